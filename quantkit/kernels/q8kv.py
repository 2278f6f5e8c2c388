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
(of the block, for q8_k_r8).  The row kernels write a row's plain form (q8_KV: its bytes;
q8_k_r8: per block the float16 d and the 256 codes, as many bytes as the interleaved row) and
:func:`quantize_groups8` regroups them group by group, as ik's quantizers do.
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


@njit(cache=True, error_model="numpy")
def _round_codes(x, mul, amax, y, at):
    """y[at + j] = int8 code of round(mul * x[j]) as the AVX2 code stores it; returns the int64
    sum of the int32 values before saturation.  Where no product can reach 2^30 (every row whose
    scale did not underflow) the plain loop, which vectorises; else C's conversion, value by value."""
    isum = np.int64(0)
    if mul * amax < F(2.0 ** 30):
        for j in range(x.shape[0]):
            i = np.int32(np.rint(mul * x[j]))
            isum += i
            y[at + j] = np.uint8(min(I32(127), max(I32(-128), i)) & 0xFF)
    else:
        for j in range(x.shape[0]):
            i = _cvt_round(mul * x[j])
            isum += i
            y[at + j] = np.uint8(_int8_saturated(i) & 0xFF)
    return isum


@njit(cache=True, error_model="numpy")
def q8_kv_row(x, qw, has_qw, ik, y):
    """One q8_KV row (ik ignores the imatrix)."""
    n = x.shape[0]
    amax = _absmax(x)
    if amax == 0:
        for j in range(n + Q8_KV_META):
            y[j] = 0
        return
    d = amax / F(127)
    isum = _round_codes(x, F(1) / d, amax, y, Q8_KV_META)
    store_f32(y, 0, d)
    for k in range(4):                              # the int32 sum wraps, as the C lanes do
        y[4 + k] = (isum >> (8 * k)) & 0xFF


@njit(cache=True, error_model="numpy")
def q8_k_r8_row(x, qw, has_qw, ik, y):
    """One row of q8_k_r8 in its plain form: per 256 values float16 d, then 256 int8 codes."""
    blk = Q8_K_R8_HEAD + QK_K
    for ib in range(x.shape[0] // QK_K):
        xb = x[QK_K * ib:QK_K * ib + QK_K]
        o = blk * ib
        amax = _absmax(xb)
        store_fp16(y, o, amax / F(127))
        _round_codes(xb, F(127) / amax if amax != 0 else F(0), amax, y, o + Q8_K_R8_HEAD)


ROW_KERNELS = {Q8_KV: q8_kv_row}


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Rows x (n_rows, n_per_row) -> q8_KV rows in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


@njit(cache=True, error_model="numpy", inline="always")
def _words8(src, s_at, s_stride, dst, d_at, n_bytes):
    """The codes of 8 rows (row k's n_bytes at s_at + k s_stride) -> 4-byte words, row after row,
    at d_at."""
    for w in range(n_bytes // 4):
        for k in range(GROUP):
            for i in range(4):
                dst[d_at + 32 * w + 4 * k + i] = src[s_at + k * s_stride + 4 * w + i]


@njit(cache=True, error_model="numpy", inline="always")
def _pack_group(plain, plain_row, packed, pos, meta_in, meta_keep, n_blocks, head, payload):
    """8 plain rows (flat from 0, plain_row bytes each: meta_in bytes, then n_blocks of head +
    payload bytes) -> one interleaved group at packed[pos]: the 8 rows' first meta_keep bytes, then
    per block the 8 heads and the 8 payloads 4 bytes at a time (module docstring)."""
    for k in range(GROUP):
        for i in range(meta_keep):
            packed[pos + meta_keep * k + i] = plain[plain_row * k + i]
    pos += GROUP * meta_keep
    for b in range(n_blocks):
        at = meta_in + (head + payload) * b
        for k in range(GROUP):
            for i in range(head):
                packed[pos + head * k + i] = plain[at + plain_row * k + i]
        pos += GROUP * head
        _words8(plain, at + head, plain_row, packed, pos, payload)
        pos += GROUP * payload


@njit(cache=True, parallel=True, error_model="numpy")
def quantize_groups8(x, kv, out):
    """Rows x (n_rows, n_per_row), n_rows a multiple of 8 -> out (n_rows, row_size) of q8_KV_r8
    (kv) or q8_k_r8: each group's rows quantized in their plain form, then regrouped, as ik's
    quantize_q8_KV_r8 / quantize_q8_k_r8 do."""
    n = x.shape[1]
    plain_row = Q8_KV_META + n if kv else out.shape[1]
    packed = out.reshape(-1)
    qw = np.zeros(1, np.float32)
    for g in prange(x.shape[0] // GROUP):
        plain = np.empty(GROUP * plain_row, np.uint8)
        for k in range(GROUP):
            row = plain[plain_row * k:plain_row * (k + 1)]
            if kv:
                q8_kv_row(x[GROUP * g + k], qw, False, True, row)
            else:
                q8_k_r8_row(x[GROUP * g + k], qw, False, True, row)
        pos = g * GROUP * out.shape[1]
        if kv:
            _pack_group(plain, plain_row, packed, pos, Q8_KV_META, Q8_KV_R8_META, 1, 0, n)
        else:
            _pack_group(plain, plain_row, packed, pos, 0, 0, n // QK_K, Q8_K_R8_HEAD, QK_K)


@njit(cache=True, parallel=True, error_model="numpy")
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
