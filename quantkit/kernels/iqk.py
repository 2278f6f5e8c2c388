"""numba kernels for IQ3_K, IQ4_K, IQ5_K, IQ6_K and IQ4_KS (see :mod:`quantkit.formats.iqk`).

Contract and arithmetic: formats.iqk's docstring; rows run in parallel.  The scale search is what
makes these quantizers cost: every trial scale looks up each value twice.  ``search_lanes`` runs all
sub-blocks of a row at once as SIMD lanes (each lane keeps its sums in C order) and finds the
nearest table value by counting the float32 thresholds between neighbours (``_iqk.thresholds``)
at or below x, which LLVM vectorises.  The encoding passes use the scalar ``nearest``: it works like
ik's own helper, without a search: ``LUT[floor(x - T[0])]`` is the last table index at or below x
(table values are integers at least 1 apart), and one comparison with the threshold between that
value and the next decides the nearest, ties going to the upper one.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K, FP16_TABLE, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from ..types import QuantType as T
from ..types import traits
from ._iqk import imatrix_cleanup_row, thresholds
from .common import (fp16_at, decode_rows, F, OVERFLOW, QK_K, ZERO_EPS, block_bytes, first_absmax, lanes_first_absmax, nint, run_rows,
                     store_f32, store_fp16, store_u16, take_trial, type_ids, weighted_sums)

IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ5_KS, IQ3_KS = type_ids(T.IQ3_K, T.IQ4_K, T.IQ5_K, T.IQ6_K, T.IQ4_KS, T.IQ5_KS,
                                                            T.IQ3_KS)
#: bytes of one block (a super-block of QK_K values)
IQ3_K_BYTES, IQ4_K_BYTES, IQ5_K_BYTES, IQ6_K_BYTES, IQ4_KS_BYTES, IQ5_KS_BYTES, IQ3_KS_BYTES = block_bytes(
    T.IQ3_K, T.IQ4_K, T.IQ5_K, T.IQ6_K, T.IQ4_KS, T.IQ5_KS, T.IQ3_KS)
#: the row scale in front of the blocks: float32 (IQ4_KS, IQ5_KS) or fp16 (IQ3_KS)
IQ4_KS_META, IQ5_KS_META, IQ3_KS_META = (traits(q).row_meta_size for q in (T.IQ4_KS, T.IQ5_KS, T.IQ3_KS))
OVERFLOW_IQ6 = OVERFLOW - F(128)        # IQ6_K's lookup is (int)(x - T[0])

__all__ = ["quantize_rows", "dequantize_rows", "FP16_TABLE"]


def _table(values):
    """(values, floor lookup, thresholds) of one half-table.  ``lut[t]`` is the last index whose value
    is <= T[0] + t; ``thr[i + 1]`` is the threshold between values i and i + 1, with -inf/+inf
    sentinels at both ends so that neither end index ever moves."""
    v = np.asarray(values, np.float32)
    span = int(v[-1] - v[0]) + 1
    lut = np.array([np.searchsorted(v, v[0] + t, side="right") - 1 for t in range(span)], np.int32)
    return v, lut, np.concatenate([[-np.inf], thresholds(v), [np.inf]]).astype(np.float32)


# tables: [base, shifted] halves
IQ3_V, IQ3_LUT, IQ3_THR = _table(IQ3NL_VALUES[:8])
IQ3_SV, IQ3_SLUT, IQ3_STHR = _table(IQ3NL_VALUES[8:])
IQ4_V, IQ4_LUT, IQ4_THR = _table(IQ4K_VALUES[:16])
IQ4_SV, IQ4_SLUT, IQ4_STHR = _table(IQ4K_VALUES[16:])
IQ5_V, IQ5_LUT, IQ5_THR = _table(IQ5NL_VALUES[:32])
IQ5_SV, IQ5_SLUT, IQ5_STHR = _table(IQ5NL_VALUES[32:])
IQ6_V, IQ6_LUT, IQ6_THR = _table(IQ6NL_VALUES[:64])
IQ6_SV, IQ6_SLUT, IQ6_STHR = _table(IQ6NL_VALUES[:64].astype(np.float32) + 1)
#: (values, lut, thresholds) of the base and the shifted half, for ``nearest_in``
IQ3_T = (IQ3_V, IQ3_LUT, IQ3_THR, IQ3_SV, IQ3_SLUT, IQ3_STHR)
IQ4_T = (IQ4_V, IQ4_LUT, IQ4_THR, IQ4_SV, IQ4_SLUT, IQ4_STHR)
IQ5_T = (IQ5_V, IQ5_LUT, IQ5_THR, IQ5_SV, IQ5_SLUT, IQ5_STHR)
IQ6_T = (IQ6_V, IQ6_LUT, IQ6_THR, IQ6_SV, IQ6_SLUT, IQ6_STHR)

_OPTS = dict(cache=True, error_model="numpy")


@njit(cache=True, error_model="numpy", inline="always")
def nearest(a, v, lut, thr, ovf):
    """Index of the entry of table v nearest to float32 a (ties to the upper one); NaN and
    a >= ovf give 0, as ik's lookup does."""
    if not (a < ovf):
        return 0
    t = min(max(a - v[0], F(0)), F(lut.shape[0] - 1))
    c = lut[np.int64(t)]
    if a < thr[c]:                      # a - T[0] rounded up to the next integer: rare
        c -= 1
    return c + (1 if a >= thr[c + 1] else 0)


