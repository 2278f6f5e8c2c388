"""Triton decoders of ik_llama.cpp's IQK types: IQ2_K .. IQ6_K, IQ2_KS .. IQ5_KS, IQ4_KSS, IQ2_KL, and the
trellis types IQ1_KT .. IQ4_KT.

Each decodes one 256-value super-block of every row of a tile (the contract of decoders.py) with
the arithmetic of the reference decoder (formats/decode.py) in its order: the sub-block's float
scale ``d * ls`` first, then its product with the table value, so the values equal the numba
decoders' bit for bit.  The bit positions are those of quantkit/layouts.py (its block diagrams
are the documentation of every offset below); value ``p`` of the block, ``ib = p // 16`` its
16-value sub-block (``g = p // 32`` its 32-value group for the row-scaled types):

    _two_bits(qs, p)   bits 2 (p % 128 // 32).. of qs[32 (p // 128) + p % 32]      (Q2_K's order)
    _nibble64(qs, p)   nibble (p // 32) % 2 of qs[32 (p // 64) + p % 32]           (IQ5_K's order)

The value tables (t0) are quantkit/tables.py's, both halves: a set ``extra`` bit (per sub-block;
IQ4_KS, IQ5_KS: bit 0 of the group's scale byte) moves the code into the shifted half.  IQ6_K
decodes to its to_float, the cubic of tables.py, as formats.dequantize does (ik's matrix products
read IQ6NL_VALUES instead; the two differ by up to half a step).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ...formats._kt_codebook import IQ4_KT_SECOND_OFFSET, KA, OFFSET
from ...kernels.iq2kl import PAIRS
from ...tables import (A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K, IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ4NL_VALUES,
                       IQ5NL_VALUES)
from ...types import QuantType
from .bits import byte, f16, f32, u16
from .decoders import for_type

T = QuantType
_F32 = np.float32

# IQ6_K's cubic, as constexpr float32 literals (the decoder multiplies in float32 like tables.py's)
IQ6_A = tl.constexpr(float(A_IQ6K))
IQ6_B = tl.constexpr(float(B_IQ6K))
IQ6_C = tl.constexpr(float(C_IQ6K))
IQ6_D = tl.constexpr(float(D_IQ6K))


@triton.jit
def _at(blk_ptr, off):
    """The bytes at offsets ``off`` [QK] of each row's block: [BN, QK] int32."""
    return byte(blk_ptr[:, None] + off[None, :])


