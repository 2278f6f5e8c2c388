"""`quantkit imatrix`: importance matrices collected by the runtime, against mainline llama-imatrix.

The reference files in ../shared/golden/imatrix were made by mainline `llama-imatrix -m
SmolLM2-135M-Instruct.Q4_1.gguf -f calib-gpl3.txt -c 256 --chunks 8` in both formats.  Every entry
must be present and 99% of the values (Σx²/count per column) within 2%: exact equality is not
expected, since ggml sums in float32 in its own order; with float32 activations (``--activations
exact``) only ~96% are, because mainline rounds every quantized product's input to 8 bits and the
later layers see the difference.

quantkit runs through the library (quantkit.collect_imatrix, quantize_model, perplexity,
kl_divergence) in-process.
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
from quantkit.imatrix_tools import RawImatrix
from quantkit.runtime import ops_cpu
from quantkit.runtime.collect import ActivationStats, ObservingOps, collect
from quantkit.runtime.model import Model


def agreement(ours, ref) -> float:
    """Fraction of reference values that ours matches within 2% (relative)."""
    assert set(ours.weights) == set(ref.weights)
    rel = np.concatenate([np.abs(ours.weights[n] - v) / np.maximum(np.abs(v), 1e-30) for n, v in ref.weights.items()])
    return float((rel <= 0.02).mean())


@pytest.fixture(scope="module")
def golden(shared_dir):
    return shared_dir / "golden" / "imatrix"


@pytest.fixture(scope="module")
def ours_dat(tmp_path_factory, smollm2_path, golden):
    out = tmp_path_factory.mktemp("imatrix") / "smollm2.dat"
    r = quantkit.collect_imatrix(smollm2_path, golden / "calib-gpl3.txt", out, ctx_size=256, chunks=8, threads=2)
    assert (r.file, r.chunks, r.entries, r.partial, r.warnings) == (out, 8, 210, {}, [])
    return out


def test_dat_matches_llama_imatrix(ours_dat, golden):
    ours, ref = load_imatrix(ours_dat), load_imatrix(golden / "smollm2-q4_1-gpl3.dat")
    share = agreement(ours, ref)
    print(f"\n  .dat: {100 * share:.2f}% of values within 2% of llama-imatrix's")
    assert share >= 0.99
    assert ours.format == "dat" and ours.chunk_count == ref.chunk_count == 8
    assert {n: int(c[0]) for n, c in ours.counts.items()} == {n: int(c[0]) for n, c in ref.counts.items()}


def test_gguf_matches_llama_imatrix(tmp_path, smollm2_path, golden):
    out = tmp_path / "smollm2.gguf"
    quantkit.collect_imatrix(smollm2_path, golden / "calib-gpl3.txt", out, ctx_size=256, chunks=8, threads=2)
    ours, ref = load_imatrix(out), load_imatrix(golden / "smollm2-q4_1-gpl3.gguf")
    assert ours.format == "gguf" and agreement(ours, ref) >= 0.99
    assert (ours.chunk_count, ours.chunk_size) == (ref.chunk_count, ref.chunk_size) == (8, 256)
    assert all(int(ours.counts[n][0]) == int(c[0]) == 2048 for n, c in ref.counts.items())
    # the same tensor layout as llama-imatrix's file: names, order, shapes, types
    with open_model(out) as a, open_model(golden / "smollm2-q4_1-gpl3.gguf") as b:
        assert [(t.name, t.shape, t.qtype) for t in a.tensors] == [(t.name, t.shape, t.qtype) for t in b.tensors]
        assert a.get("general.type") == "imatrix"


@pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")
def test_ik_llama_quantize_reads_our_dat(ours_dat, smollm2_path, tmp_path):
    out = tmp_path / "q.gguf"
    p = subprocess.run([str(peers.llama_quantize_bin()), "--allow-requantize", "--imatrix", str(ours_dat),
                        str(smollm2_path), str(out), "IQ4_XS", "2"], capture_output=True, text=True)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert "210 importance matrix entries" in log, log[-3000:]


def test_expert_counts_are_the_routed_tokens(tmp_path):
    """On a tiny deepseek2 (8 experts, 2 used): each expert's count is the number of tokens the
    router sent to it, tallied independently from the router's own output; experts that got no
    token are reported."""
    path = write_deepseek2(tmp_path / "ds.gguf", n_expert=8, n_expert_used=2, n_layer=3, n_dense=1, seed=3)
    routed: list[np.ndarray] = []
    real_route = ops_cpu.moe_route

    class Recording:                     # records the router's choices, then computes as usual
        def __getattr__(self, name):
            return getattr(ops_cpu, name)

        @staticmethod
        def moe_route(*a, **k):
            ids, w = real_route(*a, **k)
            routed.append(ids.copy())
            return ids, w

    stats = ActivationStats()
    with open_model(path) as g:
        shapes = {t.name: tuple(t.shape) for t in g.tensors}
        model = Model(g, ops=ObservingOps(Recording(), stats, shapes))
        rng = np.random.default_rng(0)
        chunks = [rng.integers(0, 512, 24) for _ in range(2)]
        collect(model, chunks)
    routed = [ids for ids in routed if len(ids) == 24]     # not the warm-up pass's few tokens (runtime/warmup.py)
    moe_layers = [1, 2]
    assert len(routed) == len(chunks) * len(moe_layers)
    for k, layer in enumerate(moe_layers):
        tally = sum(np.bincount(routed[c * len(moe_layers) + k].reshape(-1), minlength=8) for c in range(len(chunks)))
        for kind in ("gate", "up", "down"):
            e = stats.entries[f"blk.{layer}.ffn_{kind}_exps.weight"]
            np.testing.assert_array_equal(e.counts, tally)
            assert e.sums.shape == (8, shapes[f"blk.{layer}.ffn_{kind}_exps.weight"][0])
            assert ((e.sums.sum(axis=1) > 0) == (tally > 0)).all()
        expected = np.nonzero(tally == 0)[0].tolist()
        assert RawImatrix.from_stats(stats, 24, []).never_fired().get(f"blk.{layer}.ffn_up_exps.weight", []) == expected
    # dense and shared-expert products count every token; per-head MLA maps one row per head
    assert stats.entries["blk.0.ffn_down.weight"].counts.tolist() == [48]
    assert stats.entries["blk.1.ffn_up_shexp.weight"].counts.tolist() == [48]
    k_b = stats.entries["blk.0.attn_k_b.weight"]
    assert k_b.counts.tolist() == [48] and k_b.sums.shape[0] == 4


def test_our_imatrix_lowers_iq2_k_kl_divergence(ours_dat, smollm2_path, golden, tmp_path):
    """SmolLM2 at IQ2_K with and without the imatrix collected above: KL divergence against the F32
    model (quantkit's runtime, llama-perplexity's statistics) must drop with it."""
    f32 = tmp_path / "f32.gguf"
    quantkit.quantize_model(smollm2_path, f32, "f32", allow_requantize=True)
    base = tmp_path / "base.kld"
    text = golden / "calib-gpl3.txt"
    quantkit.perplexity(f32, text, ctx_size=256, chunks=4, kl_divergence_base=base)
    kld = {}
    for label, imatrix in (("without", None), ("with", ours_dat)):
        q = tmp_path / f"iq2_k-{label}.gguf"
        quantkit.quantize_model(f32, q, "IQ2_K", threads=2, imatrix=imatrix)
        kld[label] = quantkit.kl_divergence(q, base).summary()["kld"]["mean"][0]
    print(f"\n  IQ2_K mean KLD vs F32: {kld['without']:.4f} without imatrix, {kld['with']:.4f} with quantkit's")
    assert kld["with"] < 0.9 * kld["without"]


def test_periodic_saves_and_resume(smollm2_path, golden, tmp_path, monkeypatch):
    """--output-frequency 2 leaves a complete file after chunk 2 when the run is interrupted in
    chunk 3; --in-file that --chunk 2 finishes it with the same data as one uninterrupted run."""
    from quantkit.runtime import collect as collect_mod

    text = golden / "calib-gpl3.txt"
    common = dict(ctx_size=128, threads=2)
    whole = tmp_path / "whole.gguf"
    quantkit.collect_imatrix(smollm2_path, text, whole, chunks=4, **common)

    out = tmp_path / "run.gguf"
    real = collect_mod.ObservingOps.matmul_q
    calls = {"n": 0}
    per_chunk = 30 * 7 + 1                  # SmolLM2: 7 products per layer and the output

    def interrupt_in_chunk_3(self, w, x, fused=None):
        calls["n"] += 1
        if calls["n"] > 2 * per_chunk + 5:
            raise KeyboardInterrupt
        return real(self, w, x, fused)
    monkeypatch.setattr(collect_mod.ObservingOps, "matmul_q", interrupt_in_chunk_3)
    with pytest.raises(KeyboardInterrupt) as e:
        quantkit.collect_imatrix(smollm2_path, text, out, chunks=4, output_frequency=2, **common)
    assert (e.value.saved, e.value.n_chunks) == (2, 4)      # what the CLI's resume note is made of
    monkeypatch.setattr(collect_mod.ObservingOps, "matmul_q", real)
    saved = load_imatrix(out)
    assert all(int(c[0]) == 2 * 128 for c in saved.counts.values()) and saved.chunk_count == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []     # no temporary left

    resumed = tmp_path / "resumed.gguf"
    quantkit.collect_imatrix(smollm2_path, text, resumed, chunks=2, chunk=2, in_file=out, **common)
    a, b = load_imatrix(whole), load_imatrix(resumed)
    assert a.chunk_count == b.chunk_count == 4
    for n in a.weights:
        np.testing.assert_allclose(b.weights[n], a.weights[n], rtol=1e-5, err_msg=n)
