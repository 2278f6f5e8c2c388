"""The fused kernels: each walks a tile of weight rows block by block, decodes each block in
registers with a :class:`decoders.Decoder`'s device function and multiplies it at once, so the
decoded rows are never written to memory.

* :func:`decode_kernel` only decodes (``qdecode``: what the tests hold to the numba decoders);
* :func:`qmv_kernel`, for a few tokens (generation): per token and tile of BN rows, NB blocks of
  each row at a step (the decoder sees BN x NB (row, block) pairs as its rows: more bytes in flight
  per step, NB times fewer steps), the decoded values times the token's activations summed
  element-wise in float32 and reduced once at the end;
* :func:`qmm_kernel`, for a batch (prompt processing): [BM, QK] activations times the decoded
  block's transpose with ``tl.dot`` (IEEE float32, not TF32: the torch fallback's precision).

The decoder function is passed to the kernels as a ``tl.constexpr`` argument (Triton specialises
the kernel per function), with the decoder's geometry (QK, block bytes, row metadata bytes) as
constexprs too.  Rows past N are clamped to row N - 1 for the decoder (its loads carry no mask:
every pointer it sees is inside the weights) and masked on store.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_pointers(w_ptr, rows, N, row_bytes):
    """[BN] uint8 pointers to the first byte of ``rows`` (clamped to N - 1)."""
    safe = tl.minimum(rows, N - 1)
    return w_ptr + safe.to(tl.int64) * row_bytes


@triton.jit
def decode_kernel(w_ptr, out_ptr, t0_ptr, t1_ptr, N, row_bytes, n_per_row,
                  DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, META: tl.constexpr,
                  BN: tl.constexpr):
    """out[rows, block kb] = the decoded block; grid (cdiv(N, BN), n_per_row // QK)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1)
    row_ptr = _row_pointers(w_ptr, rows, N, row_bytes)
    v = DECODE(row_ptr, row_ptr + META + kb * BLOCK_BYTES, t0_ptr, t1_ptr, QK)
    cols = kb * QK + tl.arange(0, QK)
    dst = out_ptr + rows[:, None].to(tl.int64) * n_per_row + cols[None, :]
    tl.store(dst, v, mask=rows[:, None] < N)


@triton.jit
def qmv_kernel(x_ptr, w_ptr, out_ptr, t0_ptr, t1_ptr, N, K, row_bytes, stride_xm, stride_om,
               DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, META: tl.constexpr,
               BN: tl.constexpr, NB: tl.constexpr):
    """out[m, rows] = x[m] . w[rows]; grid (cdiv(N, BN), M).

    Pair p = r * NB + b of a step is block kb + b of row r: a row's NB blocks are adjacent in
    memory, so neighbouring pairs read neighbouring bytes.  Blocks past the row's last (the last
    step of a row whose block count NB does not divide) decode block 0 again (a valid pointer) and
    add nothing: tl.where, not a multiply by 0, which would turn an infinite weight into NaN."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1)
    row_ptr = _row_pointers(w_ptr, rows, N, row_bytes)
    pair_row = tl.reshape(tl.broadcast_to(row_ptr[:, None], (BN, NB)), (BN * NB,))
    sub = tl.arange(0, BN * NB) % NB
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    ks = tl.arange(0, QK)
    n_blocks = K // QK
    acc = tl.zeros((BN * NB, QK), dtype=tl.float32)
    for kb in range(0, n_blocks, NB):
        blk = kb + sub
        inside = blk < n_blocks
        blk = tl.where(inside, blk, 0)
        w = DECODE(pair_row, pair_row + META + blk * BLOCK_BYTES, t0_ptr, t1_ptr, QK)
        x = tl.load(x_row + blk[:, None] * QK + ks[None, :])
        acc += tl.where(inside[:, None], w * x, 0.0)
    out = tl.sum(tl.reshape(acc, (BN, NB * QK)), axis=1)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, out, mask=rows < N)


@triton.jit
def qmm_kernel(x_ptr, w_ptr, out_ptr, t0_ptr, t1_ptr, M, N, K, row_bytes, stride_xm, stride_om,
               DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, META: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr):
    """out[tokens, rows] = x[tokens] @ w[rows]^T; grid (cdiv(N, BN), cdiv(M, BM))."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    toks = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ptr = _row_pointers(w_ptr, rows, N, row_bytes)
    x_rows = x_ptr + toks[:, None].to(tl.int64) * stride_xm
    ks = tl.arange(0, QK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // QK):
        w = DECODE(row_ptr, row_ptr + META + kb * BLOCK_BYTES, t0_ptr, t1_ptr, QK)
        x = tl.load(x_rows + kb * QK + ks[None, :], mask=toks[:, None] < M, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    dst = out_ptr + toks[:, None].to(tl.int64) * stride_om + rows[None, :]
    tl.store(dst, acc, mask=(toks[:, None] < M) & (rows[None, :] < N))
