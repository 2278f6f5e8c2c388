"""IQ3_K..IQ6_K, IQ4_KS, IQ5_KS, IQ3_KS: ik_llama.cpp's non-linear types with a scale per sub-block.

Every value is ``d * ls * T[q]`` with T a fixed table of integers (specs/ik-quants.md §2) and a
per-sub-block bit choosing the table's "shifted" half.  Blocks (one 256-value super-block):

    IQ3_K  110 B  d fp16 | extra u16 | signs u16 | scales_l[8] 4-bit |ls|  | qs[64] 2 bits | qh[32] 1 bit
    IQ4_K  144 B  d fp16 | extra u16 | scales_h[4] 2 bits | scales_l[8] 4 bits | qs[128] 4 bits
    IQ5_K  176 B  d fp16 | extra u16 | scales_h[4] | scales_l[8]                 | qs[128] | qh[32] 1 bit
    IQ6_K  212 B  d fp16 | extra u16 | scales int8[16]                           | qs[128] | qh[64] 2 bits
    IQ4_KS 136 B  scales[8] (7-bit odd scale << 1 | shift bit) | qs[128], after a float32 row scale
    IQ5_KS 168 B  scales[8] as IQ4_KS | qs[128] as IQ5_K | qh[32] 1 bit, after a float32 row scale
    IQ3_KS 102 B  extra u16 (bit ib: bit 4 of 32-block ib's scale ls+16, bit 8+ib: its shift) |
                  scales[4] (low 4 bits of block ib's: nibble ib/4 of byte ib%4) | qs[64] | qh[32],
                  after an fp16 row scale

Sub-blocks hold 16 values (32 for the _KS types).  Bit layouts, for value p of a super-block, ib32 = p/32,
k = p%32 (ib = p/16 is the sub-block):

    qs, 2 bits (IQ3_K):  qs[32*(ib32/4) + k] >> 2*(ib32%4)            (Q2_K's layout)
    qs, 4 bits, IQ4_K:   qs[16*ib32 + k%16], low nibble for k < 16, high nibble for k >= 16
    qs, 4 bits, IQ5/6_K: qs[32*(ib32/2) + k], low nibble for even ib32, high for odd
    qh, 1 bit:           qh[k] >> ib32
    qh, 2 bits (IQ6_K):  qh[32*(ib32/4) + k] >> 2*(ib32%4)

Quantization (§3b): for each sub-block try a range of inverse scales around ``T[0]/max`` against the
base and the shifted table, each with the codes of x and of -x (a negative scale mirrors the
table), and keep the weighted least-squares scale that explains most of Σw·x² (largest
``Σwqx²/Σwq²``).  IQ3/5/6_K then re-fit the scale to the chosen codes.  The sub-block scales are
quantized against one super-block scale and the codes re-derived with the quantized scales; the
stored ``d`` is the least-squares fit over the whole super-block (row for IQ4_KS).  Weights are
``qw*sqrtf(sigma2 + x²)`` with an imatrix (cleaned by QHelper first), else ``x²`` (IQ4_K, IQ4_KS)
or ``sigma2/4 + x²``.

The quantizers are the numba kernels of :mod:`quantkit.kernels.iqk`; the numpy decoders below are
vectorised across super-blocks (the row-scaled types row by row).
"""
from __future__ import annotations

import numpy as np

from ..kernels import iqk as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, BlockwiseReference, FamilyKernelFormat, RowwiseReference
from ..tables import A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from .kquants import fp16_values, unpack_2bit, unpack_nibbles_k

F = np.float32


# ---------------------------------------------------------------------------------- bit unpacking
# (2-bit qs and 4-bit qs of IQ5/6_K: Q2_K's and Q4_K's layouts, kquants.unpack_2bit/unpack_nibbles_k)
def _unpack_bits(qh):
    return ((qh[:, None, :] >> np.arange(8)[None, :, None]) & 1).reshape(-1, QK_K)


