"""Fused matrix-vector products for generation: each stored row is multiplied with the activations
straight from its packed bytes, block by block, and never written out as float32.

A decoded row costs a write and a read of 4 bytes per weight; the packed row is 0.3-1 byte.  For
the one or few tokens of a generation step that traffic, not the arithmetic, set the speed of the
decode-then-BLAS path (ops_cpu.matmul_q), so the products of a few tokens come here for the types
below; larger batches keep the tile path, where BLAS reuses each decoded tile for every token.

Per block the codes go through one of the vector dots of :mod:`quantkit.runtime.dot` and are
multiplied by the block's scales here:

    q4_0   d * Σ (q - 8) x                   q4_1   d * Σ q x + m * Σ x     (Σ x per 32: xsum)
    q4_K   d sc_s Σ q x - dmin m_s Σ x       iq4_k  d ls_s Σ table[q] x     ...

Interleaved types (``_r4``/``_r8``) are regrouped into their plain rows once, on first use (see
``Weight.plain_layout``), and take the plain type's kernel.  The numpy twin is decoding the rows
and multiplying (``formats.dequantize(...) @ x``), which the tests compare with.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..formats._iqk import IQ2NL_VALUES, IQ4K_VALUES
from ..types import TYPE_TRAITS, QuantType
from . import dot as D

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

# the kernel's selector per stored type (the order of the branches in _row_dot)
KIND = {T.F32: 0, T.F16: 1, T.Q8_0: 2, T.Q4_0: 3, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 6, T.Q6_0: 7,
        T.IQ4_NL: 8, T.IQ4_XS: 9, T.Q4_K: 10, T.Q5_K: 11, T.Q6_K: 12, T.IQ4_K: 13, T.IQ2_K: 14}


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


@njit(inline="always")
def _u16(b, o):
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8)


@njit(inline="always")
def _u32(b, o):
    return _u16(b, o) | (_u16(b, o + 2) << 16)


@njit(inline="always")
def _scale_min_k4(j, b, o):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block j from the 12 bytes at o."""
    if j < 4:
        return np.int64(b[o + j]) & 63, np.int64(b[o + j + 4]) & 63
    a = np.int64(b[o + j + 4])
    return (a & 0xF) | ((np.int64(b[o + j - 4]) >> 6) << 4), (a >> 4) | ((np.int64(b[o + j]) >> 6) << 4)


@njit(**_OPTS)
def _floats(b, x, n, half):
    """F32 / F16 rows: 32 values per vector dot, the rest one by one."""
    size = 2 if half else 4
    s = F(0)
    n32 = n // 32 * 32
    for j in range(0, n32, 32):
        s += D.f16x32(b, size * j, x, j) if half else D.f32x32(b, size * j, x, j)
    for j in range(n32, n):
        if half:
            s += D.half_at(b, 2 * j) * x[j]
        else:
            s += b[4 * j:4 * j + 4].view(np.float32)[0] * x[j]
    return s


