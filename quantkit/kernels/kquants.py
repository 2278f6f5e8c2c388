"""numba kernels for the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).

The quantizers of :mod:`quantkit.formats.kquants` (its docstring): float32 rows ``x``
(n_rows, n_per_row) in, uint8 rows of blocks (n_rows, row_size) out, and the reverse.  Types are
selected by their ggml type id; ``ik`` selects ik_llama.cpp's algorithms, else mainline's.

Layout: rows run in parallel (one ``prange`` driver, ``common.quantize_rows_with``, that calls a per-type
row kernel).  Within a row the sub-blocks (16 or 32 values) are laid out as "lanes": ``xt[i, k]`` is
value i of sub-block k.  Every scale search is then a loop over the values of a sub-block
(sequential, exactly the C order of the float sums) around an inner loop over all sub-blocks of the
row, which LLVM vectorises: each SIMD lane carries one sub-block's sequential sum, so the bytes stay
exact while 8 sub-blocks are searched at once.  The greedy refinements, whose trip count depends on
the data, run all sub-blocks in lockstep too, each one stopping where C stops.

Exactness rules (specs/ggml-quants.md Appendix A): float32 intermediates everywhere C uses float,
float64 where ik's make_qkx3_quants uses double; ``nearest_int`` is ggml's bit trick in int32 (int64
codes would not vectorise); ``error_model="numpy"`` so divisions follow IEEE (C divides by zero in
lanes whose result is then discarded); no fastmath, so nothing is reassociated or fused.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from .common import (fp16_at, decode_rows, D, F, GROUP_MAX_EPS, I32, QK_K, block_bytes, clampf, first_absmax, fp16_value, lane_sumsq,
                     lanes_first_absmax, nint, positive_max, row_lanes, run_rows, store_fp16, type_ids)

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = type_ids(T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
#: bytes of one super-block
Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = block_bytes(T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)

_OPTS = dict(cache=True, error_model="numpy")


@njit(**_OPTS)
def superblock_sumsq(xr, s):
    """s[sb] = Σ x² over super-block sb, sequential from +0 (super-blocks interleaved for ILP)."""
    nsb = s.shape[0]
    for sb in range(nsb):
        s[sb] = F(0)
    for j in range(QK_K):
        for sb in range(nsb):
            v = xr[sb * QK_K + j]
            s[sb] += v * v


@njit(**_OPTS)
def imatrix_lanes(xt, qw, sumsq, factor, wt, sw):
    """wt = qw*sqrtf(sigma2 + x*x) with sigma2 = (factor*Σx²)/256 per super-block; sw = Σ wt per lane."""
    size, nl = xt.shape
    per_sb = QK_K // size
    sigma2 = np.empty(nl, np.float32)
    for k in range(nl):
        sw[k] = F(0)
        sigma2[k] = (factor * sumsq[k // per_sb]) / F(QK_K)
    for i in range(size):
        for k in range(nl):
            v = xt[i, k]
            wt[i, k] = qw[k * size + i] * np.sqrt(sigma2[k] + v * v)
            sw[k] += wt[i, k]


@njit(**_OPTS)
def affine_start_lanes(xt, fnmax, mn, mx, isc, sc, bis, bmn):
    """The start of make_qkx2/qkx3_quants for every lane: min (at most 0) and max of the values, the
    first trial's inverse scale isc = nmax/(max - min) and scale sc = 1/isc, which are also the
    best so far (bis, bmn: the codes of the best trial are re-derived from these at the end)."""
    n, nl = xt.shape
    for k in range(nl):
        mn[k] = xt[0, k]
        mx[k] = xt[0, k]
    for i in range(1, n):
        for k in range(nl):
            v = xt[i, k]
            mn[k] = v if v < mn[k] else mn[k]
            mx[k] = v if v > mx[k] else mx[k]
    for k in range(nl):
        if mn[k] > 0:
            mn[k] = F(0)
        isc[k] = fnmax / (mx[k] - mn[k])
        sc[k] = F(1) / isc[k]
        bis[k] = isc[k]
        bmn[k] = mn[k]


@njit(**_OPTS)
def qkx2_lanes(xt, wt, nmax, rmin, rdelta, nstep, use_mad, flat_rule, sc_out, min_out, Lt):
    """make_qkx2_quants (and mainline's make_qkx3_quants) for every lane, float32.

    flat_rule: 0 ``max == min``, 1 ``max <= min``, 2 ``max - min < 1e-10`` -> scale 0, codes 0.
    Writes scale, the_min (= -min) and codes 0..nmax."""
    n, nl = xt.shape
    st = np.empty((15, nl), np.float32)
    mn, mx, sw, sx, sc, best, bis, bmn = st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7]
    isc, sl, sl2, sxl, cur, ts, tm = st[8], st[9], st[10], st[11], st[12], st[13], st[14]
    det = np.empty(nl, np.float32)
    flat = np.empty(nl, np.bool_)
    laux = np.empty((n, nl), np.float32)
    fnmax = F(nmax)
    for k in range(nl):
        sw[k] = wt[0, k]
        sx[k] = wt[0, k] * xt[0, k]
    for i in range(1, n):
        for k in range(nl):
            sw[k] += wt[i, k]
            sx[k] += wt[i, k] * xt[i, k]
    affine_start_lanes(xt, fnmax, mn, mx, isc, sc, bis, bmn)
    for k in range(nl):
        if flat_rule == 0:
            flat[k] = mx[k] == mn[k]
        elif flat_rule == 1:
            flat[k] = mx[k] <= mn[k]
        else:
            flat[k] = (mx[k] - mn[k]) < F(1e-10)
        best[k] = F(0)
    for i in range(n):
        for k in range(nl):
            l = clampf(nint(isc[k] * (xt[i, k] - mn[k])), 0, nmax)
            diff = sc[k] * l + mn[k] - xt[i, k]
            best[k] += wt[i, k] * (abs(diff) if use_mad else diff * diff)
    for s in range(nstep + 1):
        num = rmin + rdelta * F(s) + fnmax
        for k in range(nl):
            isc[k] = num / (mx[k] - mn[k])      # C uses the min of the best trial so far
        st[9:13] = F(0)                         # sl, sl2, sxl, cur
        for i in range(n):
            for k in range(nl):
                l = clampf(nint(isc[k] * (xt[i, k] - mn[k])), 0, nmax)
                laux[i, k] = l
                wl = wt[i, k] * l
                sl[k] += wl
                sl2[k] += wl * l
                sxl[k] += wl * xt[i, k]
        for k in range(nl):
            det[k] = sw[k] * sl2[k] - sl[k] * sl[k]
            t_s = (sw[k] * sxl[k] - sx[k] * sl[k]) / det[k]
            t_m = (sl2[k] * sx[k] - sl[k] * sxl[k]) / det[k]
            pos = t_m > 0               # selects instead of C's branch: the loop vectorises
            ts[k] = sxl[k] / sl2[k] if pos else t_s
            tm[k] = F(0) if pos else t_m
        if use_mad:
            for i in range(n):
                for k in range(nl):
                    diff = ts[k] * laux[i, k] + tm[k] - xt[i, k]
                    cur[k] += wt[i, k] * abs(diff)
        else:
            for i in range(n):
                for k in range(nl):
                    diff = ts[k] * laux[i, k] + tm[k] - xt[i, k]
                    cur[k] += wt[i, k] * (diff * diff)
        for k in range(nl):
            ok = (not flat[k]) and det[k] > 0 and cur[k] < best[k]
            best[k] = cur[k] if ok else best[k]
            sc[k] = ts[k] if ok else sc[k]
            bis[k] = isc[k] if ok else bis[k]
            bmn[k] = mn[k] if ok else bmn[k]
            mn[k] = tm[k] if ok else mn[k]
    for i in range(n):
        for k in range(nl):
            l = min(I32(nmax), max(I32(0), nint(bis[k] * (xt[i, k] - bmn[k]))))
            Lt[i, k] = I32(0) if flat[k] else l
    for k in range(nl):
        sc_out[k] = F(0) if flat[k] else sc[k]
        min_out[k] = -mn[k]


@njit(**_OPTS)
def _fit_ik(sum_w, sum_x, sl, sl2, sxl):
    """ik make_qkx3_quants: least-squares (scale, min <= 0) of fixed codes from the double sums."""
    det = sum_w * sl2 - sl * sl
    ts = (sum_w * sxl - sum_x * sl) / det
    tm = (sl2 * sum_x - sl * sxl) / det
    if tm > 0:
        tm = 0.0
        ts = sxl / sl2
    return det, ts, tm


@njit(**_OPTS)
def qkx3_ik_lanes(xt, wt, nmax, sc_out, min_out, Lt):
    """ik_llama.cpp's make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, false):
    double sums, each trial's squared error from the sums, then a greedy refinement."""
    n, nl = xt.shape
    rmin, rdelta, nstep = F(-0.9), F(0.05), 36
    fnmax = F(nmax)
    st = np.empty((8, nl), np.float32)
    mn, mx, sc, bis, bmn, isc, gmax, fl = st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7]
    sd = np.empty((8, nl), np.float64)
    sum_w, sum_x, sum_x2, best_mad, sl, sl2, sxl, best = sd[0], sd[1], sd[2], sd[3], sd[4], sd[5], sd[6], sd[7]
    xd = np.empty((n, nl), np.float64)          # every product below is exact in double: convert once
    wd = np.empty((n, nl), np.float64)
    for i in range(n):
        for k in range(nl):
            xd[i, k] = D(xt[i, k])
            wd[i, k] = D(wt[i, k])
    for k in range(nl):
        sum_w[k] = wd[0, k]
        sum_x[k] = sum_w[k] * xd[0, k]
        sum_x2[k] = sum_w[k] * xd[0, k] * xd[0, k]
    for i in range(1, n):
        for k in range(nl):
            w = wd[i, k]
            sum_w[k] += w
            sum_x[k] += w * xd[i, k]
            sum_x2[k] += w * xd[i, k] * xd[i, k]
    affine_start_lanes(xt, fnmax, mn, mx, isc, sc, bis, bmn)
    for k in range(nl):
        fl[k] = F(1) if (mx[k] - mn[k]) < F(1e-10) else F(0)          # flat sub-block
        best_mad[k] = 0.0
    for i in range(n):
        for k in range(nl):
            l = clampf(nint(isc[k] * (xt[i, k] - mn[k])), 0, nmax)
            diff = D(sc[k]) * D(l) + D(mn[k]) - xd[i, k]
            best_mad[k] += wd[i, k] * (diff * diff)
    for s in range(nstep + 1):
        num = rmin + rdelta * F(s) + fnmax
        for k in range(nl):
            isc[k] = num / (mx[k] - mn[k])
            sl[k] = 0.0
            sl2[k] = 0.0
            sxl[k] = 0.0
        for i in range(n):
            for k in range(nl):
                l = D(clampf(nint(isc[k] * (xt[i, k] - mn[k])), 0, nmax))
                wl = wd[i, k] * l
                sl[k] += wl
                sl2[k] += wl * l
                sxl[k] += wl * xd[i, k]
        for k in range(nl):
            # _fit_ik with selects (C divides only on the branch it takes; the values kept are the
            # same), so that the loop over lanes vectorises
            det = sum_w[k] * sl2[k] - sl[k] * sl[k]
            ts = (sum_w[k] * sxl[k] - sum_x[k] * sl[k]) / det
            tm = (sl2[k] * sum_x[k] - sl[k] * sxl[k]) / det
            pos = tm > 0
            ts = sxl[k] / sl2[k] if pos else ts
            tm = 0.0 if pos else tm
            mad = (sum_x2[k] - 2 * ts * sxl[k] - 2 * tm * sum_x[k] + 2 * ts * tm * sl[k]
                   + ts * ts * sl2[k] + tm * tm * sum_w[k])
            ok = fl[k] == 0 and det > 0 and mad < best_mad[k]
            best_mad[k] = mad if ok else best_mad[k]
            sc[k] = F(ts) if ok else sc[k]
            bis[k] = isc[k] if ok else bis[k]
            bmn[k] = mn[k] if ok else bmn[k]
            mn[k] = F(tm) if ok else mn[k]
    for i in range(n):
        for k in range(nl):
            Lt[i, k] = min(I32(nmax), max(I32(0), nint(bis[k] * (xt[i, k] - bmn[k]))))
            Lt[i, k] = I32(0) if fl[k] != 0 else Lt[i, k]

    # Greedy refinement: step the code with the largest residual towards its value while the
    # least-squares fit of the sums improves (and never straight back).  All sub-blocks run in
    # lockstep, each stopping exactly where C stops: the scan for the code to move is a loop over
    # values with an inner loop over lanes (vectorised); the update is per lane.
    for k in range(nl):
        sl[k] = 0.0
        sl2[k] = 0.0
        sxl[k] = 0.0
    for i in range(n):
        for k in range(nl):
            w = wd[i, k]
            l = D(Lt[i, k])
            sl[k] += w * l
            sl2[k] += w * l * l
            sxl[k] += w * l * xd[i, k]
    active = np.empty(nl, np.bool_)
    bj = np.empty(nl, np.int32)
    bdir = np.empty(nl, np.int32)
    last_j = np.full(nl, -1, np.int32)
    last_dir = np.zeros(nl, np.int32)
    n_active = 0
    for k in range(nl):
        sdd = D(sc[k])
        mdd = D(mn[k])
        best[k] = (2 * sdd * sxl[k] + 2 * mdd * sum_x[k] - 2 * sdd * mdd * sl[k]
                   - sdd * sdd * sl2[k] - mdd * mdd * sum_w[k])
        active[k] = fl[k] == 0
        n_active += active[k]
    for _ in range(nmax * n):
        if n_active == 0:
            break
        for k in range(nl):
            gmax[k] = F(0)
            bj[k] = -1
            bdir[k] = 0
        for j in range(n):
            for k in range(nl):
                lj = Lt[j, k]
                g = xt[j, k] - sc[k] * F(lj) - mn[k]
                up = g > 0 and lj < nmax and g > gmax[k]
                down = g < 0 and lj > 0 and -g > gmax[k]
                gmax[k] = g if up else (-g if down else gmax[k])
                bj[k] = j if (up or down) else bj[k]
                bdir[k] = 1 if up else (-1 if down else bdir[k])
        n_active = 0
        for k in range(nl):
            if not active[k]:
                continue
            j = bj[k]
            direction = bdir[k]
            if j < 0 or (j == last_j[k] and direction == -last_dir[k]):
                active[k] = False
                continue
            w = wd[j, k]
            sl[k] += w * D(direction)
            sl2[k] += w * D(2 * Lt[j, k] * direction + 1)
            sxl[k] += w * xd[j, k] * D(direction)
            det, ts, tm = _fit_ik(sum_w[k], sum_x[k], sl[k], sl2[k], sxl[k])
            if det <= 0 or ts < 0:
                active[k] = False
                continue
            score = (2 * ts * sxl[k] + 2 * tm * sum_x[k] - 2 * ts * tm * sl[k]
                     - ts * ts * sl2[k] - tm * tm * sum_w[k])
            if score <= best[k]:
                active[k] = False
                continue
            best[k] = score
            sc[k] = F(ts)
            mn[k] = F(tm)
            Lt[j, k] += direction
            last_j[k] = j
            last_dir[k] = direction
            n_active += 1
    for k in range(nl):
        sc_out[k] = F(0) if fl[k] != 0 else sc[k]
        min_out[k] = -mn[k]