def _count_table(values):
    """(first value, steps, thresholds) for branch-free lookups: the entry nearest to a (ties up)
    is values[0] + the steps of every threshold <= a.  Every table is integer-valued, so the sum is
    exact in float32."""
    v = np.asarray(values, np.float32)
    return v, np.diff(v).astype(np.float32), thresholds(v).astype(np.float32)


IQ3_C, IQ3_SC = _count_table(IQ3_V), _count_table(IQ3_SV)
IQ4_C, IQ4_SC = _count_table(IQ4_V), _count_table(IQ4_SV)
IQ5_C, IQ5_SC = _count_table(IQ5_V), _count_table(IQ5_SV)
IQ6_C, IQ6_SC = _count_table(IQ6_V), _count_table(IQ6_SV)


@njit(**_OPTS)
def _trial_lanes(xt, wt, isc, v, dv, ct, ovf, sums, ap, qp, qm):
    """For every lane k (a sub-block), the sums of ``_trial`` at inverse scale isc[k]: Σwqx and
    Σwq² for the codes of +isc*x (sums[0], sums[1]) and of -isc*x (sums[2], sums[3]), accumulated
    in C order.  The lane loops are innermost so that LLVM runs 8 lanes per instruction; the
    nearest value is counted over the thresholds instead of searched (NaN and a >= ovf give
    values[0], as ik's (int) cast does)."""
    sub, nl = xt.shape
    for r in range(4):
        for k in range(nl):
            sums[r, k] = F(0)
    for i in range(sub):
        for k in range(nl):
            ap[k] = isc[k] * xt[i, k]
            qp[k] = v[0]
            qm[k] = v[0]
        for t in range(ct.shape[0]):
            th = ct[t]
            step = dv[t]
            for k in range(nl):
                qp[k] += step if ap[k] >= th else F(0)
                qm[k] += step if -ap[k] >= th else F(0)
        for k in range(nl):
            a = ap[k]
            x = xt[i, k]
            q = qp[k] if a < ovf else v[0]
            wq = wt[i, k] * q
            sums[0, k] += wq * x
            sums[1, k] += wq * q
            q = qm[k] if -a < ovf else v[0]
            wq = wt[i, k] * q
            sums[2, k] += wq * x
            sums[3, k] += wq * q


@njit(cache=True, error_model="numpy", inline="always")
def take_trials(sums, k, d, best):
    """The trials at +isc and -isc of lane k (``_trial_lanes``' sums) tested in C order against
    (d[k], best[k]), which they update; whether either was taken."""
    plus, dk, bk = take_trial(sums[0, k], sums[1, k], d[k], best[k])
    minus, dk, bk = take_trial(sums[2, k], sums[3, k], dk, bk)
    d[k] = dk
    best[k] = bk
    return plus or minus


@njit(cache=True, error_model="numpy", inline="always")
def first_trials(sums, k, guarded, d0, d, best):
    """The first trial pair of lane k: the + trial's scale unless ``guarded`` and its Σwq² is not
    positive (then d0 with score 0), then the - trial tested against it."""
    dk = d0
    bk = F(0)
    if not guarded or sums[1, k] > 0:
        dk = sums[0, k] / sums[1, k]
        bk = dk * sums[0, k]
    _, d[k], best[k] = take_trial(sums[2, k], sums[3, k], dk, bk)


