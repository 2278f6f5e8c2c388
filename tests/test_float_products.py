"""A batch's 8-bit products (the default) and ``--float-products``, through the library and the CLI.

A prompt multiplies with activations rounded to 8 bits, token for token the bits of a generation
step (runtime/matmul8.py; kernel checks in test_runtime_matvec.py), so the logits of a prompt's
positions are those its tokens get one step at a time; ``--float-products`` (run, perplexity;
``float_products=True`` in the library) multiplies a batch in float32 instead.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import quantkit
from hostile import assert_refused
from models import write_llama
from quantkit.cli import main
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
from quantkit.runtime.model import Model

TOKENS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64]


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    d = tmp_path_factory.mktemp("float-products")
    src = write_llama(d / "f32.gguf", n_layer=1, vocab=True)
    out = d / "q8_0.gguf"
    quantkit.quantize_model(src, out, "q8_0")
    return out


def _logits(path, ops, steps: bool) -> np.ndarray:
    with open_model(path) as g:
        m = Model(g, ops)
        cache = m.new_cache(len(TOKENS))
        if steps:
            return np.concatenate([m.forward([t], cache) for t in TOKENS])
        return m.forward(TOKENS, cache)


def test_a_prompt_computes_what_its_steps_do(q8):
    """8-bit batches: the prompt's logits are its steps' (the products are the same bits; only the
    attention of a batch may round differently); float products: further from them."""
    steps = _logits(q8, ops_cpu, steps=True)
    batch = _logits(q8, ops_cpu, steps=False)
    floats = _logits(q8, ops_cpu.float_products, steps=False)
    scale = np.abs(steps).max()
    to_batch, to_floats = np.abs(batch - steps).max() / scale, np.abs(floats - steps).max() / scale
    print(f"\n  steps vs 8-bit batch {to_batch:.1e}, vs float batch {to_floats:.1e}")
    assert to_batch <= 1e-5 < to_floats, (to_batch, to_floats)
    # the last position alone (what run samples from) is the batch's kind of product
    with open_model(q8) as g:
        m = Model(g, ops_cpu)
        last = m.forward(TOKENS, m.new_cache(len(TOKENS)), logits_from=len(TOKENS) - 1)
    np.testing.assert_array_equal(last, batch[-1:])


def test_the_cli_flag_reaches_the_backend(q8, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello world, the quick brown fox jumps over the lazy dog " * 8)
    ppl = {}
    for flag in ((), ("--float-products",)):
        capsys.readouterr()
        assert main(["perplexity", str(q8), "-f", str(text), "-c", "32", "--chunks", "1", "--json", *flag]) == 0
        ppl[flag] = json.loads(capsys.readouterr().out)["ppl"]
    assert ppl[()] != ppl[("--float-products",)] and abs(ppl[()] / ppl[("--float-products",)] - 1) < 0.05, ppl
    assert main(["run", str(q8), "-p", "the quick brown fox", "-n", "2", "--temp", "0", "--float-products",
                 "--json"]) == 0
    capsys.readouterr()
    rc = main(["run", str(q8), "-p", "hi", "-n", "1", "--device", "torch-cpu", "--float-products"])
    out, err = capsys.readouterr()
    assert_refused(rc, out, err, "--float-products", "--device torch-cpu")
