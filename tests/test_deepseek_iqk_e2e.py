"""IQK recipes on a DeepSeek-shaped model (MLA + MoE, 3-D expert tensors), end to end.

A tiny deepseek2 model with random weights and a per-expert importance matrix (legacy .dat, the
format ik_llama.cpp reads) is quantized by quantkit and by the wheel's llama-quantize with the same
recipe:

* the DeepSeek-V3 recipe of recipes/deepseek-v3-iq2_k_r4.txt with the ``_r4`` suffixes dropped
  (iq2_k/iq3_k routed experts, q8_0 elsewhere): both files load in ik_llama.cpp, and over a few
  hundred tokens quantkit's logits are as close to the F32 model's (mean KL divergence) as the C
  tool's, within 5%.  The wheel is an FMA build, so a few rows round differently; quality must not
  differ;
* a recipe that puts every IQK type quantkit writes (the trellis IQ*_KT too) on some tensor: the files hold the same types, every tensor
  equals formats.quantize of its rows with the matching imatrix slice (expert by expert), and the
  file loads and computes in ik_llama.cpp.
"""
from __future__ import annotations

import subprocess

import gguf
import numpy as np
import pytest

import peers
import quantkit
from models import write_deepseek2
from quantkit import formats
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import load_imatrix, save_dat
from quantkit.recipes import load_recipe
from quantkit.types import type_from_name

pytestmark = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

N_TOKENS = 250
# every IQK type on a tensor whose rows suit it; first match wins
ALL_IQK_RECIPE = """
blk\\.3\\.ffn_gate_exps=iq2_k
blk\\.3\\.ffn_up_exps=iq2_ks
blk\\.3\\.ffn_down_exps=iq3_k
blk\\.4\\.ffn_gate_exps=iq4_k
blk\\.4\\.ffn_up_exps=iq5_k
blk\\.4\\.ffn_down_exps=iq6_k
blk\\.0\\.ffn_gate=iq4_ks
blk\\.0\\.ffn_up=iq5_ks
blk\\.1\\.ffn_gate=iq3_ks
blk\\.1\\.ffn_up=iq4_kss
blk\\.2\\.ffn_gate=iq2_kl
blk\\.2\\.ffn_up=iq1_kt
blk\\.2\\.ffn_down=iq2_kt
blk\\.1\\.ffn_down=iq3_kt
blk\\.0\\.ffn_down=iq4_kt
blk\\..*\\.attn_k_b=q6_0
blk\\..*\\.attn_output=iq4_k
"""


def read_tensors(path) -> dict[str, tuple[int, tuple, np.ndarray]]:
    """name -> (type id, shape, raw bytes); gguf-py's reader does not know ik's types."""
    with open_model(path) as m:
        return {t.name: (int(t.qtype), tuple(t.shape), t.source.read(t.offset, t.nbytes)) for t in m.tensors}


