"""Fused matrix-vector products for generation: each stored row is multiplied with the activations
straight from its packed bytes, chunk by chunk, and never written out as float32.

A decoded row costs a write and a read of 4 bytes per weight; the packed row is 0.3-1 byte.  For
the one or few tokens of a generation step that traffic, not the arithmetic, set the speed of the
decode-then-BLAS path (ops_cpu.matmul_q), so the products of a few tokens come here for the types
below; larger batches keep the tile path, where BLAS reuses each decoded tile for every token.

As in ggml's quantized dot products the activations are first rounded to 8 bits per 32 (q8_0:
``round_q8``), and weight codes and activation codes are multiplied as integers; F32 and F16 rows
are multiplied in float.  Per chunk (8 legacy blocks, or one super-block of 256; a legacy row's
last blocks in chunks of 4, 2 and 1) the kernel runs one :func:`dot.chunk_dot`, compiled from the
type's static list of runs below; it reads the scales from the blocks themselves: float16 block
scales (legacy types), or a float16 super-block scale and packed integer sub-block scales (and
grid choices, mins) whose bit positions the type's ``Super`` lists (k-quants and IQK types).  Each type compiles its own loop: the type is a literal argument of
the kernel (``_kernel``).  The loop passes byte and value offsets, never views, down to the
chunks: a view per row would count a reference up and down on an array both threads share.

Interleaved types (``_r4``/``_r8``) are regrouped into their plain rows once, on first use (see
``Weight.plain_layout``), and take the plain type's kernel.  The numpy twin is decoding the rows
and multiplying with the rounded activations (``formats.dequantize(...) @ round_q8(x)``), which
the tests compare with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..tables import IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from ..types import TYPE_TRAITS, QuantType, traits
from . import dot as D
from .kernels import _f16_value as half_round

F = np.float32
T = QuantType
_OPTS = dict(cache=True, error_model="numpy", nogil=True)


def _padded(values, n):
    out = np.zeros(n, np.int8)
    out[:len(values)] = values
    return out


# non-linear grids as int8, padded so that a 16-byte load at any table offset stays inside
IQ4_TABLE = _padded(IQ4K_VALUES, 48)          # iq4_nl / iq4_xs: 0..15; iq4_k: + 16 * extra bit
IQ2_TABLE = _padded(IQ2NL_VALUES, 32)         # iq2_k: 4 values, + 4 * extra bit
IQ3_TABLE = _padded(IQ3NL_VALUES, 32)         # iq3_k: 8 values, + 8 * extra bit
IQ5_TABLE = _padded(IQ5NL_VALUES, 64)         # iq5_k: 32 values, + 32 * extra bit
IQ6_TABLE = _padded(IQ6NL_VALUES, 128)        # iq6_k: 64 values, + 64 * extra bit
NO_TABLE = np.zeros(16, np.int8)              # the types without a grid

# the kernel selector per stored type (each compiles its own loop: _row_dot)
KIND = {q: k for k, q in enumerate((
    T.F32, T.F16, T.BF16,                                                       # float rows
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q6_0, T.IQ4_NL,                  # legacy blocks
    T.IQ4_XS, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_K, T.IQ2_K, T.Q3_K, T.IQ3_K,       # super-blocks
    T.IQ5_K, T.IQ4_KS, T.IQ5_KS, T.IQ2_KS, T.IQ3_KS, T.Q2_K, T.IQ6_K))}
FLOAT_KINDS = len(D.FLOAT_FORMATS)      # kinds below this multiply float rows with float activations


def _kinds() -> dict[QuantType, int]:
    kinds = {}
    for q, t in TYPE_TRAITS.items():
        kind = KIND.get(t.base if t.interleave_rows > 1 else q)
        if kind is not None:
            kinds[q] = kind
    return kinds


_KIND_OF = _kinds()


def kind_of(qtype: QuantType) -> int | None:
    """The kernel selector for rows of ``qtype`` (its plain type's for interleaved types), or None
    when no fused kernel computes them."""
    return _KIND_OF.get(qtype)


# ---- the runs of each type's chunks (dot.Run: byte and value offsets inside the chunk) ----
#
# Legacy types are read 8 blocks (256 values) per chunk, and a row's last n % 256 values in chunks
# of 4, 2 and 1 blocks; super-block types one super-block per chunk.

R = D.Run


@dataclass(frozen=True)
class LegacyLayout:
    """A type of 32-value blocks: its block bytes and the runs of one block (scales and mins
    read by the chunk dot itself, from d_at / m_at)."""
    block_bytes: int
    runs: tuple
    table: bool = False                # codes index the IQ4 grid

    def chunk(self, n_blocks: int):
        """The chunk dot of n_blocks consecutive blocks."""
        runs = tuple(r.moved(self.block_bytes * i, 32 * i) for i in range(n_blocks) for r in self.runs)
        return D.chunk_dot(runs, table=self.table)


LEGACY = {
    # Q8_0   d | 32 int8
    T.Q8_0: LegacyLayout(34, (R(32, 0, 2, d_at=0),)),
    # Q4_0   d | 16 bytes: low nibbles are values 0-15, high nibbles 16-31, minus 8
    T.Q4_0: LegacyLayout(18, (R(32, 0, 2, 0, 15, bias=8, d_at=0, split=True),)),
    # Q4_1   d m | 16 bytes
    T.Q4_1: LegacyLayout(20, (R(32, 0, 4, 0, 15, d_at=0, m_at=2, split=True),)),
    # Q5_0   d | qh (bit j: the fifth bit of value j) | 16 bytes, minus 16
    T.Q5_0: LegacyLayout(22, (R(32, 0, 6, 0, 15, bias=16, hword=2, d_at=0, split=True),)),
    # Q5_1   d m | qh | 16 bytes
    T.Q5_1: LegacyLayout(24, (R(32, 0, 8, 0, 15, hword=4, d_at=0, m_at=2, split=True),)),
    # Q6_0   d | qh[8] | qs[16]: value j < 8 takes bits 0-1 of qh[j], 8 <= j < 16 bits 4-5 of
    #        qh[j - 8]; values 16 + j bits 2-3 / 6-7; minus 32
    T.Q6_0: LegacyLayout(26, tuple(R(8, xoff, 10 + 8 * (xoff // 8 % 2), 4 * (xoff // 16), 15, 2, hshift, 3,
                                     bias=32, d_at=0)
                                   for xoff, hshift in ((0, 0), (8, 4), (16, 2), (24, 6)))),
    # IQ4_NL d | 16 bytes of grid indices
    T.IQ4_NL: LegacyLayout(18, (R(32, 0, 2, 0, 15, d_at=0, split=True),), table=True),
}
# chunk dots of 8, 4, 2 and 1 blocks, made once (numba caches what uses them): a row's last
# n % 256 values take at most one of each of the smaller ones
CHUNK_BLOCKS = (8, 4, 2, 1)
_LEGACY_CHUNKS = {q: tuple(lay.chunk(n) for n in CHUNK_BLOCKS) for q, lay in LEGACY.items()}


# grids of the super-block types that have one
SUPER_TABLE = {T.IQ4_XS: IQ4_TABLE, T.IQ4_K: IQ4_TABLE, T.IQ2_K: IQ2_TABLE, T.IQ3_K: IQ3_TABLE,
               T.IQ5_K: IQ5_TABLE, T.IQ4_KS: IQ4_TABLE, T.IQ5_KS: IQ5_TABLE, T.IQ2_KS: IQ2_TABLE,
               T.IQ3_KS: IQ3_TABLE, T.IQ6_K: IQ6_TABLE}
S = D.Scale


def _k4(j, mins):
    """Q4_K/Q5_K: scale (or min) j of the 12 bytes at 4, 6 bits each (get_scale_min_k4): j < 4 is
    byte j (mins: j + 4) & 63; j >= 4 the low nibble (mins: high nibble) of byte j + 4 with the top
    2 bits of byte j - 4 (mins: j) above it."""
    if j < 4:
        return S(4 + j + 4 * mins, 0, 63)
    return S(8 + j, 4 * mins, 15, 4 + j - 4 + 4 * mins, 6, 3, 4)


# bit k of the 16-bit word at 2 (``extra``): run k's grid choice
_WORD_BITS = tuple((2 + k // 8, k % 8) for k in range(16))
# IQ4_K / IQ5_K: scale ib is nibble ib % 2 of scales_l[ib // 2] (at 8) | bits 2 (ib % 4) of
# scales_h[ib // 4] (at 4) << 4, minus 32
_IQK_SCALES = tuple(S(8 + ib // 2, 4 * (ib % 2), 15, 4 + ib // 4, 2 * (ib % 4), 3, 4, 32) for ib in range(16))
# IQ4_KS / IQ5_KS: group g's scale is (scales[g] & 254) - 127, bit 0 its grid choice
_KS_SCALES = tuple(S(g, 0, 254, bias=127) for g in range(8))
_KS_GRID = tuple((g, 0) for g in range(8))


def _two_bits(qs_at, v0):
    """(byte, shift) of value v0's 2 bits in Q2_K's layout of qs[64] at qs_at: value
    v = 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l] (Q2_K, Q3_K, IQ3_K, IQ2_KS, IQ3_KS)."""
    return qs_at + 32 * (v0 // 128) + v0 % 32, 2 * (v0 % 128 // 32)

SUPER = {
    # IQ4_XS d | scales_h | scales_l[4] | qs[128]: 32-group ib's values from the 16 bytes at 8 + 16 ib;
    # its scale: nibble ib % 2 of scales_l[ib // 2] | bits 2 ib of scales_h << 4, minus 32
    T.IQ4_XS: ([R(16, 32 * ib + 16 * h, 8 + 16 * ib, 4 * h, 15) for ib in range(8) for h in range(2)],
               D.Super(0, tuple(S(4 + ib // 2, 4 * (ib % 2), 15, 2 + ib // 4, 2 * (ib % 4), 3, 4, 32)
                                for ib in range(8) for h in range(2)))),
    # Q4_K d dmin scales[12] qs[128]: sub-block j is nibble j % 2 of qs[32 (j // 2) ..]
    T.Q4_K: ([R(32, 32 * j, 16 + 32 * (j // 2), 4 * (j % 2), 15) for j in range(8)],
             D.Super(0, tuple(_k4(j, 0) for j in range(8)), 2, tuple(_k4(j, 1) for j in range(8)))),
    # Q5_K d dmin scales[12] qh[32] qs[128]: the fifth bit of sub-block j is bit j of qh
    T.Q5_K: ([R(32, 32 * j, 48 + 32 * (j // 2), 4 * (j % 2), 15, 16, j, 1, 4) for j in range(8)],
             D.Super(0, tuple(_k4(j, 0) for j in range(8)), 2, tuple(_k4(j, 1) for j in range(8)))),
    # Q6_K ql[128] qh[64] scales[16] d: value v = 128 h + 32 q + l is nibble q // 2 of
    # ql[64 h + 32 (q % 2) + l] with bits 2q..2q+1 of qh[32 h + l] above it, minus 32; the int8
    # scale of its 16 values is scales[v // 16]
    T.Q6_K: ([R(16, 128 * h + 32 * q + l0, 64 * h + 32 * (q % 2) + l0, 4 * (q // 2), 15,
                128 + 32 * h + l0, 2 * q, 3, 4, 32)
              for h in range(2) for q in range(4) for l0 in (0, 16)],
             D.Super(208, tuple(S(192 + 8 * h + 2 * q + l0 // 16, signed=True)
                                for h in range(2) for q in range(4) for l0 in (0, 16)))),
    # IQ4_K d extra scales_h[4] scales_l[8] qs[128]: sub-block ib of 16 is nibble ib % 2 of
    # qs[16 (ib // 2) ..], on the second grid when bit ib of extra is set
    T.IQ4_K: ([R(16, 16 * ib, 16 + 16 * (ib // 2), 4 * (ib % 2), 15) for ib in range(16)],
              D.Super(0, _IQK_SCALES, grid=_WORD_BITS, grid_step=16)),
    # IQ2_K d extra scales[8] qs[64]: sub-block ib (32-group g = ib // 2) is bits 2 (g % 4) of
    # qs[32 (g // 4) + 16 (ib % 2) ..], values 4..7 of the grid when bit ib of extra is set; its
    # scale: nibble ib % 2 of scales[ib // 2], minus 8
    T.IQ2_K: ([R(16, 16 * ib, 12 + 32 * (ib // 8) + 16 * (ib % 2), 2 * ((ib // 2) % 4), 3) for ib in range(16)],
              D.Super(0, tuple(S(4 + ib // 2, 4 * (ib % 2), 15, bias=8) for ib in range(16)), grid=_WORD_BITS, grid_step=4)),
    # Q3_K hmask[32] qs[64] scales[12] d: value v = 128 h + 32 s + l is bits 2s..2s+1 of
    # qs[32 h + l] with bit 4h + s of hmask[l] above them, minus 4; the 6-bit scale of its 16
    # values j = v // 16: nibble j // 8 of scales[j % 8] | bits 2 (j // 4) of scales[8 + j % 4] << 4,
    # minus 32
    T.Q3_K: ([R(16, v0, *_two_bits(32, v0), 3, v0 % 32, v0 // 32, 1, 2, 4) for v0 in range(0, 256, 16)],
             D.Super(108, tuple(S(96 + j % 8, 4 * (j // 8), 15, 104 + j % 4, 2 * (j // 4), 3, 4, 32)
                                for j in range(16)))),
    # IQ3_K d extra signs scales_l[8] qs[64] qh[32]: value v's 2 low bits as Q3_K's (qs at 14), its
    # third bit 4h + s of qh[l]; sub-block ib of 16 on the second grid (8 on) when bit ib of extra
    # is set; its scale: 2 |nibble ib % 2 of scales_l[ib // 2]| + 1, negative where bit ib of signs is
    T.IQ3_K: ([R(16, v0, *_two_bits(14, v0), 3, 78 + v0 % 32, v0 // 32, 1, 2) for v0 in range(0, 256, 16)],
              D.Super(0, tuple(S(6 + ib // 2, 4 * (ib % 2), 15, odd=True, neg_at=4 + ib // 8, neg_bit=ib % 8)
                               for ib in range(16)), grid=_WORD_BITS, grid_step=8)),
    # IQ5_K d extra scales_h[4] scales_l[8] qs[128] qh[32]: value v's low 4 bits are nibble
    # (v // 32) % 2 of qs[32 (v // 64) + v % 32], its fifth bit v // 32 of qh[v % 32]; 32 grid
    # values, the second grid (32 on) where bit ib of extra is set; scales as IQ4_K's
    T.IQ5_K: ([R(16, v0, 16 + 32 * (v0 // 64) + v0 % 32, 4 * (v0 // 32 % 2), 15, 144 + v0 % 32, v0 // 32, 1, 4)
               for v0 in range(0, 256, 16)],
              D.Super(0, _IQK_SCALES, grid=_WORD_BITS, grid_step=32)),
    # IQ4_KS (after the row's float32 scale) scales[8] qs[128]: 32-group ib is the 16 bytes at
    # 8 + 16 ib, low nibbles then high
    T.IQ4_KS: ([R(32, 32 * ib, 8 + 16 * ib, 0, 15, split=True) for ib in range(8)],
               D.Super(None, _KS_SCALES, grid=_KS_GRID, grid_step=16)),
    # IQ5_KS (after the row's float32 scale) scales[8] qs[128] qh[32]: group g's low 4 bits are
    # nibble g % 2 of qs[32 (g // 2) ..], its fifth bit g of qh[..]; scales as IQ4_KS's
    T.IQ5_KS: ([R(32, 32 * g, 8 + 32 * (g // 2), 4 * (g % 2), 15, 136, g, 1, 4) for g in range(8)],
               D.Super(None, _KS_SCALES, grid=_KS_GRID, grid_step=32)),
    # IQ2_KS (after the row's float16 scale) extra scales[4] qs[64]: group g's codes are bits
    # 2 (g % 4) of qs[32 (g // 4) ..] (Q2_K's layout), its grid choice bit g of extra; its scale:
    # nibble g % 2 of scales[g // 2] | bit 8 + g of extra << 4, minus 16
    T.IQ2_KS: ([R(32, 32 * g, *_two_bits(6, 32 * g), 3) for g in range(8)],
               D.Super(None, tuple(S(2 + g // 2, 4 * (g % 2), 15, 1, g, 1, 4, 16) for g in range(8)),
                       grid=tuple((0, g) for g in range(8)), grid_step=4)),
    # IQ3_KS (after the row's float16 scale) extra scales[4] qs[64] qh[32]: group g's codes as
    # IQ2_KS's with bit g of qh[..] above them, its grid choice bit 8 + g of extra; its scale:
    # nibble g // 4 of scales[g % 4] | bit g of extra << 4, minus 16
    T.IQ3_KS: ([R(32, 32 * g, *_two_bits(6, 32 * g), 3, 70, g, 1, 2) for g in range(8)],
               D.Super(None, tuple(S(2 + g % 4, 4 * (g // 4), 15, 0, g, 1, 4, 16) for g in range(8)),
                       grid=tuple((1, g) for g in range(8)), grid_step=8)),
    # Q2_K scales[16] qs[64] d dmin: value v = 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l]
    # (at 16); sub-block j = v // 16 has scale nibble 0 of scales[j] and min nibble 1
    T.Q2_K: ([R(16, v0, *_two_bits(16, v0), 3) for v0 in range(0, 256, 16)],
             D.Super(80, tuple(S(j, 0, 15) for j in range(16)), 82, run_mins=tuple(S(j, 4, 15) for j in range(16)))),
    # IQ6_K d extra scales int8[16] qs[128] qh[64]: value v's low 4 bits as IQ5_K's (qs at 20),
    # bits 4-5 are bits 2 ((v // 32) % 4) of qh[32 (v // 128) + v % 32]; 64 grid values, the second
    # grid (64 on) where bit ib of extra is set.  The grid as ik's matrix products use it (its
    # to_float decodes a cubic instead: formats.iqk.dequantize_iq6_k_table is this one's twin)
    T.IQ6_K: ([R(16, v0, 20 + 32 * (v0 // 64) + v0 % 32, 4 * (v0 // 32 % 2), 15,
                 148 + 32 * (v0 // 128) + v0 % 32, 2 * (v0 // 32 % 4), 3, 4) for v0 in range(0, 256, 16)],
              D.Super(0, tuple(S(4 + ib, signed=True) for ib in range(16)), grid=_WORD_BITS, grid_step=64)),
}
SUPER_CHUNKS = {q: D.chunk_dot(runs, table=q in SUPER_TABLE, sup=sup) for q, (runs, sup) in SUPER.items()}

_TYPE_OF_KIND = {k: q for q, k in KIND.items()}


# ---- row dots, one compiled loop per type ----

def _float_row(kind):
    """The row at byte bo of b · x[xo:xo + n] for a float type (kind < FLOAT_KINDS): 32 values per
    vector dot, the rest one by one."""
    dot32, at = D.FLOAT_READERS[kind]
    size = 4 if D.FLOAT_FORMATS[kind] == "f32" else 2

    def row(b, bo, x, xo, n):
        s = F(0)
        n32 = n // 32 * 32
        for j in range(0, n32, 32):
            s += dot32(b, bo + size * j, x, xo + j)
        for j in range(n32, n):
            s += at(b, bo + size * j) * x[xo + j]
        return s
    return njit(row, inline="always")


def _legacy_row(qtype):
    """The row at byte bo of b · the n activations from xo on, for a legacy type: 8 blocks per
    chunk dot, then the row's last n % 256 values in chunks of 4, 2 and 1 blocks."""
    chunk8, chunk4, chunk2, chunk1 = _LEGACY_CHUNKS[qtype]
    block_bytes = LEGACY[qtype].block_bytes
    table = IQ4_TABLE if LEGACY[qtype].table else NO_TABLE

    def row(b, bo, xq, xd, xsum, xo, n):
        nb = n // 32
        s = F(0)
        ib = 0
        while ib + 8 <= nb:
            s += chunk8(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 8
        if ib + 4 <= nb:
            s += chunk4(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 4
        if ib + 2 <= nb:
            s += chunk2(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
            ib += 2
        if ib < nb:
            s += chunk1(b, bo + block_bytes * ib, table, xq, xd, xsum, xo + 32 * ib)
        return s
    return njit(row, inline="always")


def _super_row(qtype):
    """The row at byte bo of b · the n activations from xo on, for a super-block type: one chunk
    dot per super-block of 256."""
    chunk = SUPER_CHUNKS[qtype]
    table = SUPER_TABLE.get(qtype, NO_TABLE)
    block_bytes, meta = traits(qtype).type_size, traits(qtype).row_meta_size
    assert meta in (0, 2, 4)

    def row(b, bo, xq, xd, xsum, xo, n):
        s = F(0)
        for sb in range(n // 256):
            s += chunk(b, bo + meta + block_bytes * sb, table, xq, xd, xsum, xo + 256 * sb)
        # a row scale in front of the blocks (float32, or float16) multiplies the whole row
        if meta == 4:
            return s * D.f32_at(b, bo)
        return s * D.half_at(b, bo) if meta == 2 else s
    return njit(row, inline="always")


def row_dot(kind, b, bo, x, xq, xd, xsum, xo, n):
    """The row at byte bo of b (of the type ``kind``) · x[xo:xo + n] (float types) or · the
    rounded activations xq * xd from xo on (the others).
    Offsets, not views: a view per row costs a reference count up and down, shared by the threads."""
    raise NotImplementedError("called from numba code only")


@overload(row_dot, prefer_literal=True, inline="always")
def _row_dot(kind, b, bo, x, xq, xd, xsum, xo, n):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value
    if k < FLOAT_KINDS:
        frow = _float_row(k)
        return lambda kind, b, bo, x, xq, xd, xsum, xo, n: frow(b, bo, x, xo, n)
    qtype = _TYPE_OF_KIND[k]
    row = _legacy_row(qtype) if qtype in LEGACY else _super_row(qtype)
    return lambda kind, b, bo, x, xq, xd, xsum, xo, n: row(b, bo, xq, xd, xsum, xo, n)


ROWS_PER_TASK = 16


@njit(**_OPTS)
def round_q8(x, xq, xd, xsum):
    """The activations x (n_tokens, n) as ggml's q8_0 rounds them, per 32: d = fp16(amax / 127),
    xq = rint(x * 127 / amax) (int8), xd = d, xsum = d * Σ xq; the values they
    stand for are xq * xd (kernels.round_q8_0_rows)."""
    for t in range(x.shape[0]):
        for blk in range(x.shape[1] // 32):
            amax = F(0)
            for i in range(32 * blk, 32 * blk + 32):
                amax = max(amax, abs(x[t, i]))
            inv = F(127.0) / amax if amax > 0 else F(0)
            total = 0
            for i in range(32 * blk, 32 * blk + 32):
                q = np.int8(np.rint(x[t, i] * inv))
                xq[t, i] = q
                total += q
            xd[t, blk] = half_round(amax / F(127.0))
            xsum[t, blk] = xd[t, blk] * F(total)


@njit(cache=True, error_model="numpy", parallel=True)
def _matvec(blocks, x, out, kind):
    """out[t, r] = row r of ``blocks`` (n_rows, row_size uint8, of the type ``kind`` selects; a
    literal, so each type compiles its own loop) · x[t], for the few tokens t of x (n_tokens, n_in)."""
    n_tok, n_in = x.shape
    n_rows, row_size = blocks.shape
    flat, xf = blocks.reshape(n_rows * row_size), x.reshape(n_tok * n_in)
    # np.empty: under parallel=True each np.zeros is a parallel loop of its own (2 us a launch)
    xq = np.empty(n_tok * n_in, np.int8)
    xd = np.empty(n_tok * n_in // 32, F)
    xsum = np.empty(n_tok * n_in // 32, F)
    if kind >= FLOAT_KINDS:
        round_q8(x, xq.reshape(n_tok, n_in), xd.reshape(n_tok, n_in // 32), xsum.reshape(n_tok, n_in // 32))
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            for t in range(n_tok):
                out[t, r] = row_dot(kind, flat, r * row_size, xf, xq, xd, xsum, t * n_in, n_in)


_U8_2D, _F32_2D = types.Array(types.uint8, 2, "C"), types.Array(types.float32, 2, "C")
_ENTRY: dict[int, object] = {}


def _kernel(kind: int):
    """_matvec compiled (or loaded from numba's cache) for the literal ``kind`` and called
    directly: through the dispatcher a literal argument costs a failed plain-int typing per call."""
    fn = _ENTRY.get(kind)
    if fn is None:
        sig = (_U8_2D, _F32_2D, _F32_2D, types.literal(kind))
        _matvec.compile(sig)
        fn = _ENTRY[kind] = _matvec.overloads[sig].entry_point
    return fn


def matvec(kind: int, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (n_tokens, n_in) float32 · the rows of ``blocks`` (n_rows, row_size uint8, of the type
    ``kind`` selects) -> (n_tokens, n_rows) float32; for a few tokens (each row is read once per
    token)."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    x = np.ascontiguousarray(x, F)
    out = np.empty((x.shape[0], blocks.shape[0]), F)
    _kernel(kind)(blocks, x, out, kind)
    return out
