"""float32 building blocks shared by the numpy reference formats.

Each reproduces one C idiom exactly, vectorised across blocks (or "lanes"): the first axis is the
block, the last axis the elements of the block, evaluated in C order where order matters.
"""
from __future__ import annotations

import numpy as np

F = np.float32


def seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum along the last axis left to right starting from +0, as C's ``s = 0; s += t`` loop does
    (numpy's pairwise ``sum`` rounds differently; the leading +0 column fixes the sign of -0 sums)."""
    z = np.zeros(terms.shape[:-1] + (1,), terms.dtype)
    return np.cumsum(np.concatenate([z, terms], axis=-1), axis=-1)[..., -1]


def fp16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 (n,) -> (n, 2) little-endian fp16 bytes (GGML_FP32_TO_FP16: round to nearest even,
    NaN -> sign|0x7E00); values beyond the fp16 range become Inf, as in C."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(v, dtype=np.float32).astype("<f2").view(np.uint8).reshape(-1, 2)


def recip_or_zero(d: np.ndarray) -> np.ndarray:
    """C's ``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(d != 0, F(1) / d, F(0)).astype(np.float32)


def first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max) per block: the largest |x| and the signed value where it first occurs
    (C: ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }``, both starting at +0)."""
    amax = np.zeros(x.shape[0], np.float32)
    mx = np.zeros(x.shape[0], np.float32)
    for i in range(x.shape[1]):
        ax = np.abs(x[:, i])
        upd = ax > amax
        amax = np.where(upd, ax, amax)
        mx = np.where(upd, x[:, i], mx)
    return amax, mx
