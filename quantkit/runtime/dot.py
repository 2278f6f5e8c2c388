"""Dot products of packed integer codes with float32 activations, a run of codes at a time, written
as LLVM vector IR (numba intrinsics) for the runtime's fused matrix-vector kernels (matvec.py).

numba compiles a loop such as ``s += float(q[o + j]) * x[xo + j]`` into one scalar multiply-add
per value: index wrap-around checks and the strict order of float additions keep LLVM from
vectorizing it (7x slower than the vector form here).  These intrinsics load the codes of one run
(n = 8, 16 or 32 values) as a vector, take the bits apart, widen them to float32, multiply with
the activations and add the products up in a tree, all in SIMD registers; the kernels around them
loop over blocks and apply the scales in plain numba.

A run's code j (0 <= j < n) is built from the bytes at ``off``:

    low       (a[off + j] >> shift) & mask             shift < 8, e.g. nibbles: shift 0 / 4, mask 15
    | high    ((a[hoff + j] >> hshift) & hmask) << hpos  a second plane of bits (Q6_0, Q6_K, Q3_K)
      or      ((qh >> (hbase + j)) & 1) << hpos          one bit per code from a 32-bit word (Q5_0, Q5_1)
    then      code - bias                              (unsigned codes centred: Q4_0 bias 8, ...)
      or      table[toff + code]                       int8 values of a non-linear grid (IQ4_NL, IQ4_K, IQ2_K)

and Q8_0's codes are the signed bytes themselves.  The table lookup is one byte shuffle (pshufb)
of a 16-entry table on x86; elsewhere it is a per-lane extract.

The numpy twins (``*_twin``) compute the same sums value by value, for the tests.
"""
from __future__ import annotations

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

F = np.float32
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


def _bits(builder, base, off, shift, mask, n):
    """<n x i16>: (base[off + j] >> shift) & mask.  Shifted as 16-bit lanes: x86 shifts those by
    one count register, while a byte shift by a count only known at run time (a loop's j % 2)
    becomes n scalar shifts."""
    v = builder.zext(_load(builder, base, off, n, _I8), ir.VectorType(_I16, n))
    v = builder.lshr(v, _splat(builder, _as(builder, shift, _I16), n))
    return builder.and_(v, _splat(builder, _as(builder, mask, _I16), n))