def llama_quantize(*args):
    p = subprocess.run([str(peers.llama_quantize_bin()), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def mean_kld(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), in float64."""
    def log_softmax(z):
        z = z.astype(np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds-iqk")
    f32 = write_deepseek2(d / "f32.gguf", n_layer=5, n_dense=3, n_expert=4, n_expert_used=2, seed=3)
    rng = np.random.default_rng(4)
    weights = {}
    for t in gguf.GGUFReader(str(f32)).tensors:
        if len(t.shape) >= 2 and t.name != "token_embd.weight":
            n_per_row = int(t.shape[0])
            n_mat = int(t.shape[2]) if len(t.shape) > 2 else 1
            w = (rng.random((n_mat, n_per_row)) ** 3 * 10).astype(np.float32)
            w[:, 16:32] = 0                 # a block the calibration never saw
            weights[t.name] = w.reshape(-1)
    imatrix = save_dat(d / "imatrix.dat", weights, ncall=5, chunk_count=5, dataset="random")
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, 512, N_TOKENS)]
    return d, f32, imatrix, weights, tokens, peers.ik_logits(f32, tokens, all_positions=True)


def both_tools(d, f32, imatrix, recipe_text: str, tag: str):
    recipe = d / f"{tag}.txt"
    recipe.write_text(recipe_text)
    ours, theirs = d / f"{tag}-ours.gguf", d / f"{tag}-theirs.gguf"
    quantkit.quantize_model(f32, ours, "q8_0", custom_q=recipe, imatrix=imatrix, threads=2)
    inline = ",".join(load_recipe([str(recipe)]).text.splitlines())
    llama_quantize("--imatrix", imatrix, "--custom-q", inline, f32, theirs, "Q8_0", "2")
    return ours, theirs


def test_deepseek_v3_recipe_quality_matches_llama_quantize(model, repo_root, capsys):
    d, f32, imatrix, _, tokens, ref = model
    text = (repo_root / "recipes" / "deepseek-v3-iq2_k_r4.txt").read_text().replace("_r4", "")
    ours, theirs = both_tools(d, f32, imatrix, text, "v3")
    types_ours = {k: v[0] for k, v in read_tensors(ours).items()}
    types_theirs = {k: v[0] for k, v in read_tensors(theirs).items()}
    assert types_ours == types_theirs
    assert types_ours["blk.4.ffn_gate_exps.weight"] == 137 and types_ours["blk.3.ffn_down_exps.weight"] == 138
    lo = peers.ik_logits(ours, tokens, all_positions=True)
    lt = peers.ik_logits(theirs, tokens, all_positions=True)
    assert np.isfinite(lo).all()
    kl_ours, kl_theirs = mean_kld(ref, lo), mean_kld(ref, lt)
    with capsys.disabled():
        print(f"\n  DeepSeek-shaped model, {N_TOKENS} tokens, mean KLD vs F32: quantkit {kl_ours:.3e}, "
              f"llama-quantize {kl_theirs:.3e} (ratio {kl_ours / kl_theirs:.3f})")
    assert 0 < kl_ours <= 1.05 * kl_theirs


def test_every_iqk_type_end_to_end(model):
    d, f32, imatrix, _, tokens, ref = model
    ours, theirs = both_tools(d, f32, imatrix, ALL_IQK_RECIPE, "all")
    src = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    loaded = load_imatrix(imatrix).weights       # what the tools use: stored values / ncall
    mine = read_tensors(ours)
    assert {n: v[0] for n, v in mine.items()} == {n: v[0] for n, v in read_tensors(theirs).items()}
    wanted = {type_from_name(line.split("=")[1]) for line in ALL_IQK_RECIPE.split()}
    assert wanted <= {v[0] for v in mine.values()}
    for name, (qtype, shape, raw) in mine.items():
        if qtype not in wanted:
            continue
        n_per_row = shape[0]
        x = np.asarray(src[name].data, dtype=np.float32).reshape(-1, n_per_row)
        n_mat = shape[2] if len(shape) > 2 else 1
        w = loaded[name].reshape(n_mat, n_per_row)
        rows = x.shape[0] // n_mat
        got = raw.reshape(x.shape[0], -1)
        for e in range(n_mat):          # expert by expert, each with its own imatrix slice
            want = formats.quantize(x[e * rows:(e + 1) * rows], qtype, w[e])
            np.testing.assert_array_equal(got[e * rows:(e + 1) * rows], want, err_msg=f"{name} expert {e}")
    lo = peers.ik_logits(ours, tokens, all_positions=True)
    assert np.isfinite(lo).all()
    assert mean_kld(ref, lo) < 0.1


def test_deepseek_v3_recipe_with_interleaved_experts(model, repo_root):
    """The recipe as published (iq2_k_r4/iq3_k_r4 routed experts): same types as llama-quantize's
    file, loads and computes in ik_llama.cpp, as close to F32 as llama-quantize's."""
    d, f32, imatrix, _, tokens, ref = model
    text = (repo_root / "recipes" / "deepseek-v3-iq2_k_r4.txt").read_text()
    ours, theirs = both_tools(d, f32, imatrix, text, "v3r4")
    a, b = read_tensors(ours), read_tensors(theirs)
    assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in b.items()}
    assert a["blk.4.ffn_gate_exps.weight"][0] == 337 and a["blk.3.ffn_down_exps.weight"][0] == 338
    lo = peers.ik_logits(ours, tokens, all_positions=True)
    lt = peers.ik_logits(theirs, tokens, all_positions=True)
    assert np.isfinite(lo).all()
    assert mean_kld(ref, lo) <= 1.05 * mean_kld(ref, lt)
