"""The legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Each row is cut into blocks of 32 values; a block stores an fp16 scale ``d`` (plus an fp16 offset
``m`` for the ``_1`` types) and one small integer code per value (specs/ggml-quants.md §1.2–1.3)::

    Q4_0  y = (q - 8)*d     q in 0..15           d[0:2]                  qs[2:18]
    Q4_1  y = q*d + m       q in 0..15           d[0:2]  m[2:4]          qs[4:20]
    Q5_0  y = (q - 16)*d    q in 0..31           d[0:2]         qh[2:6]  qs[6:22]
    Q5_1  y = q*d + m       q in 0..31           d[0:2]  m[2:4] qh[4:8]  qs[8:24]
    Q8_0  y = q*d           q in -128..127       d[0:2]                  qs[2:34] (int8)

``qs`` byte j holds code j in bits 0-3 and code j+16 in bits 4-7; ``qh`` is a little-endian uint32
whose bit e is bit 4 of code e.  d and m are little-endian fp16.

Quantizers (§1.6).  Without an imatrix every flavor runs the ``quantize_row_*_ref`` functions: a
scale from the block's extreme values and codes by truncating casts.  With an imatrix the weight of
value ``x`` is ``qw*sqrt(sigma2 + x*x)`` (``sigma2`` = mean of x² over the whole row) and the scale
comes from a weighted search whose details differ between the projects:

* ``"ik"`` (ik_llama.cpp): Q4_0/Q5_0 use the fork's ``make_qx_quants`` (mainline's search, with
  every step also tried with the opposite sign, then a greedy one-code-at-a-time refinement);
  Q4_1/Q5_1 use the fork's ``make_qkx3_quants`` (double-precision sums, the error of a trial computed
  from the sums, then a greedy refinement).
* ``"mainline"`` (llama.cpp): ``make_qx_quants`` / ``make_qkx3_quants`` as in ggml-quants.c, all in
  float32 and without the refinements.

Q8_0 ignores the imatrix in both projects.

The quantizers are the numba kernels of :mod:`quantkit.kernels.legacy`, which keep the C evaluation
order of every float32 (or double) expression.  Q8_0 has a numpy twin (formats/q8_0_numpy.py, the
same bytes), run while numba is not imported: a q8_0 quantize of a float model never imports it
(~0.3 s), while a plan that loads kernels anyway gets the kernel, ~4x less CPU a value.  The kernels
module is imported on the first use of a kernel.  The reference decoder is formats/decode.py's.
"""
from __future__ import annotations

import sys

import numpy as np

from ..tables import FP16_TABLE
from ..types import QuantType
from . import q8_0_numpy
from ._base import BlockFormat, KernelFormat, reference_decoder


def _kernels():
    """kernels/legacy.py (numba), on first use: importing this module registers Q8_0, whose
    quantizer needs none of it."""
    from ..kernels import legacy
    return legacy

QK = 32                     # values per block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0)


class _LegacyFormat(BlockFormat):
    """Shared driver: the row kernels of kernels/legacy.py; the reference decoder of formats/decode.py."""
    nmax: int               # Q*_0: codes are l + nmax with l in -nmax..nmax-1; Q*_1: codes 0..nmax
    affine: bool = False    # stores an fp16 offset m after d
    high_bits: bool = False  # stores the 5th code bit in qh

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        out = cls.empty_blocks(n_rows, n)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if cls.qtype == QuantType.Q8_0 and "numba" not in sys.modules:
            q8_0_numpy.quantize_rows(x, out)        # the same bytes without importing numba
        elif imatrix is None or cls.qtype == QuantType.Q8_0:
            _kernels().quantize_rows_plain(int(cls.qtype), x, out)
        else:
            _kernels().quantize_rows_imatrix(int(cls.qtype), x, np.ascontiguousarray(imatrix, np.float32),
                                             flavor == "ik", out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        blocks = np.ascontiguousarray(blocks, np.uint8)
        _kernels().dequantize_rows(int(cls.qtype), blocks, FP16_TABLE, out)
        return out

    dequantize_ref = reference_decoder


# Without an imatrix mainline and ik run the same *_ref code; with one they differ (see above).
_LEGACY_PATHS = frozenset({("ik", False), ("ik", True), ("mainline", False), ("mainline", True)})


class Q4_0(_LegacyFormat, qtype=QuantType.Q4_0):
    nmax = 8
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS


class Q4_1(_LegacyFormat, qtype=QuantType.Q4_1):
    nmax = 15
    affine = True
    scale_fields = ((0, "<f2"), (2, "<f2"))
    quant_paths = _LEGACY_PATHS


class Q5_0(_LegacyFormat, qtype=QuantType.Q5_0):
    nmax = 16
    high_bits = True
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS


class Q5_1(_LegacyFormat, qtype=QuantType.Q5_1):
    nmax = 31
    affine = True
    high_bits = True
    scale_fields = ((0, "<f2"), (2, "<f2"))
    quant_paths = _LEGACY_PATHS


class Q8_0(_LegacyFormat, qtype=QuantType.Q8_0):
    """``d = amax/127``, ``q = roundf(x/d)``; the imatrix is ignored by both projects."""
    quant_paths = _LEGACY_PATHS
    numpy_quantize = True
    scale_fields = ((0, "<f2"),)


class Q6_0(KernelFormat, _LegacyFormat, qtype=QuantType.Q6_0):
    """ik_llama.cpp's 6-bit block (llama-quantize's fallback for IQ5_K/Q5_K rows that are not a
    multiple of 256).  Its quantizer is always the fork's ``make_qx_quants`` with nmax 32, weighted by
    ``x²`` or, with an imatrix, ``qw*sqrtf(sigma2 + x²)``; it exists only in ik, so both flavors run it.

        d[0:2]  qh[2:10]  qs[10:26]
        qs[j]: low nibble = low 4 bits of code j, high nibble = those of code j+16 (j < 16)
        qh[k]: 2-bit pairs (code k, code k+16, code k+8, code k+24) >> 4, from bit 0 up
    """
    nmax = 32
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS
    @staticmethod
    def _kernel_quantize(x, qw, has_qw, out):
        _kernels().quantize_rows_q6_0(x, qw, has_qw, out)

    @staticmethod
    def _kernel_dequantize(blocks, out):
        _kernels().dequantize_rows_q6_0(blocks, FP16_TABLE, out)
