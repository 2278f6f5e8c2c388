"""IQ2_K and IQ2_KS: 2-bit codes into a 4-value non-linear table, with a shifted twin per sub-block.

    IQ2_K   76 B per 256:  d fp16 | extra u16 (shift bit per 16-block) | scales[8] (4 bits, ls+8) | qs[64]
    IQ2_KS  fp16 row scale, then 70 B per 256:
            extra u16 (bits 0-7 shift of 32-block ib, bits 8-15 bit 4 of its scale) | scales[4] | qs[64]

    value = d * ls * T[q + 4*shift],   T = {-31, -13, 1, 17 | -26, -8, 6, 22}
    qs: value p of a super-block, ib32 = p/32, k = p%32: byte 32*(ib32/4) + k, bits 2*(ib32%4)

With four levels an exhaustive search is affordable: sort the sub-block's values, and every split
of the sorted list into four runs (levels T[0] <= T[1] <= T[2] <= T[3], or the mirror order for a
negative scale) is a candidate whose weighted least-squares scale comes from prefix sums; the
split explaining most of Σw·x² wins (specs/ik-quants.md §3e).  The sub-block scales are then
quantized together with ik's own ``make_qx_quants`` (§3c) and the codes re-derived.

The quantizers are the numba kernels of :mod:`quantkit.kernels.iq2k`; the reference decoder is
formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import iq2k as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder


class _IQ2(FamilyKernelFormat):
    kernel_module = kernels
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder


class IQ2_K(_IQ2, qtype=QuantType.IQ2_K):
    scale_fields = ((0, "<f2"),)


class IQ2_KS(_IQ2, qtype=QuantType.IQ2_KS):
    pass
