"""IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT: ik_llama.cpp's trellis quants (written from its source; not in
the spec).  Codes index groups of integer values made by a hash (:mod:`._kt_codebook`).

A row is a float32 scale d and 256-value blocks of eight 32-value sub-blocks:

    IQ1_KT (56 B):  sh[8] | ql[32] | qh[16]      13-bit codes, groups of 8
        sh[ib] = scale index (IQ4_K table) | bit 12 of code j at bit 4+j
        code (ib, j) = ql[4ib+j] | nibble ib/4 of qh[4(ib%4)+j] << 8 | sh bit << 12
    IQ2_KT (68 B):  scales[4] | ql[64]            16-bit codes, groups of 8, uint16 LE in order
        sub-block ib's scale = IQ4_K table[nibble ib/4 of scales[ib%4]]
    IQ3_KT (100 B): scales[4] | ql[64] | qh[32]   codes of |x|; bit ib of qh[j] = sign of value j of
        sub-block ib; the scale is the nibble itself (0..15)
    IQ4_KT (128 B): 32 uint32 words; word ib (ib < 8) = bit 0: second table | bits 1-7: scale+64 |
        bits 8+3j..10+3j: code bits 12-14 of group j; then ql[64] (code bits 0-7) and qh[32]
        (code bits 8-11 of group g in nibble g/32 of qh[g%32]); 15-bit codes, groups of 4
    value = d * scale * trellis value

The quantizer (per sub-block: a few trial scales, each matched to codes, keep the best; then the
row scale and the sub-block scales; then a final matching pass) is the numba kernel of
:mod:`quantkit.kernels.kt`.  It follows ik's AVX2 code, whose arithmetic is part of the format's
bytes: the nearest-code search adds each score as ``((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`` (for
groups of 4: ``(s0+s2)+(s1+s3)``), breaks ties between equal scores by SIMD lane before position,
and the scale fit accumulates with fused multiply-adds in 8 lanes.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..kernels import kt as kernels
from ..types import QuantType
from ._base import ALL_PATHS, KernelFormat, reference_decoder
from ._kt_codebook import IQ4_KT_SECOND_OFFSET, codebook


# ---------------------------------------------------------------- formats
@lru_cache(maxsize=None)
def _kernel_tables(name, offset=None):
    """The codebook as the kernels take it (kernels/kt.py), built once per process."""
    cb = codebook(name) if offset is None else codebook(name, offset)
    # float16 bits: the search widens them in one instruction (numba has no float16 arrays)
    return (cb.mid, cb.offsets, cb.flat_members, cb.flat_values_t.astype(np.float16).view(np.uint16),
            np.ascontiguousarray(cb.values.T).astype(np.float16).view(np.uint16), cb.values)


def _fast_small(one):
    def run(x, qw, has_qw, out):
        kernels.quantize_small_rows(x, qw, has_qw, out, one, *_kernel_tables("iq1_kt" if one else "iq2_kt"))
    return run


def _fast_iq3(x, qw, has_qw, out):
    kernels.quantize_iq3_rows(x, qw, has_qw, out, *_kernel_tables("iq3_kt"))


def _fast_iq4(x, qw, has_qw, out):
    kernels.quantize_iq4_rows(x, qw, has_qw, out, _kernel_tables("iq4_kt"),
                              _kernel_tables("iq4_kt", IQ4_KT_SECOND_OFFSET))


class _KT(KernelFormat):
    """The KT quantizers take the imatrix as it is (no QHelper clean-up)."""
    kind: int = 0
    dequantize_ref = reference_decoder

    @classmethod
    def _kernel_dequantize(cls, blocks, out):
        kernels.dequantize_rows(blocks, cls.kind, out)


class IQ1_KT(_KT, qtype=QuantType.IQ1_KT):
    quant_paths = ALL_PATHS
    kind = 1
    _kernel_quantize = staticmethod(_fast_small(True))


class IQ2_KT(_KT, qtype=QuantType.IQ2_KT):
    quant_paths = ALL_PATHS
    kind = 2
    _kernel_quantize = staticmethod(_fast_small(False))


class IQ3_KT(_KT, qtype=QuantType.IQ3_KT):
    quant_paths = ALL_PATHS
    kind = 3
    _kernel_quantize = staticmethod(_fast_iq3)


class IQ4_KT(_KT, qtype=QuantType.IQ4_KT):
    quant_paths = ALL_PATHS
    kind = 4
    _kernel_quantize = staticmethod(_fast_iq4)
