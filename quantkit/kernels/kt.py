"""numba kernels for IQ1_KT..IQ4_KT (see :mod:`quantkit.formats.kt`): rows in parallel.

The codebook (:mod:`quantkit.formats._kt_codebook`) comes in as arrays, flattened so that a
cluster's members are one contiguous run:

    offsets  int64 (n_clusters+1,)   cluster c owns positions offsets[c] .. offsets[c+1]-1
    members  int32 (total,)          the code at each position
    vt       uint16 (group, total)   value k of the code at each position, as float16 bits (row
                                     k contiguous, so the search reads each value dimension as
                                     one stream; values are integers in [-126, 126], exact in
                                     float16, which the CPU widens in one instruction: F16C; the
                                     same floats in integer steps without it, quantkit.cpu)
    vt_all   uint16 (group, 2^bits)  every code's values (searched when a cluster is empty)
    values   float32 (2^bits, group)

The search keeps, like ik's AVX2 loop, the best score of each of 8 position classes (p % 8) and
then takes the classes in SIMD-lane order, so ties resolve exactly as in C.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

from ..cpu import half_to_float
from ..tables import IQ4NL_VALUES
from ..types import QuantType as T
from ..types import traits
from .common import F, OVERFLOW, QK_K, ZERO_EPS, block_bytes, first_absmax, nint, store_f32, store_u16
from .iqk import IQ4_LUT, IQ4_THR, IQ4_V, nearest

I64 = np.int64
_OPTS = dict(cache=True, error_model="numpy", nogil=True)
KV = IQ4NL_VALUES.astype(np.float32)
IQ1_KT_BYTES, IQ2_KT_BYTES, IQ3_KT_BYTES, IQ4_KT_BYTES = block_bytes(T.IQ1_KT, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT)
KT_META = traits(T.IQ2_KT).row_meta_size      # every trellis row starts with its float32 scale
KA = np.uint64(0xCBAC1FED)


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 fused multiply-add (llvm.fma: one instruction with FMA hardware, libm otherwise)."""
    sig = nbt.float32(nbt.float32, nbt.float32, nbt.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)
    return sig, codegen


@njit(**_OPTS)
def fma32_arrays(a, b, c, out):
    """out = fma32(a, b, c) elementwise (float32 arrays): lets tests call the intrinsic."""
    for i in range(out.shape[0]):
        out[i] = fma32(a[i], b[i], c[i])


@njit(**_OPTS)
def iq4k_index(a):
    """IQ4_K table index nearest to a (ik's best_index_iq4nl)."""
    return nearest(a, IQ4_V, IQ4_LUT, IQ4_THR, OVERFLOW)


def _splat(builder, value, vtype):
    """<8 x T> with every lane = value."""
    one = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vtype, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))


# ik's search keeps the first minimum of each SIMD lane and then takes the lanes in this order; a
# lane holds the positions p with p % 8 == lane class.  Groups of 8 fill a register each (lane =
# p % 8); groups of 4 sit two to a register, so the classes come out as 0,2,4,6 | 1,3,5,7.
_LANE_ORDER = {8: (0, 1, 2, 3, 4, 5, 6, 7), 4: (0, 2, 4, 6, 1, 3, 5, 7)}


