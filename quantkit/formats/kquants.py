"""The k-quants: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value super-blocks).

A super-block of 256 values is cut into sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
Every sub-block gets its own small integer scale (and for Q2_K/Q4_K/Q5_K a min), quantized against
one fp16 super-scale ``d`` (and ``dmin``); specs/ggml-quants.md §1.2-1.6 give layouts and decoding::

    Q2_K  y = d*(sc&0xF)*q - dmin*(sc>>4)         q in 0..3      scales[16] qs[64] d dmin
    Q3_K  y = d*(sc6-32)*(q-4)                     q in 0..7      hmask[32] qs[64] scales[12] d
    Q4_K  y = d*sc6*q - dmin*m6                    q in 0..15     d dmin scales[12] qs[128]
    Q5_K  y = d*sc6*q - dmin*m6                    q in 0..31     d dmin scales[12] qh[32] qs[128]
    Q6_K  y = d*sc8*(q-32)                         q in 0..63     ql[128] qh[64] scales[16] d

Quantizers.  ``ggml_quantize_chunk`` runs the ``quantize_row_*_ref`` function when no imatrix is
given and the ``*_impl`` function with one.  Both end the same way: the super-scales are stored as
fp16 and every code is re-derived from the *rounded* scales.  The scale searches are helpers shared
with the legacy types, and ik_llama.cpp changed several of them:

* ``make_qkx2_quants`` (Q2_K/Q4_K/Q5_K without imatrix): a sub-block is "flat" (all codes 0) when
  ``max == min`` in mainline, ``max - min < 1e-10`` in ik;
* ``make_qkx3_quants`` (Q2_K/Q4_K/Q5_K with imatrix): mainline is make_qkx2 in float32; ik keeps the
  sums in double, evaluates each trial's error from the sums and ends with a greedy refinement;
* ``make_qx_quants`` (Q3_K with imatrix, Q6_K): ik tries two scales per step (also ``is = 0``) and
  ends with a greedy refinement;
* ``make_q3_quants`` / ``make_qp_quants`` (ik): no guard against ``0/0`` in the returned scale, and
  ``make_qp_quants`` treats a maximum below 1e-16 (not 1e-15) as zero;
* ik's Q2_K: without imatrix a "TriNet" test on the whole chunk of rows handed to
  ``ggml_quantize_chunk`` may store a ternary encoding.  quantkit applies it to llama-quantize's
  chunks, ``chunk_rows(n_per_row)`` rows counted from the first row of the array given to
  ``quantize`` (so callers that quantize a tensor in slabs should cut them at multiples of that, and
  3-D tensors one expert at a time, as llama-quantize does).  With an imatrix ``sigma2`` is
  ``0.75*Σx²/256`` (mainline ``Σx²/256``) and the codes are re-derived from the unrounded float scales.

The code below is vectorised across (sub-)blocks but keeps the C evaluation order of every float32
(or double) expression and adds sums one value at a time, because any other order changes the last
bit of a scale and, through it, codes.  ``nearest_int`` is ggml's bit trick, reproduced exactly
(round half to even; the same garbage as C far outside ±2^22 and for NaN).
"""
from __future__ import annotations

import numpy as np

from ..kernels import kquants as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, BlockFormat
from . import decode
from ._numeric import first_absmax, fp16_bytes, recip_or_zero, seq_sum  # noqa: F401 (re-exported)

F = np.float32
D64 = np.float64
GROUP_MAX_EPS = F(1e-15)

#: llama-quantize hands ggml_quantize_chunk chunks of ceil(16384 / n_per_row) rows (at least one
#: row); ik's Q2_K TriNet test looks at one chunk at a time (llama-quantize.cpp, min_chunk_size)
MIN_CHUNK_ELEMENTS = 32 * 512


def chunk_rows(n_per_row: int) -> int:
    """Rows per llama-quantize chunk (the unit of ik's Q2_K TriNet test)."""
    if n_per_row >= MIN_CHUNK_ELEMENTS:
        return 1
    return (MIN_CHUNK_ELEMENTS + n_per_row - 1) // n_per_row


# ---- float helpers ----


def nearest_int(v) -> np.ndarray:
    """ggml's ``nearest_int``: ``(bits(v + 12582912.f) & 0x7fffff) - 0x400000`` as int32.

    Equals round-half-to-even for |v| <= 2^22; reproduced bit for bit so that out-of-range values and
    NaN (-> 0 for the default NaN) come out as they do in C."""
    b = (np.asarray(v, np.float32) + F(12582912.0)).view(np.int32)
    return (b & 0x7FFFFF) - 0x400000


