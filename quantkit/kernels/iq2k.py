"""numba kernels for IQ2_K and IQ2_KS (see :mod:`quantkit.formats.iq2k`).

The four-level split search dominates: for every sub-block, every (i1, i2, i3) split of its sorted
values is scored four times.  The splits are the outer loops and the sub-blocks of a row the
innermost one ("lanes": ``sumx[i, k]`` is prefix sum i of sub-block k), so each score is one SIMD
operation over 8 sub-blocks; every lane keeps its own best in the order C visits the splits.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import FP16_TABLE, IQ2NL_VALUES
from ..types import QuantType as T
from ..types import traits
from ._iqk import thresholds
from .common import (fp16_at, decode_rows, F, QK_K, ZERO_EPS, block_bytes, first_absmax, nint, run_rows, store_fp16, store_u16, type_ids,
                     weighted_sums)
from .iqk import PLAIN_SIGMA, row_weights

IQ2_K, IQ2_KS = type_ids(T.IQ2_K, T.IQ2_KS)
IQ2_K_BYTES, IQ2_KS_BYTES = block_bytes(T.IQ2_K, T.IQ2_KS)
IQ2_KS_META = traits(T.IQ2_KS).row_meta_size        # the fp16 row scale
BASE = IQ2NL_VALUES[:4].astype(np.float32)
SHIFTED = IQ2NL_VALUES[4:].astype(np.float32)
BASE_THR = thresholds(BASE)
SHIFTED_THR = thresholds(SHIFTED)
VALUES = IQ2NL_VALUES.astype(np.float32)

__all__ = ["quantize_rows", "dequantize_rows", "FP16_TABLE"]
_OPTS = dict(cache=True, error_model="numpy")


@njit(**_OPTS)
def _nearest4(a, thr):
    """Index among 4 ascending values (ties up); NaN gives 0."""
    i = 0
    for t in range(3):
        i += 1 if a >= thr[t] else 0
    return i


@njit(**_OPTS)
def _prefix_sums(xb, wb, K, lanes, sumx, sumw):
    """sumx/sumw[i, k]: prefix sums over sub-block k sorted by value (stable)."""
    for k in range(lanes):
        order = np.argsort(xb[k * K:(k + 1) * K], kind="mergesort")
        sumx[0, k] = F(0)
        sumw[0, k] = F(0)
        for i in range(K):
            j = k * K + order[i]
            sumw[i + 1, k] = sumw[i, k] + wb[j]
            sumx[i + 1, k] = sumx[i, k] + wb[j] * xb[j]


@njit(**_OPTS)
def _score(g0, g1, g2, g3, w0, w1, w2, w3, a0, a1, a2, a3):
    sqx = ((g0 * a0 + g1 * a1) + g2 * a2) + g3 * a3
    sq2 = (((w0 * a0) * a0 + (w1 * a1) * a1) + (w2 * a2) * a2) + (w3 * a3) * a3
    return sqx, sq2


@njit(**_OPTS)
def exhaustive_search(sumx, sumw, K, lanes, i1_max, i3_min, d, shifted):
    best = np.zeros(lanes, np.float32)
    for k in range(lanes):
        d[k] = F(0)
        shifted[k] = False
    v0, v1, v2, v3 = BASE[0], BASE[1], BASE[2], BASE[3]
    s0, s1, s2, s3 = SHIFTED[0], SHIFTED[1], SHIFTED[2], SHIFTED[3]
    for i1 in range(i1_max):
        for i2 in range(i1, K):
            for i3 in range(max(i2, i3_min), K):
                for k in range(lanes):
                    g0 = sumx[i1, k] - sumx[0, k]
                    g1 = sumx[i2, k] - sumx[i1, k]
                    g2 = sumx[i3, k] - sumx[i2, k]
                    g3 = sumx[K, k] - sumx[i3, k]
                    w0 = sumw[i1, k] - sumw[0, k]
                    w1 = sumw[i2, k] - sumw[i1, k]
                    w2 = sumw[i3, k] - sumw[i2, k]
                    w3 = sumw[K, k] - sumw[i3, k]
                    b = best[k]
                    dk = d[k]
                    sk = shifted[k]
                    for t in range(4):
                        if t == 0:
                            sqx, sq2 = _score(g0, g1, g2, g3, w0, w1, w2, w3, v0, v1, v2, v3)
                        elif t == 1:
                            sqx, sq2 = _score(g0, g1, g2, g3, w0, w1, w2, w3, s0, s1, s2, s3)
                        elif t == 2:
                            sqx, sq2 = _score(g0, g1, g2, g3, w0, w1, w2, w3, v3, v2, v1, v0)
                        else:
                            sqx, sq2 = _score(g0, g1, g2, g3, w0, w1, w2, w3, s3, s2, s1, s0)
                        if sq2 > 0 and sqx * sqx > b * sq2:
                            dk = sqx / sq2
                            b = dk * sqx
                            sk = t % 2 == 1
                    best[k] = b
                    d[k] = dk
                    shifted[k] = sk


@njit(**_OPTS)
def make_qx_quants_iqk(x, qw, nmax, L):
    """ik's make_qx_quants (iqk_quantize.cpp): scale, and codes l + nmax in L."""
    n = x.shape[0]
    amax = F(0)
    mx = F(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax == 0:
        for i in range(n):
            L[i] = 0
        return F(0)
    Lt = np.empty(n, np.int32)
    scale = F(0)
    best = F(0)
    for is_ in range(-10, 10):
        if is_ == 0:
            continue
        iscale = F(-nmax) / mx if is_ == -10 else -(F(nmax) + F(0.1) * F(is_)) / mx
        sumlx = F(0)
        suml2 = F(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nint(iscale * x[i])))
            Lt[i] = l
            sumlx += (qw[i] * x[i]) * F(l)
            suml2 += (qw[i] * F(l)) * F(l)
        if is_ == -10:
            scale = sumlx / suml2 if suml2 != 0 else F(0)
            best = scale * sumlx
            for i in range(n):
                L[i] = Lt[i] + nmax
        elif suml2 > 0 and sumlx * sumlx > best * suml2:
            scale = sumlx / suml2
            best = scale * sumlx
            for i in range(n):
                L[i] = Lt[i] + nmax
    return scale


