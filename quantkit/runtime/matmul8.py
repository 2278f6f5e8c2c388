"""A batch's products with 8-bit activations: the packed rows times a block of tokens at a time.

The activations are rounded to 8 bits per 32 as a generation step rounds them (matvec.round_q8),
and each row's chunks are multiplied with the codes of TOKEN_BLOCK tokens at once
(dot_batch.chunk_dot_batch: a chunk unpacked once for all of them).  Per token the result is the
bits matvec's fused kernel gives (the same chunk sums in the same order), so the logits of a
prompt are those its tokens would get one generation step at a time; ik_llama.cpp multiplies its
prompts with 8-bit activations too (iqk_mul_mat), and reading each packed row once per token block
instead of decoding it to float32 for BLAS is what makes a prompt fast.

The rows are split between the tile pool's threads (tiles.by_rows), each running the kernel below
single-threaded; the types are those whose chunk dots the layouts describe (matvec's legacy and
super-block types, interleaved ones through their plain rows); the others (float rows, the types
code_dots unpacks) keep the decoded tiles (ops_cpu.matmul_q).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import matvec
from .dot import f32_at, half_at
from .dot_batch import chunk_dot_batch
from .matvec import CHUNK_BLOCKS, LEGACY, SUPER, TABLES, E8M0_LAYOUTS
from .tiles import by_rows

F = np.float32

# tokens multiplied with one unpacked chunk: their 8-bit activations (TOKEN_BLOCK x n_in bytes)
# stay in L1/L2 while a thread's rows stream past them
TOKEN_BLOCK = 32


def _legacy_chunks(qtype):
    lay = LEGACY[qtype]
    runs = [tuple(r.moved(lay.block_bytes * i, lay.block_values * i) for i in range(n) for r in lay.runs)
            for n in CHUNK_BLOCKS]
    return tuple(chunk_dot_batch(rs, table=lay.grid is not None, e8m0=qtype in E8M0_LAYOUTS) for rs in runs)


_TYPE_OF_KIND = {k: q for q, k in matvec.KIND.items()}
# the kinds this module multiplies: matvec's legacy and super-block layouts
KINDS = frozenset(matvec.KIND[q] for q in (*LEGACY, *SUPER))
_LEGACY_BATCH = {q: _legacy_chunks(q) for q in LEGACY}
_SUPER_BATCH = {q: chunk_dot_batch(lay.runs, table=lay.grid is not None, sup=lay.sup) for q, lay in SUPER.items()}


def _legacy_row(qtype):
    """acc[t] = the row at byte bo of b · token t's activations (t < nt, from xo on, stride n
    apart): matvec._legacy_row's chunks of 8, 4, 2 and 1 blocks."""
    chunk8, chunk4, chunk2, chunk1 = _LEGACY_BATCH[qtype]
    block_bytes = LEGACY[qtype].block_bytes
    table = TABLES[qtype]

    def row(b, bo, xq, xd, xsum, xo, n, nt, acc):
        for t in range(nt):
            acc[t] = F(0)
        nb = n // 32
        ib = 0
        while ib + 8 <= nb:
            chunk8(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib, n, nt, acc)
            ib += 8
        if ib + 4 <= nb:
            chunk4(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib, n, nt, acc)
            ib += 4
        if ib + 2 <= nb:
            chunk2(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib, n, nt, acc)
            ib += 2
        if ib < nb:
            chunk1(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib, n, nt, acc)
    return njit(row, inline="always")


