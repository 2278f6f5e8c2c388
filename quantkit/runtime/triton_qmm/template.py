"""The fused kernels: each walks a tile of weight rows block by block, decodes each block in
registers with a :class:`decoders.Decoder`'s device function and multiplies it at once, so the
decoded rows are never written to memory.

* :func:`decode_kernel` only decodes (``qdecode``: what the tests hold to the numba decoders);
* :func:`qmv_kernel`, for a few tokens (generation): per token and tile of BN rows, the decoded
  [BN, QK] block times the token's QK activations, summed element-wise in float32 over the row and
  reduced once at the end;
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
               BN: tl.constexpr):
    """out[m, rows] = x[m] . w[rows]; grid (cdiv(N, BN), M)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1)
    row_ptr = _row_pointers(w_ptr, rows, N, row_bytes)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    ks = tl.arange(0, QK)
    acc = tl.zeros((BN, QK), dtype=tl.float32)
    for kb in range(0, K // QK):
        w = DECODE(row_ptr, row_ptr + META + kb * BLOCK_BYTES, t0_ptr, t1_ptr, QK)
        x = tl.load(x_row + kb * QK + ks)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1)
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