@njit(**_OPTS)
def _sub_block_scales(xr, qw, has_qw, K, i1_max, i3_min):
    """The first pass of both row kernels: (weights, their sum per sub-block of K, each sub-block's
    scale and shifted flag from the exhaustive search)."""
    n = xr.shape[0]
    lanes = n // K
    w = np.empty(n, np.float32)
    sw = np.empty(lanes, np.float32)
    scales = np.empty(lanes, np.float32)
    shifted = np.empty(lanes, np.bool_)
    row_weights(xr, qw, has_qw, K, 1.5, PLAIN_SIGMA, w)
    for k in range(lanes):
        s = F(0)
        for j in range(K):
            s += w[k * K + j]
        sw[k] = s
    sumx = np.empty((K + 1, lanes), np.float32)
    sumw = np.empty((K + 1, lanes), np.float32)
    _prefix_sums(xr, w, K, lanes, sumx, sumw)
    exhaustive_search(sumx, sumw, K, lanes, i1_max, i3_min, scales, shifted)
    for k in range(lanes):
        if first_absmax(xr[k * K:(k + 1) * K])[0] < ZERO_EPS:
            scales[k] = F(0)
            shifted[k] = False
    return w, sw, scales, shifted


@njit(cache=True, error_model="numpy", inline="always")
def _encode(x, w, idl, scale, shifted, L, sumqx, sumq2):
    """Codes of idl*x (nearest of the base or shifted 4 values) into L, and sumqx, sumq2 advanced in
    C order by (w*q)*x and (w*q)*q of each decoded q = value*scale.  Returns (sumqx, sumq2)."""
    for j in range(x.shape[0]):
        c = _nearest4(idl * x[j], SHIFTED_THR) if shifted else _nearest4(idl * x[j], BASE_THR)
        L[j] = c
        sumqx, sumq2 = weighted_sums(x[j], w[j], (SHIFTED[c] if shifted else BASE[c]) * scale, sumqx, sumq2)
    return sumqx, sumq2


