"""Generation products of row-interleaved weights read as stored: the R rows of a group (``_r8``:
8, ``_r4``: 4) multiplied together, one row per vector lane, as ik_llama.cpp's iqk_mul_mat does
(mul_mat_q4_0_r8_q8_2, mul_mat_iq2_k_r4_q8_k), instead of regrouped into plain rows first
(``Weight.plain_layout``) and multiplied a row at a time by dot.chunk_dot.

Regrouped, a row's 32-value group sums land in the lanes of a vector that is then summed across
(dot._lane_sums: 21 instructions per 8 groups), its scales are gathered lane by lane and every
row loads the activations again.  Here the interleaved block already holds the R rows' codes side
by side (ik's repacking is made for exactly this): one load of 32 bytes is 4 codes of each of 8
rows (or 8 of 4), multiplied with 4 activations broadcast to every lane, and the 32-bit lanes
accumulate each row's group sum with no sum across lanes; a block's R float16 scales are one load.

Each row's result is the bits of the plain kernel's (matvec's row dots over the regrouped rows):
the integer group sums are exact whichever way they are added, and the float operations are the
plain chunk dot's, lane for lane, in its order:

    per 32-group g    v_g = fma(float(isum_g), d * xd_g, (d * -bias) * xsum_g)   (Q4_0: bias 8)
                      v_g = float(isum_g) * (d * xd_g)                            (IQ2_K)
    per chunk         ((v_0 + v_4) + (v_2 + v_6)) + ((v_1 + v_5) + (v_3 + v_7))   (dot._fold of 8
                      lanes; a legacy row's last chunks of 4, 2, 1 blocks: the missing v_g are +0)
    per row           s = 0, s += chunk, chunk after chunk

so tests compare them with the plain kernel bit for bit (tests/test_runtime_matvec.py,
test_generic_cpu.py).  The byte products use dot.py's instruction tiers (VNNI's vpdpbusd, else
pmaddubsw + pmaddwd, SSSE3 halves, plain IR on the generic target).

Layouts (formats/interleave.py writes them; ik's block_iq4_nl_r8 / block_iq2_k_r4):

    Q4_0_R8   | d[8] f16 | qs[128] |     qs[32 l + 4 k + i] = row k's qs[4 l + i] (l < 4): low
              0          16      144     nibble code 4 l + i, high nibble code 4 l + i + 16

    IQ2_K_R4  | d[4] f16 | extra[8] | scales[32] | qs[256] |     per super-block of 256
              0          8          16           48      304
      extra[k] bit ib: grid choice of row k's values 32 ib..+16, extra[4 + k]: of 32 ib + 16..+16
      scales: slot 8 ib + 4 h + k (sub-block 2 ib + h of row k), nibble slot // 32 of byte
              slot % 32, minus 8
      qs[32 ib + 16 h + 4 k + i] bits 2 j..2 j + 1: code of row k's value 32 ib + 16 h + 4 j + i
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types as nbt
from numba.extending import intrinsic

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..cpu import half_to_float
from ..tables import IQ2NL_VALUES
from ..types import QuantType, traits
from . import dot as D

T = QuantType
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_I64 = ir.IntType(64)


def _c(v):
    return ir.Constant(_I64, v)


def _vec(t, values):
    return ir.Constant(ir.VectorType(t, len(values)), list(values))


def _splat_f(builder, value, n):
    return D._splat(builder, value, n)


def _shuffle(builder, v, idx):
    return builder.shuffle_vector(v, v, _vec(_I32, idx))


def _byte_dot(builder, pairs):
    """<8 x i32>: Σ over (u, s) in pairs of the 4-byte products in each 32-bit lane, u unsigned
    codes below 64 and s signed <32 x i8>, |s| <= 127 (exact: vpdpbusd where VNNI, else pmaddubsw
    then pmaddwd by 1, two pairs' 16-bit lanes added first: 2 * 2 * 63 * 127 < 2^15)."""
    if D._VNNI:
        # one chain of accumulating vpdpbusd (no zeroed register and add per pair)
        total = None
        for u, s in pairs:
            total = D._dpbusd(builder, u, s, total)
        return total
    ones = _vec(_I16, [1] * 16)
    total = None
    for i in range(0, len(pairs), 2):
        p16 = D._maddubs(builder, *pairs[i])
        if i + 1 < len(pairs):
            p16 = builder.add(p16, D._maddubs(builder, *pairs[i + 1]))
        d = D._madd(builder, p16, ones)
        total = d if total is None else builder.add(total, d)
    return total


def _fold8(builder, lanes, zero):
    """dot._fold's sum of 8 lanes, lane for lane over vectors: ((l0 + l4) + (l2 + l6)) + ((l1 + l5)
    + (l3 + l7)); missing lanes (None) are ``zero`` (+0, as the plain chunk's padded lanes)."""
    v = [zero if x is None else x for x in lanes] + [zero] * (8 - len(lanes))
    n = 8
    while n > 1:
        n //= 2
        v = [builder.fadd(v[i], v[i + n]) for i in range(n)]
    return v[0]


def _zero_rows(rows):
    """``zero(out, oo)``: out[oo:oo + rows] = +0.0 as one vector store, which the first chunk's
    vector load of them (_accumulate) takes from the store buffer (after one scalar store per row a
    vector load waits for them to reach the cache: a store-forwarding stall per group of rows)."""
    @intrinsic
    def zero(typingctx, out, oo):
        def codegen(context, builder, sig, args):
            base = D._data(context, builder, sig.args[0], args[0])
            vt = ir.VectorType(_F32, rows)
            builder.store(ir.Constant(vt, [0.0] * rows), builder.bitcast(builder.gep(base, [args[1]]), vt.as_pointer()), align=4)
            return context.get_dummy_value()
        return nbt.none(out, oo), codegen
    return zero


_zero8, _zero4 = _zero_rows(8), _zero_rows(4)


def _accumulate(context, builder, sig, out_v, oo_v, chunk, rows):
    """out[oo:oo + rows] += chunk (<rows x float>): a row's s += chunk."""
    base = D._data(context, builder, sig, out_v)
    ptr = builder.bitcast(builder.gep(base, [oo_v]), ir.VectorType(_F32, rows).as_pointer())
    builder.store(builder.fadd(builder.load(ptr, align=4), chunk), ptr, align=4)


# ---- Q4_0_R8: 8 rows per 32 values ----

Q4_0_R8_BLOCK = 144


def q4_0_r8_chunk(n_blocks: int):
    """``chunk(a, o, xq, xd, xsum, xo, out, oo)``: out[oo:oo + 8] += the 8 rows' chunk dots of
    n_blocks (8, 4, 2 or 1) interleaved blocks of Q4_0_R8 at byte o of a with the rounded
    activations from value xo on (each lane the plain Q4_0 chunk dot of that row's n_blocks
    blocks: dot.chunk_dot with matvec's legacy chunk of n_blocks)."""
    assert n_blocks in (8, 4, 2, 1)

    @intrinsic
    def chunk(typingctx, a, o, xq, xd, xsum, xo, out, oo):
        def codegen(context, builder, sig, args):
            a_v, o_v, xq_v, xd_v, xs_v, xo_v, out_v, oo_v = args
            base = D._data(context, builder, sig.args[0], a_v)
            xqb = D._data(context, builder, sig.args[2], xq_v)
            xdb = D._data(context, builder, sig.args[3], xd_v)
            xsb = D._data(context, builder, sig.args[4], xs_v)
            xblock = builder.lshr(xo_v, _c(5))
            v32 = ir.VectorType(_I8, 32)
            m4 = _vec(_I8, [15] * 32)
            four = _vec(_I8, [4] * 32)
            minus8 = _splat_f(builder, ir.Constant(_F32, -8.0), 8)
            lanes = []
            for g in range(n_blocks):
                bo = builder.add(o_v, _c(Q4_0_R8_BLOCK * g))
                d = half_to_float(builder, D._load(builder, base, bo, 8, _I16))
                x = D._load(builder, xqb, builder.add(xo_v, _c(32 * g)), 32, _I8)
                pairs = []
                for l in range(4):
                    bits = D._load(builder, base, builder.add(bo, _c(16 + 32 * l)), 32, _I8)
                    lo = builder.and_(bits, m4)
                    hi = builder.and_(builder.lshr(bits, four), m4)
                    pairs.append((lo, _shuffle(builder, x, [4 * l + j % 4 for j in range(32)])))
                    pairs.append((hi, _shuffle(builder, x, [16 + 4 * l + j % 4 for j in range(32)])))
                assert pairs[0][0].type == v32
                isum = _byte_dot(builder, pairs)
                xb = builder.add(xblock, _c(g))
                xd_g = _splat_f(builder, builder.load(builder.gep(xdb, [xb])), 8)
                xs_g = _splat_f(builder, builder.load(builder.gep(xsb, [xb])), 8)
                scales = builder.fmul(d, xd_g)
                left_out = builder.fmul(builder.fmul(d, minus8), xs_g)
                lanes.append(D._fma(builder, builder.sitofp(isum, ir.VectorType(_F32, 8)), scales, left_out))
            zero = ir.Constant(ir.VectorType(_F32, 8), [0.0] * 8)
            _accumulate(context, builder, sig.args[6], out_v, oo_v, _fold8(builder, lanes, zero), 8)
            return context.get_dummy_value()
        return nbt.none(a, o, xq, xd, xsum, xo, out, oo), codegen
    return chunk


_chunk8, _chunk4, _chunk2, _chunk1 = (q4_0_r8_chunk(n) for n in (8, 4, 2, 1))


@njit(inline="always", error_model="numpy")
def q4_0_r8_rows(b, bo, xq, xd, xsum, xo, n, out, oo):
    """out[oo:oo + 8] = the 8 rows of the Q4_0_R8 group at byte bo of b · the n rounded
    activations from xo on: matvec's legacy row (8 blocks per chunk, then 4, 2, 1), 8 rows at once."""
    _zero8(out, oo)
    nb = n // 32
    ib = 0
    while ib + 8 <= nb:
        _chunk8(b, bo + Q4_0_R8_BLOCK * ib, xq, xd, xsum, xo + 32 * ib, out, oo)
        ib += 8
    if ib + 4 <= nb:
        _chunk4(b, bo + Q4_0_R8_BLOCK * ib, xq, xd, xsum, xo + 32 * ib, out, oo)
        ib += 4
    if ib + 2 <= nb:
        _chunk2(b, bo + Q4_0_R8_BLOCK * ib, xq, xd, xsum, xo + 32 * ib, out, oo)
        ib += 2
    if ib < nb:
        _chunk1(b, bo + Q4_0_R8_BLOCK * ib, xq, xd, xsum, xo + 32 * ib, out, oo)


# ---- IQ2_K_R4: 4 rows per super-block of 256 ----

IQ2_K_R4_BLOCK = 304
# the IQ2_K grid (both windows of 4) plus 32: unsigned bytes for the unsigned-by-signed products;
# the 32 * Σ xq it adds per 16 values is taken out again in integers
_IQ2NL_PLUS32 = [int(v) + 32 for v in IQ2NL_VALUES] + [0] * 8


def iq2_k_r4_chunk_dot():
    """``chunk(a, o, xq, xd, xsum, xo, out, oo)``: out[oo:oo + 4] += the 4 rows' dots of the
    IQ2_K_R4 super-block at byte o of a with the rounded activations from value xo on (each lane
    the plain IQ2_K chunk dot of that row's super-block: dot.chunk_dot with IQ2_K's layout)."""
    @intrinsic
    def chunk(typingctx, a, o, xq, xd, xsum, xo, out, oo):
        return nbt.none(a, o, xq, xd, xsum, xo, out, oo), _iq2_k_r4_codegen
    return chunk


def _iq2_k_r4_codegen(context, builder, sig, args):
    """IQ2_K_R4's chunk as LLVM IR (the instruction tiers dot.py's flags select when it runs)."""
    a_v, o_v, xq_v, xd_v, xs_v, xo_v, out_v, oo_v = args
    base = D._data(context, builder, sig.args[0], a_v)
    xqb = D._data(context, builder, sig.args[2], xq_v)
    xdb = D._data(context, builder, sig.args[3], xd_v)
    xblock = builder.lshr(xo_v, _c(5))
    v8i = ir.VectorType(_I32, 8)
    vf4 = ir.VectorType(_F32, 4)
    d = half_to_float(builder, D._load(builder, base, o_v, 4, _I16))
    # lane byte m (32-bit lane q = m // 4: row q % 4, half q // 4): its extra byte q
    extra = D._load(builder, base, builder.add(o_v, _c(8)), 8, _I8)
    extra = _shuffle(builder, extra, [m // 4 for m in range(32)])
    table = _vec(_I8, _IQ2NL_PLUS32 * 2)
    ones8 = _vec(_I8, [1] * 32)
    ones16 = _vec(_I16, [1] * 16)
    lanes = []
    for ib in range(8):
        x = D._load(builder, xqb, builder.add(xo_v, _c(32 * ib)), 32, _I8)
        bits = D._load(builder, base, builder.add(o_v, _c(48 + 32 * ib)), 32, _I8)
        window = builder.shl(builder.and_(builder.lshr(extra, _vec(_I8, [ib] * 32)), _vec(_I8, [1] * 32)),
                             _vec(_I8, [2] * 32))
        pairs = []
        for j in range(4):
            code = builder.and_(builder.lshr(bits, _vec(_I8, [2 * j] * 32)), _vec(_I8, [3] * 32))
            u = D._pshufb(builder, table, builder.add(code, window))
            pairs.append((u, _shuffle(builder, x, [16 * (m // 16) + 4 * j + m % 4 for m in range(32)])))
        dots = _byte_dot(builder, pairs)
        # Σ xq over each 16 values, in the lanes of its half: sums of 4 (pairs, then pairs of
        # pairs), then added over the 4 lanes of each half
        s4 = D._madd(builder, D._maddubs(builder, ones8, x), ones16)
        s4 = builder.add(s4, _shuffle(builder, s4, [1, 0, 3, 2, 5, 4, 7, 6]))
        s16 = builder.add(s4, _shuffle(builder, s4, [2, 3, 0, 1, 6, 7, 4, 5]))
        # scale of lane q: nibble ib // 4 of scales[8 (ib % 4) + q], minus 8
        sc = D._load(builder, base, builder.add(o_v, _c(16 + 8 * (ib % 4))), 8, _I8)
        sc = builder.and_(builder.lshr(sc, _vec(_I8, [4 * (ib // 4)] * 8)), _vec(_I8, [15] * 8))
        sc = builder.sub(builder.zext(sc, v8i), _vec(_I32, [8] * 8))
        isum8 = builder.mul(sc, builder.sub(dots, builder.mul(s16, _vec(_I32, [32] * 8))))
        isum = builder.add(_shuffle(builder, isum8, [0, 1, 2, 3]), _shuffle(builder, isum8, [4, 5, 6, 7]))
        xd_g = _splat_f(builder, builder.load(builder.gep(xdb, [builder.add(xblock, _c(ib))])), 4)
        lanes.append(builder.fmul(builder.sitofp(isum, vf4), builder.fmul(d, xd_g)))
    zero = ir.Constant(vf4, [0.0] * 4)
    _accumulate(context, builder, sig.args[6], out_v, oo_v, _fold8(builder, lanes, zero), 4)
    return context.get_dummy_value()


iq2_k_r4_chunk = iq2_k_r4_chunk_dot()


@njit(inline="always", error_model="numpy")
def iq2_k_r4_rows(b, bo, xq, xd, xsum, xo, n, out, oo):
    """out[oo:oo + 4] = the 4 rows of the IQ2_K_R4 group at byte bo of b · the n rounded
    activations from xo on: matvec's super-block row (one chunk per super-block), 4 rows at once."""
    _zero4(out, oo)
    for sb in range(n // 256):
        iq2_k_r4_chunk(b, bo + IQ2_K_R4_BLOCK * sb, xq, xd, xsum, xo + 256 * sb, out, oo)


# stored type -> its rows function (b, bo, xq, xd, xsum, xo, n, out, oo), each reading a group of
# interleave_rows rows at byte bo = first row * row size
ROWS = {T.Q4_0_R8: q4_0_r8_rows, T.IQ2_K_R4: iq2_k_r4_rows}
assert traits(T.Q4_0_R8).interleave_rows * traits(T.Q4_0_R8).type_size == Q4_0_R8_BLOCK
assert traits(T.IQ2_K_R4).interleave_rows * traits(T.IQ2_K_R4).type_size == IQ2_K_R4_BLOCK
