"""numba kernels for IQ1_S, IQ1_M (both flavors) and ik's IQ1_S_R4, IQ1_M_R4.

The quantizers of :mod:`quantkit.formats.iq1` (its docstring has the formats).  All four search,
per block of 32 (IQ1_S) or 16 (IQ1_M) values, the two boundaries that split the sorted values into
the levels -1, 0, +1 (ggml's ``iq1s_process_1block`` / ``iq1m_process_1block``), then snap each
group of 8 levels to the 2048-point lattice ``kgrid_1bit_2048`` (``kmap``; off-lattice codes take
the nearest of their precomputed neighbours, ``iq1_find_best_neighbour2``).

The lattice map and neighbour lists (``iq2xs_init_impl`` for IQ1_S/IQ1_M: nwant = 3 distinct
distances) are built once at import, in numpy, and only for the 3^8 codes whose levels are 0..2
(the only ones these quantizers look up).

The split searches follow C's float order exactly (mainline's IQ1_M is llama.cpp's current
prefix-sum form, which the golden vectors' build has; the ggml repository's copy still sums every
pair afresh and differs in ties).

ik's IQ1_M and IQ1_M_R4 read a shift they never set for a block whose values are all ~0 (C's
``shifts[ib]`` / ``shift1``, ``shift2``: left over from the block processed before, in the same call
of the quantizer).  The stateful kernels take that carried state (``state``) in and give it out;
:func:`quantize_rows` runs the rows in parallel assuming 0, then re-runs the few rows that read a
carried value with the one the rows before them left, as one call over the whole matrix would.
"""
from __future__ import annotations

import warnings

import numpy as np
from numba import NumbaExperimentalFeatureWarning, njit, prange, types

from ..grids import IQ1S_VALUES, KGRID_1BIT_2048
from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from .common import (F, FLT_MAX, I32, QK_K, ROW_SIG, _compile_once, block_bytes, decode_rows, fp16_at,
                     fp16_bits, nint, run_rows, superblock_sum_sq, take_trial, type_ids)

IQ1_S, IQ1_M, IQ1_S_R4, IQ1_M_R4 = type_ids(T.IQ1_S, T.IQ1_M, T.IQ1_S_R4, T.IQ1_M_R4)
IQ1_S_BYTES, IQ1_M_BYTES = block_bytes(T.IQ1_S, T.IQ1_M)
R4_BLOCK = traits(T.IQ1_S_R4).block_size                   # 32 values per row and block
IQ1_S_R4_BYTES = 4 * traits(T.IQ1_S_R4).type_size          # 24: block_iq1_s_r4 of 4 rows
IQ1_M_R4_BYTES = 4 * traits(T.IQ1_M_R4).type_size          # 28: block_iq1_m_r4

DELTA = F(0.125)                                            # IQ1S_DELTA = IQ1M_DELTA
X_P = np.array([-1 + 0.125, 0.125, 1 + 0.125], np.float32)  # levels with the +delta shift
X_M = np.array([-1 - 0.125, -0.125, 1 - 0.125], np.float32)
XX = np.stack([X_P, X_M])                                   # XX[minus]: the level values of a shift
MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)       # IQ1_M: shift bits of the two 8-groups
EPS_IQ1_S = F(1e-12)                                        # GROUP_MAX_EPS_IQ1_S
EPS_IQ1_M = F(1e-7)                                         # GROUP_MAX_EPS_IQ1_M
EPS_R4 = F(1e-14)
FLT_MIN = F(np.finfo(np.float32).tiny)
ZERO_POINT = 1029                                           # the lattice point of 8 zeros (level 1)
N_STATE = 16                                                # carried shifts (IQ1_M: one per 16-block)


# ---- the lattice: levels of each point, the map from level codes, the neighbour lists ----

