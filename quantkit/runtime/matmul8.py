"""A batch's products with 8-bit activations: the packed rows times a block of tokens at a time.

The activations are rounded to 8 bits per 32 as a generation step rounds them (matvec.round_q8's
operations), and per (row, token) the result is the bits matvec's fused kernel gives (the same
chunk sums, the same float operations in the same order), so the logits of a prompt are those its
tokens would get one generation step at a time; ik_llama.cpp multiplies its prompts with 8-bit
activations too (iqk_mul_mat), and reading each packed row once per token block instead of
decoding it to float32 for BLAS is what makes a prompt fast.

Two kernels, by what the CPU numba compiles for has (quantkit/cpu.py):

* with VNNI (vpdpbusd): tiles of TILE_ROWS rows x TOKENS tokens (dot_tiles.py), a token per vector
  lane: each row unpacked once for the whole batch, the activations packed once per input
  (``_pack``, shared by the products of one input: matmul8_many), no sum crossing lanes;
  SmolLM2's products 3x faster than the kernel below (Zen 5, one thread);
* elsewhere (generic targets too): each row's chunks multiplied with the codes of TOKEN_BLOCK
  tokens at once (dot_batch.chunk_dot_batch: a chunk unpacked once for all of them, then
  chunk_dot's work per token).

The rows are split between the tile pool's threads (tiles.pool), each running a kernel below
single-threaded; the types are those whose chunk dots the layouts describe (matvec's legacy and
super-block types, interleaved ones through their plain rows) and the grid i-quants (code_dots'
BLOCK_DOTS: grid_tiles.py's tiles and, without VNNI, its row dots, with the step's grid_dot
float operations); the others (float rows, the types code_dots fills) keep the decoded tiles
(ops_cpu.matmul_q).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import grid_tiles, matvec
from .code_dots import BLOCK_DOTS
from .dot import _VNNI, f32_at, half_at
from .dot_batch import chunk_dot_batch
from .dot_tiles import CHUNK_BYTES, TOKENS, amax32, quantize32, tile_chunk, unpack_chunk
from .kernels import _f16_value as half_round
from .matvec import CHUNK_BLOCKS, LEGACY, SUPER, TABLES, E8M0_LAYOUTS
from .tiles import by_rows, pool

F = np.float32

# tokens multiplied with one unpacked chunk: their 8-bit activations (TOKEN_BLOCK x n_in bytes)
# stay in L1/L2 while a thread's rows stream past them
TOKEN_BLOCK = 32
# with vpdpbusd (VNNI) the tiles of dot_tiles.py, else dot_batch's chunk dots per token
TILED = _VNNI


def _legacy_chunks(qtype):
    lay = LEGACY[qtype]
    runs = [tuple(r.moved(lay.block_bytes * i, lay.block_values * i) for i in range(n) for r in lay.runs)
            for n in CHUNK_BLOCKS]
    return tuple(chunk_dot_batch(rs, table=lay.grid is not None, e8m0=qtype in E8M0_LAYOUTS) for rs in runs)


_TYPE_OF_KIND = {k: q for q, k in matvec.KIND.items()}
# the kinds this module multiplies: matvec's legacy and super-block layouts, and the grid i-quants
# (code_dots.BLOCK_DOTS: grid_tiles.py)
KINDS = frozenset(matvec.KIND[q] for q in (*LEGACY, *SUPER, *BLOCK_DOTS))
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
    if qtype in BLOCK_DOTS:
        row = grid_tiles.row_dots(BLOCK_DOTS[qtype][1], BLOCK_DOTS[qtype][0])
    else:
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



# ---- tiles of rows x tokens (dot_tiles.py: vpdpbusd with a token per lane; CPUs with VNNI) ----

# rows multiplied together with a block of TOKENS tokens: each 4 activation bytes of the tokens
# loaded once for all of them (their codes unpacked once per row for the whole batch); 8 where
# AVX-512 has 32 vector registers (5-10% faster than 4 on Zen 5), else 4
TILE_ROWS = 8 if TOKENS == 16 else 4


def _run_n(qtype) -> int:
    """The values per run whose activation sums a type's run mins take (Q2_K), else 0."""
    sup = SUPER[qtype].sup if qtype in SUPER else None
    return SUPER[qtype].runs[0].n if sup is not None and sup.run_mins else 0


def _legacy_tile_parts(qtype):
    lay = LEGACY[qtype]
    out = []
    for n in CHUNK_BLOCKS:
        runs = tuple(r.moved(lay.block_bytes * i, lay.block_values * i) for i in range(n) for r in lay.runs)
        e8m0 = qtype in E8M0_LAYOUTS
        out.append((unpack_chunk(runs, table=lay.grid is not None, e8m0=e8m0), tile_chunk(runs, e8m0=e8m0, rows=TILE_ROWS)))
    return tuple(out)