def _unpack_nibbles_32(qs):
    q = qs.reshape(-1, 16)
    return np.concatenate([q & 0xF, q >> 4], axis=1)


def _unpack_6bit_scales(sh, sl):
    ib = np.arange(16)
    lo = (sl[:, ib // 2] >> (4 * (ib % 2))) & 0xF
    hi = (sh[:, ib // 4] >> (2 * (ib % 4))) & 3
    return (lo | (hi << 4)).astype(np.int32)


# ---------------------------------------------------------------------------------- decoders
def dequantize_iq3_k(b):
    d = fp16_values(b[:, 0:2])
    extra = b[:, 2:4].copy().view("<u2").astype(np.int64)
    signs = b[:, 4:6].copy().view("<u2").astype(np.int64)
    ib = np.arange(16)
    mag = (b[:, 6 + ib // 2] >> (4 * (ib % 2))) & 0xF
    ls = (2 * mag.astype(np.int32) + 1) * np.where((signs >> ib) & 1, -1, 1)
    q = unpack_2bit(b[:, 14:78]) | (_unpack_bits(b[:, 78:110]) << 2)
    sh = ((extra >> ib) & 1).repeat(16, axis=1)
    v = IQ3NL_VALUES.astype(np.float32)[q + 8 * sh]
    return (d[:, None] * ls.astype(np.float32)).repeat(16, axis=1) * v


def _scaled(d, ls, values, q, extra, per_shift):
    ib = np.arange(16)
    sh = ((extra[:, None] >> ib) & 1).repeat(16, axis=1)
    v = values.astype(np.float32)[q + per_shift * sh]
    return (d[:, None] * ls.astype(np.float32)).repeat(16, axis=1) * v


def dequantize_iq4_k(b):
    d = fp16_values(b[:, 0:2])
    extra = b[:, 2:4].copy().view("<u2").reshape(-1).astype(np.int64)
    ls = _unpack_6bit_scales(b[:, 4:8], b[:, 8:16]) - 32
    q = _unpack_nibbles_32(b[:, 16:144]).reshape(-1, QK_K)
    return _scaled(d, ls, IQ4K_VALUES, q, extra, 16)


def dequantize_iq5_k(b):
    d = fp16_values(b[:, 0:2])
    extra = b[:, 2:4].copy().view("<u2").reshape(-1).astype(np.int64)
    ls = _unpack_6bit_scales(b[:, 4:8], b[:, 8:16]) - 32
    q = unpack_nibbles_k(b[:, 16:144]) | (_unpack_bits(b[:, 144:176]) << 4)
    return _scaled(d, ls, IQ5NL_VALUES, q, extra, 32)


def iq6_k_codes(b):
    """(n_sb, 256) 6-bit codes of IQ6_K blocks."""
    return unpack_nibbles_k(b[:, 20:148]) | (unpack_2bit(b[:, 148:212]) << 4)


def dequantize_iq6_k_table(b):
    """IQ6_K as the matrix-multiplication kernels decode it: ``d*ls*(iq6nl_values[q] + shift)``."""
    d = fp16_values(b[:, 0:2])
    extra = b[:, 2:4].copy().view("<u2").reshape(-1).astype(np.int64)
    ls = b[:, 4:20].view(np.int8).astype(np.int32)
    return _scaled(d, ls, IQ6NL_VALUES, iq6_k_codes(b), extra, 64)




def dequantize_iq6_k(b):
    """IQ6_K as the C ``to_float`` decodes it: a cubic in the code instead of the table (they differ
    by up to 0.49 of a step); ``dl * (A + q*(B + q*(-C + q*D)) + shift)`` in float32."""
    d = fp16_values(b[:, 0:2])
    extra = b[:, 2:4].copy().view("<u2").reshape(-1).astype(np.int64)
    ls = b[:, 4:20].view(np.int8).astype(np.float32)
    q = iq6_k_codes(b).astype(np.float32)
    shift = ((extra[:, None] >> np.arange(16)) & 1).astype(np.float32).repeat(16, axis=1)
    v = (A_IQ6K + q * (B_IQ6K + q * (-C_IQ6K + q * D_IQ6K))) + shift
    return (d[:, None] * ls).repeat(16, axis=1) * v


def dequantize_iq4_ks_row(row, n):
    d = row[:4].copy().view(np.float32)[0]
    b = row[4:].reshape(-1, 136)
    s = b[:, :8].astype(np.int32)
    dl = d * ((s & 254) - 127).astype(np.float32)                      # (n_sb, 8)
    q = _unpack_nibbles_32(b[:, 8:]).reshape(-1, 8, 32)
    v = IQ4K_VALUES.astype(np.float32)[q + 16 * (s & 1)[:, :, None]]
    return (dl[:, :, None] * v).reshape(n)


def dequantize_iq5_ks_row(row, n):
    d = row[:4].copy().view(np.float32)[0]
    b = row[4:].reshape(-1, 168)
    s = b[:, :8].astype(np.int32)
    dl = d * ((s & 254) - 127).astype(np.float32)
    q = (unpack_nibbles_k(b[:, 8:136]) | (_unpack_bits(b[:, 136:168]) << 4)).reshape(-1, 8, 32)
    v = IQ5NL_VALUES.astype(np.float32)[q + 32 * (s & 1)[:, :, None]]
    return (dl[:, :, None] * v).reshape(n)


def dequantize_iq3_ks_row(row, n):
    d = fp16_values(row[None, 0:2])[0]
    b = row[2:].reshape(-1, 102)
    extra = b[:, 0:2].copy().view("<u2").reshape(-1).astype(np.int64)
    ib = np.arange(8)
    lo = (b[:, 2 + ib % 4] >> (4 * (ib // 4))) & 0xF
    ls = (lo.astype(np.int32) | (((extra[:, None] >> ib) & 1) << 4)) - 16
    q = (unpack_2bit(b[:, 6:70]) | (_unpack_bits(b[:, 70:102]) << 2)).reshape(-1, 8, 32)
    sh = ((extra[:, None] >> (8 + ib)) & 1)
    v = IQ3NL_VALUES.astype(np.float32)[q + 8 * sh[:, :, None]]
    return ((d * ls.astype(np.float32))[:, :, None] * v).reshape(n)


# ---------------------------------------------------------------------------------- formats
class _SuperBlockIQK(BlockwiseReference, FamilyKernelFormat):
    kernel_module = kernels
    quant_paths = ALL_PATHS
    scale_fields = ((0, "<f2"),)


class IQ3_K(_SuperBlockIQK, qtype=QuantType.IQ3_K):
    _dequantize_blocks = staticmethod(dequantize_iq3_k)


class IQ4_K(_SuperBlockIQK, qtype=QuantType.IQ4_K):
    _dequantize_blocks = staticmethod(dequantize_iq4_k)


class IQ5_K(_SuperBlockIQK, qtype=QuantType.IQ5_K):
    _dequantize_blocks = staticmethod(dequantize_iq5_k)


class IQ6_K(_SuperBlockIQK, qtype=QuantType.IQ6_K):
    _dequantize_blocks = staticmethod(dequantize_iq6_k)


class _RowScaled(RowwiseReference, _SuperBlockIQK):
    """Types whose rows start with a scale: the numpy decoder works row by row."""
    scale_fields = None


class IQ5_KS(_RowScaled, qtype=QuantType.IQ5_KS):
    _dequantize_row = staticmethod(dequantize_iq5_ks_row)


class IQ3_KS(_RowScaled, qtype=QuantType.IQ3_KS):
    _dequantize_row = staticmethod(dequantize_iq3_ks_row)


class IQ4_KS(_RowScaled, qtype=QuantType.IQ4_KS):
    _dequantize_row = staticmethod(dequantize_iq4_ks_row)