def _lookup(builder, table16, idx, n):
    """<n x i8>: table16[idx[j]] for idx < 16, table16 a <16 x i8>."""
    if not _X86:
        out = ir.Constant(ir.VectorType(_I8, n), ir.Undefined)
        for j in range(n):
            k = builder.extract_element(idx, ir.Constant(_I32, j))
            out = builder.insert_element(out, builder.extract_element(table16, k), ir.Constant(_I32, j))
        return out
    v16 = ir.VectorType(_I8, 16)
    fn = builder.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128", (), ir.FunctionType(v16, [v16, v16]))
    undef = ir.Constant(v16, ir.Undefined)
    if n == 8:
        wide = builder.shuffle_vector(idx, ir.Constant(ir.VectorType(_I8, 8), ir.Undefined),
                                      ir.Constant(ir.VectorType(_I32, 16), list(range(8)) + [8] * 8))
        res = builder.call(fn, [table16, wide])
        return builder.shuffle_vector(res, undef, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
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
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        prod = builder.fadd(lo, hi)
    return builder.extract_element(prod, ir.Constant(_I32, 0))


def _signed_f32(builder, codes_i8, n):
    return builder.sitofp(builder.sext(codes_i8, ir.VectorType(_I32, n)), ir.VectorType(_F32, n))


def _centred_f32(builder, codes, bias, n):
    wide = builder.zext(codes, ir.VectorType(_I32, n))
    wide = builder.sub(wide, _splat(builder, _as(builder, bias, _I32), n))
    return builder.sitofp(wide, ir.VectorType(_F32, n))


def _check(n):
    assert n in (8, 16, 32), n


def signed_dot(n):
    """``dot(a, off, x, xo)`` = Σ_j int8(a[off + j]) * x[xo + j] (a uint8 or int8 1-D, x float32 1-D)."""
    _check(n)

    @intrinsic
    def dot(typingctx, a, off, x, xo):
        def codegen(context, builder, sig, args):
            q = _load(builder, _data(context, builder, sig.args[0], args[0]), args[1], n, _I8)
            return _dot(builder, _signed_f32(builder, q, n), _data(context, builder, sig.args[2], args[2]), args[3], n)
        return nbt.float32(a, off, x, xo), codegen
    return dot


def bits_dot(n):
    """``dot(a, off, shift, mask, bias, x, xo)`` = Σ_j (((a[off + j] >> shift) & mask) - bias) * x[xo + j]."""
    _check(n)

    @intrinsic
    def dot(typingctx, a, off, shift, mask, bias, x, xo):
        def codegen(context, builder, sig, args):
            a_v, off_v, shift_v, mask_v, bias_v, x_v, xo_v = args
            codes = _bits(builder, _data(context, builder, sig.args[0], a_v), off_v, shift_v, mask_v, n)
            return _dot(builder, _centred_f32(builder, codes, bias_v, n),
                        _data(context, builder, sig.args[5], x_v), xo_v, n)
        return nbt.float32(a, off, shift, mask, bias, x, xo), codegen
    return dot


def plane_dot(n):
    """``dot(a, off, shift, mask, hoff, hshift, hmask, hpos, bias, x, xo)`` =
    Σ_j ((((a[off + j] >> shift) & mask) | (((a[hoff + j] >> hshift) & hmask) << hpos)) - bias) * x[xo + j]."""
    _check(n)

    @intrinsic
    def dot(typingctx, a, off, shift, mask, hoff, hshift, hmask, hpos, bias, x, xo):
        def codegen(context, builder, sig, args):
            a_v, off_v, shift_v, mask_v, hoff_v, hshift_v, hmask_v, hpos_v, bias_v, x_v, xo_v = args
            base = _data(context, builder, sig.args[0], a_v)
            low = _bits(builder, base, off_v, shift_v, mask_v, n)
            high = _bits(builder, base, hoff_v, hshift_v, hmask_v, n)
            high = builder.shl(high, _splat(builder, _as(builder, hpos_v, _I16), n))
            return _dot(builder, _centred_f32(builder, builder.or_(low, high), bias_v, n),
                        _data(context, builder, sig.args[9], x_v), xo_v, n)
        return nbt.float32(a, off, shift, mask, hoff, hshift, hmask, hpos, bias, x, xo), codegen
    return dot


def word_dot(n):
    """``dot(a, off, shift, mask, qh, hbase, hpos, bias, x, xo)`` =
    Σ_j ((((a[off + j] >> shift) & mask) | (((qh >> (hbase + j)) & 1) << hpos)) - bias) * x[xo + j],
    qh a 32-bit word of high bits (hbase + n <= 32)."""
    _check(n)

    @intrinsic
    def dot(typingctx, a, off, shift, mask, qh, hbase, hpos, bias, x, xo):
        def codegen(context, builder, sig, args):
            a_v, off_v, shift_v, mask_v, qh_v, hbase_v, hpos_v, bias_v, x_v, xo_v = args
            vi = ir.VectorType(_I32, n)
            low = builder.zext(_bits(builder, _data(context, builder, sig.args[0], a_v), off_v, shift_v, mask_v, n), vi)
            # bit hbase + j of qh in lane j: a mask per lane and a compare (a variable shift per
            # lane is slower on AVX2)
            masks = builder.shl(ir.Constant(vi, [1 << j for j in range(n)]), _splat(builder, _as(builder, hbase_v, _I32), n))
            hit = builder.icmp_unsigned("!=", builder.and_(_splat(builder, _as(builder, qh_v, _I32), n), masks),
                                        ir.Constant(vi, [0] * n))
            high = builder.zext(hit, vi)
            code = builder.or_(low, builder.shl(high, _splat(builder, _as(builder, hpos_v, _I32), n)))
            code = builder.sub(code, _splat(builder, _as(builder, bias_v, _I32), n))
            return _dot(builder, builder.sitofp(code, ir.VectorType(_F32, n)),
                        _data(context, builder, sig.args[8], x_v), xo_v, n)
        return nbt.float32(a, off, shift, mask, qh, hbase, hpos, bias, x, xo), codegen
    return dot


def table_dot(n):
    """``dot(a, off, shift, mask, table, toff, x, xo)`` = Σ_j table[toff + ((a[off + j] >> shift) & mask)] * x[xo + j],
    table int8 1-D with at least toff + 16 entries, mask < 16."""
    _check(n)

    @intrinsic
    def dot(typingctx, a, off, shift, mask, table, toff, x, xo):
        def codegen(context, builder, sig, args):
            a_v, off_v, shift_v, mask_v, t_v, toff_v, x_v, xo_v = args
            idx = _bits(builder, _data(context, builder, sig.args[0], a_v), off_v, shift_v, mask_v, n)
            table16 = _load(builder, _data(context, builder, sig.args[4], t_v), toff_v, 16, _I8)
            vals = _lookup(builder, table16, builder.trunc(idx, ir.VectorType(_I8, n)), n)
            return _dot(builder, _signed_f32(builder, vals, n), _data(context, builder, sig.args[6], x_v), xo_v, n)
        return nbt.float32(a, off, shift, mask, table, toff, x, xo), codegen
    return dot


def float_dot(n, half):
    """``dot(a, off, x, xo)`` = Σ_j w_j * x[xo + j], w the n float32 (``half``: float16) values
    stored at byte ``off`` of a (uint8 1-D)."""
    _check(n)
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


# ---- the instances the kernels use ----

f32x32, f16x32 = float_dot(32, False), float_dot(32, True)

signed32 = signed_dot(32)
bits8, bits16, bits32 = bits_dot(8), bits_dot(16), bits_dot(32)
plane8, plane16, plane32 = plane_dot(8), plane_dot(16), plane_dot(32)
word16 = word_dot(16)
table8, table16, table32 = table_dot(8), table_dot(16), table_dot(32)


# ---- numpy twins ----

def _x(x, xo, n):
    return np.asarray(x[xo:xo + n], np.float64)


def signed_twin(a, off, x, xo, n):
    return float(np.asarray(a[off:off + n]).view(np.int8).astype(np.float64) @ _x(x, xo, n))


def _low(a, off, shift, mask, n):
    return (np.asarray(a[off:off + n], np.int64) >> shift) & mask


def bits_twin(a, off, shift, mask, bias, x, xo, n):
    return float((_low(a, off, shift, mask, n) - bias) @ _x(x, xo, n))


def plane_twin(a, off, shift, mask, hoff, hshift, hmask, hpos, bias, x, xo, n):
    code = _low(a, off, shift, mask, n) | (_low(a, hoff, hshift, hmask, n) << hpos)
    return float((code - bias) @ _x(x, xo, n))


def word_twin(a, off, shift, mask, qh, hbase, hpos, bias, x, xo, n):
    high = (int(qh) >> (hbase + np.arange(n))) & 1
    return float(((_low(a, off, shift, mask, n) | (high << hpos)) - bias) @ _x(x, xo, n))


def float_twin(a, off, x, xo, n, half):
    w = np.asarray(a[off:off + (2 if half else 4) * n]).view(np.float16 if half else np.float32)
    return float(w.astype(np.float64) @ _x(x, xo, n))


def table_twin(a, off, shift, mask, table, toff, x, xo, n):
    vals = np.asarray(table, np.int64)[toff + _low(a, off, shift, mask, n)]
    return float(vals @ _x(x, xo, n))


# ---- whole blocks: several runs, each with its own scale, summed in one vector ----

def chunk_dot(runs, table=False):
    """``dot(a, o, scales, toffs, tab, x, xo)`` = Σ_k scales[k] * Σ_j code_kj * x[xo + xoff_k + j]
    over the static ``runs``: tuples (n, xoff, off, shift, mask, hoff, hshift, hmask, hpos, bias)
    with byte offsets relative to o (hoff None: no high plane; hshift None: the low byte's own
    bits are the int8 code).  With ``table`` a code is tab[toffs[k] + code] instead of code - bias.

    The runs' products are scaled and added into one vector, which is summed once at the end: a
    super-block costs one horizontal sum instead of one per run."""
    width = max(r[0] for r in runs)

    @intrinsic
    def dot(typingctx, a, o, scales, toffs, tab, x, xo):
        def codegen(context, builder, sig, args):
            a_v, o_v, sc_v, to_v, tab_v, x_v, xo_v = args
            i64 = ir.IntType(64)
            base = _data(context, builder, sig.args[0], a_v)
            sc = _data(context, builder, sig.args[2], sc_v)
            to = _data(context, builder, sig.args[3], to_v)
            tb = _data(context, builder, sig.args[4], tab_v)
            xb = _data(context, builder, sig.args[5], x_v)
            acc = None
            for k, (n, xoff, off, shift, mask, hoff, hshift, hmask, hpos, bias) in enumerate(runs):
                c = lambda v: ir.Constant(i64, v)
                at = builder.add(o_v, c(off))
                if shift is None:
                    vals = _signed_f32(builder, _load(builder, base, at, n, _I8), n)
                else:
                    code = _bits(builder, base, at, c(shift), c(mask), n)
                    if hoff is not None:
                        high = _bits(builder, base, builder.add(o_v, c(hoff)), c(hshift), c(hmask), n)
                        code = builder.or_(code, builder.shl(high, ir.Constant(ir.VectorType(_I16, n), [hpos] * n)))
                    if table:
                        toff = builder.load(builder.gep(to, [c(k)]))
                        t16 = _load(builder, tb, toff, 16, _I8)
                        vals = _signed_f32(builder, _lookup(builder, t16, builder.trunc(code, ir.VectorType(_I8, n)), n), n)
                    else:
                        vals = _centred_f32(builder, code, c(bias), n)
                prod = builder.fmul(vals, _load(builder, xb, builder.add(xo_v, c(xoff)), n, _F32))
                s = _splat(builder, builder.load(builder.gep(sc, [c(k)])), n)
                prod = builder.fmul(prod, s)
                while n > 8:                           # fold to 8 lanes
                    n //= 2
                    lo = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                    hi = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
                    prod = builder.fadd(lo, hi)
                acc = prod if acc is None else builder.fadd(acc, prod)
            n = 8
            while n > 1:
                n //= 2
                lo = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                hi = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
                acc = builder.fadd(lo, hi)
            return builder.extract_element(acc, ir.Constant(_I32, 0))
        return nbt.float32(a, o, scales, toffs, tab, x, xo), codegen
    return dot


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
