"""Triton decoders of ggml's i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S.

Lattice types: a grid index picks 8 (IQ2, IQ1) or 4 (IQ3) magnitudes of a fixed grid
(quantkit/grids.py; t0 holds the grid's values, one float32 per value, index * width + j), and
sign bits negate them.  The arithmetic is the reference decoder's (formats/decode.py), in its
order, so the values equal the numba decoders' bit for bit:

    IQ2_*    ((d * (0.5 + s)) * 0.25) * grid[index][j], negated where sign bit j is set
    IQ3_XXS  ((d * (s + 0.5)) * 0.5) * grid[point][j], then the sign
    IQ3_S    (d * (1 + 2 s)) * grid[point][j], then the sign
    IQ1_*    (d * (2 s + 1)) * (grid[index][j] + (+1/8 or -1/8))

Value ``p`` of the 256-value block: ``ib = p // 32`` its 32-group, ``l = p % 32 // 8`` the group's
index of 8 values, ``j = p % 8`` the value in it.  IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits
per 8 values; ksigns_iq2xs (t1) restores the eighth (even parity).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ...grids import IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS
from ...kernels.iq1 import GRID_VALUES as IQ1S_VALUES
from ...types import QuantType
from .bits import byte, f16, u16
from .decoders import for_type

T = QuantType


@triton.jit
def _at(blk_ptr, off):
    """The bytes at offsets ``off`` [QK] of each row's block: [BN, QK] int32."""
    return byte(blk_ptr[:, None] + off[None, :])


@triton.jit
def _u16_at(blk_ptr, off):
    return u16(blk_ptr[:, None] + off[None, :])


@triton.jit
def _low28(blk_ptr, at):
    """The low 28 bits of the little-endian uint32 at offsets ``at`` (7 sign bits x 4), int32-safe."""
    return _at(blk_ptr, at) | (_at(blk_ptr, at + 1) << 8) | (_at(blk_ptr, at + 2) << 16) \
        | ((_at(blk_ptr, at + 3) & 15) << 24)


@triton.jit
def _sign(v, sign_byte, j):
    """v, negated where bit j of sign_byte is set (C: ``signs & kmask[j] ? -1.f : 1.f``)."""
    return tl.where(((sign_byte >> j) & 1) == 1, -v, v)


@triton.jit
def _ksigns(t1_ptr, seven_bits):
    return tl.load(t1_ptr + seven_bits).to(tl.int32)


@triton.jit
def _iq2_value(d, s, t0_ptr, index, sign_byte, j):
    """IQ2_XXS / XS / S: ((d * (0.5 + s)) * 0.25) * grid[index][j], with the sign."""
    db = (d[:, None] * (0.5 + s.to(tl.float32))) * 0.25
    return _sign(db * tl.load(t0_ptr + 8 * index + j), sign_byte, j)