@njit(**_OPTS)
def _legacy(kind, b, x, xsum):
    """Blocks of 32: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_0, IQ4_NL (block layouts in formats/legacy.py
    and formats/iq4.py)."""
    s = F(0)
    for ib in range(x.shape[0] // 32):
        e = 32 * ib
        if kind == 2:                                   # Q8_0   d | 32 int8
            o = 34 * ib
            s += D.half_at(b, o) * D.signed32(b, o + 2, x, e)
        elif kind == 3:                                 # Q4_0   d | 16 bytes: codes j, j+16
            o = 18 * ib
            s += D.half_at(b, o) * (D.bits16(b, o + 2, 0, 15, 8, x, e) + D.bits16(b, o + 2, 4, 15, 8, x, e + 16))
        elif kind == 4:                                 # Q4_1   d m | 16 bytes
            o = 20 * ib
            q = D.bits16(b, o + 4, 0, 15, 0, x, e) + D.bits16(b, o + 4, 4, 15, 0, x, e + 16)
            s += D.half_at(b, o) * q + D.half_at(b, o + 2) * xsum[ib]
        elif kind == 5:                                 # Q5_0   d | qh (32 bits) | 16 bytes
            o = 22 * ib
            qh = _u32(b, o + 2)
            q = D.word16(b, o + 6, 0, 15, qh, 0, 4, 16, x, e) + D.word16(b, o + 6, 4, 15, qh, 16, 4, 16, x, e + 16)
            s += D.half_at(b, o) * q
        elif kind == 6:                                 # Q5_1   d m | qh | 16 bytes
            o = 24 * ib
            qh = _u32(b, o + 4)
            q = D.word16(b, o + 8, 0, 15, qh, 0, 4, 0, x, e) + D.word16(b, o + 8, 4, 15, qh, 16, 4, 0, x, e + 16)
            s += D.half_at(b, o) * q + D.half_at(b, o + 2) * xsum[ib]
        elif kind == 7:
            # Q6_0   d | qh[8] | qs[16]; code j < 8 takes bits 0-1 of qh[j], 8 <= j < 16 bits 4-5
            # of qh[j-8], and codes j+16 bits 2-3 / 6-7
            o = 26 * ib
            qh, qs = o + 2, o + 10
            q = (D.plane8(b, qs, 0, 15, qh, 0, 3, 4, 32, x, e) + D.plane8(b, qs + 8, 0, 15, qh, 4, 3, 4, 32, x, e + 8)
                 + D.plane8(b, qs, 4, 15, qh, 2, 3, 4, 32, x, e + 16)
                 + D.plane8(b, qs + 8, 4, 15, qh, 6, 3, 4, 32, x, e + 24))
            s += D.half_at(b, o) * q
        else:                                           # IQ4_NL d | 16 bytes of table indices
            o = 18 * ib
            q = D.table16(b, o + 2, 0, 15, IQ4_TABLE, 0, x, e) + D.table16(b, o + 2, 4, 15, IQ4_TABLE, 0, x, e + 16)
            s += D.half_at(b, o) * q
    return s


@njit(**_OPTS)
def _super(kind, b, x, xsum):
    """Super-blocks of 256: IQ4_XS, Q4_K, Q5_K, Q6_K, IQ4_K, IQ2_K (layouts in formats/kquants.py,
    iq4.py, iqk.py, iq2k.py)."""
    s = F(0)
    for sb in range(x.shape[0] // 256):
        e = 256 * sb
        if kind == 9:                                   # IQ4_XS d | scales_h | scales_l[4] | qs[128]
            o = 136 * sb
            d, sh = D.half_at(b, o), _u16(b, o + 2)
            for ib in range(8):
                ls = ((np.int64(b[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
                q = D.table16(b, o + 8 + 16 * ib, 0, 15, IQ4_TABLE, 0, x, e + 32 * ib) \
                    + D.table16(b, o + 8 + 16 * ib, 4, 15, IQ4_TABLE, 0, x, e + 32 * ib + 16)
                s += d * F(ls - 32) * q
        elif kind == 10 or kind == 11:
            # Q4_K d dmin scales[12] qs[128]; Q5_K the same with qh[32] before qs: sub-block j's
            # codes are nibble j % 2 of qs[32 (j // 2) ..], Q5_K's fifth bit bit j of qh[..]
            five = kind == 11
            o = (176 if five else 144) * sb
            d, dmin = D.half_at(b, o), D.half_at(b, o + 2)
            qs = o + (48 if five else 16)
            for j in range(8):
                sc, m = _scale_min_k4(j, b, o + 4)
                if five:
                    q = D.plane32(b, qs + 32 * (j // 2), 4 * (j % 2), 15, o + 16, j, 1, 4, 0, x, e + 32 * j)
                else:
                    q = D.bits32(b, qs + 32 * (j // 2), 4 * (j % 2), 15, 0, x, e + 32 * j)
                s += d * F(sc) * q - dmin * F(m) * xsum[8 * sb + j]
        elif kind == 12:
            # Q6_K ql[128] qh[64] scales[16] (int8) d; value v = 128 h + 32 quarter + l takes the
            # nibble quarter // 2 of ql[64 h + 32 (quarter % 2) + l] and bits 2 quarter of qh[32 h + l]
            o = 210 * sb
            d = D.half_at(b, o + 208)
            for h in range(2):
                for quarter in range(4):
                    for half in range(2):
                        l0 = 16 * half
                        v = 128 * h + 32 * quarter + l0
                        q = D.plane16(b, o + 64 * h + 32 * (quarter % 2) + l0, 4 * (quarter // 2), 15,
                                      o + 128 + 32 * h + l0, 2 * quarter, 3, 4, 32, x, e + v)
                        s += d * F(np.int8(b[o + 192 + v // 16])) * q
        elif kind == 13:
            # IQ4_K d extra scales_h[4] scales_l[8] qs[128]; sub-block ib of 16 takes nibble ib % 2
            # of qs[16 (ib // 2) ..], from the second table when bit ib of extra is set
            o = 144 * sb
            d, extra = D.half_at(b, o), _u16(b, o + 2)
            for ib in range(16):
                ls = (((np.int64(b[o + 8 + ib // 2]) >> (4 * (ib % 2))) & 0xF)
                      | (((np.int64(b[o + 4 + ib // 4]) >> (2 * (ib % 4))) & 3) << 4)) - 32
                q = D.table16(b, o + 16 + 16 * (ib // 2), 4 * (ib % 2), 15, IQ4_TABLE, 16 * ((extra >> ib) & 1),
                              x, e + 16 * ib)
                s += d * F(ls) * q
        else:
            # IQ2_K d extra scales[8] qs[64]; sub-block ib of 16 (in 32-group g = ib // 2) takes bits
            # 2 (g % 4) of qs[32 (g // 4) + 16 (ib % 2) ..], values 4..7 when bit ib of extra is set
            o = 76 * sb
            d, extra = D.half_at(b, o), _u16(b, o + 2)
            for ib in range(16):
                g = ib // 2
                ls = ((np.int64(b[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) - 8
                q = D.table16(b, o + 12 + 32 * (g // 4) + 16 * (ib % 2), 2 * (g % 4), 3, IQ2_TABLE,
                              4 * ((extra >> ib) & 1), x, e + 16 * ib)
                s += d * F(ls) * q
    return s


@njit(**_OPTS)
def _row_dot(kind, b, x, xsum):
    if kind <= 1:
        return _floats(b, x, x.shape[0], kind == 1)
    if kind <= 8:
        return _legacy(kind, b, x, xsum)
    return _super(kind, b, x, xsum)


@njit(cache=True, error_model="numpy", parallel=True)
def matvec(kind, blocks, x):
    """x (n_tokens, n_in) float32 · the rows of ``blocks`` (n_rows, row_size uint8, of the type
    ``kind`` selects) -> (n_tokens, n_rows) float32; for a few tokens (each row is read once per
    token)."""
    n_tok, n_in = x.shape
    xsum = np.zeros((n_tok, n_in // 32), F)             # Σ x per 32, for the types with a min
    for t in range(n_tok):
        for i in range(n_in // 32 * 32):
            xsum[t, i // 32] += x[t, i]
    out = np.empty((n_tok, blocks.shape[0]), F)
    for r in prange(blocks.shape[0]):
        for t in range(n_tok):
            out[t, r] = _row_dot(kind, blocks[r], x[t], xsum[t])
    return out