@njit(**_OPTS)
def _qx_iscale(t, nmax, mx, ik):
    """Trial t of make_qx_quants in C's order: -nmax/max; then for is = -9..9 -(nmax + 0.1 is)/max
    (mainline skips is = 0), followed in ik by (nmax - 1 + 0.1 is)/max."""
    if t == 0:
        return F(-nmax) / mx
    if ik:
        s = (t - 1) // 2 - 9
        if (t - 1) % 2 == 1:
            return (F(nmax - 1) + F(0.1) * F(s)) / mx
    else:
        s = t - 10 if t <= 9 else t - 9
    return -(F(nmax) + F(0.1) * F(s)) / mx


@njit(**_OPTS)
def _take_better_lanes(sx, s2, isc, sc, best, bsx, bs2, bis):
    """make_qx_quants' test of one trial on every lane: where s2 > 0 and sx²/s2 beats the best, the
    trial (scale sx/s2, its sums and inverse scale isc) becomes the best."""
    for k in range(sx.shape[0]):
        ok = s2[k] > 0 and sx[k] * sx[k] > best[k] * s2[k]
        sc[k] = sx[k] / s2[k] if ok else sc[k]
        best[k] = sc[k] * sx[k] if ok else best[k]
        bsx[k] = sx[k] if ok else bsx[k]
        bs2[k] = s2[k] if ok else bs2[k]
        bis[k] = isc[k] if ok else bis[k]