def _legacy_tiled(qtype):
    """(unpack(b, bo, buf, co, n): the row at byte bo unpacked chunk by chunk from buf[co] on;
    tile(buf, co, rstride, xp, xpo, xd, xs, xdo, xr, xro, n, acc): TILE_ROWS such rows times a
    token block, the chunks of matvec._legacy_row (8, 4, 2 and 1 blocks) in its order."""
    (u8, t8), (u4, t4), (u2, t2), (u1, t1) = _legacy_tile_parts(qtype)
    block_bytes = LEGACY[qtype].block_bytes
    table = TABLES[qtype]
    cb = CHUNK_BYTES

    def unpack(b, bo, buf, co, n):
        nb = n // 32
        ib = 0
        while ib + 8 <= nb:
            u8(b, bo + block_bytes * ib, table, buf, co)
            ib += 8
            co += cb
        if ib + 4 <= nb:
            u4(b, bo + block_bytes * ib, table, buf, co)
            ib += 4
            co += cb
        if ib + 2 <= nb:
            u2(b, bo + block_bytes * ib, table, buf, co)
            ib += 2
            co += cb
        if ib < nb:
            u1(b, bo + block_bytes * ib, table, buf, co)

    def tile(buf, co, rstride, xp, xpo, xd, xs, xdo, xr, xro, n, acc):
        nb = n // 32
        ib = 0
        while ib + 8 <= nb:
            t8(buf, co, rstride, xp, xpo + 32 * TOKENS * ib, xd, xs, xdo + TOKENS * ib, xr, xro, acc)
            ib += 8
            co += cb
        if ib + 4 <= nb:
            t4(buf, co, rstride, xp, xpo + 32 * TOKENS * ib, xd, xs, xdo + TOKENS * ib, xr, xro, acc)
            ib += 4
            co += cb
        if ib + 2 <= nb:
            t2(buf, co, rstride, xp, xpo + 32 * TOKENS * ib, xd, xs, xdo + TOKENS * ib, xr, xro, acc)
            ib += 2
            co += cb
        if ib < nb:
            t1(buf, co, rstride, xp, xpo + 32 * TOKENS * ib, xd, xs, xdo + TOKENS * ib, xr, xro, acc)
    return njit(unpack, inline="always"), njit(tile, inline="always")


