"""Every type the runtime computes with: its float matrix product equals dequantize-then-numpy.

The reference decodes with each format's plain-numpy twin (``reference=True``) and multiplies in
float64; the runtime reads the stored bytes through its float path (``fused=False``: tiles of
rows, interleaved row groups, expert slices of 3-D tensors; the 8-bit products a batch takes by
default are checked against the fused kernel in test_runtime_matvec).  Weights are real quantizer output of random rows, so scales
are what files hold.
"""
from __future__ import annotations

import numpy as np
import pytest

from quantkit import formats
from quantkit.runtime import ops_cpu
from quantkit.runtime.weights import Weight
from quantkit.types import QuantType, traits, type_name

N_PER_ROW = 512
N_ROWS = 32                 # a multiple of every interleave group (4, 8, 16)


def _types():
    out = []
    for qt, fmt in sorted(formats.registered().items(), key=lambda kv: int(kv[0])):
        if any(f == "ik" for f, _ in fmt.quant_paths) and N_PER_ROW % traits(qt).block_size == 0:
            out.append(qt)
    return out


TYPES = _types()


def quantized_rows(qtype, n_rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_rows, N_PER_ROW)) * rng.uniform(0.01, 1.0, (n_rows, 1))).astype(np.float32)
    paths = formats.registered()[qtype].quant_paths
    imatrix = None if ("ik", False) in paths else rng.uniform(0.5, 2.0, N_PER_ROW).astype(np.float32)
    return formats.quantize(x, qtype, imatrix, "ik")


def reference_product(blocks: np.ndarray, qtype, x: np.ndarray) -> np.ndarray:
    w = formats.dequantize(blocks, qtype, N_PER_ROW, reference=True).astype(np.float64)
    return x.astype(np.float64) @ w.T


def test_every_implemented_type_is_covered():
    names = {type_name(t) for t in TYPES}
    for must in ("q8_0", "q4_K", "iq4_k", "iq2_k_r4", "q8_0_r8", "iq2_kt", "bf16", "f16"):
        assert must in names, must


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: type_name(t))
def test_matmul_equals_dequantize_then_numpy(qtype):
    blocks = quantized_rows(qtype, N_ROWS, seed=int(qtype))
    w = Weight("w", QuantType(qtype), (N_PER_ROW, N_ROWS), blocks)
    x = np.random.default_rng(1).standard_normal((5, N_PER_ROW)).astype(np.float32)
    if qtype == QuantType.F16:           # ggml's f16 product rounds the activations to f16 first
        x = x.astype(np.float16).astype(np.float32)
    ref = reference_product(blocks, qtype, x)
    got = ops_cpu.matmul_q(w, x, fused=False)
    assert got.shape == (5, N_ROWS) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.IQ2_K_R4, QuantType.Q8_0_R8],
                         ids=lambda t: type_name(t))
def test_expert_slices_and_tiles(qtype, monkeypatch):
    """A 3-D expert tensor: each expert's product reads its own rows; small tiles change nothing."""
    n_expert = 3
    blocks = quantized_rows(qtype, N_ROWS * n_expert, seed=7)
    w = Weight("exps", QuantType(qtype), (N_PER_ROW, N_ROWS, n_expert), blocks)
    # a batch (the tile path; generation's fused products: test_runtime_matvec.py)
    x = np.random.default_rng(2).standard_normal((ops_cpu.FUSED_TOKENS + 1, N_PER_ROW)).astype(np.float32)
    monkeypatch.setattr(ops_cpu, "TILE_VALUES", N_PER_ROW * 8)     # several tiles per matrix
    for e in range(n_expert):
        ref = reference_product(blocks[e * N_ROWS:(e + 1) * N_ROWS], qtype, x)
        np.testing.assert_allclose(ops_cpu.matmul_q(w.expert(e), x, fused=False), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_embedding_rows_of_an_interleaved_type():
    """get_rows on an interleaved tensor decodes the row's group and picks the row out of it; a
    batch's ids (split between the tile pool's threads) likewise."""
    qtype = QuantType.IQ4_K_R4
    blocks = quantized_rows(qtype, N_ROWS, seed=3)
    w = Weight("token_embd.weight", qtype, (N_PER_ROW, N_ROWS), blocks)
    for ids in (np.array([0, 5, 31, 6, 6]), np.array([0, 5, 31, 6, 6, 30, 1, 2, 9, 17, 4, 4, 3, 11, 29, 8, 0])):
        ref = formats.dequantize(blocks, qtype, N_PER_ROW, reference=True)[ids]
        np.testing.assert_array_equal(ops_cpu.embed(w, ids), ref)


def test_f16_rounding_equals_numpys_cast():
    """The runtime's bit-level float16 rounding == numpy's float32 -> float16 -> float32 cast, bit for
    bit, over normal, subnormal, tie, overflow and special values."""
    rng = np.random.default_rng(0)
    scales = (1e-8, 1e-6, 3e-5, 6e-5, 1e-3, 1.0, 100.0, 6e4)
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * np.float32(s) for s in scales]
                       + [np.array([0.0, -0.0, 65504, 65519.99, 65520, -7e4, np.inf, -np.inf, np.nan, 2.0 ** -14,
                                    2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11],
                                   np.float32)])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    got = ops_cpu._f16_round(x)
    same = (ref.view(np.uint32) == got.view(np.uint32)) | (np.isnan(ref) & np.isnan(got))
    assert same.all(), x[~same][:5]


def test_interleaved_rows_are_regrouped_once(monkeypatch):
    """A batch product of an interleaved type regroups the tensor's rows once (kept beside the
    file's bytes, as generation's kernels read them), not once per tile and product."""
    from quantkit.formats import interleave
    qtype = QuantType.Q4_0_R8
    blocks = quantized_rows(qtype, N_ROWS, seed=5)
    w = Weight("w", qtype, (N_PER_ROW, N_ROWS), blocks)
    x = np.random.default_rng(4).standard_normal((ops_cpu.FUSED_TOKENS + 1, N_PER_ROW)).astype(np.float32)
    ref = reference_product(blocks, qtype, x)
    calls = []
    deinterleave = interleave.deinterleave
    monkeypatch.setattr(interleave, "deinterleave", lambda *a, **k: calls.append(1) or deinterleave(*a, **k))
    monkeypatch.setattr(ops_cpu, "TILE_VALUES", N_PER_ROW * 8)     # several tiles per product
    for _ in range(2):
        np.testing.assert_allclose(ops_cpu.matmul_q(w, x, fused=False), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert len(calls) == 1
