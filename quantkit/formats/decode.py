"""The reference decoder: stored bytes -> float32 rows, one per type, for numpy and torch alike.

Written once against a small array namespace (:class:`ArrayNamespace`: ``NUMPY`` here,
runtime/torch_decode.py's ``TORCH``): indexing, slicing, shifts, masks and products are spelled the same in both libraries;
what differs (reading a float16 from bytes, concatenating, constants on a device) goes through
the namespace.  The numba decoders in kernels/ are the fast implementation; the tests hold them
to this one bit for bit, type by type (formats' ``reference=True``, the torch backend).

* Types with a block layout (quantkit/layouts.py: legacy blocks, k-quants, IQ4_XS and ik's IQK
  types) are decoded from it: per value of a block, where its code bits sit and which scale it
  takes, derived once per type (:func:`_value_map`); a few gathers decode every block at once.
* IQ2_KL, IQ4_KSS, the trellis KT types, the ternary types and the i-quants, whose codes the layout
  records cannot describe (value pairs, xor-folded words, hashed codebooks, 5 trits per byte, lattice
  points with sign bits), have a decoder written by hand below.

The arithmetic follows ggml's dequantize_row_* (products in the same order: (d * scale) * value
- dmin * min), so every library gives the numba kernels' float32 values exactly.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..grids import IQ1S_VALUES, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS
from ..kernels.iq2kl import PAIRS
from ..kernels.ternary import POW3
from ..layouts import LAYOUTS, Layout
from ..tables import A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K, E8M0_HALF, FP16_TABLE, IQ4K_VALUES, MXFP4_VALUES
from ..types import QuantType, traits
from ._kt_codebook import IQ4_KT_SECOND_OFFSET, OFFSET, SPECS, trellis_values

T = QuantType


class ArrayNamespace:
    """What numpy and torch spell differently, as functions (positional arguments, which both
    libraries take alike): ``cat(arrays, axis)``, ``stack(arrays, axis)``, ``repeat(a, n, axis)``
    (each row n times), ``where(cond, a, b)``; ``ints`` / ``floats``: an array as int64 / float32;
    ``as_f16`` / ``as_f32``: contiguous bytes (n, 2) / (n, 4) read as (n, 1) float16 / float32;
    ``device(a)`` and ``to_device(numpy_array, a)``: where an array lives, and a constant put there.
    Codes and scales are int32 (half the memory traffic of int64); index tables int64."""

    def __init__(self, *, ints, floats, as_f16, as_f32, cat, stack, repeat, where, device, to_device):
        self.ints, self.floats, self.as_f16, self.as_f32 = ints, floats, as_f16, as_f32
        self.cat, self.stack, self.repeat, self.where = cat, stack, repeat, where
        self._device, self._to_device = device, to_device
        self._consts: dict = {}

    def const(self, like, key, make):
        """The constant ``make()`` (a numpy array: an index table, a grid) where ``like`` lives,
        made once per device."""
        full = (key, self._device(like))
        if full not in self._consts:
            self._consts[full] = self._to_device(np.ascontiguousarray(make()), like)
        return self._consts[full]

    def f16(self, b, at):
        """The float16 at byte ``at`` of every row of b (uint8), as float32 (n, 1)."""
        return self.floats(self.as_f16(b[:, at:at + 2]))

    def f32(self, b, at):
        return self.as_f32(b[:, at:at + 4])


NUMPY = ArrayNamespace(
    ints=lambda a: np.asarray(a).astype(np.int32), floats=lambda a: np.asarray(a).astype(np.float32),
    as_f16=lambda b: np.ascontiguousarray(b).view("<f2"), as_f32=lambda b: np.ascontiguousarray(b).view("<f4"),
    cat=np.concatenate, stack=np.stack, repeat=np.repeat, where=np.where,
    device=lambda a: "numpy", to_device=lambda a, like: a)


# ---- types with a layout ----

class _ValueMap(NamedTuple):
    """Per value of a block, from its layout's runs: code = ((byte[low_at] >> low_shift) & low_mask)
    | ((byte[high_at] >> high_shift) & high_mask) << high_pos; ``run`` the run it belongs to."""
    low_at: np.ndarray
    low_shift: np.ndarray
    low_mask: np.ndarray
    high_at: np.ndarray
    high_shift: np.ndarray
    high_mask: np.ndarray
    high_pos: np.ndarray
    bias: np.ndarray
    run: np.ndarray


_INDEX_FIELDS = {"low_at", "high_at", "run", "at", "hi_at", "neg_at"}       # int64: they index


@lru_cache(maxsize=None)
def _value_map(qtype: QuantType) -> _ValueMap:
    lay = LAYOUTS[qtype]
    cols = [np.zeros(lay.block_values, np.int64 if f in _INDEX_FIELDS else np.int32) for f in _ValueMap._fields]
    m = _ValueMap(*cols)
    seen = np.zeros(lay.block_values, bool)
    for k, r in enumerate(lay.runs):
        assert r.hoff is None or r.hword is None
        for j in range(r.n):
            v = r.xoff + j
            assert not seen[v]
            seen[v] = True
            m.run[v], m.bias[v] = k, r.bias
            if r.shift is None:                          # int8 codes: signed by _codes
                m.low_at[v], m.low_mask[v] = r.off + j, 0xFF
            elif r.split:                                # low nibbles first, then the high ones
                m.low_at[v], m.low_shift[v], m.low_mask[v] = r.off + j % (r.n // 2), 4 * (2 * j >= r.n), r.mask
            else:
                m.low_at[v], m.low_shift[v], m.low_mask[v] = r.off + j, r.shift, r.mask
            m.high_at[v] = m.low_at[v]
            if r.hoff is not None:
                m.high_at[v], m.high_shift[v], m.high_mask[v], m.high_pos[v] = r.hoff + j, r.hshift, r.hmask, r.hpos
            elif r.hword is not None:                    # bit hbase + j of a little-endian uint32
                bit = r.hbase + j
                m.high_at[v], m.high_shift[v], m.high_mask[v], m.high_pos[v] = r.hword + bit // 8, bit % 8, 1, r.hpos
    assert seen.all(), f"{qtype!r}: the runs do not tile the block"
    return m


class _ScaleMap(NamedTuple):
    """The Scale records of one list (layouts.Scale), field by field."""
    at: np.ndarray
    shift: np.ndarray
    mask: np.ndarray
    hi_at: np.ndarray
    hi_shift: np.ndarray
    hi_mask: np.ndarray
    hi_pos: np.ndarray
    bias: np.ndarray
    odd: np.ndarray
    neg_at: np.ndarray
    neg_mask: np.ndarray
    neg_bit: np.ndarray


@lru_cache(maxsize=None)
def _scale_map(specs: tuple) -> tuple[_ScaleMap, bool]:
    """(the fields of ``specs`` as arrays, whether they are int8 bytes)."""
    signed = {sp.signed for sp in specs}
    assert len(signed) == 1
    col = lambda f: np.array([f(sp) for sp in specs], np.int32)      # noqa: E731
    idx = lambda f: np.array([f(sp) for sp in specs], np.int64)      # noqa: E731
    return _ScaleMap(
        at=idx(lambda sp: sp.at), shift=col(lambda sp: sp.shift), mask=col(lambda sp: sp.mask),
        hi_at=idx(lambda sp: sp.at if sp.hi_at is None else sp.hi_at), hi_shift=col(lambda sp: sp.hi_shift),
        hi_mask=col(lambda sp: 0 if sp.hi_at is None else sp.hi_mask), hi_pos=col(lambda sp: sp.hi_pos),
        bias=col(lambda sp: sp.bias), odd=col(lambda sp: int(sp.odd)),
        neg_at=idx(lambda sp: sp.at if sp.neg_at is None else sp.neg_at),
        neg_mask=col(lambda sp: int(sp.neg_at is not None)), neg_bit=col(lambda sp: sp.neg_bit)), signed.pop()


def _consts(xp, like, key, arrays: NamedTuple):
    return type(arrays)(*(xp.const(like, (key, name), lambda a=a: a) for name, a in zip(arrays._fields, arrays)))


def _small_ints(xp, blk, specs):
    """The integers ``specs`` (layouts.Scale) describe, for every block: (n_blocks, len(specs))."""
    sm, signed = _scale_map(specs)
    c = _consts(xp, blk, ("scales", specs), sm)
    if signed:
        v = (blk[:, c.at] ^ 0x80) - 0x80
    else:
        v = ((blk[:, c.at] >> c.shift) & c.mask) | (((blk[:, c.hi_at] >> c.hi_shift) & c.hi_mask) << c.hi_pos)
        v = v - c.bias
    if sm.odd.any():
        v = v * (1 + c.odd) + c.odd                                  # 2 v + 1
    if sm.neg_mask.any():
        v = v * (1 - 2 * ((blk[:, c.neg_at] >> c.neg_bit) & c.neg_mask))
    return v


def _cubic_iq6_k(xp, code, grid_bit):
    """IQ6_K's to_float: a cubic in the 6-bit code, plus the grid bit (its matrix products read the
    grid of its layout instead; the two differ by up to 0.49 of a step)."""
    q = xp.floats(code)
    return (A_IQ6K + q * (B_IQ6K + q * (-C_IQ6K + q * D_IQ6K))) + xp.floats(grid_bit)


# types whose to_float does not read their layout's grid
_TO_FLOAT = {T.IQ6_K: _cubic_iq6_k}


def _decode_layout(xp, b, lay: Layout, n_per_row: int, products: bool = False):
    n_rows = b.shape[0]
    meta = lay.row_scale_bytes
    raw = b[:, meta:].reshape(-1, lay.block_bytes)
    blk = xp.ints(raw)
    m = _consts(xp, b, ("values", lay.qtype), _value_map(lay.qtype))
    code = ((blk[:, m.low_at] >> m.low_shift) & m.low_mask) | (((blk[:, m.high_at] >> m.high_shift) & m.high_mask) << m.high_pos)
    if lay.runs[0].shift is None:
        code = (code ^ 0x80) - 0x80                                 # int8 codes (Q8_0)
    sup = lay.sup
    grid_bit = 0
    if sup is not None and sup.grid:
        at = xp.const(b, ("grid_at", lay.qtype), lambda: np.array([a for a, _ in sup.grid], np.int64))
        bit = xp.const(b, ("grid_bit", lay.qtype), lambda: np.array([s for _, s in sup.grid], np.int32))
        grid_bit = ((blk[:, at] >> bit) & 1)[:, m.run]
    to_float = None if products else _TO_FLOAT.get(lay.qtype)
    if to_float is not None:
        v = to_float(xp, code, grid_bit)
    elif lay.grid is not None:
        grid = xp.const(b, ("grid", lay.qtype), lambda: lay.grid.astype(np.float32))
        v = grid[code + sup.grid_step * grid_bit] if sup is not None and sup.grid else grid[code]
    else:
        v = xp.floats(code - m.bias)
    if sup is None:                                                 # legacy: a float16 d (and m) per block
        (d_at,), (m_at,) = {r.d_at for r in lay.runs}, {r.m_at for r in lay.runs}
        y = v * xp.f16(raw, d_at)
        if m_at is not None:
            y = y + xp.f16(raw, m_at)
        return y.reshape(n_rows, n_per_row)
    if sup.d_at is not None:
        d = xp.f16(raw, sup.d_at)
    else:                                                           # the row's scale, for each block
        d = xp.repeat(xp.f32(b, 0) if meta == 4 else xp.f16(b, 0), n_per_row // lay.block_values, 0)
    y = (d * xp.floats(_small_ints(xp, blk, sup.scales)))[:, m.run] * v
    if sup.mins:
        group = xp.const(b, ("group", lay.qtype), lambda: np.arange(lay.block_values) // 32)
        y = y - (xp.f16(raw, sup.dmin_at) * xp.floats(_small_ints(xp, blk, sup.mins)))[:, group]
    if sup.run_mins:
        y = y - (xp.f16(raw, sup.dmin_at) * xp.floats(_small_ints(xp, blk, sup.run_mins)))[:, m.run]
    return y.reshape(n_rows, n_per_row)


# ---- hand-written: the row-scaled types the layout records cannot describe ----

def _row_blocks(xp, b, n_per_row, qtype):
    """Rows that start with a scale: (the scale per block (n_blocks, 1) float32, the blocks as int64
    (n_blocks, block bytes))."""
    t = traits(qtype)
    d = xp.f32(b, 0) if t.row_meta_size == 4 else xp.f16(b, 0)
    return xp.repeat(d, n_per_row // t.block_size, 0), xp.ints(b[:, t.row_meta_size:].reshape(-1, t.type_size))


def _arange(xp, like, n):
    return xp.const(like, ("arange", n), lambda: np.arange(n))


def _table(xp, like, key, values):
    return xp.const(like, ("table", key), lambda: np.asarray(values, np.float32))


def _iq2_kl(xp, b, n_per_row):
    """An fp16 row scale, then blocks { scales_h u16 @0 (2 bits per 32-group); scales_l[4] @2
    (group ib: nibble ib // 4 of byte ib % 4); qs[64] @6; qh[16] @70 }: 5-bit codes of value pairs
    (kernels.iq2kl.PAIRS), group ib's 16 codes from nibble ib % 2 of qs[16 (ib // 2)..], bit 4
    bit ib of qh[..]."""
    d, blk = _row_blocks(xp, b, n_per_row, T.IQ2_KL)
    ib = _arange(xp, b, 8)
    scales_h = blk[:, 0:1] | (blk[:, 1:2] << 8)
    uls = ((blk[:, 2 + ib % 4] >> (4 * (ib // 4))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
    qs = blk[:, 6:70].reshape(-1, 4, 16)
    lo = xp.stack([qs & 0xF, qs >> 4], 2).reshape(-1, 8, 16)
    hi = (blk[:, None, 70:86] >> ib[None, :, None]) & 1
    pairs = _table(xp, b, "iq2_kl", PAIRS)[lo | (hi << 4)]                 # (n_blocks, 8, 16, 2)
    dl = d * xp.floats(uls - 32)
    return (dl[:, :, None, None] * pairs).reshape(b.shape[0], n_per_row)


def _iq4_kss(xp, b, n_per_row):
    """A float32 row scale, then per 32 values 8 u16 words: bit 0 of word k is bit k of the group's
    scale byte, bits 1-15 hold the 4-bit codes of 4 values, xor-folded (a ^= a >> 1 undoes it);
    bit 0 of the scale byte picks the shifted half of IQ4_K's grid, (byte & 254) - 127 the scale."""
    n_rows = b.shape[0]
    d = xp.repeat(xp.f32(b, 0), n_per_row // 32, 0)
    raw = xp.ints(b[:, 4:].reshape(-1, 16))
    w = raw[:, 0::2] | (raw[:, 1::2] << 8)                           # (n_groups, 8)
    ls = ((w & 1) << _arange(xp, b, 8)).sum(1)
    a = w & 0xFFFE
    a = a ^ (a >> 1)
    qs = xp.stack([a & 0xFF, a >> 8], -1).reshape(-1, 16)
    q = xp.cat([qs & 0xF, qs >> 4], 1)
    grid = _table(xp, b, "iq4_k", IQ4K_VALUES)
    v = grid[q + 16 * (ls & 1)[:, None]]
    dl = d.reshape(-1) * xp.floats((ls & 254) - 127)
    return (dl[:, None] * v).reshape(n_rows, n_per_row)


# ---- hand-written: trellis (IQn_KT), a float32 row scale, then 256-value blocks of 8 sub-blocks ----
#
# A code selects a group of 8 (IQ4_KT: 4) integer values made by a hash; they are a fixed table
# per type (2^bits x group, formats._kt_codebook.trellis_values), made once, so decoding is bit
# extraction, one gather and one product: value = (d * scale) * table[code].

def _trellis(xp, like, name, offset=OFFSET):
    spec = SPECS[name]
    return xp.const(like, ("trellis", name, offset),
                    lambda: trellis_values(np.arange(1 << spec.num_bits), spec.group, spec.is_abs, offset))


def _iq1_kt(xp, b, n_per_row):
    """56 B: sh[8] | ql[32] | qh[16]; code (ib, j) = ql[4 ib + j] | nibble ib // 4 of
    qh[4 (ib % 4) + j] << 8 | bit 4 + j of sh[ib] << 12; scale: IQ4_NL's grid at sh & 15."""
    d, blk = _row_blocks(xp, b, n_per_row, T.IQ1_KT)
    sh, ql = blk[:, :8], blk[:, 8:40].reshape(-1, 8, 4)
    ib, j = _arange(xp, b, 8)[:, None], _arange(xp, b, 4)[None, :]
    hi = (blk[:, 40 + 4 * (ib % 4) + j] << (8 - 4 * (ib // 4))) & 0xF00
    codes = ql | hi | ((sh[:, :, None] << (8 - j)) & 0x1000)
    sl = d * _table(xp, b, "iq4_nl", IQ4K_VALUES[:16])[sh & 0xF]
    return (sl[:, :, None, None] * _trellis(xp, b, "iq1_kt")[codes]).reshape(b.shape[0], n_per_row)


def _iq23_kt(xp, b, n_per_row, name):
    """scales[4] | 16-bit codes[32] (| qh[32] signs for IQ3_KT: bit ib of qh[j] negates value j of
    sub-block ib); sub-block ib's scale nibble ib // 4 of byte ib % 4: IQ2_KT's the IQ4_NL grid
    entry, IQ3_KT's the nibble itself."""
    three = name == "iq3_kt"
    d, blk = _row_blocks(xp, b, n_per_row, T.IQ3_KT if three else T.IQ2_KT)
    codes = (blk[:, 4:68:2] | (blk[:, 5:68:2] << 8)).reshape(-1, 8, 4)
    s = blk[:, :4]
    nib = xp.cat([s & 0xF, s >> 4], 1)
    sl = d * (xp.floats(nib) if three else _table(xp, b, "iq4_nl", IQ4K_VALUES[:16])[nib])
    v = (sl[:, :, None, None] * _trellis(xp, b, name)[codes]).reshape(-1, 8, 32)
    if three:
        neg = ((blk[:, None, 68:100] >> _arange(xp, b, 8)[None, :, None]) & 1) == 1
        v = xp.where(neg, -v, v)
    return v.reshape(b.shape[0], n_per_row)


def _iq4_kt(xp, b, n_per_row):
    """128 B: 8 uint32 words (bit 0: second table, bits 1-7: scale + 64, bits 8 + 3 j..: code bits
    12-14 of group j) | ql[64] (code bits 0-7) | qh[32] (bits 8-11 of group g in nibble g // 32 of
    qh[g % 32]); 15-bit codes of 4 values."""
    d, blk = _row_blocks(xp, b, n_per_row, T.IQ4_KT)
    head = blk[:, 0:32:4] | (blk[:, 1:32:4] << 8) | (blk[:, 2:32:4] << 16) | (blk[:, 3:32:4] << 24)     # (n, 8)
    g = _arange(xp, b, 64)
    low = (blk[:, 32 + g] | ((blk[:, 96 + g % 32] << (8 - 4 * (g // 32))) & 0xF00)).reshape(-1, 8, 8)
    codes = low | (((head[:, :, None] >> (8 + 3 * _arange(xp, b, 8))) & 7) << 12)
    first = _trellis(xp, b, "iq4_kt")[codes]
    second = _trellis(xp, b, "iq4_kt", IQ4_KT_SECOND_OFFSET)[codes]
    v = xp.where(((head & 1) == 1)[:, :, None, None], second, first)
    sl = d * xp.floats(((head & 0xFF) >> 1) - 64)
    return (sl[:, :, None, None] * v).reshape(b.shape[0], n_per_row)


# ---- hand-written: the ternary types, d * (t - 1) with a trit t in {0, 1, 2} per value ----
#
# The 1.6-bit types (IQ1_BN, TQ1_0) read trit t of a byte as ((byte * 3^k) & 255) * 3 >> 8 (the 3^5
# trick, kernels.ternary), the 2-bit ones (IQ2_BN, TQ2_0) as (byte >> shift) & 3.  Per value of a
# block: the byte it is in, and the power of 3 (or the shift) that reads it.

@lru_cache(maxsize=None)
def _ternary_map(qtype: QuantType) -> tuple[np.ndarray, np.ndarray]:
    """(byte, multiplier or shift) of every value of one block of ``qtype``."""
    n = traits(qtype).block_size
    at, how = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for p in range(n):
        if qtype == T.IQ1_BN:               # per 16: ql[3 i16 + k] digit j for 5k + j, extra digit i16
            i16, r = divmod(p, 16)
            at[p], how[p] = (3 * i16 + r // 5, POW3[4 - r % 5]) if r < 15 else (12, POW3[4 - i16])
        elif qtype == T.TQ1_0:              # qs[m] along 32, qs[32 + m] along 16, qh[j] along 4
            lo, width, start = (0, 32, 0) if p < 160 else (160, 16, 32) if p < 240 else (240, 4, 48)
            at[p], how[p] = start + (p - lo) % width, POW3[(p - lo) // width]
        elif qtype == T.IQ2_BN:             # bits 2l of qs[j] for j + 16 l
            at[p], how[p] = p % 16, 2 * (p // 16)
        else:                               # TQ2_0: bits 2n of qs[32 h + m] for 128 h + 32 n + m
            at[p], how[p] = 32 * (p // 128) + p % 32, 2 * (p % 128 // 32)
    return at, how


def _ternary(xp, b, n_per_row, qtype):
    t = traits(qtype)
    if t.row_meta_size:
        d, blk = _row_blocks(xp, b, n_per_row, qtype)
    else:                                   # an fp16 d after the codes of each block
        raw = b.reshape(-1, t.type_size)
        d, blk = xp.f16(raw, t.type_size - 2), xp.ints(raw)
    at_np, how_np = _ternary_map(qtype)
    at = xp.const(b, ("ternary_at", qtype), lambda: at_np)
    how = xp.const(b, ("ternary_how", qtype), lambda: how_np)
    if qtype in (T.IQ1_BN, T.TQ1_0):
        trit = (((blk[:, at] * how) & 0xFF) * 3) >> 8
    else:
        trit = (blk[:, at] >> how) & 3
    return (xp.floats(trit - 1) * d).reshape(b.shape[0], n_per_row)
# ---- hand-written: grid-indexed i-quants, an fp16 d per 256 values (quantkit/grids.py) ----
#
# 8 values per grid index, one sign bit each: value = (d * (0.5 + s) * 0.25) * grid[index][j] * sign_j,
# s the 4-bit scale of the 32 (IQ2_XXS) or 16 values (IQ2_XS, IQ2_S).

_IQ2_GRIDS = {T.IQ2_XXS: IQ2XXS_GRID, T.IQ2_XS: IQ2XS_GRID, T.IQ2_S: IQ2S_GRID}


def _iq2_values(xp, b, n_per_row, qtype, idx, sign_bits, scales):
    """idx, sign_bits (n_blocks, 8, 4): grid index and 8 sign bits of group l of 32-block ib;
    scales (n_blocks, 8, 2): the 4-bit scales of its two halves (IQ2_XXS: the same twice)."""
    d = xp.f16(b.reshape(-1, traits(qtype).type_size), 0)
    grid = xp.const(b, ("iq2_grid", qtype), lambda: _IQ2_GRIDS[qtype].view(np.uint8).reshape(-1, 8).astype(np.float32))
    signs = xp.const(b, "iq2_signs", lambda: np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1, 1)
                     .astype(np.float32))
    db = (d[:, :, None] * (0.5 + xp.floats(scales))) * 0.25
    half = xp.const(b, "iq2_half", lambda: np.array([0, 0, 1, 1]))
    return ((db[:, :, half][..., None] * grid[idx]) * signs[sign_bits]).reshape(b.shape[0], n_per_row)


def _iq2_xxs(xp, b, n_per_row):
    """66 B: d | per 32 values 4 grid-index bytes, then a uint32: 4 x 7 sign bits (ksigns_iq2xs adds
    the parity bit), the scale in bits 28-31."""
    g = xp.ints(b.reshape(-1, 66))[:, 2:].reshape(-1, 8, 8)
    low28 = g[:, :, 4] | (g[:, :, 5] << 8) | (g[:, :, 6] << 16) | ((g[:, :, 7] & 15) << 24)
    s7 = (low28[:, :, None] >> (7 * _arange(xp, b, 4))) & 127
    ksigns = xp.const(b, "ksigns", lambda: KSIGNS_IQ2XS.astype(np.int64))
    sc = (g[:, :, 7] >> 4)[:, :, None]
    return _iq2_values(xp, b, n_per_row, T.IQ2_XXS, g[:, :, :4], ksigns[s7], xp.cat([sc, sc], 2))


def _iq2_xs(xp, b, n_per_row):
    """74 B: d | uint16 qs[32]: 9-bit grid index | 7 sign bits << 9 | scales[8]: nibbles per 16 values."""
    blk = xp.ints(b.reshape(-1, 74))
    v = (blk[:, 2:66:2] | (blk[:, 3:66:2] << 8)).reshape(-1, 8, 4)
    ksigns = xp.const(b, "ksigns", lambda: KSIGNS_IQ2XS.astype(np.int64))
    sc = blk[:, 66:74, None]
    return _iq2_values(xp, b, n_per_row, T.IQ2_XS, v & 511, ksigns[v >> 9], xp.cat([sc & 15, sc >> 4], 2))


def _iq2_s(xp, b, n_per_row):
    """82 B: d | qs[32] grid index bits 0-7 | signs[32] | qh[8]: bits 8-9 of group l at bit 2l |
    scales[8]."""
    blk = xp.ints(b.reshape(-1, 82))
    qh = blk[:, 66:74, None]
    idx = blk[:, 2:34].reshape(-1, 8, 4) | ((qh << (8 - 2 * _arange(xp, b, 4))) & 0x300)
    sc = blk[:, 74:82, None]
    return _iq2_values(xp, b, n_per_row, T.IQ2_S, idx, blk[:, 34:66].reshape(-1, 8, 4), xp.cat([sc & 15, sc >> 4], 2))


# ---- hand-written: IQ3_XXS, IQ3_S, lattice points of 4 magnitudes with a sign bit per value ----

def _grid_values(xp, like, key, grid):
    """A uint32 lattice grid as its (n_points, 4) byte values, float32."""
    return _table(xp, like, key, grid.view(np.uint8).reshape(-1, 4))


def _signed(xp, v, sign_bytes):
    """v (n, 8, 32) times -1 where bit j % 8 of sign_bytes[..., j // 8] (n, 8, 4) is set, else +1
    (C: ``db * grid[j] * (signs & kmask[j] ? -1.f : 1.f)``, so zeros keep the sign)."""
    bits = (sign_bytes[:, :, :, None] >> _arange(xp, v, 8)) & 1                      # (n, 8, 4, 8)
    one = _table(xp, v, "plus_minus_one", [1.0, -1.0])
    return v * one[bits.reshape(v.shape)]


def _iq3_xxs(xp, b, n_per_row):
    """98 B: fp16 d | qs[64] (a point per 4 values) | sas u32[8]: per 32 values 4 x 7 sign bits
    (ksigns_iq2xs restores the 8th) and the scale s in bits 28-31: y = d (0.5 + s) 0.5 grid (±1)."""
    raw = b.reshape(-1, 98)
    blk = xp.ints(raw)
    d = xp.f16(raw, 0)
    v = _grid_values(xp, b, "iq3_xxs", IQ3XXS_GRID)[blk[:, 2:66]].reshape(-1, 8, 32)
    sas = blk[:, 66:98].reshape(-1, 8, 4)
    low28 = sas[:, :, 0] | (sas[:, :, 1] << 8) | (sas[:, :, 2] << 16) | ((sas[:, :, 3] & 0xF) << 24)
    fields = (low28[:, :, None] >> (7 * _arange(xp, b, 4))) & 127                    # (n, 8, 4)
    signs = xp.const(b, ("ksigns",), lambda: KSIGNS_IQ2XS.astype(np.int64))[fields]
    db = d * (xp.floats(sas[:, :, 3] >> 4) + 0.5) * 0.5                                # (n, 8)
    return _signed(xp, db[:, :, None] * v, signs).reshape(b.shape[0], n_per_row)


def _iq3_s(xp, b, n_per_row):
    """110 B: fp16 d | qs[64] | qh[8] | signs[32] | scales[4]: point k of 32-block ib is qs[8ib + k]
    | bit k of qh[ib] << 8; y = d (1 + 2 s) grid (±1), s nibble ib % 2 of scales[ib / 2]."""
    raw = b.reshape(-1, 110)
    blk = xp.ints(raw)
    d = xp.f16(raw, 0)
    k = _arange(xp, b, 8)
    hi = (blk[:, 66:74, None] >> k) & 1                                                # (n, ib, k)
    points = blk[:, 2:66].reshape(-1, 8, 8) | (hi << 8)
    v = _grid_values(xp, b, "iq3_s", IQ3S_GRID)[points].reshape(-1, 8, 32)
    sc = blk[:, 106:110]
    s = xp.stack([sc & 0xF, sc >> 4], 2).reshape(-1, 8)
    db = d * xp.floats(1 + 2 * s)
    return _signed(xp, db[:, :, None] * v, blk[:, 74:106].reshape(-1, 8, 4)).reshape(b.shape[0], n_per_row)
# ---- hand-written: MXFP4, whose scale is an E8M0 byte (a power of two), not a float16 ----

def _mxfp4(xp, b, n_per_row):
    """17 B: e | qs[16]; value j = E8M0_HALF[e] * MXFP4_VALUES[code j] (code j: low nibble of qs[j],
    j + 16: high nibble)."""
    blk = xp.ints(b.reshape(-1, 17))
    d = _table(xp, b, "e8m0_half", E8M0_HALF)[blk[:, 0:1]]
    qs = blk[:, 1:17]
    v = _table(xp, b, "mxfp4", MXFP4_VALUES)[xp.cat([qs & 0xF, qs >> 4], 1)]
    return (d * v).reshape(b.shape[0], n_per_row)


# ---- hand-written: q8_KV, a float32 row scale (and the int32 sum of the codes) before int8 codes ----

def _q8_kv(xp, b, n_per_row):
    """float32 d | int32 sum | int8 codes[n_per_row]; value j = d * code j."""
    q = xp.ints(b[:, 8:])
    return xp.f32(b, 0) * xp.floats((q ^ 0x80) - 0x80)
# ---- hand-written: IQ1_S, IQ1_M and ik's IQ1_S_R4, IQ1_M_R4 (formats/iq1.py has the layouts) ----
#
# A point index selects 8 levels -1/0/+1 of the lattice (grids.IQ1S_VALUES); y = dl*(level +
# shift), shift +-1/8 by a bit, as ggml's dequantize_row_iq1_*: (float)level + delta first.

def _iq1_shift(xp, bit):
    """+1/8, or -1/8 where ``bit`` is 1."""
    return xp.floats(1 - 2 * bit) * 0.125


def _iq1_s(xp, b, n_per_row):
    """50 B: fp16 d | qs[32] | uint16 qh[8]; 32-group ib: points qs[4 ib + l] | bits 3l.. of qh[ib]
    << 8, scale 2 ((qh >> 12) & 7) + 1, shift bit 15."""
    raw = b.reshape(-1, 50)
    blk = xp.ints(raw)
    qh = blk[:, 34:50:2] | (blk[:, 35:50:2] << 8)                           # (n, 8)
    l3 = _arange(xp, b, 4) * 3
    g = blk[:, 2:34].reshape(-1, 8, 4) | (((qh[:, :, None] >> l3) & 7) << 8)
    dl = xp.f16(raw, 0) * xp.floats(2 * ((qh >> 12) & 7) + 1)
    v = _table(xp, b, "iq1s", IQ1S_VALUES)[g] + _iq1_shift(xp, (qh >> 15) & 1)[:, :, None, None]
    return (dl[:, :, None, None] * v).reshape(b.shape[0], n_per_row)


def _iq1_m(xp, b, n_per_row):
    """56 B: qs[32] | qh[16] | uint16 sc[4]; 16-group t: points qs[2t + l] | bits 4l.. of qh[t] << 8,
    shift bit 3 + 4l of qh[t], scale 2 ((sc[t / 4] >> 3 (t % 4)) & 7) + 1; d the fp16 whose nibbles
    are the top nibbles of sc[0..3]."""
    blk = xp.ints(b.reshape(-1, 56))
    sc = blk[:, 48:56:2] | (blk[:, 49:56:2] << 8)                           # (n, 4)
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = _table(xp, b, "fp16", FP16_TABLE)[bits][:, None]
    t = _arange(xp, b, 16)
    ls = (sc[:, t // 4] >> (3 * (t % 4))) & 7                                # (n, 16)
    qh = blk[:, 32:48][:, :, None]
    l4 = _arange(xp, b, 2) * 4
    g = blk[:, 0:32].reshape(-1, 16, 2) | ((qh << (8 - l4)) & 0x700)
    v = _table(xp, b, "iq1s", IQ1S_VALUES)[g] + _iq1_shift(xp, (qh >> (3 + l4)) & 1)[..., None]
    dl = d * xp.floats(2 * ls + 1)
    return (dl[:, :, None, None] * v).reshape(b.shape[0], n_per_row)


def _iq1_r4(xp, b, n_per_row, m):
    """Groups of 4 rows: fp16 d[4], then per 32 columns a block of the 4 rows (formats/iq1.py)."""
    n_groups = b.shape[0] // 4
    bg = b.reshape(n_groups, -1)
    d = xp.cat([xp.f16(bg, 2 * k) for k in range(4)], 1)[:, :, None]          # (G, 4, 1)
    raw = xp.ints(bg[:, 8:])
    nb = n_per_row // 32
    size = 28 if m else 24
    grid = _table(xp, b, "iq1s", IQ1S_VALUES)

    def at(name, make):             # byte positions (row k, block ib, ...) in a group's blocks
        return xp.const(b, ("iq1_r4", m, nb, name), make)

    k = np.arange(4)[:, None, None]
    ib = np.arange(nb)[None, :, None]
    if not m:
        qs = raw[:, at("qs", lambda: ib * size + 4 * np.arange(4) + k)]                 # (G, 4, nb, 4)
        lo = at("qh", lambda: (ib * size + 16 + 2 * k)[..., 0])
        qh = raw[:, lo] | (raw[:, lo + 1] << 8)                                         # (G, 4, nb)
        g = qs | (((qh[..., None] >> (_arange(xp, b, 4) * 3)) & 7) << 8)
        dl = d * xp.floats(2 * ((qh >> 12) & 7) + 1)
        v = grid[g] + _iq1_shift(xp, (qh >> 15) & 1)[..., None, None]
        return (dl[..., None, None] * v).reshape(b.shape[0], n_per_row)
    i = np.arange(2)
    qs = raw[:, at("qs", lambda: (ib * size + k)[..., None] + 8 * i[:, None] + 4 * i[None, :])]   # (G, 4, nb, 2, 2)
    qh = raw[:, at("qh", lambda: ib * size + 16 + 4 * i + k)][..., None]                # (G, 4, nb, 2, 1)
    sl = raw[:, at("sc", lambda: (ib * size + 24 + k)[..., 0])]                         # (G, 4, nb)
    l4 = _arange(xp, b, 2) * 4
    g = qs | ((qh << (8 - l4)) & 0x700)
    v = grid[g] + _iq1_shift(xp, (qh >> (3 + l4)) & 1)[..., None]
    dl = d[..., None] * xp.floats((sl[..., None] >> l4) & 0xF)                          # (G, 4, nb, 2)
    return (dl[..., None, None] * v).reshape(b.shape[0], n_per_row)


_HAND_WRITTEN = {
    T.MXFP4: _mxfp4, T.Q8_KV: _q8_kv,
    T.IQ2_KL: _iq2_kl, T.IQ4_KSS: _iq4_kss, T.IQ1_KT: _iq1_kt, T.IQ4_KT: _iq4_kt,
    T.IQ2_KT: lambda xp, b, n: _iq23_kt(xp, b, n, "iq2_kt"), T.IQ3_KT: lambda xp, b, n: _iq23_kt(xp, b, n, "iq3_kt"),
    **{q: lambda xp, b, n, q=q: _ternary(xp, b, n, q) for q in (T.IQ1_BN, T.IQ2_BN, T.TQ1_0, T.TQ2_0)},
    T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m,
    T.IQ1_S_R4: lambda xp, b, n: _iq1_r4(xp, b, n, False), T.IQ1_M_R4: lambda xp, b, n: _iq1_r4(xp, b, n, True),
}
assert not set(_HAND_WRITTEN) & set(LAYOUTS)


def can_decode(qtype) -> bool:
    qtype = QuantType(qtype)
    return qtype in LAYOUTS or qtype in _HAND_WRITTEN


def decode(xp, b, qtype, n_per_row: int, products: bool = False):
    """uint8 (n_rows, row_size) of ``qtype`` -> float32 (n_rows, n_per_row), in the library of ``xp``
    (NUMPY, or torch_decode's).  ``products``: IQ6_K's values as its matrix products (the grid), not
    as its to_float."""
    qtype = QuantType(qtype)
    assert b.shape[1] == traits(qtype).row_size(n_per_row)
    if qtype in LAYOUTS:
        return _decode_layout(xp, b, LAYOUTS[qtype], n_per_row, products)
    return _HAND_WRITTEN[qtype](xp, b, n_per_row)


def dequantize(blocks: np.ndarray, qtype, n_per_row: int, products: bool = False) -> np.ndarray:
    """:func:`decode` in numpy."""
    b = np.ascontiguousarray(blocks, np.uint8)
    return decode(NUMPY, b.reshape(b.shape[0], -1), qtype, n_per_row, products)
