"""Every type with a fused Triton decoder: the family modules' DECODERS, merged."""
from __future__ import annotations

from ...types import QuantType
from . import iqk, iquants, kquants, legacy
from .decoders import Decoder

DECODERS: dict[QuantType, Decoder] = {**legacy.DECODERS, **kquants.DECODERS, **iqk.DECODERS, **iquants.DECODERS}