@njit(**_OPTS)
def search_lanes(x, w, sub, tab, stab, ntry, step, guarded, refit, ovf, scales, shifted):
    """(scale, shifted) of every sub-block of ``sub`` values in x (specs/ik-quants.md §3b),
    all sub-blocks at once as SIMD lanes.  tab/stab: _count_table of the base/shifted half."""
    v, dv, ct = tab
    sv, sdv, sct = stab
    nl = x.shape[0] // sub
    xt = np.empty((sub, nl), np.float32)
    wt = np.empty((sub, nl), np.float32)
    for k in range(nl):
        for i in range(sub):
            xt[i, k] = x[k * sub + i]
            wt[i, k] = w[k * sub + i]
    st = np.empty((9, nl), np.float32)
    amax, mx, d, best, isc, ap, qp, qm = st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7]
    sums = np.empty((4, nl), np.float32)
    lanes_first_absmax(xt, amax, mx)
    for k in range(nl):
        isc[k] = F(1) / (-mx[k] / v[0])
    _trial_lanes(xt, wt, isc, v, dv, ct, ovf, sums, ap, qp, qm)
    for k in range(nl):
        first_trials(sums, k, guarded, -mx[k] / v[0], d, best)
        shifted[k] = False
    for itry in range(-ntry, ntry + 1):
        for half in range(2):
            num = F(itry * step + (v[0] if half == 0 else sv[0]))
            for k in range(nl):
                isc[k] = num / mx[k]
            if half == 0:
                _trial_lanes(xt, wt, isc, v, dv, ct, ovf, sums, ap, qp, qm)
            else:
                _trial_lanes(xt, wt, isc, sv, sdv, sct, ovf, sums, ap, qp, qm)
            for k in range(nl):
                if take_trials(sums, k, d, best):
                    shifted[k] = half == 1
    for k in range(nl):
        if amax[k] < ZERO_EPS:
            scales[k] = F(0)
            shifted[k] = False
            continue
        dk = d[k]
        if refit and dk != 0:
            idv = F(1) / dk
            sx = F(0)
            s2 = F(0)
            tv, tdv, tct = (sv, sdv, sct) if shifted[k] else (v, dv, ct)
            for i in range(sub):
                a = idv * xt[i, k]
                q = tv[0]
                if a < ovf:
                    for t in range(tct.shape[0]):
                        q += tdv[t] if a >= tct[t] else F(0)
                wq = wt[i, k] * q
                sx += wq * xt[i, k]
                s2 += wq * q
            if s2 > 0:
                dk = sx / s2
        scales[k] = dk


# what the weights are without an imatrix
PLAIN_X2, PLAIN_SIGMA, PLAIN_ABS = 0, 1, 2


@njit(**_OPTS)
def _weights(xs, qw, has_qw, factor, plain, w):
    """Weights of one super-block: qw*sqrtf(sigma2 + x²) with sigma2 = factor*Σx²/256, else (plain)
    x², sigma2/4 + x² or |x|.  (factor*Σx²)/256 equals Σx²*(factor/256): the division is by 2^8."""
    s = F(0)
    for j in range(QK_K):
        s += xs[j] * xs[j]
    sigma2 = (F(factor) * s) / F(QK_K)
    for j in range(QK_K):
        if has_qw:
            w[j] = qw[j] * np.sqrt(sigma2 + xs[j] * xs[j])
        elif plain == PLAIN_SIGMA:
            w[j] = F(0.25) * sigma2 + xs[j] * xs[j]
        elif plain == PLAIN_ABS:
            w[j] = abs(xs[j])
        else:
            w[j] = xs[j] * xs[j]


