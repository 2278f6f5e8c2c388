"""IQ2_KL: pairs of values coded together, 2.6875 bits per weight (ik_llama.cpp; not in the spec,
written from its source).

A row is an fp16 scale and 86-byte blocks of 256 values:

    scales_h u16  | scales_l[4] | qs[64] | qh[16]
    32-value sub-block ib: 6-bit scale ls+32 = nibble ib/4 of scales_l[ib%4] | bits 2ib..2ib+1 of scales_h
    value pair j (values 2j, 2j+1) of sub-block ib: 5-bit pair code =
        nibble ib%2 of qs[16*(ib/2) + j] | bit ib of qh[j] << 4
    (value 2j, value 2j+1) = d * ls * PAIRS[code]

PAIRS are 32 of the 64 pairs of IQ3_K's base table.  A pair of values is coded by rounding each to
the table; if that pair is not one of the 32, the best of eight listed neighbours (weighted squared
distance) replaces it.  The scale search is IQ3_K-like without the shifted table (11 trial scales,
both signs); the row scale then re-picks each sub-block's 6-bit scale among three neighbours by
weighted error.  Weights: ``qw*sqrtf(sigma2 + x²)`` (sigma2 = 2.25*Σx²/256) or ``|x|``.

The quantizer is the numba kernel of :mod:`quantkit.kernels.iq2kl`; the reference decoder is
formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import iq2kl as kernels
from ..types import QuantType
from ._base import ALL_PATHS, KernelFormat, reference_decoder


class IQ2_KL(KernelFormat, qtype=QuantType.IQ2_KL):
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder
    _kernel_quantize = staticmethod(kernels.quantize_rows)

    @staticmethod
    def _kernel_dequantize(blocks, out):
        kernels.dequantize_rows(blocks, kernels.FP16_TABLE, out)