@njit(**_OPTS)
def qx_lanes(xt, wt, nmax, ik, sc_out, Lt):
    """make_qx_quants(n, nmax, x, L, 1, w) for every lane: codes l + nmax, l in -nmax..nmax-1.
    ik adds trials and a greedy refinement.  Lanes with max|x| < 1e-15 get scale 0 and codes 0."""
    n, nl = xt.shape
    st = np.empty((10, nl), np.float32)
    amax, mx, sc, best, bsx, bs2, bis, isc, sx, s2 = (st[0], st[1], st[2], st[3], st[4], st[5],
                                                       st[6], st[7], st[8], st[9])
    wx = np.empty((n, nl), np.float32)
    lanes_first_absmax(xt, amax, mx)
    for i in range(n):
        for k in range(nl):
            wx[i, k] = wt[i, k] * xt[i, k]
    lo = I32(-nmax)
    hi = I32(nmax - 1)
    n_trials = 39 if ik else 19
    isb = np.empty((3, nl), np.float32)
    isc2, sx2, s22 = isb[0], isb[1], isb[2]
    # The trial scales depend only on max, so two trials share one pass over the values (two
    # independent chains per lane); they are then accepted or rejected one after the other, in C order.
    for t in range(0, n_trials, 2):
        t2 = t + 1 if t + 1 < n_trials else t
        for k in range(nl):
            isc[k] = _qx_iscale(t, nmax, mx[k], ik)
            isc2[k] = _qx_iscale(t2, nmax, mx[k], ik)
        st[8:10] = F(0)                         # sx, s2
        isb[1:3] = F(0)                         # sx2, s22
        for i in range(n):
            for k in range(nl):
                la = F(min(hi, max(lo, nint(isc[k] * xt[i, k]))))
                lb = F(min(hi, max(lo, nint(isc2[k] * xt[i, k]))))
                sx[k] += wx[i, k] * la
                s2[k] += wt[i, k] * la * la
                sx2[k] += wx[i, k] * lb
                s22[k] += wt[i, k] * lb * lb
        if t == 0:
            for k in range(nl):
                sc[k] = sx[k] / s2[k] if s2[k] != 0 else F(0)
                best[k] = sc[k] * sx[k]
                bsx[k] = sx[k]
                bs2[k] = s2[k]
                bis[k] = isc[k]
        else:
            _take_better_lanes(sx, s2, isc, sc, best, bsx, bs2, bis)
        if t2 != t:
            _take_better_lanes(sx2, s22, isc2, sc, best, bsx, bs2, bis)
    for i in range(n):
        for k in range(nl):
            Lt[i, k] = min(hi, max(lo, nint(bis[k] * xt[i, k])))
    for k in range(nl):
        if amax[k] < GROUP_MAX_EPS:
            sc[k] = F(0)
            for i in range(n):
                Lt[i, k] = lo           # codes 0
            continue
        if not ik:
            continue
        # greedy refinement: step the code with the largest |g|, g = scale*w*(x - scale*l), while
        # that raises sumlx²/suml2
        scale = sc[k]
        bst = best[k]
        sumlx = bsx[k]
        suml2 = bs2[k]
        for _ in range(n * (2 * nmax - 1)):
            abs_gmax = F(0)
            gmax = F(0)
            best_j = -1
            for j in range(n):
                l = Lt[j, k]
                g = scale * wt[j, k] * (xt[j, k] - scale * F(l))
                if (g > 0 and l < hi) or (g < 0 and l > lo):
                    ag = abs(g)
                    if ag > abs_gmax:
                        abs_gmax = ag
                        gmax = g
                        best_j = j
            if best_j < 0:
                break
            w = wt[best_j, k]
            l = Lt[best_j, k]
            if gmax > 0:
                nsx = sumlx + w * xt[best_j, k]
                ns2 = suml2 + w * F(2 * l + 1)
                l += 1
            else:
                nsx = sumlx - w * xt[best_j, k]
                ns2 = suml2 - w * F(2 * l - 1)
                l -= 1
            if ns2 > 0 and nsx * nsx > bst * ns2:
                sumlx = nsx
                suml2 = ns2
                scale = sumlx / suml2
                bst = scale * sumlx
                Lt[best_j, k] = l
            else:
                break
        sc[k] = scale
    for i in range(n):
        for k in range(nl):
            Lt[i, k] += I32(nmax)
    for k in range(nl):
        sc_out[k] = sc[k]


