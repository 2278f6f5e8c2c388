"""numba kernels for ik_llama.cpp's 8-bit row types q8_KV, q8_KV_r8 and q8_k_r8.

* q8_KV (iqk_quantize_row_q8_KV): a row is float32 ``d = amax/127``, the int32 sum of its codes, then
  one int8 code per value, ``q = round(x * (1/d))`` (nearest even: the AVX2 code the reference
  build runs; ``_mm256_cvtps_epi32`` gives INT_MIN for what does not fit, and the packs saturate
  to int8).  An all-zero row is all zero bytes.
* q8_k_r8 (quantize_q8_k_r8: quantize_row_q8_K32 over 8 rows, then repack_q8_k): per 256 values of
  a row ``d = amax/127`` stored as float16, codes ``round(x * (127/amax))`` (0 when amax is 0).

Their interleaved layouts regroup 8 rows: the 8 rows' scales first (q8_KV_r8: the float32 ``d`` of
each row, its code sum dropped; q8_k_r8: the 8 float16 ``d`` of each 256-block), then the codes
4 bytes at a time, row after row: byte ``32 w + 4 k + i`` is byte ``4 w + i`` of row k's codes
(of the block, for q8_k_r8).  :func:`quantize_groups8` writes each row's scales and codes straight
to those places: the bytes of ik's quantize-then-repack.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from .common import F, I32, QK_K, decode_rows, fp16_at, run_rows, store_f32, store_fp16, type_ids

Q8_KV, Q8_KV_R8, Q8_K_R8 = type_ids(T.Q8_KV, T.Q8_KV_R8, T.Q8_K_R8)
Q8_KV_META = traits(T.Q8_KV).row_meta_size              # float32 d, int32 sum of the codes
Q8_KV_R8_META = traits(T.Q8_KV_R8).row_meta_size        # float32 d
GROUP = traits(T.Q8_K_R8).interleave_rows               # 8, as q8_KV_r8's
Q8_K_R8_HEAD = traits(T.Q8_K_R8).type_size - QK_K        # a block's float16 d in the plain form
INT_MIN = -(2 ** 31)


@njit(cache=True, error_model="numpy", inline="always")
def _cvt_round(v):
    """_mm256_cvtps_epi32(_mm256_round_ps(v, nearest)): nearest even, INT_MIN out of range (NaN)."""
    r = np.rint(v)
    return np.int64(r) if F(-2147483648.0) <= r < F(2147483648.0) else np.int64(INT_MIN)


@njit(cache=True, error_model="numpy", inline="always")
def _int8_saturated(i):
    return min(127, max(-128, i))


@njit(cache=True, error_model="numpy", inline="always")
def _absmax(x):
    amax = F(0)
    for j in range(x.shape[0]):
        amax = max(amax, abs(x[j]))
    return amax


@njit(cache=True, error_model="numpy", inline="always")
def _code_at(at, j, words8):
    """Where code j goes: at + j, or with words8 (an interleaved group, ``at`` its row's first
    byte) at + 32 (j // 4) + j % 4."""
    return at + 32 * (j >> 2) + (j & 3) if words8 else at + j


@njit(cache=True, error_model="numpy")
def _round_codes(x, mul, amax, y, at, words8):
    """The int8 code of round(mul * x[j]) as the AVX2 code stores it, for every j, to y at
    _code_at(at, j, words8); returns the int64 sum of the int32 values before saturation.  Where
    no product can reach 2^30 (every row whose scale did not underflow) the plain loop; else C's
    conversion (INT_MIN out of range), value by value."""
    isum = np.int64(0)
    if mul * amax < F(2.0 ** 30):
        for j in range(x.shape[0]):
            i = np.int32(np.rint(mul * x[j]))
            isum += i
            y[_code_at(at, j, words8)] = np.uint8(min(I32(127), max(I32(-128), i)) & 0xFF)
    else:
        for j in range(x.shape[0]):
            i = _cvt_round(mul * x[j])
            isum += i
            y[_code_at(at, j, words8)] = np.uint8(_int8_saturated(i) & 0xFF)
    return isum


@njit(cache=True, error_model="numpy", inline="always")
def _q8_kv_codes(x, y, d_at, codes_at, words8):
    """A q8_KV row's float32 d to y[d_at] and its codes from codes_at; returns their int64 sum."""
    amax = _absmax(x)
    d = amax / F(127)
    if amax == 0:                                   # all zero bytes
        for j in range(x.shape[0]):
            y[_code_at(codes_at, j, words8)] = 0
        store_f32(y, d_at, F(0))
        return np.int64(0)
    store_f32(y, d_at, d)
    return _round_codes(x, F(1) / d, amax, y, codes_at, words8)


@njit(cache=True, error_model="numpy")
def q8_kv_row(x, qw, has_qw, ik, y):
    """One q8_KV row (ik ignores the imatrix)."""
    isum = _q8_kv_codes(x, y, 0, Q8_KV_META, False)
    for k in range(4):                              # the int32 sum wraps, as the C lanes do
        y[4 + k] = (isum >> (8 * k)) & 0xFF


@njit(cache=True, error_model="numpy", inline="always")
def _q8_k_block(xb, y, d_at, codes_at):
    """quantize_row_q8_K32 of 256 values: float16 d = amax/127 to y[d_at], the codes round(x *
    127/amax) as the 4-byte words of an interleaved group's row from codes_at."""
    amax = _absmax(xb)
    store_fp16(y, d_at, amax / F(127))
    _round_codes(xb, F(127) / amax if amax != 0 else F(0), amax, y, codes_at, True)


ROW_KERNELS = {Q8_KV: q8_kv_row}


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Rows x (n_rows, n_per_row) -> q8_KV rows in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def quantize_groups8(x, kv, out):
    """Rows x (n_rows, n_per_row), n_rows a multiple of 8 -> out (n_rows, row_size) of q8_KV_r8
    (kv: the 8 rows' float32 d, then their codes) or q8_k_r8 (per 256 values the 8 float16 d,
    then the codes), each row's codes written straight to its 4-byte words of the group: what ik's
    quantize_q8_KV_r8 / quantize_q8_k_r8 (quantize, then repack) write."""
    n = x.shape[1]
    packed = out.reshape(-1)
    for g in prange(x.shape[0] // GROUP):
        pos = g * GROUP * out.shape[1]
        for k in range(GROUP):
            xr = x[GROUP * g + k]
            if kv:
                _q8_kv_codes(xr, packed, pos + Q8_KV_R8_META * k, pos + GROUP * Q8_KV_R8_META + 4 * k, True)
            else:
                for b in range(n // QK_K):
                    at = pos + b * GROUP * (Q8_K_R8_HEAD + QK_K)
                    _q8_k_block(xr[QK_K * b:QK_K * (b + 1)], packed, at + Q8_K_R8_HEAD * k,
                                at + GROUP * Q8_K_R8_HEAD + 4 * k)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def decode_groups8(packed, packed_row, row_scale, n_per_row, fp16_table, out):
    """Interleaved groups of 8 rows -> float32 rows (out flat, n_per_row each): q8_KV_r8
    (row_scale: 8 float32 d, then the codes) or q8_k_r8 (per 256 values: 8 float16 d, then the
    codes); value = d * code (dequantize_row_q8_KV_r8 / _q8_k_r8).  ``packed``: the bytes (flat)."""
    n_blocks = 1 if row_scale else n_per_row // QK_K
    values = n_per_row // n_blocks
    codes = packed.view(np.int8)
    for g in prange(packed.shape[0] // (GROUP * packed_row)):
        pos = g * GROUP * packed_row
        d = np.empty(GROUP, np.float32)
        if row_scale:
            for k in range(GROUP):
                d[k] = packed[pos + 4 * k:pos + 4 * k + 4].copy().view(np.float32)[0]
            pos += 4 * GROUP
        for b in range(n_blocks):
            if not row_scale:
                for k in range(GROUP):
                    d[k] = fp16_at(packed, pos + 2 * k, fp16_table)
                pos += 2 * GROUP
            for k in range(GROUP):
                dk = d[k]
                o = (g * GROUP + k) * n_per_row + values * b
                src = pos + 4 * k
                for w in range(values // 4):
                    for i in range(4):
                        out[o + 4 * w + i] = dk * F(codes[src + 32 * w + i])
            pos += GROUP * values


@njit(cache=True, error_model="numpy")
def decode_row(qtype, b, y, fp16_table):
    """One q8_KV row: its bytes b -> its values y (dequantize_row_q8_KV: d * code)."""
    d = b[0:4].copy().view(np.float32)[0]
    codes = b[Q8_KV_META:].view(np.int8)
    for j in range(y.shape[0]):
        y[j] = d * F(codes[j])


def dequantize_rows(qtype, blocks, fp16_table, out):
    """q8_KV blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
