"""A batch's products of the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) as
tiles of rows x tokens, the tokens in the lanes of a vector (runtime/matmul8.py drives them as it
drives dot_tiles.py's; on CPUs with VNNI's vpdpbusd).

A generation step multiplies a row with a token block by block (grid_dot.py: the grid points'
indices unpacked, the points gathered, sign bits applied, 8 group sums of 32 values, then floats).
A batch would repeat the unpacking and gathers for every token; here each block of a row is unpacked
once per batch into signed int8 codes (grid value times its sign; IQ1: 8 grid + delta), the integer
scales per run of 32 or 16 values, -128 Σ codes per run and the block's float factor, then
multiplied with TOKENS tokens at a time as dot_tiles' tiles do: each 4 codes broadcast to the lanes
and vpdpbusd with the activations packed by matmul8._pack (xq + 128, unsigned; the + 128 taken out
again by the run's correction), so lane t holds token t's exact integer group sum.

The float work per (row, token) is then grid_dot's, operation for operation (its _block_sums and
_grid_blocks):

    prod_g = float(isum_g) * xd_g                          per group of 32, xd_g the token's scale
    acc    = ((0 + prod_0) + prod_1) + ... + prod_7         in group order, from +0
    s      = s + (d * factor) * acc                         block after block, s from +0

so every (row, token) gets the bits of the step kernel (tests/test_runtime_matvec.py).  The integer
sums are exact however they are formed (|code| <= 62, |xq| <= 127: no int16 saturation in the
step's pmaddubsw, none in vpdpbusd's int32).

An unpacked block (at a multiple of dot_tiles.CHUNK_BYTES in the row's buffer):

    CODES   256  int8 codes, value j of the block at byte j
    SCALES   64  int32 per run: its integer scale (8 runs of 32, or 16 of 16 values)
    CORR     64  int32 per run: -128 Σ its codes
    DD        4  float32: the block's d (float16) times the type's factor (grid_dot's d * factor)

Without VNNI (:func:`row_dots`) each block of a row is unpacked the same way once per token block
of matmul8, then multiplied token by token, two tokens a call, by grid_dot's own _block_sums on
the unpacked codes (the step's pmaddubsw / pmaddwd sums where the target has them; the signed
codes take _abs_sign's path instead of the step's negated activations: the same integers) and
the same float operations: the same bits, without a gather per token.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types as nbt
from numba.extending import intrinsic

from ..cpu import half_to_float
from .dot import _F32, _I8, _I16, _I32, _as, _data, _load, _splat
from .dot_tiles import CHUNK_BYTES, TOKENS, _dpbusd, _ptr, _reduce_add, _store
from .grid_dot import _TYPES, _block_sums, _gather, _shuffle, _vec

CODES, SCALES, CORR, DD = 0, 256, 320, 384
assert DD + 4 <= CHUNK_BYTES

_I64 = ir.IntType(64)
_VFT = ir.VectorType(_F32, TOKENS)


def _c(v, t=_I64):
    return ir.Constant(t, v)


# values per run of a type's integer scales: 32 (its unpack's <8 x i32>) or 16 (<16 x i16>)
RUN = {"iq2_xxs": 32, "iq2_xs": 16, "iq2_s": 16, "iq3_xxs": 32, "iq3_s": 32, "iq1_s": 32, "iq1_m": 16}
assert set(RUN) == set(_TYPES)


def unpack_block(name):
    """``unpack(b, o, grid, buf, bo)``: the block of the grid type ``name`` at byte o of b unpacked
    into buf[bo:bo + CHUNK_BYTES] (the layout in the module's docstring), read as grid_dot reads it
    (its type's unpack, the same gathered points, signs and scales, the same d * factor)."""
    unpack, width, factor, _ = _TYPES[name]
    elt = ir.IntType(8 * width)

    @intrinsic
    def unpack_intr(typingctx, b, o, grid, buf, bo):
        def codegen(context, builder, sig, args):
            b_v, o_v, grid_v, buf_v, bo_v = args
            base = builder.gep(_data(context, builder, sig.args[0], b_v), [_as(builder, o_v, _I64)])
            grid = builder.bitcast(_data(context, builder, sig.args[2], grid_v), elt.as_pointer())
            out = _data(context, builder, sig.args[3], buf_v)
            bo = _as(builder, bo_v, _I64)

            def at(off):
                return builder.add(bo, _c(off))
            u = unpack(builder, base)
            codes = builder.bitcast(_gather(builder, grid, u.idx, elt), ir.VectorType(_I8, 256))
            if u.deltas is not None:
                spread = _shuffle(builder, u.deltas, [j // width for j in range(256)])
                codes = builder.add(builder.shl(codes, _vec(_I8, [3] * 256)), spread)
            groups = [_shuffle(builder, codes, range(32 * g, 32 * g + 32)) for g in range(8)]
            if u.signs is not None:
                # bit j of sign word g negates value 32 g + j (grid_dot negates the activation
                # instead: the same integer product)
                zero = ir.Constant(ir.VectorType(_I8, 32), [0] * 32)
                for g in range(8):
                    neg = builder.bitcast(builder.extract_element(u.signs, _c(g, _I32)), ir.VectorType(ir.IntType(1), 32))
                    groups[g] = builder.select(neg, builder.sub(zero, groups[g]), groups[g])
            for g in range(8):
                _store(builder, groups[g], out, at(CODES + 32 * g))
            run = RUN[name]
            assert run == (32 if u.scales.type.element == _I32 else 16)
            scales = u.scales if run == 32 else builder.sext(u.scales, ir.VectorType(_I32, 16))
            _store(builder, scales, out, at(SCALES))
            wide = ir.VectorType(_I32, 32)
            for g in range(8):
                w = builder.sext(groups[g], wide)
                for h in range(32 // run):
                    part = builder.shuffle_vector(w, w, _vec(_I32, range(run * h, run * h + run)))
                    total = _reduce_add(builder, part, run)
                    _store(builder, builder.mul(total, _c(-128, _I32)), out, at(CORR + 4 * (32 // run * g + h)))
            bits = u.d if u.d is not None else builder.load(builder.bitcast(base, _I16.as_pointer()), align=1)
            d = half_to_float(builder, bits)
            if factor != 1:
                d = builder.fmul(d, ir.Constant(_F32, factor))
            _store(builder, d, out, at(DD))
            return context.get_dummy_value()
        return nbt.none(b, o, grid, buf, bo), codegen
    return unpack_intr


def tile_block(name, rows):
    """``tile(buf, bo, rstride, xp, xpo, xd, xdo, acc)``: for the ``rows`` unpacked blocks at
    buf[bo + r * rstride] (:func:`unpack_block` of the type ``name``) and a block of TOKENS tokens,
    acc[TOKENS r + t] = acc[TOKENS r + t] + (d * factor) * acc_block, acc_block grid_dot's sum of
    the block's 8 groups for row r and token t (the same float operations in the same order).

    xp: the packed activations (matmul8._pack), the block's first 4 values of the tokens at byte
    xpo; xd: the tokens' scales per 32 values, TOKENS side by side, the block's first group's at
    xdo."""
    run = RUN[name]
    per_group = 32 // run

    @intrinsic
    def tile(typingctx, buf, bo, rstride, xp, xpo, xd, xdo, acc):
        def codegen(context, builder, sig, args):
            buf_v, bo_v, rs_v, xp_v, xpo_v, xd_v, xdo_v, acc_v = args
            b = _data(context, builder, sig.args[0], buf_v)
            xpb = _data(context, builder, sig.args[3], xp_v)
            xdb = _data(context, builder, sig.args[5], xd_v)
            accb = _data(context, builder, sig.args[7], acc_v)
            row_at = [builder.add(bo_v, builder.mul(rs_v, _c(r))) for r in range(rows)]

            def scalar(r, off, t):
                return builder.load(_ptr(builder, b, builder.add(row_at[r], _c(off)), t), align=4)

            sums = [ir.Constant(_VFT, [0.0] * TOKENS)] * rows
            for g in range(8):
                xv = [builder.bitcast(_load(builder, xpb, builder.add(xpo_v, _c(4 * TOKENS * (8 * g + j))), 4 * TOKENS, _I8),
                                      ir.VectorType(_I32, TOKENS)) for j in range(8)]
                xd_g = builder.load(_ptr(builder, xdb, builder.add(xdo_v, _c(TOKENS * g)), _VFT), align=4)
                for r in range(rows):
                    isum = None
                    for h in range(per_group):
                        k = per_group * g + h
                        s = _splat(builder, scalar(r, CORR + 4 * k, _I32), TOKENS)
                        for j in range(run // 4 * h, run // 4 * (h + 1)):
                            w = _splat(builder, scalar(r, CODES + 32 * g + 4 * j, _I32), TOKENS)
                            s = _dpbusd(builder, s, xv[j], w)
                        part = builder.mul(s, _splat(builder, scalar(r, SCALES + 4 * k, _I32), TOKENS))
                        isum = part if isum is None else builder.add(isum, part)
                    # grid_dot: float(isum_g) * xd_g, added to the block's sum in group order
                    sums[r] = builder.fadd(sums[r], builder.fmul(builder.sitofp(isum, _VFT), xd_g))
            for r in range(rows):
                ptr = _ptr(builder, accb, _c(TOKENS * r), _VFT)
                dd = _splat(builder, scalar(r, DD, _F32), TOKENS)
                builder.store(builder.fadd(builder.load(ptr, align=4), builder.fmul(dd, sums[r])), ptr, align=4)
            return context.get_dummy_value()
        return nbt.none(buf, bo, rstride, xp, xpo, xd, xdo, acc), codegen
    return tile


def tiled(grid, name, rows):
    """(unpack(b, bo, buf, co, n), tile(buf, co, rstride, xp, xpo, xd, xs, xdo, xr, xro, n, acc),
    finish(b, bo, s)) for matmul8's tiles (its _super_tiled's signatures): a row's blocks one
    chunk of CHUNK_BYTES each, in the row's order; no row scale."""
    u = unpack_block(name)
    t = tile_block(name, rows)
    cb = CHUNK_BYTES
    block_bytes = _TYPES[name][3]

    def unpack(b, bo, buf, co, n):
        for blk in range(n // 256):
            u(b, bo + block_bytes * blk, grid, buf, co + cb * blk)

    def tile(buf, co, rstride, xp, xpo, xd, xs, xdo, xr, xro, n, acc):
        for blk in range(n // 256):
            t(buf, co + cb * blk, rstride, xp, xpo + 256 * TOKENS * blk, xd, xdo + 8 * TOKENS * blk, acc)

    def finish(b, bo, s):
        return s
    return njit(unpack, inline="always"), njit(tile, inline="always"), njit(finish, inline="always")


def codes_dot(name, n):
    """``dot(buf, bo, xq, xd, x0, xstride, acc, t)``: for k < n, acc[t + k] = acc[t + k] + (d *
    factor) * acc_k, acc_k grid_dot's sum over the 8 groups of the block unpacked at buf[bo]
    (:func:`unpack_block` of the type ``name``) and the rounded activations xq * xd from value x0 +
    k xstride on."""
    run = RUN[name]

    @intrinsic
    def dot(typingctx, buf, bo, xq, xd, x0, xstride, acc, t):
        def codegen(context, builder, sig, args):
            buf_v, bo_v, xq_v, xd_v, x0_v, xs_v, acc_v, t_v = args
            b = _data(context, builder, sig.args[0], buf_v)
            accb = _data(context, builder, sig.args[6], acc_v)
            bo = _as(builder, bo_v, _I64)
            codes = _load(builder, b, builder.add(bo, _c(CODES)), 256, _I8)
            scales = builder.load(_ptr(builder, b, builder.add(bo, _c(SCALES)), ir.VectorType(_I32, 256 // run)), align=1)
            if run == 16:
                scales = builder.trunc(scales, ir.VectorType(_I16, 16))
            x0 = _as(builder, x0_v, _I64)
            xs = _as(builder, xs_v, _I64)
            blocks = [(codes, None, scales, builder.add(x0, builder.mul(xs, _c(k)))) for k in range(n)]
            accs = _block_sums(builder, blocks, _data(context, builder, sig.args[2], xq_v),
                               _data(context, builder, sig.args[3], xd_v))
            dd = builder.load(_ptr(builder, b, builder.add(bo, _c(DD)), _F32), align=1)
            for k, a in enumerate(accs):
                ptr = builder.gep(builder.bitcast(accb, _F32.as_pointer()), [builder.add(_as(builder, t_v, _I64), _c(k))])
                builder.store(builder.fadd(builder.load(ptr), builder.fmul(dd, a)), ptr)
            return context.get_dummy_value()
        return nbt.none(buf, bo, xq, xd, x0, xstride, acc, t), codegen
    return dot


def row_dots(grid, name):
    """``row(b, bo, xq, xd, xsum, xo, n, nt, acc)`` (matmul8's row_dots without tiles): acc[t] = the
    row at byte bo of b times token t's rounded activations (from xo + n t on), for t < nt: each
    block unpacked once into a buffer, then :func:`codes_dot` two tokens a call (the same bits as
    grid_dot's step kernel)."""
    u = unpack_block(name)
    dot1, dot2 = codes_dot(name, 1), codes_dot(name, 2)
    block_bytes = _TYPES[name][3]

    def row(b, bo, xq, xd, xsum, xo, n, nt, acc):
        buf = np.empty(CHUNK_BYTES, np.uint8)
        for t in range(nt):
            acc[t] = np.float32(0)
        for blk in range(n // 256):
            u(b, bo + block_bytes * blk, grid, buf, 0)
            x0 = xo + 256 * blk
            t = 0
            while t + 2 <= nt:
                dot2(buf, 0, xq, xd, x0 + n * t, n, acc, t)
                t += 2
            if t < nt:
                dot1(buf, 0, xq, xd, x0 + n * t, n, acc, t)
    return njit(row, inline="always")
