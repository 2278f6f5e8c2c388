"""Block layouts of the quantized types, as data: where each block keeps its scales, how the
sub-block scales are packed, where the bits of every code sit and what a code stands for.

One declaration per type, from which the rest is derived:

* the runtime's fused generation products (runtime/matvec.py compiles one ``dot.chunk_dot`` per
  type from the runs below);
* the reference decoder that numpy and torch share (formats/decode.py reads the same runs and
  scales, value by value, through an array namespace).

Types whose layout these records cannot describe (row-scaled IQ2_KL and IQ4_KSS, the trellis KT
types) have a hand-written reference decoder in formats/decode.py instead, and no fused product.
Block sizes come from types.py (``traits``), never from literals here.

A block (legacy types: one block of 32 values; super-block types: 256 values) is a list of
:class:`Run` (a run of 8, 16 or 32 codes), each with the integer scale :class:`Scale` read from
the block (super-block types, :class:`Super`) or a float16 scale of its own (legacy blocks):

    code    = (byte[at + j] >> shift) & mask                low bits of value ``first + j``
              | ((byte[high_at + j] >> high_shift) & high_mask) << high_pos    (a plane of high bits)
              | bit (high_bit + j) of the uint32 at high_word << high_pos      (or a word of them)
    value   = d * (code - bias) (+ m)                       legacy: float16 d (and m) of the block
            = d * scale_k * (code - bias) - dmin * min_g    super-blocks: float16 d, integer scales
            = d * scale_k * grid[window_k + code]           non-linear types: a value table, whose
                                                            window a block's grid bit moves

Byte offsets are relative to the block's first byte (after a row's scale for the row-scaled
types: the row's float32 / float16 ``d`` multiplies all of the row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .tables import IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from .types import QuantType, traits

T = QuantType


class Run(NamedTuple):
    """One run of codes in a block; byte offsets are relative to the block's first byte, value
    offsets to its first value."""
    n: int                      # values (8, 16 or 32)
    xoff: int                   # the run's first value
    off: int                    # first byte of the low bits
    shift: int | None = None    # low bits (byte >> shift) & mask; None: the bytes are int8 codes
    mask: int | None = None
    hoff: int | None = None     # a plane of high bits, ((byte >> hshift) & hmask) << hpos
    hshift: int = 0
    hmask: int = 0
    hpos: int = 4
    bias: int = 0               # subtracted from the code (ignored with a grid)
    hword: int | None = None    # or high bit j is bit hbase + j of the 32-bit word at hword
    hbase: int = 0
    d_at: int | None = None     # the run's scale: the float16 at d_at (legacy), else the Super's
    m_at: int | None = None     # a float16 min added to every value (Q4_1, Q5_1)
    split: bool = False         # n/2 bytes at off: codes 0..n/2-1 their low nibbles, then the high

    def moved(self, byte_delta: int, value_delta: int) -> "Run":
        """The same run in a block byte_delta bytes and value_delta values further on."""
        def mv(v):
            return None if v is None else v + byte_delta
        return self._replace(xoff=self.xoff + value_delta, off=self.off + byte_delta, hoff=mv(self.hoff),
                             hword=mv(self.hword), d_at=mv(self.d_at), m_at=mv(self.m_at))


class Scale(NamedTuple):
    """A small integer read from a super-block's bytes (a run's scale, a group's min); offsets
    relative to the super-block's first byte:

        v = ((a[at] >> shift) & mask | ((a[hi_at] >> hi_shift) & hi_mask) << hi_pos) - bias
        int8(a[at])                                                 (signed)
        then 2 v + 1 (odd), and -v where bit neg_bit of a[neg_at] is set"""
    at: int
    shift: int = 0
    mask: int = 0xFF
    hi_at: int | None = None
    hi_shift: int = 0
    hi_mask: int = 0
    hi_pos: int = 4
    bias: int = 0
    signed: bool = False
    odd: bool = False
    neg_at: int | None = None
    neg_bit: int = 0

    def value(self, a, o) -> int:
        if self.signed:
            v = int(np.int8(a[o + self.at]))
        else:
            v = (int(a[o + self.at]) >> self.shift) & self.mask
            if self.hi_at is not None:
                v |= ((int(a[o + self.hi_at]) >> self.hi_shift) & self.hi_mask) << self.hi_pos
            v -= self.bias
        if self.odd:
            v = 2 * v + 1
        if self.neg_at is not None and (int(a[o + self.neg_at]) >> self.neg_bit) & 1:
            v = -v
        return v


class Super(NamedTuple):
    """What a super-block reads besides its runs: value = d * scale_k * code (- dmin * min)."""
    d_at: int | None                # the float16 super-block scale (None: 1, and the row's scale
                                    # multiplies the row: the *_KS types)
    scales: tuple                   # run k's integer scale (Scale)
    dmin_at: int | None = None      # a float16 scale of the mins (Q4_K, Q5_K, Q2_K)
    mins: tuple = ()                # 32-group g's integer min (Scale)
    run_mins: tuple = ()            # or run k's integer min (Scale; Q2_K: one per 16 values)
    grid: tuple = ()                # with a grid: run k's (byte, bit) moving its window
    grid_step: int = 0              # of the grid by grid_step entries where set


@dataclass(frozen=True)
class Layout:
    """A type's block: its runs, and its super-block scales (None: a legacy block, whose runs
    carry their float16 scale).  ``grid``: the int8 value table the codes index (None: the codes
    minus their bias are the values)."""
    qtype: QuantType
    runs: tuple
    sup: Super | None = None
    grid: np.ndarray | None = None

    @property
    def block_bytes(self) -> int:
        return traits(self.qtype).type_size

    @property
    def block_values(self) -> int:
        return traits(self.qtype).block_size

    @property
    def row_scale_bytes(self) -> int:
        """The float32 (4) or float16 (2) scale in front of each row; 0: none."""
        return traits(self.qtype).row_meta_size


# ---- legacy types: blocks of 32 values, a float16 d (and m) each ----
#
#   Q8_0    | d | q[32] int8 |                                    value j = d * q[j]
#           0   2          34
#
#   Q4_0    | d | qs[16] |             qs[j] = code j | code j+16 << 4     value = d * (code - 8)
#   Q4_1    | d | m | qs[16] |                                            value = d * code + m
#   IQ4_NL  | d | qs[16] |             (as Q4_0)                          value = d * grid[code]
#           0   2   4
#
#   Q5_0    | d | qh u32 | qs[16] |    bit j of qh: bit 4 of code j       value = d * (code - 16)
#   Q5_1    | d | m | qh u32 | qs[16] |                                   value = d * code + m
#
#   Q6_0    | d | qh[8] | qs[16] |     low 4 bits as Q4_0's; the 2 high bits of code j (j < 8) are
#           0   2       10      26     bits 0-1 of qh[j], j + 8: bits 4-5 of qh[j], j + 16: bits
#                                      2-3 of qh[j], j + 24: bits 6-7 (code - 32)

def _nibbles32(at, **kw):
    """A 32-value block's codes as 16 bytes at ``at``: low nibbles the first 16, high the next."""
    return Run(n=32, xoff=0, off=at, shift=0, mask=15, split=True, d_at=0, **kw)