@intrinsic
def _nearest_code(typingctx, tab, start, n, v, w):
    """ik's find_best_match over one run of n codebook positions (n a multiple of 8, as every
    cluster is): the position p (0 <= p < n) of the code nearest to the group v (weights w, both
    g-tuples of float32), whose values are tab[:, start + p] (float16 bits).

    One pass, 8 positions per step, written in LLVM vectors because numba leaves a per-lane argmin
    scalar: lane l of the running state holds the best (score, position) among positions
    p % 8 == l, replaced only by a strictly smaller score, so each lane keeps its first minimum
    and a NaN never wins (ik's _CMP_LT compare).  The score is summed as ik's horizontal sum:
    ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)) for groups of 8, (s0+s2) + (s1+s3) for groups of 4.

        step i:  lane    0     1     2   ...   7
                 pos     i    i+1   i+2  ...  i+7
                 score   s(i) ...                    best[l] = s if s < best[l]; at[l] = pos
        then the lanes in _LANE_ORDER[g], a later lane winning only with a smaller score
    """
    g = v.count
    sig = nbt.int64(tab, start, n, v, w)

    def codegen(context, builder, signature, args):
        tab_v, start_v, n_v, v_v, w_v = args
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        vf, vi = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
        vh_ptr = ir.VectorType(ir.HalfType(), 8).as_pointer()
        ary = context.make_array(signature.args[0])(context, builder, tab_v)
        row_stride = builder.sdiv(cgutils.unpack_tuple(builder, ary.strides, 2)[0], ir.Constant(i64, 2))
        rows = [builder.gep(ary.data, [builder.add(builder.mul(ir.Constant(i64, k), row_stride), start_v)])
                for k in range(g)]
        vx = [_splat(builder, builder.extract_value(v_v, k), vf) for k in range(g)]
        vw = [_splat(builder, builder.extract_value(w_v, k), vf) for k in range(g)]

        entry = builder.block
        loop = builder.append_basic_block("kt.loop")
        body = builder.append_basic_block("kt.body")
        done = builder.append_basic_block("kt.done")
        builder.branch(loop)

        builder.position_at_end(loop)
        i = builder.phi(i64)
        pos = builder.phi(vi)
        best = builder.phi(vf)
        at = builder.phi(vi)
        builder.cbranch(builder.icmp_signed("<", i, n_v), body, done)

        builder.position_at_end(body)
        t = []
        for k in range(g):
            q = half_to_float(builder, builder.load(builder.bitcast(builder.gep(rows[k], [i]), vh_ptr), align=2))
            e = builder.fsub(q, vx[k])
            t.append(builder.fmul(vw[k], builder.fmul(e, e)))
        if g == 8:
            s = builder.fadd(builder.fadd(builder.fadd(t[0], t[4]), builder.fadd(t[2], t[6])),
                             builder.fadd(builder.fadd(t[1], t[5]), builder.fadd(t[3], t[7])))
        else:
            s = builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))
        better = builder.fcmp_ordered("<", s, best)
        for phi, first, later in ((i, ir.Constant(i64, 0), builder.add(i, ir.Constant(i64, 8))),
                                  (pos, ir.Constant(vi, list(range(8))), builder.add(pos, ir.Constant(vi, [8] * 8))),
                                  (best, ir.Constant(vf, [float("inf")] * 8), builder.select(better, s, best)),
                                  (at, ir.Constant(vi, [0] * 8), builder.select(better, pos, at))):
            phi.add_incoming(first, entry)
            phi.add_incoming(later, body)
        builder.branch(loop)

        builder.position_at_end(done)
        order = _LANE_ORDER[g]
        s_best = builder.extract_element(best, ir.Constant(i32, order[0]))
        p_best = builder.extract_element(at, ir.Constant(i32, order[0]))
        for lane in order[1:]:
            s = builder.extract_element(best, ir.Constant(i32, lane))
            later = builder.fcmp_ordered("<", s, s_best)
            s_best = builder.select(later, s, s_best)
            p_best = builder.select(later, builder.extract_element(at, ir.Constant(i32, lane)), p_best)
        return builder.sext(p_best, i64)
    return sig, codegen


@njit(cache=True, error_model="numpy", inline="always")
def _nearest8(tab, start, n, inv, x, w, o):
    v = (inv * x[o], inv * x[o + 1], inv * x[o + 2], inv * x[o + 3],
         inv * x[o + 4], inv * x[o + 5], inv * x[o + 6], inv * x[o + 7])
    ww = (w[o], w[o + 1], w[o + 2], w[o + 3], w[o + 4], w[o + 5], w[o + 6], w[o + 7])
    return _nearest_code(tab, start, n, v, ww)


@njit(cache=True, error_model="numpy", inline="always")
def _nearest4(tab, start, n, inv, x, w, o):
    return _nearest_code(tab, start, n, (inv * x[o], inv * x[o + 1], inv * x[o + 2], inv * x[o + 3]),
                         (w[o], w[o + 1], w[o + 2], w[o + 3]))