@njit(**_OPTS)
def row_weights(xr, qw, has_qw, block, factor, plain, w):
    """Weights of a whole row: the imatrix cleaned by QHelper (blocks of ``block``), then
    ``_weights`` per super-block."""
    n = xr.shape[0]
    wrow = np.empty(n, np.float32)
    _row_weights(xr, qw, has_qw, block, wrow)
    for sb in range(n // QK_K):
        _weights(xr[sb * QK_K:(sb + 1) * QK_K], wrow[sb * QK_K:(sb + 1) * QK_K], has_qw, factor, plain,
                 w[sb * QK_K:(sb + 1) * QK_K])


@njit(**_OPTS)
def _row_weights(xr, qw, has_qw, block, wrow):
    if has_qw:
        imatrix_cleanup_row(xr, qw, block, wrow)


@njit(**_OPTS)
def search_row(xr, qw, has_qw, sub, factor, plain, tab, stab, ntry, step, guarded, refit, ovf):
    """The first pass of every IQK row kernel: the weights (``row_weights``, QHelper blocks of
    ``sub``) and each sub-block's (scale, shifted) from ``search_lanes``."""
    n = xr.shape[0]
    w = np.empty(n, np.float32)
    scales = np.empty(n // sub, np.float32)
    shifted = np.zeros(n // sub, np.bool_)
    row_weights(xr, qw, has_qw, sub, factor, plain, w)
    search_lanes(xr, w, sub, tab, stab, ntry, step, guarded, refit, ovf, scales, shifted)
    return w, scales, shifted


@njit(cache=True, error_model="numpy", inline="always")
def nearest_in(a, shifted, tab, ovf):
    """``nearest`` in the shifted or the base half of ``tab`` (an IQ*_T tuple)."""
    v, lut, thr, sv, slut, sthr = tab
    if shifted:
        return nearest(a, sv, slut, sthr, ovf)
    return nearest(a, v, lut, thr, ovf)


@njit(cache=True, error_model="numpy", inline="always")
def encode(x, w, idl, scale, shifted, tab, ovf, L, sumqx, sumq2):
    """Codes of idl*x into L, and sumqx, sumq2 advanced, in C order, by (w*q)*x and (w*q)*q of each
    decoded value q = entry * scale.  Returns (sumqx, sumq2)."""
    for j in range(x.shape[0]):
        c = nearest_in(idl * x[j], shifted, tab, ovf)
        L[j] = c
        sumqx, sumq2 = weighted_sums(x[j], w[j], (tab[3][c] if shifted else tab[0][c]) * scale, sumqx, sumq2)
    return sumqx, sumq2


@njit(cache=True, error_model="numpy", inline="always")
def encode_at(x, w, d, l, shifted, tab, ovf, L, sumqx, sumq2):
    """``encode`` at the block scale d*l (no codes to speak of where that is 0: all become 0's
    nearest entry, as C's ``dl ? 1/dl : 0`` makes them)."""
    dl = d * F(l)
    return encode(x, w, F(1) / dl if dl != 0 else F(0), F(l), shifted, tab, ovf, L, sumqx, sumq2)


@njit(**_OPTS)
def iq4_k_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    w, all_scales, all_shifted = search_row(xr, qw, has_qw, 16, 2.0, PLAIN_X2, IQ4_C, IQ4_SC, 7, 1, False, False,
                                            OVERFLOW)
    L = np.empty(QK_K, np.int32)
    for sb in range(n // QK_K):
        xs = xr[sb * QK_K:(sb + 1) * QK_K]
        ws = w[sb * QK_K:(sb + 1) * QK_K]
        scales = all_scales[16 * sb:16 * sb + 16]
        shifted = all_shifted[16 * sb:16 * sb + 16]
        d = -first_absmax(scales)[1] / F(32)
        idv = F(1) / d if d != 0 else F(0)
        o = sb * IQ4_K_BYTES
        sumqx = F(0)
        sumq2 = F(0)
        extra = 0
        y[o + 4:o + 16] = 0
        for ib in range(16):
            l = max(-32, min(31, nint(idv * scales[ib])))
            e = 16 * ib
            sumqx, sumq2 = encode_at(xs[e:e + 16], ws[e:e + 16], d, l, shifted[ib], IQ4_T, OVERFLOW, L[e:e + 16],
                                     sumqx, sumq2)
            if shifted[ib]:
                extra |= 1 << ib
            ls = l + 32
            y[o + 8 + ib // 2] |= (ls & 0xF) << (4 * (ib % 2))
            y[o + 4 + ib // 4] |= (ls >> 4) << (2 * (ib % 4))
        store_fp16(y, o, sumqx / sumq2 if sumq2 > 0 else d)
        store_u16(y, o + 2, extra)
        for g in range(8):
            for j in range(16):
                y[o + 16 + 16 * g + j] = L[32 * g + j] | (L[32 * g + 16 + j] << 4)


@njit(**_OPTS)
def iq56_k_row(xr, qw, has_qw, ik, y):
    """IQ5_K and IQ6_K share this kernel (one signature for all row kernels): the output row length
    says which."""
    n = xr.shape[0]
    six = y.shape[0] == (n // QK_K) * IQ6_K_BYTES
    if six:
        w, all_scales, all_shifted = search_row(xr, qw, has_qw, 16, 2.0, PLAIN_SIGMA, IQ6_C, IQ6_SC, 5, 1, False,
                                                True, OVERFLOW_IQ6)
    else:
        w, all_scales, all_shifted = search_row(xr, qw, has_qw, 16, 2.0, PLAIN_SIGMA, IQ5_C, IQ5_SC, 5, 1, False,
                                                True, OVERFLOW)
    L = np.empty(QK_K, np.int32)
    bs = IQ6_K_BYTES if six else IQ5_K_BYTES
    smax = 127 if six else 32
    for sb in range(n // QK_K):
        xs = xr[sb * QK_K:(sb + 1) * QK_K]
        ws = w[sb * QK_K:(sb + 1) * QK_K]
        scales = all_scales[16 * sb:16 * sb + 16]
        shifted = all_shifted[16 * sb:16 * sb + 16]
        amax_scale, max_scale = first_absmax(scales)
        o = sb * bs
        y[o:o + bs] = 0
        if amax_scale == 0:
            continue
        d = -max_scale / F(smax)
        idv = F(1) / d
        sumqx = F(0)
        sumq2 = F(0)
        extra = 0
        for ib in range(16):
            if shifted[ib]:
                extra |= 1 << ib
            l = max(-smax, min(smax if six else smax - 1, nint(idv * scales[ib])))
            if six:
                y[o + 4 + ib] = l & 0xFF
            else:
                y[o + 8 + ib // 2] |= ((l + 32) & 0xF) << (4 * (ib % 2))
                y[o + 4 + ib // 4] |= ((l + 32) >> 4) << (2 * (ib % 4))
            dl = d * F(l)
            e = 16 * ib
            L[e:e + 16] = 0
            if dl == 0:
                continue
            idl = F(1) / dl
            if six:
                sumqx, sumq2 = encode(xs[e:e + 16], ws[e:e + 16], idl, F(l), shifted[ib], IQ6_T, OVERFLOW_IQ6,
                                      L[e:e + 16], sumqx, sumq2)
            else:
                sumqx, sumq2 = encode(xs[e:e + 16], ws[e:e + 16], idl, F(l), shifted[ib], IQ5_T, OVERFLOW,
                                      L[e:e + 16], sumqx, sumq2)
        store_fp16(y, o, sumqx / sumq2 if sumq2 > 0 else d)
        store_u16(y, o + 2, extra)
        qs = o + (20 if six else 16)
        qh = o + (148 if six else 144)
        for p in range(QK_K):
            ib32 = p // 32
            k = p % 32
            y[qs + 32 * (ib32 // 2) + k] |= (L[p] & 0xF) << (4 * (ib32 % 2))
            if six:
                y[qh + 32 * (ib32 // 4) + k] |= (L[p] >> 4) << (2 * (ib32 % 4))
            else:
                y[qh + k] |= (L[p] >> 4) << ib32


@njit(**_OPTS)
def iq3_k_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    w, all_scales, all_shifted = search_row(xr, qw, has_qw, 16, 1.5, PLAIN_SIGMA, IQ3_C, IQ3_SC, 3, 2, True, True,
                                            OVERFLOW)
    L = np.empty(16, np.int32)
    for sb in range(n // QK_K):
        xs = xr[sb * QK_K:(sb + 1) * QK_K]
        ws = w[sb * QK_K:(sb + 1) * QK_K]
        scales = all_scales[16 * sb:16 * sb + 16]
        shifted = all_shifted[16 * sb:16 * sb + 16]
        max_abs = F(0)
        for ib in range(16):
            shifted[ib] = shifted[ib] and scales[ib] != 0
            max_abs = max(max_abs, abs(scales[ib]))
        o = sb * IQ3_K_BYTES
        y[o:o + IQ3_K_BYTES] = 0
        if max_abs == 0:
            continue
        d = max_abs / F(31)
        idv = F(1) / d
        sumqx = F(0)
        sumq2 = F(0)
        extra = 0
        signs = 0
        for ib in range(16):
            if shifted[ib]:
                extra |= 1 << ib
            ls = max(0, min(15, nint(F(0.5) * (idv * abs(scales[ib]) - F(1)))))
            y[o + 6 + ib // 2] |= ls << (4 * (ib % 2))
            sls = 2 * ls + 1
            if scales[ib] < 0:
                signs |= 1 << ib
                sls = -sls
            dl = d * F(sls)
            if dl == 0:
                continue
            idl = F(1) / dl
            e = 16 * ib
            sumqx, sumq2 = encode(xs[e:e + 16], ws[e:e + 16], idl, F(sls), shifted[ib], IQ3_T, OVERFLOW, L,
                                  sumqx, sumq2)
            ib32 = ib // 2
            for j in range(16):
                k = (e + j) % 32
                y[o + 14 + 32 * (ib32 // 4) + k] |= (L[j] & 3) << (2 * (ib32 % 4))
                y[o + 78 + k] |= (L[j] >> 2) << ib32
        store_fp16(y, o, F(1.01) * (sumqx / sumq2 if sumq2 > 0 else d))
        store_u16(y, o + 2, extra)
        store_u16(y, o + 4, signs)


@njit(cache=True, error_model="numpy", inline="always")
def ks_row_scale(scales):
    """The row scale d of IQ4_KS, IQ5_KS and IQ4_KSS, max |block scale| / 127, and 1/d."""
    d = first_absmax(scales)[0] / F(127)
    return d, F(1) / d


@njit(cache=True, error_model="numpy", inline="always")
def ks_scale_code(idv, scale):
    """The 8-bit block scale of IQ4_KS / IQ5_KS / IQ4_KSS: 2*clamp(nearest((idv*scale + 127)/2), 0, 127);
    bit 0 is left for the block's shifted flag, the signed scale is the code - 127."""
    return max(0, min(127, nint(F(0.5) * (idv * scale + F(127))))) << 1


@njit(**_OPTS)
def iq4_ks_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    n_blk = n // 32
    w, scales, shifted = search_row(xr, qw, has_qw, 32, 2.0, PLAIN_X2, IQ4_C, IQ4_SC, 7, 1, False, False, OVERFLOW)
    y[:] = 0
    for b in range(n_blk):
        if shifted[b]:
            y[IQ4_KS_META + IQ4_KS_BYTES * (b // 8) + b % 8] = 1
    d, idv = ks_row_scale(scales)
    if d == 0:
        return
    sumqx = F(0)
    sumq2 = F(0)
    for b in range(n_blk):
        so = IQ4_KS_META + IQ4_KS_BYTES * (b // 8) + b % 8
        sh = y[so] & 1
        l = ks_scale_code(idv, scales[b])
        y[so] |= l
        l -= 127
        dl = d * F(l)
        idl = F(1) / dl if dl != 0 else F(0)
        qo = IQ4_KS_META + IQ4_KS_BYTES * (b // 8) + 8 + 16 * (b % 8)
        for j in range(16):
            p1 = 32 * b + j
            p2 = p1 + 16
            c1 = nearest_in(idl * xr[p1], sh == 1, IQ4_T, OVERFLOW)
            c2 = nearest_in(idl * xr[p2], sh == 1, IQ4_T, OVERFLOW)
            y[qo + j] = c1 | (c2 << 4)
            q1 = (IQ4_SV[c1] if sh else IQ4_V[c1]) * F(l)
            q2 = (IQ4_SV[c2] if sh else IQ4_V[c2]) * F(l)
            sumqx += (w[p1] * q1) * xr[p1] + (w[p2] * q2) * xr[p2]
            sumq2 += (w[p1] * q1) * q1 + (w[p2] * q2) * q2
    if sumq2 > 0:
        d = sumqx / sumq2
    store_f32(y, 0, d)


@njit(**_OPTS)
def iq53_ks_row(xr, qw, has_qw, ik, y):
    """IQ5_KS and IQ3_KS (told apart by the output row length): a row scale d in front (float32 /
    fp16), then per block of 32 a scale index (7 / 5 bits), the shifted bit and the codes (5 / 3
    bits)."""
    n = xr.shape[0]
    three = y.shape[0] == IQ3_KS_META + (n // QK_K) * IQ3_KS_BYTES
    if three:
        w, scales, shifted = search_row(xr, qw, has_qw, 32, 2.0, PLAIN_X2, IQ3_C, IQ3_SC, 5, 1, True, False,
                                        OVERFLOW)
        meta, bs = IQ3_KS_META, IQ3_KS_BYTES
    else:
        w, scales, shifted = search_row(xr, qw, has_qw, 32, 2.0, PLAIN_X2, IQ5_C, IQ5_SC, 5, 1, False, False,
                                        OVERFLOW)
        meta, bs = IQ5_KS_META, IQ5_KS_BYTES
    y[:] = 0
    for b in range(n // 32):
        if shifted[b] and three:
            y[meta + bs * (b // 8) + 1] |= 1 << (b % 8)
        elif shifted[b]:
            y[meta + bs * (b // 8) + b % 8] = 1
    amax_scale, max_scale = first_absmax(scales)
    if three:
        d = -max_scale / F(16)
        store_fp16(y, 0, d)
    else:
        d = amax_scale / F(127)
    if d == 0:
        return
    idv = F(1) / d
    sumqx = F(0)
    sumq2 = F(0)
    L = np.empty(32, np.int32)
    for b in range(n // 32):
        o = meta + bs * (b // 8)
        ib = b % 8
        xb = xr[32 * b:32 * b + 32]
        wb = w[32 * b:32 * b + 32]
        if three:
            l = max(-16, min(15, nint(idv * scales[b])))
            y[o + 2 + ib % 4] |= ((l + 16) & 0xF) << (4 * (ib // 4))
            y[o] |= ((l + 16) >> 4) << ib
            sumqx, sumq2 = encode_at(xb, wb, d, l, shifted[b], IQ3_T, OVERFLOW, L, sumqx, sumq2)
            for j in range(32):
                y[o + 6 + 32 * (ib // 4) + j] |= (L[j] & 3) << (2 * (ib % 4))
                y[o + 70 + j] |= (L[j] >> 2) << ib
        else:
            code = ks_scale_code(idv, scales[b])
            y[o + ib] |= code
            sumqx, sumq2 = encode_at(xb, wb, d, code - 127, shifted[b], IQ5_T, OVERFLOW, L, sumqx, sumq2)
            for j in range(32):
                y[o + 8 + 32 * (ib // 2) + j] |= (L[j] & 0xF) << (4 * (ib % 2))
                y[o + 136 + j] |= (L[j] >> 4) << ib
    if sumq2 > 0 and three:
        store_fp16(y, 0, sumqx / sumq2)
    elif not three:
        store_f32(y, 0, sumqx / sumq2 if sumq2 > 0 else d)


ROW_KERNELS = {IQ3_K: iq3_k_row, IQ4_K: iq4_k_row, IQ5_K: iq56_k_row, IQ6_K: iq56_k_row, IQ4_KS: iq4_ks_row,
               IQ5_KS: iq53_ks_row, IQ3_KS: iq53_ks_row}


def quantize_rows(qtype, x, qw, has_qw, out):
    """Quantize rows x (n_rows, n_per_row) to ``qtype`` in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, True, out)


# ---- decoding ----


@njit(**_OPTS)
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y (the C to_float)."""
    n = y.shape[0]
    if qtype == IQ5_KS:
        d = b[0:4].copy().view(np.float32)[0]
        for blk in range(n // 32):
            o = IQ5_KS_META + IQ5_KS_BYTES * (blk // 8)
            ib = blk % 8
            s = np.int64(b[o + ib])
            dl = d * F((s & 254) - 127)
            for j in range(32):
                q = ((np.int64(b[o + 8 + 32 * (ib // 2) + j]) >> (4 * (ib % 2))) & 0xF) | \
                    (((np.int64(b[o + 136 + j]) >> ib) & 1) << 4)
                y[32 * blk + j] = dl * F(IQ5NL_VALUES[q + 32 * (s & 1)])
        return
    if qtype == IQ3_KS:
        d = fp16_at(b, 0, fp16_table)
        for blk in range(n // 32):
            o = IQ3_KS_META + IQ3_KS_BYTES * (blk // 8)
            ib = blk % 8
            extra = np.int64(b[o]) | (np.int64(b[o + 1]) << 8)
            ls = (((np.int64(b[o + 2 + ib % 4]) >> (4 * (ib // 4))) & 0xF) | (((extra >> ib) & 1) << 4)) - 16
            dl = d * F(ls)
            for j in range(32):
                q = ((np.int64(b[o + 6 + 32 * (ib // 4) + j]) >> (2 * (ib % 4))) & 3) | \
                    (((np.int64(b[o + 70 + j]) >> ib) & 1) << 2)
                y[32 * blk + j] = dl * F(IQ3NL_VALUES[q + 8 * ((extra >> (8 + ib)) & 1)])
        return
    if qtype == IQ4_KS:
        d = b[0:4].copy().view(np.float32)[0]
        for blk in range(n // 32):
            o = IQ4_KS_META + IQ4_KS_BYTES * (blk // 8)
            s = np.int64(b[o + blk % 8])
            dl = d * F((s & 254) - 127)
            for j in range(16):
                q = np.int64(b[o + 8 + 16 * (blk % 8) + j])
                y[32 * blk + j] = dl * F(IQ4K_VALUES[(q & 0xF) + 16 * (s & 1)])
                y[32 * blk + j + 16] = dl * F(IQ4K_VALUES[(q >> 4) + 16 * (s & 1)])
        return
    for sb in range(n // QK_K):
        e = sb * QK_K
        if qtype == IQ3_K:
            o = sb * IQ3_K_BYTES
            d = fp16_at(b, o, fp16_table)
            extra = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
            signs = np.int64(b[o + 4]) | (np.int64(b[o + 5]) << 8)
            # per 16 values one scale: worked out once, the values' loop left with loads and a lookup
            for ib in range(16):
                ib32 = ib // 2
                mag = (np.int64(b[o + 6 + ib // 2]) >> (4 * (ib % 2))) & 0xF
                ls = (2 * mag + 1) * (-1 if (signs >> ib) & 1 else 1)
                dl = d * F(ls)
                shift = 8 * ((extra >> ib) & 1)
                lo_at = o + 14 + 32 * (ib32 // 4) + 16 * (ib % 2)
                lo_shift = 2 * (ib32 % 4)
                hi_at = o + 78 + 16 * (ib % 2)
                for j in range(16):
                    q = ((np.int64(b[lo_at + j]) >> lo_shift) & 3) | (((np.int64(b[hi_at + j]) >> ib32) & 1) << 2)
                    y[e + 16 * ib + j] = dl * F(IQ3NL_VALUES[q + shift])
        elif qtype == IQ4_K:
            o = sb * IQ4_K_BYTES
            d = fp16_at(b, o, fp16_table)
            extra = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
            for ib in range(16):
                ls = (((np.int64(b[o + 8 + ib // 2]) >> (4 * (ib % 2))) & 0xF)
                      | (((np.int64(b[o + 4 + ib // 4]) >> (2 * (ib % 4))) & 3) << 4)) - 32
                dl = d * F(ls)
                shift = 16 * ((extra >> ib) & 1)
                at = o + 16 + 16 * (ib // 2)
                nibble = 4 * (ib % 2)
                for j in range(16):
                    q = (np.int64(b[at + j]) >> nibble) & 0xF
                    y[e + 16 * ib + j] = dl * F(IQ4K_VALUES[q + shift])
        else:
            six = qtype == IQ6_K
            o = sb * (IQ6_K_BYTES if six else IQ5_K_BYTES)
            d = fp16_at(b, o, fp16_table)
            extra = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
            qs = o + (20 if six else 16)
            qh = o + (148 if six else 144)
            for ib in range(16):
                ib32 = ib // 2
                sh = (extra >> ib) & 1
                if six:
                    ls = np.int64(np.int8(b[o + 4 + ib]))
                else:
                    ls = (((np.int64(b[o + 8 + ib // 2]) >> (4 * (ib % 2))) & 0xF)
                          | (((np.int64(b[o + 4 + ib // 4]) >> (2 * (ib % 4))) & 3) << 4)) - 32
                dl = d * F(ls)
                lo_at = qs + 32 * (ib32 // 2) + 16 * (ib % 2)
                lo_shift = 4 * (ib32 % 2)
                if six:
                    for j in range(16):
                        k = 16 * (ib % 2) + j
                        lo = (np.int64(b[lo_at + j]) >> lo_shift) & 0xF
                        q = F(lo | (((np.int64(b[qh + 32 * (ib32 // 4) + k]) >> (2 * (ib32 % 4))) & 3) << 4))
                        v = (A_IQ6K + q * (B_IQ6K + q * (-C_IQ6K + q * D_IQ6K))) + F(sh)
                        y[e + 16 * ib + j] = dl * v
                else:
                    for j in range(16):
                        lo = (np.int64(b[lo_at + j]) >> lo_shift) & 0xF
                        q = lo | (((np.int64(b[qh + 16 * (ib % 2) + j]) >> ib32) & 1) << 4)
                        y[e + 16 * ib + j] = dl * F(IQ5NL_VALUES[q + 32 * sh])


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32 (the C to_float)."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
