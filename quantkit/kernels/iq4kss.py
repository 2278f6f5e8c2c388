"""numba kernel for IQ4_KSS (see :mod:`quantkit.formats.iq4kss`): rows in parallel, scalar inside."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..types import QuantType as T
from ..types import traits
from ._iqk import thresholds
from .common import (F, FLT_MAX, OVERFLOW, ZERO_EPS, first_absmax, run_rows, store_f32, take_trial, to_lanes,
                     weighted_sums)
from .iqk import IQ4_SV, IQ4_T, IQ4_V, PLAIN_X2, ks_row_scale, ks_scale_code, nearest_in, row_weights

IQ4_KSS_META = traits(T.IQ4_KSS).row_meta_size      # the float32 row scale
BLOCK_BYTES = traits(T.IQ4_KSS).type_size * 32 // traits(T.IQ4_KSS).block_size     # one block of 32
_OPTS = dict(cache=True, error_model="numpy")

#: set bits of every 16-bit value
POPCOUNT = np.array([bin(i).count("1") for i in range(1 << 16)], np.int32)


def _squeeze_table() -> np.ndarray:
    """SQUEEZE[v & 0x7fff] = the 15-bit j with j ^ (j << 1) == v, for even-parity 16-bit v."""
    j = np.arange(1 << 15, dtype=np.int64)
    inverse = np.full(1 << 16, -1, np.int64)
    inverse[(j ^ (j << 1)) & 0xFFFF] = j
    i = np.arange(1 << 15, dtype=np.int64)
    return inverse[i | ((POPCOUNT[i] & 1) << 15)].astype(np.uint16)


SQUEEZE = _squeeze_table()
IQ4_CT = thresholds(IQ4_V).astype(np.float32)          # code = number of these <= x
IQ4_SCT = thresholds(IQ4_SV).astype(np.float32)


@njit(cache=True, error_model="numpy", inline="always")
def _group_pos(k, j):
    """Position in the sub-block of code j (0..3) of word k: 2k, 2k+16, 2k+1, 2k+17."""
    return 2 * k + (j >> 1) + 16 * (j & 1)


@njit(cache=True, error_model="numpy", inline="always")
def _codes(xb, k, a_scale, shifted, q4):
    for j in range(4):
        a = a_scale * xb[_group_pos(k, j)]
        q4[j] = nearest_in(a, shifted, IQ4_T, OVERFLOW)


def _candidate_table() -> np.ndarray:
    """CANDIDATES[q] = the codes within 2 of q whose bit count has the other parity, ascending (the
    order of ik's loop), padded with -1: the codes that can flip a word's parity by changing q."""
    out = np.full((16, 4), -1, np.int64)
    for q in range(16):
        c = [i for i in range(max(q - 2, 0), min(q + 2, 15) + 1) if i != q and (bin(i).count("1") - bin(q).count("1")) % 2]
        out[q, :len(c)] = c
    return out


CANDIDATES = _candidate_table()


@njit(cache=True, error_model="numpy", inline="always")
def _prune(q4, xb, wb, k, shifted, dl):
    """Even parity for the four codes of word k (in place): the single-code change, among
    CANDIDATES, that costs the least weighted squared error (the first one on ties)."""
    if (POPCOUNT[q4[0] | (q4[1] << 4) | (q4[2] << 8) | (q4[3] << 12)] & 1) == 0:
        return
    best = FLT_MAX
    jbest = -1
    qbest = 0
    for j in range(4):
        q = q4[j]
        p = _group_pos(k, j)
        x = xb[p]
        diff0 = dl * IQ4_V[q] - x
        e0 = diff0 * diff0
        for m in range(4):
            iq = CANDIDATES[q, m]
            if iq < 0:
                break
            diff1 = dl * (IQ4_SV[iq] if shifted else IQ4_V[iq]) - x
            score = wb[p] * (diff1 * diff1 - e0)
            if score < best:
                best = score
                jbest = j
                qbest = iq
    q4[jbest] = qbest


@njit(**_OPTS)
def _codes_lanes(xt, isc, ct, cp, cm):
    """Codes of +isc[k]*x and -isc[k]*x for every value i of every lane (block) k, by counting
    the 15 thresholds ct (lanes innermost: LLVM runs 8 blocks per instruction).  ct is IQ4_CT or
    IQ4_SCT, the shifted half's thresholds; isc already includes the half's first value."""
    n, nl = xt.shape
    for i in range(n):
        for k in range(nl):
            a = isc[k] * xt[i, k]
            c_plus = 0
            c_minus = 0
            for t in range(15):
                c_plus += 1 if a >= ct[t] else 0
                c_minus += 1 if -a >= ct[t] else 0
            cp[i, k] = c_plus if a < OVERFLOW else 0
            cm[i, k] = c_minus if -a < OVERFLOW else 0


def _neighbour_tables(values: np.ndarray) -> np.ndarray:
    """Row i, entry q: values[q + o] for the offsets o = (-2, -1, 1, 2), where code q + o is one of
    CANDIDATES[q] (a code, of the other parity), else +inf.  An inf value scores inf or NaN in
    _prune's test, which never takes it, so the lane loop scores all four offsets of every code
    with no test of whether each is a candidate."""
    out = np.full((4, 16), np.inf, np.float32)
    for q in range(16):
        for i, o in enumerate((-2, -1, 1, 2)):
            if 0 <= q + o <= 15 and q + o in CANDIDATES[q]:         # (-1 pads CANDIDATES' rows)
                out[i, q] = values[q + o]
    return out


IQ4_NM2, IQ4_NM1, IQ4_NP1, IQ4_NP2 = _neighbour_tables(IQ4_V)
IQ4_SNM2, IQ4_SNM1, IQ4_SNP1, IQ4_SNP2 = _neighbour_tables(IQ4_SV)


@njit(cache=True, error_model="numpy", inline="always")
def _score(v, x, w, dl, e0, best, vbest, jbest, j):
    """One candidate of _prune (value v for the value x of weight w; e0 the code's own squared
    error): taken where its score is strictly below ``best``."""
    diff1 = dl * v - x
    score = w * (diff1 * diff1 - e0)
    take = score < best
    return (score if take else best), (v if take else vbest), (j if take else jbest)


@njit(cache=True, error_model="numpy", inline="always")
def _code_candidates(q, x, w, dl, down2, down1, up1, up2, best, vbest, jbest, j):
    """_prune's four candidates of code j (q at value x), ascending: q-2, q-1, q+1, q+2."""
    e0 = dl * IQ4_V[q] - x
    e0 = e0 * e0
    best, vbest, jbest = _score(down2[q], x, w, dl, e0, best, vbest, jbest, j)
    best, vbest, jbest = _score(down1[q], x, w, dl, e0, best, vbest, jbest, j)
    best, vbest, jbest = _score(up1[q], x, w, dl, e0, best, vbest, jbest, j)
    return _score(up2[q], x, w, dl, e0, best, vbest, jbest, j)


@njit(cache=True, error_model="numpy", inline="always")
def _trial_lanes(xt, wt, codes, isc, values, down2, down1, up1, up2, sx, s2):
    """One trial of the scale search for every lane (block) b at once: the codes codes[:, b]
    parity pruned at the scale 1/isc[b] (_prune's choice, every candidate scored in its order and
    the word's parity deciding whether the best one replaces its code), and sx[b], s2[b] the
    weighted sums of the values, accumulated in C's order (word k, then its four codes): every
    lane's floats are those of ik's scalar loop.  Straight-line code, so that LLVM runs the lane
    loop 16 blocks per instruction (the table lookups are gathers: ``values`` and the neighbour
    rows down2..up2, the table half and its _neighbour_tables, are module constants where this is
    inlined; tables chosen at run time would keep the loop scalar).  A zero block's lane computes
    garbage that the caller skips."""
    nl = xt.shape[1]
    for b in range(nl):
        sx[b] = F(0)
        s2[b] = F(0)
    for k in range(8):
        p0 = 2 * k
        p1 = 2 * k + 16
        p2 = 2 * k + 1
        p3 = 2 * k + 17
        for b in range(nl):
            dl = F(1) / isc[b]
            q0 = codes[p0, b]
            q1 = codes[p1, b]
            q2 = codes[p2, b]
            q3 = codes[p3, b]
            x0 = xt[p0, b]
            x1 = xt[p1, b]
            x2 = xt[p2, b]
            x3 = xt[p3, b]
            w0 = wt[p0, b]
            w1 = wt[p1, b]
            w2 = wt[p2, b]
            w3 = wt[p3, b]
            best = FLT_MAX
            vbest = F(0)
            jbest = -1
            best, vbest, jbest = _code_candidates(q0, x0, w0, dl, down2, down1, up1, up2, best, vbest, jbest, 0)
            best, vbest, jbest = _code_candidates(q1, x1, w1, dl, down2, down1, up1, up2, best, vbest, jbest, 1)
            best, vbest, jbest = _code_candidates(q2, x2, w2, dl, down2, down1, up1, up2, best, vbest, jbest, 2)
            best, vbest, jbest = _code_candidates(q3, x3, w3, dl, down2, down1, up1, up2, best, vbest, jbest, 3)
            if POPCOUNT[q0 ^ q1 ^ q2 ^ q3] & 1 == 0:     # even parity already: no code changes
                jbest = -1
            a = sx[b]
            c = s2[b]
            a, c = weighted_sums(x0, w0, vbest if jbest == 0 else values[q0], a, c)
            a, c = weighted_sums(x1, w1, vbest if jbest == 1 else values[q1], a, c)
            a, c = weighted_sums(x2, w2, vbest if jbest == 2 else values[q2], a, c)
            a, c = weighted_sums(x3, w3, vbest if jbest == 3 else values[q3], a, c)
            sx[b] = a
            s2[b] = c


@njit(**_OPTS)
def _trial_lanes_base(xt, wt, codes, isc, sx, s2):
    _trial_lanes(xt, wt, codes, isc, IQ4_V, IQ4_NM2, IQ4_NM1, IQ4_NP1, IQ4_NP2, sx, s2)


@njit(**_OPTS)
def _trial_lanes_shifted(xt, wt, codes, isc, sx, s2):
    _trial_lanes(xt, wt, codes, isc, IQ4_SV, IQ4_SNM2, IQ4_SNM1, IQ4_SNP1, IQ4_SNP2, sx, s2)


@njit(**_OPTS)
def iq4_kss_row(xr, qw, has_qw, ik, y):
    n = xr.shape[0]
    nb = n // 32
    y[:] = 0
    w = np.empty(n, np.float32)
    row_weights(xr, qw, has_qw, 32, 2.0, PLAIN_X2, w)
    scales = np.empty(nb, np.float32)
    q4 = np.empty(4, np.int64)
    # the scale search: every block of the row is a lane of the code computation
    xt = np.empty((32, nb), np.float32)
    to_lanes(xr, 32, xt)
    mx = np.zeros(nb, np.float32)
    best = np.zeros(nb, np.float32)
    isc = np.empty(nb, np.float32)
    cp = np.empty((32, nb), np.int32)
    cm = np.empty((32, nb), np.int32)
    wt = np.empty((32, nb), np.float32)
    to_lanes(w, 32, wt)
    sp = np.empty(nb, np.float32)
    s2p = np.empty(nb, np.float32)
    sm = np.empty(nb, np.float32)
    s2m = np.empty(nb, np.float32)
    for b in range(nb):
        amax, mx[b] = first_absmax(xr[32 * b:32 * b + 32])
        scales[b] = -mx[b] / IQ4_V[0] if amax >= ZERO_EPS else F(0)
    for itry in range(-7, 8):
        for half in range(2):
            v0 = IQ4_SV[0] if half == 1 else IQ4_V[0]
            for b in range(nb):
                isc[b] = F(itry + v0) / mx[b]
            if half == 1:
                _codes_lanes(xt, isc, IQ4_SCT, cp, cm)
            else:
                _codes_lanes(xt, isc, IQ4_CT, cp, cm)
            if half == 1:
                _trial_lanes_shifted(xt, wt, cp, isc, sp, s2p)
                _trial_lanes_shifted(xt, wt, cm, isc, sm, s2m)
            else:
                _trial_lanes_base(xt, wt, cp, isc, sp, s2p)
                _trial_lanes_base(xt, wt, cm, isc, sm, s2m)
            for b in range(nb):
                if scales[b] == 0:
                    continue
                _, db, bb = take_trial(sp[b], s2p[b], scales[b], best[b])
                _, scales[b], best[b] = take_trial(sm[b], s2m[b], db, bb)
    d, idv = ks_row_scale(scales)
    if d == 0:
        return
    sumqx = F(0)
    sumq2 = F(0)
    vp = np.empty((8, 4), np.int64)
    vm = np.empty((8, 4), np.int64)
    for b in range(nb):
        xb = xr[32 * b:32 * b + 32]
        wb = w[32 * b:32 * b + 32]
        l = ks_scale_code(idv, scales[b]) - 127
        wo = IQ4_KSS_META + BLOCK_BYTES * b
        if l == 0:
            for k in range(8):
                y[wo + 2 * k] = (127 >> k) & 1
            continue
        dl = d * F(l)
        idl = F(1) / dl
        mse_p = F(0)
        mse_m = F(0)
        for k in range(8):
            _codes(xb, k, idl, False, vp[k])
            _codes(xb, k, idl, True, vm[k])
            _prune(vp[k], xb, wb, k, False, dl)
            _prune(vm[k], xb, wb, k, True, dl)
            for j in range(4):
                p = _group_pos(k, j)
                e = xb[p] - dl * IQ4_V[vp[k, j]]
                mse_p += (wb[p] * e) * e
                e = xb[p] - dl * IQ4_SV[vm[k, j]]
                mse_m += (wb[p] * e) * e
        use_m = mse_m < mse_p
        for k in range(8):
            for j in range(4):
                p = _group_pos(k, j)
                q = (IQ4_SV[vm[k, j]] if use_m else IQ4_V[vp[k, j]]) * F(l)
                sumqx, sumq2 = weighted_sums(xb[p], wb[p], q, sumqx, sumq2)
        sb = (l + 127) | (1 if use_m else 0)
        for k in range(8):
            c = vm[k] if use_m else vp[k]
            packed = c[0] | (c[1] << 4) | (c[2] << 8) | (c[3] << 12)
            word = (np.int64(SQUEEZE[packed & 0x7FFF]) << 1) | ((sb >> k) & 1)
            y[wo + 2 * k] = word & 0xFF
            y[wo + 2 * k + 1] = (word >> 8) & 0xFF
    if sumq2 > 0:
        d = (sumqx / sumq2) * F(1.01)
    store_f32(y, 0, d)


def quantize_rows(x, qw, has_qw, out):
    run_rows(iq4_kss_row, x, qw, has_qw, True, out)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def dequantize_rows(blocks, out):
    n_rows, n = out.shape
    for r in prange(n_rows):
        b = blocks[r]
        d = b[0:4].copy().view(np.float32)[0]
        for blk in range(n // 32):
            o = IQ4_KSS_META + BLOCK_BYTES * blk
            ls = 0
            for k in range(8):
                ls |= (np.int64(b[o + 2 * k]) & 1) << k
            dl = d * F((ls & 254) - 127)
            for k in range(8):
                a = (np.int64(b[o + 2 * k]) | (np.int64(b[o + 2 * k + 1]) << 8)) & 0xFFFE
                a ^= a >> 1
                for j in range(4):
                    q = (a >> (4 * j)) & 0xF
                    p = 32 * blk + _group_pos(k, j)
                    out[r, p] = dl * (IQ4_SV[q] if ls & 1 else IQ4_V[q])