@njit(**_OPTS)
def match(d, x, w, base, mid, offsets, members, vt, vt_all, codes, cbase):
    """find_best_match: codes[cbase + l] for each group l of the 32 values x[base:base+32] at scale
    d."""
    g = vt.shape[0]
    if d == 0:
        for l in range(32 // g):
            codes[cbase + l] = 0
        return
    inv = F(1) / d
    for l in range(32 // g):
        o = base + g * l
        c = 0
        if g == 8:
            for k in range(8):
                if inv * x[o + k] > mid[k]:
                    c |= 1 << k
        else:
            s5 = 1
            for k in range(4):
                v = inv * x[o + k]
                c += s5 * ((v >= -48) + (v >= -16) + (v >= 16) + (v >= 48))
                s5 *= 5
        start = offsets[c]
        n = offsets[c + 1] - start
        everything = n == 0              # an empty cluster: every code (groups of 8 only)
        if everything:
            n = vt_all.shape[1]
            jbest = _nearest8(vt_all, 0, n, inv, x, w, o)
        elif g == 8:
            jbest = _nearest8(vt, start, n, inv, x, w, o)
        else:
            jbest = _nearest4(vt, start, n, inv, x, w, o)
        # the winner is the smallest score, then the earliest lane, then the earliest position
        # (_nearest_code)
        codes[cbase + l] = jbest if everything else members[start + jbest]


@njit(cache=True, error_model="numpy", inline="always")
def _fit_lane(x, w, base, codes, cbase, values, e, ax, a2):
    g = values.shape[1]
    q = values[codes[cbase + e // g], e % g]
    qw = q * w[base + e]
    return fma32(qw, x[base + e], ax), fma32(qw, q, a2)


@njit(**_OPTS)
def fit(x, w, base, codes, cbase, values):
    """find_best_scale: (d, score) of the least-squares scale for the codes of x[base:base+32],
    accumulated as ik's AVX2 code does (8 lanes, fused multiply-adds, then its horizontal sum)."""
    x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = F(0)
    q0 = q1 = q2 = q3 = q4 = q5 = q6 = q7 = F(0)
    for e in range(0, 32, 8):
        x0, q0 = _fit_lane(x, w, base, codes, cbase, values, e, x0, q0)
        x1, q1 = _fit_lane(x, w, base, codes, cbase, values, e + 1, x1, q1)
        x2, q2 = _fit_lane(x, w, base, codes, cbase, values, e + 2, x2, q2)
        x3, q3 = _fit_lane(x, w, base, codes, cbase, values, e + 3, x3, q3)
        x4, q4 = _fit_lane(x, w, base, codes, cbase, values, e + 4, x4, q4)
        x5, q5 = _fit_lane(x, w, base, codes, cbase, values, e + 5, x5, q5)
        x6, q6 = _fit_lane(x, w, base, codes, cbase, values, e + 6, x6, q6)
        x7, q7 = _fit_lane(x, w, base, codes, cbase, values, e + 7, x7, q7)
    sumqx = ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7))
    sumq2 = ((q0 + q4) + (q2 + q6)) + ((q1 + q5) + (q3 + q7))
    if sumq2 > 0:
        return sumqx / sumq2, sumqx * sumqx / sumq2
    return F(0), F(0)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def nearest_clusters(values, centres, near):
    """near[ip] = the near.shape[1] clusters nearest to code ip (float32 squared distance summed in
    order; ties to the lower cluster), as ik's finalize_clusters inserts them."""
    n_val, g = values.shape
    nn = near.shape[1]
    for ip in prange(n_val):
        best = np.full(nn, np.inf, np.float32)
        ib = np.full(nn, -1, np.int64)
        for ic in range(centres.shape[0]):
            d2 = F(0)
            for k in range(g):
                d = values[ip, k] - centres[ic, k]
                d2 += d * d
            if d2 < best[nn - 1]:
                j = nn - 1
                while j > 0 and d2 < best[j - 1]:
                    best[j] = best[j - 1]
                    ib[j] = ib[j - 1]
                    j -= 1
                best[j] = d2
                ib[j] = ic
        for j in range(nn):
            near[ip, j] = ib[j]


@njit(**_OPTS)
def kt_weights(x, qw, has_qw, w):
    """ik's set_weights with sigma2 scale 2: per 256 block sigma2 = 2*Σx²/256; with an imatrix
    qw*sqrtf(sigma2 + x²) per 32-block (1e-4 where the block's sums are degenerate), else
    0.25*sigma2 + x²; an all-(almost)-zero 256 block gets 1e-4."""
    for b in range(x.shape[0] // QK_K):
        o = QK_K * b
        sumx2 = F(0)
        for j in range(QK_K):
            sumx2 += x[o + j] * x[o + j]
        if sumx2 < F(1e-14) * F(QK_K):
            for j in range(QK_K):
                w[o + j] = F(1e-4)
            continue
        sigma2 = F(2) * sumx2 / F(QK_K)
        if has_qw:
            for ib in range(8):
                ob = o + 32 * ib
                swx = F(0)
                sw2 = F(0)
                sx2 = F(0)
                for j in range(32):
                    xv = x[ob + j]
                    wv = qw[ob + j] * np.sqrt(sigma2 + xv * xv)
                    w[ob + j] = wv
                    swx += wv * abs(xv)
                    sw2 += wv * wv
                    sx2 += xv * xv
                if sx2 < F(1e-14) or sw2 < F(1e-14) or swx < F(1e-14):
                    for j in range(32):
                        w[ob + j] = F(1e-4)
        else:
            for j in range(QK_K):
                w[o + j] = F(0.25) * sigma2 + x[o + j] * x[o + j]


@njit(**_OPTS)
def _kt_start(x, qw, has_qw, y):
    """How every trellis row kernel starts: y zeroed, then (the weights, max |x| of the row)."""
    y[:] = 0
    w = np.empty(x.shape[0], np.float32)
    kt_weights(x, qw, has_qw, w)
    return w, first_absmax(x)[0]


@njit(**_OPTS)
def _final_sums(x, w, base, codes, cbase, values, ls, sums):
    g = values.shape[1]
    for e in range(32):
        q = values[codes[cbase + e // g], e % g] * ls
        sums[0] += (w[base + e] * x[base + e]) * q
        sums[1] += (w[base + e] * q) * q


@njit(**_OPTS)
def _signed_trials(a, x, w, base, mid, offsets, members, vt, vt_all, values, tmp):
    """The codes and fit of block ``base`` at the trial scale +a (codes in tmp[0:4]) and at -a
    (tmp[4:8]): (scale +, score +, scale -, score -)."""
    match(a, x, w, base, mid, offsets, members, vt, vt_all, tmp, 0)
    dp, sp = fit(x, w, base, tmp, 0, values)
    match(-a, x, w, base, mid, offsets, members, vt, vt_all, tmp, 4)
    dm, sm = fit(x, w, base, tmp, 4, values)
    return dp, sp, dm, sm


@njit(**_OPTS)
def _take_sign(ib, dp, sp, dm, sm, tmp, scales, idx):
    """Block ib takes the + trial (codes tmp[0:4]) if it scores strictly better, else the - trial
    (tmp[4:8]); returns the score taken."""
    plus = sp > sm
    scales[ib] = dp if plus else dm
    for j in range(4):
        idx[4 * ib + j] = tmp[j if plus else 4 + j]
    return sp if plus else sm


@njit(**_OPTS)
def _block_starts(x, amax_row, lo, slope):
    """The state of a row's block scale search, per block of 32: (scales, 0 until found; the 4
    codes of each block; max |x|; the first trial's divisor max(lo, slope * max|x| / max|x| of the
    row))."""
    nsub = x.shape[0] // 32
    amax = np.empty(nsub, np.float32)
    start = np.empty(nsub, np.float32)
    for ib in range(nsub):
        amax[ib] = first_absmax(x[32 * ib:32 * ib + 32])[0]
        start[ib] = max(lo, slope * amax[ib] / amax_row)
    return np.zeros(nsub, np.float32), np.zeros(4 * nsub, np.int64), amax, start


@njit(**_OPTS)
def _row_trial(x, w, idx, values, dl, d, best):
    """One trial of the row scale: the least-squares scale of the row with block ib's values
    dl[ib] * its codes' values, taken (with its score) if it beats ``best``; returns (d, best)."""
    sumqx = F(0)
    sumq2 = F(0)
    for ib in range(dl.shape[0]):
        for e in range(32):
            q = dl[ib] * values[idx[4 * ib + e // 8], e % 8]
            sumqx += (w[32 * ib + e] * x[32 * ib + e]) * q
            sumq2 += (w[32 * ib + e] * q) * q
    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
        d = sumqx / sumq2
        best = d * sumqx
    return d, best


@njit(**_OPTS)
def small_row(x, qw, has_qw, y, one, mid, offsets, members, vt, vt_all, values):
    """IQ1_KT (one=True) or IQ2_KT: one row into y (float32 scale + blocks)."""
    nsub = x.shape[0] // 32
    w, amax_row = _kt_start(x, qw, has_qw, y)
    scales, idx, amaxs, starts = _block_starts(x, amax_row, F(90), F(124))
    tmp = np.empty(8, np.int64)
    for ib in range(nsub):
        base = 32 * ib
        amax = amaxs[ib]
        if amax < ZERO_EPS:
            continue
        dp, sp, dm, sm = _signed_trials(amax / starts[ib], x, w, base, mid, offsets, members, vt, vt_all, values, tmp)
        score = _take_sign(ib, dp, sp, dm, sm, tmp, scales, idx)
        if one:
            dp, sp, dm, sm = _signed_trials(amax / (starts[ib] - F(8)), x, w, base, mid, offsets, members, vt, vt_all,
                                            values, tmp)
            if sp > score or sm > score:
                _take_sign(ib, dp, sp, dm, sm, tmp, scales, idx)
    max_scale = first_absmax(scales)[1]
    if max_scale == 0:
        return
    d = max_scale / KV[0]
    best = F(0)
    dl = np.empty(nsub, np.float32)
    for itry in range(-9, 10):
        inv = F(itry - 127) / max_scale
        for ib in range(nsub):
            dl[ib] = KV[iq4k_index(inv * scales[ib])]
        d, best = _row_trial(x, w, idx, values, dl, d, best)
    inv = F(1) / d if d != 0 else F(0)
    blk = IQ1_KT_BYTES if one else IQ2_KT_BYTES
    ls = np.empty(nsub, np.int64)
    for ib in range(nsub):
        ls[ib] = iq4k_index(inv * scales[ib])
        o = KT_META + blk * (ib // 8)
        if one:
            y[o + ib % 8] = ls[ib]
        else:
            y[o + ib % 4] |= ls[ib] << (4 * ((ib % 8) // 4))
    store_f32(y, 0, d)
    if d == 0:
        return
    sums = np.zeros(2, np.float32)
    for ib in range(nsub):
        base = 32 * ib
        lv = KV[ls[ib]]
        dl = d * lv
        match(dl, x, w, base, mid, offsets, members, vt, vt_all, tmp, 0)
        mse1 = F(0)
        mse2 = F(0)
        for e in range(32):
            e1 = x[base + e] - dl * values[idx[4 * ib + e // 8], e % 8]
            e2 = x[base + e] - dl * values[tmp[e // 8], e % 8]
            mse1 += (w[base + e] * e1) * e1
            mse2 += (w[base + e] * e2) * e2
        if not (mse1 < mse2):
            for j in range(4):
                idx[4 * ib + j] = tmp[j]
        _final_sums(x, w, base, idx, 4 * ib, values, lv, sums)
        o = KT_META + blk * (ib // 8)
        sb = ib % 8
        for j in range(4):
            c = idx[4 * ib + j]
            if one:
                y[o + 8 + 4 * sb + j] = c & 0xFF
                y[o + 40 + 4 * (sb % 4) + j] |= ((c >> 8) & 0xF) << (4 * (sb // 4))
                y[o + sb] |= (c >> 12) << (4 + j)
            else:
                store_u16(y, o + 4 + 8 * sb + 2 * j, c)
    if sums[1] > 0:
        d = sums[0] / sums[1]
        store_f32(y, 0, d * F(1.07) if one else d)


@njit(**_OPTS)
def iq3_row(x, qw, has_qw, y, mid, offsets, members, vt, vt_all, values):
    nsub = x.shape[0] // 32
    w, amax_row = _kt_start(x, qw, has_qw, y)
    if amax_row == 0:
        return
    ax = np.abs(x)
    scales, idx, amaxs, starts = _block_starts(ax, amax_row, F(84), F(123))
    tmp = np.empty(4, np.int64)
    for ib in range(nsub):
        if amaxs[ib] < ZERO_EPS:
            continue
        base = 32 * ib
        best = F(0)
        found = False
        for itry in range(-3, 4):
            match(amaxs[ib] / (starts[ib] + F(8 * itry)), ax, w, base, mid, offsets, members, vt, vt_all, tmp, 0)
            dd, score = fit(ax, w, base, tmp, 0, values)
            if score > best:
                best = score
                found = True
                scales[ib] = dd
                for j in range(4):
                    idx[4 * ib + j] = tmp[j]
        if not found:
            raise ValueError("IQ3_KT: no scale found for a block (ik aborts here)")
    max_scale = first_absmax(scales)[1]
    d = max_scale / F(15)
    best = F(0)
    dl = np.empty(nsub, np.float32)
    for itry in range(-9, 10):
        inv = (F(itry) * F(0.2) + F(15)) / max_scale
        for ib in range(nsub):
            dl[ib] = F(max(0, min(15, nint(inv * scales[ib]))))
        d, best = _row_trial(ax, w, idx, values, dl, d, best)
    inv = F(1) / d if d != 0 else F(0)
    store_f32(y, 0, d)
    sums = np.zeros(2, np.float32)
    for ib in range(nsub):
        base = 32 * ib
        o = KT_META + IQ3_KT_BYTES * (ib // 8)
        sb = ib % 8
        ls = max(0, min(15, nint(inv * scales[ib])))
        y[o + sb % 4] |= ls << (4 * (sb // 4))
        for j in range(32):
            if x[base + j] < 0:
                y[o + 68 + j] |= 1 << sb
        match(d * F(ls), ax, w, base, mid, offsets, members, vt, vt_all, idx, 4 * ib)
        _final_sums(ax, w, base, idx, 4 * ib, values, F(ls), sums)
        for j in range(4):
            store_u16(y, o + 4 + 8 * sb + 2 * j, idx[4 * ib + j])
    if sums[1] > 0:
        store_f32(y, 0, sums[0] / sums[1])


@njit(cache=True, error_model="numpy", inline="always")
def _iq4_trials(x, w, base, amax, scale_0, best, cb, tmp):
    """IQ4_KT's ten trial scales ±amax/(scale_0 + 8*itry) with one codebook: (best score, the scale
    that beat ``best`` last, whether one did)."""
    mid, off, mem, vt, vta, val = cb
    scale = F(0)
    better = False
    for itry in range(-2, 3):
        den = F(8 * itry) + scale_0
        for sgn in range(2):
            a = amax / den if sgn == 0 else -amax / den
            match(a, x, w, base, mid, off, mem, vt, vta, tmp, 0)
            dd, score = fit(x, w, base, tmp, 0, val)
            if score > best:
                best = score
                scale = dd
                better = True
    return best, scale, better


@njit(**_OPTS)
def iq4_row(x, qw, has_qw, y, cb1, cb2):
    nsub = x.shape[0] // 32
    w, amax_row = _kt_start(x, qw, has_qw, y)
    if amax_row == 0:
        return
    mid1, off1, mem1, vt1, vta1, val1 = cb1
    mid2, off2, mem2, vt2, vta2, val2 = cb2
    scales, _, amaxs, starts = _block_starts(x, amax_row, F(90), F(124))
    second = np.zeros(nsub, np.bool_)
    tmp = np.empty(8, np.int64)
    for ib in range(nsub):
        amax = amaxs[ib]
        scale_0 = starts[ib]
        if amax < ZERO_EPS:
            continue
        base = 32 * ib
        best, scale, better = _iq4_trials(x, w, base, amax, scale_0, F(0), cb1, tmp)
        if better:
            scales[ib] = scale
        match(scales[ib], x, w, base, mid2, off2, mem2, vt2, vta2, tmp, 0)
        dd, score = fit(x, w, base, tmp, 0, val2)
        if score > best:               # ik does not raise best here
            scales[ib] = dd
            second[ib] = True
        best, scale, better = _iq4_trials(x, w, base, amax, scale_0, best, cb2, tmp)
        if better:
            scales[ib] = scale
            second[ib] = True
    d = -first_absmax(scales)[1] / F(64)
    if d == 0:
        return
    inv = F(1) / d
    sums = np.zeros(2, np.float32)
    for ib in range(nsub):
        base = 32 * ib
        o = KT_META + IQ4_KT_BYTES * (ib // 8)
        sb = ib % 8
        ls = min(nint(inv * scales[ib]), 63)
        if second[ib]:
            match(d * F(ls), x, w, base, mid2, off2, mem2, vt2, vta2, tmp, 0)
            _final_sums(x, w, base, tmp, 0, val2, F(ls), sums)
        else:
            match(d * F(ls), x, w, base, mid1, off1, mem1, vt1, vta1, tmp, 0)
            _final_sums(x, w, base, tmp, 0, val1, F(ls), sums)
        head = (((ls + 64) << 1) & 0xFF) | (1 if second[ib] else 0)
        for j in range(8):
            c = tmp[j]
            head |= (c >> 12) << (8 + 3 * j)
            gi = 8 * sb + j
            y[o + 32 + gi] = c & 0xFF
            y[o + 96 + gi % 32] |= ((c >> 8) & 0xF) << (4 * (gi // 32))
        for k in range(4):
            y[o + 4 * sb + k] = (head >> (8 * k)) & 0xFF
    store_f32(y, 0, d)
    if sums[1] > 0:
        store_f32(y, 0, sums[0] / sums[1])


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def quantize_small_rows(x, qw, has_qw, out, one, mid, offsets, members, vt, vt_all, values):
    for r in prange(x.shape[0]):
        small_row(x[r], qw, has_qw, out[r], one, mid, offsets, members, vt, vt_all, values)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def quantize_iq3_rows(x, qw, has_qw, out, mid, offsets, members, vt, vt_all, values):
    for r in prange(x.shape[0]):
        iq3_row(x[r], qw, has_qw, out[r], mid, offsets, members, vt, vt_all, values)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def quantize_iq4_rows(x, qw, has_qw, out, cb1, cb2):
    for r in prange(x.shape[0]):
        iq4_row(x[r], qw, has_qw, out[r], cb1, cb2)


# ------------------------------------------------------------------ decoding
@njit(cache=True, error_model="numpy", inline="always")
def _group(code, offset, is_abs, g, sl, out, o):
    xx = (np.uint64(code) + np.uint64(offset)) & np.uint64(0xFFFFFFFF)
    for k in range(g):
        xx = (xx * KA) & np.uint64(0xFFFFFFFF)
        s = xx & np.uint64(0x3F3F3F3F)
        v = I64((s & np.uint64(0xFF)) + ((s >> np.uint64(8)) & np.uint64(0xFF))
                + ((s >> np.uint64(16)) & np.uint64(0xFF)) + (s >> np.uint64(24))) - 126
        out[o + k] = sl * (F(abs(v)) if is_abs else F(v))


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def dequantize_rows(blocks, kind, out):
    """kind: 1..4 for IQ1_KT..IQ4_KT."""
    n_rows, n = out.shape
    nbl = n // QK_K
    for r in prange(n_rows):
        b = blocks[r]
        d = np.array([b[0], b[1], b[2], b[3]], np.uint8).view(np.float32)[0]
        for bl in range(nbl):
            for ib in range(8):
                o = QK_K * bl + 32 * ib
                if kind == 1:
                    p = KT_META + IQ1_KT_BYTES * bl
                    sh = I64(b[p + ib])
                    sl = d * KV[sh & 0xF]
                    for ig in range(4):
                        c = I64(b[p + 8 + 4 * ib + ig]) | ((I64(b[p + 40 + 4 * (ib % 4) + ig]) << (8 - 4 * (ib // 4))) & 0xF00) \
                            | ((sh << (8 - ig)) & 0x1000)
                        _group(c, 4096, False, 8, sl, out[r], o + 8 * ig)
                elif kind == 2 or kind == 3:
                    p = KT_META + (IQ2_KT_BYTES if kind == 2 else IQ3_KT_BYTES) * bl
                    nib = (I64(b[p + ib % 4]) >> (4 * (ib // 4))) & 0xF
                    sl = d * (KV[nib] if kind == 2 else F(nib))
                    for ig in range(4):
                        c = I64(b[p + 4 + 8 * ib + 2 * ig]) | (I64(b[p + 5 + 8 * ib + 2 * ig]) << 8)
                        _group(c, 4096, kind == 3, 8, sl, out[r], o + 8 * ig)
                    if kind == 3:
                        for j in range(32):
                            if (b[p + 68 + j] >> ib) & 1:
                                out[r, o + j] = -out[r, o + j]
                else:
                    p = KT_META + IQ4_KT_BYTES * bl
                    head = I64(b[p + 4 * ib]) | (I64(b[p + 4 * ib + 1]) << 8) | (I64(b[p + 4 * ib + 2]) << 16) \
                        | (I64(b[p + 4 * ib + 3]) << 24)
                    offset = 4096 + 32768 if head & 1 else 4096
                    sl = d * F(((head & 0xFF) >> 1) - 64)
                    for ig in range(8):
                        gi = 8 * ib + ig
                        c = I64(b[p + 32 + gi]) | ((I64(b[p + 96 + gi % 32]) << (8 - 4 * (gi // 32))) & 0xF00) \
                            | (((head >> (8 + 3 * ig)) & 7) << 12)
                        _group(c, offset, False, 4, sl, out[r], o + 4 * ig)
