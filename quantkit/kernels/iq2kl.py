"""numba kernel for IQ2_KL (see :mod:`quantkit.formats.iq2kl`): rows in parallel, scalar inside."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..formats._iqk import IQ3NL_VALUES
from .iqk import IQ3_LUT, IQ3_THR, IQ3_V, OVERFLOW, PLAIN_ABS, nearest, row_weights
from .kquants import FP16_TABLE, nint, run_rows, store_fp16

F = np.float32
ZERO_EPS = F(1e-16)
FLT_MAX = F(np.finfo(np.float32).max)
_OPTS = dict(cache=True, error_model="numpy")
__all__ = ["quantize_rows", "dequantize_rows", "FP16_TABLE", "PAIRS", "PAIR_INDEX", "NEIGHBOURS"]

# The 32 allowed (first, second) code pairs out of the 8x8 pairs of IQ3_K's base table: PAIR_INDEX[8*l1 + l2]
# is the pair's index, or -(k+1) for a disallowed pair whose replacement candidates are NEIGHBOURS[k].
PAIR_INDEX = np.array([
    -1, -2, 0, -3, -4, 1, -5, -6, 2, -7, -8, 3, -9, 4, -10, 5, -11, 6, 7, -12, 8, 9, 10, -13, 11, -14, -15, -16,
    12, 13, -17, 14, -18, -19, 15, 16, 17, 18, 19, -20, -21, 20, 21, 22, 23, 24, -22, -23, 25, -24, 26, -25, 27,
    -26, 28, 29, -27, -28, 30, -29, -30, 31, -31, -32], np.int64)
NEIGHBOURS = np.array([
    [2, 0, 6, 11, 7, 3, 8, 15], [0, 2, 3, 6, 7, 1, 8, 4], [0, 1, 3, 4, 8, 7, 9, 6], [1, 0, 3, 4, 8, 9, 7, 10],
    [1, 4, 5, 10, 9, 3, 8, 0], [5, 1, 4, 10, 9, 14, 8, 3], [6, 2, 7, 0, 3, 11, 8, 15], [3, 7, 0, 6, 8, 4, 12, 9],
    [3, 4, 8, 9, 1, 7, 12, 10], [4, 10, 5, 9, 1, 8, 13, 14], [11, 2, 6, 7, 20, 15, 25, 21],
    [8, 7, 3, 12, 9, 16, 17, 13], [14, 5, 10, 19, 9, 13, 4, 18], [6, 15, 7, 11, 20, 21, 16, 2],
    [15, 7, 16, 6, 21, 12, 17, 22], [12, 16, 17, 8, 15, 7, 13, 22], [19, 10, 13, 18, 14, 9, 12, 24],
    [11, 20, 25, 6, 15, 2, 21, 7], [20, 15, 21, 6, 11, 7, 16, 26], [14, 19, 29, 10, 28, 18, 13, 24],
    [25, 11, 20, 21, 15, 6, 26, 30], [19, 24, 28, 18, 29, 23, 13, 17], [29, 19, 14, 28, 24, 18, 10, 13],
    [20, 26, 21, 25, 30, 15, 22, 16], [27, 26, 22, 23, 21, 30, 16, 24], [27, 24, 28, 31, 23, 18, 22, 17],
    [25, 30, 20, 26, 21, 11, 15, 22], [30, 26, 25, 20, 21, 27, 22, 15], [30, 27, 31, 26, 22, 23, 21, 24],
    [31, 27, 30, 26, 28, 23, 22, 24], [31, 28, 29, 27, 24, 23, 19, 18], [29, 28, 31, 24, 19, 27, 14, 18]],
    np.int64)


def _pairs() -> np.ndarray:
    grid = np.zeros((32, 2), np.float32)
    for j in range(64):
        if PAIR_INDEX[j] >= 0:
            grid[PAIR_INDEX[j]] = IQ3NL_VALUES[j // 8], IQ3NL_VALUES[j % 8]
    return grid


PAIRS = _pairs()


@njit(cache=True, error_model="numpy", inline="always")
def pair_code(isc, x1, x2, w1, w2):
    """Pair index for values x1, x2 at inverse scale isc: the nearest allowed pair, or the best of
    the disallowed pair's neighbours by weighted squared distance."""
    s1 = isc * x1
    s2 = isc * x2
    i = PAIR_INDEX[8 * nearest(s1, IQ3_V, IQ3_LUT, IQ3_THR, OVERFLOW) + nearest(s2, IQ3_V, IQ3_LUT, IQ3_THR, OVERFLOW)]
    if i >= 0:
        return i
    best = FLT_MAX
    ibest = -1
    for t in range(8):
        n = NEIGHBOURS[-i - 1, t]
        d1 = PAIRS[n, 0] - s1
        d2 = PAIRS[n, 1] - s2
        score = (w1 * d1) * d1 + (w2 * d2) * d2
        if score < best:
            best = score
            ibest = n
    return ibest


@njit(cache=True, error_model="numpy", inline="always")
def _trial(xb, wb, isc):
    sx = F(0)
    s2 = F(0)
    for j in range(0, 32, 2):
        c = pair_code(isc, xb[j], xb[j + 1], wb[j], wb[j + 1])
        q1 = PAIRS[c, 0]
        q2 = PAIRS[c, 1]
        sx += (wb[j] * q1) * xb[j] + (wb[j + 1] * q2) * xb[j + 1]
        s2 += (wb[j] * q1) * q1 + (wb[j + 1] * q2) * q2
    return sx, s2


