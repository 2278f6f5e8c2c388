"""IQ4_KSS: IQ4_KS squeezed to exactly 4 bits per weight (specs/ik-quants.md §9.3).

A row is a float32 scale and 128-byte blocks of 256 values; a block is 64 little-endian uint16
words, eight per 32-value sub-block.  Word k of sub-block ib carries

    bit 0      bit k of the sub-block's scale byte (7-bit odd scale << 1 | shifted-table bit)
    bits 1-15  the four 4-bit codes of values (2k, 2k+16, 2k+1, 2k+17), 16 bits squeezed to 15:

               word & 0xfffe = j << 1, and j ^ (j << 1) = codes (as qs[2k] | qs[2k+1] << 8)

The squeeze only works for code patterns with an even number of set bits, so the quantizer
"prunes" each group of four codes to even parity: if the parity is odd it moves the one code
(within +-2 levels, to a code of the other parity) whose move costs least in weighted squared
error.  Everything else is IQ4_KS's search: pass 1 finds a scale per sub-block, pass 2 quantizes
the scales against the row scale and picks, per sub-block, the table half with the smaller error.

The quantizer is the numba kernel of :mod:`quantkit.kernels.iq4kss`; the numpy decoder below works
a row at a time.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq4kss as kernels
from ..types import QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from ..tables import IQ4K_VALUES

BASE = IQ4K_VALUES[:16].astype(np.float32)
SHIFTED = IQ4K_VALUES[16:].astype(np.float32)


def dequantize_iq4_kss_row(row, n):
    d = row[:4].copy().view(np.float32)[0]
    w = row[4:].copy().view("<u2").astype(np.int64).reshape(-1, 8)     # (n_blocks, 8)
    ls = (w & 1) << np.arange(8)
    ls = ls.sum(axis=1)
    a = w & 0xFFFE
    a ^= a >> 1
    qs = np.stack([a & 0xFF, a >> 8], axis=-1).reshape(-1, 16)          # qs[2k], qs[2k+1]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    v = np.where((ls & 1)[:, None] == 1, SHIFTED[q], BASE[q])
    return ((d * ((ls & 254) - 127).astype(np.float32))[:, None] * v).reshape(n)


class IQ4_KSS(RowwiseReference, KernelFormat, qtype=QuantType.IQ4_KSS):
    quant_paths = ALL_PATHS
    _dequantize_row = staticmethod(dequantize_iq4_kss_row)
    _kernel_quantize = staticmethod(kernels.quantize_rows)
    _kernel_dequantize = staticmethod(kernels.dequantize_rows)
