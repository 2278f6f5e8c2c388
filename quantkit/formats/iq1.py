"""IQ1_S and IQ1_M (both flavors), ik's IQ1_S_R4 and IQ1_M_R4: 8 values per point of a 2048-point
lattice of levels {-1, 0, +1}, shifted by +-1/8.

    IQ1_S     256 values: fp16 d @0; qs[32] @2; uint16 qh[8] @34           (50 bytes)
              32-block ib: points qs[4ib + l] | bits 3l..3l+2 of qh[ib] << 8; bits 12-14 of qh[ib]
              the scale l (value d*(2l+1)); bit 15 the shift (-1/8, else +1/8)
    IQ1_M     256 values: qs[32] @0; qh[16] @32; scales[8] @48              (56 bytes)
              16-block b: points qs[2b + l] | bits 4l..4l+2 of qh[b] << 8, shift bit 3 + 4l of qh[b];
              3-bit scales, 4 to a uint16 of scales; the fp16 d in the top nibbles of the four
    IQ1_S_R4  4 rows: fp16 d[4], then per 32 columns { qs[16]; uint16 qh[4] }  (row k: qs[4i + k],
              qh[k] as IQ1_S's qh of one 32-block)
    IQ1_M_R4  4 rows: fp16 d[4], then per 32 columns { qs[16]; qh[8]; scales[4] } (row k, half i:
              points qs[8i + k], qs[8i + k + 4], qh[4i + k]; 4-bit scales (no 2l+1), nibble i of
              scales[k])

    y = dl * (grid + shift)

Quantizing (kernels/iq1.py): per block, the exact weighted least-squares split of the sorted values
into the three levels, each group of 8 levels snapped to the lattice (or its nearest neighbour),
then the block scales to 3 (4) bits.  IQ1_S needs an imatrix (its C quantizer asserts one), and
both flavors write the same bytes.  IQ1_M differs by flavor (ik: sigma² per 32 values, weights
x² where the imatrix is zero on the non-zero x, fudge 1.085; mainline: sigma² per 256, a
different summation order of the split search, fudge 1.1125).  The _R4 types exist only in ik and
are not repacks of IQ1_S/IQ1_M: their blocks are 32 values with a per-row scale, quantized by
their own C functions (quantize_iq1_s_r4 / quantize_iq1_m_r4), with or without an imatrix;
``repack`` has no mapping for them (ik's get_repack_info has none).
"""
from __future__ import annotations

from ..kernels import iq1 as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder

_IMATRIX_ONLY = frozenset({("ik", True), ("mainline", True)})


class _IQ1(FamilyKernelFormat):
    """The row kernels of kernels/iq1.py; the reference decoder of formats/decode.py."""
    kernel_module = kernels
    kernel_takes_flavor = True
    dequantize_ref = reference_decoder


class IQ1_S(_IQ1, qtype=QuantType.IQ1_S):
    # block_iq1_s { fp16 d @0; uint8 qs[32]; uint16 qh[8] }
    quant_paths = _IMATRIX_ONLY
    scale_fields = ((0, "<f2"),)


class IQ1_M(_IQ1, qtype=QuantType.IQ1_M):
    # block_iq1_m { uint8 qs[32]; uint8 qh[16]; uint16 scales[4] }: the fp16 scale is spread over
    # the top nibbles, so the output check decodes
    quant_paths = ALL_PATHS


class _IQ1_R4(_IQ1):
    """ik only: one quantizer for both flavors; 4 rows at a time."""
    quant_paths = ALL_PATHS

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        group = cls.traits.interleave_rows
        if x.shape[0] % group:
            raise ValueError(f"{cls.traits.name} needs a multiple of {group} rows, got {x.shape[0]}")
        return super().quantize(x, imatrix, "ik")


class IQ1_S_R4(_IQ1_R4, qtype=QuantType.IQ1_S_R4):
    pass


class IQ1_M_R4(_IQ1_R4, qtype=QuantType.IQ1_M_R4):
    pass
