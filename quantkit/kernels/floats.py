"""numba kernels for float rows: float32 to BF16 (ggml's rounding), DeepSeek's FP8 blocks to BF16.

Decoding F16 and BF16 is numpy (formats/floats.py), as is the input scan before quantizing
(formats/limits.row_extent): a q8_0 quantize of a float model then needs no kernel at all.  These work
on bit patterns: ``x`` is a uint32 view of float32 rows, ``out`` a uint16 view of the bf16 bytes, all
shaped (n_rows, n_per_row).
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
