"""MXFP4: the OCP microscaling 4-bit float (gpt-oss's native weights), in both projects.

    block_mxfp4 { uint8 e @0 (E8M0 shared exponent); uint8 qs[16] @1 }      32 values, 17 bytes
    value j = 2^(e - 128) * MXFP4_VALUES[code j]    code j: low nibble of qs[j], j + 16 the high one
    MXFP4_VALUES = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}  (E2M1 values doubled)

ik_llama.cpp and llama.cpp quantize it alike (the golden vectors of the two are the same bytes) and
neither uses an imatrix: the exponent from the block's largest |x|, each code the nearest value
(:mod:`quantkit.kernels.mxfp4`).  The reference decoder is formats/decode.py's (hand-written: the
layout records know float16 scales only, not an E8M0 byte).  ik also has mxfp4_r8 (8 rows
interleaved: formats/interleave.py, repacked.py).
"""
from __future__ import annotations

from ..kernels import mxfp4 as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder


class MXFP4(FamilyKernelFormat, qtype=QuantType.MXFP4):
    kernel_module = kernels
    kernel_takes_flavor = True
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder
    # no float field: the quantizer's exponent is at most 252 (amax <= FLT_MAX < 2^128), and
    # 2^(252 - 128) * 12 is finite, so its output never decodes to inf or nan
    scale_fields = ()