@triton.jit
def iq2_xxs(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """66 B: d | per 32-group ib at 2 + 8 ib: 4 grid-index bytes, a uint32 of 4 x 7 sign bits and
    the scale in bits 28-31."""
    p = tl.arange(0, QK)
    ib, l, j = p // 32, p % 32 // 8, p % 8
    at = 2 + 8 * ib
    sign_byte = _ksigns(t1_ptr, (_low28(blk_ptr, at + 4) >> (7 * l)) & 127)
    s = _at(blk_ptr, at + 7) >> 4
    return _iq2_value(f16(blk_ptr), s, t0_ptr, _at(blk_ptr, at + l), sign_byte, j)


@triton.jit
def iq2_xs(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """74 B: d | uint16 qs[32]: 9-bit grid index | 7 sign bits << 9 | scales[8]: nibble l // 2 of
    scales[ib] for its two halves."""
    p = tl.arange(0, QK)
    ib, l, j = p // 32, p % 32 // 8, p % 8
    q = _u16_at(blk_ptr, 2 + 2 * (4 * ib + l))
    s = (_at(blk_ptr, 66 + ib) >> (4 * (l // 2))) & 15
    return _iq2_value(f16(blk_ptr), s, t0_ptr, q & 511, _ksigns(t1_ptr, q >> 9), j)


@triton.jit
def iq2_s(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """82 B: d | qs[32] grid index bits 0-7 | signs[32] | qh[8]: bits 8-9 of index l at bits 2l |
    scales[8] as IQ2_XS's."""
    p = tl.arange(0, QK)
    ib, l, j = p // 32, p % 32 // 8, p % 8
    index = _at(blk_ptr, 2 + 4 * ib + l) | ((_at(blk_ptr, 66 + ib) << (8 - 2 * l)) & 0x300)
    s = (_at(blk_ptr, 74 + ib) >> (4 * (l // 2))) & 15
    return _iq2_value(f16(blk_ptr), s, t0_ptr, index, _at(blk_ptr, 34 + 4 * ib + l), j)


@triton.jit
def iq3_xxs(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """98 B: d | qs[64] (a grid point per 4 values) | u32[8] per 32-group: 4 x 7 sign bits, the
    scale in bits 28-31."""
    p = tl.arange(0, QK)
    ib, r = p // 32, p % 32
    at = 66 + 4 * ib
    v = tl.load(t0_ptr + 4 * _at(blk_ptr, 2 + 8 * ib + r // 4) + r % 4)
    sign_byte = _ksigns(t1_ptr, (_low28(blk_ptr, at) >> (7 * (r // 8))) & 127)
    db = (f16(blk_ptr)[:, None] * ((_at(blk_ptr, at + 3) >> 4).to(tl.float32) + 0.5)) * 0.5
    return _sign(db * v, sign_byte, r % 8)


@triton.jit
def iq3_s(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """110 B: d | qs[64] | qh[8] | signs[32] | scales[4]: point k of 32-group ib is qs[8 ib + k] |
    bit k of qh[ib] << 8; scale: nibble ib % 2 of scales[ib // 2]."""
    p = tl.arange(0, QK)
    ib, r = p // 32, p % 32
    k = r // 4
    point = _at(blk_ptr, 2 + 8 * ib + k) | (((_at(blk_ptr, 66 + ib) >> k) & 1) << 8)
    v = tl.load(t0_ptr + 4 * point + r % 4)
    s = (_at(blk_ptr, 106 + ib // 2) >> (4 * (ib % 2))) & 15
    db = f16(blk_ptr)[:, None] * (1 + 2 * s).to(tl.float32)
    return _sign(db * v, _at(blk_ptr, 74 + 4 * ib + r // 8), r % 8)


@triton.jit
def _iq1_value(dl, t0_ptr, index, j, shift_bit):
    """dl * (grid[index][j] + delta), delta = +1/8, or -1/8 where shift_bit is 1."""
    delta = (1 - 2 * shift_bit).to(tl.float32) * 0.125
    return dl * (tl.load(t0_ptr + 8 * index + j) + delta)


@triton.jit
def iq1_s(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """50 B: d | qs[32] | uint16 qh[8]: 32-group ib's points qs[4 ib + l] | bits 3l.. of qh[ib] << 8,
    scale 2 ((qh >> 12) & 7) + 1, shift bit 15."""
    p = tl.arange(0, QK)
    ib, l, j = p // 32, p % 32 // 8, p % 8
    qh = _u16_at(blk_ptr, 34 + 2 * ib)
    index = _at(blk_ptr, 2 + 4 * ib + l) | (((qh >> (3 * l)) & 7) << 8)
    dl = f16(blk_ptr)[:, None] * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    return _iq1_value(dl, t0_ptr, index, j, (qh >> 15) & 1)


@triton.jit
def iq1_m(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """56 B: qs[32] | qh[16] | uint16 sc[4]; 16-group t: points qs[2 t + l] | bits 4l.. of qh[t] << 8
    (3 bits), shift bit 3 + 4l of qh[t], scale 2 ((sc[t // 4] >> 3 (t % 4)) & 7) + 1; d is the fp16
    whose nibbles are the top nibbles of sc[0..3]."""
    p = tl.arange(0, QK)
    t, l, j = p // 16, p % 16 // 8, p % 8
    bits = (u16(blk_ptr + 48) >> 12) | ((u16(blk_ptr + 50) >> 8) & 0x00F0) \
        | ((u16(blk_ptr + 52) >> 4) & 0x0F00) | (u16(blk_ptr + 54) & 0xF000)
    d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    ls = (_u16_at(blk_ptr, 48 + 2 * (t // 4)) >> (3 * (t % 4))) & 7
    qh = _at(blk_ptr, 32 + t)
    index = _at(blk_ptr, 2 * t + l) | ((qh << (8 - 4 * l)) & 0x700)
    dl = d[:, None] * (2 * ls + 1).to(tl.float32)
    return _iq1_value(dl, t0_ptr, index, j, (qh >> (3 + 4 * l)) & 1)


def _values(grid: np.ndarray, width: int) -> np.ndarray:
    """A lattice grid (one uint32 / uint64 per point) as its byte values, float32, point-major."""
    return np.ascontiguousarray(grid).view(np.uint8).reshape(-1, width).astype(np.float32).reshape(-1)


_KSIGNS = KSIGNS_IQ2XS.astype(np.float32)

DECODERS = {
    T.IQ2_XXS: for_type(T.IQ2_XXS, iq2_xxs, (_values(IQ2XXS_GRID, 8), _KSIGNS)),
    T.IQ2_XS: for_type(T.IQ2_XS, iq2_xs, (_values(IQ2XS_GRID, 8), _KSIGNS)),
    T.IQ2_S: for_type(T.IQ2_S, iq2_s, (_values(IQ2S_GRID, 8),)),
    T.IQ3_XXS: for_type(T.IQ3_XXS, iq3_xxs, (_values(IQ3XXS_GRID, 4), _KSIGNS)),
    T.IQ3_S: for_type(T.IQ3_S, iq3_s, (_values(IQ3S_GRID, 4),)),
    T.IQ1_S: for_type(T.IQ1_S, iq1_s, (np.ascontiguousarray(IQ1S_VALUES, np.float32).reshape(-1),)),
    T.IQ1_M: for_type(T.IQ1_M, iq1_m, (np.ascontiguousarray(IQ1S_VALUES, np.float32).reshape(-1),)),
}