@njit(**_OPTS)
def iq2_k_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    w, sw, scales, shifted = _sub_block_scales(xr, qw, has_qw, 16, 16, 0)
    L = np.empty(16, np.int32)
    codes = np.empty(16, np.int32)
    for sb in range(n // QK_K):
        o = IQ2_K_BYTES * sb
        y[o:o + IQ2_K_BYTES] = 0
        s16 = scales[16 * sb:16 * sb + 16]
        if first_absmax(s16)[0] == 0:
            continue
        d = make_qx_quants_iqk(s16, sw[16 * sb:16 * sb + 16], 8, L)
        if d == 0:
            continue
        idv = F(1) / d
        sumqx = F(0)
        sumq2 = F(0)
        extra = 0
        for ib in range(16):
            sh = shifted[16 * sb + ib]
            if sh:
                extra |= 1 << ib
            ls = max(-8, min(7, nint(idv * s16[ib])))
            y[o + 4 + ib // 2] |= (ls + 8) << (4 * (ib % 2))
            dl = d * F(ls)
            if dl == 0:
                continue
            p = QK_K * sb + 16 * ib
            sumqx, sumq2 = _encode(xr[p:p + 16], w[p:p + 16], F(1) / dl, F(ls), sh, codes, sumqx, sumq2)
            for j in range(16):
                pp = 16 * ib + j
                ib32 = pp // 32
                y[o + 12 + 32 * (ib32 // 4) + pp % 32] |= codes[j] << (2 * (ib32 % 4))
        store_fp16(y, o, F(1.030) * (sumqx / sumq2 if sumq2 > 0 else d))
        store_u16(y, o + 2, extra)


@njit(**_OPTS)
def iq2_ks_row(xr, qw, has_qw, ik, y):
    lanes = xr.shape[0] // 32
    w, sw, scales, shifted = _sub_block_scales(xr, qw, has_qw, 32, 24, 8)
    y[:] = 0
    for b in range(lanes):
        if shifted[b]:
            y[IQ2_KS_META + IQ2_KS_BYTES * (b // 8)] |= 1 << (b % 8)
    L = np.empty(lanes, np.int32)
    codes = np.empty(32, np.int32)
    d = make_qx_quants_iqk(scales, sw, 16, L)
    if d == 0:
        return
    sumqx = F(0)
    sumq2 = F(0)
    for b in range(lanes):
        o = IQ2_KS_META + IQ2_KS_BYTES * (b // 8)
        ib = b % 8
        y[o + 2 + ib // 2] |= (L[b] & 0xF) << (4 * (ib % 2))
        y[o + 1] |= (L[b] >> 4) << ib
        ls = L[b] - 16
        dl = d * F(ls)
        if dl == 0:
            continue
        sumqx, sumq2 = _encode(xr[32 * b:32 * b + 32], w[32 * b:32 * b + 32], F(1) / dl, F(ls), shifted[b], codes,
                               sumqx, sumq2)
        for j in range(32):
            y[o + 6 + 32 * (ib // 4) + j] |= codes[j] << (2 * (ib % 4))
    store_fp16(y, 0, F(1.030) * (sumqx / sumq2 if sumq2 > 0 else d))


ROW_KERNELS = {IQ2_K: iq2_k_row, IQ2_KS: iq2_ks_row}


def quantize_rows(qtype, x, qw, has_qw, out):
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, True, out)


@njit(**_OPTS)
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y."""
    n = y.shape[0]
    if qtype == IQ2_K:
        for sb in range(n // QK_K):
            o = IQ2_K_BYTES * sb
            d = fp16_at(b, o, fp16_table)
            extra = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
            # per 16 values one scale: worked out once, the values' loop left with loads and a lookup
            for ib in range(16):
                ib32 = ib // 2
                dl = d * F(((np.int64(b[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) - 8)
                shift = 4 * ((extra >> ib) & 1)
                at = o + 12 + 32 * (ib32 // 4) + 16 * (ib % 2)
                bits = 2 * (ib32 % 4)
                for j in range(16):
                    q = (np.int64(b[at + j]) >> bits) & 3
                    y[QK_K * sb + 16 * ib + j] = dl * VALUES[q + shift]
    else:
        d = fp16_at(b, 0, fp16_table)
        for sb in range(n // QK_K):
            o = IQ2_KS_META + IQ2_KS_BYTES * sb
            extra = np.int64(b[o]) | (np.int64(b[o + 1]) << 8)
            for ib in range(8):
                ls = (((np.int64(b[o + 2 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((extra >> (8 + ib)) & 1) << 4)) - 16
                dl = d * F(ls)
                shift = 4 * ((extra >> ib) & 1)
                at = o + 6 + 32 * (ib // 4)
                bits = 2 * (ib % 4)
                for j in range(32):
                    q = (np.int64(b[at + j]) >> bits) & 3
                    y[QK_K * sb + 32 * ib + j] = dl * VALUES[q + shift]


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
