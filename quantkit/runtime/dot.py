"""Dot products of packed weights with activations, written as LLVM vector IR (numba intrinsics)
for the runtime's fused matrix-vector kernels (matvec.py) and its attention of a few tokens.

numba compiles a loop such as ``s += float(q[o + j]) * x[xo + j]`` into one scalar multiply-add
per value: index wrap-around checks and the strict order of float additions keep LLVM from
vectorizing it (7x slower than the vector form here).  These intrinsics load the codes as vectors,
take the bits apart, multiply and add in SIMD registers, at byte offsets that are constants of
the compiled kernel.

The main one, :func:`chunk_dot`, reads a chunk of blocks described by a static list of
:class:`~quantkit.layouts.Run` (where each run's bits sit, how they combine, where its scale is;
the types' layouts are declared in quantkit/layouts.py), with the
activations rounded to 8 bits per 32 as ggml's q8_0 does:

    code j of a run    (a[off + j] >> shift) & mask            (split: a 16-byte block's low
                       | high bits << hpos                      nibbles, then its high ones)
                       (- bias), or table[params[k] + code]    (non-linear grids, one pshufb)
    32-group sum       Σ_j code_j * xq_j over the group's runs  bytes times bytes added in pairs
                       (times each run's integer scale)         (pmaddubsw), then in pairs into
                                                                32-bit lanes (pmaddwd)
    chunk              Σ_g float(group sum_g) * scale_g * xd_g  one float multiply-add of 8
                       + Σ_g (min_g - bias * d_g) * xsum_g      lanes (legacy blocks too)

A multiply-add is always fused (llvm.fma, never llvm.fmuladd, which fuses only where the CPU has
FMA): one rounding on every target, an FMA instruction where numba's target has one and libm's
correctly rounded fmaf where not (NUMBA_CPU_NAME=generic), so the results are the same bits on
every CPU; other multiplies and adds are plain fmul / fadd, which LLVM never contracts without
fast-math flags.  The integer sums are exact anyway.

After an edit of this module numba recompiles the kernels built from its IR: their cache is keyed
on all of quantkit's sources (quantkit/kernel_cache.py).
chunk_dot has a numpy twin (tests/runtime_twins.py ``chunk_twin``) that the tests compare it with on any bytes; the float
and float16 dots are tested through the kernels that use them (F32/F16 products, attention).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

from ..cpu import half_to_float, target
from ..layouts import Run

# which x86 intrinsics the byte products may emit: those of the target numba compiles for
# (quantkit.cpu), never more: LLVM aborts the process on an instruction it cannot select.
# AVX2: 256-bit pshufb / pmaddubsw / pmaddwd / psignb, and a block's 16 bytes of nibbles loaded into
# both 128-bit halves and shifted per half (no cross-half insert); SSSE3: the same on two 128-bit
# halves; neither (NUMBA_CPU_NAME=generic, other architectures): plain vector IR, the same integers,
# with SSE2's pmaddwd where there is SSE2 (x86-64's baseline)
_AVX2 = target().avx2
_SSSE3 = target().ssse3
_SSE2 = target().sse2
# VNNI (AVX-512 VNNI, AVX-VNNI): a legacy group's 32 byte products added in fours into 32-bit lanes
# by one vpdpbusd (exact: no 16-bit saturation), the integers of pmaddubsw then pmaddwd by 1;
# AVX-512BW: a word of high bits (Q5_0's) made a byte mask (kmov) instead of spread over the lanes
# and tested.  On Zen 4 (512-bit ops in two halves) a chunk's groups two per zmm register ran no
# faster than 256 bits: the chunks stay on 256-bit vectors.
_VNNI = target().vnni
_AVX512BW = target().avx512bw
# GFNI (with AVX2): a group of byte runs (Q6_0's four runs of 8, Q6_K's two of 16, Q5_K's one of 32)
# is unpacked as whole 32-byte vectors, each byte's shift and mask (and its high bits' shift,
# mask and move) one vgf2p8affineqb with a bit matrix per 8 bytes (``_gfni_codes``): Q6_0's 25
# instructions per 32 codes became 6.  The same integers as the shifts and masks give.
_GFNI = target().gfni and _AVX2

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _data(context, builder, arytype, value):
    return context.make_array(arytype)(context, builder, value).data


def _load(builder, base, off, n, elt):
    """<n x elt> from base[off:off + n] (unaligned)."""
    ptr = builder.gep(base, [off])
    return builder.load(builder.bitcast(ptr, ir.VectorType(elt, n).as_pointer()), align=1)


def prefetch(builder, base, off):
    """A hint to fetch the cache line of base[off] (llvm.prefetch: read, keep in all levels): no
    result, no fault where off is past the array."""
    i8p = _I8.as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0")
    ptr = builder.bitcast(builder.gep(base, [off]), i8p)
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


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


def _pshufb(builder, table, idx):
    """lane j: table[16 (j // 16) + idx[j]] (idx < 16), table and idx 16 or 32 bytes: each 16-byte
    half looked up in its own table (x86's pshufb, 128 or 256 bits)."""
    n = idx.type.count
    if n == 32 and _AVX2:
        return _x86(builder, "llvm.x86.avx2.pshuf.b", table.type, table, idx)
    if _SSSE3:
        return _on_128(builder, lambda t, i: _x86(builder, "llvm.x86.ssse3.pshuf.b.128", t.type, t, i), table, idx)
    # plain IR: for each of the 16 entries, where idx is k take entry k of the lane's table (a
    # lane-by-lane lookup through memory ran 6x slower on SSE2)
    out = ir.Constant(table.type, [0] * n)
    for k in range(16):
        entry = builder.shuffle_vector(table, table, ir.Constant(ir.VectorType(_I32, n), [16 * (j // 16) + k for j in range(n)]))
        out = builder.select(builder.icmp_unsigned("==", idx, ir.Constant(idx.type, [k] * n)), entry, out)
    return out


def _pieces(builder, v):
    """A vector of 128, 256 or 512 bits as its 128-bit pieces."""
    n = v.type.count
    m = 128 // v.type.element.width
    if n == m:
        return [v]
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, m), list(range(h, h + m))))
            for h in range(0, n, m)]


def _on_128(builder, op, *vs):
    """op (a 128-bit instruction) on each 128-bit piece of the operands, the results joined: a
    256-bit instruction's lanes without AVX2."""
    return _concat(builder, [op(*parts) for parts in zip(*(_pieces(builder, v) for v in vs))])


def _lookup(builder, table16, idx, n):
    """<n x i8>: table16[idx[j]] for idx < 16, table16 a <16 x i8> (n 16 or 32)."""
    assert n in (16, 32), n
    return _pshufb(builder, table16 if n == 16 else _concat(builder, [table16, table16]), idx)


def _dot(builder, values, xbase, xoff, n):
    """Σ_j values[j] * x[xoff + j], values <n x float>, summed as a tree of halves."""
    prod = builder.fmul(values, _load(builder, xbase, xoff, n, _F32))
    return builder.extract_element(_fold(builder, prod, n, 1), ir.Constant(_I32, 0))


def _widen(builder, w, fmt):
    """float16 / bfloat16 values (<n x half> / <n x i16>, or one) as float32; float32 as they are."""
    vec = isinstance(w.type, ir.VectorType)

    def like_w(t):
        return ir.VectorType(t, w.type.count) if vec else t
    if fmt == "f16":
        return half_to_float(builder, w)
    if fmt == "bf16":                       # the top 16 bits of a float32
        sixteen = ir.Constant(like_w(_I32), [16] * w.type.count if vec else 16)
        return builder.bitcast(builder.shl(builder.zext(w, like_w(_I32)), sixteen), like_w(_F32))
    return w


_STORED = {"f32": _F32, "f16": ir.HalfType(), "bf16": _I16}


def float_dot(n, fmt):
    """``dot(a, off, x, xo)`` = Σ_j w_j * x[xo + j], w the n values stored at byte ``off`` of a
    (uint8 1-D) as ``fmt`` ("f32", "f16" or "bf16"): rows of F32 / F16 / BF16 weights."""
    elt = _STORED[fmt]

    @intrinsic
    def dot(typingctx, a, off, x, xo):
        def codegen(context, builder, sig, args):
            base = builder.bitcast(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]), elt.as_pointer())
            w = _widen(builder, _load(builder, base, ir.Constant(ir.IntType(64), 0), n, elt), fmt)
            return _dot(builder, w, _data(context, builder, sig.args[2], args[2]), args[3], n)
        return nbt.float32(a, off, x, xo), codegen
    return dot


def float_at(fmt):
    """``at(a, off)``: the value stored at byte ``off`` of a (uint8 1-D) as ``fmt``, as float32."""
    elt = _STORED[fmt]

    @intrinsic
    def at(typingctx, a, off):
        def codegen(context, builder, sig, args):
            ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
            return _widen(builder, builder.load(builder.bitcast(ptr, elt.as_pointer()), align=1), fmt)
        return nbt.float32(a, off), codegen
    return at


# rows of float weights, kind 0 / 1 / 2 (matvec): 32 values per dot, then one value at a time;
# half_at / f32_at also read a block's float16 scale and a row's float32 scale
FLOAT_FORMATS = ("f32", "f16", "bf16")
FLOAT_READERS = tuple((float_dot(32, fmt), float_at(fmt)) for fmt in FLOAT_FORMATS)
f32_at, half_at = FLOAT_READERS[0][1], FLOAT_READERS[1][1]


# ---- chunks: many runs of codes, each with its own scale, accumulated in one vector ----

def _fma(builder, a, b, c):
    """a * b + c rounded once (<n x float>): llvm.fma, on every target (module docstring)."""
    vt = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3), f"llvm.fma.v{vt.count}f32")
    return builder.call(fn, [a, b, c])


