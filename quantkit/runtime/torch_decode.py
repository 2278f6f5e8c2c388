"""Block decoders in torch: stored bytes on the device -> float32 rows on the device.

The torch backend (``ops_torch``) keeps weights in their quantized layout and decodes a tile of
rows right before each product, on whatever device the bytes live (CUDA, or the CPU in tests).
The decoder is the reference one (formats/decode.py, written once for numpy and torch, from the
types' block layouts in quantkit/layouts.py) run through ``TORCH``, its array namespace in
torch; its values equal the numba decoders' bit for bit, which the tests check type by type.

Interleaved types have no decoder here by design: they stay on the CPU (numba), as ik_llama.cpp
keeps them there.
"""
from __future__ import annotations

import torch

from ..formats import decode as reference
from ..types import QuantType

T = QuantType

TORCH = reference.ArrayNamespace(
    ints=lambda a: a.int(), floats=lambda a: a.float(),
    as_f16=lambda b: b.contiguous().view(torch.float16), as_f32=lambda b: b.contiguous().view(torch.float32),
    cat=torch.cat, stack=torch.stack, repeat=torch.repeat_interleave, where=torch.where,
    device=lambda a: str(a.device), to_device=lambda a, like: torch.from_numpy(a).to(like.device))
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
