"""IQ3_XXS and IQ3_S: 3-bit magnitudes on a lattice of 4-value points, with sign bits (ggml's i-quants).

    IQ3_XXS  256 values, 98 bytes:  fp16 d | qs[64] | sas u32[8]
             per 32 values ib: points qs[8ib..8ib+7] (IQ3XXS_GRID, 256 points); sas[ib] bits 7l..7l+6:
             signs of values 8l..8l+7 (ksigns_iq2xs: the 8th makes the count of minus signs even),
             bits 28-31 the scale s:  y = d (0.5 + s) 0.5 grid[q] (±1)
    IQ3_S    256 values, 110 bytes: fp16 d | qs[64] | qh[8] | signs[32] | scales[4]
             per 32 values ib: points qs[8ib + k] | bit k of qh[ib] << 8 (IQ3S_GRID, 512 points); a
             sign bit per value (signs[4ib..4ib+3]); scale s = nibble ib%2 of scales[ib/2]:
             y = d (1 + 2 s) grid[q] (±1)

The grid values are 2l+1 for the levels l = 0..7 the quantizers pick (IQ3_XXS's decoder grid stores
them times 4, with 62 for 15*4).  Quantizing (ggml-quants.c, quantize_row_iq3_xxs_impl /
quantize_row_iq3_s_impl, the same in ik_llama.cpp and mainline): per 32-block, weights qw sqrtf(sigma2
+ x²) with an imatrix (sigma2 = 2Σx²/256 of the super-block) or x²; the magnitudes are fitted with 31
(IQ3_XXS) or 19 (IQ3_S) trial scales, points off the lattice replaced by their best listed neighbour;
the super-block scale is max/31 (times a fudge factor 1.0125 or 1.033 when stored), the block scales
4-bit codes of it.  IQ3_XXS flips the sign of its cheapest value where an 8-value group has an odd
number of minus signs; IQ3_S skips blocks whose max is exactly 0 and moves the next block's codes and
signs into their place (a quirk of the C pointer arithmetic the files keep).

The quantizers are the numba kernels of :mod:`quantkit.kernels.iq3xs`; the reference decoder is
formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import iq3xs as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder


class _IQ3(FamilyKernelFormat):
    """The row kernels of kernels/iq3xs.py (one algorithm for both flavors); the reference decoder
    of formats/decode.py."""
    kernel_module = kernels
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder
    scale_fields = ((0, "<f2"),)


class IQ3_XXS(_IQ3, qtype=QuantType.IQ3_XXS):
    pass


class IQ3_S(_IQ3, qtype=QuantType.IQ3_S):
    pass
