"""Ternary types (BitNet b1.58, TriLMs): every value is d * t with t in {-1, 0, +1}.

    IQ1_BN   ik      fp16 row scale d = max|x|; per 64 values ql[12] | extra   1.625 bpw
    IQ2_BN   ik      float32 row scale d = max|x|; per 64 values qs[16]        2 bpw
    TQ1_0    mainline  per 256 values qs[48] | qh[4] | fp16 d = max|x|         1.6875 bpw
    TQ2_0    mainline  per 256 values qs[64] | fp16 d = max|x|                 2.0625 bpw

ik rounds a value to 0 where |x| < d/2, else to its sign; mainline to lroundf(x/d).  IQ1_BN and
TQ1_0 store 5 trits per byte as ceil(256 q / 243) of their base-3 number q (3^5 = 243 <= 256),
IQ2_BN and TQ2_0 2-bit codes t + 1.  No quantizer reads an imatrix.  IQ2_BN_R4 (ik) is IQ2_BN
repacked by 4 rows (formats/interleave.py, formats/repacked.py).

ik's ``to_float`` for IQ1_BN / IQ2_BN reads the blocks from the row's first byte (not after the
row scale) and returns t without the scale; its matrix products and IQ2_BN_R4's ``to_float`` use
d * t, which is what the decoders here return.  ik_llama.cpp cannot load TQ1_0 / TQ2_0 (types.py:
loads=MAINLINE; the plan refuses them for --flavor ik) and has no quantizer for them, so they
quantize in the mainline flavor only.

The quantizers and the fast decoders are the numba kernels of :mod:`quantkit.kernels.ternary`; the
reference decoders are formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import ternary as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder

MAINLINE_PATHS = frozenset(p for p in ALL_PATHS if p[0] == "mainline")


class _Ternary(FamilyKernelFormat):
    kernel_module = kernels
    quant_paths = ALL_PATHS                 # ik-only types: one algorithm for both flavors
    dequantize_ref = reference_decoder


class IQ1_BN(_Ternary, qtype=QuantType.IQ1_BN):
    # fp16 d; block_iq1_bn { uint8 ql[12]; uint8 extra }
    scale_fields = ((0, "<f2"),)            # the row scale: max|x| above 65504 is inf


class IQ2_BN(_Ternary, qtype=QuantType.IQ2_BN):
    # float32 d; block_iq2_bn { uint8 qs[16] }
    scale_fields = ((0, "<f4"),)


class TQ1_0(_Ternary, qtype=QuantType.TQ1_0):
    # block_tq1_0 { uint8 qs[48]; uint8 qh[4]; fp16 d @52 }
    quant_paths = MAINLINE_PATHS
    scale_fields = ((52, "<f2"),)


class TQ2_0(_Ternary, qtype=QuantType.TQ2_0):
    # block_tq2_0 { uint8 qs[64]; fp16 d @64 }
    quant_paths = MAINLINE_PATHS
    scale_fields = ((64, "<f2"),)
