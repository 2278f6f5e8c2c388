"""numba kernels for BF16 rows (F32 and F16 are plain numpy casts).

Both work on bit patterns: ``x`` / ``out`` are uint32 views of float32 rows, ``b`` / ``out`` uint16
views of the bf16 bytes, all shaped (n_rows, n_per_row).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True, nogil=True)
def fp32_to_bf16_rows(x, out):
    """ggml_compute_fp32_to_bf16 per element: quiet NaNs, otherwise round to nearest even."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        for i in range(n):
            u = np.uint32(x[r, i])
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out[r, i] = np.uint16((u >> np.uint32(16)) | np.uint32(64))
            else:
                # the rounding carry may run into the exponent (up to Inf); no uint32 overflow is
                # possible since u <= 0xFF7FFFFF here
                v = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
                out[r, i] = np.uint16(v >> np.uint32(16))


@njit(cache=True, parallel=True, nogil=True)
def bf16_to_fp32_rows(b, out):
    n_rows, n = b.shape
    for r in prange(n_rows):
        for i in range(n):
            out[r, i] = np.uint32(b[r, i]) << np.uint32(16)


@njit(cache=True, parallel=True, nogil=True)
def f16_to_fp32_rows(h, lut, out):
    """F16 bit patterns to float32 through a 65536-entry table (exact, NaN payloads included)."""
    n_rows, n = h.shape
    for r in prange(n_rows):
        for i in range(n):
            out[r, i] = lut[h[r, i]]


@njit(cache=True, parallel=True, nogil=True)
def fp8_blocks_to_bf16_rows(q, scale, row_index, table, out):
    """DeepSeek's block-scaled float8 to bf16: out[r, c] = bf16(table[q[r, c]] * scale[row_index[r]
    // 128, c // 128]), the product in float32 and rounded to nearest even (NaN stays a quiet NaN).
    ``table``: the 256 float8_e4m3fn values as float32; numpy twin: hf.numerics.fp8_block_rows."""
    n_rows, n = q.shape
    for r in prange(n_rows):
        srow = row_index[r] // 128
        prod = np.empty(n, np.float32)
        for c in range(n):
            prod[c] = table[q[r, c]] * scale[srow, c // 128]
        u32 = prod.view(np.uint32)
        for c in range(n):
            u = u32[c]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out[r, c] = np.uint16((u >> np.uint32(16)) | np.uint32(64))
            else:
                out[r, c] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, parallel=True, nogil=True)
def row_extent(x, qw, has_qw, out):
    """Per float32 row of ``x`` (n_rows, n), in one pass: ``out[r, 0]`` = max |x| (+inf when the
    row holds a NaN or an infinity), ``out[r, 1]`` = max |x|·qw (0 without ``has_qw``).

    What the quantizer's input checks need (quantize.quantize_rows, formats/limits.py), without the
    |x| copy and the separate isfinite pass numpy would make.  ``a - a`` is 0 for a finite value
    and NaN for NaN or inf, so the NaN test is one sum a row (it vectorizes; a branch would not)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        big = np.float32(0)
        prod = np.float32(0)
        nan = np.float32(0)
        for i in range(n):
            a = abs(x[r, i])
            nan += a - a
            big = max(big, a)
            if has_qw:
                prod = max(prod, a * qw[i])
        out[r, 0] = big if nan == 0 else np.inf
        out[r, 1] = prod
