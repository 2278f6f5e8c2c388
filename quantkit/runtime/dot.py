"""Dot products of packed weights with activations, written as LLVM vector IR (numba intrinsics)
for the runtime's fused matrix-vector kernels (matvec.py) and its attention of a few tokens.

numba compiles a loop such as ``s += float(q[o + j]) * x[xo + j]`` into one scalar multiply-add
per value: index wrap-around checks and the strict order of float additions keep LLVM from
vectorizing it (7x slower than the vector form here).  These intrinsics load the codes as vectors,
take the bits apart, multiply and add in SIMD registers, at byte offsets that are constants of
the compiled kernel.

The main one, :func:`chunk_dot`, reads a chunk of blocks described by a static list of
:class:`Run` (where each run's bits sit, how they combine, where its scale is), with the
activations rounded to 8 bits per 32 as ggml's q8_0 does:

    code j of a run    (a[off + j] >> shift) & mask            (split: a 16-byte block's low
                       | high bits << hpos                      nibbles, then its high ones)
                       - bias, or table[params[k] + code]      (non-linear grids, one pshufb)
    run sum            Σ_j code_j * xq_j                       16-bit products added in pairs
                                                               into 32-bit lanes (pmaddwd)
    chunk              Σ_k float(run sum_k) * scale_k * xd     float FMAs, 4 accumulators

numba's cache checks the source file of the cached function only: after editing this module,
delete quantkit/runtime/__pycache__/*.nb* (kernels compiled from the old IR stay cached otherwise).
chunk_dot has a numpy twin (``chunk_twin``) that the tests compare it with on any bytes; the float
and float16 dots are tested through the kernels that use them (F32/F16 products, attention).
"""
from __future__ import annotations

from typing import NamedTuple

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

_X86 = llb.get_process_triple().split("-")[0] in ("x86_64", "i386", "i686")

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _data(context, builder, arytype, value):
    return context.make_array(arytype)(context, builder, value).data


def _load(builder, base, off, n, elt):
    """<n x elt> from base[off:off + n] (unaligned)."""
    ptr = builder.gep(base, [off])
    return builder.load(builder.bitcast(ptr, ir.VectorType(elt, n).as_pointer()), align=1)


def _splat(builder, value, n):
    vt = ir.VectorType(value.type, n)
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _as(builder, value, t):
    """An integer scalar argument as type t (truncated or widened)."""
    if value.type.width > t.width:
        return builder.trunc(value, t)
    if value.type.width < t.width:
        return builder.zext(value, t)
    return value


def _lookup(builder, table16, idx, n):
    """<n x i8>: table16[idx[j]] for idx < 16, table16 a <16 x i8> (n 16 or 32 on x86)."""
    if not _X86:
        out = ir.Constant(ir.VectorType(_I8, n), ir.Undefined)
        for j in range(n):
            k = builder.extract_element(idx, ir.Constant(_I32, j))
            out = builder.insert_element(out, builder.extract_element(table16, k), ir.Constant(_I32, j))
        return out
    assert n in (16, 32), n
    v16 = ir.VectorType(_I8, 16)
    fn = builder.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128", (), ir.FunctionType(v16, [v16, v16]))
    parts = []
    for p in range(n // 16):
        piece = builder.shuffle_vector(idx, ir.Constant(idx.type, ir.Undefined),
                                       ir.Constant(ir.VectorType(_I32, 16), list(range(16 * p, 16 * p + 16))))
        parts.append(builder.call(fn, [table16, piece]))
    if len(parts) == 1:
        return parts[0]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _dot(builder, values, xbase, xoff, n):
    """Σ_j values[j] * x[xoff + j], values <n x float>, summed as a tree of halves."""
    prod = builder.fmul(values, _load(builder, xbase, xoff, n, _F32))
    return builder.extract_element(_fold(builder, prod, n, 1), ir.Constant(_I32, 0))


def float_dot(n, half):
    """``dot(a, off, x, xo)`` = Σ_j w_j * x[xo + j], w the n float32 (``half``: float16) values
    stored at byte ``off`` of a (uint8 1-D): rows of F32 / F16 weights."""
    elt = ir.HalfType() if half else _F32

    @intrinsic
    def dot(typingctx, a, off, x, xo):
        def codegen(context, builder, sig, args):
            base = builder.bitcast(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]), elt.as_pointer())
            w = _load(builder, base, ir.Constant(ir.IntType(64), 0), n, elt)
            if half:
                w = builder.fpext(w, ir.VectorType(_F32, n))
            return _dot(builder, w, _data(context, builder, sig.args[2], args[2]), args[3], n)
        return nbt.float32(a, off, x, xo), codegen
    return dot