def _super_tiled(qtype):
    """As _legacy_tiled for a super-block type: a chunk per super-block (matvec._super_row)."""
    lay = SUPER[qtype]
    u = unpack_chunk(lay.runs, table=lay.grid is not None, sup=lay.sup)
    t = tile_chunk(lay.runs, sup=lay.sup, rows=TILE_ROWS)
    table = TABLES[qtype]
    block_bytes, meta = lay.block_bytes, lay.row_scale_bytes
    cb = CHUNK_BYTES
    run_n = _run_n(qtype)
    xr_step = 256 // run_n * TOKENS if run_n else 0

    def unpack(b, bo, buf, co, n):
        for sb in range(n // 256):
            u(b, bo + meta + block_bytes * sb, table, buf, co + cb * sb)

    def tile(buf, co, rstride, xp, xpo, xd, xs, xdo, xr, xro, n, acc):
        for sb in range(n // 256):
            t(buf, co + cb * sb, rstride, xp, xpo + 256 * TOKENS * sb, xd, xs, xdo + 8 * TOKENS * sb, xr, xro + xr_step * sb, acc)
    return njit(unpack, inline="always"), njit(tile, inline="always")


def _row_scale(qtype):
    """finish(b, bo, s): a row's sum s times the row's scale in front of its blocks, if it has one
    (matvec._super_row: the same multiply)."""
    meta = SUPER[qtype].row_scale_bytes if qtype in SUPER else 0

    def finish(b, bo, s):
        if meta == 4:
            return s * f32_at(b, bo)
        if meta == 2:
            return s * half_at(b, bo)
        return s
    return njit(finish, inline="always")


def tiled(kind, part):
    """``part`` (0 unpack, 1 tile, 2 finish) of the tiled products of the type ``kind``."""
    raise NotImplementedError("called from numba code only")


def n_chunks(kind, n):
    raise NotImplementedError("called from numba code only")


_TILED: dict = {}


@overload(tiled, prefer_literal=True, inline="always")
def _tiled(kind, part):
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(part, types.IntegerLiteral):
        return None
    qtype = _TYPE_OF_KIND[kind.literal_value]
    fns = _TILED.get(qtype)
    if fns is None and qtype in BLOCK_DOTS:
        fns = _TILED[qtype] = grid_tiles.tiled(BLOCK_DOTS[qtype][1], BLOCK_DOTS[qtype][0], TILE_ROWS)
    if fns is None:
        fns = _TILED[qtype] = (*(_legacy_tiled(qtype) if qtype in LEGACY else _super_tiled(qtype)), _row_scale(qtype))
    fn = fns[part.literal_value]
    return lambda kind, part: fn


@overload(n_chunks, prefer_literal=True, inline="always")
def _n_chunks_ov(kind, n):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    qtype = _TYPE_OF_KIND[kind.literal_value]
    if qtype in SUPER or qtype in BLOCK_DOTS:
        return lambda kind, n: n // 256

    def legacy(kind, n):
        nb = n // 32
        return nb // 8 + (nb % 8 >= 4) + (nb % 4 >= 2) + (nb % 2)
    return legacy


@njit(cache=True, error_model="numpy", nogil=True)
def _tile_rows(blocks, xp, xd, xs, xr, out, r0, r1, kind):
    """out[t, r] for the rows r0 <= r < r1 of ``blocks`` (the type ``kind``, a literal) and every
    token t < out.shape[0]: the rows unpacked TILE_ROWS at a time, then multiplied with each
    block of TOKENS packed tokens (:func:`_pack`)."""
    n_tok = out.shape[0]
    n_blk, n_in = xp.shape[0], xp.shape[1] // TOKENS
    row_size = blocks.shape[1]
    flat = blocks.reshape(blocks.shape[0] * row_size)
    xpf, xdf, xsf, xrf = xp.reshape(xp.size), xd.reshape(xd.size), xs.reshape(xs.size), xr.reshape(xr.size)
    rstride = n_chunks(kind, n_in) * CHUNK_BYTES
    buf = np.empty(TILE_ROWS * rstride, np.uint8)
    acc = np.empty(TILE_ROWS * TOKENS, F)
    unpack, tile, finish = tiled(kind, 0), tiled(kind, 1), tiled(kind, 2)
    for rb in range(r0, r1, TILE_ROWS):
        for i in range(TILE_ROWS):
            # past r1: the last row again (its sums computed, never stored)
            unpack(flat, min(rb + i, r1 - 1) * row_size, buf, i * rstride, n_in)
        nr = min(TILE_ROWS, r1 - rb)
        for blk in range(n_blk):
            acc[:] = F(0)
            tile(buf, 0, rstride, xpf, blk * xp.shape[1], xdf, xsf, blk * xd.shape[1], xrf, blk * xr.shape[1], n_in, acc)
            nt = min(TOKENS, n_tok - blk * TOKENS)
            for i in range(nr):
                for t in range(nt):
                    out[blk * TOKENS + t, rb + i] = finish(flat, (rb + i) * row_size, acc[TOKENS * i + t])


@njit(cache=True, error_model="numpy", nogil=True)
def _pack(x, xp, xd, xs, xr, run_n, b0, b1):
    """Token blocks b0 <= blk < b1 of x (n_tokens, n_in) rounded as matvec.round_q8 rounds them
    (the same operations: the same bits; dot_tiles.amax32 and quantize32) and packed for the
    tiles: xp[blk, 4 TOKENS k + 4 t + j] = xq[TOKENS blk + t, 4 k + j] + 128 (uint8); xd,
    xs[blk, TOKENS g + t]: the scale and sum of group g; xr[blk, TOKENS k + t]: Σ xq over run k
    of run_n values (run mins); tokens past n_tokens all zero."""
    n_tok, n_in = x.shape
    xf = x.reshape(n_tok * n_in)
    zero = np.zeros(32, F)
    for blk in range(b0, b1):
        row = xp[blk]
        for t in range(TOKENS):
            tok = blk * TOKENS + t
            for g in range(n_in // 32):
                at = TOKENS * g + t
                po = 4 * TOKENS * 8 * g + 4 * t
                if tok >= n_tok:
                    quantize32(zero, 0, F(0), row, po)
                    xd[blk, at] = F(0)
                    xs[blk, at] = F(0)
                else:
                    xo = tok * n_in + 32 * g
                    amax = amax32(xf, xo)
                    inv = F(127.0) / amax if amax > 0 else F(0)
                    total = quantize32(xf, xo, inv, row, po)
                    d = half_round(amax / F(127.0))
                    xd[blk, at] = d
                    xs[blk, at] = d * F(total)
                if run_n > 0:
                    for k in range(32 // run_n):
                        total = 0
                        for i in range(run_n * k, run_n * k + run_n):
                            total += np.int32(row[po + 4 * TOKENS * (i // 4) + i % 4]) - 128
                        xr[blk, TOKENS * (32 // run_n * g + k) + t] = total


_TILE_ENTRY: dict[int, object] = {}


def _tile_kernel(kind: int):
    fn = _TILE_ENTRY.get(kind)
    if fn is None:
        sig = (_U8_2D, _U8_2D, _F32_2D, _F32_2D, _I32_2D, _F32_2D, types.int64, types.int64, types.literal(kind))
        _tile_rows.compile(sig)
        fn = _TILE_ENTRY[kind] = _tile_rows.overloads[sig].entry_point
    return fn


_RUN_N = {matvec.KIND[q]: _run_n(q) for q in (*LEGACY, *SUPER)} | {matvec.KIND[q]: 0 for q in BLOCK_DOTS}


def _matmul_tiled(parts, x: np.ndarray) -> list[np.ndarray]:
    """[x · the rows of blocks for (kind, blocks) in parts]: x rounded and packed once (_pack),
    then the rows of all the parts split between the tile pool's threads in one hand-off, in
    whole tiles of TILE_ROWS where they can be."""
    n_tok, n_in = x.shape
    n_blk = -(-n_tok // TOKENS)
    run_n = max(_RUN_N[kind] for kind, _ in parts)
    assert all(_RUN_N[kind] in (0, run_n) for kind, _ in parts)
    xp = np.empty((n_blk, n_in * TOKENS), np.uint8)
    xd = np.empty((n_blk, n_in // 32 * TOKENS), F)
    xs = np.empty((n_blk, n_in // 32 * TOKENS), F)
    xr = np.empty((n_blk, (n_in // run_n if run_n else 1) * TOKENS), np.int32)
    by_rows(lambda b0, b1: _pack(x, xp, xd, xs, xr, run_n, b0, b1), n_blk, n_tok)
    outs = [np.empty((n_tok, blocks.shape[0]), F) for _, blocks in parts]
    fns = [_TILE_ENTRY.get(kind) or _tile_kernel(kind) for kind, _ in parts]
    sizes = [blocks.shape[0] for _, blocks in parts]
    total = sum(sizes)

    def rows(r0, r1):
        # rows r0 <= r < r1 of the parts' rows one after the other
        first = 0
        for (kind, blocks), out, fn, size in zip(parts, outs, fns, sizes):
            a, b = max(r0 - first, 0), min(r1 - first, size)
            if a < b:
                fn(blocks, xp, xd, xs, xr, out, a, b, kind)
            first += size
    n = pool.threads(n_tok)
    if n <= 1 or total < 2 * n * TILE_ROWS:
        rows(0, total)
    else:
        step = -(-total // (n * TILE_ROWS)) * TILE_ROWS
        pool.map(lambda r0: rows(r0, min(total, r0 + step)), range(0, total, step), n_tok)
    return outs


_U8_2D, _I8_2D, _F32_2D, _I32_2D = (types.Array(t, 2, "C") for t in (types.uint8, types.int8, types.float32, types.int32))
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
    matvec.check_rows(kind, blocks, x.shape[1])        # the kernels read without bounds checks
    if TILED:
        return _matmul_tiled([(kind, blocks)], x)[0]
    n_tok, n_in = x.shape
    xq = np.empty((n_tok, n_in), np.int8)
    xd = np.empty((n_tok, n_in // 32), F)
    xsum = np.empty((n_tok, n_in // 32), F)
    by_rows(lambda r0, r1: _round(x, xq, xd, xsum, r0, r1), n_tok)
    out = np.empty((n_tok, blocks.shape[0]), F)
    fn = _ENTRY.get(kind) or _kernel(kind)
    by_rows(lambda r0, r1: fn(blocks, xq, xd, xsum, out, r0, r1, kind), blocks.shape[0], n_tok)
    return out


def matmul8_many(parts, x: np.ndarray) -> list[np.ndarray]:
    """[matmul8(kind, blocks, x) for kind, blocks in parts], the same bits: products that share
    their input (attn_q/k/v, ffn_gate/up), which are rounded once where the tiles multiply them."""
    x = np.ascontiguousarray(x, F)
    parts = [(kind, np.ascontiguousarray(blocks, np.uint8)) for kind, blocks in parts]
    for kind, blocks in parts:
        matvec.check_rows(kind, blocks, x.shape[1])    # the kernels read without bounds checks
    if TILED:
        return _matmul_tiled(parts, x)
    return [matmul8(kind, blocks, x) for kind, blocks in parts]
