"""numba kernels for MXFP4 (the quantizer and decoder of :mod:`quantkit.formats.mxfp4`).

A block of 32 values is one E8M0 exponent byte ``e`` and 16 bytes of 4-bit codes (code j in the
low nibble of byte j, code j + 16 in the high one); value = ``d * MXFP4_VALUES[code]`` with
``d = E8M0_HALF[e] = 2^(e - 128)`` (half the E8M0 power of two: the table holds the E2M1 values
doubled).

The quantizer is ik's ``quantize_row_mxfp4_impl`` and mainline's ``quantize_row_mxfp4_ref``, which
compute the same bytes (neither reads an imatrix): ``e = (uint8)(floorf(log2f(amax)) - 2 + 127)``
and every value's code is the nearest ``d * value`` by ``|x - d*value|``, the first on a tie (an
all-zero block stays all zero bytes).  numba's float32 ``np.log2`` is libm's ``log2f``, so the
floor agrees with C's even where log2f rounds up to the next integer just below a power of two.

The nearest code is searched among the 8 magnitudes only: ``d*value`` is exact (a power of two
times a small integer), so for x < 0 the negative table entries give the same differences as the
positive ones for |x| (IEEE negation is exact), and the entries of the other sign, and -0 (code
8), are never strictly nearer than code 0, which comes first.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import E8M0_HALF, FP16_TABLE, MXFP4_VALUES  # noqa: F401  (FP16_TABLE: the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from .common import F, block_bytes, decode_rows, run_rows, type_ids

(MXFP4,) = type_ids(T.MXFP4)
(MXFP4_BYTES,) = block_bytes(T.MXFP4)
QK = traits(T.MXFP4).block_size
KV = MXFP4_VALUES.astype(np.float32)
MAGNITUDES = KV[:8].copy()                      # 0, 1, 2, 3, 4, 6, 8, 12
INT_MIN = -(2 ** 31)


@njit(cache=True, error_model="numpy", inline="always")
def shared_exponent(amax):
    """C's ``(uint8_t)(floorf(log2f(amax)) - 2 + 127)``: x86 converts through int32 (cvttss2si,
    INT_MIN out of range) and keeps the low byte."""
    v = (np.floor(np.log2(amax)) - F(2)) + F(127)
    iv = np.int64(v) if F(-2147483648.0) <= v < F(2147483648.0) else np.int64(INT_MIN)
    return iv & 0xFF


@njit(cache=True, error_model="numpy", inline="always")
def block_codes(xb, d, a, best, m):
    """The code of each of the 32 values of a block into m: the index of the nearest
    d * MXFP4_VALUES[i], the first one on a tie (module docstring).  The candidates are the outer
    loop so that the inner one (over values, with selects) vectorises; a, best: scratch."""
    for j in range(QK):
        a[j] = abs(xb[j])
        best[j] = a[j]
        m[j] = 0
    for c in range(1, 8):
        dv = d * MAGNITUDES[c]
        for j in range(QK):
            diff = abs(a[j] - dv)
            better = diff < best[j]
            best[j] = diff if better else best[j]
            m[j] = c if better else m[j]
    for j in range(QK):
        m[j] = m[j] + 8 if (xb[j] < 0 and m[j] != 0) else m[j]


@njit(cache=True, error_model="numpy")
def mxfp4_row(x, qw, has_qw, ik, y):
    """One row of MXFP4 blocks (the imatrix and the flavor change nothing)."""
    a = np.empty(QK, np.float32)
    best = np.empty(QK, np.float32)
    m = np.empty(QK, np.int32)
    for ib in range(x.shape[0] // QK):
        o = MXFP4_BYTES * ib
        xb = x[QK * ib:QK * ib + QK]
        amax = F(0)
        for j in range(QK):
            amax = max(amax, abs(xb[j]))
        for j in range(MXFP4_BYTES):
            y[o + j] = 0
        if amax == 0:
            continue
        e = shared_exponent(amax)
        y[o] = e
        block_codes(xb, E8M0_HALF[e], a, best, m)
        for j in range(QK // 2):
            y[o + 1 + j] = m[j] | (m[j + QK // 2] << 4)


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Quantize rows x (n_rows, n_per_row) to MXFP4 blocks in out (n_rows, row_size)."""
    run_rows(mxfp4_row, x, qw, has_qw, ik, out)


@njit(cache=True, error_model="numpy")
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y (dequantize_row_mxfp4: d * value)."""
    for ib in range(y.shape[0] // QK):
        o = MXFP4_BYTES * ib
        d = E8M0_HALF[np.int64(b[o])]
        for j in range(QK // 2):
            q = np.int64(b[o + 1 + j])
            y[QK * ib + j] = d * KV[q & 0xF]
            y[QK * ib + j + QK // 2] = d * KV[q >> 4]


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
