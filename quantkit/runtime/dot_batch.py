"""The chunk dots of a batch: :func:`dot.chunk_dot` for a block of tokens, each chunk's packed
codes unpacked once and multiplied with every token's activations (runtime/matmul8.py drives it).

A prompt's products multiply each weight row with many tokens.  Unpacking a chunk's codes (shifts,
masks, grid lookups, integer scales) costs as much as multiplying them with one token, so the
batch's kernel does it once per chunk and token block instead of once per token, as ik_llama.cpp's
integer GEMMs (iqk_mul_mat) do.

Per token the result is the same bits as ``dot.chunk_dot``'s: the integer sums are exact however
they are formed, and the float work per chunk is the same operations in the same order (the 8
lanes of group sums converted once, ``d_g * xd_g`` times them, fused with what the products leave
out: a folded bias, mins; the lanes folded as a tree of halves), then added to the token's
running row sum as ``s += chunk`` does in matvec's row loops.  So a prompt's logits are the
generation steps' (tests/test_runtime_matmul8.py compares the two kernels on every type they
cover, generic CPU too).

A chunk's scales, mins and pair tables are read by ``dot._Chunk`` and its codes unpacked by
``dot._group_codes``, as chunk_dot reads and unpacks them.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic

from .dot import (_F32, _I8, _I16, _I32, _VNNI, _Chunk, _abs_sign, _chunk_runs, _data, _dpbusd, _fma, _fold,
                  _group_codes, _lane_sums, _load, _load8, _madd, _maddubs, _splat)


def chunk_dot_batch(runs, table=False, sup=None, e8m0=False):
    """``dot(a, o, tab, xq, xd, xsum, xo, stride, n_tok, acc)``: for t < n_tok,
    acc[t] += chunk_dot(runs, table, sup, e8m0)(a, o, tab, xq, xd, xsum, xo + t * stride) (dot.py),
    the same bits, with the chunk's codes and scales unpacked once for all the tokens (``stride``:
    the values between two tokens' activations, a multiple of 32)."""
    runs, groups = _chunk_runs(runs, sup, e8m0)

    @intrinsic
    def dot(typingctx, a, o, tab, xq, xd, xsum, xo, stride, n_tok, acc):
        def codegen(context, builder, sig, args):
            # ---- what does not depend on the token: scales, mins, the codes ----
            ch = _Chunk(context, builder, sig, args, groups, table, sup, e8m0)
            c, n_groups = ch.c, ch.n_groups
            xo_v, stride_v, nt_v = args[6:9]
            accb = _data(context, builder, sig.args[9], args[9])
            vf8 = ir.VectorType(_F32, 8)
            d_vec, run_scales = ch.scales()
            coef = ch.bias_coef(d_vec)
            m8 = ch.mins()
            if sup is not None and (sup.mins or sup.run_mins):
                dmin = ch.neg_dmin()
            ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
            v32 = ir.VectorType(_I8, 32)
            pair_tables = ch.pair_tables()
            run_mins = ch.run_mins()
            codes = []
            for g, members in groups.items():
                w, signed = _group_codes(ch, members, pair_tables)
                lane_runs = None
                if members[0][1].d_at is None:
                    lanes = 16 // len(members)
                    lane_runs = ir.Constant(ir.VectorType(_I32, 16), [members[j // lanes][0] for j in range(16)])
                    lane_scales = builder.shuffle_vector(run_scales, run_scales, lane_runs)
                    lane_mins = builder.shuffle_vector(run_mins, run_mins, lane_runs) if sup.run_mins else None
                else:
                    lane_scales, lane_mins = ones, None
                codes.append((g, w, signed, lane_scales, lane_mins))

            # ---- per token: the products, then chunk_dot's float work, added to acc[t] ----
            xo0 = xo_v
            with cgutils.for_range(builder, nt_v) as loop:
                t = loop.index
                xo_t = builder.add(xo0, builder.mul(t, stride_v))
                xblock = builder.lshr(xo_t, c(5))
                group_scales = builder.fmul(d_vec, _load8(builder, ch.xd, xblock, n_groups))
                left_out = None
                if coef is not None:
                    left_out = builder.fmul(coef, _load8(builder, ch.xsum, xblock, n_groups))
                if m8 is not None:
                    left_out = builder.fmul(builder.fmul(m8, _load8(builder, ch.xsum, xblock, n_groups)), _splat(builder, dmin, 8))
                isums, msums = [], []
                for g, w, signed, lane_scales, lane_mins in codes:
                    x = _load(builder, ch.xq, builder.add(xo_t, c(32 * g)), 32, _I8)
                    u, s = _abs_sign(builder, w, x) if signed else (w, x)
                    if lane_scales is ones and _VNNI:
                        # a legacy group: its 32 byte products in one vpdpbusd (as chunk_dot's)
                        isums.append(_dpbusd(builder, u, s))
                    else:
                        isums.append(_madd(builder, _maddubs(builder, u, s), lane_scales))
                    if lane_mins is not None:
                        xpairs = _maddubs(builder, ir.Constant(v32, [1] * 32), x)
                        msums.append(_madd(builder, xpairs, lane_mins))
                if msums:
                    run_left = builder.fmul(builder.fmul(builder.sitofp(_lane_sums(builder, msums), vf8),
                                                         _load8(builder, ch.xd, xblock, n_groups)), _splat(builder, dmin, 8))
                    left_out = run_left if left_out is None else builder.fadd(left_out, run_left)
                total = builder.sitofp(_lane_sums(builder, isums), vf8)
                res = builder.fmul(total, group_scales) if left_out is None else _fma(builder, total, group_scales, left_out)
                chunk = builder.extract_element(_fold(builder, res, 8, 1), ir.Constant(_I32, 0))
                ptr = builder.gep(accb, [t])
                builder.store(builder.fadd(builder.load(ptr), chunk), ptr)
            return context.get_dummy_value()
        return nbt.none(a, o, tab, xq, xd, xsum, xo, stride, n_tok, acc), codegen
    dot.runs, dot.table, dot.sup, dot.e8m0 = runs, table, sup, e8m0
    return dot
