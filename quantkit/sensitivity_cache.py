"""The on-disk cache of sensitivity results (quantkit.sensitivity): one JSON object a line.

A line holds what a result was computed from and the result::

    {"fp": MODEL FINGERPRINT, "mode": "fast"|"measured", "settings": {...}, "key": GROUP KEY,
     "types": {TENSOR: TYPE, ...}, "value": FLOAT}

Lines are appended and flushed one result at a time, so a search that is interrupted, or run again
with more types, budgets or measured samples, finds what was done and computes only the rest.  A
line that is not such an object (a write cut short, an edit) is skipped: it only costs its result
again.  The fingerprint says which model a line belongs to, so one cache can serve many models.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from .errors import QuantkitError
from .inputs import open_regular
from .types import type_name

SAMPLE_BYTES = 256          # of each tensor's data, at its start and at its end, in the fingerprint
WHOLE_FILE_HASH = 64 << 20  # files up to this size are hashed whole by file_fingerprint


def _hash_value(h, value) -> None:
    h.update(json.dumps(value, sort_keys=True, default=repr, ensure_ascii=True).encode())


def fingerprint(model) -> str:
    """A digest of a model (an open GGUF model or HF checkpoint: ``metadata``, ``tensors``) that
    is the same for the same content and changes with it: every metadata key and value, the tensor
    table (name, shape, type, size) and the first and last bytes of every tensor's data.  Reading
    those bytes costs one small read per tensor, so a 671B model is fingerprinted in seconds."""
    h = hashlib.sha256(b"quantkit-model-1\0")
    for key, mv in model.metadata.items():
        _hash_value(h, [key, int(mv.vtype), mv.to_python()])
    for t in model.tensors:
        _hash_value(h, [t.name, list(t.shape), int(t.qtype), int(t.nbytes)])
        n = min(SAMPLE_BYTES, t.nbytes)
        if n:
            h.update(t.source.view(t.offset, n).tobytes())
            h.update(t.source.view(t.offset + t.nbytes - n, n).tobytes())
    return h.hexdigest()[:32]


def file_fingerprint(path, what: str | None = None) -> str:
    """A digest of a file's content (an imatrix, a calibration text): the whole file up to
    ``WHOLE_FILE_HASH`` bytes, else its size and its first, middle and last MiB.  ``what`` names
    the file in errors ("--imatrix")."""
    path = Path(path)
    h = hashlib.sha256(b"quantkit-file-1\0")
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode() + b"\0")
        try:
            if size <= WHOLE_FILE_HASH:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                for at in (0, size // 2, size - (1 << 20)):
                    f.seek(at)
                    h.update(f.read(1 << 20))
        except OSError as e:
            raise QuantkitError(f"{path}: {e.strerror}") from None
    return h.hexdigest()[:32]


def _entry_key(fp: str, mode: str, settings: dict, key: str, types: dict) -> str:
    return json.dumps([fp, mode, settings, key, {k: str(v) for k, v in types.items()}],
                      sort_keys=True, ensure_ascii=True)


class SensitivityCache:
    """Results by (model fingerprint, mode, settings, group key, per-tensor types), kept in the
    JSON-lines file ``path`` (created with its directory on the first put).  ``types`` values are
    type names (strings) or QuantTypes (stored by name)."""

    def __init__(self, path):
        self.path = Path(path)
        self._values: dict[str, float] = {}
        self._fh = None
        self.skipped = 0                # lines that were not results (corrupt, cut short)
        if os.path.lexists(self.path):
            self._load()

    def _load(self) -> None:
        with open_regular(self.path, "the sensitivity cache") as f:
            try:
                data = f.read()
            except OSError as e:
                raise QuantkitError(f"{self.path}: {e.strerror}") from None
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                k = _entry_key(doc["fp"], doc["mode"], doc["settings"], doc["key"], doc["types"])
                value = doc["value"]
                if not (isinstance(doc["fp"], str) and isinstance(doc["key"], str) and isinstance(doc["types"], dict)
                        and all(isinstance(v, str) for v in doc["types"].values())
                        and isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isfinite(value)):
                    raise ValueError
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                self.skipped += 1
                continue
            self._values[k] = float(value)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, fp: str, mode: str, settings: dict, key: str, types: dict) -> float | None:
        return self._values.get(_entry_key(fp, mode, settings, key, _names(types)))

    def put(self, fp: str, mode: str, settings: dict, key: str, types: dict, value: float) -> None:
        """Record one result and flush it to the file at once."""
        value = float(value)
        if not math.isfinite(value):
            raise QuantkitError(f"sensitivity of {key}: {value} is not a finite number")
        types = _names(types)
        self._values[_entry_key(fp, mode, settings, key, types)] = value
        line = json.dumps({"fp": fp, "mode": mode, "settings": settings, "key": key, "types": types,
                           "value": value}, sort_keys=True, ensure_ascii=True)
        try:
            if self._fh is None:
                self._open_for_append()
            self._fh.write(line + "\n")
            self._fh.flush()
        except OSError as e:
            raise QuantkitError(f"{self.path}: {e.strerror}") from None

    def _open_for_append(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(self.path):
            open_regular(self.path, "the sensitivity cache").close()   # a FIFO or device: refused
        self._fh = open(self.path, "a", encoding="ascii")
        # a line cut short by an interrupt is not glued to the next result
        if self._fh.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._fh.write("\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _names(types: dict) -> dict[str, str]:
    return {name: t if isinstance(t, str) else type_name(t) for name, t in types.items()}