def nint_clip(v, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as float32 (codes take part in float32 sums)."""
    return np.clip(nearest_int(v), lo, hi).astype(np.float32)






def fp16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)): the stored super-scale as the requantization sees it."""
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def fp16_values(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 fp16 bytes -> float32 (n,)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32).reshape(-1)






def sub_blocks(x: np.ndarray, size: int) -> np.ndarray:
    """(n_rows, n) -> (n_rows*n/size, size) lanes, row-major (lane k = values k*size..k*size+size-1)."""
    return np.ascontiguousarray(x, np.float32).reshape(-1, size)


# ---- scale searches (lanes = sub-blocks; arrays (n_lanes, n)) ----


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad, flat_rule):
    """Affine search ``x ≈ scale*L + min`` with L in 0..nmax, float32 throughout.

    This is ggml's make_qkx2_quants, and with ``use_mad=False`` also mainline's make_qkx3_quants.
    ``flat_rule`` is the test for a sub-block that gets scale 0 and codes 0: ``"eq"`` ``max == min``
    (mainline qkx2), ``"le"`` ``max <= min`` (mainline qkx3), ``"eps"`` ``max - min < 1e-10`` (ik qkx2).
    Returns (scale, the_min = -min, L (int64)).
    """
    n = x.shape[1]
    mn, mx = x[:, 0].copy(), x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    mn = np.where(mn > 0, F(0), mn)
    if flat_rule == "eq":
        flat = mx == mn
    elif flat_rule == "le":
        flat = mx <= mn
    else:
        flat = (mx - mn) < F(1e-10)

    def error(scale, min_, L):
        diff = (scale[:, None] * L + min_[:, None]) - x
        return seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    with np.errstate(all="ignore"):        # flat lanes divide by zero; they are reset at the end
        iscale = F(nmax) / (mx - mn)
        scale = F(1) / iscale
        L = nint_clip(iscale[:, None] * (x - mn[:, None]), 0, nmax)
        best = error(scale, mn, L)
        for s in range(nstep + 1):
            # C reads `min` here, which the accepted trials below update
            iscale = (F(rmin) + F(rdelta) * F(s) + F(nmax)) / (mx - mn)
            la = nint_clip(iscale[:, None] * (x - mn[:, None]), 0, nmax)
            wl = w * la
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum(wl * la)
            sum_xl = seq_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            ts = (sum_w * sum_xl - sum_x * sum_l) / det
            tm = (sum_l2 * sum_x - sum_l * sum_xl) / det
            pos = tm > 0
            tm = np.where(pos, F(0), tm)
            ts = np.where(pos, sum_xl / sum_l2, ts)
            cur = error(ts, tm, la)
            better = ~flat & (det > 0) & (cur < best)
            L = np.where(better[:, None], la, L)
            best = np.where(better, cur, best)
            scale = np.where(better, ts, scale)
            mn = np.where(better, tm, mn)
    L = np.where(flat[:, None], F(0), L)
    scale = np.where(flat, F(0), scale)
    return scale.astype(np.float32), (-mn).astype(np.float32), L.astype(np.int64)


def make_qkx3_quants_ik(x, w, nmax, rmin=F(-0.9), rdelta=F(0.05), nstep=36):
    """ik_llama.cpp's make_qkx3_quants (use_mad false): sums in double, each trial's weighted squared
    error computed from the sums, then a greedy refinement that moves one code at a time.
    Returns (scale, the_min, L)."""
    n_lanes, n = x.shape
    xd, wd = x.astype(D64), w.astype(D64)
    mn, mx = x[:, 0].copy(), x[:, 0].copy()
    sum_w = wd[:, 0].copy()
    sum_x = sum_w * xd[:, 0]
    sum_x2 = sum_w * xd[:, 0] * xd[:, 0]
    for i in range(1, n):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
        sum_w = sum_w + wd[:, i]
        sum_x = sum_x + wd[:, i] * xd[:, i]
        sum_x2 = sum_x2 + wd[:, i] * xd[:, i] * xd[:, i]
    mn = np.where(mn > 0, F(0), mn)
    flat = (mx - mn) < F(1e-10)

    def fit(sl, sl2, sxl):
        """least-squares (scale, min <= 0) for fixed codes, from the sums"""
        det = sum_w * sl2 - sl * sl
        ts = (sum_w * sxl - sum_x * sl) / det
        tm = (sl2 * sum_x - sl * sxl) / det
        pos = tm > 0
        return det, np.where(pos, sxl / sl2, ts), np.where(pos, 0.0, tm)

    with np.errstate(all="ignore"):
        iscale = F(nmax) / (mx - mn)
        scale = F(1) / iscale
        L = nint_clip(iscale[:, None] * (x - mn[:, None]), 0, nmax)
        diff = (scale.astype(D64)[:, None] * L + mn.astype(D64)[:, None]) - xd
        best_mad = seq_sum(wd * (diff * diff))
        for s in range(nstep + 1):
            iscale = (F(rmin) + F(rdelta) * F(s) + F(nmax)) / (mx - mn)
            la = nint_clip(iscale[:, None] * (x - mn[:, None]), 0, nmax)
            wl = wd * la
            sl, sl2, sxl = seq_sum(wl), seq_sum(wl * la), seq_sum(wl * xd)
            det, ts, tm = fit(sl, sl2, sxl)
            mad = (sum_x2 - 2 * ts * sxl - 2 * tm * sum_x + 2 * ts * tm * sl
                   + ts * ts * sl2 + tm * tm * sum_w)
            better = ~flat & (det > 0) & (mad < best_mad)
            L = np.where(better[:, None], la, L)
            best_mad = np.where(better, mad, best_mad)
            scale = np.where(better, ts.astype(np.float32), scale)
            mn = np.where(better, tm.astype(np.float32), mn)

        # greedy refinement: step the code with the largest residual towards its value while the
        # least-squares fit of the sums keeps improving
        wl = wd * L
        sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * L), seq_sum(wl * xd)
        sd, md = scale.astype(D64), mn.astype(D64)
        best = 2 * sd * sum_xl + 2 * md * sum_x - 2 * sd * md * sum_l - sd * sd * sum_l2 - md * md * sum_w
        last_j = np.full(n_lanes, -1)
        last_dir = np.zeros(n_lanes)
        act = np.nonzero(~flat)[0]
        for _ in range(nmax * n):
            if act.size == 0:
                break
            rows = np.arange(act.size)
            xa, la = x[act], L[act]
            g = (xa - scale[act][:, None] * la) - mn[act][:, None]
            cand = np.where((g > 0) & (la < nmax), g, np.where((g < 0) & (la > 0), -g, F(0)))
            j = np.argmax(cand, axis=1)             # first of equal maxima (C: strict '>')
            direction = np.where(g[rows, j] > 0, 1.0, -1.0)
            go = (cand[rows, j] > 0) & ~((j == last_j[act]) & (direction == -last_dir[act]))
            wj = wd[act, j]
            n_sl = sum_l[act] + wj * direction
            n_sl2 = sum_l2[act] + wj * (2 * la[rows, j].astype(D64) * direction + 1)
            n_sxl = sum_xl[act] + wj * xd[act, j] * direction
            sw, sx = sum_w[act], sum_x[act]
            det = sw * n_sl2 - n_sl * n_sl
            ts = (sw * n_sxl - sx * n_sl) / det
            tm = (n_sl2 * sx - n_sl * n_sxl) / det
            pos = tm > 0
            tm = np.where(pos, 0.0, tm)
            ts = np.where(pos, n_sxl / n_sl2, ts)
            score = 2 * ts * n_sxl + 2 * tm * sx - 2 * ts * tm * n_sl - ts * ts * n_sl2 - tm * tm * sw
            go &= (det > 0) & ~(ts < 0) & (score > best[act])
            a, jg = act[go], j[go]
            sum_l[a], sum_l2[a], sum_xl[a] = n_sl[go], n_sl2[go], n_sxl[go]
            best[a] = score[go]
            scale[a] = ts[go].astype(np.float32)
            mn[a] = tm[go].astype(np.float32)
            L[a, jg] = L[a, jg] + direction[go].astype(np.float32)
            last_j[a], last_dir[a] = jg, direction[go]
            act = a
    L = np.where(flat[:, None], F(0), L)
    scale = np.where(flat, F(0), scale)
    return scale.astype(np.float32), (-mn).astype(np.float32), L.astype(np.int64)