def _super_row(qtype):
    """As _legacy_row for a super-block type (matvec._super_row): a chunk per super-block, then
    the row's scale, if it has one, times each token's sum."""
    chunk = _SUPER_BATCH[qtype]
    table = TABLES[qtype]
    block_bytes, meta = SUPER[qtype].block_bytes, SUPER[qtype].row_scale_bytes

    def row(b, bo, xq, xd, xsum, xo, n, nt, acc):
        for t in range(nt):
            acc[t] = F(0)
        for sb in range(n // 256):
            chunk(b, bo + meta + block_bytes * sb, table, xq, xd, xsum, xo + 256 * sb, n, nt, acc)
        if meta == 4:
            scale = f32_at(b, bo)
            for t in range(nt):
                acc[t] = acc[t] * scale
        elif meta == 2:
            scale = half_at(b, bo)
            for t in range(nt):
                acc[t] = acc[t] * scale
    return njit(row, inline="always")


def row_dots(kind, b, bo, xq, xd, xsum, xo, n, nt, acc):
    """acc[t] = the row at byte bo of b (of the type ``kind``) · token t's rounded activations,
    for t < nt (token t's from xo + t * n on)."""
    raise NotImplementedError("called from numba code only")


@overload(row_dots, prefer_literal=True, inline="always")
def _row_dots(kind, b, bo, xq, xd, xsum, xo, n, nt, acc):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    qtype = _TYPE_OF_KIND[kind.literal_value]
    row = _legacy_row(qtype) if qtype in LEGACY else _super_row(qtype)
    return lambda kind, b, bo, xq, xd, xsum, xo, n, nt, acc: row(b, bo, xq, xd, xsum, xo, n, nt, acc)


@njit(cache=True, error_model="numpy", nogil=True)
def _rows(blocks, xq, xd, xsum, out, r0, r1, kind):
    """out[t, r] for the rows r0 <= r < r1 of ``blocks`` (the type ``kind``, a literal) and every
    token t of the rounded activations xq (n_tokens, n_in), xd and xsum (n_tokens, n_in // 32)."""
    n_tok, n_in = xq.shape
    row_size = blocks.shape[1]
    flat = blocks.reshape(blocks.shape[0] * row_size)
    q, d, s = xq.reshape(n_tok * n_in), xd.reshape(n_tok * n_in // 32), xsum.reshape(n_tok * n_in // 32)
    acc = np.empty(TOKEN_BLOCK, F)
    for t0 in range(0, n_tok, TOKEN_BLOCK):
        nt = min(TOKEN_BLOCK, n_tok - t0)
        for r in range(r0, r1):
            row_dots(kind, flat, r * row_size, q, d, s, t0 * n_in, n_in, nt, acc)
            for t in range(nt):
                out[t0 + t, r] = acc[t]


@njit(cache=True, error_model="numpy", nogil=True)
def _round(x, xq, xd, xsum, r0, r1):
    matvec.round_q8(x[r0:r1], xq[r0:r1], xd[r0:r1], xsum[r0:r1])


_U8_2D, _I8_2D, _F32_2D = (types.Array(t, 2, "C") for t in (types.uint8, types.int8, types.float32))
_ENTRY: dict[int, object] = {}


def _kernel(kind: int):
    """_rows compiled (or loaded from numba's cache) for the literal ``kind``, called directly
    (as matvec._kernel: no dispatcher typing per call)."""
    fn = _ENTRY.get(kind)
    if fn is None:
        sig = (_U8_2D, _I8_2D, _F32_2D, _F32_2D, _F32_2D, types.int64, types.int64, types.literal(kind))
        _rows.compile(sig)
        fn = _ENTRY[kind] = _rows.overloads[sig].entry_point
    return fn


def supports(kind: int | None) -> bool:
    return kind in KINDS


def matmul8(kind: int, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (n_tokens, n_in) float32 · the rows of ``blocks`` (n_rows, row_size uint8, of the type
    ``kind`` selects: one of KINDS) -> (n_tokens, n_rows) float32, with the activations rounded to
    8 bits per 32; row for row and token for token the bits of ``matvec.matvec``."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    x = np.ascontiguousarray(x, F)
    n_tok, n_in = x.shape
    xq = np.empty((n_tok, n_in), np.int8)
    xd = np.empty((n_tok, n_in // 32), F)
    xsum = np.empty((n_tok, n_in // 32), F)
    by_rows(lambda r0, r1: _round(x, xq, xd, xsum, r0, r1), n_tok)
    out = np.empty((n_tok, blocks.shape[0]), F)
    fn = _ENTRY.get(kind) or _kernel(kind)
    by_rows(lambda r0, r1: fn(blocks, xq, xd, xsum, out, r0, r1, kind), blocks.shape[0], n_tok)
    return out