def _lattice():
    """(levels (2048, 8) of each point, kmap (43692,) int32: the point of a code or -1 - slot,
    neighbour list offsets (slots + 1,), neighbours flat) as iq2xs_init_impl builds them (a code's
    neighbours: the points at its nwant = 3 smallest distances, by distance then index)."""
    kg = KGRID_1BIT_2048.astype(np.int64)
    shifts = 2 * np.arange(8)
    levels = ((kg[:, None] >> shifts) & 3).astype(np.int8)
    kmap = np.full(43692, -1, np.int32)
    kmap[kg] = np.arange(kg.shape[0], dtype=np.int32)
    digits = (np.arange(3 ** 8)[:, None] // 3 ** np.arange(8)) % 3            # every code of levels 0..2
    codes = (digits << shifts).sum(1)
    off = kmap[codes] < 0
    codes, digits = codes[off], digits[off].astype(np.int16)
    # squared distances |a|² + |b|² - 2 a.b, exact in float32 (small integers), as int8
    a, g = digits.astype(np.float32), levels.astype(np.float32)
    d2 = a @ g.T
    d2 *= -2
    d2 += (a * a).sum(1)[:, None]
    d2 += (g * g).sum(1)[None, :]
    d2 = d2.astype(np.int8)
    third = d2.min(axis=1)                                                    # the 3rd smallest distance
    for _ in range(2):
        third = np.where(d2 > third[:, None], d2, np.int8(127)).min(axis=1)
    row, point = np.nonzero(d2 <= third[:, None])
    # nonzero gives (code, point) in order: a stable sort by (code, distance) keeps points in order
    order = np.argsort(row * 64 + d2[row, point], kind="stable")
    row, point = row[order], point[order]
    starts = np.searchsorted(row, np.arange(codes.shape[0] + 1)).astype(np.int32)
    kmap[codes] = -1 - np.arange(codes.shape[0], dtype=np.int32)
    return levels, kmap, starts, point.astype(np.int16)     # int16: numba embeds arrays < 1 MB in the code


LEVELS, KMAP, NB_START, NB_POINTS = _lattice()
GRID_VALUES = IQ1S_VALUES                                                   # the decoders' -1/0/+1


# ---- shared pieces ----

@njit(cache=True, error_model="numpy")
def _sort_order(xb, order):
    """order = the indices of xb by ascending value, equal values in index order (glibc's qsort of
    these small arrays is a stable merge sort)."""
    n = xb.shape[0]
    for j in range(n):
        order[j] = j
    for j in range(1, n):
        v = order[j]
        key = xb[v]
        i = j - 1
        while i >= 0 and xb[order[i]] > key:
            order[i + 1] = order[i]
            i -= 1
        order[i + 1] = v


@njit(cache=True, error_model="numpy")
def _snap(xb, w, L, o, scale, minus):
    """The lattice point of the 8 levels L[o:o+8]; off the lattice, the neighbour nearest to xb at
    ``scale`` with the level values XX[minus] (iq1_find_best_neighbour2), whose levels replace L's."""
    u = 0
    for j in range(8):
        u |= np.int64(L[o + j]) << (2 * j)
    g = KMAP[u]
    if g >= 0:
        return g, True
    slot = -1 - g
    best = FLT_MAX
    g = -1
    for t in range(NB_START[slot], NB_START[slot + 1]):
        p = NB_POINTS[t]
        d2 = F(0)
        for i in range(8):
            diff = scale * XX[minus, LEVELS[p, i]] - xb[o + i]
            d2 += w[o + i] * diff * diff
        if d2 < best:
            best = d2
            g = p
    if g < 0:                   # C then reads out of bounds; every candidate was NaN or infinite
        g = NB_POINTS[NB_START[slot]]
    for i in range(8):
        L[o + i] = LEVELS[g, i]
    return g, False


@njit(cache=True, error_model="numpy")
def _levels_from_split(order, i1, i2, L, mirror):
    """Levels 0, 1, 2 of the sorted values before i1, before i2 and after; ``mirror`` (the scale
    came out negative): 2 - level."""
    n = order.shape[0]
    for j in range(n):
        lv = 0 if j < i1 else (1 if j < i2 else 2)
        L[order[j]] = 2 - lv if mirror else lv


@njit(cache=True, error_model="numpy", inline="always")
def _split_sums(p, i1, i2, n):
    """The three groups' sums from the prefix sums p[0..n]: before i1, i1..i2, from i2."""
    return p[i1] - p[0], p[i2] - p[i1], p[n] - p[i2]


@njit(cache=True, error_model="numpy")
def iq1s_block(xb, w, best0, scr, L, index):
    """iq1s_process_1block on one block of 32 (or any multiple of 8): (scale, shift +-1, found).
    ``best0``: the first best score (ik -FLT_MIN, mainline -FLT_MAX); not found: no split had
    Σw > 0 (ik asserts, mainline writes a zero block).  index[k]: the lattice point of group k."""
    n = xb.shape[0]
    mx = abs(xb[0])
    for i in range(1, n):
        a = abs(xb[i])
        mx = mx if mx > a else a
    if mx < EPS_IQ1_S:
        for k in range(n // 8):
            index[k] = 0
        return F(0), 1, True
    order = scr[0].view(np.int32)[:n]
    sumx, sumw = scr[1], scr[2]
    _sort_order(xb, order)
    sumx[0] = F(0)
    sumw[0] = F(0)
    for j in range(n):
        i = order[j]
        sumx[j + 1] = sumx[j] + w[i] * xb[i]
        sumw[j + 1] = sumw[j] + w[i]
    xp0, xp1, xp2 = X_P[0], X_P[1], X_P[2]
    xm0, xm1, xm2 = X_M[0], X_M[1], X_M[2]
    best = best0
    scale = mx
    besti1 = -1
    besti2 = -1
    shift = 0
    sxn = sumx[n]
    swn = sumw[n]
    for i1 in range(n + 1):
        ax = sumx[i1] - sumx[0]
        aw = sumw[i1] - sumw[0]
        for i2 in range(i1, n + 1):
            bx = sumx[i2] - sumx[i1]
            cx = sxn - sumx[i2]
            bw = sumw[i2] - sumw[i1]
            cw = swn - sumw[i2]
            taken, scale, best = take_trial(ax * xp0 + bx * xp1 + cx * xp2,
                                            aw * xp0 * xp0 + bw * xp1 * xp1 + cw * xp2 * xp2, scale, best)
            if taken:
                besti1, besti2, shift = i1, i2, 1
            taken, scale, best = take_trial(ax * xm0 + bx * xm1 + cx * xm2,
                                            aw * xm0 * xm0 + bw * xm1 * xm1 + cw * xm2 * xm2, scale, best)
            if taken:
                besti1, besti2, shift = i1, i2, -1
    if besti1 < 0:
        return F(0), 1, False
    _levels_from_split(order, besti1, besti2, L, scale < 0)
    if scale < 0:
        scale = -scale
        shift = -shift
    minus = 0 if shift == 1 else 1
    on_grid = True
    for k in range(n // 8):
        index[k], on = _snap(xb, w, L, 8 * k, scale, minus)
        on_grid = on_grid and on
    if not on_grid:
        scale = _refit(xb, w, L, scale, minus, minus)
    return scale, shift, True


@njit(cache=True, error_model="numpy")
def _refit(xb, w, L, scale, minus_first8, minus_rest):
    """The scale refitted to the snapped levels, Σ(w q) x / Σ(w q) q in C's order (values 0-7 with
    the levels XX[minus_first8], the rest XX[minus_rest]); ``scale`` unless both sums are > 0."""
    sqx = F(0)
    sq2 = F(0)
    for j in range(xb.shape[0]):
        q = XX[minus_first8 if j < 8 else minus_rest, L[j]]
        sqx += w[j] * q * xb[j]
        sq2 += w[j] * q * q
    if sqx > 0 and sq2 > 0:
        return sqx / sq2
    return scale


@njit(cache=True, error_model="numpy")
def _half(k, j):
    """Whether value j of a 16-block takes the -1/8 levels for shift combination k (0: +,+; 1: +,-;
    2: -,+; 3: -,-; the first sign for values 0-7): the row of XX."""
    return (k >> 1) if j < 8 else (k & 1)


@njit(cache=True, error_model="numpy")
def iq1m_block(xb, w, ik, scr, L, index):
    """iq1m_process_1block (ik) or mainline's inline copy on a block of 16: (scale, k, found)."""
    n = 16
    order = scr[0].view(np.int32)[:n]
    _sort_order(xb, order)
    sqx = scr[3][:4]
    sq2 = scr[3][4:8]
    xp0, xp1, xp2 = X_P[0], X_P[1], X_P[2]
    xm0, xm1, xm2 = X_M[0], X_M[1], X_M[2]
    besti1 = -1
    besti2 = -1
    best_k = -1
    # prefix sums over the sorted values of each half: Σ w x (sx1, sx2), Σ w (sw1, sw2)
    sx1, sx2, sw1, sw2 = scr[1], scr[2], scr[4], scr[5]
    sx1[0] = F(0)
    sx2[0] = F(0)
    sw1[0] = F(0)
    sw2[0] = F(0)
    for j in range(n):
        i = order[j]
        if i < n // 2:
            sw1[j + 1] = sw1[j] + w[i]
            sx1[j + 1] = sx1[j] + w[i] * xb[i]
            sw2[j + 1] = sw2[j]
            sx2[j + 1] = sx2[j]
        else:
            sw2[j + 1] = sw2[j] + w[i]
            sx2[j + 1] = sx2[j] + w[i] * xb[i]
            sw1[j + 1] = sw1[j]
            sx1[j + 1] = sx1[j]
    if ik:
        best = F(0)
        scale = F(0)
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                a1, b1, c1 = _split_sums(sx1, i1, i2, n)
                a2, b2, c2 = _split_sums(sx2, i1, i2, n)
                u1, v1, t1 = _split_sums(sw1, i1, i2, n)
                u2, v2, t2 = _split_sums(sw2, i1, i2, n)
                px1 = a1 * xp0 + b1 * xp1 + c1 * xp2
                mx1 = a1 * xm0 + b1 * xm1 + c1 * xm2
                sqx[0] = px1 + a2 * xp0 + b2 * xp1 + c2 * xp2
                sqx[1] = px1 + a2 * xm0 + b2 * xm1 + c2 * xm2
                sqx[2] = mx1 + a2 * xp0 + b2 * xp1 + c2 * xp2
                sqx[3] = mx1 + a2 * xm0 + b2 * xm1 + c2 * xm2
                pw1 = u1 * xp0 * xp0 + v1 * xp1 * xp1 + t1 * xp2 * xp2
                mw1 = u1 * xm0 * xm0 + v1 * xm1 * xm1 + t1 * xm2 * xm2
                sq2[0] = pw1 + u2 * xp0 * xp0 + v2 * xp1 * xp1 + t2 * xp2 * xp2
                sq2[1] = pw1 + u2 * xm0 * xm0 + v2 * xm1 * xm1 + t2 * xm2 * xm2
                sq2[2] = mw1 + u2 * xp0 * xp0 + v2 * xp1 * xp1 + t2 * xp2 * xp2
                sq2[3] = mw1 + u2 * xm0 * xm0 + v2 * xm1 * xm1 + t2 * xm2 * xm2
                for k in range(4):
                    taken, scale, best = take_trial(sqx[k], sq2[k], scale, best)
                    if taken:
                        besti1, besti2, best_k = i1, i2, k
    else:
        # mainline (llama.cpp since its prefix-sum rewrite of this search; ggml's own copy still
        # sums each pair's terms afresh): prefix sums per half, and since the level steps are 1,
        # a split's sums collapse to T*v[2] - (p[i1] + p[i2]) and T_w*v[2]² + w[i1]*c1 + w[i2]*c2
        mx = abs(xb[0])
        for i in range(1, n):
            a = abs(xb[i])
            mx = mx if mx > a else a
        px0, px1, pw0, pw1 = sx1, sx2, sw1, sw2
        cp1 = xp0 * xp0 - xp1 * xp1
        cp2 = xp1 * xp1 - xp2 * xp2
        cm1 = xm0 * xm0 - xm1 * xm1
        cm2 = xm1 * xm1 - xm2 * xm2
        tp0 = px0[n] * xp2
        tm0 = px0[n] * xm2
        tp1 = px1[n] * xp2
        tm1 = px1[n] * xm2
        wp0 = pw0[n] * xp2 * xp2
        wm0 = pw0[n] * xm2 * xm2
        wp1 = pw1[n] * xp2 * xp2
        wm1 = pw1[n] * xm2 * xm2
        best = -FLT_MAX
        scale = mx
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                s0 = px0[i1] + px0[i2]
                s1 = px1[i1] + px1[i2]
                qxp0 = tp0 - s0
                qxm0 = tm0 - s0
                qxp1 = tp1 - s1
                qxm1 = tm1 - s1
                q2p0 = wp0 + pw0[i1] * cp1 + pw0[i2] * cp2
                q2m0 = wm0 + pw0[i1] * cm1 + pw0[i2] * cm2
                q2p1 = wp1 + pw1[i1] * cp1 + pw1[i2] * cp2
                q2m1 = wm1 + pw1[i1] * cm1 + pw1[i2] * cm2
                sqx[0] = qxp0 + qxp1
                sqx[1] = qxp0 + qxm1
                sqx[2] = qxm0 + qxp1
                sqx[3] = qxm0 + qxm1
                sq2[0] = q2p0 + q2p1
                sq2[1] = q2p0 + q2m1
                sq2[2] = q2m0 + q2p1
                sq2[3] = q2m0 + q2m1
                for k in range(4):
                    taken, scale, best = take_trial(sqx[k], sq2[k], scale, best)
                    if taken:
                        besti1, besti2, best_k = i1, i2, k
    if best_k < 0:
        return F(0), 0, False
    _levels_from_split(order, besti1, besti2, L, scale < 0)
    if scale < 0:
        scale = -scale
        best_k = 3 - best_k
    on_grid = True
    for k in range(2):
        index[k], on = _snap(xb, w, L, 8 * k, scale, _half(best_k, 8 * k))
        on_grid = on_grid and on
    if not on_grid:
        if ik:
            for k in range(8):
                scr[3][k] = F(0)
            for j in range(n):
                wj = w[j]
                qp = X_P[L[j]]
                qm = X_M[L[j]]
                sqx[0] += wj * xb[j] * qp
                sq2[0] += wj * qp * qp
                sqx[3] += wj * xb[j] * qm
                sq2[3] += wj * qm * qm
                if j < 8:
                    sqx[1] += wj * xb[j] * qp
                    sq2[1] += wj * qp * qp
                    sqx[2] += wj * xb[j] * qm
                    sq2[2] += wj * qm * qm
                else:
                    sqx[2] += wj * xb[j] * qp
                    sq2[2] += wj * qp * qp
                    sqx[1] += wj * xb[j] * qm
                    sq2[1] += wj * qm * qm
            best = F(0)
            for k in range(4):
                if sqx[k] > 0 and sq2[k] > 0 and sqx[k] * sqx[k] > best * sq2[k]:
                    scale = sqx[k] / sq2[k]
                    best = scale * sqx[k]
                    best_k = k
        else:
            scale = _refit(xb, w, L, scale, _half(best_k, 0), _half(best_k, 8))
    return scale, best_k, True


@njit(cache=True, error_model="numpy")
def _block_scratch(n):
    """For blocks of n values: the block searches' scratch (sort order, prefix sums, trial sums),
    weights, levels, and one lattice point per 8 values."""
    return np.empty((6, 33), np.float32), np.empty(n, np.float32), np.empty(n, np.int8), np.empty(n // 8, np.int64)


# ---- IQ1_S: block_iq1_s { fp16 d @0; qs[32] @2; uint16 qh[8] @34 } ----

@njit(cache=True, error_model="numpy")
def iq1_s_row(xr, qw, has_qw, ik, y):
    nbl = xr.shape[0] // QK_K
    scr, w, L, index = _block_scratch(32)
    scales = np.empty(8, np.float32)
    shifts = np.empty(8, np.int64)
    best0 = -FLT_MIN if ik else -FLT_MAX
    for ibl in range(nbl):
        o = ibl * IQ1_S_BYTES
        for j in range(IQ1_S_BYTES):
            y[o + j] = 0
        xbl = xr[QK_K * ibl:QK_K * (ibl + 1)]
        sigma2 = F(2) * superblock_sum_sq(xr, QK_K * ibl) / F(QK_K)
        max_scale = F(0)
        for ib in range(QK_K // 32):
            xb = xbl[32 * ib:32 * ib + 32]
            for i in range(32):
                qwi = qw[QK_K * ibl + 32 * ib + i] if has_qw else F(1)
                w[i] = qwi * np.sqrt(sigma2 + xb[i] * xb[i])
            s, shift, found = iq1s_block(xb, w, best0, scr, L, index)
            if not found:
                index[:] = 0
            h = 0
            for k in range(4):
                y[o + 2 + 4 * ib + k] = index[k] & 255
                h |= (index[k] >> 8) << (3 * k)
            y[o + 34 + 2 * ib] = h & 0xFF
            y[o + 35 + 2 * ib] = h >> 8
            scales[ib] = s
            shifts[ib] = shift
            max_scale = max_scale if max_scale > s else s
        if not max_scale:
            continue
        d = max_scale / F(15)
        h16 = fp16_bits(d * F(1.125))
        y[o] = h16 & 0xFF
        y[o + 1] = h16 >> 8
        idv = F(1) / d
        for ib in range(QK_K // 32):
            l = nint(F(0.5) * (idv * scales[ib] - F(1)))
            l = max(I32(0), min(I32(7), l))
            if shifts[ib] == -1:
                l |= 8
            y[o + 35 + 2 * ib] |= l << 4


# ---- IQ1_M: block_iq1_m { qs[32] @0; qh[16] @32; scales[8] @48 (4 uint16: 3-bit block scales,
#      the fp16 super-block scale in their top nibbles) } ----

@njit(cache=True, error_model="numpy")
def _weights16(xb, qw, o, has_qw, sigma2, w):
    for i in range(16):
        w[i] = qw[o + i] * np.sqrt(sigma2 + xb[i] * xb[i]) if has_qw else xb[i] * xb[i]


@njit(cache=True, error_model="numpy")
def iq1_m_row_state(xr, qw, has_qw, ik, y, state):
    """One row; ``state``: ik's carried shifts (state[0:16] in and out), which positions this row
    set (state[16:32]) and whether it read one it had not set (state[32])."""
    nbl = xr.shape[0] // QK_K
    scr, w, L, index = _block_scratch(16)
    scales = np.empty(16, np.float32)
    sigma = np.empty(8, np.float32)
    sc = np.empty(4, np.int64)
    for ibl in range(nbl):
        o = ibl * IQ1_M_BYTES
        for j in range(IQ1_M_BYTES):
            y[o + j] = 0
        xbl = xr[QK_K * ibl:QK_K * (ibl + 1)]
        if ik:
            for ib in range(8):
                s2 = F(0)
                for i in range(32):
                    s2 += xbl[32 * ib + i] * xbl[32 * ib + i]
                sigma[ib] = F(1.5) * s2 / F(32)
        else:
            s2 = F(0)
            for i in range(QK_K):
                s2 += xbl[i] * xbl[i]
            for ib in range(8):
                sigma[ib] = F(2) * s2 / F(QK_K)
        max_scale = F(0)
        for ib in range(16):
            xb = xbl[16 * ib:16 * ib + 16]
            _weights16(xb, qw, QK_K * ibl + 16 * ib, has_qw, sigma[ib // 2], w)
            mx = abs(xb[0])
            sumwx = F(0)
            for i in range(1, 16):
                a = abs(xb[i])
                mx = mx if mx > a else a
                sumwx += w[i] * a
            if mx < EPS_IQ1_M:
                scales[ib] = F(0)
                if not ik:
                    state[ib] = 0
                    state[N_STATE + ib] = 1
                elif state[N_STATE + ib] == 0:
                    state[2 * N_STATE] = 1          # reads the shift a block before this row left
                continue
            if ik and sumwx == 0:                   # weights zero wherever x is not: ignore them
                for i in range(16):
                    w[i] = xb[i] * xb[i]
            s, k, found = iq1m_block(xb, w, ik, scr, L, index)
            if not found:                           # mainline: a zero block (ik asserts)
                scales[ib] = F(0)
                state[ib] = 0
                state[N_STATE + ib] = 1
                continue
            y[o + 2 * ib] = index[0] & 255
            y[o + 2 * ib + 1] = index[1] & 255
            y[o + 32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            scales[ib] = s
            state[ib] = k
            state[N_STATE + ib] = 1
            max_scale = max_scale if max_scale > s else s
        if not max_scale:
            continue
        d = max_scale / F(15)
        idv = F(1) / d
        fx = F(0)
        f2 = F(0)
        sc[:] = 0
        for ib in range(16):
            l = nint(F(0.5) * (idv * scales[ib] - F(1)))
            l = max(I32(0), min(I32(7), l))
            sc[ib // 4] |= np.int64(l) << (3 * (ib % 4))
            shift = state[ib]
            qh = np.int64(y[o + 32 + ib]) | MASKS[shift]
            y[o + 32 + ib] = qh
            xb = xbl[16 * ib:16 * ib + 16]
            _weights16(xb, qw, QK_K * ibl + 16 * ib, has_qw, sigma[ib // 2], w)
            for k in range(2):
                minus = _half(shift, 8 * k)
                p = np.int64(y[o + 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    wj = w[8 * k + j]
                    q = XX[minus, LEVELS[p, j]] * F(2 * l + 1)
                    fx += wj * q * xb[8 * k + j]
                    f2 += wj * q * q
        if f2 > 0:
            d = fx / f2
        s16 = fp16_bits(d * (F(1.085) if ik else F(1.1125)))
        sc[0] |= (s16 & 0x000F) << 12
        sc[1] |= (s16 & 0x00F0) << 8
        sc[2] |= (s16 & 0x0F00) << 4
        sc[3] |= s16 & 0xF000
        for i in range(4):
            y[o + 48 + 2 * i] = sc[i] & 0xFF
            y[o + 49 + 2 * i] = (sc[i] >> 8) & 0xFF


# ---- IQ1_S_R4 / IQ1_M_R4 (ik only): a "row" here is a group of 4 rows, x[k * n + i]; the group's
#      bytes are 4 fp16 row scales, then per 32 columns one block of the 4 rows ----

@njit(cache=True, error_model="numpy")
def _r4_weights(xb, qw, o, use_qw, sigma2, w, lo, hi):
    for j in range(lo, hi):
        w[j] = qw[o + j] * np.sqrt(sigma2 + xb[j] * xb[j]) if use_qw else np.sqrt(sigma2 + xb[j] * xb[j])


@njit(cache=True, error_model="numpy")
def _r4_scratch(qw, scales_per_block):
    """(values per row, blocks per row, block-search scratch, weights, levels, points, block scales
    (blocks, scales_per_block), the 4 rows' largest scales) for one group of 4 rows."""
    n = qw.shape[0]
    nblock = n // R4_BLOCK
    scr, w, L, index = _block_scratch(32)
    return n, nblock, scr, w, L, index, np.empty((nblock, scales_per_block), np.float32), np.zeros(4, np.float32)


@njit(cache=True, error_model="numpy")
def iq1_s_r4_row(xg, qw, has_qw, ik, y):
    n, nblock, scr, w, L, index, scales, mx = _r4_scratch(qw, 4)
    for ibl in range(nblock):
        o = 8 + IQ1_S_R4_BYTES * ibl
        for k in range(4):
            xb = xg[k * n + 32 * ibl:k * n + 32 * ibl + 32]
            sumx2 = F(0)
            for j in range(32):
                sumx2 += xb[j] * xb[j]
            if sumx2 < EPS_R4:
                scales[ibl, k] = F(0)
                for i in range(4):
                    y[o + 4 * i + k] = ZERO_POINT & 255
                h = 0
                for i in range(4):
                    h |= (ZERO_POINT >> 8) << (3 * i)
                y[o + 16 + 2 * k] = h & 0xFF
                y[o + 17 + 2 * k] = h >> 8
                continue
            sigma2 = F(1.5) * sumx2 / F(32)
            use_qw = has_qw
            if has_qw:
                _r4_weights(xb, qw, 32 * ibl, True, sigma2, w, 0, 32)
                sumwx = F(0)
                for j in range(32):
                    sumwx += w[j] * abs(xb[j])
                use_qw = not (sumwx < EPS_R4)
            if not use_qw:
                _r4_weights(xb, qw, 32 * ibl, False, sigma2, w, 0, 32)
            s, shift, found = iq1s_block(xb, w, -FLT_MIN, scr, L, index)
            if not found:                   # C asserts; write the zero block
                s = F(0)
                shift = 1
                for i in range(4):
                    index[i] = ZERO_POINT
            scales[ibl, k] = s
            mx[k] = s if mx[k] < s else mx[k]
            h = 0
            for i in range(4):
                y[o + 4 * i + k] = index[i] & 255
                h |= (index[i] >> 8) << (3 * i)
            if shift < 0:
                h |= 0x8000
            y[o + 16 + 2 * k] = h & 0xFF
            y[o + 17 + 2 * k] = h >> 8
    invd = _r4_row_scales(mx, y)
    for ibl in range(nblock):
        o = 8 + IQ1_S_R4_BYTES * ibl
        for k in range(4):
            ls = nint(F(0.5) * (scales[ibl, k] * invd[k] - F(1)))
            ls = max(I32(0), min(I32(7), ls))
            y[o + 17 + 2 * k] |= ls << 4


@njit(cache=True, error_model="numpy")
def _r4_row_scales(mx, y):
    """The 4 fp16 row scales 1.0625*max/15 at y[0:8]; returns 15/max (0 for max 0)."""
    invd = np.empty(4, np.float32)
    for k in range(4):
        h = fp16_bits(F(1.0625) * mx[k] / F(15))
        y[2 * k] = h & 0xFF
        y[2 * k + 1] = h >> 8
        invd[k] = F(15) / mx[k] if mx[k] else F(0)
    return invd


@njit(cache=True, error_model="numpy")
def iq1_m_r4_row_state(xg, qw, has_qw, ik, y, state):
    """One group of 4 rows; ``state``: the carried shift1, shift2 (state[0:2]), set here
    (state[16:18]), read before set (state[32])."""
    n, nblock, scr, w, L, index, scales, mx = _r4_scratch(qw, 8)
    for ibl in range(nblock):
        o = 8 + IQ1_M_R4_BYTES * ibl
        for k in range(4):
            xb = xg[k * n + 32 * ibl:k * n + 32 * ibl + 32]
            s2l = F(0)
            s2h = F(0)
            for j in range(16):
                s2l += xb[j] * xb[j]
            for j in range(16, 32):
                s2h += xb[j] * xb[j]
            sumx2 = s2l + s2h
            if sumx2 < EPS_R4:
                scales[ibl, 2 * k] = F(0)
                scales[ibl, 2 * k + 1] = F(0)
                for i in range(4):
                    y[o + 4 * i + k] = ZERO_POINT & 255
                for i in range(2):
                    y[o + 16 + 4 * i + k] = (ZERO_POINT >> 8) | ((ZERO_POINT >> 8) << 4)
                continue
            sigma2 = F(1.5) * sumx2 / F(32)
            if has_qw:
                _r4_weights(xb, qw, 32 * ibl, True, sigma2, w, 0, 32)
                sumwx = F(0)
                for j in range(16):
                    sumwx += w[j] * abs(xb[j])
                if sumwx < EPS_R4:
                    _r4_weights(xb, qw, 32 * ibl, False, sigma2, w, 0, 16)
                sumwx = F(0)
                for j in range(16, 32):
                    sumwx += w[j] * abs(xb[j])
                if np.float64(sumwx) < 1e-14:           # C compares with the double 1e-14 here
                    _r4_weights(xb, qw, 32 * ibl, False, sigma2, w, 16, 32)
            else:
                _r4_weights(xb, qw, 32 * ibl, False, sigma2, w, 0, 32)
            for h in range(2):
                if (s2l if h == 0 else s2h) > EPS_R4:
                    s, sh, found = iq1m_block(xb[16 * h:16 * h + 16], w[16 * h:16 * h + 16], True, scr, L,
                                              index[2 * h:2 * h + 2])
                    if not found:               # C asserts; write the zero half
                        s = F(0)
                        sh = 0
                        index[2 * h] = ZERO_POINT
                        index[2 * h + 1] = ZERO_POINT
                    scales[ibl, 2 * k + h] = s
                    state[h] = sh
                    state[N_STATE + h] = 1
                else:
                    scales[ibl, 2 * k + h] = F(0)
                    index[2 * h] = ZERO_POINT
                    index[2 * h + 1] = ZERO_POINT
                    if state[N_STATE + h] == 0:
                        state[2 * N_STATE] = 1
            m2 = scales[ibl, 2 * k] if scales[ibl, 2 * k] >= scales[ibl, 2 * k + 1] else scales[ibl, 2 * k + 1]
            mx[k] = m2 if mx[k] < m2 else mx[k]
            for i in range(4):
                y[o + 4 * i + k] = index[i] & 255
            for i in range(2):
                y[o + 16 + 4 * i + k] = (index[2 * i] >> 8) | ((index[2 * i + 1] >> 8) << 4) | MASKS[state[i]]
    invd = _r4_row_scales(mx, y)
    for ibl in range(nblock):
        o = 8 + IQ1_M_R4_BYTES * ibl
        for k in range(4):
            ls1 = max(I32(0), min(I32(15), nint(scales[ibl, 2 * k] * invd[k])))
            ls2 = max(I32(0), min(I32(15), nint(scales[ibl, 2 * k + 1] * invd[k])))
            y[o + 24 + k] = ls1 | (ls2 << 4)


# IQ1_S's kernels have the shared row signature; IQ1_M's take the carried state as well (one
# signature each: mainline's IQ1_M runs the same kernel and never reads a carried shift)
ROW_KERNELS = {IQ1_S: iq1_s_row, IQ1_S_R4: iq1_s_r4_row}
STATE_KERNELS = {IQ1_M: iq1_m_row_state, IQ1_M_R4: iq1_m_r4_row_state}
STATE_SIG = ROW_SIG + (types.Array(types.int64, 1, "C"),)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _rows_with_state(row_fn, x, qw, has_qw, ik, out, states, todo):
    for t in prange(todo.shape[0]):
        r = todo[t]
        row_fn[0](x[r], qw, has_qw, ik, out[r], states[r])


def _run_with_state(kernel, x, qw, has_qw, ik, out, states, todo):
    _compile_once(kernel, STATE_SIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
        _rows_with_state((kernel,), x, qw, has_qw, ik, out, states, todo)


def _quantize_carrying_shifts(kernel, x, qw, has_qw, ik, out):
    """Rows in parallel from a zero carried state, then the rows that read the carried state again
    with what the rows before them left (as one sequential call of the C quantizer would)."""
    n_rows = x.shape[0]
    states = np.zeros((n_rows, 2 * N_STATE + 1), np.int64)
    _run_with_state(kernel, x, qw, has_qw, ik, out, states, np.arange(n_rows, dtype=np.int64))
    carried = np.zeros(N_STATE, np.int64)
    incoming = np.zeros((n_rows, N_STATE), np.int64)
    for r in range(n_rows):
        incoming[r] = carried
        written = states[r, N_STATE:2 * N_STATE] != 0
        carried = np.where(written, states[r, :N_STATE], carried)
    redo = np.nonzero((states[:, 2 * N_STATE] != 0) & incoming.any(axis=1))[0].astype(np.int64)
    if redo.size:
        states[redo] = 0
        states[redo, :N_STATE] = incoming[redo]
        _run_with_state(kernel, x, qw, has_qw, ik, out, states, redo)


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Quantize rows x (n_rows, n_per_row) into out (n_rows, row_size); the _R4 types take groups
    of 4 rows."""
    if qtype in (IQ1_S_R4, IQ1_M_R4):
        n_rows, n = x.shape
        x = x.reshape(n_rows // 4, 4 * n)
        out = out.reshape(n_rows // 4, -1)
    if qtype in STATE_KERNELS:
        _quantize_carrying_shifts(STATE_KERNELS[qtype], x, qw, has_qw, ik, out)
    else:
        run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


# ---- decoders ----

@njit(cache=True, error_model="numpy")
def decode_row(qtype, b, y, fp16_table):
    """One row (the _R4 types: one group of 4 rows): its bytes b -> its values y."""
    if qtype == IQ1_S:
        for sb in range(y.shape[0] // QK_K):
            o = IQ1_S_BYTES * sb
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                qh = np.int64(b[o + 34 + 2 * ib]) | (np.int64(b[o + 35 + 2 * ib]) << 8)
                dl = d * F(2 * ((qh >> 12) & 7) + 1)
                delta = -DELTA if qh & 0x8000 else DELTA
                for l in range(4):
                    g = np.int64(b[o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                    for j in range(8):
                        y[QK_K * sb + 32 * ib + 8 * l + j] = dl * (GRID_VALUES[g, j] + delta)
    elif qtype == IQ1_M:
        for sb in range(y.shape[0] // QK_K):
            o = IQ1_M_BYTES * sb
            sc = np.empty(4, np.int64)
            for i in range(4):
                sc[i] = np.int64(b[o + 48 + 2 * i]) | (np.int64(b[o + 49 + 2 * i]) << 8)
            s16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
            d = fp16_table[s16]
            for ib in range(8):
                for h in range(2):
                    dl = d * F(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 3 * h)) & 7) + 1)
                    qh = np.int64(b[o + 32 + 2 * ib + h])
                    for l in range(2):
                        g = np.int64(b[o + 4 * ib + 2 * h + l]) | ((qh << (8 - 4 * l)) & 0x700)
                        delta = -DELTA if qh & (0x08 << (4 * l)) else DELTA
                        for j in range(8):
                            y[QK_K * sb + 32 * ib + 16 * h + 8 * l + j] = dl * (GRID_VALUES[g, j] + delta)
    else:
        n = y.shape[0] // 4
        m = qtype == IQ1_M_R4
        nb = IQ1_M_R4_BYTES if m else IQ1_S_R4_BYTES
        for k in range(4):
            d = fp16_at(b, 2 * k, fp16_table)
            for ib in range(n // R4_BLOCK):
                o = 8 + nb * ib
                yo = k * n + 32 * ib
                if m:
                    sl = np.int64(b[o + 24 + k])
                    for i in range(2):
                        dl = d * F((sl >> (4 * i)) & 0xF)
                        qh = np.int64(b[o + 16 + 4 * i + k])
                        for l in range(2):
                            g = np.int64(b[o + 8 * i + k + 4 * l]) | ((qh << (8 - 4 * l)) & 0x700)
                            delta = -DELTA if qh & (0x08 << (4 * l)) else DELTA
                            for j in range(8):
                                y[yo + 16 * i + 8 * l + j] = dl * (GRID_VALUES[g, j] + delta)
                else:
                    qh = np.int64(b[o + 16 + 2 * k]) | (np.int64(b[o + 17 + 2 * k]) << 8)
                    delta = -DELTA if qh & 0x8000 else DELTA
                    dl = d * F(2 * ((qh >> 12) & 7) + 1)
                    for i in range(4):
                        g = np.int64(b[o + 4 * i + k]) | (((qh >> (3 * i)) & 7) << 8)
                        for j in range(8):
                            y[yo + 8 * i + j] = dl * (GRID_VALUES[g, j] + delta)


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out, interleave=4 if qtype in (IQ1_S_R4, IQ1_M_R4) else 1)
