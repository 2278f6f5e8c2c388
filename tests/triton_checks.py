"""What the Triton kernel tests share (tests/test_triton_qmm.py, test_triton_qmm_iq.py).

Importing this module turns on Triton's CPU interpreter (TRITON_INTERPRET=1) unless the variable is
already set, so the kernels run where there is no GPU.  Triton reads the variable when its
``@triton.jit`` decorators run, which is when quantkit.runtime.triton_qmm first loads its kernel
modules (lazily: on the first supports / qdecode / qmatmul call).  A test module imports this at
collection, before any test runs, in every pytest-xdist worker, so no kernel module can have been
loaded without it.  Set TRITON_INTERPRET=0 on a GPU machine to check the compiled kernels instead.

    triton_torch()            -> torch, or the module is skipped where triton or torch is missing
    check_rows(qtype, w, n)   qdecode bit-exact against formats.dequantize; qmatmul close to
                              formats.dequantize(w) @ x on a few tokens (per-token kernel) and on a
                              batch (tl.dot kernel)
    check_type(qtype, ...)    check_rows on quantkit's quantization of awkward rows
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from quantkit import formats
from quantkit.types import QuantType as T

os.environ.setdefault("TRITON_INTERPRET", "1")

FLOATS = (T.F16, T.BF16)


def triton_torch():
    pytest.importorskip("triton")
    return pytest.importorskip("torch")


def awkward_rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    """Rows with an all-zero row, a tiny one, a huge one and scattered zeros (as
    test_runtime_torch's)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    x[0] = 0
    x[1] *= np.float32(1e-7)
    x[2] *= np.float32(3e3)
    x[3, ::7] = 0
    return x


def stored_rows(x: np.ndarray, qtype) -> np.ndarray:
    """x in qtype's stored layout, uint8 (n_rows, row_bytes): quantkit's quantizer (ik flavor,
    an imatrix where the type needs one), or the float bits."""
    if qtype == T.F16:
        return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], -1)
    if qtype == T.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(x.shape[0], -1)
    imatrix = None if formats.can_quantize(qtype, "ik", False) else np.linspace(0.1, 4, x.shape[1], dtype=np.float32)
    return formats.quantize(x, qtype, imatrix, "ik")


def check_type(qtype, n_rows: int = 5, n_per_row: int = 256, seed: int = 0) -> None:
    """check_rows on quantkit's own quantization of awkward rows (n_rows: not a multiple of the
    kernels' row tile, so the clamped tail is exercised)."""
    triton_torch()
    check_rows(qtype, stored_rows(awkward_rows(n_rows, n_per_row, int(qtype)), qtype), n_per_row, seed)


def check_rows(qtype, w: np.ndarray, n_per_row: int, seed: int = 0, reference: bool = False) -> np.ndarray:
    """qdecode of the stored rows ``w`` equals formats.dequantize (its reference decoder with
    ``reference``) bit for bit; qmatmul on 3 tokens (the per-token kernel), 12 (tl.dot) and 20
    (decoded tiles and a matmul, above FUSED_BATCH) agrees with the decoded rows' float32 product
    to summation-order tolerance.  Returns the decoded rows."""
    torch = triton_torch()
    from quantkit.runtime import triton_qmm
    assert triton_qmm.available() and triton_qmm.supports(qtype)
    expect = formats.dequantize(w, qtype, n_per_row, reference=reference)
    got = triton_qmm.qdecode(torch.from_numpy(w), qtype, n_per_row).numpy()
    assert got.shape == expect.shape
    bad = np.flatnonzero(got.view(np.uint32) != expect.view(np.uint32))
    assert bad.size == 0, f"{bad.size} values differ, first at {np.unravel_index(bad[0], got.shape)}: " \
                          f"{got.flat[bad[0]]} != {expect.flat[bad[0]]}"
    rng = np.random.default_rng(seed)
    scale = float(np.abs(expect).sum(1).max())
    assert 3 <= triton_qmm.FEW_TOKENS < 12 <= triton_qmm.FUSED_BATCH < 20      # each path once
    for n_tokens in (3, 12, 20):
        x = rng.standard_normal((n_tokens, n_per_row)).astype(np.float32)
        ref = x.astype(np.float64) @ expect.T.astype(np.float64)
        y = triton_qmm.qmatmul(torch.from_numpy(x), torch.from_numpy(w), qtype).numpy()
        assert y.shape == ref.shape and y.dtype == np.float32
        # float32 sums of n_per_row products of |x| < ~5: a few ulps of the largest |row| sum
        np.testing.assert_allclose(y, ref, rtol=0, atol=4e-6 * 5 * scale + 1e-30)
    return expect