def _fold(builder, v, n, to):
    """Add the halves of v (<n x float> or <n x i32>) until ``to`` lanes are left."""
    add = builder.fadd if isinstance(v.type.element, ir.FloatType) else builder.add
    while n > to:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = add(lo, hi)
    return v


def _half_vector(builder, base, o, offsets):
    """<8 x float>: lane i the float16 at base[o + offsets[i]] (at most 8), the other lanes 0;
    gathered as 16-bit words and widened in one instruction (a scalar widening per scale merges
    into a register and chains every conversion to the one before)."""
    assert len(offsets) <= 8
    vec = ir.Constant(ir.VectorType(_I16, 8), [0] * 8)
    for lane, off in enumerate(offsets):
        ptr = builder.bitcast(builder.gep(base, [builder.add(o, ir.Constant(ir.IntType(64), off))]), _I16.as_pointer())
        vec = builder.insert_element(vec, builder.load(ptr, align=1), ir.Constant(_I32, lane))
    return half_to_float(builder, vec)


def _e8m0_vector(builder, base, o, offsets):
    """<8 x float>: lane i 2^(e - 128) for the E8M0 byte e at base[o + offsets[i]] (at most 8; the
    other lanes 0), as ggml_e8m0_to_fp32_half: the float32 whose exponent field is e - 1 (e >= 2),
    the subnormals 2^-128 and 2^-127 for e = 0 and 1 (tables.E8M0_HALF)."""
    assert len(offsets) <= 8
    v8 = ir.VectorType(_I32, 8)
    e = ir.Constant(v8, [0] * 8)
    for lane, off in enumerate(offsets):
        byte = builder.load(builder.gep(base, [builder.add(o, ir.Constant(ir.IntType(64), off))]))
        e = builder.insert_element(e, builder.zext(byte, _I32), ir.Constant(_I32, lane))

    def splat(v):
        return ir.Constant(v8, [v] * 8)
    normal = builder.shl(builder.sub(e, splat(1)), splat(23))
    small = builder.shl(splat(0x00200000), builder.and_(e, splat(1)))
    used = ir.Constant(ir.VectorType(ir.IntType(1), 8), [lane < len(offsets) for lane in range(8)])
    bits = builder.select(builder.icmp_unsigned(">=", e, splat(2)), normal, small)
    return builder.bitcast(builder.select(used, bits, splat(0)), ir.VectorType(_F32, 8))


