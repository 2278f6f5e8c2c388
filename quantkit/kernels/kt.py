"""numba kernels for IQ1_KT..IQ4_KT (see :mod:`quantkit.formats.kt`): rows in parallel.

The codebook (:mod:`quantkit.formats._kt_codebook`) comes in as arrays, flattened so that a
cluster's members are one contiguous run:

    offsets  int64 (n_clusters+1,)   cluster c owns positions offsets[c] .. offsets[c+1]-1
    members  int32 (total,)          the code at each position
    vt       int8 (group, total)     value k of the code at each position (row k contiguous, so
                                     the score loop reads each value dimension as one stream;
                                     values are integers in [-126, 126], so int8 is exact)
    vt_all   int8 (group, 2^bits)    every code's values (searched when a cluster is empty)
    values   float32 (2^bits, group)

The search keeps, like ik's AVX2 loop, the best score of each of 8 position classes (p % 8) and
then takes the classes in SIMD-lane order, so ties resolve exactly as in C.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types as nbt
from numba.extending import intrinsic

from ..formats._iqk import IQ4K_VALUES
from .iqk import IQ4_LUT, IQ4_THR, IQ4_V, OVERFLOW, nearest, store_f32
from .kquants import nint

F = np.float32
I64 = np.int64
_OPTS = dict(cache=True, error_model="numpy", nogil=True)
KV = IQ4K_VALUES[:16].astype(np.float32)
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


def _flip_magnitude(builder, b):
    """b ^ ((b >> 31) & 0x7fffffff) on an i32: maps float bits to a signed order key and back."""
    i32 = ir.IntType(32)
    sign = builder.ashr(b, ir.Constant(i32, 31))
    return builder.xor(b, builder.and_(sign, ir.Constant(i32, 0x7FFFFFFF)))


@intrinsic
def _order_key(typingctx, s):
    """int32 whose order is the float order of float32 s (+0 for -0, so equal floats get equal
    keys): the smallest score can then be found with an integer min, which LLVM vectorises.  Done
    in LLVM's own int32 ops because numba widens int32 arithmetic to int64."""
    sig = nbt.int32(nbt.float32)

    def codegen(context, builder, signature, args):
        v = builder.fadd(args[0], ir.Constant(ir.FloatType(), 0.0))
        return _flip_magnitude(builder, builder.bitcast(v, ir.IntType(32)))
    return sig, codegen


@intrinsic
def _min32(typingctx, a, b):
    """min of two int32 without widening."""
    sig = nbt.int32(nbt.int32, nbt.int32)

    def codegen(context, builder, signature, args):
        return builder.select(builder.icmp_signed("<", args[0], args[1]), args[0], args[1])
    return sig, codegen


