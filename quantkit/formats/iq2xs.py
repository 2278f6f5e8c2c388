"""IQ2_XXS, IQ2_XS and IQ2_S: groups of 8 values as a point of a 2-bit lattice grid, with sign bits.

    IQ2_XXS  2.06 bpw  fp16 d | per 32 values: 4 grid indices (8 bits, 256 points), 4 x 7 sign bits
                       (the 8th makes an even number of minus signs), a 4-bit scale
    IQ2_XS   2.31 bpw  fp16 d | per 8 values: 9-bit grid index (512 points) + 7 sign bits | per 16
                       values a 4-bit scale
    IQ2_S    2.56 bpw  fp16 d | per 8 values: 10-bit grid index (1024 points), 8 sign bits | per 16
                       values a 4-bit scale

    y = d * (0.5 + s) * 0.25 * grid[index][j] * sign_j,   grid magnitudes 8, 25, 43

Quantizers (ggml-quants.c quantize_row_iq2_{xxs,xs,s}_impl): per block, weights from the imatrix
(``qw*sqrtf(sigma2 + x²)``), values as magnitudes with sign bits, then a scale search in which each
trial scale maps 8 magnitudes to levels 0..2; a level pattern that is not a grid point becomes the
nearest grid point by weighted distance among its precomputed neighbours.  IQ2_XXS starts from
make_qp_quants; the block scales are then 4-bit multiples of max_scale/31 (IQ2_S stores d*0.9875).

The flavors differ in IQ2_XS (ik: a sorted-values start, is = -7..7, re-projection while the points
change, and d refitted over the super-block as 1.05 Σwqx/Σwq²; mainline: is = -9..9 from max/5, as
IQ2_S) and, where no trial fits a block (all its weights 0), in the levels written: ik keeps the
previous block's (its C code does not reset them), mainline zeros.  llama-quantize refuses IQ2_XXS
and IQ2_XS without an imatrix (their mainline C quantizers assert one), so those paths are left out;
ik's _r4 wrappers still call the quantizer without one (``wrapped_paths``).

The kernels are kernels/iq2xs.py; the reference decoder is formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import iq2xs as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FLAVORS, FamilyKernelFormat, reference_decoder

_IMATRIX_ONLY = frozenset((f, True) for f in FLAVORS)


class _IQ2(FamilyKernelFormat):
    """The row kernels of kernels/iq2xs.py; the reference decoder of formats/decode.py."""
    kernel_module = kernels
    kernel_takes_flavor = True
    dequantize_ref = reference_decoder
    scale_fields = ((0, "<f2"),)


class IQ2_XXS(_IQ2, qtype=QuantType.IQ2_XXS):
    # block_iq2_xxs { fp16 d @0; uint16 qs[32] }
    quant_paths = _IMATRIX_ONLY
    wrapped_paths = ALL_PATHS


class IQ2_XS(_IQ2, qtype=QuantType.IQ2_XS):
    # block_iq2_xs { fp16 d @0; uint16 qs[32]; uint8 scales[8] }
    quant_paths = _IMATRIX_ONLY
    wrapped_paths = ALL_PATHS


class IQ2_S(_IQ2, qtype=QuantType.IQ2_S):
    # block_iq2_s { fp16 d @0; uint8 qs[64] (indices, then signs); uint8 qh[8]; uint8 scales[8] }
    quant_paths = ALL_PATHS
