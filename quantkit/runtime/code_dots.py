"""Fused generation products of the types whose codes quantkit.layouts cannot describe: the grid
i-quants (a byte indexes a point of 4 or 8 magnitudes, with sign bits beside), the ternary types
(base-3 digits: TQ1_0, IQ1_BN; 2-bit: TQ2_0, IQ2_BN) and Q8_KV (int8 codes under one float32 row
scale).

The grid i-quants with sign bits (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: ``BLOCK_DOTS``) read per
32 values their grid points' indices, sign bytes and scales, and dot.grid_dot32_* gathers the
points into a vector register and multiplies them there.  For the others each block's values are unpacked into a small buffer of int8 codes (a grid point whole, as one
word of 8 or 4 codes, its sign bits beside it) and their integer scales per 16 values, and
multiplied with the activations rounded to 8 bits per 32 (matvec.round_q8) as integers, 32 at a
time in vector registers (dot.codes_dot32; a plain numba loop over the values ran 30-90x slower
than the layout types' chunk_dot, unpacking value by value 3x slower).  One float per 32 values
then scales the group's sum (its xd), one per block the block's (``fill``'s return value: d times
what the integer scales leave out), and one per row a row scale in front of the blocks (Q8_KV,
IQ1_BN, IQ2_BN).  The unpacking follows each type's
``dequantize_row_*`` in ggml-quants.c (ik_llama.cpp and mainline) and iqk_quantize.cpp, where the
float values are

    IQ2_XXS / IQ2_XS / IQ2_S   d * (0.5 + s) * 0.25 * grid * sign   = d/8 * (2s + 1) * grid * sign
    IQ3_XXS                    d * (0.5 + s) * 0.5 * grid * sign    = d/4 * (2s + 1) * grid * sign
    IQ3_S                      d * (1 + 2s) * grid * sign
    IQ1_S / IQ1_M              d * (2s + 1) * (grid ± 1/8)          = d/8 * (2s + 1) * (8 grid ± 1)
    TQ1_0 / TQ2_0              d * (t - 1)                          t a base-3 digit / 2-bit code
    IQ1_BN / IQ2_BN            d_row * (t - 1)                      d_row in front of the row
    Q8_KV                      d_row * q

so every product is exact in integers up to the block's float scale.  (MXFP4, IQ4_NL's block with
an E8M0 exponent, takes the legacy chunk dots: matvec.E8M0_LAYOUTS.)  Interleaved layouts that are
their base's rows regrouped reach here as those plain rows (``Weight.plain_layout``), as matvec's
other types do; those with a layout of their own (ik quantizes iq1_s_r4 and iq1_m_r4 on their own,
in blocks of 32; q8_KV_r8 and q8_k_r8 keep their rows' scales side by side) are read in place: row
k of a group finds its bytes inside the group's blocks.  The numpy twin is the decoded rows times
the rounded activations (tests/test_runtime_code_dots.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..grids import (IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
                     KSIGNS_IQ2XS)
from ..types import QuantType, traits
from . import dot as D

F = np.float32
T = QuantType

# grid points go into the code buffer whole: a uint64 (uint32) point is its 8 (4) magnitudes in
# memory order, as ggml reads it through a uint8 pointer (little-endian, as numba's targets are)
assert np.little_endian
# IQ1 points (int8 -1, 0, 1) times 8, moved by +1 or -1 (the +-1/8 delta), as words of 8 codes
_G1S = IQ1S_GRID.view(np.int8).astype(np.int64)
G1S_UP = (8 * _G1S + 1).astype(np.int8).view(np.uint64)
G1S_DOWN = (8 * _G1S - 1).astype(np.int8).view(np.uint64)
KSIGNS = KSIGNS_IQ2XS.copy()
# the fills index these with masked bits of the block: 8, 9, 10, 8, 9 and 11 bits, and 7 for the signs
assert [len(g) for g in (IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID, IQ3XXS_GRID, IQ3S_GRID)] == [256, 512, 1024, 256, 512]
assert len(G1S_UP) == len(G1S_DOWN) == 2048 and len(KSIGNS) == 128
POW3 = np.array([1, 3, 9, 27, 81, 243], np.int64)        # tq1_0's pow3
K_MULT = np.array([81, 27, 9, 3, 1], np.int64)            # IQ1BNQuantizer::k_mult

_INLINE = dict(inline="always", error_model="numpy")


@njit(**_INLINE)
def _u16(b, o):
    return np.int64(b[o]) | np.int64(b[o + 1]) << 8


@njit(**_INLINE)
def _u32(b, o):
    return _u16(b, o) | _u16(b, o + 2) << 16


@njit(**_INLINE)
def _signed(g, signs, bit):
    """g with the sign bit ``bit`` of the byte ``signs``."""
    return -g if (signs >> bit) & 1 else g


@njit(**_INLINE)
def _put_scales(sc, at, n, v):
    for i in range(at, at + n):
        sc[i] = v


@njit(**_INLINE)
def _iq1_word(idx, delta):
    """The 8 codes 8 grid + delta of IQ1 point idx, as one word."""
    return G1S_UP[idx] if delta > 0 else G1S_DOWN[idx]


# ---- fill(b, o, k, w, sg, sc): the block at byte o (of row k of an interleaved group, whose blocks
# are the group's rows' blocks side by side) -> its int8 codes in w (a uint64 array: grid points go
# in whole, 8 codes a word, or 4 in a uint32 view), the sign byte of each 8 codes in sg (bit j
# negates code j; left 0 by the types without sign bits) and their integer scales per 16 values in
# sc; returns the block's float factor ----

@njit(**_INLINE)
def _ksigns4(aux):
    """The sign bytes of 4 x 8 codes from the 4 x 7 bits of aux (ksigns_iq2xs: the 8th bit makes
    each byte's count of set bits even), as one word, byte l for codes 8 l .. 8 l + 7."""
    return (np.int64(KSIGNS[aux & 127]) | np.int64(KSIGNS[(aux >> 7) & 127]) << 8
            | np.int64(KSIGNS[(aux >> 14) & 127]) << 16 | np.int64(KSIGNS[(aux >> 21) & 127]) << 24)


# ---- block dots of the grid i-quants: block_dot(b, o, xq, xd, x0) = the 256 values of the block at
# byte o · the rounded activations xq * xd from x0 on; per 32 values the grid points' indices, sign
# bytes and scales are read here and the points gathered into a vector register by
# dot.grid_dot32_* (unpacked into a buffer first, the block cost 3x more) ----

@njit(**_INLINE)
def _iq2_xxs(b, o, xq, xd, x0):
    # block_iq2_xxs | d | qs[32] u16 |: per 32 values 4 grid bytes, then a u32: 4 x 7 sign bits, scale
    acc = F(0)
    for ib in range(8):
        q = o + 2 + 8 * ib
        aux = _u32(b, q + 4)
        s = 2 * (aux >> 28) + 1
        idx = (np.int64(b[q]), np.int64(b[q + 1]), np.int64(b[q + 2]), np.int64(b[q + 3]))
        acc += F(D.grid_dot32_u64(IQ2XXS_GRID, idx, _ksigns4(aux), s, s, xq, x0 + 32 * ib)) * xd[(x0 >> 5) + ib]
    return D.half_at(b, o) * F(0.125) * acc


@njit(**_INLINE)
def _iq2_xs(b, o, xq, xd, x0):
    # block_iq2_xs | d | qs[32] u16: grid index (9 bits), sign index (7) | scales[8]: a nibble per 16 |
    acc = F(0)
    for ib in range(8):
        scb = np.int64(b[o + 66 + ib])
        q0, q1 = _u16(b, o + 2 + 8 * ib), _u16(b, o + 4 + 8 * ib)
        q2, q3 = _u16(b, o + 6 + 8 * ib), _u16(b, o + 8 + 8 * ib)
        signs = (np.int64(KSIGNS[q0 >> 9]) | np.int64(KSIGNS[q1 >> 9]) << 8
                 | np.int64(KSIGNS[q2 >> 9]) << 16 | np.int64(KSIGNS[q3 >> 9]) << 24)
        isum = D.grid_dot32_u64(IQ2XS_GRID, (q0 & 511, q1 & 511, q2 & 511, q3 & 511), signs,
                                2 * (scb & 15) + 1, 2 * (scb >> 4) + 1, xq, x0 + 32 * ib)
        acc += F(isum) * xd[(x0 >> 5) + ib]
    return D.half_at(b, o) * F(0.125) * acc


@njit(**_INLINE)
def _iq2_s(b, o, xq, xd, x0):
    # block_iq2_s | d | qs[32] grid low bytes | signs[32] | qh[8]: 2 high bits per index | scales[8] |
    acc = F(0)
    for ib in range(8):
        qh = np.int64(b[o + 66 + ib])
        scb = np.int64(b[o + 74 + ib])
        q = o + 2 + 4 * ib
        idx = (np.int64(b[q]) | ((qh << 8) & 0x300), np.int64(b[q + 1]) | ((qh << 6) & 0x300),
               np.int64(b[q + 2]) | ((qh << 4) & 0x300), np.int64(b[q + 3]) | ((qh << 2) & 0x300))
        isum = D.grid_dot32_u64(IQ2S_GRID, idx, _u32(b, o + 34 + 4 * ib), 2 * (scb & 15) + 1, 2 * (scb >> 4) + 1,
                                xq, x0 + 32 * ib)
        acc += F(isum) * xd[(x0 >> 5) + ib]
    return D.half_at(b, o) * F(0.125) * acc


@njit(**_INLINE)
def _iq3_xxs(b, o, xq, xd, x0):
    # block_iq3_xxs | d | qs[64]: a grid byte per 4 values | 8 u32: 4 x 7 sign bits, scale |
    acc = F(0)
    for ib in range(8):
        aux = _u32(b, o + 66 + 4 * ib)
        s = 2 * (aux >> 28) + 1
        q = o + 2 + 8 * ib
        idx = (np.int64(b[q]), np.int64(b[q + 1]), np.int64(b[q + 2]), np.int64(b[q + 3]),
               np.int64(b[q + 4]), np.int64(b[q + 5]), np.int64(b[q + 6]), np.int64(b[q + 7]))
        acc += F(D.grid_dot32_u32(IQ3XXS_GRID, idx, _ksigns4(aux), s, s, xq, x0 + 32 * ib)) * xd[(x0 >> 5) + ib]
    return D.half_at(b, o) * F(0.25) * acc


@njit(**_INLINE)
def _iq3_s(b, o, xq, xd, x0):
    # block_iq3_s | d | qs[64] | qh[8]: bit 8 of each index | signs[32] | scales[4]: a nibble per 32 |
    acc = F(0)
    for ib in range(8):
        qh = np.int64(b[o + 66 + ib])
        s = 2 * ((np.int64(b[o + 106 + ib // 2]) >> 4 * (ib % 2)) & 15) + 1
        q = o + 2 + 8 * ib
        idx = (np.int64(b[q]) | ((qh << 8) & 256), np.int64(b[q + 1]) | ((qh << 7) & 256),
               np.int64(b[q + 2]) | ((qh << 6) & 256), np.int64(b[q + 3]) | ((qh << 5) & 256),
               np.int64(b[q + 4]) | ((qh << 4) & 256), np.int64(b[q + 5]) | ((qh << 3) & 256),
               np.int64(b[q + 6]) | ((qh << 2) & 256), np.int64(b[q + 7]) | ((qh << 1) & 256))
        acc += F(D.grid_dot32_u32(IQ3S_GRID, idx, _u32(b, o + 74 + 4 * ib), s, s, xq, x0 + 32 * ib)) * xd[(x0 >> 5) + ib]
    return D.half_at(b, o) * acc


@njit(**_INLINE)
def _iq1_s(b, o, k, w, sg, sc):
    # block_iq1_s | d | qs[32]: grid low bytes | qh[8] u16: 4 x 3 high bits, scale (3), delta sign |
    for ib in range(8):
        qh = _u16(b, o + 34 + 2 * ib)
        _put_scales(sc, 2 * ib, 2, 2 * ((qh >> 12) & 7) + 1)
        delta = -1 if qh & 0x8000 else 1
        for l in range(4):
            w[4 * ib + l] = _iq1_word(np.int64(b[o + 2 + 4 * ib + l]) | (((qh >> 3 * l) & 7) << 8), delta)
    return D.half_at(b, o) * F(0.125)


@njit(**_INLINE)
def _iq1_m(b, o, k, w, sg, sc):
    # block_iq1_m | qs[32] | qh[16]: 3 high bits + delta sign per 8 | scales[8]: 4 u16, 3 bits per 16
    # values, the float16 d in their top nibbles |
    s0, s1, s2, s3 = _u16(b, o + 48), _u16(b, o + 50), _u16(b, o + 52), _u16(b, o + 54)
    d = D.half_bits((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000))
    for ib in range(8):
        s16 = _u16(b, o + 48 + 2 * (ib // 2))
        for h in range(2):
            sc[2 * ib + h] = 2 * ((s16 >> (6 * (ib % 2) + 3 * h)) & 7) + 1
        for l in range(4):
            qh = np.int64(b[o + 32 + 2 * ib + l // 2])
            high = (qh << 8) if l % 2 == 0 else (qh << 4)
            delta = -1 if qh & (0x08 << 4 * (l % 2)) else 1
            w[4 * ib + l] = _iq1_word(np.int64(b[o + 4 * ib + l]) | (high & 0x700), delta)
    return d * F(0.125)


@njit(**_INLINE)
def _trit(byte, mult):
    """The base-3 digit ``mult`` selects from a byte of 5 (tq1_0's and iq1_bn's packing), minus 1."""
    v = (byte * mult) & 255
    return ((v * 3) >> 8) - 1


@njit(**_INLINE)
def _trits(w, at, b, o, width, digits):
    """w[at + width n + m] = digit n of the byte b[o + m], minus 1 (m < width, n < digits)."""
    for n in range(digits):
        for m in range(width):
            w[at + width * n + m] = _trit(np.int64(b[o + m]), POW3[n])


@njit(**_INLINE)
def _tq1_0(b, o, k, words, sg, sc):
    # block_tq1_0 | qs[48]: 5 digits a byte | qh[4]: 4 digits a byte | d |: 32 bytes times 5 digits,
    # then 16 bytes times 5, then the 4 bytes times 4, digit-major
    w = words.view(np.int8)
    _trits(w, 0, b, o, 32, 5)
    _trits(w, 160, b, o + 32, 16, 5)
    _trits(w, 240, b, o + 48, 4, 4)
    _put_scales(sc, 0, 16, 1)
    return D.half_at(b, o + 52)


@njit(**_INLINE)
def _tq2_0(b, o, k, words, sg, sc):
    # block_tq2_0 | qs[64] | d |: value 128 h + 32 l + m: bits 2l..2l+1 of qs[32 h + m], minus 1
    w = words.view(np.int8)
    for h in range(2):
        for l in range(4):
            for m in range(32):
                w[128 * h + 32 * l + m] = ((np.int64(b[o + 32 * h + m]) >> 2 * l) & 3) - 1
    _put_scales(sc, 0, 16, 1)
    return D.half_at(b, o + 64)


@njit(**_INLINE)
def _iq1_bn(b, o, k, words, sg, sc):
    # block_iq1_bn | ql[12] | extra |: per 16 values, 3 bytes of 5 digits, and digit i16 of extra
    w = words.view(np.int8)
    for i16 in range(4):
        for kk in range(3):
            byte = np.int64(b[o + 3 * i16 + kk])
            for j in range(5):
                v = (byte * K_MULT[j]) & 255
                w[16 * i16 + 5 * kk + j] = ((v + (v >> 1)) >> 7) - 1
        v = (np.int64(b[o + 12]) * K_MULT[i16]) & 255
        w[16 * i16 + 15] = ((v + (v >> 1)) >> 7) - 1
    _put_scales(sc, 0, 4, 1)
    return F(1)


@njit(**_INLINE)
def _iq2_bn(b, o, k, words, sg, sc):
    # block_iq2_bn | qs[16] |: value j + 16 l in bits 2l..2l+1 of qs[j], minus 1
    w = words.view(np.int8)
    for j in range(16):
        q = np.int64(b[o + j])
        for l in range(4):
            w[j + 16 * l] = ((q >> 2 * l) & 3) - 1
    _put_scales(sc, 0, 4, 1)
    return F(1)


@njit(**_INLINE)
def _q8_kv(b, o, k, words, sg, sc):
    w = words.view(np.int8)
    for j in range(32):
        w[j] = np.int8(b[o + j])
    _put_scales(sc, 0, 2, 1)
    return F(1)


# ---- interleaved layouts of their own (not their base's rows regrouped), read in place ----

@njit(**_INLINE)
def _iq1_s_r4(b, o, k, w, sg, sc):
    # block_iq1_s_r4, 32 values of 4 rows | qs[16]: row k's 8-group i at 4 i + k | qh[4] u16: row k's
    # 3 high bits per 8, scale, delta sign |; the rows' float16 d in front of the group
    qh = _u16(b, o + 16 + 2 * k)
    _put_scales(sc, 0, 2, 2 * ((qh >> 12) & 7) + 1)
    delta = -1 if qh & 0x8000 else 1
    for i in range(4):
        w[i] = _iq1_word(np.int64(b[o + 4 * i + k]) | (((qh >> 3 * i) & 7) << 8), delta)
    return F(0.125)


@njit(**_INLINE)
def _iq1_m_r4(b, o, k, w, sg, sc):
    # block_iq1_m_r4, 32 values of 4 rows | qs[16] | qh[8] | scales[4] |: row k's 16-half i: scale
    # nibble i of scales[k] (d * scale, not 2 scale + 1), grid bytes qs[8 i + k], qs[8 i + k + 4],
    # high bits and delta signs in qh[4 i + k]
    scb = np.int64(b[o + 24 + k])
    for i in range(2):
        sc[i] = (scb >> 4 * i) & 15
        qh = np.int64(b[o + 16 + 4 * i + k])
        w[2 * i] = _iq1_word(np.int64(b[o + 8 * i + k]) | ((qh & 0x07) << 8), -1 if qh & 0x08 else 1)
        w[2 * i + 1] = _iq1_word(np.int64(b[o + 8 * i + k + 4]) | ((qh & 0x70) << 4), -1 if qh & 0x80 else 1)
    return F(0.125)


@njit(**_INLINE)
def _q8_kv_r8(b, o, k, words, sg, sc):
    # 32 values of 8 rows: row k's value 16 h + 4 l + i at 128 h + 32 l + 4 k + i; the rows' float32
    # d in front of the group
    w = words.view(np.int8)
    for h in range(2):
        for l in range(4):
            for i in range(4):
                w[16 * h + 4 * l + i] = np.int8(b[o + 128 * h + 32 * l + 4 * k + i])
    _put_scales(sc, 0, 2, 1)
    return F(1)


@njit(**_INLINE)
def _q8_k_r8(b, o, k, words, sg, sc):
    # block_q8_k_r8, 256 values of 8 rows | d[8] | qs[2048] |: row k's value 4 m + i at qs[32 m + 4 k + i]
    w = words.view(np.int8)
    for m in range(64):
        for i in range(4):
            w[4 * m + i] = np.int8(b[o + 16 + 32 * m + 4 * k + i])
    _put_scales(sc, 0, 16, 1)
    return D.half_at(b, o + 2 * k)


# type -> (fill, values per block); block bytes and the row's scale bytes come from types.py
FILLS = {
    T.IQ1_S: (_iq1_s, 256), T.IQ1_M: (_iq1_m, 256),
    T.TQ1_0: (_tq1_0, 256), T.TQ2_0: (_tq2_0, 256),
    T.IQ1_BN: (_iq1_bn, 64), T.IQ2_BN: (_iq2_bn, 64), T.Q8_KV: (_q8_kv, 32),
    T.IQ1_S_R4: (_iq1_s_r4, 32), T.IQ1_M_R4: (_iq1_m_r4, 32), T.Q8_KV_R8: (_q8_kv_r8, 32), T.Q8_K_R8: (_q8_k_r8, 256),
}
for _q, (_f, _values) in FILLS.items():
    assert traits(_q).block_size == _values, _q
# type -> block dot (256 values a block, no row scale, rows as stored)
BLOCK_DOTS = {T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s}
for _q in BLOCK_DOTS:
    assert traits(_q).block_size == 256 and traits(_q).row_meta_size == 0 and traits(_q).interleave_rows == 1, _q
# every type whose products are computed here
TYPES = (*BLOCK_DOTS, *FILLS)


@njit(error_model="numpy", nogil=True)
def new_scratch():
    """The buffers a row's blocks are unpacked into (``fill``'s w, sg, sc), for the largest block
    (256 values); made once per task of rows, not per row (three allocations a row cost a third of
    an IQ3_S product).  Not inlined: numba's parfor pass could hoist an inlined allocation out of
    the parallel loop, and the threads would share it.  The sign bytes start at 0, which the
    types without sign bits never change."""
    return np.empty(32, np.uint64), np.zeros(32, np.uint8), np.empty(16, np.int16)


def coded_row(qtype):
    """``row(b, bo, xq, xd, xsum, xo, n, w, sg, sc)``: the row of ``qtype`` at byte bo of b · the
    rounded activations xq * xd from xo on (matvec's row signature; xsum unused), unpacking its
    blocks into the task's buffers w, sg, sc (:func:`new_scratch`); without those three for the
    types of BLOCK_DOTS, which unpack nothing.  An interleaved type's row k
    of a group of R reads its blocks inside the group's, and its row scale among the R in front
    of them."""
    if qtype in BLOCK_DOTS:
        block_dot, block_bytes = BLOCK_DOTS[qtype], traits(qtype).type_size

        def block_row(b, bo, xq, xd, xsum, xo, n):
            s = F(0)
            for blk in range(n // 256):
                s += block_dot(b, bo + block_bytes * blk, xq, xd, xo + 256 * blk)
            return s
        return njit(block_row, inline="always", error_model="numpy")
    fill, values = FILLS[qtype]
    t = traits(qtype)
    block_bytes, meta, group = t.type_size, t.row_meta_size, t.interleave_rows
    # the row's scale: a float16 (IQ1_BN, IQ1_S_R4, IQ1_M_R4), a float32 (IQ2_BN, Q8_KV_R8; Q8_KV:
    # then an int32 sum, unused)
    assert meta in (0, 2, 4, 8) and values % 32 == 0
    groups = values // 32

    def row(b, bo, xq, xd, xsum, xo, n, w, sg, sc):
        row_bytes = meta + block_bytes * (n // values)
        k = bo // row_bytes % group
        g0 = bo - k * row_bytes
        s = F(0)
        for blk in range(n // values):
            factor = fill(b, g0 + group * (meta + block_bytes * blk), k, w, sg, sc)
            x0 = xo + values * blk
            acc = F(0)
            for g in range(groups):
                acc += F(D.codes_dot32(w, 32 * g, sg, 4 * g, sc, 2 * g, xq, x0 + 32 * g)) * xd[(x0 >> 5) + g]
            s += factor * acc
        if meta == 2:
            return s * D.half_at(b, g0 + 2 * k)
        return s * D.f32_at(b, g0 + meta * k) if meta else s
    return njit(row, inline="always", error_model="numpy")
