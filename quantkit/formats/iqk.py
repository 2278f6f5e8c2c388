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

The quantizers are the numba kernels of :mod:`quantkit.kernels.iqk`; the reference decoder is
formats/decode.py's, from the layouts of quantkit/layouts.py.
"""
from __future__ import annotations

from ..kernels import iqk as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder


# ---------------------------------------------------------------------------------- formats
class _SuperBlockIQK(FamilyKernelFormat):
    kernel_module = kernels
    quant_paths = ALL_PATHS
    scale_fields = ((0, "<f2"),)
    dequantize_ref = reference_decoder


class IQ3_K(_SuperBlockIQK, qtype=QuantType.IQ3_K):
    pass


class IQ4_K(_SuperBlockIQK, qtype=QuantType.IQ4_K):
    pass


class IQ5_K(_SuperBlockIQK, qtype=QuantType.IQ5_K):
    pass


class IQ6_K(_SuperBlockIQK, qtype=QuantType.IQ6_K):
    pass


class _RowScaled(_SuperBlockIQK):
    """Types whose rows start with a scale (a float32 one: IQ4_KS, IQ5_KS; float16: IQ3_KS)."""
    scale_fields = None


class IQ5_KS(_RowScaled, qtype=QuantType.IQ5_KS):
    pass


class IQ3_KS(_RowScaled, qtype=QuantType.IQ3_KS):
    pass


class IQ4_KS(_RowScaled, qtype=QuantType.IQ4_KS):
    pass