@njit(**_OPTS)
def q3_lanes(xt, nmax, ik, sc_out, Lt):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) for every lane: weights x², initial rounding
    against -nmax/max, then up to 5 passes of coordinate descent (a lane stops after a pass that
    changes nothing).  ik returns sumlx/suml2 unguarded."""
    n, nl = xt.shape
    st = np.empty((5, nl), np.float32)
    amax, mx, sumlx, suml2, isc = st[0], st[1], st[2], st[3], st[4]
    active = np.empty(nl, np.bool_)
    changed = np.empty(nl, np.bool_)
    lf = np.empty((n, nl), np.float32)
    lo = I32(-nmax)
    hi = I32(nmax - 1)
    for k in range(nl):
        sumlx[k] = F(0)
        suml2[k] = F(0)
    lanes_first_absmax(xt, amax, mx)
    for k in range(nl):
        isc[k] = F(-nmax) / mx[k]
        active[k] = not (amax[k] < GROUP_MAX_EPS)
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            l = F(min(hi, max(lo, nint(isc[k] * v))))
            lf[i, k] = l
            w = v * v
            sumlx[k] += w * v * l
            suml2[k] += w * l * l
    for _ in range(5):
        for k in range(nl):
            changed[k] = False
        for i in range(n):
            for k in range(nl):
                v = xt[i, k]
                w = v * v
                li = lf[i, k]
                slx = sumlx[k] - w * v * li
                sl2 = suml2[k] - w * li * li
                new_l = F(min(hi, max(lo, nint(v * sl2 / slx))))
                cand = active[k] and slx > 0 and new_l != li
                slx = slx + w * v * new_l
                sl2 = sl2 + w * new_l * new_l
                ok = cand and sl2 > 0 and slx * slx * suml2[k] > sumlx[k] * sumlx[k] * sl2
                lf[i, k] = new_l if ok else li
                sumlx[k] = slx if ok else sumlx[k]
                suml2[k] = sl2 if ok else suml2[k]
                changed[k] = changed[k] or ok
        any_active = False
        for k in range(nl):
            active[k] = active[k] and changed[k]
            any_active = any_active or active[k]
        if not any_active:
            break
    for i in range(n):
        for k in range(nl):
            Lt[i, k] = I32(0) if amax[k] < GROUP_MAX_EPS else I32(lf[i, k]) + I32(nmax)
    for k in range(nl):
        if amax[k] < GROUP_MAX_EPS:
            sc_out[k] = F(0)
        elif ik:
            sc_out[k] = sumlx[k] / suml2[k]
        else:
            sc_out[k] = sumlx[k] / suml2[k] if suml2[k] > 0 else F(0)


@njit(**_OPTS)
def qp_quants(x, nmax, qw, ik, L):
    """make_qp_quants(n, nmax, x, L, qw): quantize non-negative sub-block scales (or mins) to
    0..nmax against one scale, which is returned.  L is uint8_t in C: values wrap modulo 256."""
    n = x.shape[0]
    mx = F(0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < (F(1e-16) if ik else GROUP_MAX_EPS):
        for i in range(n):
            L[i] = 0
        return F(0)
    iscale = F(nmax) / mx
    for i in range(n):
        L[i] = nint(iscale * x[i]) & 0xFF
    scale = F(1) / iscale
    best_mse = F(0)
    for i in range(n):
        diff = x[i] - scale * F(L[i])
        best_mse += qw[i] * diff * diff
    for s in range(-4, 5):
        if s == 0:
            continue
        isc = (F(0.1) * F(s) + F(nmax)) / mx
        sc = F(1) / isc
        mse = F(0)
        for i in range(n):
            l = min(I32(nmax), nint(isc * x[i]))
            diff = x[i] - sc * F(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = isc
    sumlx = F(0)
    suml2 = F(0)
    for i in range(n):
        l = min(I32(nmax), nint(iscale * x[i]))
        L[i] = l & 0xFF
        sumlx += qw[i] * x[i] * F(l)
        suml2 += qw[i] * F(l) * F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            li = F(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(I32(nmax), nint(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    if ik:
        return sumlx / suml2
    return sumlx / suml2 if suml2 > 0 else F(0)


@njit(**_OPTS)
def qp_scales_mins(scales, mins, sw, j0, count, nmax, ik, Ls, Lm):
    """qp_quants of the ``count`` sub-block scales and mins from j0 against their weight sums:
    (scale of the scales, scale of the mins), the codes in Ls and Lm."""
    dm = qp_quants(scales[j0:j0 + count], nmax, sw[j0:j0 + count], ik, Ls)
    mm = qp_quants(mins[j0:j0 + count], nmax, sw[j0:j0 + count], ik, Lm)
    return dm, mm


@njit(**_OPTS)
def affine_imatrix_lanes(xr, xt, qw, factor, nmax, ik, wt, sw, scales, mins, Lt):
    """The imatrix search of Q2_K, Q4_K and Q5_K: weights qw*sqrtf(sigma2 + x²) (imatrix_lanes),
    then ik's make_qkx3_quants or mainline's make_qkx2_quants(-0.9, 0.05, 36) on every lane."""
    sumsq = np.empty(xr.shape[0] // QK_K, np.float32)
    superblock_sumsq(xr, sumsq)
    imatrix_lanes(xt, qw, sumsq, factor, wt, sw)
    if ik:
        qkx3_ik_lanes(xt, wt, nmax, scales, mins, Lt)
    else:
        qkx2_lanes(xt, wt, nmax, F(-0.9), F(0.05), 36, False, 1, scales, mins, Lt)


@njit(**_OPTS)
def requantize_lanes(xt, d_sub, dm_sub, lo, hi, offset, multiply, skip_zero, Lt):
    """Final codes from the per-sub-block scale d and min dm: ``clamp(nearest_int((x + dm)/d))``
    (``(x + dm)*(d ? 1/d : 0)`` with ``multiply``) + offset; lanes with d == 0 keep their codes when
    ``skip_zero`` (C: ``if (!d) continue;``)."""
    n, nl = xt.shape
    for i in range(n):
        for k in range(nl):
            d = d_sub[k]
            if multiply:
                idv = F(1) / d if d != 0 else F(0)
                v = (xt[i, k] + dm_sub[k]) * idv
            else:
                v = (xt[i, k] + dm_sub[k]) / d
            q = min(I32(hi), max(I32(lo), nint(v))) + I32(offset)
            Lt[i, k] = Lt[i, k] if (skip_zero and d == 0) else q


@njit(**_OPTS)
def gather_codes(Lt, size, sb, L):
    """Codes of super-block sb in value order (L[v] = Lt[v % size, sb*256/size + v // size])."""
    per_sb = QK_K // size
    for kk in range(per_sb):
        for i in range(size):
            L[kk * size + i] = Lt[i, sb * per_sb + kk]


# ---- bit packing ----

@njit(**_OPTS)
def pack_2bit(L, y, off):
    """qs[32h + l] = L[128h+l] | L[128h+l+32]<<2 | L[128h+l+64]<<4 | L[128h+l+96]<<6 (h = 0, 1)."""
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            y[off + 32 * h + l] = (L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)) & 0xFF


@njit(**_OPTS)
def pack_scales_k4(ls, lm, y, off):
    """scales[12] of Q4_K/Q5_K: bytes 0-3 sc0..3 | hi2(sc4..7)<<6, bytes 4-7 m0..3 | hi2(m4..7)<<6,
    bytes 8-11 lo4(sc4..7) | lo4(m4..7)<<4."""
    for j in range(4):
        y[off + j] = (ls[j] | ((ls[j + 4] >> 4) << 6)) & 0xFF
        y[off + j + 4] = (lm[j] | ((lm[j + 4] >> 4) << 6)) & 0xFF
        y[off + j + 8] = ((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4)) & 0xFF


@njit(**_OPTS)
def scale_min_k4(j, y, off):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j."""
    if j < 4:
        return np.int64(y[off + j]) & 63, np.int64(y[off + j + 4]) & 63
    a = np.int64(y[off + j + 4])
    return (a & 0xF) | ((np.int64(y[off + j - 4]) >> 6) << 4), (a >> 4) | ((np.int64(y[off + j]) >> 6) << 4)


@njit(**_OPTS)
def pack_scales_q3(ls, y, off):
    """scales[12] of Q3_K: bytes 0-7 lo4(s_j) | lo4(s_j+8)<<4; byte 8+m has hi2 of s_m, s_m+4, s_m+8,
    s_m+12 at bits 0, 2, 4, 6."""
    sc = np.zeros(12, np.int64)
    for j in range(16):
        l = ls[j]
        if j < 8:
            sc[j] = l & 0xF
        else:
            sc[j - 8] |= (l & 0xF) << 4
        sc[8 + j % 4] |= (l >> 4) << (2 * (j // 4))
    for j in range(12):
        y[off + j] = sc[j] & 0xFF


@njit(**_OPTS)
def scale_q3(j, y, off):
    """Signed 6-bit scale j of a Q3_K block (stored - 32)."""
    s = np.int64(y[off + j]) & 0xF if j < 8 else np.int64(y[off + j - 8]) >> 4
    return (s | (((np.int64(y[off + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


# ---- per-type row quantizers ----

@njit(**_OPTS)
def q2_k_row(xr, qw, has_qw, ik, y):
    nsb = xr.shape[0] // QK_K
    xt, wt, Lt, lane = row_lanes(xr, 16, 5)
    scales, mins, sw, d_sub, dm_sub = lane[0], lane[1], lane[2], lane[3], lane[4]
    L = np.empty(QK_K, np.int64)
    sc = np.empty(16, np.int64)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    if not has_qw:
        for i in range(16):
            for k in range(xt.shape[1]):
                wt[i, k] = abs(xt[i, k])
        qkx2_lanes(xt, wt, 3, F(-0.5), F(0.1), 15, True, 2 if ik else 0, scales, mins, Lt)
        for sb in range(nsb):
            ob = sb * Q2_K_BYTES
            max_scale = positive_max(scales[sb * 16:sb * 16 + 16])
            max_min = positive_max(mins[sb * 16:sb * 16 + 16])
            for j in range(16):
                sc[j] = 0
            if max_scale > 0:
                iscale = F(15) / max_scale
                for j in range(16):
                    sc[j] = nint(iscale * scales[sb * 16 + j]) & 0xFF
                d = store_fp16(y, ob + 80, max_scale / F(15))
            else:
                d = store_fp16(y, ob + 80, F(0))
            if max_min > 0:
                iscale = F(15) / max_min
                for j in range(16):
                    sc[j] = (sc[j] | (np.int64(nint(iscale * mins[sb * 16 + j])) << 4)) & 0xFF
                dmin = store_fp16(y, ob + 82, max_min / F(15))
            else:
                dmin = store_fp16(y, ob + 82, F(0))
            for j in range(16):
                y[ob + j] = sc[j]
                d_sub[sb * 16 + j] = d * F(sc[j] & 0xF)
                dm_sub[sb * 16 + j] = dmin * F(sc[j] >> 4)
        requantize_lanes(xt, d_sub, dm_sub, 0, 3, 0, False, True, Lt)
    else:
        affine_imatrix_lanes(xr, xt, qw, F(0.75) if ik else F(1), 3, ik, wt, sw, scales, mins, Lt)
        for sb in range(nsb):
            ob = sb * Q2_K_BYTES
            dm, mm = qp_scales_mins(scales, mins, sw, sb * 16, 16, 15, ik, Ls, Lm)
            dr = store_fp16(y, ob + 80, dm)
            mr = store_fp16(y, ob + 82, mm)
            for j in range(16):
                scj = (Ls[j] | (Lm[j] << 4)) & 0xFF
                y[ob + j] = scj
                if ik:          # the unrounded float scales, codes by *(1/d), no skip
                    d_sub[sb * 16 + j] = dm * F(Ls[j])
                    dm_sub[sb * 16 + j] = mm * F(Lm[j])
                else:
                    d_sub[sb * 16 + j] = dr * F(scj & 0xF)
                    dm_sub[sb * 16 + j] = mr * F(scj >> 4)
        requantize_lanes(xt, d_sub, dm_sub, 0, 3, 0, ik, not ik, Lt)
    for sb in range(nsb):
        gather_codes(Lt, 16, sb, L)
        pack_2bit(L, y, sb * Q2_K_BYTES + 16)


@njit(**_OPTS)
def q3_k_row(xr, qw, has_qw, ik, y):
    nsb = xr.shape[0] // QK_K
    xt, wt, Lt, lane = row_lanes(xr, 16, 4)
    scales, sw, d_sub, zeros = lane[0], lane[1], lane[2], lane[3]
    L = np.empty(QK_K, np.int64)
    ls = np.empty(16, np.int64)
    if not has_qw:
        q3_lanes(xt, 4, ik, scales, Lt)
        for sb in range(nsb):
            ob = sb * Q3_K_BYTES
            max_scale = first_absmax(scales[sb * 16:sb * 16 + 16])[1]
            if max_scale != 0:
                iscale = F(-32) / max_scale
                for j in range(16):
                    l = np.int64(np.int8(nint(iscale * scales[sb * 16 + j]) & 0xFF))   # int8_t l
                    ls[j] = max(-32, min(31, l)) + 32
                pack_scales_q3(ls, y, ob + 96)
                store_fp16(y, ob + 108, F(1) / iscale)
            else:
                for j in range(12):
                    y[ob + 96 + j] = 0
                store_fp16(y, ob + 108, F(0))
    else:
        sumsq = np.empty(nsb, np.float32)
        superblock_sumsq(xr, sumsq)
        imatrix_lanes(xt, qw, sumsq, F(2), wt, sw)
        qx_lanes(xt, wt, 4, ik, scales, Lt)
        # the 16 sub-block scales of every super-block, quantized with their weight sums (lanes =
        # super-blocks)
        st = np.empty((16, nsb), np.float32)
        swt = np.empty((16, nsb), np.float32)
        for sb in range(nsb):
            for j in range(16):
                st[j, sb] = scales[sb * 16 + j]
                swt[j, sb] = sw[sb * 16 + j]
        d_block = np.empty(nsb, np.float32)
        Lst = np.empty((16, nsb), np.int32)
        qx_lanes(st, swt, 32, ik, d_block, Lst)
        for sb in range(nsb):
            for j in range(16):
                ls[j] = Lst[j, sb]
            pack_scales_q3(ls, y, sb * Q3_K_BYTES + 96)
            store_fp16(y, sb * Q3_K_BYTES + 108, d_block[sb])
    for sb in range(nsb):
        ob = sb * Q3_K_BYTES
        d = fp16_value(np.int64(y[ob + 108]) | (np.int64(y[ob + 109]) << 8))
        for j in range(16):
            d_sub[sb * 16 + j] = d * F(scale_q3(j, y, ob + 96))
            zeros[sb * 16 + j] = F(0)
    requantize_lanes(xt, d_sub, zeros, -4, 3, 4, False, True, Lt)
    for sb in range(nsb):
        ob = sb * Q3_K_BYTES
        gather_codes(Lt, 16, sb, L)
        # hmask[m] bit k = bit 2 of the code of value 32k + m; the low 2 bits go to qs
        for m in range(32):
            h = 0
            for k in range(8):
                h |= (L[32 * k + m] >> 2) << k
            y[ob + m] = h & 0xFF
        for j in range(QK_K):
            L[j] &= 3
        pack_2bit(L, y, ob + 32)


@njit(**_OPTS)
def q45_k_row(xr, qw, has_qw, ik, y):
    """Q4_K and Q5_K share this kernel (one signature for all row kernels): the output row length
    (Q4_K_BYTES or Q5_K_BYTES a super-block) says which."""
    n = xr.shape[0]
    nmax = 15 if y.shape[0] == (n // QK_K) * Q4_K_BYTES else 31
    nsb = n // QK_K
    ts = Q4_K_BYTES if nmax == 15 else Q5_K_BYTES
    xt, wt, Lt, lane = row_lanes(xr, 32, 5)
    nl = xt.shape[1]
    scales, mins, sw, d_sub, dm_sub = lane[0], lane[1], lane[2], lane[3], lane[4]
    L = np.empty(QK_K, np.int64)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    if not has_qw:
        lane_sumsq(xt, sw)
        for i in range(32):
            for k in range(nl):
                wt[i, k] = np.sqrt(sw[k] / F(32)) + abs(xt[i, k])       # av_x + |x|
        if nmax == 15:
            qkx2_lanes(xt, wt, 15, F(-1.0), F(0.1), 20, False, 2 if ik else 0, scales, mins, Lt)
        else:
            qkx2_lanes(xt, wt, 31, F(-0.5), F(0.1), 15, False, 2 if ik else 0, scales, mins, Lt)
        for sb in range(nsb):
            ob = sb * ts
            max_scale = positive_max(scales[sb * 8:sb * 8 + 8])
            max_min = positive_max(mins[sb * 8:sb * 8 + 8])
            inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
            inv_min = F(63) / max_min if max_min > 0 else F(0)
            for j in range(8):
                ls[j] = min(63, np.int64(nint(inv_scale * scales[sb * 8 + j]) & 0xFF))   # uint8_t
                lm[j] = min(63, np.int64(nint(inv_min * mins[sb * 8 + j]) & 0xFF))
            pack_scales_k4(ls, lm, y, ob + 4)
            store_fp16(y, ob, max_scale / F(63))
            store_fp16(y, ob + 2, max_min / F(63))
    else:
        affine_imatrix_lanes(xr, xt, qw, F(2), nmax, ik, wt, sw, scales, mins, Lt)
        for sb in range(nsb):
            ob = sb * ts
            d_block, m_block = qp_scales_mins(scales, mins, sw, sb * 8, 8, 63, ik, ls, lm)
            if nmax == 31:      # only quantize_row_q5_K_impl clamps (a no-op unless L wrapped)
                for j in range(8):
                    ls[j] = min(63, ls[j])
                    lm[j] = min(63, lm[j])
            pack_scales_k4(ls, lm, y, ob + 4)
            store_fp16(y, ob, d_block)
            store_fp16(y, ob + 2, m_block)
    for sb in range(nsb):
        ob = sb * ts
        d = fp16_value(np.int64(y[ob]) | (np.int64(y[ob + 1]) << 8))
        dmin = fp16_value(np.int64(y[ob + 2]) | (np.int64(y[ob + 3]) << 8))
        for j in range(8):
            s, m = scale_min_k4(j, y, ob + 4)
            d_sub[sb * 8 + j] = d * F(s)
            dm_sub[sb * 8 + j] = dmin * F(m)
    requantize_lanes(xt, d_sub, dm_sub, 0, nmax, 0, False, True, Lt)
    for sb in range(nsb):
        ob = sb * ts
        gather_codes(Lt, 32, sb, L)
        qs = ob + 16
        if nmax == 31:
            # qh[l] bit k = bit 4 of the code of value 32k + l
            for l in range(32):
                h = 0
                for k in range(8):
                    h |= (L[32 * k + l] >> 4) << k
                y[ob + 16 + l] = h & 0xFF
            qs = ob + 48
        # qs[32c + l] = low nibble: value 64c + l, high nibble: value 64c + 32 + l
        for c in range(4):
            for l in range(32):
                y[qs + 32 * c + l] = (L[64 * c + l] & 0xF) | ((L[64 * c + 32 + l] & 0xF) << 4)


@njit(**_OPTS)
def q6_k_row(xr, qw, has_qw, ik, y):
    nsb = xr.shape[0] // QK_K
    xt, wt, Lt, lane = row_lanes(xr, 16, 3)
    nl = xt.shape[1]
    scales, d_sub, zeros = lane[0], lane[1], lane[2]
    for i in range(16):
        for k in range(nl):
            # the raw imatrix (no sigma2 term) or x²
            wt[i, k] = qw[k * 16 + i] if has_qw else xt[i, k] * xt[i, k]
    qx_lanes(xt, wt, 32, ik, scales, Lt)
    L = np.empty(QK_K, np.int64)
    zero_sb = np.empty(nsb, np.bool_)
    for sb in range(nsb):
        ob = sb * Q6_K_BYTES
        amax, max_scale = first_absmax(scales[sb * 16:sb * 16 + 16])
        zero_sb[sb] = amax < GROUP_MAX_EPS
        for j in range(16):
            zeros[sb * 16 + j] = F(0)
        if zero_sb[sb]:
            for j in range(16):
                d_sub[sb * 16 + j] = F(0)
            continue
        iscale = F(-128) / max_scale
        d = store_fp16(y, ob + 208, F(1) / iscale)
        for j in range(16):
            s8 = np.int8(min(I32(127), nint(iscale * scales[sb * 16 + j])))      # int8_t scales[]
            y[ob + 192 + j] = np.uint8(s8)
            d_sub[sb * 16 + j] = d * F(s8)
    requantize_lanes(xt, d_sub, zeros, -32, 31, 32, False, True, Lt)
    for sb in range(nsb):
        ob = sb * Q6_K_BYTES
        if zero_sb[sb]:
            for j in range(Q6_K_BYTES):
                y[ob + j] = 0
            continue
        gather_codes(Lt, 16, sb, L)
        # per half h: ql[64h + l] = lo4(v l) | lo4(v l+64)<<4, ql[64h + l + 32] = lo4(v l+32) |
        # lo4(v l+96)<<4, qh[32h + l] = hi2 of v l, l+32, l+64, l+96 at bits 0, 2, 4, 6
        for h in range(2):
            for l in range(32):
                j = 128 * h + l
                y[ob + 64 * h + l] = (L[j] & 0xF) | ((L[j + 64] & 0xF) << 4)
                y[ob + 64 * h + l + 32] = (L[j + 32] & 0xF) | ((L[j + 96] & 0xF) << 4)
                y[ob + 128 + 32 * h + l] = ((L[j] >> 4) | ((L[j + 32] >> 4) << 2)
                                            | ((L[j + 64] >> 4) << 4) | ((L[j + 96] >> 4) << 6))


ROW_KERNELS = {Q2_K: q2_k_row, Q3_K: q3_k_row, Q4_K: q45_k_row, Q5_K: q45_k_row, Q6_K: q6_k_row}


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Quantize rows x (n_rows, n_per_row) to ``qtype`` blocks in out (n_rows, row_size).
    qw: the imatrix (n_per_row,), read only when has_qw."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def q2_k_trinet(x, chunk_rows, out):
    """ik's quantize_row_q2_K_ref first looks at the whole chunk it is given: if rounding every value
    to {-max, 0, +max} leaves less than a tenth of Σx², the chunk is stored ternary (d = dmin =
    fp16(max), all scales 1|1<<4, codes 0/1/2).  Chunks of ``chunk_rows`` rows, as llama-quantize cuts."""
    n_rows, n = x.shape
    n_chunks = (n_rows + chunk_rows - 1) // chunk_rows
    for c in prange(n_chunks):
        r0 = c * chunk_rows
        r1 = min(n_rows, r0 + chunk_rows)
        mx = F(0)
        for r in range(r0, r1):
            for j in range(n):
                mx = max(mx, abs(x[r, j]))
        half = F(0.5) * mx
        mse0 = F(0)
        mse = F(0)
        for r in range(r0, r1):
            for j in range(n):
                v = x[r, j]
                l = F(-1) if v < -half else (F(0) if v < half else F(1))
                mse0 += v * v
                diff = v - mx * l
                mse += diff * diff
        if not (mse < F(0.1) * mse0):
            continue
        L = np.empty(QK_K, np.int64)
        for r in range(r0, r1):
            y = out[r]
            for sb in range(n // QK_K):
                ob = sb * Q2_K_BYTES
                store_fp16(y, ob + 80, mx)
                store_fp16(y, ob + 82, mx)
                for j in range(16):
                    y[ob + j] = 0x11
                for j in range(QK_K):
                    v = x[r, sb * QK_K + j]
                    L[j] = 0 if v < -half else (1 if v < half else 2)
                pack_2bit(L, y, ob + 16)


# ---- decoding ----

@njit(**_OPTS)
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y (dequantize_row_*)."""
    n = y.shape[0]
    for sb in range(n // QK_K):
        e = sb * QK_K
        if qtype == Q2_K:
            o = sb * Q2_K_BYTES
            d = fp16_at(b, o + 80, fp16_table)
            dmin = fp16_at(b, o + 82, fp16_table)
            for s in range(16):
                sc = np.int64(b[o + s])
                dl = d * F(sc & 0xF)
                ml = dmin * F(sc >> 4)
                for i in range(16):
                    v = 16 * s + i
                    q = (np.int64(b[o + 16 + 32 * (v // 128) + v % 32]) >> (2 * ((v % 128) // 32))) & 3
                    y[e + v] = dl * F(q) - ml
        elif qtype == Q3_K:
            o = sb * Q3_K_BYTES
            d = fp16_at(b, o + 108, fp16_table)
            for s in range(16):
                dl = d * F(scale_q3(s, b, o + 96))
                for i in range(16):
                    v = 16 * s + i
                    q = (np.int64(b[o + 32 + 32 * (v // 128) + v % 32]) >> (2 * ((v % 128) // 32))) & 3
                    h = (np.int64(b[o + v % 32]) >> (v // 32)) & 1
                    y[e + v] = dl * F(q - (0 if h else 4))
        elif qtype == Q4_K or qtype == Q5_K:
            o = sb * (Q4_K_BYTES if qtype == Q4_K else Q5_K_BYTES)
            d = fp16_at(b, o, fp16_table)
            dmin = fp16_at(b, o + 2, fp16_table)
            qs = o + 16 if qtype == Q4_K else o + 48
            for s in range(8):
                sc, m = scale_min_k4(s, b, o + 4)
                dl = d * F(sc)
                ml = dmin * F(m)
                for i in range(32):
                    v = 32 * s + i
                    q = (np.int64(b[qs + 32 * (s // 2) + i]) >> (4 * (s % 2))) & 0xF
                    if qtype == Q5_K:
                        q += ((np.int64(b[o + 16 + i]) >> s) & 1) << 4
                    y[e + v] = dl * F(q) - ml
        else:
            o = sb * Q6_K_BYTES
            d = fp16_at(b, o + 208, fp16_table)
            # per 16 values one scale: worked out once, the values' loop left with loads and shifts
            for s16 in range(16):
                dl = d * F(np.int64(np.int8(b[o + 192 + s16])))
                v0 = 16 * s16
                h = v0 // 128
                quarter = (v0 % 128) // 32
                l0 = v0 % 32
                lo_at = o + 64 * h + l0 + 32 * (quarter % 2)
                lo_shift = 4 * (quarter // 2)
                hi_at = o + 128 + 32 * h + l0
                hi_shift = 2 * quarter
                for j in range(16):
                    lo = (np.int64(b[lo_at + j]) >> lo_shift) & 0xF
                    hi = (np.int64(b[hi_at + j]) >> hi_shift) & 3
                    y[e + v0 + j] = dl * F((lo | (hi << 4)) - 32)


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32 (dequantize_row_*)."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
