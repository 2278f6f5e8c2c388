"""Byte-reading helpers the decoders share (Triton device functions).

Every decoder reads its block through uint8 pointers; these turn bytes into the scalars ggml keeps
there (little-endian float16 / bfloat16 / float32, int8 codes).  Bit casts, never conversions, so
the values equal the numba decoders' exactly.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def u16(p):
    """The little-endian uint16 at byte pointers ``p``, as int32."""
    return tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)


@triton.jit
def f16(p):
    """The little-endian float16 at byte pointers ``p``, as float32."""
    return u16(p).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def bf16(p):
    """The little-endian bfloat16 at byte pointers ``p``, as float32 (its bits are a float32's top half)."""
    return (u16(p) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32(p):
    """The little-endian float32 at byte pointers ``p``."""
    w = u16(p) | (u16(p + 2) << 16)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def byte(p):
    """The uint8 at byte pointers ``p``, as int32."""
    return tl.load(p).to(tl.int32)


@triton.jit
def int8(p):
    """The int8 at byte pointers ``p``, as int32."""
    return tl.load(p).to(tl.int8, bitcast=True).to(tl.int32)
