"""Plain number formats: F32, F16 and BF16 (one value per "block", no scale).

F16 is IEEE binary16 with round-to-nearest-even, as ``GGML_FP32_TO_FP16`` and numpy's
``astype(float16)`` both do for every non-NaN value.  BF16 keeps the upper 16 bits of the float32
pattern after ``ggml_compute_fp32_to_bf16``'s rounding (a numba kernel).  None of them uses an
imatrix, and mainline and ik_llama.cpp convert identically, so every (flavor, imatrix) path is the
same code.
"""
from __future__ import annotations

import numpy as np

from ..kernels import floats as kernels
from ..tables import FP16_TABLE
from ..types import QuantType
from ._base import ALL_PATHS, BlockFormat


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 bf16 bit patterns of the same shape (ggml_compute_fp32_to_bf16).

    NaN keeps its upper half with the quiet bit (64 = bit 6 of the upper half) forced on; everything
    else rounds to nearest even, so a value just under FLT_MAX may round up to Inf.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.reshape(1, -1) if x.ndim < 2 or x.shape[-1] == 0 else x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape, np.uint16)
    kernels.fp32_to_bf16_rows(rows.view(np.uint32), out)
    return out.reshape(x.shape)


class F32(BlockFormat, qtype=QuantType.F32):
    quant_paths = ALL_PATHS
    scale_fields = ((0, "<f4"),)        # every value is its own "field"

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        x = np.ascontiguousarray(x, dtype="<f4")
        return x.view(np.uint8).reshape(x.shape[0], cls.traits.row_size(x.shape[1]))

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        return np.ascontiguousarray(blocks, np.uint8).view("<f4").reshape(blocks.shape[0], n_per_row).copy()


# every float16 bit pattern decoded once; the fast decoder is a parallel table lookup
_F16_TO_F32 = FP16_TABLE


class F16(BlockFormat, qtype=QuantType.F16):
    quant_paths = ALL_PATHS
    scale_fields = ((0, "<f2"),)

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        h = np.ascontiguousarray(blocks, np.uint8).view(np.uint16).reshape(blocks.shape[0], n_per_row)
        kernels.f16_to_fp32_rows(h, _F16_TO_F32, out)
        return out

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        with np.errstate(over="ignore"):        # beyond ±65504 rounds to ±Inf, as in C
            h = np.ascontiguousarray(x, dtype=np.float32).astype("<f2")
        return h.view(np.uint8).reshape(x.shape[0], cls.traits.row_size(x.shape[1]))

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        h = np.ascontiguousarray(blocks, np.uint8).view("<f2")
        return h.astype(np.float32).reshape(blocks.shape[0], n_per_row)


class BF16(BlockFormat, qtype=QuantType.BF16):
    quant_paths = ALL_PATHS

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        return fp32_to_bf16_bits(x).view(np.uint8).reshape(x.shape[0], cls.traits.row_size(x.shape[1]))

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        b = np.ascontiguousarray(blocks, np.uint8).view("<u2").astype(np.uint32) << 16
        return b.view(np.float32).reshape(blocks.shape[0], n_per_row)

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        kernels.bf16_to_fp32_rows(np.ascontiguousarray(blocks, np.uint8).view(np.uint16), out.view(np.uint32))
        return out
