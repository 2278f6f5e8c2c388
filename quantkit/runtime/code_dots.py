"""Fused generation products of the types whose codes quantkit.layouts cannot describe: the grid
i-quants (a byte indexes a point of 4 or 8 magnitudes, with sign bits beside), the ternary types
(base-3 digits: TQ1_0, IQ1_BN; 2-bit: TQ2_0, IQ2_BN) and Q8_KV (int8 codes under one float32 row
scale).

The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: ``BLOCK_DOTS``) are
multiplied two blocks of 256 at a time by grid_dot.py, all in vector registers: indices, gathered
grid points, signs, scales (read per 32 values by scalar numba code and gathered by the former
dot.grid_dot32_*, IQ3_S ran at 0.8-1 GB/s, IQ2_XXS at 0.9, IQ2_XS at 0.7; IQ1_S and IQ1_M,
unpacked as the others below, at 0.9 and 0.6; all 1.6-3.5 GB/s so, on one Zen 4 thread of a busy
machine).  For the others each block's values are unpacked
into a small buffer of int8 codes (a grid point whole, as one
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

from ..grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from ..types import QuantType, traits
from . import dot as D
from . import grid_dot as G

F = np.float32
T = QuantType

# grid points go into the code buffer whole: a uint64 (uint32) point is its 8 (4) magnitudes in
# memory order, as ggml reads it through a uint8 pointer (little-endian, as numba's targets are)
assert np.little_endian
# IQ1 points (int8 -1, 0, 1) times 8, moved by +1 or -1 (the +-1/8 delta), as words of 8 codes
_G1S = IQ1S_GRID.view(np.int8).astype(np.int64)
G1S_UP = (8 * _G1S + 1).astype(np.int8).view(np.uint64)
G1S_DOWN = (8 * _G1S - 1).astype(np.int8).view(np.uint64)
# the block dots and fills index these with masked bits of the block: 8, 9, 10, 8, 9 and 11 bits
assert [len(g) for g in (IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID, IQ3XXS_GRID, IQ3S_GRID)] == [256, 512, 1024, 256, 512]
assert len(G1S_UP) == len(G1S_DOWN) == 2048
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
    T.TQ1_0: (_tq1_0, 256), T.TQ2_0: (_tq2_0, 256),
    T.IQ1_BN: (_iq1_bn, 64), T.IQ2_BN: (_iq2_bn, 64), T.Q8_KV: (_q8_kv, 32),
    T.IQ1_S_R4: (_iq1_s_r4, 32), T.IQ1_M_R4: (_iq1_m_r4, 32), T.Q8_KV_R8: (_q8_kv_r8, 32), T.Q8_K_R8: (_q8_k_r8, 256),
}
for _q, (_f, _values) in FILLS.items():
    assert traits(_q).block_size == _values, _q
# type -> (its grid_dot.BLOCKS name, its grid): 256 values a block, no row scale, rows as stored
BLOCK_DOTS = {T.IQ2_XXS: ("iq2_xxs", IQ2XXS_GRID), T.IQ2_XS: ("iq2_xs", IQ2XS_GRID), T.IQ2_S: ("iq2_s", IQ2S_GRID),
              T.IQ3_XXS: ("iq3_xxs", IQ3XXS_GRID), T.IQ3_S: ("iq3_s", IQ3S_GRID), T.IQ1_S: ("iq1_s", IQ1S_GRID),
              T.IQ1_M: ("iq1_m", IQ1S_GRID)}
for _q in BLOCK_DOTS:
    assert traits(_q).block_size == 256 and traits(_q).row_meta_size == 0 and traits(_q).interleave_rows == 1, _q
    assert G.block_bytes(BLOCK_DOTS[_q][0]) == traits(_q).type_size, _q
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
        (name, grid), block_bytes = BLOCK_DOTS[qtype], traits(qtype).type_size
        dot1, dot2 = G.BLOCKS[1][name], G.BLOCKS[2][name]

        def block_row(b, bo, xq, xd, xsum, xo, n):
            # two blocks a call (their chains interleaved), a row's odd last one alone
            s = F(0)
            nb = n // 256
            blk = 0
            while blk + 2 <= nb:
                s = dot2(b, bo + block_bytes * blk, grid, xq, xd, xo + 256 * blk, s)
                blk += 2
            if blk < nb:
                s = dot1(b, bo + block_bytes * blk, grid, xq, xd, xo + 256 * blk, s)
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
