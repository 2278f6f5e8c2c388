"""The JSON files of a checkpoint (config.json, the safetensors index and headers, the tokenizer
files), read through typed getters.

Every value comes from an untrusted file. A getter returns the type it promises, within the bounds
it is given, or raises a QuantkitError naming the file, the key and what was expected: no wrong type
travels on to fail later as a TypeError, a ZeroDivisionError or a reshape. A ``null`` counts as
absent (transformers writes ``"q_lora_rank": null`` for "none").
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import QuantkitError
from ..inputs import read_bounded

MAX_JSON_BYTES = 256 << 20      # DeepSeek-V3's tokenizer.json is 7.5 MiB, its index 8.5 MiB
U32_MAX = 2**32 - 1             # the GGUF keys the dimensions go to are u32
_REQUIRED = object()


def load_json(path: Path, what: str = "a JSON file"):
    """The parsed contents of a JSON file (any value); errors say what is wrong, not what is there."""
    data = read_bounded(path, MAX_JSON_BYTES, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    return parse_json(text, path)


def parse_json(text: str | bytes, where, object_pairs_hook=None) -> object:
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise QuantkitError(f"{where}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:       # its message gives the position, not the text
        raise QuantkitError(f"{where}: not valid JSON ({e})") from None
    except ValueError:                      # Python's limit on the digits of an integer
        raise QuantkitError(f"{where}: not valid JSON (a number with more than 4300 digits)") from None


def describe(value) -> str:
    """A short rendering of an unexpected value for an error message: the value itself when short
    (JSON, so that strings show their quotes and escapes), else only its kind."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", float: "a number",
            int: "an integer"}.get(type(value), type(value).__name__)
    if isinstance(value, (list, dict)) and len(value) > 8:
        return kind
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return kind
    return kind if len(text) > 40 else f"{text} ({kind})"


class Fields:
    """A JSON object read through typed getters. Errors name the file (``where``) and the key, with
    the keys leading to this object as ``prefix`` (``rope_scaling.``, ``added_tokens[3].``)."""

    def __init__(self, raw: dict, where: str, prefix: str = ""):
        self.raw, self.where, self.prefix = raw, where, prefix

    @classmethod
    def load(cls, path: Path, what: str = "a JSON file") -> "Fields":
        raw = load_json(path, what)
        if not isinstance(raw, dict):
            raise QuantkitError(f"{path}: not a JSON object (found {describe(raw)})")
        return cls(raw, str(path))

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def fail(self, key: str, expected: str):
        value = self.raw.get(key)
        found = "missing" if value is None else describe(value)
        raise QuantkitError(f"{self.where}: '{self.prefix}{key}' is {found}, expected {expected}")

    def _value(self, key: str, default, expected: str):
        value = self.raw.get(key)
        if value is None and default is _REQUIRED:
            self.fail(key, expected)
        return value

    def integer(self, key: str, default=_REQUIRED, *, low: int = 0, high: int = U32_MAX) -> int:
        expected = f"an integer from {low} to {high}"
        value = self._value(key, default, expected)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(key, expected)
        return value

    def dim(self, key: str, default=_REQUIRED) -> int:
        """A size or a count that must be at least 1 (heads, layers, widths, vocabulary)."""
        return self.integer(key, default, low=1)

    def number(self, key: str, default=_REQUIRED, *, low: float = -math.inf, high: float = math.inf,
               positive: bool = False) -> float:
        expected = ("a positive number" if positive else "a number") + (
            f" from {low:g} to {high:g}" if math.isfinite(low) and math.isfinite(high) else
            f" of at least {low:g}" if math.isfinite(low) else f" of at most {high:g}" if math.isfinite(high) else "")
        value = self._value(key, default, expected)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, expected)
        try:
            value = float(value)
        except OverflowError:       # an integer past the float range
            self.fail(key, expected)
        if not (math.isfinite(value) and low <= value <= high) or (positive and value <= 0):
            self.fail(key, expected)
        return value

    def _of_type(self, key: str, default, kind: type, expected: str):
        value = self._value(key, default, expected)
        if value is None:
            return default
        if not isinstance(value, kind):
            self.fail(key, expected)
        return value

    def boolean(self, key: str, default=_REQUIRED) -> bool:
        return self._of_type(key, default, bool, "true or false")

    def string(self, key: str, default=_REQUIRED) -> str:
        return self._of_type(key, default, str, "a string")

    def object(self, key: str) -> "Fields":
        """A nested object (an empty one when absent)."""
        value = self.raw.get(key)
        if value is None:
            value = {}
        elif not isinstance(value, dict):
            self.fail(key, "an object")
        return Fields(value, self.where, f"{self.prefix}{key}.")

    def array(self, key: str, default=_REQUIRED) -> list:
        return self._of_type(key, default, list, "a list")

    def objects(self, key: str) -> list["Fields"]:
        """A list of objects (empty when absent), each read through its own getters."""
        items = self.array(key, [])
        if not all(isinstance(item, dict) for item in items):
            self.fail(key, "a list of objects")
        return [Fields(item, self.where, f"{self.prefix}{key}[{i}].") for i, item in enumerate(items)]


class Config(Fields):
    """config.json."""

    def __init__(self, path: Path):
        if not path.exists() and not path.is_symlink():
            raise QuantkitError(f"{path.parent}: no config.json (not a Hugging Face model directory)")
        super().__init__(Fields.load(path, "a config.json").raw, str(path))
        self.path = path

    @property
    def architecture(self) -> str:
        archs = self.raw.get("architectures")
        if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
            self.fail("architectures", 'a list of model class names (["LlamaForCausalLM"])')
        return archs[0]

    # rope settings: config.json of transformers < 5 writes rope_theta and rope_scaling; 5.x writes
    # both into rope_parameters
    @property
    def rope_scaling(self) -> Fields:
        return self.object("rope_scaling" if self.raw.get("rope_scaling") else "rope_parameters")

    @property
    def rope_type(self) -> str:
        rope = self.rope_scaling
        return rope.string("rope_type" if rope.has("rope_type") else "type", "default").lower()

    @property
    def rope_theta(self) -> float:
        if self.has("rope_theta"):
            return self.number("rope_theta", positive=True)
        return self.rope_scaling.number("rope_theta", 10000.0, positive=True)