def _load8(builder, base, off, n):
    """<8 x float>: base[off:off + n] (n <= 8), the other lanes 0 (nothing past n is read)."""
    v = _load(builder, base, off, n, _F32)
    if n == 8:
        return v
    zero = ir.Constant(ir.VectorType(_F32, n), [0.0] * n)
    return builder.shuffle_vector(v, zero, ir.Constant(ir.VectorType(_I32, 8), [i if i < n else n for i in range(8)]))


def _x86(builder, name, ret, *args):
    fn = builder.module.declare_intrinsic(name, (), ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, list(args))


def _concat(builder, parts):
    """The parts (vectors of one width, a power of two; 1, 2 or 4 of them) as one vector."""
    while len(parts) > 1:
        n = parts[0].type.count
        both = ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(parts[i], parts[i + 1], both) for i in range(0, len(parts), 2)]
    return parts[0]


def _abs_sign(builder, w, x):
    """(|w| as unsigned bytes, x with w's sign, 0 where w is 0): w * x = |w| * sign(x, w), which
    lets signed codes take the unsigned-by-signed byte product (<32 x i8> operands)."""
    absolute = _x86(builder, "llvm.abs.v32i8", w.type, w, ir.Constant(ir.IntType(1), 0))    # any target
    if _AVX2:
        return absolute, _x86(builder, "llvm.x86.avx2.psign.b", w.type, x, w)
    if _SSSE3:
        return absolute, _on_128(builder, lambda a, b: _x86(builder, "llvm.x86.ssse3.psign.b.128", a.type, a, b), x, w)
    zero = ir.Constant(w.type, [0] * 32)
    neg = builder.icmp_signed("<", w, zero)
    return absolute, builder.select(neg, builder.sub(zero, x), builder.select(builder.icmp_signed("==", w, zero), zero, x))


def _maddubs(builder, u, s):
    """<16 x i16>: u[2i] * s[2i] + u[2i+1] * s[2i+1], u unsigned and s signed <32 x i8>
    (pmaddubsw; its saturation never happens here: u <= 128, |s| <= 127)."""
    if _AVX2:
        return _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), u, s)
    if _SSSE3:
        return _on_128(builder, lambda a, b: _x86(builder, "llvm.x86.ssse3.pmadd.ub.sw.128", ir.VectorType(_I16, 8), a, b), u, s)
    v32 = ir.VectorType(_I16, 32)
    u16, s16 = builder.zext(u, v32), builder.sext(s, v32)
    if _SSE2:
        # the pairs in 32-bit lanes (pmaddwd, on x86-64's baseline), then narrowed: they fit
        pairs = _on_128(builder, lambda a, b: _x86(builder, "llvm.x86.sse2.pmadd.wd", ir.VectorType(_I32, 4), a, b), u16, s16)
        return builder.trunc(pairs, ir.VectorType(_I16, 16))
    return _pairs(builder, builder.mul(u16, s16), 32)


def _dpbusd(builder, u, s, acc=None):
    """<8 x i32>: lane i = acc[i] + Σ_j<4 u[4i + j] * s[4i + j], u unsigned and s signed <32 x i8>,
    exact in int32 (vpdpbusd: AVX-512 VNNI or AVX-VNNI; only where _VNNI); acc None: 0."""
    v8 = ir.VectorType(_I32, 8)
    return _x86(builder, "llvm.x86.avx512.vpdpbusd.256", v8, ir.Constant(v8, [0] * 8) if acc is None else acc,
                builder.bitcast(u, v8), builder.bitcast(s, v8))


