"""Element decoders for checkpoint dtypes: bfloat16 and DeepSeek's block-scaled float8.

float8_e4m3fn (the "fn" variant: finite only, no infinities)::

    bit  7   6 5 4 3   2 1 0
         s   e e e e   m m m        bias 7
    e = 0:      (-1)^s * m/8 * 2^-6               (subnormal)
    e = 1..15:  (-1)^s * (1 + m/8) * 2^(e - 7)    (max 448 = 0x7E)
    0x7F, 0xFF: NaN

DeepSeek-V3 stores each weight matrix in float8 with one float32 ``weight_scale_inv`` per 128 x 128
block (a partial block at the right or bottom edge included); the value is ``fp8 * scale``. Its
own ``fp8_cast_bf16.py``, which every FP8 -> GGUF recipe starts with, computes that product in
float32 and rounds it to bfloat16, so we do the same: the GGUF we write equals the one made from
the BF16 checkpoint.

DeepSeek-V3.1/V3.2 were trained with "ue8m0" scales (``quantization_config.scale_fmt``): every
block scale is a power of two, stored as float32 or as safetensors' F8_E8M0 (one exponent byte e,
the scale 2^(e - 127); 0xFF is NaN).  fp8 * 2^k keeps the float8's 4 significant bits, which
bfloat16 holds: the BF16 values are the checkpoint's exactly, no rounding at all.
"""
from __future__ import annotations

import numpy as np

from ..formats.floats import fp32_to_bf16_bits

FP8_BLOCK = 128


def _e4m3fn_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = (bits & 0x7).astype(np.float64)
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    value = sign * value
    value[(bits & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3FN = _e4m3fn_table()


def fp8_block_rows(fp8: np.ndarray, scale_inv: np.ndarray, row_index: np.ndarray) -> np.ndarray:
    """Rows of a block-scaled float8 matrix as bfloat16 bits.

    ``fp8``: (n, cols) uint8, the matrix rows numbered ``row_index``;
    ``scale_inv``: the whole (ceil(rows/128), ceil(cols/128)) float32 scale grid.
    """
    cols = fp8.shape[1]
    block_rows = np.asarray(row_index) // FP8_BLOCK
    scale = np.repeat(scale_inv[block_rows].astype(np.float32), FP8_BLOCK, axis=1)[:, :cols]
    return fp32_to_bf16_bits(E4M3FN[fp8] * scale)


def block_scales(dtype: str, data: np.ndarray) -> np.ndarray:
    """A stored scale grid (F32, or F8_E8M0 exponent bytes) as float32 (NaN for E8M0's 0xFF)."""
    if dtype == "F8_E8M0":
        e = np.asarray(data, np.uint8)
        return np.where(e == 0xFF, np.nan, np.ldexp(1.0, e.astype(np.int32) - 127)).astype(np.float32)
    return np.array(data, np.float32)


def powers_of_two(x: np.ndarray) -> np.ndarray:
    """Which float32 values are positive powers of two (normal or subnormal)."""
    x = np.asarray(x, np.float32)
    mantissa, _ = np.frexp(x)
    return np.isfinite(x) & (mantissa == 0.5)
