"""Plain number formats: F32, F16 and BF16 (one value per "block", no scale).

F16 is IEEE binary16 with round-to-nearest-even, as ``GGML_FP32_TO_FP16`` and numpy's
``astype(float16)`` both do for every non-NaN value.  BF16 keeps the upper 16 bits of the float32
pattern after ``ggml_compute_fp32_to_bf16``'s rounding (a numba kernel).  None of them uses an
imatrix, and mainline and ik_llama.cpp convert identically, so every (flavor, imatrix) path is the
same code.

Decoding F16 and BF16 is numpy on rows split between threads (row_threads.py), exact for every bit
pattern: a quantize from an F16/BF16 model to a type whose quantizer is numpy too (q8_0) imports no
numba.  Encoding BF16 is a numba kernel (kernels/floats.py, imported on first use).
"""
from __future__ import annotations

import numpy as np

from ..row_threads import over_rows, scratch
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
    from ..kernels.floats import fp32_to_bf16_rows
    fp32_to_bf16_rows(rows.view(np.uint32), out)
    return out.reshape(x.shape)


class F32(BlockFormat, qtype=QuantType.F32):
    quant_paths = ALL_PATHS
    numpy_quantize = numpy_decode = True
    scale_fields = ((0, "<f4"),)        # every value is its own "field"

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        x = np.ascontiguousarray(x, dtype="<f4")
        return x.view(np.uint8).reshape(x.shape[0], cls.traits.row_size(x.shape[1]))

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        return np.ascontiguousarray(blocks, np.uint8).view("<f4").reshape(blocks.shape[0], n_per_row).copy()


_HALF_TO_FLOAT_SCALE = np.float32(2.0 ** 112)       # 2^(127 - 15): fp16's exponent bias to float32's


def f16_bits_to_f32(h: np.ndarray, out: np.ndarray) -> None:
    """fp16 bit patterns ``h`` (uint16) -> float32 ``out`` (same shape), every pattern exactly as
    numpy's float16 -> float32 cast (GGML_FP16_TO_FP32; a NaN keeps its payload)::

        h:    s eeeee mmmmmmmmmm              float32: s EEEEEEEE mmmmmmmmmm0000000000000
        (h & 0x7FFF) << 13 is a float32 of exponent e (or a subnormal for e = 0) worth value·2^-112:
        times 2^112 (exact) gives the value, subnormal halves included; e = 31 (inf, NaN) gets
        exponent 255 with its mantissa; the sign bit moves 16 places up.
    """
    u = scratch("f16.u", h.shape, np.uint32)
    sign = scratch("f16.sign", h.shape, np.uint32)
    np.copyto(u, h)
    np.bitwise_and(u, np.uint32(0x8000), out=sign)
    sign <<= np.uint32(16)
    u &= np.uint32(0x7FFF)
    u <<= np.uint32(13)
    np.multiply(u.view(np.float32), _HALF_TO_FLOAT_SCALE, out=out)
    bits = out.view(np.uint32)
    special = np.greater_equal(u, np.uint32(0x0F800000), out=scratch("f16.special", h.shape, np.bool_))   # e = 31
    if special.any():
        np.bitwise_or(u, np.uint32(0x70000000), out=bits, where=special)
    bits |= sign


class F16(BlockFormat, qtype=QuantType.F16):
    quant_paths = ALL_PATHS
    numpy_quantize = numpy_decode = True
    scale_fields = ((0, "<f2"),)

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        h = np.ascontiguousarray(blocks, np.uint8).view(np.uint16).reshape(blocks.shape[0], n_per_row)
        over_rows(lambda a, b: f16_bits_to_f32(h[a:b], out[a:b]), h.shape[0], n_per_row)
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
    numpy_decode = True

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
        b = np.ascontiguousarray(blocks, np.uint8).view(np.uint16).reshape(blocks.shape[0], n_per_row)
        bits = out.view(np.uint32)
        over_rows(lambda i, j: np.left_shift(b[i:j], np.uint32(16), out=bits[i:j], dtype=np.uint32),
                  b.shape[0], n_per_row)
        return out