def _pairs(builder, v, n):
    even = ir.Constant(ir.VectorType(_I32, n // 2), list(range(0, n, 2)))
    odd = ir.Constant(ir.VectorType(_I32, n // 2), list(range(1, n, 2)))
    return builder.add(builder.shuffle_vector(v, v, even), builder.shuffle_vector(v, v, odd))


def _madd(builder, p16, s16):
    """<8 x i32>: p16[2i] * s16[2i] + p16[2i+1] * s16[2i+1] (<16 x i16> operands; pmaddwd)."""
    if _AVX2:
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), p16, s16)
    if _SSE2:
        return _on_128(builder, lambda a, b: _x86(builder, "llvm.x86.sse2.pmadd.wd", ir.VectorType(_I32, 4), a, b), p16, s16)
    v32 = ir.VectorType(_I32, 16)
    return _pairs(builder, builder.mul(builder.sext(p16, v32), builder.sext(s16, v32)), 16)


def _small_ints(builder, base, o, specs):
    """<16 x i16>: lane i the value of specs[i] (:class:`Scale`, at most 16, all signed or all
    not), the other lanes 0.  The bytes they read (a span of at most 16) are loaded once and
    spread over the lanes with one shuffle per plane; shifts and masks are per-lane constants."""
    n = len(specs)
    assert n <= 16 and len({sp.signed for sp in specs}) == 1
    ats = [sp.at for sp in specs] + [at for sp in specs for at in (sp.hi_at, sp.neg_at) if at is not None]
    lo, span = min(ats), max(ats) - min(ats) + 1
    assert span <= 16, specs
    v16 = ir.VectorType(_I8, 16)
    raw = _load(builder, base, builder.add(o, ir.Constant(ir.IntType(64), lo)), span, _I8)
    if span < 16:
        raw = builder.shuffle_vector(raw, ir.Constant(ir.VectorType(_I8, span), [0] * span),
                                     ir.Constant(ir.VectorType(_I32, 16), list(range(span)) + [span] * (16 - span)))

    def lanes(values, fill=0):
        return ir.Constant(v16, list(values) + [fill] * (16 - n))

    def pick(idx):
        return builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 16), list(idx) + [0] * (16 - n)))
    vals = pick(sp.at - lo for sp in specs)
    if not specs[0].signed:
        vals = builder.and_(builder.lshr(vals, lanes(sp.shift for sp in specs)), lanes(sp.mask for sp in specs))
        if any(sp.hi_at is not None for sp in specs):
            high = pick((sp.hi_at if sp.hi_at is not None else sp.at) - lo for sp in specs)
            high = builder.and_(builder.lshr(high, lanes(sp.hi_shift for sp in specs)),
                                lanes(sp.hi_mask if sp.hi_at is not None else 0 for sp in specs))
            vals = builder.or_(vals, builder.shl(high, lanes(sp.hi_pos if sp.hi_at is not None else 0 for sp in specs)))
    w16 = ir.VectorType(_I16, 16)
    wide = builder.sext(vals, w16) if specs[0].signed else builder.zext(vals, w16)
    if any(sp.bias for sp in specs):
        wide = builder.sub(wide, ir.Constant(w16, [sp.bias for sp in specs] + [0] * (16 - n)))
    if any(sp.odd for sp in specs):
        odd = ir.Constant(w16, [int(sp.odd) for sp in specs] + [0] * (16 - n))
        wide = builder.add(builder.shl(wide, odd), odd)                  # 2 v + 1
    if any(sp.neg_at is not None for sp in specs):
        signs = pick((sp.neg_at if sp.neg_at is not None else sp.at) - lo for sp in specs)
        bits = lanes(1 << sp.neg_bit if sp.neg_at is not None else 0 for sp in specs)
        neg = builder.icmp_unsigned("!=", builder.and_(signs, bits), ir.Constant(v16, [0] * 16))
        wide = builder.select(neg, builder.sub(ir.Constant(w16, [0] * 16), wide), wide)
    return wide


