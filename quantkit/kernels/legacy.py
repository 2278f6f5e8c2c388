"""numba kernels for the legacy 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

The quantizers of :mod:`quantkit.formats.legacy` (its docstring): float32 rows
``x`` (n_rows, n_per_row) in, uint8 rows of blocks (n_rows, row_size) out, and the reverse.  Formats
are selected by their ggml type id.  Rows are independent and run in parallel (``prange``; the
thread count is ``numba.set_num_threads``); within a block everything is scalar and in C order.

Exactness rules (specs/ggml-quants.md Appendix A): every float intermediate is float32 (numba turns
``float32 op int`` and Python float literals into float64, so integers and constants are wrapped in
``F(...)``), except where ik_llama.cpp's make_qkx3_quants accumulates in double; packed bytes are cast
to int64 before bit operations; no fastmath, so LLVM neither reassociates nor fuses multiply-adds.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from .common import fp16_at, D, F, FLT_MAX, block_bytes, store_fp16, type_ids
from .kquants import qx_lanes

QK = traits(T.Q4_0).block_size
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_0 = type_ids(T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q6_0)
Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES, Q6_0_BYTES = block_bytes(
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q6_0)


# Block layouts (ggml-common.h), byte offsets within a block; d and m are little-endian fp16:
#
#   Q4_0  d[0:2]                  qs[2:18]
#   Q4_1  d[0:2]  m[2:4]          qs[4:20]
#   Q5_0  d[0:2]         qh[2:6]  qs[6:22]
#   Q5_1  d[0:2]  m[2:4] qh[4:8]  qs[8:24]
#   Q8_0  d[0:2]                  qs[2:34]   one int8 code per value
#
#   qs byte j:  bits 0-3 = code j (low 4 bits), bits 4-7 = code j+16
#   qh:         little-endian uint32, bit e = bit 4 of code e (e = 0..31)

@njit(cache=True)
def _block_bytes(qtype):
    if qtype == Q4_0:
        return Q4_0_BYTES
    if qtype == Q4_1:
        return Q4_1_BYTES
    if qtype == Q5_0:
        return Q5_0_BYTES
    if qtype == Q5_1:
        return Q5_1_BYTES
    return Q8_0_BYTES


@njit(cache=True)
def _pack_codes(L, y, off, high_bits):
    """Codes L[0..31] (already offset to be non-negative) -> [qh (4 bytes)] qs (16 bytes) at y[off].

    qs[j] = code j (low nibble) | code j+16 (high nibble); qh is a little-endian uint32 whose bit e
    is bit 4 of code e.
    """
    if high_bits:
        qh = 0
        for j in range(QK):
            qh |= ((np.int64(L[j]) >> 4) & 1) << j
        for k in range(4):
            y[off + k] = (qh >> (8 * k)) & 0xFF
        off += 4
    for j in range(16):
        y[off + j] = (np.int64(L[j]) & 0xF) | ((np.int64(L[j + 16]) & 0xF) << 4)


# ---- quantize_row_*_ref (no imatrix) ----
# These loops are kept free of data-dependent branches (selects, float min/max, truncating
# conversions) so that they run at a few cycles per value; the C reference is auto-vectorised.

@njit(cache=True, error_model="numpy")
def _q8_0_quantize_row(xr, y):
    """quantize_row_q8_0_ref of one row: per block d = max|x| / 127, taken in C's order
    (amax = MAX(amax, fabsf(v)) from 0, which decides where a NaN or an infinity is), and each
    value round(x / d) as C's roundf (halves away from zero).  On block slices, one block after
    the other: ~2.4 ns a value on 2 loaded threads, where the former per-value row indexing with
    8 max lanes took ~7.5 (most of an F16 model's q8_0 quantize), the same bytes."""
    for ib in range(xr.shape[0] // QK):
        xb = xr[ib * QK:(ib + 1) * QK]
        amax = F(0)
        for j in range(QK):
            a = abs(xb[j])
            amax = amax if amax > a else a
        d = amax / F(127)
        id_ = F(1) / d if d != 0 else F(0)
        off = ib * Q8_0_BYTES
        store_fp16(y, off, d)
        yb = y[off + 2:off + Q8_0_BYTES]
        for j in range(QK):
            # C roundf (halves away from zero): v - trunc(v) is exact in float32
            v = xb[j] * id_
            t = np.trunc(v)
            frac = v - t
            q = t + F(frac >= F(0.5)) - F(frac <= F(-0.5))
            yb[j] = np.uint8(np.int32(q) & 0xFF)


@njit(cache=True)
def _store_qh(y, off, qh):
    """qh is stored as a little-endian uint32: bit e = bit 4 of code e (Q5_0/Q5_1 only)."""
    for k in range(4):
        y[off + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True)
def _int8_cast(v):
    """C's ``(int8_t)v`` as x86 code computes it: truncate to int32 (NaN and out-of-range values give
    INT32_MIN) and keep the low byte, sign-extended.  For the usual 0..32 values it is trunc(v); the
    rest only occurs when 1/d overflows to Inf, and then C writes code 0."""
    b = np.int64(np.int32(v)) & 0xFF
    return (b ^ 0x80) - 0x80


@njit(cache=True)
def _pack_byte(lo, hi, five_bit):
    """qs byte of codes j (lo) and j+16 (hi).  C packs the 4-bit types as ``lo | hi << 4`` and the
    5-bit ones as ``(lo & 0xF) | (hi & 0xF) << 4``; both are uint8."""
    if five_bit:
        return (lo & 0xF) | ((hi & 0xF) << 4)
    return (lo | (hi << 4)) & 0xFF


@njit(cache=True)
def _centered_block(xb, y, off, nmax):
    """Q4_0 / Q5_0 reference: d = max/-nmax (max = signed value of the first largest |x|),
    code = min(2*nmax - 1, (int8_t)(x/d + nmax + 0.5))."""
    amax = F(0)
    mx = F(0)                   # C starts from +0.0 and keeps it for an all-zero block
    for j in range(QK):
        a = abs(xb[j])
        bigger = amax < a       # strict: the first of equal |x| wins
        mx = xb[j] if bigger else mx
        amax = a if bigger else amax
    d = mx / F(-nmax)
    id_ = F(1) / d if d != 0 else F(0)
    store_fp16(y, off, d)
    half = F(nmax + 0.5)
    top = 2 * nmax - 1
    five_bit = nmax == 16
    qs = off + 6 if five_bit else off + 2
    qh = 0
    for j in range(16):
        lo = min(top, _int8_cast(xb[j] * id_ + half)) & 0xFF
        hi = min(top, _int8_cast(xb[j + 16] * id_ + half)) & 0xFF
        y[qs + j] = _pack_byte(lo, hi, five_bit)
        qh |= (((lo >> 4) & 1) << j) | (((hi >> 4) & 1) << (j + 16))
    if five_bit:
        _store_qh(y, off + 2, qh)


@njit(cache=True)
def _affine_block(xb, y, off, nmax):
    """Q4_1 / Q5_1 reference: d = (max - min)/nmax, m = min, code = (x - min)/d + 0.5 cast to
    int8_t and clamped to 15 (Q4_1) or cast to uint8_t (Q5_1)."""
    mn = FLT_MAX
    mx = -FLT_MAX
    for j in range(QK):
        v = xb[j]
        mn = v if v < mn else mn        # C's strict comparisons: the first of equal values stays
        mx = v if v > mx else mx
    d = (mx - mn) / F(nmax)
    id_ = F(1) / d if d != 0 else F(0)
    store_fp16(y, off, d)
    store_fp16(y, off + 2, mn)
    five_bit = nmax == 31
    qs = off + 8 if five_bit else off + 4
    qh = 0
    for j in range(16):
        lo = _int8_cast((xb[j] - mn) * id_ + F(0.5))
        hi = _int8_cast((xb[j + 16] - mn) * id_ + F(0.5))
        if not five_bit:
            lo = min(15, lo)
            hi = min(15, hi)
        lo &= 0xFF
        hi &= 0xFF
        y[qs + j] = _pack_byte(lo, hi, five_bit)
        qh |= (((lo >> 4) & 1) << j) | (((hi >> 4) & 1) << (j + 16))
    if five_bit:
        _store_qh(y, off + 4, qh)


@njit(cache=True, parallel=True, nogil=True)
def quantize_rows_plain(qtype, x, out):
    """Reference (no imatrix) quantization of every row; also Q8_0 with or without imatrix."""
    n_rows, n = x.shape
    ts = _block_bytes(qtype)
    for r in prange(n_rows):
        y = out[r]
        if qtype == Q8_0:
            _q8_0_quantize_row(x[r], y)
            continue
        for ib in range(n // QK):
            xb = x[r, ib * QK:(ib + 1) * QK]
            if qtype == Q4_0:
                _centered_block(xb, y, ib * ts, 8)
            elif qtype == Q5_0:
                _centered_block(xb, y, ib * ts, 16)
            elif qtype == Q4_1:
                _affine_block(xb, y, ib * ts, 15)
            else:
                _affine_block(xb, y, ib * ts, 31)


# ---- imatrix paths ----

# The scale searches below are bound by the latency of their sequential sums (each addition waits
# for the previous one), not by arithmetic.  So two trial scales are evaluated in one pass over the
# block: two independent chains run at nearly the cost of one.  The accept/reject decisions are
# still taken one trial after the other, in C's order, so the result is unchanged.

@njit(cache=True)
def _qkx3_codes(xb, nmax, iscale, mn, L):
    """L[i] = clamp(nearest_int(iscale*(x[i] - min)), 0, nmax)."""
    for i in range(QK):
        L[i] = max(0, min(nmax, int(np.rint(iscale * (xb[i] - mn)))))


@njit(cache=True)
def _qkx3_sums2_ik(xb, w, fnmax, ia, ib, mn):
    """Double sums Σ w*l, Σ w*l*l, Σ w*l*x for the codes of two trial scales ia and ib."""
    la = 0.0
    la2 = 0.0
    lxa = 0.0
    lb = 0.0
    lb2 = 0.0
    lxb = 0.0
    for i in range(QK):
        xm = xb[i] - mn
        fa = D(min(fnmax, max(F(0), np.rint(ia * xm))))
        fb = D(min(fnmax, max(F(0), np.rint(ib * xm))))
        wa = D(w[i]) * fa
        wb = D(w[i]) * fb
        la += wa
        la2 += wa * fa
        lxa += wa * D(xb[i])
        lb += wb
        lb2 += wb * fb
        lxb += wb * D(xb[i])
    return la, la2, lxa, lb, lb2, lxb


@njit(cache=True)
def _qkx3_fit_ik(sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl):
    """Least-squares (scale, min <= 0) for fixed codes and its weighted squared error, from the
    sums alone.  Returns (ok, scale, min, error); ok is False when the system is singular."""
    det = sum_w * sum_l2 - sum_l * sum_l
    if not det > 0:
        return False, 0.0, 0.0, 0.0
    ts = (sum_w * sum_xl - sum_x * sum_l) / det
    tm = (sum_l2 * sum_x - sum_l * sum_xl) / det
    if tm > 0:
        tm = 0.0
        ts = sum_xl / sum_l2
    mad = (sum_x2 - 2 * ts * sum_xl - 2 * tm * sum_x + 2 * ts * tm * sum_l
           + ts * ts * sum_l2 + tm * tm * sum_w)
    return True, ts, tm, mad


@njit(cache=True)
def _min_max(xb):
    """(min, max) of the block with C's strict comparisons, the min raised to 0 if positive."""
    mn = xb[0]
    mx = xb[0]
    for i in range(1, QK):
        if xb[i] < mn:
            mn = xb[i]
        if xb[i] > mx:
            mx = xb[i]
    if mn > 0:
        mn = F(0)
    return mn, mx


@njit(cache=True)
def _first_trial(xb, nmax, mn, mx, L):
    """The codes of the first trial, iscale = nmax/(max - min), in L; returns its scale 1/iscale."""
    iscale = F(nmax) / (mx - mn)
    _qkx3_codes(xb, nmax, iscale, mn, L)
    return F(1) / iscale


@njit(cache=True)
def make_qkx3_quants_ik(xb, w, nmax, L, rmin, rdelta, nstep):
    """ik_llama.cpp's affine search (double sums, error from the sums, greedy refinement).
    Returns (scale, the_min) with the_min = -min."""
    sum_w = D(w[0])
    sum_x = sum_w * D(xb[0])
    sum_x2 = sum_w * D(xb[0]) * D(xb[0])
    for i in range(1, QK):
        wi = D(w[i])
        sum_w += wi
        sum_x += wi * D(xb[i])
        sum_x2 += wi * D(xb[i]) * D(xb[i])
    mn, mx = _min_max(xb)
    if mx - mn < F(1e-10):
        L[:] = 0
        return F(0), -mn
    fnmax = F(nmax)
    scale = _first_trial(xb, nmax, mn, mx, L)
    best_mad = 0.0
    for i in range(QK):
        diff = D(scale) * D(L[i]) + D(mn) - D(xb[i])
        best_mad += D(w[i]) * (diff * diff)
    # Trial s uses iscale = (rmin + rdelta*s + nmax)/(max - min) with the min fitted so far, so
    # trial s+1 depends on whether trial s was taken.  Both are summed in one pass with the current
    # min; when trial s is taken (which changes min) the sums of s+1 are dropped and redone.
    s = 0
    while s <= nstep:
        sb = min(s + 1, nstep)
        ia = (rmin + rdelta * F(s) + fnmax) / (mx - mn)
        ib = (rmin + rdelta * F(sb) + fnmax) / (mx - mn)
        sums = _qkx3_sums2_ik(xb, w, fnmax, ia, ib, mn)
        for t in range(s, sb + 1):
            k = 3 * (t - s)
            ok, ts, tm, mad = _qkx3_fit_ik(sum_w, sum_x, sum_x2, sums[k], sums[k + 1], sums[k + 2])
            if ok and mad < best_mad:
                _qkx3_codes(xb, nmax, ia if t == s else ib, mn, L)
                best_mad = mad
                scale = F(ts)
                mn = F(tm)
                break
        s = t + 1

    sum_l = 0.0
    sum_l2 = 0.0
    sum_xl = 0.0
    for i in range(QK):
        wl = D(w[i]) * D(L[i])
        sum_l += wl
        sum_l2 += wl * D(L[i])
        sum_xl += wl * D(xb[i])
    sd = D(scale)
    md = D(mn)
    best = 2 * sd * sum_xl + 2 * md * sum_x - 2 * sd * md * sum_l - sd * sd * sum_l2 - md * md * sum_w
    last_j = -1
    last_dir = 0
    for _ in range(nmax * QK):
        # the value with the largest residual |g| whose code can still move towards it; the first
        # one wins ties.  Bitwise &, | and the select keep the loop free of unpredictable branches.
        gmax = F(0)
        best_j = -1
        for j in range(QK):
            g = xb[j] - scale * F(L[j]) - mn
            movable = ((g > 0) & (L[j] < nmax)) | ((g < 0) & (L[j] > 0))
            a = abs(g) if movable else F(0)
            if a > gmax:
                gmax = a
                best_j = j
        if best_j < 0:
            break
        direction = 1 if xb[best_j] - scale * F(L[best_j]) - mn > 0 else -1
        if best_j == last_j and direction == -last_dir:
            break
        wj = D(w[best_j])
        sum_l += wj * direction
        sum_l2 += wj * D(2 * L[best_j] * direction + 1)
        sum_xl += wj * D(xb[best_j]) * direction
        det = sum_w * sum_l2 - sum_l * sum_l
        if det <= 0:
            break
        ts = (sum_w * sum_xl - sum_x * sum_l) / det
        tm = (sum_l2 * sum_x - sum_l * sum_xl) / det
        if tm > 0:
            tm = 0.0
            ts = sum_xl / sum_l2
        if ts < 0:
            break
        score = 2 * ts * sum_xl + 2 * tm * sum_x - 2 * ts * tm * sum_l - ts * ts * sum_l2 - tm * tm * sum_w
        if score <= best:
            break
        best = score
        scale = F(ts)
        mn = F(tm)
        L[best_j] += direction
        last_j = best_j
        last_dir = direction
    return scale, -mn


@njit(cache=True)
def make_qkx3_quants_mainline(xb, w, nmax, L, Laux, rmin, rdelta, nstep):
    """llama.cpp's affine search, all float32, error evaluated value by value.
    Returns (scale, the_min) with the_min = -min."""
    sum_w = w[0]
    sum_x = sum_w * xb[0]
    for i in range(1, QK):
        sum_w += w[i]
        sum_x += w[i] * xb[i]
    mn, mx = _min_max(xb)
    if mx <= mn:
        L[:] = 0
        return F(0), -mn
    fnmax = F(nmax)
    scale = _first_trial(xb, nmax, mn, mx, L)
    best = F(0)
    for i in range(QK):
        diff = scale * F(L[i]) + mn - xb[i]
        best += w[i] * (diff * diff)
    for s in range(nstep + 1):
        iscale = (rmin + rdelta * F(s) + F(nmax)) / (mx - mn)
        sum_l = F(0)
        sum_l2 = F(0)
        sum_xl = F(0)
        for i in range(QK):
            fl = min(fnmax, max(F(0), np.rint(iscale * (xb[i] - mn))))
            Laux[i] = int(fl)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * xb[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            ts = (sum_w * sum_xl - sum_x * sum_l) / det
            tm = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if tm > 0:
                tm = F(0)
                ts = sum_xl / sum_l2
            cur = F(0)
            for i in range(QK):
                diff = ts * F(Laux[i]) + tm - xb[i]
                cur += w[i] * (diff * diff)
            if cur < best:
                for i in range(QK):
                    L[i] = Laux[i]
                best = cur
                scale = ts
                mn = tm
    return scale, -mn


@njit(cache=True)
def _search_lanes(xr, qw, has_qw, sigma2, nmax, ik):
    """make_qx_quants on every block of a row at once, one SIMD lane each (kquants.qx_lanes):
    value j of block b goes to lane b with the weight ``qw*sqrtf(sigma2 + x²)`` (``x²`` without an
    imatrix).  make_qx_quants' trial scales are sequential float sums, which one block at a time
    would wait on.  Returns the blocks' scales d (n_blocks,) and codes Lt (QK, n_blocks)."""
    nb = xr.shape[0] // QK
    xt = np.empty((QK, nb), np.float32)
    wt = np.empty((QK, nb), np.float32)
    for b in range(nb):
        for j in range(QK):
            v = xr[b * QK + j]
            xt[j, b] = v
            wt[j, b] = qw[b * QK + j] * np.sqrt(sigma2 + v * v) if has_qw else v * v
    d = np.empty(nb, np.float32)
    Lt = np.empty((QK, nb), np.int32)
    qx_lanes(xt, wt, nmax, ik, d, Lt)
    return d, Lt


@njit(cache=True, parallel=True, nogil=True)
def quantize_rows_imatrix(qtype, x, qw, ik, out):
    """Q4_0/Q4_1/Q5_0/Q5_1 with importance weights qw (n_per_row,); ik selects the fork's searches."""
    n_rows, n = x.shape
    ts = _block_bytes(qtype)
    for r in prange(n_rows):
        xr = x[r]
        y = out[r]
        sum_x2 = F(0)
        for j in range(n):
            sum_x2 += xr[j] * xr[j]
        sigma2 = sum_x2 / F(n)
        L = np.empty(QK, np.int64)
        if qtype == Q4_0 or qtype == Q5_0:
            d, Lt = _search_lanes(xr, qw, True, sigma2, 8 if qtype == Q4_0 else 16, ik)
            for ib in range(n // QK):
                for j in range(QK):
                    L[j] = Lt[j, ib]
                store_fp16(y, ib * ts, d[ib])
                _pack_codes(L, y, ib * ts + 2, qtype == Q5_0)
            continue
        w = np.empty(QK, np.float32)
        Laux = np.empty(QK, np.int64)
        nmax = 15 if qtype == Q4_1 else 31
        for ib in range(n // QK):
            xb = xr[ib * QK:(ib + 1) * QK]
            for j in range(QK):
                w[j] = qw[ib * QK + j] * np.sqrt(sigma2 + xb[j] * xb[j])
            off = ib * ts
            if ik:
                d, the_min = make_qkx3_quants_ik(xb, w, nmax, L, F(-0.9), F(0.05), 36)
            else:
                d, the_min = make_qkx3_quants_mainline(xb, w, nmax, L, Laux, F(-0.9), F(0.05), 36)
            store_fp16(y, off, d)
            store_fp16(y, off + 2, -the_min)
            _pack_codes(L, y, off + 4, qtype == Q5_1)


# ---- decoding ----
#
# Q8_0, Q4_0 and Q5_0 each have a row decoder of their own, with 32-bit integers and no test of the
# type inside the loops over a block: the prompt path decodes every weight of a product once per
# batch, and the shared loop below decoded Q5_0 at a third of this speed (SmolLM2's 576-wide rows
# make Q5_0 three quarters of a Q4_K or IQ4_K file).  Same values: a code times d, nothing added.

@njit(cache=True, error_model="numpy")
def _q8_0_row(b, y, fp16_table):
    for ib in range(y.shape[0] // QK):
        o = ib * Q8_0_BYTES
        d = fp16_at(b, o, fp16_table)
        for j in range(QK):
            y[QK * ib + j] = F(np.int8(b[o + 2 + j])) * d


@njit(cache=True, error_model="numpy")
def _q4_0_row(b, y, fp16_table):
    for ib in range(y.shape[0] // QK):
        o = ib * Q4_0_BYTES
        d = fp16_at(b, o, fp16_table)
        for j in range(16):
            byte = np.int32(b[o + 2 + j])
            y[QK * ib + j] = F((byte & 0xF) - 8) * d
            y[QK * ib + j + 16] = F((byte >> 4) - 8) * d


@njit(cache=True, error_model="numpy")
def _q5_0_row(b, y, fp16_table):
    for ib in range(y.shape[0] // QK):
        o = ib * Q5_0_BYTES
        d = fp16_at(b, o, fp16_table)
        qh = (np.uint32(b[o + 2]) | (np.uint32(b[o + 3]) << 8) | (np.uint32(b[o + 4]) << 16)
              | (np.uint32(b[o + 5]) << 24))
        for j in range(16):
            byte = np.int32(b[o + 6 + j])
            q0 = (byte & 0xF) | np.int32(((qh >> j) & 1) << 4)
            q1 = (byte >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            y[QK * ib + j] = F(q0 - 16) * d
            y[QK * ib + j + 16] = F(q1 - 16) * d


@njit(cache=True, error_model="numpy")
def _affine_row(qtype, b, y, fp16_table):
    """Q4_1 and Q5_1: code * d + m."""
    ts = _block_bytes(qtype)
    for ib in range(y.shape[0] // QK):
        o = ib * ts
        e = ib * QK
        d = fp16_at(b, o, fp16_table)
        m = fp16_at(b, o + 2, fp16_table)
        qs = o + 4
        qh = 0
        if qtype == Q5_1:
            for k in range(4):
                qh |= np.int64(b[qs + k]) << (8 * k)
            qs += 4
        for j in range(16):
            byte = np.int64(b[qs + j])
            q0 = (byte & 0xF) | (((qh >> j) & 1) << 4)
            q1 = (byte >> 4) | (((qh >> (j + 16)) & 1) << 4)
            y[e + j] = F(q0) * d + m
            y[e + j + 16] = F(q1) * d + m


@njit(cache=True, parallel=True, nogil=True)
def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32 (dequantize_row_*)."""
    for r in prange(out.shape[0]):
        if qtype == Q8_0:
            _q8_0_row(blocks[r], out[r], fp16_table)
        elif qtype == Q4_0:
            _q4_0_row(blocks[r], out[r], fp16_table)
        elif qtype == Q5_0:
            _q5_0_row(blocks[r], out[r], fp16_table)
        else:
            _affine_row(qtype, blocks[r], out[r], fp16_table)


# ---- Q6_0 (ik_llama.cpp only) ----
#
#   Q6_0  d[0:2]  qh[2:10]  qs[10:26]      codes l + 32, l in -32..31
#
#   qs byte j (j < 16): low 4 bits of code j | low 4 bits of code j+16 << 4
#   qh byte k (k < 8):  bits 0-1 = code k >> 4,   bits 2-3 = code k+16 >> 4,
#                       bits 4-5 = code k+8 >> 4, bits 6-7 = code k+24 >> 4

@njit(cache=True)
def _pack_q6_0(L, y, off):
    for k in range(8):
        y[off + 2 + k] = 0
    for j in range(16):
        lo, hi = np.int64(L[j]), np.int64(L[j + 16])
        y[off + 10 + j] = (lo & 0xF) | ((hi & 0xF) << 4)
        y[off + 2 + j % 8] |= ((lo >> 4) | ((hi >> 4) << 2)) << (4 * (j // 8))


@njit(cache=True, parallel=True, nogil=True)
def quantize_rows_q6_0(x, qw, has_qw, out):
    """Q6_0 always runs the fork's make_qx_quants (nmax 32): weights ``qw*sqrtf(sigma2 + x²)`` with
    sigma2 = Σx²/n_per_row of the row, or ``x²`` without an imatrix; a row's blocks are searched
    side by side (_search_lanes)."""
    n_rows, n = x.shape
    nb = n // QK
    for r in prange(n_rows):
        xr = x[r]
        y = out[r]
        sigma2 = F(0)
        if has_qw:
            sum_x2 = F(0)
            for j in range(n):
                sum_x2 += xr[j] * xr[j]
            sigma2 = sum_x2 / F(n)
        d, Lt = _search_lanes(xr, qw, has_qw, sigma2, 32, True)
        L = np.empty(QK, np.int64)
        for b in range(nb):
            for j in range(QK):
                L[j] = Lt[j, b]
            off = b * Q6_0_BYTES
            store_fp16(y, off, d[b])
            _pack_q6_0(L, y, off)


@njit(cache=True, parallel=True, nogil=True)
def dequantize_rows_q6_0(blocks, fp16_table, out):
    n_rows, n = out.shape
    for r in prange(n_rows):
        b = blocks[r]
        for ib in range(n // QK):
            o = ib * Q6_0_BYTES
            d = fp16_at(b, o, fp16_table)
            for j in range(16):
                h = np.int64(b[o + 2 + j % 8]) >> (4 * (j // 8))
                q = np.int64(b[o + 10 + j])
                out[r, ib * QK + j] = F(((q & 0xF) | ((h << 4) & 0x30)) - 32) * d
                out[r, ib * QK + j + 16] = F(((q >> 4) | ((h << 2) & 0x30)) - 32) * d