@intrinsic
def half_at(typingctx, a, off):
    """The float16 stored at byte ``off`` of a (uint8 1-D), as float32 (a block's scale)."""
    def codegen(context, builder, sig, args):
        ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
        return builder.fpext(builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1), _F32)
    return nbt.float32(a, off), codegen


f32x32, f16x32 = float_dot(32, False), float_dot(32, True)


def _low(a, off, shift, mask, n):
    return (np.asarray(a[off:off + n], np.int64) >> shift) & mask


# ---- chunks: many runs of codes, each with its own scale, accumulated in one vector ----

class Run(NamedTuple):
    """One run of codes in a chunk; byte offsets are relative to the chunk's first byte, value
    offsets to its first value."""
    n: int                      # values (8, 16 or 32)
    xoff: int                   # the run's first value
    off: int                    # first byte of the low bits
    shift: int | None = None    # low bits (byte >> shift) & mask; None: the bytes are int8 codes
    mask: int | None = None
    hoff: int | None = None     # a plane of high bits, ((byte >> hshift) & hmask) << hpos
    hshift: int = 0
    hmask: int = 0
    hpos: int = 4
    bias: int = 0               # subtracted from the code (ignored with a table)
    hword: int | None = None    # or high bit j is bit hbase + j of the 32-bit word at hword
    hbase: int = 0
    d_at: int | None = None     # the run's scale: the float16 at d_at, else scales[k]
    m_at: int | None = None     # a float16 min added to every value (Q4_1, Q5_1)
    split: bool = False         # n/2 bytes at off: codes 0..n/2-1 their low nibbles, then the high

    def moved(self, byte_delta: int, value_delta: int) -> "Run":
        """The same run in a block byte_delta bytes and value_delta values further on."""
        def mv(v):
            return None if v is None else v + byte_delta
        return self._replace(xoff=self.xoff + value_delta, off=self.off + byte_delta, hoff=mv(self.hoff),
                             hword=mv(self.hword), d_at=mv(self.d_at), m_at=mv(self.m_at))


def _fold(builder, v, n, to):
    """Add the halves of v (<n x float> or <n x i32>) until ``to`` lanes are left."""
    add = builder.fadd if isinstance(v.type.element, ir.FloatType) else builder.add
    while n > to:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = add(lo, hi)
    return v


def _halves(builder, base, o, offsets):
    """{offset: float32} for the float16 scalars at base[o + offset]: 8 at a time gathered into
    one vector and widened in one instruction (a scalar widening per scale merges into a register
    and chains every conversion to the one before)."""
    out = {}
    v8h = ir.VectorType(_I16, 8)
    offsets = list(offsets)
    for g in range(0, len(offsets), 8):
        part = offsets[g:g + 8]
        vec = ir.Constant(v8h, [0] * 8)
        for lane, off in enumerate(part):
            ptr = builder.bitcast(builder.gep(base, [builder.add(o, ir.Constant(ir.IntType(64), off))]), _I16.as_pointer())
            vec = builder.insert_element(vec, builder.load(ptr, align=1), ir.Constant(_I32, lane))
        wide = builder.fpext(builder.bitcast(vec, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(_F32, 8))
        for lane, off in enumerate(part):
            out[off] = (wide, lane)
    return out


def _lane_splat(builder, vec_lane, n):
    vec, lane = vec_lane
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), [lane] * n))


