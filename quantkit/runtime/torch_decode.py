"""Block decoders in torch: stored bytes on the device -> float32 rows on the device.

The torch backend (``ops_torch``) keeps weights in their quantized layout and decodes a tile of
rows right before each product, on whatever device the bytes live (CUDA, or the CPU in tests).
The decoder is the reference one (formats/decode.py, written once for numpy and torch, from the
types' block layouts in quantkit/layouts.py) run through :class:`Torch`, the array namespace
below; its values equal the numba decoders' bit for bit, which the tests check type by type.

Interleaved types have no decoder here by design: they stay on the CPU (numba), as ik_llama.cpp
keeps them there.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats import decode as reference
from ..types import QuantType

T = QuantType


class Torch:
    """formats.decode's array namespace, in torch (the methods of formats.decode.Numpy)."""

    def __init__(self):
        self._consts: dict = {}

    def const(self, like, key, make):
        """``make()`` (a numpy array) as a tensor on ``like``'s device, made once per device."""
        full = (key, str(like.device))
        if full not in self._consts:
            self._consts[full] = torch.from_numpy(np.ascontiguousarray(make())).to(like.device)
        return self._consts[full]

    @staticmethod
    def ints(b):
        return b.long()

    @staticmethod
    def floats(a):
        return a.float()

    @staticmethod
    def f16(b, at):
        return b[:, at:at + 2].contiguous().view(torch.float16).float()

    @staticmethod
    def f32(b, at):
        return b[:, at:at + 4].contiguous().view(torch.float32)

    @staticmethod
    def cat(arrays, axis):
        return torch.cat(arrays, dim=axis)

    @staticmethod
    def stack(arrays, axis):
        return torch.stack(arrays, dim=axis)

    @staticmethod
    def repeat(a, n, axis):
        return a.repeat_interleave(n, dim=axis)

    @staticmethod
    def where(cond, a, b):
        return torch.where(cond, a, b)


TORCH = Torch()
FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# the quantized types decoded here: every one with a reference decoder
DECODERS = tuple(q for q in QuantType if reference.can_decode(q))


def can_decode(qtype) -> bool:
    qtype = QuantType(qtype)
    return qtype in FLOATS or reference.can_decode(qtype)


def decode(b: torch.Tensor, qtype, n_per_row: int) -> torch.Tensor:
    """uint8 (n_rows, row_size) of ``qtype`` -> float32 (n_rows, n_per_row), on b's device."""
    qtype = QuantType(qtype)
    if qtype in FLOATS:
        return b.contiguous().view(FLOATS[qtype]).float().reshape(b.shape[0], n_per_row)
    return reference.decode(TORCH, b, qtype, n_per_row)