def _q6_0_runs():
    runs = []
    for xoff, high_shift in ((0, 0), (8, 4), (16, 2), (24, 6)):
        runs.append(Run(n=8, xoff=xoff, off=10 + 8 * (xoff // 8 % 2), shift=4 * (xoff // 16), mask=15,
                        hoff=2, hshift=high_shift, hmask=3, hpos=4, bias=32, d_at=0))
    return tuple(runs)


_LEGACY = (
    Layout(T.Q8_0, (Run(n=32, xoff=0, off=2, d_at=0),)),
    Layout(T.Q4_0, (_nibbles32(2, bias=8),)),
    Layout(T.Q4_1, (_nibbles32(4, m_at=2),)),
    Layout(T.Q5_0, (_nibbles32(6, bias=16, hword=2, hpos=4),)),
    Layout(T.Q5_1, (_nibbles32(8, hword=4, hpos=4, m_at=2),)),
    Layout(T.Q6_0, _q6_0_runs()),
    Layout(T.IQ4_NL, (_nibbles32(2),), grid=IQ4K_VALUES[:16]),
)


# ---- shared pieces of the super-block layouts ----

def _two_bits(qs_at, v0):
    """(byte, shift) of value v0's 2 bits in Q2_K's layout of qs[64] at qs_at:

        value v = 128 h + 32 s + l  ->  bits 2s..2s+1 of qs[32 h + l]

    (Q2_K, Q3_K, IQ2_K, IQ3_K, IQ2_KS, IQ3_KS, and the top 2 bits of IQ6_K)."""
    return dict(off=qs_at + 32 * (v0 // 128) + v0 % 32, shift=2 * (v0 % 128 // 32))


def _k4(j, mins):
    """Q4_K/Q5_K's scales[12] at byte 4: 8 6-bit scales and 8 6-bit mins (get_scale_min_k4)

        byte  4 + j      (j < 4)   scale j (bits 0-5) | bits 4-5 of scale j + 4 (bits 6-7)
        byte  8 + j      (j < 4)   min j              | bits 4-5 of min j + 4
        byte 12 + j      (j < 4)   bits 0-3 of scale j + 4 | bits 0-3 of min j + 4 << 4"""
    if j < 4:
        return Scale(at=4 + j + 4 * mins, mask=63)
    return Scale(at=8 + j, shift=4 * mins, mask=15, hi_at=j + 4 * mins, hi_shift=6, hi_mask=3, hi_pos=4)


def _iqk_scale(ib, scales_l_at, scales_h_at):
    """IQ4_XS / IQ4_K / IQ5_K: 6-bit scale ib, minus 32 = nibble ib % 2 of scales_l[ib // 2]
    | bits 2 (ib % 4)..+1 of scales_h[ib // 4] << 4."""
    return Scale(at=scales_l_at + ib // 2, shift=4 * (ib % 2), mask=15,
                 hi_at=scales_h_at + ib // 4, hi_shift=2 * (ib % 4), hi_mask=3, hi_pos=4, bias=32)


# bit k of the 16-bit ``extra`` word at byte 2: sub-block k's grid choice (IQ2_K .. IQ6_K)
_EXTRA_BITS = tuple((2 + k // 8, k % 8) for k in range(16))
_SUB16 = range(0, 256, 16)          # first values of the 16 sub-blocks of 16
_KS_SCALES = tuple(Scale(at=g, mask=254, bias=127) for g in range(8))


# ---- k-quants: super-blocks of 256 ----
#
#   Q2_K  | scales[16] | qs[64] | d | dmin |      codes: _two_bits(16, v); sub-block j = v // 16:
#         0            16       80  82   84      value = d * (scales[j] & 15) * code
#                                                        - dmin * (scales[j] >> 4)
#
#   Q3_K  | hmask[32] | qs[64] | scales[12] | d |   low 2 bits: _two_bits(32, v), v = 128 h + 32 s + l;
#         0           32       96           108 110 bit 2: bit 4h + s of hmask[l]; code - 4.
#         the 6-bit scale of sub-block j, minus 32: nibble j // 8 of scales[j % 8]
#         | bits 2 (j // 4)..+1 of scales[8 + j % 4] << 4
#
#   Q4_K  | d | dmin | scales[12] | qs[128] |       32-group g: nibble g % 2 of qs[32 (g // 2) + l];
#   Q5_K  | d | dmin | scales[12] | qh[32] | qs[128] |   Q5_K: bit g of qh[l] above it
#         0   2      4            16       48     176  value = d * sc_g * code - dmin * m_g (_k4)
#
#   Q6_K  | ql[128] | qh[64] | scales[16] int8 | d |   v = 128 h + 32 q + l: nibble q // 2 of
#         0         128      192               208 210 ql[64 h + 32 (q % 2) + l], bits 2q..2q+1 of
#                                                      qh[32 h + l] above it; code - 32; scale of
#                                                      16 values: scales[v // 16]

def _q2_k():
    return Layout(T.Q2_K, tuple(Run(n=16, xoff=v0, **_two_bits(16, v0), mask=3) for v0 in _SUB16),
                  Super(d_at=80, dmin_at=82, scales=tuple(Scale(at=j, mask=15) for j in range(16)),
                        run_mins=tuple(Scale(at=j, shift=4, mask=15) for j in range(16))))


def _q3_k():
    runs = tuple(Run(n=16, xoff=v0, **_two_bits(32, v0), mask=3, hoff=v0 % 32, hshift=v0 // 32, hmask=1,
                     hpos=2, bias=4) for v0 in _SUB16)
    scales = tuple(Scale(at=96 + j % 8, shift=4 * (j // 8), mask=15, hi_at=104 + j % 4, hi_shift=2 * (j // 4),
                         hi_mask=3, hi_pos=4, bias=32) for j in range(16))
    return Layout(T.Q3_K, runs, Super(d_at=108, scales=scales))


def _q45_k(qtype, high_bits):
    qs_at = 48 if high_bits else 16
    runs = []
    for g in range(8):
        high = dict(hoff=16, hshift=g, hmask=1, hpos=4) if high_bits else {}
        runs.append(Run(n=32, xoff=32 * g, off=qs_at + 32 * (g // 2), shift=4 * (g % 2), mask=15, **high))
    return Layout(qtype, tuple(runs), Super(d_at=0, dmin_at=2, scales=tuple(_k4(g, 0) for g in range(8)),
                                            mins=tuple(_k4(g, 1) for g in range(8))))


def _q6_k():
    runs, scales = [], []
    for h in range(2):
        for q in range(4):
            for l0 in (0, 16):
                runs.append(Run(n=16, xoff=128 * h + 32 * q + l0, off=64 * h + 32 * (q % 2) + l0, shift=4 * (q // 2),
                                mask=15, hoff=128 + 32 * h + l0, hshift=2 * q, hmask=3, hpos=4, bias=32))
                scales.append(Scale(at=192 + 8 * h + 2 * q + l0 // 16, signed=True))
    return Layout(T.Q6_K, tuple(runs), Super(d_at=208, scales=tuple(scales)))


# ---- non-linear super-block types (IQ4_XS, and ik's IQK types) ----
#
#   IQ4_XS | d | scales_h u16 | scales_l[4] | qs[128] |   32-group ib: the 16 bytes at 8 + 16 ib
#          0   2              4             8     136     (low nibbles, then high); scale ib:
#                                                         _iqk_scale(ib, 4, 2)
#
#   IQ2_K  | d | extra | scales[8] | qs[64] |      codes _two_bits(12, v); sub-block ib's scale:
#          0   2       4           12      76      nibble ib % 2 of scales[ib // 2], minus 8
#
#   IQ3_K  | d | extra | signs | scales_l[8] | qs[64] | qh[32] |   low 2 bits _two_bits(14, v),
#          0   2       4       6             14       78     110  bit 2: bit v // 32 of qh[v % 32];
#          scale ib: 2 * nibble ib % 2 of scales_l[ib // 2] + 1, negative where bit ib of signs is
#
#   IQ4_K  | d | extra | scales_h[4] | scales_l[8] | qs[128] |   sub-block ib: nibble ib % 2 of
#          0   2       4             8             16     144   the 16 bytes at 16 + 16 (ib // 2)
#   IQ5_K  | d | extra | scales_h[4] | scales_l[8] | qs[128] | qh[32] |   low 4 bits: nibble
#          0   2       4             8             16        144    176  (v // 32) % 2 of
#          qs[32 (v // 64) + v % 32]; bit 4: bit v // 32 of qh[v % 32]; scales _iqk_scale(ib, 8, 4)
#   IQ6_K  | d | extra | scales[16] int8 | qs[128] | qh[64] |   low 4 bits as IQ5_K's (qs at 20),
#          0   2       4                 20        148    212  bits 4-5: _two_bits(148, v)
#
#   each sub-block ib of 16 takes the second half of the grid where bit ib of ``extra`` is set
#
# row-scaled (a float32 / float16 scale in front of the row's super-blocks):
#
#   IQ4_KS | scales[8] | qs[128] |            32-group g: as IQ4_XS's; scales[g]: bit 0 the grid
#          0           8     136              choice, (scales[g] & 254) - 127 the scale
#   IQ5_KS | scales[8] | qs[128] | qh[32] |   32-group g: nibble g % 2 of qs[32 (g // 2) + l],
#          0           8         136    168   bit 4: bit g of qh[l]; scales as IQ4_KS's
#   IQ2_KS | extra u16 | scales[4] | qs[64] |            codes _two_bits(6, v); bit g of extra:
#          0           2           6      70             grid choice, bit 8 + g: bit 4 of the scale
#   IQ3_KS | extra u16 | scales[4] | qs[64] | qh[32] |   codes as IQ2_KS's, bit 2: bit g of qh[l];
#          0           2           6        70     102  bit g of extra: bit 4 of the scale, 8 + g
#          the grid choice; the low 4 bits of group g's scale: nibble g // 4 of scales[g % 4]
#          (IQ2_KS: nibble g % 2 of scales[g // 2]); both minus 16

def _iq4_xs():
    runs = tuple(Run(n=16, xoff=32 * ib + 16 * h, off=8 + 16 * ib, shift=4 * h, mask=15)
                 for ib in range(8) for h in range(2))
    scales = tuple(_iqk_scale(ib, 4, 2) for ib in range(8) for h in range(2))
    return Layout(T.IQ4_XS, runs, Super(d_at=0, scales=scales), grid=IQ4K_VALUES[:16])


def _grid_scales(scales, step):
    return Super(d_at=0, scales=tuple(scales), grid=_EXTRA_BITS, grid_step=step)


def _iq2_k():
    runs = tuple(Run(n=16, xoff=v0, **_two_bits(12, v0), mask=3) for v0 in _SUB16)
    scales = (Scale(at=4 + ib // 2, shift=4 * (ib % 2), mask=15, bias=8) for ib in range(16))
    return Layout(T.IQ2_K, runs, _grid_scales(scales, 4), grid=IQ2NL_VALUES)


def _iq3_k():
    runs = tuple(Run(n=16, xoff=v0, **_two_bits(14, v0), mask=3, hoff=78 + v0 % 32, hshift=v0 // 32, hmask=1, hpos=2)
                 for v0 in _SUB16)
    scales = (Scale(at=6 + ib // 2, shift=4 * (ib % 2), mask=15, odd=True, neg_at=4 + ib // 8, neg_bit=ib % 8)
              for ib in range(16))
    return Layout(T.IQ3_K, runs, _grid_scales(scales, 8), grid=IQ3NL_VALUES)


def _iq4_k():
    runs = tuple(Run(n=16, xoff=16 * ib, off=16 + 16 * (ib // 2), shift=4 * (ib % 2), mask=15) for ib in range(16))
    return Layout(T.IQ4_K, runs, _grid_scales((_iqk_scale(ib, 8, 4) for ib in range(16)), 16), grid=IQ4K_VALUES)


def _nibbles64(qs_at, v0, **high):
    """16 values from v0 in IQ5_K's / IQ6_K's nibble order: nibble (v // 32) % 2 of
    qs[32 (v // 64) + v % 32]."""
    return Run(n=16, xoff=v0, off=qs_at + 32 * (v0 // 64) + v0 % 32, shift=4 * (v0 // 32 % 2), mask=15, **high)


def _iq5_k():
    runs = tuple(_nibbles64(16, v0, hoff=144 + v0 % 32, hshift=v0 // 32, hmask=1, hpos=4) for v0 in _SUB16)
    return Layout(T.IQ5_K, runs, _grid_scales((_iqk_scale(ib, 8, 4) for ib in range(16)), 32), grid=IQ5NL_VALUES)


def _iq6_k():
    """The grid as ik's matrix products use it; its to_float decodes a cubic in the code instead
    (formats/decode.py)."""
    runs = []
    for v0 in _SUB16:
        top = _two_bits(148, v0)
        runs.append(_nibbles64(20, v0, hoff=top["off"], hshift=top["shift"], hmask=3, hpos=4))
    scales = (Scale(at=4 + ib, signed=True) for ib in range(16))
    return Layout(T.IQ6_K, tuple(runs), _grid_scales(scales, 64), grid=IQ6NL_VALUES)


def _iq4_ks():
    runs = tuple(Run(n=32, xoff=32 * g, off=8 + 16 * g, shift=0, mask=15, split=True) for g in range(8))
    return Layout(T.IQ4_KS, runs, Super(d_at=None, scales=_KS_SCALES, grid=tuple((g, 0) for g in range(8)),
                                        grid_step=16), grid=IQ4K_VALUES)


def _iq5_ks():
    runs = tuple(Run(n=32, xoff=32 * g, off=8 + 32 * (g // 2), shift=4 * (g % 2), mask=15, hoff=136, hshift=g,
                     hmask=1, hpos=4) for g in range(8))
    return Layout(T.IQ5_KS, runs, Super(d_at=None, scales=_KS_SCALES, grid=tuple((g, 0) for g in range(8)),
                                        grid_step=32), grid=IQ5NL_VALUES)


def _iq2_ks():
    runs = tuple(Run(n=32, xoff=32 * g, **_two_bits(6, 32 * g), mask=3) for g in range(8))
    scales = tuple(Scale(at=2 + g // 2, shift=4 * (g % 2), mask=15, hi_at=1, hi_shift=g, hi_mask=1, hi_pos=4, bias=16)
                   for g in range(8))
    return Layout(T.IQ2_KS, runs, Super(d_at=None, scales=scales, grid=tuple((0, g) for g in range(8)), grid_step=4),
                  grid=IQ2NL_VALUES)


def _iq3_ks():
    runs = tuple(Run(n=32, xoff=32 * g, **_two_bits(6, 32 * g), mask=3, hoff=70, hshift=g, hmask=1, hpos=2)
                 for g in range(8))
    scales = tuple(Scale(at=2 + g % 4, shift=4 * (g // 4), mask=15, hi_at=0, hi_shift=g, hi_mask=1, hi_pos=4, bias=16)
                   for g in range(8))
    return Layout(T.IQ3_KS, runs, Super(d_at=None, scales=scales, grid=tuple((1, g) for g in range(8)), grid_step=8),
                  grid=IQ3NL_VALUES)


# every type with a layout, legacy blocks first (the order of matvec's kernel selectors)
LAYOUTS: dict[QuantType, Layout] = {lay.qtype: lay for lay in (
    *_LEGACY, _iq4_xs(), _q45_k(T.Q4_K, False), _q45_k(T.Q5_K, True), _q6_k(), _iq4_k(), _iq2_k(), _q3_k(),
    _iq3_k(), _iq5_k(), _iq4_ks(), _iq5_ks(), _iq2_ks(), _iq3_ks(), _q2_k(), _iq6_k())}


def layout(qtype) -> Layout | None:
    """The block layout of ``qtype``, or None when no record describes it."""
    return LAYOUTS.get(QuantType(qtype))