def make_qkx3_quants(x, w, nmax, flavor):
    """make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, false) of either project."""
    if flavor == "ik":
        return make_qkx3_quants_ik(x, w, nmax)
    return make_qkx2_quants(x, w, nmax, F(-0.9), F(0.05), 36, False, "le")


def make_qx_quants(x, w, nmax, flavor):
    """Symmetric weighted search (rmse_type 1 with weights ``w``): codes l + nmax, l in -nmax..nmax-1.

    Mainline tries ``-nmax/max`` and then ``-(nmax + 0.1 is)/max`` for is = -9..9 except 0; ik tries
    for every is = -9..9 both ``-(nmax + 0.1 is)/max`` and ``(nmax - 1 + 0.1 is)/max`` and ends with a
    greedy refinement.  A sub-block with max|x| < 1e-15 gets scale 0 and codes 0.
    Returns (scale, L (int64 codes)).
    """
    n_lanes, n = x.shape
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    wx = w * x

    def sums(iscale):
        l = nint_clip(iscale[:, None] * x, -nmax, nmax - 1)
        return l, seq_sum(wx * l), seq_sum((w * l) * l)

    with np.errstate(all="ignore"):
        iscale0 = F(-nmax) / mx
        L, sumlx, suml2 = sums(iscale0)
        scale = np.where(suml2 != 0, sumlx / suml2, F(0)).astype(np.float32)
        best = scale * sumlx
        trials = []
        for s in range(-9, 10):
            if flavor == "ik":
                trials.append(-(F(nmax) + F(0.1) * F(s)) / mx)
                trials.append((F(nmax - 1) + F(0.1) * F(s)) / mx)
            elif s != 0:
                trials.append(-(F(nmax) + F(0.1) * F(s)) / mx)
        for iscale in trials:
            lt, sx, s2 = sums(iscale)
            better = (s2 > 0) & (sx * sx > best * s2)
            scale = np.where(better, sx / s2, scale)
            best = np.where(better, scale * sx, best)
            sumlx = np.where(better, sx, sumlx)
            suml2 = np.where(better, s2, suml2)
            L = np.where(better[:, None], lt, L)
        if flavor == "ik":
            scale, L = _qx_refine(x, w, nmax, scale, best, sumlx, suml2, L, ~zero)
    L = np.where(zero[:, None], F(-nmax), L)
    scale = np.where(zero, F(0), scale)
    return scale.astype(np.float32), (L + F(nmax)).astype(np.int64)