@triton.jit
def _two_bits(blk_ptr, qs: tl.constexpr, p):
    return (_at(blk_ptr, qs + 32 * (p // 128) + p % 32) >> (2 * (p % 128 // 32))) & 3


@triton.jit
def _nibble64(blk_ptr, qs: tl.constexpr, p):
    return (_at(blk_ptr, qs + 32 * (p // 64) + p % 32) >> (4 * (p // 32 % 2))) & 15


@triton.jit
def _extra_bit(blk_ptr, ib):
    """Bit ib of the uint16 ``extra`` at byte 2 (IQ2_K .. IQ6_K): sub-block ib's shifted half."""
    return (_at(blk_ptr, 2 + ib // 8) >> (ib % 8)) & 1


@triton.jit
def _iqk_scale(blk_ptr, ib, scales_l: tl.constexpr, scales_h: tl.constexpr):
    """IQ4_K / IQ5_K's 6-bit scale of sub-block ib, minus 32 (layouts._iqk_scale)."""
    lo = (_at(blk_ptr, scales_l + ib // 2) >> (4 * (ib % 2))) & 15
    hi = (_at(blk_ptr, scales_h + ib // 4) >> (2 * (ib % 4))) & 3
    return (lo | (hi << 4)) - 32


@triton.jit
def _scaled(d, ls, t0_ptr, index):
    """(d * ls) * table[index]: d [BN] float32, ls and index [BN, QK] int32."""
    return (d[:, None] * ls.to(tl.float32)) * tl.load(t0_ptr + index)


# ---- super-blocks with an fp16 d at byte 0 and an ``extra`` word at byte 2 ----

@triton.jit
def iq2_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """76 B: d | extra | scales[8] (nibble ib % 2 of scales[ib // 2], minus 8) | qs[64] 2 bits."""
    p = tl.arange(0, QK)
    ib = p // 16
    ls = ((_at(blk_ptr, 4 + ib // 2) >> (4 * (ib % 2))) & 15) - 8
    code = _two_bits(blk_ptr, 12, p)
    return _scaled(f16(blk_ptr), ls, t0_ptr, code + 4 * _extra_bit(blk_ptr, ib))


@triton.jit
def iq3_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """110 B: d | extra | signs u16 | scales_l[8] | qs[64] 2 bits | qh[32] bit 2; scale ib:
    2 * nibble ib % 2 of scales_l[ib // 2] + 1, negated where bit ib of signs is set."""
    p = tl.arange(0, QK)
    ib = p // 16
    ls = ((_at(blk_ptr, 6 + ib // 2) >> (4 * (ib % 2))) & 15) * 2 + 1
    ls = ls * (1 - 2 * ((_at(blk_ptr, 4 + ib // 8) >> (ib % 8)) & 1))
    code = _two_bits(blk_ptr, 14, p) | (((_at(blk_ptr, 78 + p % 32) >> (p // 32)) & 1) << 2)
    return _scaled(f16(blk_ptr), ls, t0_ptr, code + 8 * _extra_bit(blk_ptr, ib))


@triton.jit
def iq4_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """144 B: d | extra | scales_h[4] | scales_l[8] | qs[128]: sub-block ib, nibble ib % 2 of the
    16 bytes at 16 + 16 (ib // 2)."""
    p = tl.arange(0, QK)
    ib = p // 16
    code = (_at(blk_ptr, 16 + 16 * (ib // 2) + p % 16) >> (4 * (ib % 2))) & 15
    return _scaled(f16(blk_ptr), _iqk_scale(blk_ptr, ib, 8, 4), t0_ptr, code + 16 * _extra_bit(blk_ptr, ib))


@triton.jit
def iq5_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """176 B: d | extra | scales_h[4] | scales_l[8] | qs[128] | qh[32]: bit 4 bit p // 32 of qh[p % 32]."""
    p = tl.arange(0, QK)
    ib = p // 16
    code = _nibble64(blk_ptr, 16, p) | (((_at(blk_ptr, 144 + p % 32) >> (p // 32)) & 1) << 4)
    return _scaled(f16(blk_ptr), _iqk_scale(blk_ptr, ib, 8, 4), t0_ptr, code + 32 * _extra_bit(blk_ptr, ib))


@triton.jit
def iq6_k(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """212 B: d | extra | scales int8[16] | qs[128] | qh[64] (bits 4-5: _two_bits at 148); the value
    is the cubic A + q (B + q (-C + q D)) of the 6-bit code, plus the extra bit."""
    p = tl.arange(0, QK)
    ib = p // 16
    code = _nibble64(blk_ptr, 20, p) | (_two_bits(blk_ptr, 148, p) << 4)
    ls = (_at(blk_ptr, 4 + ib) ^ 0x80) - 0x80                  # int8
    q = code.to(tl.float32)
    v = (IQ6_A + q * (IQ6_B + q * (-IQ6_C + q * IQ6_D))) + _extra_bit(blk_ptr, ib).to(tl.float32)
    return (f16(blk_ptr)[:, None] * ls.to(tl.float32)) * v


# ---- row-scaled: the row's float32 (IQ4_KS, IQ5_KS, IQ4_KSS) or float16 (IQ2_KS, IQ3_KS, IQ2_KL) d ----

@triton.jit
def iq4_ks(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """136 B: scales[8] (bit 0: shifted half; (s & 254) - 127: scale) | qs[128]: group g's 16 bytes at
    8 + 16 g, low nibbles the first 16 values, high the next."""
    p = tl.arange(0, QK)
    s = _at(blk_ptr, p // 32)
    code = (_at(blk_ptr, 8 + 16 * (p // 32) + p % 16) >> (4 * (p % 32 // 16))) & 15
    return _scaled(f32(row_ptr), (s & 254) - 127, t0_ptr, code + 16 * (s & 1))


@triton.jit
def iq5_ks(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """168 B: scales[8] as IQ4_KS's | qs[128]: nibble g % 2 of qs[32 (g // 2) + l] | qh[32]: bit g of qh[l]."""
    p = tl.arange(0, QK)
    g = p // 32
    s = _at(blk_ptr, g)
    code = ((_at(blk_ptr, 8 + 32 * (g // 2) + p % 32) >> (4 * (g % 2))) & 15) \
        | (((_at(blk_ptr, 136 + p % 32) >> g) & 1) << 4)
    return _scaled(f32(row_ptr), (s & 254) - 127, t0_ptr, code + 32 * (s & 1))


@triton.jit
def iq2_ks(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """70 B: extra u16 (bit g: shifted half, bit 8 + g: bit 4 of the scale) | scales[4] (nibble g % 2
    of scales[g // 2]) | qs[64] 2 bits; scale minus 16."""
    p = tl.arange(0, QK)
    g = p // 32
    ls = (((_at(blk_ptr, 2 + g // 2) >> (4 * (g % 2))) & 15) | (((_at(blk_ptr, 1 + 0 * p) >> g) & 1) << 4)) - 16
    shifted = (_at(blk_ptr, 0 * p) >> g) & 1
    return _scaled(f16(row_ptr), ls, t0_ptr, _two_bits(blk_ptr, 6, p) + 4 * shifted)


@triton.jit
def iq3_ks(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """102 B: extra u16 (bit g: bit 4 of the scale, bit 8 + g: shifted half) | scales[4] (nibble
    g // 4 of scales[g % 4]) | qs[64] 2 bits | qh[32] bit 2: bit g of qh[l]; scale minus 16."""
    p = tl.arange(0, QK)
    g = p // 32
    ls = (((_at(blk_ptr, 2 + g % 4) >> (4 * (g // 4))) & 15) | (((_at(blk_ptr, 0 * p) >> g) & 1) << 4)) - 16
    shifted = (_at(blk_ptr, 1 + 0 * p) >> g) & 1
    code = _two_bits(blk_ptr, 6, p) | (((_at(blk_ptr, 70 + p % 32) >> g) & 1) << 2)
    return _scaled(f16(row_ptr), ls, t0_ptr, code + 8 * shifted)


@triton.jit
def iq4_kss(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """128 B: per 32-group g, 8 uint16 words at 16 g; bit 0 of word k is bit k of the group's scale
    byte (IQ4_KS's), bits 1-15 the xor-folded codes: a = w & 0xfffe, a ^ (a >> 1) is the uint16
    qs[2k] | qs[2k + 1] << 8, and value l < 16 of the group is qs[l]'s low nibble, l + 16 its high."""
    p = tl.arange(0, QK)
    g = p // 32
    s = _at(blk_ptr, 16 * g) & 1
    for k in tl.static_range(1, 8):
        s |= (_at(blk_ptr, 16 * g + 2 * k) & 1) << k
    l = p % 16
    a = u16(blk_ptr[:, None] + (16 * g + 2 * (l // 2))[None, :]) & 0xFFFE
    a = a ^ (a >> 1)
    code = (a >> (8 * (l % 2) + 4 * (p % 32 // 16))) & 15
    return _scaled(f32(row_ptr), (s & 254) - 127, t0_ptr, code + 16 * (s & 1))


@triton.jit
def iq2_kl(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """86 B: scales_h u16 (bits 2 ib..: bits 4-5 of group ib's scale) | scales_l[4] (nibble ib // 4 of
    scales_l[ib % 4]) | qs[64] | qh[16]; value pair j of group ib: 5-bit code nibble ib % 2 of
    qs[16 (ib // 2) + j] | bit ib of qh[j] << 4, its two values t0[2 code], t0[2 code + 1]; scale
    minus 32."""
    p = tl.arange(0, QK)
    ib = p // 32
    j = p % 32 // 2
    scales_h = u16(blk_ptr[:, None] + 0 * p[None, :])
    ls = ((_at(blk_ptr, 2 + ib % 4) >> (4 * (ib // 4))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4)
    code = ((_at(blk_ptr, 6 + 16 * (ib // 2) + j) >> (4 * (ib % 2))) & 15) | (((_at(blk_ptr, 70 + j) >> ib) & 1) << 4)
    return _scaled(f16(row_ptr), ls - 32, t0_ptr, 2 * code + p % 2)


# ---- trellis (IQ1_KT .. IQ4_KT): a float32 row scale; a code picks a group of 8 (IQ4_KT: 4) values
# that a hash makes (formats/_kt_codebook.py trellis_values): x = code + offset, then per value
# x = x * KA (mod 2^32) and the value is the sum of the 4 bytes of x & 0x3f3f3f3f, minus 126 (its
# absolute value for IQ3_KT).  The decoders compute it (the tables have up to 2^16 x 8 values)

KT_KA = tl.constexpr(int(KA))
KT_OFFSET = tl.constexpr(OFFSET)
KT_SECOND_OFFSET = tl.constexpr(IQ4_KT_SECOND_OFFSET)


@triton.jit
def _trellis(code, pos, GROUP: tl.constexpr, IS_ABS: tl.constexpr):
    """Value ``pos`` (< GROUP) of the group of ``code`` (code + offset, as int32 ≥ 0)."""
    x = code.to(tl.uint32)
    v = tl.zeros(code.shape, tl.int32)
    for k in tl.static_range(GROUP):
        x = x * KT_KA
        s = (x & 0x3F3F3F3F).to(tl.int32)
        t = (s & 0xFF) + ((s >> 8) & 0xFF) + ((s >> 16) & 0xFF) + ((s >> 24) & 0xFF) - 126
        v = tl.where(pos == k, t, v)
    if IS_ABS:
        v = tl.abs(v)
    return v.to(tl.float32)


@triton.jit
def iq1_kt(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """56 B: sh[8] | ql[32] | qh[16]; code j of 32-group ib = ql[4 ib + j] | nibble ib // 4 of
    qh[4 (ib % 4) + j] << 8 | bit 4 + j of sh[ib] << 12; scale: IQ4_NL's value sh & 15 (t0)."""
    p = tl.arange(0, QK)
    ib, j = p // 32, p % 32 // 8
    sh = _at(blk_ptr, ib)
    code = _at(blk_ptr, 8 + 4 * ib + j) | ((_at(blk_ptr, 40 + 4 * (ib % 4) + j) << (8 - 4 * (ib // 4))) & 0xF00) \
        | ((sh << (8 - j)) & 0x1000)
    sl = f32(row_ptr)[:, None] * tl.load(t0_ptr + (sh & 15))
    return sl * _trellis(code + KT_OFFSET, p % 8, 8, False)


@triton.jit
def _iq23_kt(row_ptr, blk_ptr, t0_ptr, QK: tl.constexpr, THREE: tl.constexpr):
    """scales[4] | uint16 codes[32] (| qh[32] for IQ3_KT: bit ib of qh[r] negates value r of group
    ib); group ib's scale nibble ib // 4 of scales[ib % 4]: IQ2_KT's IQ4_NL value (t0), IQ3_KT's itself."""
    p = tl.arange(0, QK)
    ib, r = p // 32, p % 32
    nib = (_at(blk_ptr, ib % 4) >> (4 * (ib // 4))) & 15
    if THREE:
        scale = nib.to(tl.float32)
    else:
        scale = tl.load(t0_ptr + nib)
    code = u16(blk_ptr[:, None] + (4 + 2 * (4 * ib + r // 8))[None, :])
    v = (f32(row_ptr)[:, None] * scale) * _trellis(code + KT_OFFSET, p % 8, 8, THREE)
    if THREE:
        v = tl.where(((_at(blk_ptr, 68 + r) >> ib) & 1) == 1, -v, v)
    return v


@triton.jit
def iq2_kt(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    return _iq23_kt(row_ptr, blk_ptr, t0_ptr, QK, False)


@triton.jit
def iq3_kt(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    return _iq23_kt(row_ptr, blk_ptr, t0_ptr, QK, True)


@triton.jit
def iq4_kt(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
    """128 B: 8 uint32 words (bit 0: the second offset, bits 1-7: scale + 64, bits 8 + 3 j..: code bits
    12-14 of group j of 4 values) | ql[64] (code bits 0-7) | qh[32] (bits 8-11 of group g: nibble
    g // 32 of qh[g % 32]); 15-bit codes of 4 values."""
    p = tl.arange(0, QK)
    ib, g = p // 32, p // 4
    w = 4 * ib
    head = _at(blk_ptr, w)
    top = _at(blk_ptr, w + 1) | (_at(blk_ptr, w + 2) << 8) | (_at(blk_ptr, w + 3) << 16)     # bits 8-31
    code = _at(blk_ptr, 32 + g) | ((_at(blk_ptr, 96 + g % 32) << (8 - 4 * (g // 32))) & 0xF00) \
        | (((top >> (3 * (g % 8))) & 7) << 12)
    offset = tl.where((head & 1) == 1, KT_SECOND_OFFSET, KT_OFFSET)
    sl = f32(row_ptr)[:, None] * ((head >> 1) - 64).to(tl.float32)
    return sl * _trellis(code + offset, p % 4, 4, False)


def _grid(values) -> np.ndarray:
    return np.ascontiguousarray(values, _F32).reshape(-1)


DECODERS = {
    T.IQ2_K: for_type(T.IQ2_K, iq2_k, (_grid(IQ2NL_VALUES),)),
    T.IQ3_K: for_type(T.IQ3_K, iq3_k, (_grid(IQ3NL_VALUES),)),
    T.IQ4_K: for_type(T.IQ4_K, iq4_k, (_grid(IQ4K_VALUES),)),
    T.IQ5_K: for_type(T.IQ5_K, iq5_k, (_grid(IQ5NL_VALUES),)),
    T.IQ6_K: for_type(T.IQ6_K, iq6_k),
    T.IQ4_KS: for_type(T.IQ4_KS, iq4_ks, (_grid(IQ4K_VALUES),)),
    T.IQ5_KS: for_type(T.IQ5_KS, iq5_ks, (_grid(IQ5NL_VALUES),)),
    T.IQ2_KS: for_type(T.IQ2_KS, iq2_ks, (_grid(IQ2NL_VALUES),)),
    T.IQ3_KS: for_type(T.IQ3_KS, iq3_ks, (_grid(IQ3NL_VALUES),)),
    T.IQ4_KSS: for_type(T.IQ4_KSS, iq4_kss, (_grid(IQ4K_VALUES),)),
    T.IQ2_KL: for_type(T.IQ2_KL, iq2_kl, (_grid(PAIRS),)),
    T.IQ1_KT: for_type(T.IQ1_KT, iq1_kt, (_grid(IQ4NL_VALUES),)),
    T.IQ2_KT: for_type(T.IQ2_KT, iq2_kt, (_grid(IQ4NL_VALUES),)),
    T.IQ3_KT: for_type(T.IQ3_KT, iq3_kt),
    T.IQ4_KT: for_type(T.IQ4_KT, iq4_kt),
}
