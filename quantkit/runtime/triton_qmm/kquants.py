"""Decoders of the 256-value super-block types: ggml's k-quants and IQ4_XS, on the contract of
decoders.py.

Each computes, for value v = 0..255 of the block, the byte offsets and shifts of its code and of
its sub-block's scale (and min) from v alone (ggml's dequantize_row_* loops, unrolled into
index arithmetic; quantkit/layouts.py draws the same layouts), then ggml's products in its order:
(d * scale) * code - dmin * min.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...tables import IQ4K_VALUES
from ...types import QuantType
from . import bits
from .decoders import for_type

T = QuantType


@triton.jit
def _at(blk_ptr, offsets):
    """[BN, QK] bytes of each row's block at per-value ``offsets`` [QK], as int32."""
    return bits.byte(blk_ptr[:, None] + offsets[None, :])


@triton.jit
def _scale_min_k4(blk_ptr, g):
    """Q4_K / Q5_K's 6-bit scale and min of 32-group g (ggml's get_scale_min_k4), per value; the
    12 scale bytes sit at byte 4."""
    a = _at(blk_ptr, 4 + g)                        # s[g]
    b = _at(blk_ptr, 8 + g)                        # s[g + 4]
    c = _at(blk_ptr, 4 + g % 4)                    # s[g - 4] (for g >= 4)
    low = (g < 4)[None, :]
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def q4_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | dmin | scales[12] | qs[128] |: 32-group g = v // 32 takes nibble g % 2 of
    qs[32 (g // 2) + v % 32]."""
    v = tl.arange(0, QK)
    g, l = v // 32, v % 32
    q = (_at(blk_ptr, 16 + 32 * (g // 2) + l) >> (4 * (g % 2))[None, :]) & 0xF
    sc, mn = _scale_min_k4(blk_ptr, g)
    y = (bits.f16(blk_ptr)[:, None] * sc.to(tl.float32)) * q.to(tl.float32)
    return y - bits.f16(blk_ptr + 2)[:, None] * mn.to(tl.float32)


@triton.jit
def q5_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | dmin | scales[12] | qh[32] | qs[128] |: low 4 bits as Q4_K's (qs at 48), bit 4 is bit
    g of qh[v % 32]."""
    v = tl.arange(0, QK)
    g, l = v // 32, v % 32
    q = (_at(blk_ptr, 48 + 32 * (g // 2) + l) >> (4 * (g % 2))[None, :]) & 0xF
    q = q | (((_at(blk_ptr, 16 + l) >> g[None, :]) & 1) << 4)
    sc, mn = _scale_min_k4(blk_ptr, g)
    y = (bits.f16(blk_ptr)[:, None] * sc.to(tl.float32)) * q.to(tl.float32)
    return y - bits.f16(blk_ptr + 2)[:, None] * mn.to(tl.float32)


@triton.jit
def q6_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| ql[128] | qh[64] | scales[16] int8 | d |: v = 128 h + 32 q + l takes nibble q // 2 of
    ql[64 h + 32 (q % 2) + l], bits 2q.. of qh[32 h + l] above it, scale 8 h + 2 q + l // 16;
    (d * scale) * (code - 32)."""
    v = tl.arange(0, QK)
    h, q, l = v // 128, (v // 32) % 4, v % 32
    low = (_at(blk_ptr, 64 * h + 32 * (q % 2) + l) >> (4 * (q // 2))[None, :]) & 0xF
    high = (_at(blk_ptr, 128 + 32 * h + l) >> (2 * q)[None, :]) & 3
    sc = bits.int8(blk_ptr[:, None] + (192 + 8 * h + 2 * q + l // 16)[None, :])
    y = bits.f16(blk_ptr + 208)[:, None] * sc.to(tl.float32)
    return y * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def q2_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| scales[16] | qs[64] | d | dmin |: v = 128 h + 32 s + l takes bits 2s.. of qs[32 h + l];
    sub-block v // 16's byte: scale low nibble, min high nibble."""
    v = tl.arange(0, QK)
    h, s, l = v // 128, (v // 32) % 4, v % 32
    q = (_at(blk_ptr, 16 + 32 * h + l) >> (2 * s)[None, :]) & 3
    sm = _at(blk_ptr, v // 16)
    y = (bits.f16(blk_ptr + 80)[:, None] * (sm & 0xF).to(tl.float32)) * q.to(tl.float32)
    return y - bits.f16(blk_ptr + 82)[:, None] * (sm >> 4).to(tl.float32)


@triton.jit
def q3_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| hmask[32] | qs[64] | scales[12] | d |: v = 128 h + 32 s + l takes bits 2s.. of
    qs[32 h + l] and bit 4 h + s of hmask[l] (clear: minus 4); 6-bit scale j = v // 16: nibble
    j // 8 of scales[j % 8], bits 2 (j // 4).. of scales[8 + j % 4] above it, minus 32."""
    v = tl.arange(0, QK)
    h, s, l = v // 128, (v // 32) % 4, v % 32
    low = (_at(blk_ptr, 32 + 32 * h + l) >> (2 * s)[None, :]) & 3
    hbit = (_at(blk_ptr, l) >> (4 * h + s)[None, :]) & 1
    j = v // 16
    sc = ((_at(blk_ptr, 96 + j % 8) >> (4 * (j // 8))[None, :]) & 0xF) \
        | (((_at(blk_ptr, 104 + j % 4) >> (2 * (j // 4))[None, :]) & 3) << 4)
    y = bits.f16(blk_ptr + 108)[:, None] * (sc - 32).to(tl.float32)
    return y * (low - 4 + 4 * hbit).to(tl.float32)


@triton.jit
def iq4_xs(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """| d | scales_h u16 | scales_l[4] | qs[128] |: 32-group ib = v // 32 takes nibble (v % 32) // 16
    of qs[16 ib + v % 16]; its scale nibble ib % 2 of scales_l[ib // 2], bits 2 ib.. of scales_h
    above it, minus 32; (d * scale) * grid[code] (t0: IQ4_NL's 16 values)."""
    v = tl.arange(0, QK)
    ib, l = v // 32, v % 32
    q = (_at(blk_ptr, 8 + 16 * ib + l % 16) >> (4 * (l // 16))[None, :]) & 0xF
    ls = ((_at(blk_ptr, 4 + ib // 2) >> (4 * (ib % 2))[None, :]) & 0xF) \
        | (((bits.u16(blk_ptr + 2)[:, None] >> (2 * ib)[None, :]) & 3) << 4)
    y = bits.f16(blk_ptr)[:, None] * (ls - 32).to(tl.float32)
    return y * tl.load(t0_ptr + q)


DECODERS = {
    T.Q2_K: for_type(T.Q2_K, q2_k),
    T.Q3_K: for_type(T.Q3_K, q3_k),
    T.Q4_K: for_type(T.Q4_K, q4_k),
    T.Q5_K: for_type(T.Q5_K, q5_k),
    T.Q6_K: for_type(T.Q6_K, q6_k),
    T.IQ4_XS: for_type(T.IQ4_XS, iq4_xs, tables=(IQ4K_VALUES[:16],)),
}
