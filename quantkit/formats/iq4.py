"""IQ4_NL and IQ4_XS: 4-bit codes that index a fixed non-linear table of 16 int8 values.

    IQ4_NL  32 values:  y = d*T[q]                     fp16 d, qs[16]
    IQ4_XS  256 values: y = d*(ls-32)*T[q] per 32      fp16 d, uint16 scales_h, scales_l[4], qs[128]

    T = kvalues_iq4nl = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

Both types run one quantizer (quantize_row_iq4_nl_impl) with ``ntry = 7``, with or without an
imatrix (specs/ggml-quants.md §1.6).  Per 32-value block: weights ``qw*sqrtf(sigma2 + x²)`` with an
imatrix (``sigma2 = 2*Σx²/super_block_size``), else ``x²``; start from ``d = max/127`` and try the
inverse scales ``(itry - 127)/max``, keeping the weighted least-squares scale with the best
``Σwqx²/Σwq²``.  ik_llama.cpp also tries ``(itry + 113)/max`` (the mirrored table), keeps the codes
of the best trial and then moves one code at a time while the fit improves; it does not guard the first
``Σwqx/Σwq²`` against 0/0.  IQ4_NL stores fp16(d) and re-derives the codes with the *unrounded* d;
IQ4_XS quantizes the eight block scales to 6 bits against ``d = -max_scale/32`` and re-derives the
codes from ``d*l`` (unrounded).

``best_index`` is "the nearest table value, an exact tie goes to the upper one".  Mainline finds it by
binary search, ik with a 241-entry lookup on ``(int)x`` whose entries are either that index or a pair
to compare (checked against the C table); the two agree except for NaN (mainline 15, ik 0) and for
|x| >= 2^31, where ik's float-to-int conversion overflows to INT_MIN and gives 0.

The quantizers are the numba kernels of :mod:`quantkit.kernels.iq4`; the reference decoder is
formats/decode.py's.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq4 as kernels
from ..tables import IQ4NL_VALUES
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder

KVALUES = IQ4NL_VALUES.astype(np.int64)
KV = KVALUES.astype(np.float32)


class _IQ4(FamilyKernelFormat):
    """The row kernels of kernels/iq4.py; the reference decoder of formats/decode.py."""
    kernel_module = kernels
    kernel_takes_flavor = True
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder


class IQ4_NL(_IQ4, qtype=QuantType.IQ4_NL):
    # block_iq4_nl { fp16 d @0; uint8 qs[16] }
    scale_fields = ((0, "<f2"),)


class IQ4_XS(_IQ4, qtype=QuantType.IQ4_XS):
    # block_iq4_xs { fp16 d @0; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128] }
    scale_fields = ((0, "<f2"),)