@intrinsic
def _float(typingctx, b):
    """The float32 with these int32 bits."""
    sig = nbt.float32(nbt.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def _key_flip(typingctx, b):
    sig = nbt.int32(nbt.int32)

    def codegen(context, builder, signature, args):
        return _flip_magnitude(builder, args[0])
    return sig, codegen


@njit(cache=True, error_model="numpy", inline="always")
def _from_key(k):
    """The score with order key k (the key map is its own inverse)."""
    return _float(_key_flip(k))


@intrinsic
def _lane_rank(typingctx, s, m, p, is4):
    """(lane << 24) | p as int32 where score s equals the minimum m, else INT32_MAX.  The lane of
    position p in ik's 8-wide search: p % 8, or for groups of 4 (two per register) the lane that
    holds class p % 8 = 0,2,4,6,1,3,5,7 in that order."""
    sig = nbt.int32(nbt.float32, nbt.float32, nbt.int64, nbt.boolean)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        s, m, p, is4 = args
        p32 = builder.trunc(p, i32)
        o = builder.and_(p32, ir.Constant(i32, 7))
        r4 = builder.or_(builder.lshr(o, ir.Constant(i32, 1)), builder.shl(builder.and_(o, ir.Constant(i32, 1)),
                                                                            ir.Constant(i32, 2)))
        lane = builder.select(builder.trunc(is4, ir.IntType(1)), r4, o)
        val = builder.or_(builder.shl(lane, ir.Constant(i32, 24)), p32)
        return builder.select(builder.fcmp_ordered("==", s, m), val, ir.Constant(i32, 0x7FFFFFFF))
    return sig, codegen


@njit(cache=True, error_model="numpy", inline="always")
def _first_of(sc, n, m, is4):
    """The position ik's search returns among the n scores whose minimum is m (see match)."""
    best = np.int32(0x7FFFFFFF)
    for p in range(n):
        best = _min32(best, _lane_rank(sc[np.uintp(p)], m, p, is4))
    return np.int64(best) & 0xFFFFFF


@njit(cache=True, error_model="numpy", inline="always")
def _scores8(tab, start, n, inv, x, w, base, sc):
    """Weighted squared distance of inv*x[base:base+8] to the n codes at tab[:, start:], summed as
    ik's hsum: ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)).  Returns the position ik picks (see match)."""
    v0, v1, v2, v3 = inv * x[base], inv * x[base + 1], inv * x[base + 2], inv * x[base + 3]
    v4, v5, v6, v7 = inv * x[base + 4], inv * x[base + 5], inv * x[base + 6], inv * x[base + 7]
    w0, w1, w2, w3, w4, w5, w6, w7 = w[base], w[base + 1], w[base + 2], w[base + 3], w[base + 4], \
        w[base + 5], w[base + 6], w[base + 7]
    m = np.int32(0x7FFFFFFF)
    st = np.uintp(start)
    for p in range(n):
        u = np.uintp(p)
        q = st + u
        e0 = F(tab[0, q]) - v0
        e1 = F(tab[1, q]) - v1
        e2 = F(tab[2, q]) - v2
        e3 = F(tab[3, q]) - v3
        e4 = F(tab[4, q]) - v4
        e5 = F(tab[5, q]) - v5
        e6 = F(tab[6, q]) - v6
        e7 = F(tab[7, q]) - v7
        s = (((w0 * (e0 * e0) + w4 * (e4 * e4)) + (w2 * (e2 * e2) + w6 * (e6 * e6)))
             + ((w1 * (e1 * e1) + w5 * (e5 * e5)) + (w3 * (e3 * e3) + w7 * (e7 * e7))))
        sc[u] = s
        m = _min32(m, _order_key(s))
    return _first_of(sc, n, _from_key(m), False)


@njit(cache=True, error_model="numpy", inline="always")
def _scores4(tab, start, n, inv, x, w, base, sc):
    """As _scores8 for groups of 4: (s0+s2) + (s1+s3)."""
    v0, v1, v2, v3 = inv * x[base], inv * x[base + 1], inv * x[base + 2], inv * x[base + 3]
    w0, w1, w2, w3 = w[base], w[base + 1], w[base + 2], w[base + 3]
    m = np.int32(0x7FFFFFFF)
    st = np.uintp(start)
    for p in range(n):
        u = np.uintp(p)
        q = st + u
        e0 = F(tab[0, q]) - v0
        e1 = F(tab[1, q]) - v1
        e2 = F(tab[2, q]) - v2
        e3 = F(tab[3, q]) - v3
        s = (w0 * (e0 * e0) + w2 * (e2 * e2)) + (w1 * (e1 * e1) + w3 * (e3 * e3))
        sc[u] = s
        m = _min32(m, _order_key(s))
    return _first_of(sc, n, _from_key(m), True)


@njit(**_OPTS)
def match(d, x, w, base, mid, offsets, members, vt, vt_all, codes, cbase, sc):
    """find_best_match: codes[cbase + l] for each group l of the 32 values x[base:base+32] at scale
    d.  sc: scratch of at least the largest cluster (2^bits where a cluster is empty)."""
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
            jbest = _scores8(vt_all, 0, n, inv, x, w, o, sc)
        elif g == 8:
            jbest = _scores8(vt, start, n, inv, x, w, o, sc)
        else:
            jbest = _scores4(vt, start, n, inv, x, w, o, sc)
        # ik keeps the first minimum of each position class p % 8 (one SIMD lane each) and then
        # takes the lanes in order: the winner is the smallest score, then the earliest lane, then
        # the earliest position (_first_of)
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


@njit(cache=True, parallel=True, error_model="numpy")
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
    """set_weights (sigma2 scale 2), see formats.kt.kt_weights."""
    for b in range(x.shape[0] // 256):
        o = 256 * b
        sumx2 = F(0)
        for j in range(256):
            sumx2 += x[o + j] * x[o + j]
        if sumx2 < F(1e-14) * F(256):
            for j in range(256):
                w[o + j] = F(1e-4)
            continue
        sigma2 = F(2) * sumx2 / F(256)
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
            for j in range(256):
                w[o + j] = F(0.25) * sigma2 + x[o + j] * x[o + j]


@njit(**_OPTS)
def _final_sums(x, w, base, codes, cbase, values, ls, sums):
    g = values.shape[1]
    for e in range(32):
        q = values[codes[cbase + e // g], e % g] * ls
        sums[0] += (w[base + e] * x[base + e]) * q
        sums[1] += (w[base + e] * q) * q


@njit(**_OPTS)
def small_row(x, qw, has_qw, y, one, mid, offsets, members, vt, vt_all, values):
    """IQ1_KT (one=True) or IQ2_KT: one row into y (float32 scale + blocks)."""
    n = x.shape[0]
    nsub = n // 32
    w = np.empty(n, np.float32)
    kt_weights(x, qw, has_qw, w)
    for k in range(y.shape[0]):
        y[k] = 0
    amax_row = F(0)
    for j in range(n):
        amax_row = max(amax_row, abs(x[j]))
    scales = np.zeros(nsub, np.float32)
    idx = np.zeros(4 * nsub, np.int64)
    tmp = np.empty(8, np.int64)
    sc = np.empty(vt_all.shape[1], np.float32)
    max_scale = F(0)
    for ib in range(nsub):
        base = 32 * ib
        amax = F(0)
        for j in range(32):
            amax = max(amax, abs(x[base + j]))
        if amax < F(1e-16):
            continue
        scale_0 = max(F(90), F(124) * amax / amax_row)
        match(amax / scale_0, x, w, base, mid, offsets, members, vt, vt_all, tmp, 0, sc)
        dp, sp = fit(x, w, base, tmp, 0, values)
        match(-amax / scale_0, x, w, base, mid, offsets, members, vt, vt_all, tmp, 4, sc)
        dm, sm = fit(x, w, base, tmp, 4, values)
        pick = 0
        if sp > sm:
            scales[ib] = dp
        else:
            scales[ib] = dm
            pick = 4
            sp = sm
        for j in range(4):
            idx[4 * ib + j] = tmp[pick + j]
        if one:
            scale_0 -= F(8)
            match(amax / scale_0, x, w, base, mid, offsets, members, vt, vt_all, tmp, 0, sc)
            dp1, sp1 = fit(x, w, base, tmp, 0, values)
            match(-amax / scale_0, x, w, base, mid, offsets, members, vt, vt_all, tmp, 4, sc)
            dm1, sm1 = fit(x, w, base, tmp, 4, values)
            if sp1 > sp or sm1 > sp:
                pick = 0
                if sp1 > sm1:
                    scales[ib] = dp1
                else:
                    scales[ib] = dm1
                    pick = 4
                for j in range(4):
                    idx[4 * ib + j] = tmp[pick + j]
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    if max_scale == 0:
        return
    d = max_scale / KV[0]
    best = F(0)
    for itry in range(-9, 10):
        inv = F(itry - 127) / max_scale
        sumqx = F(0)
        sumq2 = F(0)
        for ib in range(nsub):
            dl = KV[iq4k_index(inv * scales[ib])]
            for e in range(32):
                q = dl * values[idx[4 * ib + e // 8], e % 8]
                sumqx += (w[32 * ib + e] * x[32 * ib + e]) * q
                sumq2 += (w[32 * ib + e] * q) * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    inv = F(1) / d if d != 0 else F(0)
    blk = 56 if one else 68
    ls = np.empty(nsub, np.int64)
    for ib in range(nsub):
        ls[ib] = iq4k_index(inv * scales[ib])
        o = 4 + blk * (ib // 8)
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
        match(dl, x, w, base, mid, offsets, members, vt, vt_all, tmp, 0, sc)
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
        o = 4 + blk * (ib // 8)
        sb = ib % 8
        for j in range(4):
            c = idx[4 * ib + j]
            if one:
                y[o + 8 + 4 * sb + j] = c & 0xFF
                y[o + 40 + 4 * (sb % 4) + j] |= ((c >> 8) & 0xF) << (4 * (sb // 4))
                y[o + sb] |= (c >> 12) << (4 + j)
            else:
                y[o + 4 + 8 * sb + 2 * j] = c & 0xFF
                y[o + 4 + 8 * sb + 2 * j + 1] = c >> 8
    if sums[1] > 0:
        d = sums[0] / sums[1]
        store_f32(y, 0, d * F(1.07) if one else d)


@njit(**_OPTS)
def iq3_row(x, qw, has_qw, y, mid, offsets, members, vt, vt_all, values):
    n = x.shape[0]
    nsub = n // 32
    for k in range(y.shape[0]):
        y[k] = 0
    ax = np.empty(n, np.float32)
    amax_row = F(0)
    for j in range(n):
        ax[j] = abs(x[j])
        amax_row = max(amax_row, ax[j])
    if amax_row == 0:
        return
    w = np.empty(n, np.float32)
    kt_weights(x, qw, has_qw, w)
    scales = np.zeros(nsub, np.float32)
    idx = np.zeros(4 * nsub, np.int64)
    tmp = np.empty(4, np.int64)
    sc = np.empty(vt_all.shape[1], np.float32)
    max_scale = F(0)
    for ib in range(nsub):
        base = 32 * ib
        amax = F(0)
        for j in range(32):
            amax = max(amax, ax[base + j])
        if amax < F(1e-16):
            continue
        scale_0 = max(F(84), F(123) * amax / amax_row)
        best = F(0)
        found = False
        for itry in range(-3, 4):
            match(amax / (scale_0 + F(8 * itry)), ax, w, base, mid, offsets, members, vt, vt_all, tmp, 0, sc)
            dd, score = fit(ax, w, base, tmp, 0, values)
            if score > best:
                best = score
                found = True
                scales[ib] = dd
                for j in range(4):
                    idx[4 * ib + j] = tmp[j]
        if not found:
            raise ValueError("IQ3_KT: no scale found for a block (ik aborts here)")
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    d = max_scale / F(15)
    best = F(0)
    for itry in range(-9, 10):
        inv = (F(itry) * F(0.2) + F(15)) / max_scale
        sumqx = F(0)
        sumq2 = F(0)
        for ib in range(nsub):
            dl = F(max(0, min(15, nint(inv * scales[ib]))))
            for e in range(32):
                q = dl * values[idx[4 * ib + e // 8], e % 8]
                sumqx += (w[32 * ib + e] * ax[32 * ib + e]) * q
                sumq2 += (w[32 * ib + e] * q) * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    inv = F(1) / d if d != 0 else F(0)
    store_f32(y, 0, d)
    sums = np.zeros(2, np.float32)
    for ib in range(nsub):
        base = 32 * ib
        o = 4 + 100 * (ib // 8)
        sb = ib % 8
        ls = max(0, min(15, nint(inv * scales[ib])))
        y[o + sb % 4] |= ls << (4 * (sb // 4))
        for j in range(32):
            if x[base + j] < 0:
                y[o + 68 + j] |= 1 << sb
        match(d * F(ls), ax, w, base, mid, offsets, members, vt, vt_all, idx, 4 * ib, sc)
        _final_sums(ax, w, base, idx, 4 * ib, values, F(ls), sums)
        for j in range(4):
            c = idx[4 * ib + j]
            y[o + 4 + 8 * sb + 2 * j] = c & 0xFF
            y[o + 4 + 8 * sb + 2 * j + 1] = c >> 8
    if sums[1] > 0:
        store_f32(y, 0, sums[0] / sums[1])


@njit(cache=True, error_model="numpy", inline="always")
def _iq4_trials(x, w, base, amax, scale_0, best, cb, tmp, sc):
    """IQ4_KT's ten trial scales ±amax/(scale_0 + 8*itry) with one codebook: (best score, the scale
    that beat ``best`` last, whether one did)."""
    mid, off, mem, vt, vta, val = cb
    scale = F(0)
    better = False
    for itry in range(-2, 3):
        den = F(8 * itry) + scale_0
        for sgn in range(2):
            a = amax / den if sgn == 0 else -amax / den
            match(a, x, w, base, mid, off, mem, vt, vta, tmp, 0, sc)
            dd, score = fit(x, w, base, tmp, 0, val)
            if score > best:
                best = score
                scale = dd
                better = True
    return best, scale, better


@njit(**_OPTS)
def iq4_row(x, qw, has_qw, y, cb1, cb2):
    n = x.shape[0]
    nsub = n // 32
    for k in range(y.shape[0]):
        y[k] = 0
    w = np.empty(n, np.float32)
    kt_weights(x, qw, has_qw, w)
    amax_row = F(0)
    for j in range(n):
        amax_row = max(amax_row, abs(x[j]))
    if amax_row == 0:
        return
    mid1, off1, mem1, vt1, vta1, val1 = cb1
    mid2, off2, mem2, vt2, vta2, val2 = cb2
    scales = np.zeros(nsub, np.float32)
    second = np.zeros(nsub, np.bool_)
    tmp = np.empty(8, np.int64)
    sc = np.empty(max(vta1.shape[1], vta2.shape[1]), np.float32)
    max_scale = F(0)
    for ib in range(nsub):
        base = 32 * ib
        amax = F(0)
        for j in range(32):
            amax = max(amax, abs(x[base + j]))
        if amax < F(1e-16):
            continue
        scale_0 = max(F(90), F(124) * amax / amax_row)
        best, scale, better = _iq4_trials(x, w, base, amax, scale_0, F(0), cb1, tmp, sc)
        if better:
            scales[ib] = scale
        match(scales[ib], x, w, base, mid2, off2, mem2, vt2, vta2, tmp, 0, sc)
        dd, score = fit(x, w, base, tmp, 0, val2)
        if score > best:               # ik does not raise best here
            scales[ib] = dd
            second[ib] = True
        best, scale, better = _iq4_trials(x, w, base, amax, scale_0, best, cb2, tmp, sc)
        if better:
            scales[ib] = scale
            second[ib] = True
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    d = -max_scale / F(64)
    if d == 0:
        return
    inv = F(1) / d
    sums = np.zeros(2, np.float32)
    for ib in range(nsub):
        base = 32 * ib
        o = 4 + 128 * (ib // 8)
        sb = ib % 8
        ls = min(nint(inv * scales[ib]), 63)
        if second[ib]:
            match(d * F(ls), x, w, base, mid2, off2, mem2, vt2, vta2, tmp, 0, sc)
            _final_sums(x, w, base, tmp, 0, val2, F(ls), sums)
        else:
            match(d * F(ls), x, w, base, mid1, off1, mem1, vt1, vta1, tmp, 0, sc)
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


@njit(cache=True, parallel=True, error_model="numpy")
def quantize_small_rows(x, qw, has_qw, out, one, mid, offsets, members, vt, vt_all, values):
    for r in prange(x.shape[0]):
        small_row(x[r], qw, has_qw, out[r], one, mid, offsets, members, vt, vt_all, values)


@njit(cache=True, parallel=True, error_model="numpy")
def quantize_iq3_rows(x, qw, has_qw, out, mid, offsets, members, vt, vt_all, values):
    for r in prange(x.shape[0]):
        iq3_row(x[r], qw, has_qw, out[r], mid, offsets, members, vt, vt_all, values)


@njit(cache=True, parallel=True, error_model="numpy")
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


@njit(cache=True, parallel=True, error_model="numpy")
def dequantize_rows(blocks, kind, out):
    """kind: 1..4 for IQ1_KT..IQ4_KT."""
    n_rows, n = out.shape
    nbl = n // 256
    for r in prange(n_rows):
        b = blocks[r]
        d = np.array([b[0], b[1], b[2], b[3]], np.uint8).view(np.float32)[0]
        for bl in range(nbl):
            for ib in range(8):
                o = 256 * bl + 32 * ib
                if kind == 1:
                    p = 4 + 56 * bl
                    sh = I64(b[p + ib])
                    sl = d * KV[sh & 0xF]
                    for ig in range(4):
                        c = I64(b[p + 8 + 4 * ib + ig]) | ((I64(b[p + 40 + 4 * (ib % 4) + ig]) << (8 - 4 * (ib // 4))) & 0xF00) \
                            | ((sh << (8 - ig)) & 0x1000)
                        _group(c, 4096, False, 8, sl, out[r], o + 8 * ig)
                elif kind == 2 or kind == 3:
                    p = 4 + (68 if kind == 2 else 100) * bl
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
                    p = 4 + 128 * bl
                    head = I64(b[p + 4 * ib]) | (I64(b[p + 4 * ib + 1]) << 8) | (I64(b[p + 4 * ib + 2]) << 16) \
                        | (I64(b[p + 4 * ib + 3]) << 24)
                    offset = 4096 + 32768 if head & 1 else 4096
                    sl = d * F(((head & 0xFF) >> 1) - 64)
                    for ig in range(8):
                        gi = 8 * ib + ig
                        c = I64(b[p + 32 + gi]) | ((I64(b[p + 96 + gi % 32]) << (8 - 4 * (gi // 32))) & 0xF00) \
                            | (((head >> (8 + 3 * ig)) & 7) << 12)
                        _group(c, offset, False, 4, sl, out[r], o + 4 * ig)
