"""config.json, read with the errors a user can act on."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import QuantkitError


class Config:
    def __init__(self, path: Path):
        self.path = path
        try:
            self.raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise QuantkitError(f"{path.parent}: no config.json (not a Hugging Face model directory)") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise QuantkitError(f"{path}: cannot read it as JSON ({e})") from None
        if not isinstance(self.raw, dict):
            raise QuantkitError(f"{path}: not a JSON object")

    @property
    def architecture(self) -> str:
        archs = self.raw.get("architectures") or []
        if not archs:
            raise QuantkitError(f"{self.path}: no 'architectures' entry")
        return archs[0]

    def get(self, key: str, default=None):
        v = self.raw.get(key)
        return default if v is None else v

    def need(self, key: str):
        v = self.raw.get(key)
        if v is None:
            raise QuantkitError(f"{self.path}: '{key}' is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise QuantkitError(f"{self.path}: '{key}' is {v!r}, expected a non-negative number")
        return v

    # rope settings: config.json of transformers < 5 writes rope_theta and rope_scaling; 5.x writes
    # both into rope_parameters
    @property
    def rope_scaling(self) -> dict:
        rope = self.raw.get("rope_scaling") or self.raw.get("rope_parameters") or {}
        return rope if isinstance(rope, dict) else {}

    @property
    def rope_type(self) -> str:
        rope = self.rope_scaling
        return str(rope.get("rope_type") or rope.get("type") or "default").lower()

    @property
    def rope_theta(self) -> float:
        theta = self.raw.get("rope_theta") or self.rope_scaling.get("rope_theta") or 10000.0
        return float(theta)
