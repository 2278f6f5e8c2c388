"""Block dots of the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S with sign bits; IQ1_S,
IQ1_M with signed grid points), written as LLVM vector IR (numba intrinsics) for
runtime/code_dots.py: one call multiplies two whole blocks of 256 values (or a row's odd last
one) with the activations rounded to 8 bits per 32 (matvec.round_q8).

A block's 256 values are 64 grid points of 4 values (uint32 grids) or 32 of 8 (uint64 grids),
with an odd integer scale per 16 or 32 values.  Per block, in vectors:

    indices     the points' grid indices, all of them at once (bytes widened to 32-bit lanes,
                high bits from their own bytes, tested bit by bit per lane)
    points      gathered from the grid (llvm.masked.gather: vpgatherdd / vpgatherdq where the
                target has them and LLVM deems them fast, loads one by one elsewhere: the same
                bytes); IQ1: 8 times the point's values (-1, 0, 1) plus its delta, +-1
    signs       a 32-bit word per 32 values, bit j negating value j (an AVX-512 mask register):
                stored whole (IQ2_S, IQ3_S), or 4 x 7 bits whose 8th is their byte's parity
                (ksigns_iq2xs, computed on 8 words: the same bytes); IQ1's points carry their sign
    group sum   Σ_j |g_j| * (±xq_j) in pairs (pmaddubsw), then in pairs times the scales per 16
                or 1 (pmaddwd), per 32 values; the 8 groups' lanes added into one vector
                (dot._lane_sums), times the scales per 32
    float       acc = Σ_g float(sum_g) * xd_g, added in group order from 0; the row's sum
                s = s + (d * factor) * acc, block after block

The float part is code_dots' former loop's, step by step (each product rounded, then added in
the same order: the same bits as the grid_dot32 / fill + codes_dot32 paths it replaces); the
integer sums are exact, however they are added.  Each scalar read of the former path went
through numba's index wrap-around checks (a select per byte): an IQ3_S block cost ~350 cycles
(1 GB/s), ~75 now, most of it the 64 gathered loads (without them ~25: measured on Zen 4).  Two
blocks a call give the core a second, independent chain to run while one waits (4-12%).

On targets without AVX2 / SSSE3 the products take dot.py's fallbacks (the same integers), so
NUMBA_CPU_NAME=generic gives the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

from ..cpu import half_to_float
from .dot import _I8, _I16, _I32, _F32, _abs_sign, _as, _data, _lane_sums, _load, _madd, _maddubs

_I64 = ir.IntType(64)


def _c(v, t=_I64):
    return ir.Constant(t, v)


def _vec(t, values):
    return ir.Constant(ir.VectorType(t, len(values)), list(values))


def _shuffle(builder, v, lanes):
    """v's lanes in the order ``lanes`` (a new vector of len(lanes) lanes)."""
    return builder.shuffle_vector(v, v, _vec(_I32, lanes))


def _bytes(builder, base, at, n):
    """<n x i8> at byte ``at`` (a constant offset) of base."""
    return _load(builder, base, _c(at), n, _I8)


def _words(builder, base, at, n, t):
    """<n x t> (t i16 / i32) at byte ``at`` of base, unaligned."""
    return _load(builder, builder.bitcast(builder.gep(base, [_c(at)]), t.as_pointer()), _c(0), n, t)


def _bit_lanes(builder, v, bits, t):
    """<n x t>: lane j is 1 where bit bits[j] of v[j] is set, else 0 (v a <n x t> vector)."""
    n = v.type.count
    return builder.and_(builder.lshr(v, _vec(t, bits)), _vec(t, [1] * n))


