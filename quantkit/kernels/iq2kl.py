"""numba kernel for IQ2_KL (see :mod:`quantkit.formats.iq2kl`): rows in parallel.

The scale search (24 trial scales per block of 32, 16 pair codes per trial) runs all blocks of a row
at once as SIMD lanes, each lane keeping its sums in C order.  A pair code is found without branches:
the nearest base-table index of each value is counted over the thresholds, and every one of the 64
(l1, l2) cells lists 8 candidate pairs (``CAND_*``): the pair itself 8 times when it is allowed, its
8 neighbours in ik's order when it is not.  The first candidate with the smallest weighted error
wins, which is what ik's search over the neighbours picks.  The encoding pass uses ``pair_code``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..tables import FP16_TABLE, IQ3NL_VALUES
from ..types import QuantType as T
from ..types import traits
from ._iqk import thresholds
from .common import fp16_at, F, FLT_MAX, OVERFLOW, ZERO_EPS, lanes_first_absmax, nint, run_rows, store_fp16
from .iqk import IQ3_LUT, IQ3_THR, IQ3_V, PLAIN_ABS, first_trials, nearest, row_weights, take_trials

IQ2_KL_META = traits(T.IQ2_KL).row_meta_size        # the fp16 row scale
IQ2_KL_BYTES = traits(T.IQ2_KL).type_size
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


def _candidates() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat (64*8,) tables: candidate pair index, first and second value, for cell 8*l1 + l2."""
    code = np.empty((64, 8), np.int64)
    for cell in range(64):
        i = PAIR_INDEX[cell]
        code[cell] = i if i >= 0 else NEIGHBOURS[-i - 1]
    code = code.reshape(-1)
    return code, PAIRS[code, 0].copy(), PAIRS[code, 1].copy()


CAND_CODE, CAND_Q1, CAND_Q2 = _candidates()
IQ3_T = thresholds(IQ3NL_VALUES[:8])          # 7 thresholds: the nearest index is how many are <= a


@njit(cache=True, error_model="numpy", inline="always")
def _index(a, t):
    """Nearest IQ3 base index of a (ties up) by counting thresholds; NaN and a >= 2^31 give 0."""
    c = ((a >= t[0]) + (a >= t[1]) + (a >= t[2]) + (a >= t[3]) + (a >= t[4]) + (a >= t[5])
         + (a >= t[6]))
    return np.uintp(c) if a < OVERFLOW else np.uintp(0)


@njit(cache=True, error_model="numpy", inline="always")
def _pair_lane(s1, s2, w1, w2, t):
    """(q1, q2) of pair_code for scaled values s1, s2: the first of the cell's 8 candidates with the
    smallest (w1*d1)*d1 + (w2*d2)*d2, without branches."""
    base = np.uintp(8) * (np.uintp(8) * _index(s1, t) + _index(s2, t))
    q1 = CAND_Q1[base]
    q2 = CAND_Q2[base]
    d1 = q1 - s1
    d2 = q2 - s2
    best = (w1 * d1) * d1 + (w2 * d2) * d2
    for c in range(1, 8):
        i = base + np.uintp(c)
        c1 = CAND_Q1[i]
        c2 = CAND_Q2[i]
        d1 = c1 - s1
        d2 = c2 - s2
        score = (w1 * d1) * d1 + (w2 * d2) * d2
        take = score < best
        best = score if take else best
        q1 = c1 if take else q1
        q2 = c2 if take else q2
    return q1, q2


@njit(**_OPTS)
def _trial_lanes(xt, wt, isc, t, sums):
    """For every lane k (a block of 32), _trial's sums at inverse scale isc[k] (sums[0], sums[1])
    and at -isc[k] (sums[2], sums[3])."""
    sums[:] = F(0)
    for j in range(0, 32, 2):
        for k in range(xt.shape[1]):
            x1, x2 = xt[j, k], xt[j + 1, k]
            w1, w2 = wt[j, k], wt[j + 1, k]
            s1 = isc[k] * x1
            s2 = isc[k] * x2
            q1, q2 = _pair_lane(s1, s2, w1, w2, t)
            sums[0, k] += (w1 * q1) * x1 + (w2 * q2) * x2
            sums[1, k] += (w1 * q1) * q1 + (w2 * q2) * q2
            q1, q2 = _pair_lane(-s1, -s2, w1, w2, t)
            sums[2, k] += (w1 * q1) * x1 + (w2 * q2) * x2
            sums[3, k] += (w1 * q1) * q1 + (w2 * q2) * q2


@njit(**_OPTS)
def _score_lanes(xt, wt, dl, t, score):
    """For every lane k, the weighted squared error of the block's pair codes at scale dl[k]."""
    score[:] = F(0)
    for j in range(0, 32, 2):
        for k in range(xt.shape[1]):
            x1, x2 = xt[j, k], xt[j + 1, k]
            w1, w2 = wt[j, k], wt[j + 1, k]
            idl = F(1) / dl[k] if dl[k] != 0 else F(0)
            q1, q2 = _pair_lane(idl * x1, idl * x2, w1, w2, t)
            d1 = dl[k] * q1 - x1
            d2 = dl[k] * q2 - x2
            score[k] += (w1 * d1) * d1 + (w2 * d2) * d2


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