def _madd(builder, w16, x16, n):
    """<n/2 x i32>: w16[2i] * x16[2i] + w16[2i+1] * x16[2i+1] (<n x i16> operands; pmaddwd on x86)."""
    if _X86 and n in (16, 32):
        v16, v8 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (), ir.FunctionType(v8, [v16, v16]))
        halves = []
        for h in range(n // 16):
            pick = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16)))
            halves.append(builder.call(fn, [builder.shuffle_vector(w16, w16, pick), builder.shuffle_vector(x16, x16, pick)]))
        if len(halves) == 1:
            return halves[0]
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
    vi = ir.VectorType(_I32, n)
    prod = builder.mul(builder.sext(w16, vi), builder.sext(x16, vi))
    even = ir.Constant(ir.VectorType(_I32, n // 2), list(range(0, n, 2)))
    odd = ir.Constant(ir.VectorType(_I32, n // 2), list(range(1, n, 2)))
    return builder.add(builder.shuffle_vector(prod, prod, even), builder.shuffle_vector(prod, prod, odd))


def chunk_dot(runs, table=False):
    """``dot(a, o, scales, params, tab, xq, xd, xsum, xo)`` = Σ_k Σ_j value_kj * x_(xo + xoff_k + j)
    over the static ``runs`` (:class:`Run`) of a chunk starting at byte o of a and value xo of x
    (xo a multiple of 32), where

        value = scale_k * code (+ min_k)      scale_k the float16 at d_at, or scales[k]
        x_i   = xq[i] * xd[i // 32]           the activations as int8 codes (held as int16) and
                                              a scale per 32, as ggml's q8_0 rounds them;
                                              xsum[i // 32] = xd * Σ xq over the 32

    With ``table`` a code is the int8 tab[params[k] + code] (a 16-entry window of the grid).

    A run's integer codes are multiplied with xq in 16-bit lanes and added in pairs into 32-bit
    lanes (pmaddwd: 16 products per instruction), so each run costs one float conversion and one
    FMA per 8 lanes, whatever its width; the runs' sums go into a few float accumulators (scaled by
    scale_k * xd), summed once at the end.  Bytes, scales and activations are read at offsets
    fixed when the kernel is compiled: a chunk is straight-line vector code."""
    runs = tuple(Run(*r) for r in runs)
    assert all(r.n == runs[0].n for r in runs), "one run width per chunk"

    @intrinsic
    def dot(typingctx, a, o, scales, params, tab, xq, xd, xsum, xo):
        def codegen(context, builder, sig, args):
            a_v, o_v, sc_v, pa_v, tab_v, xq_v, xd_v, xs_v, xo_v = args
            i64 = ir.IntType(64)
            vf8 = ir.VectorType(_F32, 8)
            fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf8, [vf8, vf8, vf8]),
                                                     "llvm.fmuladd.v8f32")
            base = _data(context, builder, sig.args[0], a_v)
            sc = _data(context, builder, sig.args[2], sc_v)
            pa = _data(context, builder, sig.args[3], pa_v)
            tb = _data(context, builder, sig.args[4], tab_v)
            xqb = _data(context, builder, sig.args[5], xq_v)
            xdb = _data(context, builder, sig.args[6], xd_v)
            xsb = _data(context, builder, sig.args[7], xs_v)
            xblock = builder.lshr(xo_v, ir.Constant(i64, 5))

            def c(v):
                return ir.Constant(i64, v)
            # the scales first, so that 8 of them fill the first vector in run order
            d_offs = list(dict.fromkeys(r.d_at for r in runs if r.d_at is not None))
            halves = _halves(builder, base, o_v, dict.fromkeys(d_offs + [r.m_at for r in runs if r.m_at is not None]))
            # 8 blocks of 32 with a float16 scale each (legacy chunks): their scale products
            # d * xd in one vector multiply, lane i for block i
            block_scales = None
            if len(d_offs) == 8 and all(r.d_at is not None and d_offs.index(r.d_at) == r.xoff // 32 for r in runs):
                block_scales = builder.fmul(halves[d_offs[0]][0], _load(builder, xdb, xblock, 8, _F32))
            n_acc = 4                   # independent FMA chains
            accs = [ir.Constant(vf8, [0.0] * 8)] * n_acc
            mins = ir.Constant(_F32, 0.0)
            for k, r in enumerate(runs):
                n = r.n
                v8 = ir.VectorType(_I8, n)

                def b8(v):
                    return ir.Constant(v8, [v] * n)
                at = builder.add(o_v, c(r.off))
                if r.shift is None:
                    code = _load(builder, base, at, n, _I8)
                elif r.split:
                    # a block of 16 bytes holds 32 codes: low nibbles first, then the high ones
                    h8 = ir.VectorType(_I8, n // 2)
                    raw = _load(builder, base, at, n // 2, _I8)
                    mask = ir.Constant(h8, [15] * (n // 2))
                    lo = builder.and_(raw, mask)
                    hi = builder.and_(builder.lshr(raw, ir.Constant(h8, [4] * (n // 2))), mask)
                    code = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                else:
                    # bytes all the way: the shifts are constants here, which x86 does on bytes
                    # as a 16-bit shift and a mask; codes fit in int8
                    code = builder.and_(builder.lshr(_load(builder, base, at, n, _I8), b8(r.shift)), b8(r.mask))
                if r.shift is not None:
                    if r.hoff is not None:
                        high = _load(builder, base, builder.add(o_v, c(r.hoff)), n, _I8)
                        high = builder.and_(builder.lshr(high, b8(r.hshift)), b8(r.hmask))
                        code = builder.or_(code, builder.shl(high, b8(r.hpos)))
                    if r.hword is not None:
                        # bit hbase + j of the word, in byte lane j: spread the word's bytes over
                        # the lanes (byte (hbase + j) // 8 to lane j), test one bit per lane
                        word = _load(builder, base, builder.add(o_v, c(r.hword)), 4, _I8)
                        spread = builder.shuffle_vector(word, word, ir.Constant(ir.VectorType(_I32, n),
                                                                                [(r.hbase + j) // 8 for j in range(n)]))
                        bit = ir.Constant(v8, [1 << ((r.hbase + j) % 8) for j in range(n)])
                        hit = builder.icmp_unsigned("!=", builder.and_(spread, bit), b8(0))
                        code = builder.or_(code, builder.select(hit, b8(1 << r.hpos), b8(0)))
                    if table:
                        t16 = _load(builder, tb, builder.load(builder.gep(pa, [c(k)])), 16, _I8)
                        code = _lookup(builder, t16, code, n)
                    else:
                        code = builder.sub(code, b8(r.bias))
                w16 = builder.sext(code, ir.VectorType(_I16, n))
                x16 = _load(builder, xqb, builder.add(xo_v, c(r.xoff)), n, _I16)
                isum = _fold(builder, _madd(builder, w16, x16, n), n // 2, 8) if n >= 16 else \
                    builder.shuffle_vector(_madd(builder, w16, x16, n), ir.Constant(ir.VectorType(_I32, 4), [0] * 4),
                                           ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
                blk = builder.add(xblock, c(r.xoff // 32))
                if block_scales is not None:
                    scale8 = _lane_splat(builder, (block_scales, r.xoff // 32), 8)
                else:
                    if r.d_at is not None:
                        vec, lane = halves[r.d_at]
                        d = builder.extract_element(vec, ir.Constant(_I32, lane))
                    else:
                        d = builder.load(builder.gep(sc, [c(k)]))
                    scale8 = _splat(builder, builder.fmul(d, builder.load(builder.gep(xdb, [blk]))), 8)
                fsum = builder.sitofp(isum, vf8)
                accs[k % n_acc] = builder.call(fmuladd, [fsum, scale8, accs[k % n_acc]])
                if r.m_at is not None and (k == 0 or runs[k - 1].m_at != r.m_at or r.xoff // 32 != runs[k - 1].xoff // 32):
                    vec, lane = halves[r.m_at]
                    m = builder.extract_element(vec, ir.Constant(_I32, lane))
                    mins = builder.fadd(mins, builder.fmul(m, builder.load(builder.gep(xsb, [blk]))))
            while len(accs) > 1:
                accs = [builder.fadd(accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
            total = builder.extract_element(_fold(builder, accs[0], 8, 1), ir.Constant(_I32, 0))
            return builder.fadd(total, mins)
        return nbt.float32(a, o, scales, params, tab, xq, xd, xsum, xo), codegen
    dot.runs, dot.table = runs, table           # for the twin in tests
    return dot


def chunk_twin(runs, table, a, o, scales, params, tab, xq, xd, xo):
    """chunk_dot, value by value (float64 sums of value * xq * xd)."""
    a = np.asarray(a)
    total = 0.0
    for k, r in enumerate(Run(*r) for r in runs):
        n = r.n
        if r.shift is None:
            code = a[o + r.off:o + r.off + n].view(np.int8).astype(np.int64)
        else:
            if r.split:
                raw = np.asarray(a[o + r.off:o + r.off + n // 2], np.int64)
                code = np.concatenate([raw & 15, raw >> 4])
            else:
                code = _low(a, o + r.off, r.shift, r.mask, n)
            if r.hoff is not None:
                code = code | (_low(a, o + r.hoff, r.hshift, r.hmask, n) << r.hpos)
            if r.hword is not None:
                word = int(a[o + r.hword:o + r.hword + 4].view(np.uint32)[0])
                code = code | (((word >> (r.hbase + np.arange(n))) & 1) << r.hpos)
            code = np.asarray(tab, np.int64)[params[k] + code] if table else code - r.bias
        half = (lambda at: float(a[o + at:o + at + 2].view(np.float16)[0]))
        d = float(scales[k]) if r.d_at is None else half(r.d_at)
        value = d * code + (0.0 if r.m_at is None else half(r.m_at))
        i = xo + r.xoff
        xv = np.asarray(xq[i:i + n], np.float64) * float(xd[i // 32])
        total += float(value @ xv)
    return total


# ---- float16 rows of a 3-D array (the KV cache): a[i, h, d:d + n], contiguous in d ----

def _half_ptr(context, builder, arytype, value, i, h, d, n):
    """Pointer to a[i, h, d] as <n x half>*, a a 3-D 2-byte array (strides in bytes)."""
    ary = context.make_array(arytype)(context, builder, value)
    s0, s1, s2 = cgutils.unpack_tuple(builder, ary.strides, 3)
    byte = builder.add(builder.add(builder.mul(i, s0), builder.mul(h, s1)), builder.mul(d, s2))
    ptr = builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [byte])
    return builder.bitcast(ptr, ir.VectorType(ir.HalfType(), n).as_pointer())


def half_row_dot(n):
    """``dot(a, i, h, d, x, xo)`` = Σ_j half(a[i, h, d + j]) * x[xo + j], a uint16 3-D (float16
    bits, last axis contiguous)."""
    @intrinsic
    def dot(typingctx, a, i, h, d, x, xo):
        def codegen(context, builder, sig, args):
            a_v, i_v, h_v, d_v, x_v, xo_v = args
            w = builder.load(_half_ptr(context, builder, sig.args[0], a_v, i_v, h_v, d_v, n), align=2)
            return _dot(builder, builder.fpext(w, ir.VectorType(_F32, n)), _data(context, builder, sig.args[4], x_v), xo_v, n)
        return nbt.float32(a, i, h, d, x, xo), codegen
    return dot


def half_row_axpy(n):
    """``axpy(a, i, h, d, p, y, yo)``: y[yo + j] += p * half(a[i, h, d + j]) for j < n."""
    @intrinsic
    def axpy(typingctx, a, i, h, d, p, y, yo):
        def codegen(context, builder, sig, args):
            a_v, i_v, h_v, d_v, p_v, y_v, yo_v = args
            w = builder.fpext(builder.load(_half_ptr(context, builder, sig.args[0], a_v, i_v, h_v, d_v, n), align=2),
                              ir.VectorType(_F32, n))
            yp = builder.bitcast(builder.gep(_data(context, builder, sig.args[5], y_v), [yo_v]),
                                 ir.VectorType(_F32, n).as_pointer())
            builder.store(builder.fadd(builder.load(yp, align=4), builder.fmul(w, _splat(builder, p_v, n))), yp, align=4)
            return context.get_dummy_value()
        return nbt.none(a, i, h, d, p, y, yo), codegen
    return axpy


@intrinsic
def half_bits(typingctx, u):
    """The float16 whose bits are the uint16 u, as float32."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(_as(builder, args[0], ir.IntType(16)), ir.HalfType()), _F32)
    return nbt.float32(u), codegen


half_dot8, half_dot32 = half_row_dot(8), half_row_dot(32)
half_axpy8, half_axpy32 = half_row_axpy(8), half_row_axpy(32)
