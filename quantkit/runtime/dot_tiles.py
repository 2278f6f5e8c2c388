"""A batch's chunk dots as tiles of rows x tokens, the tokens in the lanes of a vector: the integer
GEMM of a prompt (runtime/matmul8.py drives it; on CPUs with VNNI's vpdpbusd).

:func:`dot.chunk_dot` multiplies one row with one token: the 32 byte products of a group added in
fours into 8 lanes, the 8 groups' lanes added across (21 shuffles and adds), then the float work of
the chunk on a vector of groups and its 8 lanes folded into one value.  For a batch the same sums
are formed the other way round, as ik_llama.cpp's GEMM tiles do: lane t is token t, so no sum ever
crosses lanes.

    activations   packed per block of TOKENS tokens (16 with AVX-512, else 8): the 4 bytes
                  j..j+3 of each token side by side, 4 TOKENS bytes per 4 values, made unsigned
                  (xq + 128, matmul8._pack with :func:`quantize32`)
                      | t0: x0 x1 x2 x3 | t1: x0 x1 x2 x3 | ... | t15: x0 x1 x2 x3 |
    weights       a row's chunk unpacked once (:func:`unpack_chunk`: the codes of dot._group_codes,
                  its scales), each 4 codes broadcast to the lanes (vpdpbusd's m32bcst operand)
    group sum     vpdpbusd(-128 Σ codes, xq + 128, codes) over the group's 8 dwords (per run with
                  integer run scales, then times them): lane t = Σ code_j xq_j of token t, exact

The float work per (row, token) is then chunk_dot's, operation for operation: ``d_g * xd_g``, the
multiply-add with what the products leave out (a folded bias, mins), and the 8 groups added as
``_fold``'s tree of halves, ((g0 + g4) + (g2 + g6)) + ((g1 + g5) + (g3 + g7)), groups a chunk does
not have adding +0 as chunk_dot's zero lanes do; then added to the row's running sum.  So every
(row, token) gets the bits of the generation step's kernel (tests/test_runtime_matvec.py).

An unpacked chunk (CHUNK_BYTES, at a multiple of CHUNK_BYTES in the row's buffer):

    CODES   256  int8 codes of the chunk's groups, 32 per group
    D        32  float32 per group: d_g (chunk_dot's d_vec)
    LO       32  float32 per group: a legacy block's coefficient of xsum (-bias d_g + m_g), or
                 a super-block's integer min m_g as float
    DMIN      4  float32 -dmin
    CORR     64  int32 per run (per group for legacy blocks): -128 Σ its codes (the + 128 taken out)
    SCALES   64  int32 per run: its integer scale (super-blocks)
    MINS     64  int32 per run: its integer min (Q2_K's run mins)
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

from .dot import _F32, _I8, _I16, _I32, _Chunk, _chunk_runs, _data, _fma, _folds_bias, _group_codes, _load, _splat, _x86
from ..cpu import target

# tokens per vector: a 32-bit lane each of a 512-bit register (AVX-512), else of a 256-bit one
TOKENS = 16 if target().avx512 else 8
CODES, D, LO, DMIN, CORR, SCALES, MINS = 0, 256, 288, 320, 336, 400, 464
CHUNK_BYTES = 528

_I64 = ir.IntType(64)
_VF8 = ir.VectorType(_F32, 8)
_VFT = ir.VectorType(_F32, TOKENS)
_VIT = ir.VectorType(_I32, TOKENS)


def _c(v):
    return ir.Constant(_I64, v)


def _ptr(builder, base, off, t):
    return builder.bitcast(builder.gep(base, [off]), t.as_pointer())


def _store(builder, value, base, off):
    builder.store(value, _ptr(builder, base, off, value.type), align=1)


def _check(runs, sup, e8m0):
    runs, groups = _chunk_runs(runs, sup, e8m0)
    assert list(groups) == list(range(len(groups))) and len(groups) <= 8 and (sup is None or len(runs) <= 16)
    firsts = [members[0][1] for members in groups.values()]
    coef = sup is None and any(_folds_bias(r) or r.m_at is not None for r in firsts)
    # chunk_dot's left-out terms: a legacy coefficient, or a super-block's mins, never both
    assert not (coef and sup is not None)
    return runs, groups, firsts, coef


def unpack_chunk(runs, table=False, sup=None, e8m0=False):
    """``unpack(a, o, tab, buf, bo)``: the chunk of ``runs`` at byte o of a (as dot.chunk_dot
    reads it) unpacked into buf[bo:bo + CHUNK_BYTES] (the layout in the module's docstring)."""
    runs, groups, _, coef = _check(runs, sup, e8m0)

    @intrinsic
    def unpack(typingctx, a, o, tab, buf, bo):
        def codegen(context, builder, sig, args):
            # the chunk read as chunk_dot reads it (dot._Chunk: the same loads and float operations)
            ch = _Chunk(context, builder, sig, args, groups, table, sup, e8m0, activations=False)
            bo_v = args[4]
            out = _data(context, builder, sig.args[3], args[3])

            def at(off):
                return builder.add(bo_v, _c(off))

            # the scales and left-out coefficients: chunk_dot's d_vec, coef, m8 and -dmin
            d_vec, run_scales = ch.scales()
            lo = ir.Constant(_VF8, [0.0] * 8)
            if coef:
                lo = ch.bias_coef(d_vec)
            if sup is not None and sup.mins:
                lo = ch.mins()
            dmin = ir.Constant(_F32, 0.0)
            if sup is not None and (sup.mins or sup.run_mins):
                dmin = ch.neg_dmin()
            _store(builder, d_vec, out, at(D))
            _store(builder, lo, out, at(LO))
            _store(builder, dmin, out, at(DMIN))
            v16i32 = ir.VectorType(_I32, 16)
            if sup is not None:
                _store(builder, builder.sext(run_scales, v16i32), out, at(SCALES))
                mins = ch.run_mins()
                if mins is None:
                    mins = ir.Constant(ir.VectorType(_I16, 16), [0] * 16)
                _store(builder, builder.sext(mins, v16i32), out, at(MINS))

            # the codes, as chunk_dot unpacks them, and -128 Σ codes per run (per group: legacy)
            pair_tables = ch.pair_tables()
            wide = ir.VectorType(_I32, 32)
            for g, members in groups.items():
                w, _ = _group_codes(ch, members, pair_tables)
                _store(builder, w, out, at(CODES + 32 * g))
                codes = builder.sext(w, wide)
                spans = [(g, 0, 32)] if sup is None else [(k, r.xoff - 32 * g, r.n) for k, r in members]
                for idx, first, n in spans:
                    part = builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(_I32, n), list(range(first, first + n))))
                    total = _reduce_add(builder, part, n)
                    _store(builder, builder.mul(total, ir.Constant(_I32, -128)), out, at(CORR + 4 * idx))
            return context.get_dummy_value()
        return nbt.none(a, o, tab, buf, bo), codegen
    return unpack


