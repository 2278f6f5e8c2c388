"""`quantkit imatrix` on MLA (deepseek2) models: the file it writes quantizes the same model, in
quantkit and in ik_llama.cpp's llama-quantize, with no --exclude-weights (issue 22, item 9).

llama-quantize (ik_llama.cpp src/llama-quantize.cpp) wants ne[0] * ne[2] values for a tensor,
attn_kv_b falling back to attn_v_b's entry and back.  The three layouts MLA files come in:

* mainline's: attn_k_b [qk_nope, kv_lora, n_head], attn_v_b [kv_lora, v_head, n_head] (3-D): one
  row of sums per head, as llama-imatrix writes them;
* the fused attn_kv_b [kv_lora, n_head * (qk_nope + v_head)] only: one row, from the value rows
  (the key rows are used transposed, their input is not along the columns);
* ik_llama.cpp's converter (and quantkit's): attn_kv_b plus attn_k_b/attn_v_b stored flat in 2-D,
  [qk_nope, n_head * kv_lora] and [kv_lora, n_head * v_head]: one row each, the heads summed.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import peers
import quantkit
from models import write_deepseek2
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import load_imatrix
from quantkit.runtime import ops_cpu
from quantkit.runtime.collect import ActivationStats, ObservingOps, collect
from quantkit.runtime.model import Model

SMALL = dict(n_layer=2, n_dense=1, n_embd=64, n_ff=128, n_ff_exp=64, n_expert=4, n_expert_used=2, n_head=4,
             q_lora_rank=64, n_vocab=512)
# ik_llama.cpp loads mainline's layout only with DeepSeek's head sizes (models.write_deepseek2);
# the other layouts get head sizes where qk_nope != kv_lora, so a mix-up of the two shows
HEADS = dict(kv_lora_rank=64, qk_nope=32, qk_rope=32, v_head=32)
LAYOUTS = {"mainline": {}, "fused": dict(fused_kv_b=True, **HEADS),
           "split": dict(fused_kv_b=True, split_kv_b=True, **HEADS)}
MLA = ("attn_k_b", "attn_v_b", "attn_kv_b")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Per layout: the model and the imatrix `quantkit imatrix` writes for it, .dat and GGUF."""
    d = tmp_path_factory.mktemp("mla")
    text = d / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = {}
    for layout, kw in LAYOUTS.items():
        model = write_deepseek2(d / f"{layout}.gguf", **SMALL, **kw)
        files = {}
        for ext in ("dat", "gguf"):
            files[ext] = d / f"{layout}-imatrix.{ext}"
            quantkit.collect_imatrix(model, text, files[ext], ctx_size=32, chunks=2, threads=2)
        out[layout] = (model, files)
    return out


def mla_tensors(path):
    with open_model(path) as g:
        return {t.name: tuple(t.shape) for t in g.tensors if t.name.split(".")[-2] in MLA}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_entries_have_the_size_llama_quantize_wants(made, layout):
    model, files = made[layout]
    tensors = mla_tensors(model)
    assert tensors
    for ext, path in files.items():
        imat = load_imatrix(path)
        for name, shape in tensors.items():
            entry = imat.lookup_name(name)
            assert entry is not None, (ext, name)
            n_mat = shape[2] if len(shape) > 2 else 1
            assert imat.weights[entry].size == shape[0] * n_mat, (ext, name, shape)
            assert imat.weights_for(name, shape[0], n_mat) is not None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantkit_quantizes_with_it(made, layout, tmp_path):
    model, files = made[layout]
    for ext, path in files.items():
        out = tmp_path / f"q-{ext}.gguf"
        with quantkit.open_quantization(model, out, "q4_0", imatrix=path) as q:
            q.write()
        used = {t.name: t.imatrix for t in q.plan.tensors if t.action == "quantize"}
        assert all(used[n] for n in mla_tensors(model)), used
        assert [n for n, u in used.items() if not u] == ["token_embd.weight", "output.weight"]


@pytest.mark.skipif(not peers.llama_quantize_runs(), reason="ik-llama-cpp-python's llama-quantize not available")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ik_llama_quantize_quantizes_with_it(made, layout, tmp_path):
    """The wheel's llama-quantize reads the legacy .dat (not GGUF imatrices)."""
    model, files = made[layout]
    p = subprocess.run([str(peers.llama_quantize_bin()), "--imatrix", str(files["dat"]), str(model),
                        str(tmp_path / "q.gguf"), "Q4_0", "2"], capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert "imatrix size" not in log
    missing = [line.split()[-1] for line in log.splitlines() if "did not find weights for" in line]
    assert sorted(missing) == ["output.weight", "token_embd.weight"], log[-3000:]


def test_flat_tensor_row_is_the_sum_of_the_head_rows(tmp_path):
    """The same products observed as a 3-D tensor (one row per head) and as the flat 2-D one
    (one row): the flat row is the per-head rows summed; one count of tokens in both."""
    path = write_deepseek2(tmp_path / "split.gguf", **SMALL, **LAYOUTS["split"])
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 512, 24)]
    entries = {}
    for as_3d in (False, True):
        stats = ActivationStats()
        with open_model(path) as g:
            shapes = {t.name: tuple(t.shape) for t in g.tensors}
            if as_3d:
                for name in ("blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"):
                    ne0, ne1 = shapes[name]
                    shapes[name] = (ne0, ne1 // SMALL["n_head"], SMALL["n_head"])
            collect(Model(g, ops=ObservingOps(ops_cpu, stats, shapes)), chunks)
        entries[as_3d] = stats.entries
    for name, n_in in (("blk.0.attn_k_b.weight", HEADS["qk_nope"]), ("blk.0.attn_v_b.weight", HEADS["kv_lora_rank"])):
        flat, heads = entries[False][name], entries[True][name]
        assert flat.sums.shape == (1, n_in) and heads.sums.shape == (SMALL["n_head"], n_in)
        assert flat.counts.tolist() == heads.counts.tolist() == [24]
        np.testing.assert_allclose(flat.sums[0], heads.sums.sum(axis=0), rtol=1e-12)
    assert "blk.0.attn_kv_b.weight" not in entries[False]       # not used: attn_k_b/attn_v_b are


def test_fused_kv_b_gets_the_value_rows_inputs(made):
    """The fused file and the split one are the same model: attn_kv_b's entry of the one is
    attn_v_b's of the other (the inputs of the value rows, heads summed)."""
    fused, split = load_imatrix(made["fused"][1]["gguf"]), load_imatrix(made["split"][1]["gguf"])
    for i in range(SMALL["n_layer"]):
        np.testing.assert_allclose(fused.weights[f"blk.{i}.attn_kv_b.weight"],
                                   split.weights[f"blk.{i}.attn_v_b.weight"], rtol=1e-5)