@njit(**_OPTS)
def iq2_kl_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    nb = n // 32
    w = np.empty(n, np.float32)
    row_weights(xr, qw, has_qw, 32, 2.25, PLAIN_ABS, w)
    scales = np.empty(nb, np.float32)
    max_abs = F(0)
    max_scale = F(0)
    v0 = IQ3_V[0]
    for b in range(nb):
        xb = xr[32 * b:32 * b + 32]
        wb = w[32 * b:32 * b + 32]
        amax = F(0)
        mx = F(0)
        for j in range(32):
            if abs(xb[j]) > amax:
                amax = abs(xb[j])
                mx = xb[j]
        if amax < ZERO_EPS:
            scales[b] = F(0)
            continue
        d = -mx / v0
        isc = F(1) / d
        sp, s2p = _trial(xb, wb, isc)
        sm, s2m = _trial(xb, wb, -isc)
        d = sp / s2p
        best = d * sp
        if s2m > 0 and sm * sm > best * s2m:
            d = sm / s2m
            best = d * sm
        for itry in range(-5, 6):
            isc = F(itry + v0) / mx
            sp, s2p = _trial(xb, wb, isc)
            sm, s2m = _trial(xb, wb, -isc)
            if s2p > 0 and sp * sp > best * s2p:
                d = sp / s2p
                best = d * sp
            if s2m > 0 and sm * sm > best * s2m:
                d = sm / s2m
                best = d * sm
        scales[b] = d
        if abs(d) > max_abs:
            max_abs = abs(d)
            max_scale = d
    for k in range(y.shape[0]):
        y[k] = 0
    if max_abs == 0:
        return
    d = -max_scale / F(32)
    idv = F(1) / d
    sumqx = F(0)
    sumq2 = F(0)
    for b in range(nb):
        xb = xr[32 * b:32 * b + 32]
        wb = w[32 * b:32 * b + 32]
        o = 2 + 86 * (b // 8)
        ib = b % 8
        ls = max(-32, min(31, nint(idv * scales[b])))
        best_score = FLT_MAX
        best_ls = ls
        for ils in range(max(-32, ls - 1), min(31, ls + 1) + 1):
            dl = d * F(ils)
            idl = F(1) / dl if dl != 0 else F(0)
            score = F(0)
            for j in range(0, 32, 2):
                c = pair_code(idl, xb[j], xb[j + 1], wb[j], wb[j + 1])
                d1 = dl * PAIRS[c, 0] - xb[j]
                d2 = dl * PAIRS[c, 1] - xb[j + 1]
                score += (wb[j] * d1) * d1 + (wb[j + 1] * d2) * d2
            if score < best_score:
                best_score = score
                best_ls = ils
        ls = best_ls
        uls = ls + 32
        y[o + 2 + ib % 4] |= (uls & 0xF) << (4 * (ib // 4))
        y[o + ib // 4] |= (uls >> 4) << (2 * (ib % 4))
        if ls == 0:
            continue
        dl = d * F(ls)
        idl = F(1) / dl
        for j in range(16):
            c = pair_code(idl, xb[2 * j], xb[2 * j + 1], wb[2 * j], wb[2 * j + 1])
            y[o + 6 + 16 * (ib // 2) + j] |= (c & 0xF) << (4 * (ib % 2))
            y[o + 70 + j] |= (c >> 4) << ib
            q1 = F(ls) * PAIRS[c, 0]
            q2 = F(ls) * PAIRS[c, 1]
            sumqx += (wb[2 * j] * q1) * xb[2 * j] + (wb[2 * j + 1] * q2) * xb[2 * j + 1]
            sumq2 += (wb[2 * j] * q1) * q1 + (wb[2 * j + 1] * q2) * q2
    if sumq2 > 0:
        d = sumqx / sumq2
    store_fp16(y, 0, F(1.025) * d)


def quantize_rows(x, qw, has_qw, out):
    run_rows(iq2_kl_row, x, qw, has_qw, True, out)


@njit(cache=True, parallel=True, error_model="numpy")
def dequantize_rows(blocks, fp16_table, out):
    n_rows, n = out.shape
    for r in prange(n_rows):
        b = blocks[r]
        d = fp16_table[np.int64(b[0]) | (np.int64(b[1]) << 8)]
        for blk in range(n // 32):
            o = 2 + 86 * (blk // 8)
            ib = blk % 8
            scales_h = np.int64(b[o]) | (np.int64(b[o + 1]) << 8)
            uls = ((np.int64(b[o + 2 + ib % 4]) >> (4 * (ib // 4))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * F(uls - 32)
            for j in range(16):
                c = ((np.int64(b[o + 6 + 16 * (ib // 2) + j]) >> (4 * (ib % 2))) & 0xF) | \
                    (((np.int64(b[o + 70 + j]) >> ib) & 1) << 4)
                out[r, 32 * blk + 2 * j] = dl * PAIRS[c, 0]
                out[r, 32 * blk + 2 * j + 1] = dl * PAIRS[c, 1]