def _gather(builder, grid, idx, elt):
    """<n x elt>: grid[idx[j]] for the <n x i32> indices idx, grid an elt* (llvm.masked.gather,
    all lanes on: LLVM lowers it to the target's gather instruction, or to loads one by one)."""
    n = idx.type.count
    ptrs = builder.gep(grid, [idx], source_etype=elt)
    ptrs.type = ir.VectorType(grid.type, n)         # a vector GEP: llvmlite types it as a scalar one
    vt = ir.VectorType(elt, n)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vt, [ptrs.type, _I32, ir.VectorType(ir.IntType(1), n), vt]),
        f"llvm.masked.gather.v{n}i{elt.width}.v{n}p0")
    return builder.call(fn, [ptrs, _c(elt.width // 8, _I32), _vec(ir.IntType(1), [1] * n), ir.Constant(vt, [0] * n)])


def _parity_words(builder, w):
    """Sign words (<8 x i32>) from 4 7-bit fields per word, one per byte (bit 7 clear): each
    byte's parity set as its bit 7 (ksigns_iq2xs: the 8th sign makes each byte's count of set bits
    even).  Shifts right by 4, 2, 1 bring into bit 0 of a byte only bits of that byte."""
    def splat(v):
        return _vec(_I32, [v] * 8)
    p = builder.xor(w, builder.lshr(w, splat(4)))
    p = builder.xor(p, builder.lshr(p, splat(2)))
    p = builder.xor(p, builder.lshr(p, splat(1)))
    return builder.or_(w, builder.shl(builder.and_(p, splat(0x01010101)), splat(7)))


def _odd(builder, v):
    """2 v + 1, lane by lane."""
    n = v.type.count
    t = v.type.element
    return builder.add(builder.shl(v, _vec(t, [1] * n)), _vec(t, [1] * n))


def _block_sums(builder, blocks, xq, xd):
    """For each block (codes, signs, scales, x0) of ``blocks``: Σ_g float(Σ_(j in group g) ±codes_j *
    xq[x0 + 32 g + j] * scale) * xd[x0 / 32 + g], added in group order from 0; codes <256 x i8>:
    magnitudes below 128 with signs <8 x i32> (bit j of lane g negates value 32 g + j), or signed
    codes (signs None; |code| < 128); scales <8 x i32> (one per 32 values) or <16 x i16> (one per
    16).  The blocks' work is emitted interleaved, group by group: a block's own chain (gathered
    points, products, lane sums, 8 float additions in order) is long, and the other block's
    instructions fill its waits."""
    v32 = ir.VectorType(_I8, 32)
    zero = ir.Constant(v32, [0] * 32)
    ones = _vec(_I16, [1] * 16)
    isums = [[] for _ in blocks]
    for g in range(8):
        for k, (codes, signs, scales, x0) in enumerate(blocks):
            w = _shuffle(builder, codes, range(32 * g, 32 * g + 32))
            x = _load(builder, xq, builder.add(x0, _c(32 * g)), 32, _I8)
            if signs is None:
                w, x = _abs_sign(builder, w, x)
            else:
                # the 32 sign bits as a mask (a k-register move with AVX-512, a compare elsewhere)
                neg = builder.bitcast(builder.extract_element(signs, _c(g, _I32)), ir.VectorType(ir.IntType(1), 32))
                x = builder.select(neg, builder.sub(zero, x), x)            # |x| <= 127: round_q8
            sc = ones if scales.type.element == _I32 else _shuffle(builder, scales, [2 * g] * 8 + [2 * g + 1] * 8)
            isums[k].append(_madd(builder, _maddubs(builder, w, x), sc))
    vf8 = ir.VectorType(_F32, 8)
    prods = []
    for k, (codes, signs, scales, x0) in enumerate(blocks):
        isum = _lane_sums(builder, isums[k])
        if scales.type.element == _I32:
            isum = builder.mul(isum, scales)
        xdv = _load(builder, xd, builder.lshr(x0, _c(5)), 8, _F32)
        prods.append(builder.fmul(builder.sitofp(isum, vf8), xdv))
    accs = [ir.Constant(_F32, 0.0)] * len(blocks)
    for g in range(8):
        accs = [builder.fadd(acc, builder.extract_element(prod, _c(g, _I32))) for acc, prod in zip(accs, prods)]
    return accs


@dataclass
class Unpacked:
    """What a type's unpack reads of a block (IR values)."""
    idx: ir.Value                   # <256 / width x i32>: the points' grid indices
    signs: ir.Value | None          # <8 x i32>: a sign bit per value (None: the grid is signed)
    scales: ir.Value                # <8 x i32> integer scales per 32 values, or <16 x i16> per 16
    d: ir.Value | None = None       # the block's float16 bits (i16), where not at byte 0
    deltas: ir.Value | None = None  # IQ1: <256 / width x i8> added to 8 times each point's codes


def _grid_blocks(unpack, width, factor, block_bytes, n):
    """The intrinsic ``dot(b, o, grid, xq, xd, x0, s)`` -> float32: s + r_0 + ... + r_(n-1), added in
    that order, r_k the block at byte o + k block_bytes of b · the rounded activations xq * xd
    from value x0 + 256 k on: (d * factor) * acc (:func:`_block_sums`), d the block's float16;
    ``unpack(builder, base)`` gives a block's :class:`Unpacked`, the grid's points are ``width``
    bytes each.  All n blocks' indices are unpacked and their points gathered first."""
    elt = ir.IntType(8 * width)
    assert (256 // width) * width == 256

    @intrinsic
    def dot(typingctx, b, o, grid, xq, xd, x0, s):
        def codegen(context, builder, sig, args):
            b_v, o_v, grid_v, xq_v, xd_v, x0_v, s_v = args
            data = _data(context, builder, sig.args[0], b_v)
            grid = builder.bitcast(_data(context, builder, sig.args[2], grid_v), elt.as_pointer())
            blocks, ds = [], []
            for k in range(n):
                base = builder.gep(data, [builder.add(_as(builder, o_v, _I64), _c(block_bytes * k))])
                u = unpack(builder, base)
                codes = builder.bitcast(_gather(builder, grid, u.idx, elt), ir.VectorType(_I8, 256))
                if u.deltas is not None:
                    spread = _shuffle(builder, u.deltas, [j // width for j in range(256)])
                    codes = builder.add(builder.shl(codes, _vec(_I8, [3] * 256)), spread)
                blocks.append((codes, u.signs, u.scales, builder.add(_as(builder, x0_v, _I64), _c(256 * k))))
                bits = u.d if u.d is not None else builder.load(builder.bitcast(base, _I16.as_pointer()), align=1)
                d = half_to_float(builder, bits)
                ds.append(builder.fmul(d, ir.Constant(_F32, factor)) if factor != 1 else d)
            accs = _block_sums(builder, blocks, _data(context, builder, sig.args[3], xq_v),
                               _data(context, builder, sig.args[4], xd_v))
            total = s_v
            for d, acc in zip(ds, accs):
                total = builder.fadd(total, builder.fmul(d, acc))
            return total
        return nbt.float32(b, o, grid, xq, xd, x0, s), codegen
    return dot


def _nibbles16(builder, raw8):
    """<16 x i16>: 2 n + 1 for the low then the high nibble of each of 8 bytes (scales per 16)."""
    v = builder.zext(_shuffle(builder, raw8, [i // 2 for i in range(16)]), ir.VectorType(_I16, 16))
    v = builder.and_(builder.lshr(v, _vec(_I16, [4 * (i % 2) for i in range(16)])), _vec(_I16, [15] * 16))
    return _odd(builder, v)


def _aux_signs_scales(builder, aux):
    """IQ2_XXS / IQ3_XXS: from 8 u32 (<8 x i32>), each 4 x 7 sign bits and a 4-bit scale on top,
    the sign words and the scales 2 s + 1 per 32."""
    # field l (bits 7 l .. 7 l + 6) to byte l
    fields = [builder.and_(builder.shl(aux, _vec(_I32, [l] * 8)), _vec(_I32, [127 << 8 * l] * 8)) for l in range(4)]
    w = builder.or_(builder.or_(fields[0], fields[1]), builder.or_(fields[2], fields[3]))
    return _parity_words(builder, w), _odd(builder, builder.lshr(aux, _vec(_I32, [28] * 8)))


def _unpack_iq2_xxs(builder, base):
    # block_iq2_xxs | d | qs[32] u16 |: per 32 values 4 grid bytes, then a u32: 4 x 7 sign bits, scale
    raw = _bytes(builder, base, 2, 64)
    idx = builder.zext(_shuffle(builder, raw, [8 * (i // 4) + i % 4 for i in range(32)]), ir.VectorType(_I32, 32))
    aux = _shuffle(builder, _words(builder, base, 2, 16, _I32), range(1, 16, 2))
    return Unpacked(idx, *_aux_signs_scales(builder, aux))


def _unpack_iq2_xs(builder, base):
    # block_iq2_xs | d | qs[32] u16: grid index (9 bits), sign index (7) | scales[8]: a nibble per 16 |
    q16 = _words(builder, base, 2, 32, _I16)
    idx = builder.and_(builder.zext(q16, ir.VectorType(_I32, 32)), _vec(_I32, [511] * 32))
    fields = builder.trunc(builder.lshr(q16, _vec(_I16, [9] * 32)), ir.VectorType(_I8, 32))
    signs = _parity_words(builder, builder.bitcast(fields, ir.VectorType(_I32, 8)))
    return Unpacked(idx, signs, _nibbles16(builder, _bytes(builder, base, 66, 8)))


def _unpack_iq2_s(builder, base):
    # block_iq2_s | d | qs[32] grid low bytes | signs[32] | qh[8]: 2 high bits per index | scales[8] |
    low = builder.zext(_bytes(builder, base, 2, 32), ir.VectorType(_I32, 32))
    qh = builder.zext(_shuffle(builder, _bytes(builder, base, 66, 8), [i // 4 for i in range(32)]), ir.VectorType(_I32, 32))
    high = builder.and_(builder.lshr(qh, _vec(_I32, [2 * (i % 4) for i in range(32)])), _vec(_I32, [3] * 32))
    idx = builder.or_(low, builder.shl(high, _vec(_I32, [8] * 32)))
    return Unpacked(idx, _words(builder, base, 34, 8, _I32), _nibbles16(builder, _bytes(builder, base, 74, 8)))


def _unpack_iq3_xxs(builder, base):
    # block_iq3_xxs | d | qs[64]: a grid byte per 4 values | 8 u32: 4 x 7 sign bits, scale |
    idx = builder.zext(_bytes(builder, base, 2, 64), ir.VectorType(_I32, 64))
    return Unpacked(idx, *_aux_signs_scales(builder, _words(builder, base, 66, 8, _I32)))


def _unpack_iq3_s(builder, base):
    # block_iq3_s | d | qs[64] | qh[8]: bit 8 of each index | signs[32] | scales[4]: a nibble per 32 |
    v64 = ir.VectorType(_I32, 64)
    low = builder.zext(_bytes(builder, base, 2, 64), v64)
    qh = builder.zext(_shuffle(builder, _bytes(builder, base, 66, 8), [i // 8 for i in range(64)]), v64)
    idx = builder.or_(low, builder.shl(_bit_lanes(builder, qh, [i % 8 for i in range(64)], _I32), _vec(_I32, [8] * 64)))
    sc = builder.zext(_shuffle(builder, _bytes(builder, base, 106, 4), [i // 2 for i in range(8)]), ir.VectorType(_I32, 8))
    sc = builder.and_(builder.lshr(sc, _vec(_I32, [4 * (i % 2) for i in range(8)])), _vec(_I32, [15] * 8))
    return Unpacked(idx, _words(builder, base, 74, 8, _I32), _odd(builder, sc))


def _iq1_deltas(builder, neg):
    """<n x i8>: -1 where neg (<n x i1>), else +1."""
    n = neg.type.count
    return builder.select(neg, _vec(_I8, [-1] * n), _vec(_I8, [1] * n))


def _unpack_iq1_s(builder, base):
    # block_iq1_s | d | qs[32]: grid low bytes | qh[8] u16: 4 x 3 high bits, scale (3), delta sign |
    v32 = ir.VectorType(_I32, 32)
    low = builder.zext(_bytes(builder, base, 2, 32), v32)
    qh8 = builder.zext(_words(builder, base, 34, 8, _I16), ir.VectorType(_I32, 8))
    qh = _shuffle(builder, qh8, [i // 4 for i in range(32)])
    high = builder.and_(builder.lshr(qh, _vec(_I32, [3 * (i % 4) for i in range(32)])), _vec(_I32, [7] * 32))
    idx = builder.or_(low, builder.shl(high, _vec(_I32, [8] * 32)))
    scales = _odd(builder, builder.and_(builder.lshr(qh8, _vec(_I32, [12] * 8)), _vec(_I32, [7] * 8)))
    neg = builder.icmp_unsigned("!=", builder.and_(qh, _vec(_I32, [0x8000] * 32)), _vec(_I32, [0] * 32))
    return Unpacked(idx, None, scales, deltas=_iq1_deltas(builder, neg))


def _unpack_iq1_m(builder, base):
    # block_iq1_m | qs[32] | qh[16]: 3 high bits + delta sign per 8 | scales[8]: 4 u16, 3 bits per 16
    # values, the float16 d in their top nibbles |
    v32 = ir.VectorType(_I32, 32)
    low = builder.zext(_bytes(builder, base, 0, 32), v32)
    qh = builder.zext(_shuffle(builder, _bytes(builder, base, 32, 16), [i // 2 for i in range(32)]), v32)
    # point i: the low nibble of its qh byte for even i, the high one for odd i
    nib = builder.lshr(qh, _vec(_I32, [4 * (i % 2) for i in range(32)]))
    idx = builder.or_(low, builder.shl(builder.and_(nib, _vec(_I32, [7] * 32)), _vec(_I32, [8] * 32)))
    neg = builder.icmp_unsigned("!=", builder.and_(nib, _vec(_I32, [8] * 32)), _vec(_I32, [0] * 32))
    sw = builder.zext(_words(builder, base, 48, 4, _I16), ir.VectorType(_I32, 4))
    # scale h of 32-group ib: bits 6 (ib % 2) + 3 h of word ib // 2
    s16 = builder.lshr(_shuffle(builder, sw, [i // 4 for i in range(16)]), _vec(_I32, [6 * ((i // 2) % 2) + 3 * (i % 2) for i in range(16)]))
    scales = builder.trunc(_odd(builder, builder.and_(s16, _vec(_I32, [7] * 16))), ir.VectorType(_I16, 16))
    # d: the top nibbles of the 4 words, word k's as bits 4 k .. 4 k + 3
    top = builder.lshr(builder.and_(sw, _vec(_I32, [0xF000] * 4)), _vec(_I32, [12, 8, 4, 0]))
    d = builder.trunc(builder.or_(builder.or_(builder.extract_element(top, _c(0, _I32)), builder.extract_element(top, _c(1, _I32))),
                                  builder.or_(builder.extract_element(top, _c(2, _I32)), builder.extract_element(top, _c(3, _I32)))), _I16)
    return Unpacked(idx, None, scales, d=d, deltas=_iq1_deltas(builder, neg))


# type name -> (unpack, grid point bytes, factor, block bytes)
_TYPES = {"iq2_xxs": (_unpack_iq2_xxs, 8, 0.125, 66), "iq2_xs": (_unpack_iq2_xs, 8, 0.125, 74),
          "iq2_s": (_unpack_iq2_s, 8, 0.125, 82), "iq3_xxs": (_unpack_iq3_xxs, 4, 0.25, 98),
          "iq3_s": (_unpack_iq3_s, 4, 1, 110), "iq1_s": (_unpack_iq1_s, 8, 0.125, 50),
          "iq1_m": (_unpack_iq1_m, 8, 0.125, 56)}


def block_bytes(name: str) -> int:
    """The bytes of a block of the type ``name`` (a key of each BLOCKS[n])."""
    return _TYPES[name][3]


#: blocks per call -> type name -> the intrinsic (``_grid_blocks``)
BLOCKS = {n: {name: _grid_blocks(*spec, n) for name, spec in _TYPES.items()} for n in (1, 2)}