def _qx_refine(x, w, nmax, scale, best, sumlx, suml2, L, active):
    """ik's greedy step after make_qx_quants' search: move the code with the largest gradient
    ``scale*w*(x - scale*l)`` one step while that raises sumlx²/suml2."""
    L = L.copy()
    scale, best, sumlx, suml2 = scale.copy(), best.copy(), sumlx.copy(), suml2.copy()
    act = np.nonzero(active)[0]
    for _ in range(x.shape[1] * (2 * nmax - 1)):
        if act.size == 0:
            break
        xa, wa, la, sc = x[act], w[act], L[act], scale[act]
        g = (sc[:, None] * wa) * (xa - sc[:, None] * la)
        movable = ((g > 0) & (la < nmax - 1)) | ((g < 0) & (la > -nmax))
        ag = np.where(movable, np.abs(g), F(0))
        j = np.argmax(ag, axis=1)
        rows = np.arange(act.size)
        found = ag[rows, j] > 0
        gj, wj, xj, lj = g[rows, j], wa[rows, j], xa[rows, j], la[rows, j]
        up = gj > 0
        nsx = np.where(up, sumlx[act] + wj * xj, sumlx[act] - wj * xj)
        ns2 = np.where(up, suml2[act] + wj * (F(2) * lj + F(1)), suml2[act] - wj * (F(2) * lj - F(1)))
        ok = found & (ns2 > 0) & (nsx * nsx > best[act] * ns2)
        a = act[ok]
        sumlx[a], suml2[a] = nsx[ok], ns2[ok]
        scale[a] = sumlx[a] / suml2[a]
        best[a] = scale[a] * sumlx[a]
        L[a, j[ok]] = np.where(up[ok], lj[ok] + F(1), lj[ok] - F(1))
        act = a
    return scale, L


