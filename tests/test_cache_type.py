"""The KV cache type, llama.cpp's -ctk/-ctv (--cache-type-k/--cache-type-v): f16, the default, keeps
today's numbers (the cache in float16, the query and the probabilities rounded to f16, as ggml
multiplies an f16 cache); f32 multiplies in float32, rounding nothing.  Both backends, the KV and
the MLA cache, each attention path (a generation step's kernel, the batch's BLAS blocks, DSA's kept
keys); the library's and the CLI's option, and its refusals.  The architectures' comparisons with
transformers on the f32 cache are in tests/test_arch_*.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import runtime_twins as ref
from hostile import Snapshot, assert_refused
from models import write_deepseek2, write_llama
from quantkit.cli import _imatrix_resume, main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
from quantkit.runtime.cache_type import cache_types
from quantkit.runtime.model import Model

F32 = np.float32
LLAMA = dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, vocab=True)
MLA = dict(n_layer=2, n_dense=1, n_embd=64, n_ff=64, n_ff_exp=32, n_head=2, q_lora_rank=32, kv_lora_rank=32,
           qk_nope=16, qk_rope=8, v_head=16, n_vocab=64)
TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods " * 20


def backends():
    torch = pytest.importorskip("torch")
    from quantkit.runtime.ops_torch import TorchOps
    return {"numba": ops_cpu, "torch": TorchOps(torch.device("cpu"))}


def dense(q, k, v, pos0, scale, round_q=False, round_p=False, keep=None):
    """Causal attention of q (n_tok, n_head, d) against every head's keys/values (n_kv, n_head_kv, .)
    in float64, with the f16 roundings an f16 K (the query) or V (the probabilities) cache brings."""
    n_tok, n_head, _ = q.shape
    g = n_head // k.shape[1]
    qq = ref.f16_round(q) if round_q else q
    out = np.empty((n_tok, n_head, v.shape[2]))
    for h in range(n_head):
        s = (qq[:, h].astype(np.float64) @ k[:, h // g].T) * scale
        seen = np.arange(k.shape[0])[None, :] <= (pos0 + np.arange(n_tok))[:, None]
        if keep is not None:
            seen &= keep
        s = np.where(seen, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p = p / p.sum(axis=1, keepdims=True)
        out[:, h] = (ref.f16_round(p.astype(F32)) if round_p else p) @ v[:, h // g]
    return out


def filled_kv(ops, pos0, n_tok, n_head_kv, k_dim, v_dim, k_type, v_type, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((pos0 + n_tok, n_head_kv, k_dim)).astype(F32)
    v = rng.standard_normal((pos0 + n_tok, n_head_kv, v_dim)).astype(F32)
    cache = ops.KVCache(1, pos0 + n_tok, n_head_kv, k_dim, v_dim, k_type, v_type)
    cache.store(0, 0, ops.from_host(k), ops.from_host(v))
    as_stored = lambda x, t: x.astype(np.float16).astype(np.float64) if t == "f16" else x.astype(np.float64)
    return cache, as_stored(k, k_type), as_stored(v, v_type)


# ---- the attention paths ----

# (n_head, n_head_kv, pos0, n_tok): a batch (BLAS blocks), generation steps (the few-token kernel)
SHAPES = [(6, 2, 0, 150), (4, 4, 7, 3), (8, 1, 20, 1)]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("n_head,n_head_kv,pos0,n_tok", SHAPES)
@pytest.mark.parametrize("k_type,v_type", [("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16")])
def test_attention_rounds_what_the_cache_type_says(backend, n_head, n_head_kv, pos0, n_tok, k_type, v_type):
    """An f32 K cache multiplies the query as it is, an f32 V cache the probabilities as they are;
    f16 rounds them (today's numbers).  Measured against float64 with only those roundings."""
    ops = backends()[backend]
    k_dim, v_dim = 16, 8
    cache, k, v = filled_kv(ops, pos0, n_tok, n_head_kv, k_dim, v_dim, k_type, v_type, seed=n_head + pos0)
    q = np.random.default_rng(1).standard_normal((n_tok, n_head, k_dim)).astype(F32)
    got = ops.host(ops.attention(ops.from_host(q), cache, 0, pos0, 0.25)).reshape(n_tok, n_head, v_dim)
    expect = dense(q, k, v, pos0, 0.25, round_q=k_type == "f16", round_p=v_type == "f16")
    if v_type == "f32":
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    else:       # a last-bit difference in a score can move a probability's f16 rounding (2^-11)
        np.testing.assert_allclose(got, expect, rtol=1e-3, atol=2e-4)
    if k_type == v_type == "f32":
        # and the f16 rounding is really gone: the f16 formula is further off than float error
        assert np.abs(dense(q, k, v, pos0, 0.25, True, True) - expect).max() > 20 * np.abs(got - expect).max()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("pos0,n_tok,with_keep", [(5, 2, False), (0, 70, False), (3, 20, True)])
def test_mla_cache_f32(backend, pos0, n_tok, with_keep):
    """The MLA cache in float32: its rows (roped key part, then the latent that is also the value)
    multiplied unrounded, in a generation step, a batch, and over DSA's kept keys."""
    ops = backends()[backend]
    n_rot, lora, n_head, n_kv = 8, 32, 4, pos0 + n_tok
    rng = np.random.default_rng(pos0)
    k_rope = rng.standard_normal((n_kv, 1, n_rot)).astype(F32)
    kv = rng.standard_normal((n_kv, lora)).astype(F32)
    cache = ops.MLACache(1, n_kv, n_rot, lora, cache_type="f32")
    cache.store(0, 0, ops.from_host(k_rope), ops.from_host(kv))
    q_rope = rng.standard_normal((n_tok, n_head, n_rot)).astype(F32)
    q_lat = rng.standard_normal((n_tok, n_head, lora)).astype(F32)
    keep = rng.random((n_tok, n_kv)) < 0.5 if with_keep else None
    if keep is not None:
        keep[:, 0] = True                   # every query keeps a key it sees
    got = ops.host(ops.attention_mla(ops.from_host(q_rope), ops.from_host(q_lat), cache, 0, pos0, 0.2,
                                     keep=None if keep is None else (keep if backend == "numba" else
                                                                     ops.from_host(keep.astype(F32)).bool())))
    keys = np.concatenate([k_rope[:, 0], kv], axis=1)[:, None].astype(np.float64)
    expect = dense(np.concatenate([q_rope, q_lat], axis=-1), keys, kv[:, None].astype(np.float64), pos0, 0.2,
                   keep=keep)
    np.testing.assert_allclose(got.reshape(expect.shape), expect, rtol=1e-5, atol=1e-5)


# ---- the library: the default, the option, the refusals ----

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache-type")
    (d / "text.txt").write_text(TEXT)
    return {"llama": write_llama(d / "llama.gguf", **LLAMA), "mla": write_deepseek2(d / "mla.gguf", **MLA),
            "text": d / "text.txt", "dir": d}


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_f16_is_the_default_and_f32_changes_only_the_rounding(files, arch):
    tokens = list(range(1, 40))
    for name, ops in backends().items():
        with open_model(files[arch]) as g:
            default, f16, f32 = Model(g, ops), Model(g, ops, cache_type="f16"), Model(g, ops, cache_type="f32")
            assert default.cache_type == ("f16", "f16") and f32.cache_type == ("f32", "f32")
            c16, c32 = default.new_cache(8), f32.new_cache(8)
            assert str(c16.k.dtype).endswith("float16") and str(c16.v.dtype).endswith("float16"), name
            assert str(c32.k.dtype).endswith("float32") and str(c32.v.dtype).endswith("float32"), name
            logits = [m.forward(tokens, m.new_cache(len(tokens))) for m in (default, f16, f32)]
            # one token at a time: the generation-step kernels
            step = [np.concatenate([m.forward([t], cache) for t in tokens[:6]])
                    for m in (default, f32) for cache in [m.new_cache(6)]]
        assert np.array_equal(logits[0], logits[1]), name
        assert 0 < np.abs(logits[2] - logits[0]).max() < 1e-2 * np.abs(logits[0]).max(), name
        np.testing.assert_allclose(step[1], logits[2][:6], rtol=0, atol=1e-4 * np.abs(logits[2]).max())
        assert not np.array_equal(step[0], step[1]), name


def test_cache_types_are_checked():
    assert cache_types() == ("f16", "f16") and cache_types("f32") == ("f32", "f32")
    assert cache_types(("f32", "f16")) == ("f32", "f16")
    for bad in ("q8_0", ("f16", "bf16"), "F32"):
        with pytest.raises(QuantkitError, match="supported: f16, f32"):
            cache_types(bad)
    with pytest.raises(QuantkitError, match="K and V cache types must be the same"):
        cache_types(("f32", "f16"), mla=True)


def test_mla_refuses_different_k_and_v_types(files):
    with open_model(files["mla"]) as g:
        with pytest.raises(QuantkitError, match="MLA cache keeps K and V in one row"):
            Model(g, ops_cpu, cache_type=("f16", "f32"))
    with open_model(files["llama"]) as g:            # a KV cache keeps them apart
        assert Model(g, ops_cpu, cache_type=("f16", "f32")).new_cache(4).v.dtype == np.float32


# ---- the CLI ----

def run_main(capsys, *args):
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_perplexity_takes_the_options(files, capsys):
    import quantkit
    args = ("perplexity", files["llama"], "-f", files["text"], "-c", "32", "--chunks", "2", "--json")
    rc, out, _ = run_main(capsys, *args, "-ctk", "f32", "--cache-type-v", "f32")
    assert rc == 0
    res = quantkit.perplexity(files["llama"], files["text"], ctx_size=32, chunks=2, cache_type="f32")
    default = quantkit.perplexity(files["llama"], files["text"], ctx_size=32, chunks=2)
    assert json.loads(out)["chunk_ppl"] == res.chunk_ppl != default.chunk_ppl
    rc, out, _ = run_main(capsys, *args, "-ctk", "f16", "-ctv", "f16")
    assert rc == 0 and json.loads(out)["chunk_ppl"] == default.chunk_ppl


@pytest.mark.parametrize("cmd", ["perplexity", "run", "imatrix"])
@pytest.mark.parametrize("flag,value", [("-ctk", "q8_0"), ("--cache-type-v", "bf16"), ("-ctv", "[red]x")])
def test_the_commands_refuse_other_types(files, capsys, cmd, flag, value):
    out_path = files["dir"] / "never.imatrix"
    args = {"perplexity": ("perplexity", files["llama"], "-f", files["text"], "-c", "32"),
            "run": ("run", files["llama"], "-p", "the quick", "-n", "2"),
            "imatrix": ("imatrix", files["llama"], "-f", files["text"], "-c", "32", "-o", out_path)}[cmd]
    snap = Snapshot(files["dir"])
    rc, out, err = run_main(capsys, *args, flag, value)
    line = assert_refused(rc, out, err, "f16, f32", value)
    assert ("K cache" if flag == "-ctk" else "V cache") in line
    snap.assert_unchanged()


def test_mla_model_refuses_mixed_types(files, capsys):
    rc, out, err = run_main(capsys, "perplexity", files["mla"], "-f", files["text"], "-c", "16", "--chunks", "1",
                            "-ctk", "f32", "-ctv", "f16")
    assert_refused(rc, out, err, "K and V cache types must be the same")


def test_run_and_imatrix_take_the_options(files, capsys, tmp_path):
    import quantkit
    rc, out, err = run_main(capsys, "run", files["llama"], "-p", "the quick", "-n", "3", "--temp", "0", "-ctk", "f32",
                            "-ctv", "f32", "--json")
    assert rc == 0, err
    assert json.loads(out)["text"] == quantkit.generate(files["llama"], "the quick", n_predict=3, temp=0,
                                                        cache_type="f32").text
    rc, out, err = run_main(capsys, "imatrix", files["llama"], "-f", files["text"], "-c", "32", "--chunks", "1",
                            "-o", tmp_path / "f32.imatrix", "-ctk", "f32", "-ctv", "f32")
    assert rc == 0 and (tmp_path / "f32.imatrix").is_file(), err


def test_imatrix_resume_command_keeps_the_cache_types(files):
    o = dict(model_path=files["llama"], text_path=files["text"], ctx_size=32, chunks=None, skip=2,
             process_output=False, output_frequency=1, activations="mainline", partial_experts="keep", threads=None,
             device="cpu", overrides=(), cache_type=("f32", "f16"))
    note = _imatrix_resume(files["dir"] / "x.imatrix", 2, 1, 4, o)
    assert "-ctk f32" in note and "-ctv" not in note
