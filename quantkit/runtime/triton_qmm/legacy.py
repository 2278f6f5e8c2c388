"""Decoders of the 32-value block types (ggml's legacy quants, ik's Q6_0, IQ4_NL, MXFP4) and of
the float types, on the contract of decoders.py.

Value j of a block (j = 0..31) is computed from the byte offsets ggml's layouts give it
(quantkit/layouts.py): the nibble types keep code j in the low nibble of qs[j] for j < 16 and in
the high nibble of qs[j - 16] above.  Products in ggml's order: value = d * (code - bias) (+ m).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...tables import E8M0_HALF, IQ4K_VALUES, MXFP4_VALUES
from ...types import QuantType
from . import bits
from .decoders import for_type

T = QuantType


@triton.jit
def _nibble(qs_ptr, QK: tl.constexpr):
    """[BN, QK] codes: value j's nibble of qs[j % 16] (low for j < 16, high above)."""
    j = tl.arange(0, QK)
    b = bits.byte(qs_ptr[:, None] + (j % 16)[None, :])
    return (b >> (4 * (j // 16))[None, :]) & 0xF


@triton.jit
def _high_bit(qh_ptr, QK: tl.constexpr):
    """[BN, QK] bit j of the little-endian uint32 at qh (Q5_0, Q5_1)."""
    j = tl.arange(0, QK)
    return (bits.byte(qh_ptr[:, None] + (j // 8)[None, :]) >> (j % 8)[None, :]) & 1


@triton.jit
def q8_0(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d f16 | q[32] int8 |: d * q."""
    j = tl.arange(0, QK)
    q = bits.int8(blk_ptr[:, None] + 2 + j[None, :])
    return q.to(tl.float32) * bits.f16(blk_ptr)[:, None]


@triton.jit
def q4_0(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | qs[16] |: d * (code - 8)."""
    return (_nibble(blk_ptr + 2, QK) - 8).to(tl.float32) * bits.f16(blk_ptr)[:, None]


@triton.jit
def q4_1(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | m | qs[16] |: d * code + m."""
    v = _nibble(blk_ptr + 4, QK).to(tl.float32) * bits.f16(blk_ptr)[:, None]
    return v + bits.f16(blk_ptr + 2)[:, None]


@triton.jit
def q5_0(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | qh u32 | qs[16] |: bit j of qh is bit 4 of code j; d * (code - 16)."""
    code = _nibble(blk_ptr + 6, QK) | (_high_bit(blk_ptr + 2, QK) << 4)
    return (code - 16).to(tl.float32) * bits.f16(blk_ptr)[:, None]


@triton.jit
def q5_1(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | m | qh u32 | qs[16] |: d * code + m."""
    code = _nibble(blk_ptr + 8, QK) | (_high_bit(blk_ptr + 4, QK) << 4)
    v = code.to(tl.float32) * bits.f16(blk_ptr)[:, None]
    return v + bits.f16(blk_ptr + 2)[:, None]


@triton.jit
def q6_0(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | qh[8] | qs[16] |: low 4 bits as Q4_0's; bits 4-5 of code j at qh[j % 8], shifted by
    4 (j // 8 odd) + 2 (j >= 16); d * (code - 32)."""
    j = tl.arange(0, QK)
    shift = 4 * ((j // 8) % 2) + 2 * (j // 16)
    hi = (bits.byte(blk_ptr[:, None] + 2 + (j % 8)[None, :]) >> shift[None, :]) & 3
    code = _nibble(blk_ptr + 10, QK) | (hi << 4)
    return (code - 32).to(tl.float32) * bits.f16(blk_ptr)[:, None]


@triton.jit
def iq4_nl(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | qs[16] |: d * grid[code] (t0: IQ4_NL's 16 values)."""
    return tl.load(t0_ptr + _nibble(blk_ptr + 2, QK)) * bits.f16(blk_ptr)[:, None]


@triton.jit
def mxfp4(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| e | qs[16] |: E8M0_HALF[e] (t1) * MXFP4_VALUES[code] (t0)."""
    d = tl.load(t1_ptr + bits.byte(blk_ptr))
    return d[:, None] * tl.load(t0_ptr + _nibble(blk_ptr + 1, QK))


@triton.jit
def f16(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """QK float16 values."""
    j = tl.arange(0, QK)
    return bits.f16(blk_ptr[:, None] + 2 * j[None, :])


@triton.jit
def bf16(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """QK bfloat16 values."""
    j = tl.arange(0, QK)
    return bits.bf16(blk_ptr[:, None] + 2 * j[None, :])


DECODERS = {
    T.Q8_0: for_type(T.Q8_0, q8_0),
    T.Q4_0: for_type(T.Q4_0, q4_0),
    T.Q4_1: for_type(T.Q4_1, q4_1),
    T.Q5_0: for_type(T.Q5_0, q5_0),
    T.Q5_1: for_type(T.Q5_1, q5_1),
    T.Q6_0: for_type(T.Q6_0, q6_0),
    T.IQ4_NL: for_type(T.IQ4_NL, iq4_nl, tables=(IQ4K_VALUES[:16],)),
    T.MXFP4: for_type(T.MXFP4, mxfp4, tables=(MXFP4_VALUES, E8M0_HALF)),
    # floats: 32 values (64 bytes) per call
    T.F16: for_type(T.F16, f16, block_values=32, block_bytes=64),
    T.BF16: for_type(T.BF16, bf16, block_values=32, block_bytes=64),
}