def make_q3_quants(x, nmax, flavor):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): weights x², then up to 5 passes of coordinate
    descent.  Returns (scale, L codes l + nmax).  ik returns sumlx/suml2 unguarded (NaN for 0/0)."""
    n_lanes, n = x.shape
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(all="ignore"):
        iscale = F(-nmax) / mx
        L = nint_clip(iscale[:, None] * x, -nmax, nmax - 1)
        sumlx = seq_sum(wx * L)
        suml2 = seq_sum((w * L) * L)
        active = ~zero
        for _ in range(5):
            changed = np.zeros(n_lanes, bool)
            for i in range(n):
                li = L[:, i]
                slx = sumlx - wx[:, i] * li
                sl2 = suml2 - (w[:, i] * li) * li
                new_l = nint_clip((x[:, i] * sl2) / slx, -nmax, nmax - 1)
                cand = active & (slx > 0) & (new_l != li)
                slx = slx + wx[:, i] * new_l
                sl2 = sl2 + (w[:, i] * new_l) * new_l
                ok = cand & (sl2 > 0) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
                L[:, i] = np.where(ok, new_l, li)
                sumlx = np.where(ok, slx, sumlx)
                suml2 = np.where(ok, sl2, suml2)
                changed |= ok
            active &= changed
            if not active.any():
                break
        if flavor == "ik":
            scale = sumlx / suml2
        else:
            scale = np.where(suml2 > 0, sumlx / suml2, F(0))
    L = np.where(zero[:, None], F(-nmax), L)
    scale = np.where(zero, F(0), scale)
    return scale.astype(np.float32), (L + F(nmax)).astype(np.int64)


def make_qp_quants(x, nmax, qw, flavor):
    """Quantize non-negative sub-block scales (or mins) x to 0..nmax against one positive scale:
    a search over 9 trial scales, then up to 5 passes of coordinate descent.
    Returns (scale, L).  L is a uint8 array in C, so negative codes wrap (kept here)."""
    n_lanes, n = x.shape
    mx = np.zeros(n_lanes, np.float32)
    for i in range(n):
        mx = np.where(mx > x[:, i], mx, x[:, i])          # C MAX(max, x[i])
    eps = F(1e-16) if flavor == "ik" else GROUP_MAX_EPS
    zero = mx < eps
    wx = qw * x

    def mse(iscale, clamp):
        l = nearest_int(iscale[:, None] * x)
        if clamp:
            l = np.minimum(nmax, l)
        else:
            l = l & 0xFF                                  # stored to uint8_t L[] and read back
        lf = l.astype(np.float32)
        diff = x - (F(1) / iscale)[:, None] * lf
        return seq_sum((qw * diff) * diff)

    with np.errstate(all="ignore"):
        iscale = F(nmax) / mx
        best_mse = mse(iscale, False)
        for s in range(-4, 5):
            if s == 0:
                continue
            isc = (F(0.1) * F(s) + F(nmax)) / mx
            m = mse(isc, True)
            better = m < best_mse
            best_mse = np.where(better, m, best_mse)
            iscale = np.where(better, isc, iscale)
        l = np.minimum(nmax, nearest_int(iscale[:, None] * x)).astype(np.float32)
        sumlx = seq_sum(wx * l)                 # C sums the int l, and stores it to uint8 L[]
        suml2 = seq_sum((qw * l) * l)
        L = (l.astype(np.int64) & 0xFF).astype(np.float32)
        active = ~zero
        for _ in range(5):
            changed = np.zeros(n_lanes, bool)
            for i in range(n):
                li = L[:, i]
                slx = sumlx - wx[:, i] * li
                sl2 = suml2 - (qw[:, i] * li) * li
                new_l = np.minimum(nmax, nearest_int((x[:, i] * sl2) / slx))
                cand = active & (slx > 0) & (sl2 > 0) & (new_l != li)
                nl = new_l.astype(np.float32)
                slx = slx + wx[:, i] * nl
                sl2 = sl2 + (qw[:, i] * nl) * nl
                ok = cand & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
                L[:, i] = np.where(ok, (new_l & 0xFF).astype(np.float32), li)
                sumlx = np.where(ok, slx, sumlx)
                suml2 = np.where(ok, sl2, suml2)
                changed |= ok
            active &= changed
            if not active.any():
                break
        if flavor == "ik":
            scale = sumlx / suml2
        else:
            scale = np.where(suml2 > 0, sumlx / suml2, F(0))
    L = np.where(zero[:, None], F(0), L)
    scale = np.where(zero, F(0), scale)
    return scale.astype(np.float32), L.astype(np.int64)


# ---- bit packing (arrays (n_super_blocks, ...)) ----


def pack_2bit(L: np.ndarray) -> np.ndarray:
    """256 codes 0..3 -> qs[64] (Q2_K, and the low bits of Q3_K).

    For each half h (128 values) byte ``32h + l`` holds, from bit 0 up, the codes of values
    ``128h + l``, ``+32``, ``+64``, ``+96``::

        qs[32h + l] = L[128h+l] | L[128h+l+32]<<2 | L[128h+l+64]<<4 | L[128h+l+96]<<6
    """
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins -> scales[12] (Q4_K/Q5_K).

    bytes 0-3:  sc0..sc3 (bits 0-5) | high 2 bits of sc4..sc7 (bits 6-7)
    bytes 4-7:  m0..m3  (bits 0-5) | high 2 bits of m4..m7  (bits 6-7)
    bytes 8-11: low 4 bits of sc4..sc7 (bits 0-3) | low 4 bits of m4..m7 (bits 4-7)
    """
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def unpack_scales_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales[12] -> (8 scales, 8 mins) (get_scale_min_k4)."""
    sc = sc.astype(np.int64)
    ls = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def pack_scales_q3(ls: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales (0..63, value = ls - 32) -> scales[12] (Q3_K).

    bytes 0-7:  low 4 bits of scale j (bits 0-3) | low 4 bits of scale j+8 (bits 4-7)
    bytes 8-11: byte 8+k holds the high 2 bits of scales k, k+4, k+8, k+12 at bits 0-1, 2-3, 4-5, 6-7
    """
    ls = ls.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:8] = (ls[:, 0:8] & 0xF) | ((ls[:, 8:16] & 0xF) << 4)
    hi = (ls >> 4).reshape(-1, 4, 4)                      # [j//4, j%4]
    out[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return out


def unpack_scales_q3(sc: np.ndarray) -> np.ndarray:
    """scales[12] -> sixteen signed scales (ls - 32) as int64."""
    sc = sc.astype(np.int64)
    low = np.concatenate([sc[:, 0:8] & 0xF, sc[:, 0:8] >> 4], axis=1)
    j = np.arange(16)
    high = (sc[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


def pack_nibbles_k(L: np.ndarray) -> np.ndarray:
    """256 codes -> qs[128] (Q4_K, low 4 bits of Q5_K): ``qs[32c + l] = L[64c+l] | L[64c+32+l]<<4``."""
    q = (L.astype(np.uint8) & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def pack_q6(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """256 codes 0..63 -> (ql[128], qh[64]).

    Per half h (128 values, ql offset 64h, qh offset 32h), l = 0..31::

        ql[64h + l]      = L[128h+l] & 0xF    | (L[128h+l+64] & 0xF) << 4
        ql[64h + l + 32] = L[128h+l+32] & 0xF | (L[128h+l+96] & 0xF) << 4
        qh[32h + l]      = L[128h+l]>>4 | (L[128h+l+32]>>4)<<2 | (L[128h+l+64]>>4)<<4 | (L[128h+l+96]>>4)<<6
    """
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


# ---- per-type quantizers (arrays of super-blocks) ----


def _sigma2(xs: np.ndarray, factor) -> np.ndarray:
    """``factor*Σx²/QK_K`` per super-block, C order ``(factor*sum)/256``."""
    return (F(factor) * seq_sum(xs * xs)) / F(QK_K)


def _imatrix_weights(xs, qw, sigma2, size):
    """``qw*sqrtf(sigma2 + x*x)`` as sub-block lanes (n_sb*256/size, size)."""
    w = qw[None, :] * np.sqrt(sigma2[:, None] + xs * xs)
    return w.astype(np.float32).reshape(-1, size)


def _requantize_affine(xl, d_sub, dm_sub, nmax, L, skip_zero=True, multiply=False):
    """Codes from the final per-sub-block scale and min: ``nearest_int((x + dm)/d)`` (or ``*(1/d)``),
    clamped to 0..nmax; sub-blocks with d == 0 keep their codes (when ``skip_zero``)."""
    with np.errstate(all="ignore"):
        if multiply:
            v = (xl + dm_sub[:, None]) * recip_or_zero(d_sub)[:, None]
        else:
            v = (xl + dm_sub[:, None]) / d_sub[:, None]
        q = np.clip(nearest_int(v), 0, nmax).astype(np.int64)
    if skip_zero:
        return np.where((d_sub == 0)[:, None], L, q)
    return q


def trinet_chunks(x: np.ndarray):
    """ik's quantize_row_q2_K_ref first looks at the whole chunk it is given (llama-quantize cuts
    ``chunk_rows`` rows): if rounding every value to {-max, 0, +max} leaves less than a tenth of Σx²,
    the chunk is stored ternary.  Yields (first row, end row, max) of those chunks."""
    n_rows, n = x.shape
    cr = chunk_rows(n)
    for r0 in range(0, n_rows, cr):
        xc = x[r0:r0 + cr].reshape(1, -1)
        mx = np.abs(xc).max()                   # MAX(max, |x|) from 0: the order does not matter
        half = F(0.5) * mx
        l = np.where(xc < -half, F(-1), np.where(xc < half, F(0), F(1)))
        mse0 = seq_sum(xc * xc)[0]
        diff = xc - mx * l
        if seq_sum(diff * diff)[0] < F(0.1) * mse0:
            yield r0, min(n_rows, r0 + cr), mx


def _trinet_blocks(xc: np.ndarray, mx) -> np.ndarray:
    """Ternary Q2_K blocks: d = dmin = fp16(max), every scale byte 1 | 1<<4, codes 0/1/2."""
    half = F(0.5) * mx
    L = np.where(xc < -half, 0, np.where(xc < half, 1, 2)).reshape(-1, 256)
    out = np.empty((L.shape[0], 84), np.uint8)
    out[:, 0:16] = 0x11
    out[:, 16:80] = pack_2bit(L)
    out[:, 80:84] = np.tile(fp16_bytes(np.array([mx], np.float32)), 2)
    return out


def quantize_q2_k(x, qw, flavor):
    n_rows, n = x.shape
    xs = sub_blocks(x, QK_K)
    xl = xs.reshape(-1, 16)
    n_sb = xs.shape[0]
    if qw is None:
        w = np.abs(xl)
        scales, mins, L = make_qkx2_quants(xl, w, 3, F(-0.5), F(0.1), 15, True,
                                           "eps" if flavor == "ik" else "eq")
        scales, mins = scales.reshape(n_sb, 16), mins.reshape(n_sb, 16)
        max_scale = np.zeros(n_sb, np.float32)
        max_min = np.zeros(n_sb, np.float32)
        for j in range(16):
            max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
            max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
        with np.errstate(all="ignore"):
            ls = nearest_int((F(15) / max_scale)[:, None] * scales) & 0xFF
            lm = nearest_int((F(15) / max_min)[:, None] * mins)
        sc = np.where((max_scale > 0)[:, None], ls, 0)
        sc = np.where((max_min > 0)[:, None], sc | (lm << 4), sc) & 0xFF
        d = np.where(max_scale > 0, max_scale / F(15), F(0)).astype(np.float32)
        dmin = np.where(max_min > 0, max_min / F(15), F(0)).astype(np.float32)
        dr, mr = fp16_round(d), fp16_round(dmin)
        d_sub = (dr[:, None] * (sc & 0xF).astype(np.float32)).reshape(-1)
        dm_sub = (mr[:, None] * (sc >> 4).astype(np.float32)).reshape(-1)
        L = _requantize_affine(xl, d_sub, dm_sub, 3, L)
        sc = sc.astype(np.uint8)
    else:
        sigma2 = _sigma2(xs, 0.75 if flavor == "ik" else 1.0)
        w = _imatrix_weights(xs, np.tile(qw, n_rows).reshape(n_sb, QK_K), sigma2, 16)
        sw = seq_sum(w).reshape(n_sb, 16)
        scales, mins, L = make_qkx3_quants(xl, w, 3, flavor)
        d, Ls = make_qp_quants(scales.reshape(n_sb, 16), 15, sw, flavor)
        dmin, Lm = make_qp_quants(mins.reshape(n_sb, 16), 15, sw, flavor)
        sc = ((Ls | (Lm << 4)) & 0xFF).astype(np.uint8)
        if flavor == "ik":      # codes from the unrounded float scales, *(1/d), no skip
            d_sub = (d[:, None] * Ls.astype(np.float32)).reshape(-1)
            dm_sub = (dmin[:, None] * Lm.astype(np.float32)).reshape(-1)
            L = _requantize_affine(xl, d_sub, dm_sub, 3, L, skip_zero=False, multiply=True)
        else:
            d_sub = (fp16_round(d)[:, None] * (sc & 0xF).astype(np.float32)).reshape(-1)
            dm_sub = (fp16_round(dmin)[:, None] * (sc >> 4).astype(np.float32)).reshape(-1)
            L = _requantize_affine(xl, d_sub, dm_sub, 3, L)
    out = np.concatenate([sc, pack_2bit(L.reshape(n_sb, 256)), fp16_bytes(d), fp16_bytes(dmin)], axis=1)
    if qw is None and flavor == "ik":
        per_row = n // QK_K
        for r0, r1, mx in trinet_chunks(x):
            out[r0 * per_row:r1 * per_row] = _trinet_blocks(x[r0:r1], mx)
    return out


def _q3_requantize(xl, d, sc16, L):
    """Q3_K codes from fp16(d) and the packed signed 6-bit scales: clamp(nearest_int(x/d_j), -4, 3)+4."""
    d_sub = (fp16_round(d)[:, None] * sc16.astype(np.float32)).reshape(-1)
    with np.errstate(all="ignore"):
        q = np.clip(nearest_int(xl / d_sub[:, None]), -4, 3).astype(np.int64) + 4
    return np.where((d_sub == 0)[:, None], L, q)


def quantize_q3_k(x, qw, flavor):
    n_rows, n = x.shape
    xs = sub_blocks(x, QK_K)
    xl = xs.reshape(-1, 16)
    n_sb = xs.shape[0]
    if qw is None:
        scales, L = make_q3_quants(xl, 4, flavor)
        scales = scales.reshape(n_sb, 16)
        amax = np.zeros(n_sb, np.float32)
        max_scale = np.zeros(n_sb, np.float32)
        for j in range(16):
            a = np.abs(scales[:, j])
            upd = a > amax
            amax = np.where(upd, a, amax)
            max_scale = np.where(upd, scales[:, j], max_scale)
        nz = max_scale != 0
        with np.errstate(all="ignore"):
            iscale = F(-32) / max_scale
            l = nearest_int(iscale[:, None] * scales).astype(np.int8).astype(np.int64)   # int8_t l
            ls = np.clip(l, -32, 31) + 32
            d = np.where(nz, F(1) / iscale, F(0)).astype(np.float32)
        ls = np.where(nz[:, None], ls, 0)
        packed = np.where(nz[:, None], pack_scales_q3(ls), 0).astype(np.uint8)
    else:
        sigma2 = _sigma2(xs, 2.0)
        w = _imatrix_weights(xs, np.tile(qw, n_rows).reshape(n_sb, QK_K), sigma2, 16)
        sw = seq_sum(w).reshape(n_sb, 16)
        scales, L = make_qx_quants(xl, w, 4, flavor)
        d, Ls = make_qx_quants(scales.reshape(n_sb, 16), sw, 32, flavor)
        packed = pack_scales_q3(Ls)
    L = _q3_requantize(xl, d, unpack_scales_q3(packed), L).reshape(n_sb, 256)
    high = L > 3
    hb = high.astype(np.uint8).reshape(n_sb, 8, 32)
    # hmask[m] bit k = high bit of value 32k + m
    hmask = np.zeros((n_sb, 32), np.uint8)
    for k in range(8):
        hmask |= hb[:, k] << k
    L = L - 4 * high
    return np.concatenate([hmask, pack_2bit(L), packed, fp16_bytes(d)], axis=1)


def _q45_search_noimat(xl, n_sb, nmax, flavor):
    """Q4_K/Q5_K reference path: make_qkx2_quants with weights ``sqrt(mean x²) + |x|`` per 32, then
    6-bit scales/mins against max/63.  Returns (d, dmin, Ls, Lm, L)."""
    sum_x2 = seq_sum(xl * xl)
    av_x = np.sqrt(sum_x2 / F(32))
    w = av_x[:, None] + np.abs(xl)
    rmin, nstep = (F(-1.0), 20) if nmax == 15 else (F(-0.5), 15)
    scales, mins, L = make_qkx2_quants(xl, w, nmax, rmin, F(0.1), nstep, False,
                                       "eps" if flavor == "ik" else "eq")
    scales, mins = scales.reshape(n_sb, 8), mins.reshape(n_sb, 8)
    max_scale = np.zeros(n_sb, np.float32)
    max_min = np.zeros(n_sb, np.float32)
    for j in range(8):
        max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    with np.errstate(all="ignore"):
        inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0)).astype(np.float32)
        inv_min = np.where(max_min > 0, F(63) / max_min, F(0)).astype(np.float32)
    Ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)     # uint8_t ls = ...
    Lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
    return max_scale / F(63), max_min / F(63), Ls, Lm, L


def _q45_search_imat(x, xs, xl, qw, n_sb, nmax, flavor):
    sigma2 = _sigma2(xs, 2.0)
    w = _imatrix_weights(xs, np.tile(qw, x.shape[0]).reshape(n_sb, QK_K), sigma2, 32)
    sw = seq_sum(w).reshape(n_sb, 8)
    scales, mins, L = make_qkx3_quants(xl, w, nmax, flavor)
    d, Ls = make_qp_quants(scales.reshape(n_sb, 8), 63, sw, flavor)
    dmin, Lm = make_qp_quants(mins.reshape(n_sb, 8), 63, sw, flavor)
    if nmax == 31:      # only quantize_row_q5_K_impl clamps (a no-op unless L wrapped)
        Ls, Lm = np.minimum(63, Ls), np.minimum(63, Lm)
    return d, dmin, Ls, Lm, L


def _quantize_q45(x, qw, flavor, nmax):
    xs = sub_blocks(x, QK_K)
    xl = xs.reshape(-1, 32)
    n_sb = xs.shape[0]
    if qw is None:
        d, dmin, Ls, Lm, L = _q45_search_noimat(xl, n_sb, nmax, flavor)
    else:
        d, dmin, Ls, Lm, L = _q45_search_imat(x, xs, xl, qw, n_sb, nmax, flavor)
    scales = pack_scales_k4(Ls, Lm)
    ls, lm = unpack_scales_k4(scales)
    d_sub = (fp16_round(d)[:, None] * ls.astype(np.float32)).reshape(-1)
    dm_sub = (fp16_round(dmin)[:, None] * lm.astype(np.float32)).reshape(-1)
    L = _requantize_affine(xl, d_sub, dm_sub, nmax, L).reshape(n_sb, 256)
    head = [fp16_bytes(d), fp16_bytes(dmin), scales]
    if nmax == 15:
        return np.concatenate(head + [pack_nibbles_k(L)], axis=1)
    # qh[l] bit 2c = bit 4 of value 64c + l, bit 2c+1 = bit 4 of value 64c + 32 + l
    hb = (L >> 4).astype(np.uint8).reshape(n_sb, 8, 32)
    qh = np.zeros((n_sb, 32), np.uint8)
    for k in range(8):
        qh |= hb[:, k] << k
    return np.concatenate(head + [qh, pack_nibbles_k(L & 0xF)], axis=1)


def quantize_q6_k(x, qw, flavor):
    n_rows, n = x.shape
    xs = sub_blocks(x, QK_K)
    xl = xs.reshape(-1, 16)
    n_sb = xs.shape[0]
    if qw is None:
        w = xl * xl
    else:
        w = np.tile(qw, n_rows).reshape(-1, 16).astype(np.float32)     # the raw imatrix
    scales, L = make_qx_quants(xl, w, 32, flavor)
    scales = scales.reshape(n_sb, 16)
    amax = np.zeros(n_sb, np.float32)
    max_scale = np.zeros(n_sb, np.float32)
    for j in range(16):
        a = np.abs(scales[:, j])
        upd = a > amax
        amax = np.where(upd, a, amax)
        max_scale = np.where(upd, scales[:, j], max_scale)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = F(-128) / max_scale
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)   # int8_t scales[]
        d = (F(1) / iscale).astype(np.float32)
        d_sub = (fp16_round(d)[:, None] * sc.astype(np.float32)).reshape(-1)
        q = np.clip(nearest_int(xl / d_sub[:, None]), -32, 31).astype(np.int64) + 32
    L = np.where((d_sub == 0)[:, None], L, q).reshape(n_sb, 256)
    ql, qh = pack_q6(L)
    out = np.concatenate([ql, qh, sc.view(np.uint8), fp16_bytes(d)], axis=1)
    out[zero] = 0                       # memset(&y[i], 0, sizeof(block_q6_K)); d = fp16(0)
    return out


# ---- the formats ----


class _KQuant(BlockFormat):
    """Shared driver: reshape rows to super-blocks, run the numpy reference or the numba kernel."""
    kernel_id: int = 0

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        raise NotImplementedError

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        x = np.ascontiguousarray(x, np.float32)
        qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
        out = cls._quantize_blocks(x, qw, flavor)
        return np.ascontiguousarray(out, np.uint8).reshape(n_rows, cls.traits.row_size(n))

    dequantize_ref = decode.dequantize_ref

    @classmethod
    def quantize_fast(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        out = cls.empty_blocks(n_rows, n)
        x = np.ascontiguousarray(x, np.float32)
        ik = flavor == "ik"
        if imatrix is None:
            kernels.quantize_rows(cls.kernel_id, x, np.zeros(n, np.float32), False, ik, out)
            if ik and cls.qtype == QuantType.Q2_K:
                kernels.q2_k_trinet(x, chunk_rows(n), out)
        else:
            kernels.quantize_rows(cls.kernel_id, x, np.ascontiguousarray(imatrix, np.float32), True, ik, out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        kernels.dequantize_rows(cls.kernel_id, np.ascontiguousarray(blocks, np.uint8), kernels.FP16_TABLE, out)
        return out


class Q2_K(_KQuant, qtype=QuantType.Q2_K):
    kernel_id = kernels.Q2_K
    quant_paths = ALL_PATHS
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; fp16 d @80; fp16 dmin @82 }
    scale_fields = ((80, "<f2"), (82, "<f2"))

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return quantize_q2_k(x, qw, flavor)


class Q3_K(_KQuant, qtype=QuantType.Q3_K):
    kernel_id = kernels.Q3_K
    quant_paths = ALL_PATHS
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d @108 }
    scale_fields = ((108, "<f2"),)

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return quantize_q3_k(x, qw, flavor)


class Q4_K(_KQuant, qtype=QuantType.Q4_K):
    kernel_id = kernels.Q4_K
    quant_paths = ALL_PATHS
    # block_q4_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return _quantize_q45(x, qw, flavor, 15)


class Q5_K(_KQuant, qtype=QuantType.Q5_K):
    kernel_id = kernels.Q5_K
    quant_paths = ALL_PATHS
    # block_q5_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return _quantize_q45(x, qw, flavor, 31)


class Q6_K(_KQuant, qtype=QuantType.Q6_K):
    kernel_id = kernels.Q6_K
    quant_paths = ALL_PATHS
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d @208 }
    scale_fields = ((208, "<f2"),)

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return quantize_q6_k(x, qw, flavor)