def _reduce_add(builder, v, n):
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.add(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _dpbusd(builder, acc, u, s):
    """acc + lane i: Σ_j<4 u[4i + j] * s[4i + j] (u unsigned, s signed bytes; <TOKENS x i32> each)."""
    return _x86(builder, f"llvm.x86.avx512.vpdpbusd.{32 * TOKENS}", _VIT, acc, u, s)


def tile_chunk(runs, sup=None, e8m0=False, rows=4):
    """``tile(buf, bo, rstride, xp, xpo, xd, xs, xdo, xr, xro, acc)``: for the ``rows`` unpacked
    chunks at buf[bo + r * rstride] (:func:`unpack_chunk` of the same runs) and a block of TOKENS
    tokens, acc[TOKENS r + t] += chunk_dot of row r and token t (the same bits).

    xp: the packed activations (matmul8._pack), the chunk's first 4 values of the block's
    tokens at byte xpo; xd, xs: the tokens' scales and sums per 32 values, float32, TOKENS tokens side
    by side, the chunk's first group's at xdo; xr: Σ xq per run of a super-block's run mins (int32,
    likewise, at xro)."""
    runs, groups, firsts, coef = _check(runs, sup, e8m0)
    mins = sup is not None and bool(sup.mins)
    run_mins = sup is not None and bool(sup.run_mins)
    run_n = runs[0].n
    assert not run_mins or all(r.n == run_n for r in runs)

    @intrinsic
    def tile(typingctx, buf, bo, rstride, xp, xpo, xd, xs, xdo, xr, xro, acc):
        def codegen(context, builder, sig, args):
            buf_v, bo_v, rs_v, xp_v, xpo_v, xd_v, xs_v, xdo_v, xr_v, xro_v, acc_v = args
            b = _data(context, builder, sig.args[0], buf_v)
            xpb = _data(context, builder, sig.args[3], xp_v)
            xdb = _data(context, builder, sig.args[5], xd_v)
            xsb = _data(context, builder, sig.args[6], xs_v)
            xrb = _data(context, builder, sig.args[8], xr_v)
            accb = _data(context, builder, sig.args[10], acc_v)
            row_at = [builder.add(bo_v, builder.mul(rs_v, _c(r))) for r in range(rows)]

            def scalar(r, off, t):
                return builder.load(_ptr(builder, b, builder.add(row_at[r], _c(off)), t), align=4)

            def lanes(base, off, t):
                return builder.load(_ptr(builder, base, off, ir.VectorType(t, TOKENS)), align=4)

            zero = ir.Constant(_VFT, [0.0] * TOKENS)
            res = [dict() for _ in range(rows)]

            def fold(r, g):
                """_fold's tree of halves over the 8 groups, ((g0 + g4) + (g2 + g6)) + ((g1 + g5)
                + (g3 + g7)), each sum formed as soon as its terms are (few registers live)."""
                v = res[r]
                for key, a, b in (((4, g % 4), g % 4, g % 4 + 4), ((2, g % 2), (4, g % 2), (4, g % 2 + 2)),
                                  ((1, 0), (2, 0), (2, 1))):
                    if key not in v and a in v and b in v:
                        v[key] = builder.fadd(v.pop(a), v.pop(b))
            for r in range(rows):
                for g in range(len(groups), 8):
                    res[r][g] = zero
            for g in sorted(groups, key=lambda g: (g % 2, g % 4 // 2, g // 4)):
                members = groups[g]
                xv = [builder.bitcast(_load(builder, xpb, builder.add(xpo_v, _c(4 * TOKENS * (8 * g + j))), 4 * TOKENS, _I8), _VIT)
                      for j in range(8)]
                xd_g = lanes(xdb, builder.add(xdo_v, _c(TOKENS * g)), _F32)
                xs_g = lanes(xsb, builder.add(xdo_v, _c(TOKENS * g)), _F32) if (coef or mins) else None
                xr_k = {}
                if run_mins:
                    for k, r in members:
                        xr_k[k] = lanes(xrb, builder.add(xro_v, _c(TOKENS * (r.xoff // run_n))), _I32)
                for r in range(rows):
                    def sums(first, n, corr_at):
                        s = _splat(builder, scalar(r, corr_at, _I32), TOKENS)
                        for j in range(first // 4, (first + n) // 4):
                            w = _splat(builder, scalar(r, CODES + 32 * g + 4 * j, _I32), TOKENS)
                            s = _dpbusd(builder, s, xv[j], w)
                        return s
                    if sup is None:
                        isum = sums(0, 32, CORR + 4 * g)
                    else:
                        isum = None
                        for k, run in members:
                            part = builder.mul(sums(run.xoff - 32 * g, run.n, CORR + 4 * k),
                                               _splat(builder, scalar(r, SCALES + 4 * k, _I32), TOKENS))
                            isum = part if isum is None else builder.add(isum, part)
                    total = builder.sitofp(isum, _VFT)
                    scale = builder.fmul(_splat(builder, scalar(r, D + 4 * g, _F32), TOKENS), xd_g)
                    left = None
                    if coef:
                        left = builder.fmul(_splat(builder, scalar(r, LO + 4 * g, _F32), TOKENS), xs_g)
                    if mins:
                        left = builder.fmul(builder.fmul(_splat(builder, scalar(r, LO + 4 * g, _F32), TOKENS), xs_g),
                                            _splat(builder, scalar(r, DMIN, _F32), TOKENS))
                    if run_mins:
                        msum = None
                        for k, _ in members:
                            part = builder.mul(_splat(builder, scalar(r, MINS + 4 * k, _I32), TOKENS), xr_k[k])
                            msum = part if msum is None else builder.add(msum, part)
                        run_left = builder.fmul(builder.fmul(builder.sitofp(msum, _VFT), xd_g),
                                                _splat(builder, scalar(r, DMIN, _F32), TOKENS))
                        left = run_left if left is None else builder.fadd(left, run_left)
                    res[r][g] = builder.fmul(total, scale) if left is None else _fma(builder, total, scale, left)
                    fold(r, g)
            for r in range(rows):
                for g in range(len(groups), 8):
                    fold(r, g)
                chunk = res[r].pop((1, 0))
                assert not res[r]
                ptr = _ptr(builder, accb, _c(TOKENS * r), _VFT)
                builder.store(builder.fadd(builder.load(ptr, align=4), chunk), ptr, align=4)
            return context.get_dummy_value()
        return nbt.none(buf, bo, rstride, xp, xpo, xd, xs, xdo, xr, xro, acc), codegen
    return tile


# ---- the activations: 32 values at a time, rounded as matvec.round_q8 and packed ----

@intrinsic
def amax32(typingctx, x, xo):
    """max |x[xo + j]| over j < 32 (x float32 1-D), taken on the bits: of values that are not NaN
    the largest magnitude has the largest bits as an unsigned integer (and a NaN, larger ones)."""
    def codegen(context, builder, sig, args):
        v = _load(builder, _data(context, builder, sig.args[0], args[0]), args[1], 32, _I32)
        v = builder.and_(v, ir.Constant(ir.VectorType(_I32, 32), [0x7FFFFFFF] * 32))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v.type]), "llvm.vector.reduce.umax.v32i32")
        return builder.bitcast(builder.call(fn, [v]), _F32)
    return nbt.float32(x, xo), codegen


@intrinsic
def quantize32(typingctx, x, xo, inv, xp, po):
    """The codes q_j = int8(rint(x[xo + j] * inv)) of 32 values (round_q8's operations) stored as
    q_j + 128 at xp[po + 4 TOKENS (j // 4) + j % 4] (:func:`tile_chunk`'s packed tokens); Σ q_j."""
    def codegen(context, builder, sig, args):
        x_v, xo_v, inv_v, xp_v, po_v = args
        v = _load(builder, _data(context, builder, sig.args[0], x_v), xo_v, 32, _F32)
        v = builder.fmul(v, _splat(builder, inv_v, 32))
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v.type, [v.type]), "llvm.rint.v32f32")
        # through int32 then its low byte, as x86 converts round_q8's scalars (a value out of
        # range: a NaN of inf * 0, gives the same byte)
        q = builder.trunc(builder.fptosi(builder.call(rint, [v]), ir.VectorType(_I32, 32)), ir.VectorType(_I8, 32))
        u = builder.xor(q, ir.Constant(ir.VectorType(_I8, 32), [-128] * 32))
        out = _data(context, builder, sig.args[3], xp_v)
        dwords = builder.bitcast(u, ir.VectorType(_I32, 8))
        for k in range(8):
            _store(builder, builder.extract_element(dwords, ir.Constant(_I32, k)), out,
                   builder.add(po_v, _c(4 * TOKENS * k)))
        return _reduce_add(builder, builder.sext(q, ir.VectorType(_I32, 32)), 32)
    return nbt.int32(x, xo, inv, xp, po), codegen