@njit(**_OPTS)
def iq2_kl_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    nb = n // 32
    w = np.empty(n, np.float32)
    row_weights(xr, qw, has_qw, 32, 2.25, PLAIN_ABS, w)
    xt = np.empty((32, nb), np.float32)
    wt = np.empty((32, nb), np.float32)
    for b in range(nb):
        for j in range(32):
            xt[j, b] = xr[32 * b + j]
            wt[j, b] = w[32 * b + j]
    st = np.empty((7, nb), np.float32)
    amax, mx, isc, d, best, scales, score = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    sums = np.empty((4, nb), np.float32)
    t = IQ3_T
    v0 = IQ3_V[0]
    lanes_first_absmax(xt, amax, mx)
    for b in range(nb):
        isc[b] = F(1) / (-mx[b] / v0)
    _trial_lanes(xt, wt, isc, t, sums)
    for b in range(nb):
        first_trials(sums, b, False, F(0), d, best)
    for itry in range(-5, 6):
        for b in range(nb):
            isc[b] = F(itry + v0) / mx[b]
        _trial_lanes(xt, wt, isc, t, sums)
        for b in range(nb):
            take_trials(sums, b, d, best)
    max_abs = F(0)
    max_scale = F(0)
    for b in range(nb):
        scales[b] = d[b] if amax[b] >= ZERO_EPS else F(0)
        if abs(scales[b]) > max_abs:
            max_abs = abs(scales[b])
            max_scale = scales[b]
    for k in range(y.shape[0]):
        y[k] = 0
    if max_abs == 0:
        return
    d0 = -max_scale / F(32)
    idv = F(1) / d0
    # the block scale: the best of ls - 1, ls, ls + 1 (clamped to [-32, 31]), first on ties
    ls = np.empty(nb, np.int64)
    best_ls = np.empty(nb, np.int64)
    for b in range(nb):
        ls[b] = max(-32, min(31, nint(idv * scales[b])))
        best_ls[b] = ls[b]
        best[b] = FLT_MAX
    for off in range(-1, 2):
        for b in range(nb):
            d[b] = d0 * F(ls[b] + off)
        _score_lanes(xt, wt, d, t, score)
        for b in range(nb):
            ils = ls[b] + off
            if -32 <= ils <= 31 and score[b] < best[b]:
                best[b] = score[b]
                best_ls[b] = ils
    sumqx = F(0)
    sumq2 = F(0)
    for b in range(nb):
        xb = xr[32 * b:32 * b + 32]
        wb = w[32 * b:32 * b + 32]
        o = IQ2_KL_META + IQ2_KL_BYTES * (b // 8)
        ib = b % 8
        lsb = best_ls[b]
        uls = lsb + 32
        y[o + 2 + ib % 4] |= (uls & 0xF) << (4 * (ib // 4))
        y[o + ib // 4] |= (uls >> 4) << (2 * (ib % 4))
        if lsb == 0:
            continue
        dl = d0 * F(lsb)
        idl = F(1) / dl
        for j in range(16):
            c = pair_code(idl, xb[2 * j], xb[2 * j + 1], wb[2 * j], wb[2 * j + 1])
            y[o + 6 + 16 * (ib // 2) + j] |= (c & 0xF) << (4 * (ib % 2))
            y[o + 70 + j] |= (c >> 4) << ib
            q1 = F(lsb) * PAIRS[c, 0]
            q2 = F(lsb) * PAIRS[c, 1]
            sumqx += (wb[2 * j] * q1) * xb[2 * j] + (wb[2 * j + 1] * q2) * xb[2 * j + 1]
            sumq2 += (wb[2 * j] * q1) * q1 + (wb[2 * j + 1] * q2) * q2
    if sumq2 > 0:
        d0 = sumqx / sumq2
    store_fp16(y, 0, F(1.025) * d0)


def quantize_rows(x, qw, has_qw, out):
    run_rows(iq2_kl_row, x, qw, has_qw, True, out)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def dequantize_rows(blocks, fp16_table, out):
    n_rows, n = out.shape
    for r in prange(n_rows):
        b = blocks[r]
        d = fp16_at(b, 0, fp16_table)
        for blk in range(n // 32):
            o = IQ2_KL_META + IQ2_KL_BYTES * (blk // 8)
            ib = blk % 8
            scales_h = np.int64(b[o]) | (np.int64(b[o + 1]) << 8)
            uls = ((np.int64(b[o + 2 + ib % 4]) >> (4 * (ib // 4))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * F(uls - 32)
            for j in range(16):
                c = ((np.int64(b[o + 6 + 16 * (ib // 2) + j]) >> (4 * (ib % 2))) & 0xF) | \
                    (((np.int64(b[o + 70 + j]) >> ib) & 1) << 4)
                out[r, 32 * blk + 2 * j] = dl * PAIRS[c, 0]
                out[r, 32 * blk + 2 * j + 1] = dl * PAIRS[c, 1]
