"""Fused matrix-vector products for generation: each stored row is multiplied with the activations
straight from its packed bytes, chunk by chunk, and never written out as float32.

A decoded row costs a write and a read of 4 bytes per weight; the packed row is 0.3-1 byte.  For
the one or few tokens of a generation step that traffic, not the arithmetic, set the speed of the
decode-then-BLAS path (ops_cpu.matmul_q), so the products of a few tokens come here for the types
below; larger batches keep the tile path, where BLAS reuses each decoded tile for every token.

As in ggml's quantized dot products the activations are first rounded to 8 bits per 32 (q8_0:
``round_q8``), and weight codes and activation codes are multiplied as integers; F32 and F16 rows
are multiplied in float.  Per chunk (8 legacy blocks, or one super-block of 256; a legacy row's
last blocks in chunks of 4, 2 and 1) the kernel runs one :func:`dot.chunk_dot`, compiled from the
type's layout (quantkit/layouts.py: its runs, where their bits sit); it reads the scales from the
blocks themselves: float16 block scales (legacy types), or a float16 super-block scale and packed
integer sub-block scales (and grid choices, mins) whose bit positions the layout's ``Super`` lists
(k-quants and IQK types); MXFP4, IQ4_NL's block with an E8M0 exponent for its scale, takes the
legacy chunk dots with that scale (``E8M0_LAYOUTS``).  The types whose codes the layouts cannot
describe are multiplied by code_dots.py: the grid i-quants with sign bits gather each 32 values'
grid points into a vector register, the ternary types, Q8_KV and IQ1_S/IQ1_M are unpacked block by
block into integers, then multiplied the same way.  Each type compiles its own loop: the type is a literal argument of
the kernel (``_kernel``).  The loop passes byte and value offsets, never views, down to the
chunks: a view per row would count a reference up and down on an array both threads share.

Interleaved types (``_r4``/``_r8``) with a group kernel (``STEP``: q4_0_r8, iq2_k_r4) are read as
stored, the R rows of a group at once, one row per vector lane (group_dot.py: each row the bits of
the plain kernel's); the others are regrouped into their plain rows once, on first use (see
``Weight.plain_layout``), and take the plain type's kernel, as a batch's products of every
interleaved type do (matmul8); those with a layout of their own
(code_dots: iq1_s_r4, iq1_m_r4, q8_KV_r8, q8_k_r8) are read as stored.  The numpy twin is decoding the rows
and multiplying with the rounded activations (``formats.dequantize(...) @ round_q8(x)``), which
the tests compare with.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..layouts import LAYOUTS, Layout, Run
from ..tables import MXFP4_VALUES
from ..types import TYPE_TRAITS, QuantType, traits, type_name
from . import dot as D
from . import group_dot
from .code_dots import TYPES as CODED
from . import code_dots
from .code_dots import coded_row, new_scratch
from .kernels import _f16_value as half_round

F = np.float32
T = QuantType
_OPTS = dict(cache=True, error_model="numpy", nogil=True)


def _padded(grid):
    """A layout's grid as int8, padded so that a 16-byte load at any window of it stays inside."""
    out = np.zeros(16 * ((len(grid) + 15) // 16) + 16, np.int8)
    out[:len(grid)] = grid
    return out


NO_TABLE = np.zeros(16, np.int8)              # the types without a grid

# MXFP4's block is IQ4_NL's with an E8M0 exponent byte for the float16 scale, | e | qs[16] |
# (value = 2^(e - 128) * kvalues_mxfp4[code]): the legacy chunk dots read it with that scale
# (dot.chunk_dot's e8m0).  It is not in layouts.LAYOUTS, whose records the reference decoder
# (formats/decode.py) also reads, with float16 scales; unpacked block by block into integers
# (code_dots) its products ran 7x slower than ik's.
E8M0_LAYOUTS = {T.MXFP4: Layout(T.MXFP4, (Run(n=32, xoff=0, off=1, shift=0, mask=15, split=True, d_at=0),),
                                grid=MXFP4_VALUES)}

# the kernel selector per stored type (each compiles its own loop: _row_dot): the float rows, then
# every type whose block layout quantkit.layouts declares, then the types code_dots unpacks
KIND = {q: k for k, q in enumerate((T.F32, T.F16, T.BF16, *LAYOUTS, *E8M0_LAYOUTS, *CODED))}
FLOAT_KINDS = len(D.FLOAT_FORMATS)      # kinds below this multiply float rows with float activations


def _row_shape(t) -> tuple[int, int, int]:
    return t.block_size, t.type_size, t.row_meta_size


def _kinds() -> dict[QuantType, int]:
    kinds = {}
    for q, t in TYPE_TRAITS.items():
        kind = KIND.get(q, KIND.get(t.base) if t.interleave_rows > 1 else None)
        # an interleaved type without a kernel of its own is regrouped into its base's rows
        # (Weight.plain_layout) only where its rows are the base's, regrouped
        if q not in KIND and t.interleave_rows > 1 and kind is not None and _row_shape(TYPE_TRAITS[t.base]) != _row_shape(t):
            kind = None
        if kind is not None:
            kinds[q] = kind
    return kinds


_KIND_OF = _kinds()


def regroups(qtype: QuantType) -> bool:
    """Whether the kernel of ``qtype`` reads its base type's plain rows (``Weight.plain_layout``):
    the interleaved types that are their base's rows regrouped; the others are read as stored."""
    return TYPE_TRAITS[QuantType(qtype)].interleave_rows > 1 and QuantType(qtype) not in KIND


def kind_of(qtype: QuantType) -> int | None:
    """The kernel selector for rows of ``qtype`` (its plain type's for interleaved types), or None
    when no fused kernel computes them."""
    return _KIND_OF.get(qtype)


# stored type -> (kernel selector, whether the kernel reads the base type's regrouped rows): the
# one lookup a generation step's product makes (regroups' QuantType() conversion cost a
# microsecond per product, 200 products a SmolLM2 step)
FUSED = {q: (k, regroups(q)) for q, k in _KIND_OF.items()}

# interleaved types whose generation steps read the stored groups of rows, R rows at once
# (group_dot.py): stored type -> kernel selector, after every kind above.  FUSED keeps their
# regrouped base kind, which a batch's products (matmul8) take
STEP = {q: len(KIND) + i for i, q in enumerate(group_dot.ROWS)}
_GROUP_ROWS = {k: traits(q).interleave_rows for q, k in STEP.items()}


def check_rows(kind: int, blocks: np.ndarray, n_in: int) -> None:
    """ValueError unless ``blocks`` (n_rows, row_size) are whole rows of n_in values of the type
    ``kind`` selects, in whole groups for an interleaved kind: the kernels read without bounds
    checks."""
    qtype = _TYPE_OF_KIND[kind]
    t = traits(qtype)
    n_rows, row_size = blocks.shape
    group = _GROUP_ROWS.get(kind, 1)
    if n_in % t.block_size or row_size != t.row_size(n_in):
        raise ValueError(f"{type_name(qtype)}: rows of {row_size} bytes are not {n_in} values")
    if n_rows % group:
        raise ValueError(f"{type_name(qtype)}: {n_rows} rows are not a multiple of {group}")


# ---- the chunk dots of each type, from its layout (quantkit.layouts) ----
#
# Legacy types (a float16 scale per block) are read 8 blocks (256 values) per chunk, and a row's
# last n % 256 values in chunks of 4, 2 and 1 blocks; super-block types one super-block per chunk.

LEGACY = {**{q: lay for q, lay in LAYOUTS.items() if lay.sup is None}, **E8M0_LAYOUTS}
SUPER = {q: lay for q, lay in LAYOUTS.items() if lay.sup is not None}
TABLES = {q: NO_TABLE if lay.grid is None else _padded(lay.grid) for q, lay in {**LAYOUTS, **E8M0_LAYOUTS}.items()}


def _legacy_chunk(lay, n_blocks: int):
    """The chunk dot of n_blocks consecutive blocks of a legacy layout."""
    runs = tuple(r.moved(lay.block_bytes * i, lay.block_values * i) for i in range(n_blocks) for r in lay.runs)
    return D.chunk_dot(runs, table=lay.grid is not None, e8m0=lay.qtype in E8M0_LAYOUTS)


# chunk dots of 8, 4, 2 and 1 blocks, made once (numba caches what uses them): a row's last
# n % 256 values take at most one of each of the smaller ones
CHUNK_BLOCKS = (8, 4, 2, 1)
_LEGACY_CHUNKS = {q: tuple(_legacy_chunk(lay, n) for n in CHUNK_BLOCKS) for q, lay in LEGACY.items()}
SUPER_CHUNKS = {q: D.chunk_dot(lay.runs, table=lay.grid is not None, sup=lay.sup) for q, lay in SUPER.items()}

_TYPE_OF_KIND = {k: q for q, k in {**KIND, **STEP}.items()}


# ---- row dots, one compiled loop per type ----

def _float_row(kind):
    """The row at byte bo of b · x[xo:xo + n] for a float type (kind < FLOAT_KINDS): 32 values per
    vector dot, the rest one by one."""
    dot32, at = D.FLOAT_READERS[kind]
    size = 4 if D.FLOAT_FORMATS[kind] == "f32" else 2

    def row(b, bo, x, xo, n):
        s = F(0)
        n32 = n // 32 * 32
        for j in range(0, n32, 32):
            s += dot32(b, bo + size * j, x, xo + j)
        for j in range(n32, n):
            s += at(b, bo + size * j) * x[xo + j]
        return s
    return njit(row, inline="always")


def _float_rows4(kind):
    """Four rows at byte bo, bo + rs, bo + 2 rs, bo + 3 rs of b · x[xo:xo + n] for a float type:
    each row's operations those of :func:`_float_row`, in its order, the four chains side by
    side (one row at a time, its chain of adds kept a float row's product from streaming its
    weights: 17 GB/s a thread against 22 for ggml's, on F32 rows of 576)."""
    dot32, at = D.FLOAT_READERS[kind]
    size = 4 if D.FLOAT_FORMATS[kind] == "f32" else 2

    def rows4(b, bo, rs, x, xo, n):
        s0 = s1 = s2 = s3 = F(0)
        n32 = n // 32 * 32
        for j in range(0, n32, 32):
            o = bo + size * j
            s0 += dot32(b, o, x, xo + j)
            s1 += dot32(b, o + rs, x, xo + j)
            s2 += dot32(b, o + 2 * rs, x, xo + j)
            s3 += dot32(b, o + 3 * rs, x, xo + j)
        for j in range(n32, n):
            o = bo + size * j
            xj = x[xo + j]
            s0 += at(b, o) * xj
            s1 += at(b, o + rs) * xj
            s2 += at(b, o + 2 * rs) * xj
            s3 += at(b, o + 3 * rs) * xj
        return s0, s1, s2, s3
    return njit(rows4, inline="always")


def _legacy_row(qtype):
    """The row at byte bo of b · the n activations from xo on, for a legacy type: 8 blocks per
    chunk dot, then the row's last n % 256 values in chunks of 4, 2 and 1 blocks."""
    chunk8, chunk4, chunk2, chunk1 = _LEGACY_CHUNKS[qtype]
    block_bytes, block_values = LEGACY[qtype].block_bytes, LEGACY[qtype].block_values
    assert block_values == 32 and CHUNK_BLOCKS[0] * block_values == 256
    table = TABLES[qtype]

    def row(b, bo, xq, xd, xsum, xo, n):
        nb = n // 32
        s = F(0)
        ib = 0
        while ib + 8 <= nb:
            s += chunk8(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 8
        if ib + 4 <= nb:
            s += chunk4(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 4
        if ib + 2 <= nb:
            s += chunk2(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 2
        if ib < nb:
            s += chunk1(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
        return s
    return njit(row, inline="always")


def _super_row(qtype):
    """The row at byte bo of b · the n activations from xo on, for a super-block type: one chunk
    dot per super-block of 256."""
    chunk = SUPER_CHUNKS[qtype]
    table = TABLES[qtype]
    block_bytes, meta = SUPER[qtype].block_bytes, SUPER[qtype].row_scale_bytes
    assert meta in (0, 2, 4) and SUPER[qtype].block_values == 256

    def row(b, bo, xq, xd, xsum, xo, n):
        s = F(0)
        for sb in range(n // 256):
            s += chunk(b, bo + meta + block_bytes * sb, table, xq, xd, xsum, xo + 256 * sb)
        # a row scale in front of the blocks (float32, or float16) multiplies the whole row
        if meta == 4:
            return s * D.f32_at(b, bo)
        return s * D.half_at(b, bo) if meta == 2 else s
    return njit(row, inline="always")


def row_dot(kind, b, bo, x, xq, xd, xsum, xo, n, scratch):
    """The row at byte bo of b (of the type ``kind``) · x[xo:xo + n] (float types) or · the
    rounded activations xq * xd from xo on (the others); ``scratch``: the task's buffers
    (:func:`task_scratch`).
    Offsets, not views: a view per row costs a reference count up and down, shared by the threads."""
    raise NotImplementedError("called from numba code only")


@overload(row_dot, prefer_literal=True, inline="always")
def _row_dot(kind, b, bo, x, xq, xd, xsum, xo, n, scratch):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value
    if k < FLOAT_KINDS:
        frow = _float_row(k)
        return lambda kind, b, bo, x, xq, xd, xsum, xo, n, scratch: frow(b, bo, x, xo, n)
    qtype = _TYPE_OF_KIND[k]
    if qtype in code_dots.FILLS:
        crow = coded_row(qtype)
        return lambda kind, b, bo, x, xq, xd, xsum, xo, n, scratch: crow(b, bo, xq, xd, xsum, xo, n, scratch[0], scratch[1], scratch[2])
    if qtype in CODED:
        brow = coded_row(qtype)
        return lambda kind, b, bo, x, xq, xd, xsum, xo, n, scratch: brow(b, bo, xq, xd, xsum, xo, n)
    row = _legacy_row(qtype) if qtype in LEGACY else _super_row(qtype)
    return lambda kind, b, bo, x, xq, xd, xsum, xo, n, scratch: row(b, bo, xq, xd, xsum, xo, n)


def task_scratch(kind):
    """The buffers the rows of one task unpack their blocks into: code_dots' types only (the
    others get none, and allocate nothing)."""
    raise NotImplementedError("called from numba code only")


@overload(task_scratch, prefer_literal=True, inline="always")
def _task_scratch(kind):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    if _TYPE_OF_KIND[kind.literal_value] in code_dots.FILLS:
        return lambda kind: new_scratch()
    return lambda kind: ()


def rows_into(kind, b, row_size, r0, r1, xf, xq, xd, xsum, n_tok, n_in, out, out_stride):
    """out[t * out_stride + r] = row r of b (rows of row_size bytes, of the type ``kind``) · token
    t, for the rows r0..r1 and the n_tok tokens of xf (float32) or of their rounding xq, xd, xsum:
    a task's rows, one at a time (row_dot), or for an interleaved kind (STEP) a group of rows at a
    time (group_dot: r0, r1 on group boundaries)."""
    raise NotImplementedError("called from numba code only")


@overload(rows_into, prefer_literal=True, inline="always")
def _rows_into(kind, b, row_size, r0, r1, xf, xq, xd, xsum, n_tok, n_in, out, out_stride):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    group = _GROUP_ROWS.get(kind.literal_value)
    if group is not None:
        grow = group_dot.ROWS[_TYPE_OF_KIND[kind.literal_value]]

        def grouped(kind, b, row_size, r0, r1, xf, xq, xd, xsum, n_tok, n_in, out, out_stride):
            for r in range(r0, r1, group):
                for t in range(n_tok):
                    grow(b, r * row_size, xq, xd, xsum, t * n_in, n_in, out, t * out_stride + r)
        return grouped

    if kind.literal_value < FLOAT_KINDS:
        frow4 = _float_rows4(kind.literal_value)

        def float_rows(kind, b, row_size, r0, r1, xf, xq, xd, xsum, n_tok, n_in, out, out_stride):
            r4 = r0 + (r1 - r0) // 4 * 4
            for r in range(r0, r4, 4):
                for t in range(n_tok):
                    s0, s1, s2, s3 = frow4(b, r * row_size, row_size, xf, t * n_in, n_in)
                    o = t * out_stride + r
                    out[o], out[o + 1], out[o + 2], out[o + 3] = s0, s1, s2, s3
            for r in range(r4, r1):
                for t in range(n_tok):
                    out[t * out_stride + r] = row_dot(kind, b, r * row_size, xf, xq, xd, xsum, t * n_in, n_in, ())
        return float_rows

    def rows(kind, b, row_size, r0, r1, xf, xq, xd, xsum, n_tok, n_in, out, out_stride):
        scratch = task_scratch(kind)
        for r in range(r0, r1):
            for t in range(n_tok):
                out[t * out_stride + r] = row_dot(kind, b, r * row_size, xf, xq, xd, xsum, t * n_in, n_in, scratch)
    return rows


ROWS_PER_TASK = 16
assert all(ROWS_PER_TASK % g == 0 for g in _GROUP_ROWS.values())     # a task's rows are whole groups


@njit(**_OPTS)
def round_q8(x, xq, xd, xsum):
    """The activations x (n_tokens, n) as ggml's q8_0 rounds them, per 32: d = fp16(amax / 127),
    xq = rint(x * 127 / amax) (int8), xd = d, xsum = d * Σ xq; the values they
    stand for are xq * xd (kernels.round_q8_0_rows)."""
    for t in range(x.shape[0]):
        for blk in range(x.shape[1] // 32):
            amax = F(0)
            for i in range(32 * blk, 32 * blk + 32):
                amax = max(amax, abs(x[t, i]))
            inv = F(127.0) / amax if amax > 0 else F(0)
            total = 0
            for i in range(32 * blk, 32 * blk + 32):
                q = np.int8(np.rint(x[t, i] * inv))
                xq[t, i] = q
                total += q
            xd[t, blk] = half_round(amax / F(127.0))
            xsum[t, blk] = xd[t, blk] * F(total)


@njit(cache=True, error_model="numpy", parallel=True)
def _matvec(blocks, x, out, kind):
    """out[t, r] = row r of ``blocks`` (n_rows, row_size uint8, of the type ``kind`` selects; a
    literal, so each type compiles its own loop) · x[t], for the few tokens t of x (n_tokens, n_in)."""
    n_tok, n_in = x.shape
    n_rows, row_size = blocks.shape
    flat, xf = blocks.reshape(n_rows * row_size), x.reshape(n_tok * n_in)
    # np.empty: under parallel=True each np.zeros is a parallel loop of its own (2 us a launch)
    xq = np.empty(n_tok * n_in, np.int8)
    xd = np.empty(n_tok * n_in // 32, F)
    xsum = np.empty(n_tok * n_in // 32, F)
    if kind >= FLOAT_KINDS:
        round_q8(x, xq.reshape(n_tok, n_in), xd.reshape(n_tok, n_in // 32), xsum.reshape(n_tok, n_in // 32))
    of = out.reshape(n_tok * n_rows)
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        rows_into(kind, flat, row_size, task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK),
                  xf, xq, xd, xsum, n_tok, n_in, of, n_rows)


_U8_2D, _F32_2D = types.Array(types.uint8, 2, "C"), types.Array(types.float32, 2, "C")
_ENTRY: dict[int, object] = {}


def _kernel(kind: int):
    """_matvec compiled (or loaded from numba's cache) for the literal ``kind`` and called
    directly: through the dispatcher a literal argument costs a failed plain-int typing per call."""
    fn = _ENTRY.get(kind)
    if fn is None:
        sig = (_U8_2D, _F32_2D, _F32_2D, types.literal(kind))
        _matvec.compile(sig)
        fn = _ENTRY[kind] = _matvec.overloads[sig].entry_point
    return fn


def matvec(kind: int, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (n_tokens, n_in) float32 · the rows of ``blocks`` (n_rows, row_size uint8, of the type
    ``kind`` selects) -> (n_tokens, n_rows) float32; for a few tokens (each row is read once per
    token)."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    x = np.ascontiguousarray(x, F)
    if kind in _GROUP_ROWS:
        check_rows(kind, blocks, x.shape[1])
    out = np.empty((x.shape[0], blocks.shape[0]), F)
    (_ENTRY.get(kind) or _kernel(kind))(blocks, x, out, kind)
    return out


# ---- several weights in one parallel launch (a generation step's q/k/v, gate/up) ----
#
# A launch of a parallel numba loop costs 2-10 us of waking and joining threads (more where the
# machine is busy), and a SmolLM2 step made 211 of them, each with its own Python call and its own
# rounding of the same activations.  :func:`products` multiplies any number of weights, each of
# any kind, with one input rounded once, in one parallel loop over all their tasks of rows.  Each
# kind's loop over a range of rows is compiled once as a C function (``_rows_fn``), and the loop
# calls it through its address: one driver serves every mix of kinds (a driver per combination of
# literal kinds would compile once per mix a file has).  The row dots are row_dot's, so each
# output value is the same bits as ``_matvec`` gives.

_ADDR = types.int64


@intrinsic
def _pointer(typingctx, addr, dtype):
    """The int64 address ``addr`` as a pointer to ``dtype`` values (a numba carray's data)."""
    elt = dtype.dtype if isinstance(dtype, types.NumberClass) else dtype

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(elt)))
    return types.CPointer(elt)(addr, dtype), codegen


_ROWS_ARGS = 12          # rows(b, row_size, r0, r1, n_in, n_tok, x, xq, xd, xsum, out, out_stride)


@intrinsic
def _call_rows(typingctx, fn, b, row_size, r0, r1, n_in, n_tok, x, xq, xd, xsum, out, out_stride):
    """Call the C function at address ``fn`` (a ``_rows_fn``) with its 12 int64 arguments."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64] * (_ROWS_ARGS + 1))
        # the kind: a literal of the compiled rows function, which its C wrapper takes and ignores
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [ir.Constant(i64, 0), *args[1:]])
        return context.get_dummy_value()
    return types.none(*([_ADDR] * (_ROWS_ARGS + 1))), codegen


@njit(cache=True, error_model="numpy", nogil=True)
def _rows(kind, b, row_size, r0, r1, n_in, n_tok, x, xq, xd, xsum, out, out_stride):
    """Rows r0..r1 of a weight of the type ``kind`` selects (a literal: each kind compiles its own;
    n_rows x row_size uint8 at address b) · each of the n_tok tokens of x (float32, address) or of
    its rounding (xq int8, xd, xsum float32) -> out[t * out_stride + r] (float32, address).  Called
    by :func:`_products` through the address of its C wrapper (``_rows_fn``)."""
    flat = carray(_pointer(b, np.uint8), r1 * row_size)
    xf = carray(_pointer(x, np.float32), n_tok * n_in)
    q = carray(_pointer(xq, np.int8), n_tok * n_in)
    d = carray(_pointer(xd, np.float32), n_tok * n_in // 32)
    s = carray(_pointer(xsum, np.float32), n_tok * n_in // 32)
    o = carray(_pointer(out, np.float32), n_tok * out_stride)
    # the buffers code_dots.FILLS kinds unpack a row's blocks into (the ternary types, q8_KV,
    # iq1_s_r4, ...): made by rows_into in each call, i.e. each task of rows on its thread, and held
    # as arrays until its rows are done; no two tasks share them (they were what first showed
    # _products freeing its rounded activations before the loop read them: see _products)
    rows_into(kind, flat, row_size, r0, r1, xf, q, d, s, n_tok, n_in, o, out_stride)


_ROWS: dict[int, int] = {}          # kind -> address of the C wrapper of _rows compiled for it


def _rows_fn(kind: int) -> int:
    """The address of ``_rows``' C wrapper for the literal ``kind`` (compiled, or loaded from
    numba's cache, on first use: through the dispatcher, which announces compiles), called with
    the kind then the 12 int64 arguments."""
    addr = _ROWS.get(kind)
    if addr is None:
        sig = (types.literal(kind), *([_ADDR] * _ROWS_ARGS))
        _rows.compile(sig)
        cres = _rows.overloads[sig]
        addr = _ROWS[kind] = cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)
    return addr


# a product table's columns, one row per weight
T_FN, T_BLOCKS, T_ROWS, T_ROW_SIZE, T_OUT, T_FIRST_TASK = range(6)
_TABLE_COLUMNS = 6


@njit(cache=True, error_model="numpy", parallel=True)
def _products(table, x, out, rounded, xq, xd, xsum):
    """Every weight of ``table`` (int64, one row per weight: its rows function, blocks address,
    rows, row size, first column in out, first task; a last row holding the total of tasks in
    T_FIRST_TASK) · x (n_tokens, n_in) float32 -> out (n_tokens, all rows) float32, the weights'
    columns side by side, in one parallel loop over tasks of ROWS_PER_TASK rows.  ``rounded``: x
    rounded to 8 bits first (the weights are not all float), into xq (n_tokens * n_in int8), xd
    and xsum (n_tokens * n_in / 32 float32).

    Every array whose address the loop passes on is an argument, held by the caller: an array
    made here would be freed after its last use as an array, before the loop that reads it through
    its address, and its memory reused (the parallel loop's own allocations, a task's unpacking
    buffers): the steps' results changed from run to run."""
    n_tok, n_in = x.shape
    if rounded:
        round_q8(x, xq.reshape(n_tok, n_in), xd.reshape(n_tok, n_in // 32), xsum.reshape(n_tok, n_in // 32))
    xa, qa, da, sa, oa = x.ctypes.data, xq.ctypes.data, xd.ctypes.data, xsum.ctypes.data, out.ctypes.data
    stride = out.shape[1]
    n_w = table.shape[0] - 1
    for task in prange(table[n_w, T_FIRST_TASK]):
        w = 0
        while task >= table[w + 1, T_FIRST_TASK]:
            w += 1
        n_rows = table[w, T_ROWS]
        r0 = (task - table[w, T_FIRST_TASK]) * ROWS_PER_TASK
        _call_rows(table[w, T_FN], table[w, T_BLOCKS], table[w, T_ROW_SIZE], r0, min(n_rows, r0 + ROWS_PER_TASK),
                   n_in, n_tok, xa, qa, da, sa, oa + 4 * table[w, T_OUT], stride)


class Products:
    """The products of several weights with one input, in one parallel launch (:func:`_products`):
    ``parts`` [(kind, blocks (n_rows, row_size) uint8)], all rows of the same length; calling it
    with x (n_tokens, n_in) float32 (C-contiguous) returns each weight's (n_tokens, n_rows)
    float32, the same values matvec gives (views of one output array: columns side by side)."""

    def __init__(self, parts):
        self.blocks = [np.ascontiguousarray(b, np.uint8) for _, b in parts]     # kept: the table holds their addresses
        kinds = [k for k, _ in parts]
        # the values per row each part's row size stands for: an input of another length is
        # refused (the kernels read without bounds checks), as are partial groups of rows
        n_ins = set()
        for k, b in zip(kinds, self.blocks):
            t = traits(_TYPE_OF_KIND[k])
            n_ins.add((b.shape[1] - t.row_meta_size) // t.type_size * t.block_size)
            check_rows(k, b, (b.shape[1] - t.row_meta_size) // t.type_size * t.block_size)
        if len(n_ins) > 1:
            raise ValueError("Products: rows of different lengths")
        self.n_in = n_ins.pop() if n_ins else 0
        self.rounded = any(k >= FLOAT_KINDS for k in kinds)
        rows = np.array([b.shape[0] for b in self.blocks], np.int64)
        bounds = np.concatenate([[0], np.cumsum(rows)])
        self.n_out = int(bounds[-1])
        self.columns = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(len(parts))]
        table = np.zeros((len(parts) + 1, _TABLE_COLUMNS), np.int64)
        table[:-1, T_FN] = [_rows_fn(k) for k in kinds]
        table[:-1, T_BLOCKS] = [b.ctypes.data for b in self.blocks]
        table[:-1, T_ROWS] = rows
        table[:-1, T_ROW_SIZE] = [b.shape[1] for b in self.blocks]
        table[:-1, T_OUT] = bounds[:-1]
        table[:, T_FIRST_TASK] = np.concatenate([[0], np.cumsum(-(-rows // ROWS_PER_TASK))])
        self.table = table

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        n_tok, n_in = x.shape
        if n_in != self.n_in or not x.flags.c_contiguous or x.dtype != F:
            raise ValueError(f"Products: x of {n_in} values (float32, C-contiguous) for rows of {self.n_in}")
        out = np.empty((n_tok, self.n_out), F)
        xq, xd, xsum = np.empty(n_tok * n_in, np.int8), np.empty(n_tok * n_in // 32, F), np.empty(n_tok * n_in // 32, F)
        _PRODUCTS(self.table, x, out, self.rounded, xq, xd, xsum)
        return [out[:, c] for c in self.columns]


def _products_entry():
    f32 = types.Array(types.float32, 1, "C")
    sig = (types.Array(types.int64, 2, "C"), _F32_2D, _F32_2D, types.boolean, types.Array(types.int8, 1, "C"), f32, f32)
    _products.compile(sig)
    return _products.overloads[sig].entry_point


def _PRODUCTS(*args):
    """_products' compiled entry point, made ready on the first call (then called directly)."""
    global _PRODUCTS
    _PRODUCTS = _products_entry()
    return _PRODUCTS(*args)
