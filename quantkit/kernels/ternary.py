"""numba kernels for the ternary types (see :mod:`quantkit.formats.ternary`): IQ1_BN, IQ2_BN
(ik_llama.cpp, a row scale in front) and TQ1_0, TQ2_0 (mainline, an fp16 scale per 256 values).

Every value becomes a trit t in {0, 1, 2} (value -1, 0, +1).  The 1.6-bit types pack 5 trits per
byte with the "3^5 trick": the base-3 number q < 243 is stored as ceil(256 q / 243), so that
multiplying the byte by 3^k (mod 256) brings trit k to the top, where (3 v) >> 8 reads it.  The
row kernels follow ik's quantize_one_row_1bn / _2bn and mainline's quantize_row_tq1_0_ref /
tq2_0_ref; none of them reads the imatrix.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from .common import F, block_bytes, decode_rows, fp16_at, run_rows, store_f32, store_fp16, type_ids

IQ1_BN, IQ2_BN, TQ1_0, TQ2_0 = type_ids(T.IQ1_BN, T.IQ2_BN, T.TQ1_0, T.TQ2_0)
IQ1_BN_BYTES, IQ2_BN_BYTES, TQ1_0_BYTES, TQ2_0_BYTES = block_bytes(T.IQ1_BN, T.IQ2_BN, T.TQ1_0, T.TQ2_0)
IQ1_BN_META = traits(T.IQ1_BN).row_meta_size       # fp16 row scale
IQ2_BN_META = traits(T.IQ2_BN).row_meta_size       # float32 row scale
QK_BN = traits(T.IQ1_BN).block_size                 # 64
QK_TQ = traits(T.TQ1_0).block_size                  # 256
TQ1_QS = TQ1_0_BYTES - 2 - QK_TQ // 64              # 48 bytes of 5 trits, then qh[4] of 4, then d
TQ1_QS32 = TQ1_QS - TQ1_QS % 32                     # the first 32 of them along 32 values
TQ2_QS = TQ2_0_BYTES - 2                            # 64 bytes of 4 2-bit codes, then d
POW3 = np.array([1, 3, 9, 27, 81, 243], np.int64)   # ik's k_nb; its k_mult[j] is POW3[4 - j]
I64_LIMIT = 2.0 ** 63
_OPTS = dict(cache=True, error_model="numpy")


# ---- the 3^5 trick ----

@njit(cache=True, error_model="numpy", inline="always")
def pack_trits(q):
    """A base-3 number q < 243 as its byte: ceil(256 q / 243) (C: (256*q + 242)/243, kept in uint8)."""
    return ((256 * q + 242) // 243) & 0xFF


@njit(cache=True, error_model="numpy", inline="always")
def top_trit(byte, mult):
    """Trit of ``byte`` that ``mult`` (a power of 3) brings to the top: ((uint8)(byte*mult) * 3) >> 8,
    mainline's dequantize_row_tq1_0 (ik writes (v + (v >> 1)) >> 7, the same for every byte)."""
    v = (np.int64(byte) * mult) & 0xFF
    return (v * 3) >> 8


# ---- IQ1_BN / IQ2_BN (ik): a row scale max|x|, trit 1 where |x| < max/2 ----

@njit(cache=True, error_model="numpy", inline="always")
def _row_max(x):
    """ik's row_max: std::max(max, fabsf(x)) from 0 (a NaN never wins)."""
    mx = F(0)
    for j in range(x.shape[0]):
        ax = abs(x[j])
        mx = ax if mx < ax else mx
    return mx


@njit(cache=True, error_model="numpy", inline="always")
def _bn_trit(v, thresh):
    """fabsf(v) < thresh ? 1 : v < 0 ? 0 : 2."""
    return 1 if abs(v) < thresh else (0 if v < 0 else 2)


