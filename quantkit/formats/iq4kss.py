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

The quantizer is the numba kernel of :mod:`quantkit.kernels.iq4kss`; the reference decoder is
formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import iq4kss as kernels
from ..types import QuantType
from ._base import ALL_PATHS, KernelFormat, reference_decoder


class IQ4_KSS(KernelFormat, qtype=QuantType.IQ4_KSS):
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder
    _kernel_quantize = staticmethod(kernels.quantize_rows)
    _kernel_dequantize = staticmethod(kernels.dequantize_rows)