def _lane_sums(builder, vs):
    """<8 x i32>: lane g = the sum of the 8 lanes of vs[g] (at most 8 vectors <8 x i32>, the
    missing ones 0).  Three rounds of interleaving within 128-bit halves and adding (x86:
    unpack, unpack, add), then the two halves added: 21 instructions for 8 vectors.

        round 1  a, b  ->  a0+a2 b0+b2 a1+a3 b1+b3 | a4+a6 b4+b6 a5+a7 b5+b7   "a b a b | a b a b"
        round 2        ->  a b c d | a b c d  (each lane half of its vector's sum)
        round 3        ->  a b c d e f g h    (the low halves of abcd, efgh plus their high halves)"""
    v8 = ir.VectorType(_I32, 8)
    vs = list(vs) + [ir.Constant(v8, [0] * 8)] * (8 - len(vs))

    def mix(a, b, lo, hi):
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(v8, lo)),
                           builder.shuffle_vector(a, b, ir.Constant(v8, hi)))
    pairs = [mix(vs[i], vs[i + 1], [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]) for i in range(0, 8, 2)]
    quads = [mix(pairs[i], pairs[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]) for i in (0, 2)]
    return mix(quads[0], quads[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _groups(runs):
    """{32-value group: [(k, run), ...] in value order}; each group's runs tile its 32 values."""
    groups = {}
    for k, r in enumerate(runs):
        groups.setdefault(r.xoff // 32, []).append((k, r))
    for g, members in groups.items():
        members.sort(key=lambda kr: kr[1].xoff)
        assert [r.xoff for _, r in members] == [32 * g + sum(r.n for _, r in members[:i]) for i in range(len(members))]
        assert sum(r.n for _, r in members) == 32 and len({r.n for _, r in members}) == 1, members
        assert len({r.d_at for _, r in members}) == 1 and len({r.m_at for _, r in members}) == 1, members
    return dict(sorted(groups.items()))


def _paired(members, table, sup):
    """A group of two 16-value grid runs whose grid choices are adjacent bits of one byte (or that
    have none): its codes go through one 32-byte lookup (vpshufb looks up each 16-byte half in
    its own table) in a table picked by those two bits."""
    if not table or len(members) != 2 or any(r.n != 16 or _max_code(r) >= 16 for _, r in members):
        return False
    if sup is None or not sup.grid:
        return True
    (at0, b0), (at1, b1) = (sup.grid[k] for k, _ in members)
    return at0 == at1 and b1 == b0 + 1


def _max_code(r):
    """The largest code a run's bits can form."""
    high = (r.hmask << r.hpos) if r.hoff is not None else (1 << r.hpos) if r.hword is not None else 0
    return (r.mask or 0) | high


def _folds_bias(r):
    """A run whose bias is taken out after the products, as -bias * d * Σx of its 32-group (a
    float16 scale per 32-value block: the legacy types), keeping its codes unsigned."""
    return r.bias != 0 and r.d_at is not None and r.shift is not None


def _group_codes(chunk, members, pair_tables):
    """(<32 x i8> codes of one 32-value group, whether they are signed): the group's runs
    ``members`` unpacked from the chunk (a :class:`_Chunk`) and joined (``pair_tables``: what
    chunk.pair_tables() made).  chunk_dot and dot_batch.chunk_dot_batch both unpack with it: the
    same codes for both."""
    builder, base, o_v, tb, c = chunk.builder, chunk.base, chunk.o, chunk.tab, chunk.c
    table, sup, grid_bits = chunk.table, chunk.sup, chunk.grid_bits
    if _gfni_group(members, table):
        w = _gfni_codes(chunk, members)
        bias = [r.bias if r.bias and not _folds_bias(r) else 0 for _, r in members for _ in range(r.n)]
        if any(bias):
            return builder.sub(w, ir.Constant(w.type, bias)), True
        return w, False
    pieces, signed = [], False
    paired = _paired(members, table, sup)
    for k, r in members:
        n = r.n
        v8 = ir.VectorType(_I8, n)

        def b8(v):
            return ir.Constant(v8, [v] * n)
        at = builder.add(o_v, c(r.off))
        if r.shift is None:
            code, signed = _load(builder, base, at, n, _I8), True
        elif r.split:
            # a block of 16 bytes holds 32 codes: low nibbles first, then the high ones
            h8 = ir.VectorType(_I8, n // 2)
            raw = _load(builder, base, at, n // 2, _I8)
            if _GFNI and n == 32:
                # the 16 bytes in both halves, low nibbles of the first, high of the second
                # picked by one vgf2p8affineqb (a bit matrix per 8 bytes)
                twice = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
                code = _affine(builder, twice, [_bit_matrix(0, 15, 0)] * 2 + [_bit_matrix(4, 15, 0)] * 2)
            elif _AVX2 and n == 32:
                twice = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
                q4 = ir.VectorType(ir.IntType(64), 4)
                both = builder.bitcast(builder.lshr(builder.bitcast(twice, q4), ir.Constant(q4, [0, 0, 4, 4])), v8)
                code = builder.and_(both, b8(15))
            else:
                both = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(h8, [4] * (n // 2))),
                                              ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                code = builder.and_(both, b8(15))
        else:
            # bytes all the way: the shifts are constants here, which x86 does on bytes
            # as a 16-bit shift and a mask; codes fit in int8
            code = builder.and_(builder.lshr(_load(builder, base, at, n, _I8), b8(r.shift)), b8(r.mask))
        if r.shift is not None:
            if r.hoff is not None:
                high = _load(builder, base, builder.add(o_v, c(r.hoff)), n, _I8)
                high = builder.and_(builder.lshr(high, b8(r.hshift)), b8(r.hmask))
                code = builder.or_(code, builder.shl(high, b8(r.hpos)))
            if r.hword is not None and _AVX512BW:
                word = builder.load(builder.bitcast(builder.gep(base, [builder.add(o_v, c(r.hword))]), _I32.as_pointer()), align=1)
                if r.hbase:
                    word = builder.lshr(word, ir.Constant(_I32, r.hbase))
                bits = builder.bitcast(_as(builder, word, ir.IntType(n)), ir.VectorType(ir.IntType(1), n))
                code = builder.or_(code, builder.select(bits, b8(1 << r.hpos), b8(0)))
            elif r.hword is not None:
                # bit hbase + j of the word, in byte lane j: spread the word's bytes over
                # the lanes (byte (hbase + j) // 8 to lane j), test one bit per lane
                word = _load(builder, base, builder.add(o_v, c(r.hword)), 4, _I8)
                spread = builder.shuffle_vector(word, word, ir.Constant(ir.VectorType(_I32, n),
                                                                        [(r.hbase + j) // 8 for j in range(n)]))
                bit = ir.Constant(v8, [1 << ((r.hbase + j) % 8) for j in range(n)])
                hit = builder.icmp_unsigned("!=", builder.and_(spread, bit), b8(0))
                code = builder.or_(code, builder.select(hit, b8(1 << r.hpos), b8(0)))
            if paired:
                pass                        # looked up below, with the other run
            elif table:
                window = c(0)
                if sup is not None and sup.grid:
                    window = builder.mul(grid_bits(k, 1), c(sup.grid_step))
                # 16 grid entries per lookup: with 5- or 6-bit codes every 16-entry
                # part is looked up and bits 4 (and 5) of the code pick
                low = builder.and_(code, b8(15)) if _max_code(r) >= 16 else code
                parts = [_lookup(builder, _load(builder, tb, builder.add(window, c(16 * i)), 16, _I8), low, n)
                         for i in range(_max_code(r) // 16 + 1)]
                bit = 16
                while len(parts) > 1:
                    upper = builder.icmp_unsigned("!=", builder.and_(code, b8(bit)), b8(0))
                    parts = [builder.select(upper, parts[i + 1], parts[i]) for i in range(0, len(parts), 2)]
                    bit *= 2
                code, signed = parts[0], True
            elif r.bias and not _folds_bias(r):
                code, signed = builder.sub(code, b8(r.bias)), True
        pieces.append(code)
    w = _concat(builder, pieces)
    if paired:
        pick = c(0)
        if sup is not None and sup.grid:
            pick = grid_bits(members[0][0], 3)
        w, signed = _pshufb(builder, builder.load(builder.gep(pair_tables, [c(0), pick])), w), True
    return w, signed


def _bit_matrix(shift, mask, pos):
    """The 64-bit matrix of vgf2p8affineqb that maps a byte b to ((b >> shift) & mask) << pos:
    output bit i is input bit i - pos + shift where bit i - pos of mask is set (matrix byte 7 - i
    holds the input bits of output bit i)."""
    m = 0
    for i in range(8):
        j = i - pos
        if 0 <= j < 8 and (mask >> j) & 1 and j + shift < 8:
            m |= (1 << (j + shift)) << (8 * (7 - i))
    return m


def _gfni_group(members, table) -> bool:
    """Whether a group's runs are plain byte runs that _gfni_codes unpacks: each n bytes, a code
    (byte >> shift) & mask with maybe a plane of high bits (all or none), no grid, no split
    nibbles, no high bit words, runs of 8, 16 or 32 codes."""
    return (_GFNI and not table and len({r.hoff is None for _, r in members}) == 1
            and all(r.shift is not None and not r.split and r.hword is None and r.n in (8, 16, 32) for _, r in members))


def _gfni_bytes(builder, chunk, pieces):
    """<32 x i8>: the bytes at o + off for each (off, n) of pieces, in order (n bytes each: 32 in
    all); adjacent pieces are loaded as one, equal pieces once (LLVM broadcasts them)."""
    merged = []
    for off, n in pieces:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    if len({n for _, n in merged}) != 1:                # pieces of different lengths: one per run
        merged = list(pieces)
    loads = [_load(builder, chunk.base, builder.add(chunk.o, chunk.c(off)), n, _I8) for off, n in merged]
    return _concat(builder, loads)


def _affine(builder, v, qwords):
    """<32 x i8> v with the bit matrix qwords[i] (:func:`_bit_matrix`) applied to each byte of
    its 8 bytes 8 i..8 i + 7 (vgf2p8affineqb; only where _GFNI)."""
    m = ir.Constant(ir.VectorType(_I8, 32), [(q >> (8 * j)) & 0xFF for q in qwords for j in range(8)])
    return _x86(builder, "llvm.x86.vgf2p8affineqb.256", v.type, v, m, ir.Constant(_I8, 0))


def _gfni_codes(chunk, members):
    """<32 x i8> codes of a group of plain byte runs (_gfni_group): the low bits of every run
    gathered into one vector and shifted and masked by one vgf2p8affineqb (a bit matrix per 8
    bytes, each run's own), the high bits likewise, moved to hpos, or-ed in."""
    builder = chunk.builder

    def matrices(spec):
        return [spec(r) for _, r in members for _ in range(r.n // 8)]
    low = _affine(builder, _gfni_bytes(builder, chunk, [(r.off, r.n) for _, r in members]),
                  matrices(lambda r: _bit_matrix(r.shift, r.mask, 0)))
    if members[0][1].hoff is None:
        return low
    high = _affine(builder, _gfni_bytes(builder, chunk, [(r.hoff, r.n) for _, r in members]),
                   matrices(lambda r: _bit_matrix(r.hshift, r.hmask, r.hpos)))
    return builder.or_(low, high)


def _chunk_runs(runs, sup, e8m0):
    """(the runs as :class:`Run` records, their 32-value groups) of a chunk_dot or
    chunk_dot_batch: a legacy chunk's runs each with its block's scale (d_at), a super-block's
    with an integer scale each (``sup``), E8M0 scales only for legacy runs without mins."""
    runs = tuple(Run(*r) for r in runs)
    groups = _groups(runs)
    assert (sup is None) == all(r.d_at is not None for r in runs)
    assert sup is None or len(sup.scales) == len(runs)
    assert not e8m0 or (sup is None and all(r.m_at is None for r in runs))
    return runs, groups


class _Chunk:
    """The reads of one chunk's kernel that do not depend on the activations, shared by chunk_dot
    and dot_batch.chunk_dot_batch (and dot_tiles.unpack_chunk) so that all read a chunk the same
    way: the data pointers of the kernel's first six arguments (a, o, tab, xq, xd, xsum: ``base``,
    ``o``, ``tab``, ``xq``, ``xd``, ``xsum``; the first three alone with ``activations=False``) and
    one method per part of the chunk, each emitting its loads where it is
    called (chunk_dot interleaves them with its float work; the batch's kernel calls them all
    before its token loop).  ``groups``: the chunk's 32-value groups (:func:`_groups`), lane g of
    the 8-lane float vectors below being group g."""

    def __init__(self, context, builder, sig, args, groups, table, sup, e8m0, activations=True):
        self.builder, self.groups, self.table, self.sup, self.e8m0 = builder, groups, table, sup, e8m0
        a_v, self.o, tab_v = args[:3]
        self.base = _data(context, builder, sig.args[0], a_v)
        self.tab = _data(context, builder, sig.args[2], tab_v)
        # a kernel that reads the chunk alone (dot_tiles.unpack_chunk) has no activation arguments
        self.xq = self.xd = self.xsum = None
        if activations:
            self.xq = _data(context, builder, sig.args[3], args[3])
            self.xd = _data(context, builder, sig.args[4], args[4])
            self.xsum = _data(context, builder, sig.args[5], args[5])
        self.n_groups = len(groups)
        assert list(groups) == list(range(self.n_groups)) and self.n_groups <= 8
        self.firsts = [members[0][1] for members in groups.values()]

    @staticmethod
    def c(v):
        """An i64 constant."""
        return ir.Constant(ir.IntType(64), v)

    def half(self, at):
        """The float16 at byte o + at, as a float."""
        b = self.builder
        ptr = b.bitcast(b.gep(self.base, [b.add(self.o, self.c(at))]), ir.HalfType().as_pointer())
        return half_to_float(b, b.load(ptr, align=1))

    def grid_bits(self, k, mask):
        """Run k's grid bit (mask 1), or with the next run's above it (mask 3)."""
        b, c = self.builder, self.c
        at, bit = self.sup.grid[k]
        byte = b.zext(b.load(b.gep(self.base, [b.add(self.o, c(at))])), ir.IntType(64))
        return b.and_(b.lshr(byte, c(bit)), c(mask))

    def scales(self):
        """(d_vec, run_scales): lane g group g's float scale (its block's float16 or E8M0 byte; a
        super-block's d, 1.0 where it has none), and a super-block's integer run scales
        (<16 x i32>; None for blocks)."""
        b, sup = self.builder, self.sup
        if sup is None:
            read = _e8m0_vector if self.e8m0 else _half_vector
            return read(b, self.base, self.o, [r.d_at for r in self.firsts]), None
        d = ir.Constant(_F32, 1.0) if sup.d_at is None else self.half(sup.d_at)
        return _splat(b, d, 8), _small_ints(b, self.base, self.o, sup.scales)

    def bias_coef(self, d_vec):
        """Lane g: what group g's products leave out per unit of its Σx, -bias * d_g (a folded
        bias) + m_g (a float16 min); None where no group has either."""
        b, firsts = self.builder, self.firsts
        if not any(_folds_bias(r) or r.m_at is not None for r in firsts):
            return None
        bias = ir.Constant(ir.VectorType(_F32, 8),
                           [-float(r.bias) if _folds_bias(r) else 0.0 for r in firsts] + [0.0] * (8 - self.n_groups))
        coef = b.fmul(d_vec, bias)
        if firsts[0].m_at is not None:
            coef = b.fadd(coef, _half_vector(b, self.base, self.o, [r.m_at for r in firsts]))
        return coef

    def mins(self):
        """A super-block's mins m_g as float lanes (None where it has none)."""
        if self.sup is None or not self.sup.mins:
            return None
        b = self.builder
        m16 = _small_ints(b, self.base, self.o, self.sup.mins)
        return b.sitofp(b.shuffle_vector(m16, m16, ir.Constant(ir.VectorType(_I32, 8), list(range(8)))),
                        ir.VectorType(_F32, 8))

    def neg_dmin(self):
        """- dmin, the super-block's float16 scale of its mins."""
        return self.builder.fsub(ir.Constant(_F32, 0.0), self.half(self.sup.dmin_at))

    def pair_tables(self):
        """The 4 pair tables [window(bit a) | window(bit b)] of a paired group, on the stack; None
        where no group is paired."""
        b, c, sup = self.builder, self.c, self.sup
        if not any(_paired(m, self.table, sup) for m in self.groups.values()):
            return None
        v32 = ir.VectorType(_I8, 32)
        t16 = [_load(b, self.tab, c(0), 16, _I8)]
        if sup is not None and sup.grid:
            t16.append(_load(b, self.tab, c(sup.grid_step), 16, _I8))
        both = ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
        tables = cgutils.alloca_once(b, ir.ArrayType(v32, 4))
        for p in range(4):
            lo, hi = t16[(p & 1) % len(t16)], t16[(p >> 1) % len(t16)]
            b.store(b.shuffle_vector(lo, hi, both), b.gep(tables, [c(0), c(p)]))
        return tables

    def run_mins(self):
        """A super-block's integer run mins (<16 x i32>; None where it has none)."""
        if self.sup is None or not self.sup.run_mins:
            return None
        return _small_ints(self.builder, self.base, self.o, self.sup.run_mins)


def chunk_dot(runs, table=False, sup=None, e8m0=False):
    """``dot(a, o, tab, xq, xd, xsum, xo)`` = Σ_k Σ_j value_kj * x_(xo + xoff_k + j) over the static
    ``runs`` (:class:`Run`) of a chunk starting at byte o of a and value xo of x (xo a multiple of
    32), where

        value = scale_k * code (+ min_k)      scale_k the float16 at the run's d_at (legacy
                                              blocks), or d * s_k with the super-block's float16
                                              d and its integer run scale s_k (``sup``: Super;
                                              its mins: - dmin * m_g)
        x_i   = xq[i] * xd[i // 32]           the activations as int8 codes and a scale per 32,
                                              as ggml's q8_0 rounds them; xsum[i // 32] = xd * Σ xq
                                              over the 32

    With ``table`` a code is the int8 tab[window_k + code], a 16-entry window of the grid (moved
    by the super-block's grid bits).  With ``e8m0`` a legacy run's scale at d_at is an E8M0 byte,
    2^(e - 128) (MXFP4), not a float16.

    The runs of each 32 values (one of 32, two of 16 or four of 8) are multiplied together: their
    codes as one vector of 32 bytes times the 32 activation bytes, added in pairs into 16-bit lanes
    (pmaddubsw), then in pairs into 32-bit lanes times the runs' integer scales, or times 1
    (pmaddwd).  pmaddubsw takes unsigned codes: signed ones (int8, grid values, codes minus a
    bias) go as |code| times the activation with the code's sign; a legacy block's bias is taken
    out afterwards instead (-bias * d * xsum).  The groups' sums then meet in one vector, which is
    converted once and scaled by d_g * xd_g.  Bytes, scales and activations are read at offsets
    fixed when the kernel is compiled: a chunk is straight-line vector code."""
    runs, groups = _chunk_runs(runs, sup, e8m0)

    @intrinsic
    def dot(typingctx, a, o, tab, xq, xd, xsum, xo):
        def codegen(context, builder, sig, args):
            ch = _Chunk(context, builder, sig, args, groups, table, sup, e8m0)
            c, n_groups, xo_v = ch.c, ch.n_groups, args[6]
            vf8 = ir.VectorType(_F32, 8)
            xblock = builder.lshr(xo_v, c(5))
            # per 32-group g (lane g): its scale (the block's float16, or the super-block's d)
            # times xd, and what the products leave out, times xsum: a folded bias, a min
            d_vec, run_scales = ch.scales()
            group_scales = builder.fmul(d_vec, _load8(builder, ch.xd, xblock, n_groups))
            left_out = None
            coef = ch.bias_coef(d_vec)
            if coef is not None:
                left_out = builder.fmul(coef, _load8(builder, ch.xsum, xblock, n_groups))
            m8 = ch.mins()
            if m8 is not None:
                # - dmin * m_g * xsum_g
                dmin = ch.neg_dmin()
                left_out = builder.fmul(builder.fmul(m8, _load8(builder, ch.xsum, xblock, n_groups)), _splat(builder, dmin, 8))
            ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
            isums, msums = [], []
            pair_tables = ch.pair_tables()
            run_mins = ch.run_mins()
            for g, members in groups.items():
                w, signed = _group_codes(ch, members, pair_tables)
                x = _load(builder, ch.xq, builder.add(xo_v, c(32 * g)), 32, _I8)
                u, s = _abs_sign(builder, w, x) if signed else (w, x)
                r0 = members[0][1]
                if r0.d_at is None:
                    # the runs' integer scales, each over the 16-bit lanes of its values
                    lanes = 16 // len(members)
                    lane_runs = ir.Constant(ir.VectorType(_I32, 16), [members[j // lanes][0] for j in range(16)])
                    isum = _madd(builder, _maddubs(builder, u, s), builder.shuffle_vector(run_scales, run_scales, lane_runs))
                    if sup.run_mins:
                        # Σx over each run (bytes times 1, in pairs) times the run's min
                        xpairs = _maddubs(builder, ir.Constant(ir.VectorType(_I8, 32), [1] * 32), x)
                        msums.append(_madd(builder, xpairs, builder.shuffle_vector(run_mins, run_mins, lane_runs)))
                elif _VNNI:
                    isum = _dpbusd(builder, u, s)
                else:
                    isum = _madd(builder, _maddubs(builder, u, s), ones)
                isums.append(isum)
            if msums:
                # - dmin * xd_g * Σ_k m_k Σx over run k, per group
                dmin = _splat(builder, ch.neg_dmin(), 8)
                run_left = builder.fmul(builder.fmul(builder.sitofp(_lane_sums(builder, msums), vf8),
                                                     _load8(builder, ch.xd, xblock, n_groups)), dmin)
                left_out = run_left if left_out is None else builder.fadd(left_out, run_left)
            # lane g: group g's sum; one conversion and one multiply-add for the chunk
            total = builder.sitofp(_lane_sums(builder, isums), vf8)
            acc = builder.fmul(total, group_scales) if left_out is None else _fma(builder, total, group_scales, left_out)
            return builder.extract_element(_fold(builder, acc, 8, 1), ir.Constant(_I32, 0))
        return nbt.float32(a, o, tab, xq, xd, xsum, xo), codegen
    dot.runs, dot.table, dot.sup, dot.e8m0 = runs, table, sup, e8m0     # for the twin in tests/runtime_twins.py
    return dot


# ---- float16 rows of a 3-D array (the KV cache): a[i, h, d:d + n], contiguous in d ----

def _half_ptr(context, builder, arytype, value, i, h, d, n):
    """Pointer to a[i, h, d] as <n x half>*, a a 3-D 2-byte array (strides in bytes)."""
    ary = context.make_array(arytype)(context, builder, value)
    s0, s1, s2 = cgutils.unpack_tuple(builder, ary.strides, 3)
    byte = builder.add(builder.add(builder.mul(i, s0), builder.mul(h, s1)), builder.mul(d, s2))
    ptr = builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [byte])
    return builder.bitcast(ptr, ir.VectorType(ir.HalfType(), n).as_pointer())


@intrinsic
def half_bits(typingctx, u):
    """The float16 whose bits are the uint16 u, as float32."""
    def codegen(context, builder, sig, args):
        return half_to_float(builder, _as(builder, args[0], ir.IntType(16)))
    return nbt.float32(u), codegen



@intrinsic
def codes_dot32(typingctx, w, wo, sg, so, sc, sco, xq, xo):
    """Σ_j ±w[wo + j] * xq[xo + j] * sc[sco + j // 16] over j < 32, exact in int32: 32 int8 codes
    at byte wo of w (any array: its bytes), negated where bit j % 8 of the byte sg[so + j // 8] is
    set (the i-quants' sign bits), their int16 scales per 16 values and 32 int8 activations; the
    byte products added in pairs (pmaddubsw), then in pairs times the scales (pmaddwd), as
    chunk_dot does (runtime/code_dots.py unpacks the blocks it cannot describe into such codes)."""
    def codegen(context, builder, sig, args):
        w_v, wo_v, sg_v, so_v, sc_v, sco_v, xq_v, xo_v = args
        i64 = ir.IntType(64)
        v32 = ir.VectorType(_I8, 32)
        wbase = builder.bitcast(_data(context, builder, sig.args[0], w_v), _I8.as_pointer())
        codes = _load(builder, wbase, _as(builder, wo_v, i64), 32, _I8)
        x = _load(builder, _data(context, builder, sig.args[6], xq_v), _as(builder, xo_v, i64), 32, _I8)
        signs = _load(builder, _data(context, builder, sig.args[2], sg_v), _as(builder, so_v, i64), 4, _I8)
        spread = builder.shuffle_vector(signs, signs, ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
        neg = builder.icmp_unsigned("!=", builder.and_(spread, ir.Constant(v32, [1 << (j % 8) for j in range(32)])),
                                    ir.Constant(v32, [0] * 32))
        x = builder.select(neg, builder.sub(ir.Constant(v32, [0] * 32), x), x)      # |x| <= 127: round_q8
        two = _load(builder, _data(context, builder, sig.args[4], sc_v), _as(builder, sco_v, i64), 2, _I16)
        scales = builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8))
        u, s = _abs_sign(builder, codes, x)
        return builder.extract_element(_fold(builder, _madd(builder, _maddubs(builder, u, s), scales), 8, 1),
                                       ir.Constant(_I32, 0))
    return nbt.int32(w, wo, sg, so, sc, sco, xq, xo), codegen