@njit(**_OPTS)
def iq1_bn_row(x, qw, has_qw, ik, y):
    """fp16 max|x|, then per 64 values ql[12] | extra: in each 16, values 5k..5k+4 are the trits
    of ql[3 i16 + k] (value 5k + j: digit j), value 15 digit i16 of extra."""
    mx = _row_max(x)
    store_fp16(y, 0, mx)
    thresh = F(0.5) * mx
    for ib in range(x.shape[0] // QK_BN):
        o = IQ1_BN_META + IQ1_BN_BYTES * ib
        xb = QK_BN * ib
        v13 = 0
        for i16 in range(QK_BN // 16):
            for k in range(3):
                idx = 0
                for j in range(5):
                    idx += POW3[j] * _bn_trit(x[xb + 16 * i16 + 5 * k + j], thresh)
                y[o + 3 * i16 + k] = pack_trits(idx)
            v13 += POW3[i16] * _bn_trit(x[xb + 16 * i16 + 15], thresh)
        y[o + 12] = pack_trits(v13)


@njit(**_OPTS)
def iq2_bn_row(x, qw, has_qw, ik, y):
    """float32 max|x|, then per 64 values qs[16]: bits 2l..2l+1 of qs[j] the trit of value j + 16 l."""
    mx = _row_max(x)
    store_f32(y, 0, mx)
    thresh = F(0.5) * mx
    nj = QK_BN // 4
    for ib in range(x.shape[0] // QK_BN):
        o = IQ2_BN_META + IQ2_BN_BYTES * ib
        xb = QK_BN * ib
        for j in range(nj):
            q = 0
            for l in range(4):
                q |= _bn_trit(x[xb + j + nj * l], thresh) << (2 * l)
            y[o + j] = q


# ---- TQ1_0 / TQ2_0 (mainline): per 256 values d = max|x|, trit lroundf(x/d) + 1 ----

@njit(cache=True, error_model="numpy", inline="always")
def _tq_amax(x, o):
    """MAX(amax, fabsf(v)) over the block from 0, as the C macro evaluates it (a NaN is taken, and
    the next value replaces it)."""
    amax = F(0)
    for j in range(QK_TQ):
        a = abs(x[o + j])
        amax = amax if amax > a else a
    return amax


@njit(cache=True, error_model="numpy", inline="always")
def _tq_trit(v):
    """lroundf(v) + 1 as C's int: half away from zero; NaN, infinities and |v| >= 2^63 give
    LONG_MIN, whose low 32 bits are 0."""
    a = abs(np.float64(v))
    if not a < I64_LIMIT:
        return 1
    r = np.int64(np.floor(a + 0.5))
    r = -r if v < 0 else r
    return np.int64(np.int32(r & 0xFFFFFFFF)) + 1


@njit(cache=True, error_model="numpy", inline="always")
def _tq_scale(x, o, y, d_at):
    """Store fp16(d = amax) at d_at; return 1/d (0 for d == 0)."""
    d = _tq_amax(x, o)
    store_fp16(y, d_at, d)
    return F(1) / d if d != 0 else F(0)


@njit(cache=True, error_model="numpy", inline="always")
def _tq1_five_trits(x, xo, idv, y, o, start, stop, width):
    """qs[start:stop] of a TQ1_0 block, ``width`` bytes at a time: byte m of a group holds the trits
    of values m + width n (n = 0..4, the first the most significant); returns the next value."""
    for j in range(start, stop, width):
        for m in range(width):
            q = 0
            for n in range(5):
                q = (q * 3 + _tq_trit(x[xo + m + width * n] * idv)) & 0xFF
            y[o + j + m] = pack_trits(q)
        xo += 5 * width
    return xo


@njit(**_OPTS)
def tq1_0_row(x, qw, has_qw, ik, y):
    """Per 256 values qs[48] | qh[4] | fp16 d: qs[m] (m < 32) the trits of values m + 32 n, qs[32 + m]
    (m < 16) of values 160 + m + 16 n (n = 0..4, the first the most significant), qh[j] of values
    240 + j + 4 n (n = 0..3, then one 0 trit)."""
    for ib in range(x.shape[0] // QK_TQ):
        o = TQ1_0_BYTES * ib
        xo = QK_TQ * ib
        idv = _tq_scale(x, xo, y, o + TQ1_QS + QK_TQ // 64)
        xo = _tq1_five_trits(x, xo, idv, y, o, 0, TQ1_QS32, 32)
        xo = _tq1_five_trits(x, xo, idv, y, o, TQ1_QS32, TQ1_QS, 16)
        nh = QK_TQ // 64
        for j in range(nh):
            q = 0
            for m in range(4):
                q = (q * 3 + _tq_trit(x[xo + j + nh * m] * idv)) & 0xFF
            y[o + TQ1_QS + j] = pack_trits((q * 3) & 0xFF)


@njit(**_OPTS)
def tq2_0_row(x, qw, has_qw, ik, y):
    """Per 256 values qs[64] | fp16 d: bits 2n..2n+1 of qs[32 h + m] the trit of value 128 h + m + 32 n."""
    for ib in range(x.shape[0] // QK_TQ):
        o = TQ2_0_BYTES * ib
        xo = QK_TQ * ib
        idv = _tq_scale(x, xo, y, o + TQ2_QS)
        for j in range(0, TQ2_QS, 32):
            for m in range(32):
                q = 0
                for n in range(4):
                    q += (_tq_trit(x[xo + m + 32 * n] * idv) & 3) << (2 * n)
                y[o + j + m] = q & 0xFF
            xo += 4 * 32


ROW_KERNELS = {IQ1_BN: iq1_bn_row, IQ2_BN: iq2_bn_row, TQ1_0: tq1_0_row, TQ2_0: tq2_0_row}


def quantize_rows(qtype, x, qw, has_qw, out):
    """Quantize rows x (n_rows, n_per_row) to ``qtype`` in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, True, out)


@njit(**_OPTS)
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y = d * (trit - 1), in C's order (float(trit - 1) * d)."""
    n = y.shape[0]
    if qtype == IQ1_BN:
        d = fp16_at(b, 0, fp16_table)
        for ib in range(n // QK_BN):
            o = IQ1_BN_META + IQ1_BN_BYTES * ib
            for i16 in range(QK_BN // 16):
                for k in range(3):
                    for j in range(5):
                        y[QK_BN * ib + 16 * i16 + 5 * k + j] = F(top_trit(b[o + 3 * i16 + k], POW3[4 - j]) - 1) * d
                y[QK_BN * ib + 16 * i16 + 15] = F(top_trit(b[o + 12], POW3[4 - i16]) - 1) * d
    elif qtype == IQ2_BN:
        d = b[0:IQ2_BN_META].copy().view(np.float32)[0]
        for ib in range(n // QK_BN):
            o = IQ2_BN_META + IQ2_BN_BYTES * ib
            for j in range(QK_BN // 4):
                q = np.int64(b[o + j])
                for l in range(4):
                    y[QK_BN * ib + j + QK_BN // 4 * l] = F(((q >> (2 * l)) & 3) - 1) * d
    elif qtype == TQ1_0:
        for ib in range(n // QK_TQ):
            o = TQ1_0_BYTES * ib
            d = fp16_at(b, o + TQ1_QS + QK_TQ // 64, fp16_table)
            v = QK_TQ * ib
            for j in range(0, TQ1_QS32, 32):
                for t in range(5):
                    for m in range(32):
                        y[v] = F(top_trit(b[o + j + m], POW3[t]) - 1) * d
                        v += 1
            for j in range(TQ1_QS32, TQ1_QS, 16):
                for t in range(5):
                    for m in range(16):
                        y[v] = F(top_trit(b[o + j + m], POW3[t]) - 1) * d
                        v += 1
            for t in range(4):
                for j in range(QK_TQ // 64):
                    y[v] = F(top_trit(b[o + TQ1_QS + j], POW3[t]) - 1) * d
                    v += 1
    else:
        for ib in range(n // QK_TQ):
            o = TQ2_0_BYTES * ib
            d = fp16_at(b, o + TQ2_QS, fp16_table)
            for j in range(0, TQ2_QS, 32):
                for l in range(4):
                    for m in range(32):
                        q = (np.int64(b[o + j + m]) >> (2 * l)) & 3
                        y[QK_TQ * ib + 4 * j + 32 * l + m] = F(q - 1) * d


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
