"""``--override-kv KEY=TYPE:VALUE``: metadata values set in the output file, as llama-quantize does.

The syntax is common.cpp's ``string_parse_kv_override``: the key ends at the first ``=`` and has at
most 127 bytes; TYPE is ``int``, ``float``, ``bool`` or ``str``; a ``bool`` is exactly ``true`` or
``false``; a ``str`` has at most 127 bytes.  Where the C parser reads a number with atol/atof (so
``int:12abc`` is 12 and ``int:abc`` is 0), quantkit wants the whole value to be a number.

What is written follows the flavor, as each tool's llama_model_quantize_impl does, for a key the
input does not have:

* ik: ``int`` as INT32, ``float`` as FLOAT32; an existing key keeps its place in the metadata
  (ik's gguf_set_val replaces a key in place);
* mainline: ``int`` as UINT32 (llama.cpp PR 14182; mainline writes the absolute value, quantkit
  refuses a negative one), ``float`` as FLOAT32; the key moves to the end (gguf.cpp removes it and
  appends it).

A key the input has keeps its GGUF type (an override of the u32 ``llama.context_length`` stays a
u32, range-checked): the C loaders refuse a key stored with another type than the one they read
("key ... has wrong type"), so ik's i32 for a u32 key would give a file ik itself cannot load.

The C tools also load the input model with the overrides, so an overridden hyper-parameter (say
``llama.expert_count``) changes the preset mix: :func:`overridden_getter` gives the mix that view.
Their loader refuses an override whose type differs from the key's; so does :func:`resolve`
(an integer key takes ``int``, a float key ``float``, and so on).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .errors import QuantkitError
from .gguf_io.constants import SPLIT_KEYS, MetaValue, ValueType

MAX_KEY_BYTES = 127             # llama_model_kv_override.key is char[128]
MAX_STR_BYTES = 127             # and val_str char[128]
KINDS = ("int", "float", "bool", "str")
_KEY_RE = re.compile(r"^[\x21-\x7e]+$")        # printable ASCII, no spaces: GGUF keys are ASCII
_INT_RE = re.compile(r"^[+-]?[0-9]+$")
_F32_MAX = float(np.finfo(np.float32).max)

_INT_TYPES = {ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
              ValueType.INT32, ValueType.UINT64, ValueType.INT64}
_KIND_OF = {**{t: "int" for t in _INT_TYPES}, ValueType.FLOAT32: "float", ValueType.FLOAT64: "float",
            ValueType.BOOL: "bool", ValueType.STRING: "str"}


_INT_RANGE = {ValueType.UINT8: (0, 2 ** 8), ValueType.INT8: (-2 ** 7, 2 ** 7), ValueType.UINT16: (0, 2 ** 16),
              ValueType.INT16: (-2 ** 15, 2 ** 15), ValueType.UINT32: (0, 2 ** 32),
              ValueType.INT32: (-2 ** 31, 2 ** 31), ValueType.UINT64: (0, 2 ** 64),
              ValueType.INT64: (-2 ** 63, 2 ** 63)}


@dataclass(frozen=True)
class KVOverride:
    key: str
    kind: str           # int, float, bool, str
    value: object       # int, float, bool or str
    text: str           # as given, for messages


def _error(text: str, why: str) -> QuantkitError:
    shown = text if len(text) <= 200 else f"{text[:200]}… ({len(text)} characters)"
    return QuantkitError(f"--override-kv '{shown}': {why}")


def _utf8_len(text: str, original: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise _error(original, "not valid UTF-8") from None


def parse_kv_override(text: str) -> KVOverride:
    """One ``KEY=TYPE:VALUE`` argument, checked; a QuantkitError says what is wrong."""
    key, sep, rest = text.partition("=")
    if not sep:
        raise _error(text, "expected KEY=TYPE:VALUE (TYPE one of int, float, bool, str), as in "
                           "general.name=str:My model")
    if not key:
        raise _error(text, "the key is empty")
    if _utf8_len(key, text) > MAX_KEY_BYTES:
        raise _error(text, f"the key has more than {MAX_KEY_BYTES} bytes")
    if not _KEY_RE.match(key):
        raise _error(text, "a key is printable ASCII without spaces (GGUF keys such as general.name)")
    if key in SPLIT_KEYS or key.startswith("quantkit."):
        raise _error(text, f"'{key}' is written by quantkit itself (split shards, how the file was made)")
    kind, colon, value = rest.partition(":")
    if not colon or kind not in KINDS:
        raise _error(text, "TYPE must be int, float, bool or str, followed by ':' and the value")
    if kind == "int":
        if not _INT_RE.match(value):
            raise _error(text, f"'{value}' is not an integer")
        number = int(value)
        if not -2 ** 63 <= number < 2 ** 63:       # atol's range
            raise _error(text, f"{value} is outside the 64-bit range")
        return KVOverride(key, kind, number, text)
    if kind == "float":
        try:
            number = float(value)
        except ValueError:
            raise _error(text, f"'{value}' is not a number") from None
        if not math.isfinite(number) or abs(number) > _F32_MAX:
            raise _error(text, f"'{value}' is not a finite float32 value")
        return KVOverride(key, kind, number, text)
    if kind == "bool":
        if value not in ("true", "false"):
            raise _error(text, "a bool is true or false")
        return KVOverride(key, kind, value == "true", text)
    if _utf8_len(value, text) > MAX_STR_BYTES:
        raise _error(text, f"a str value has at most {MAX_STR_BYTES} bytes")
    return KVOverride(key, kind, value, text)


def parse_kv_overrides(texts) -> list[KVOverride]:
    """Every ``--override-kv`` value, in order."""
    return [parse_kv_override(t) for t in texts]


def _value_for(o: KVOverride, existing: MetaValue | None, flavor: str) -> MetaValue:
    if existing is not None:
        kind = "array" if existing.vtype == ValueType.ARRAY else _KIND_OF.get(existing.vtype)
        if kind != o.kind:
            article = "an" if kind in ("int", "array") else "a"
            raise _error(o.text, f"the input's {o.key} is {article} {kind} ({existing.vtype.name.lower()}), "
                                 f"not {o.kind}")
        vtype = existing.vtype
    elif o.kind == "int":
        vtype = ValueType.UINT32 if flavor == "mainline" else ValueType.INT32
    else:
        vtype = {"float": ValueType.FLOAT32, "bool": ValueType.BOOL, "str": ValueType.STRING}[o.kind]
    if vtype in _INT_RANGE:
        lo, hi = _INT_RANGE[vtype]
        if not lo <= o.value < hi:
            why = "llama.cpp writes a new int key as u32" if existing is None and flavor == "mainline" else \
                "ik_llama.cpp writes a new int key as i32" if existing is None else f"the input's {o.key} is one"
            raise _error(o.text, f"{o.value} does not fit a {vtype.name.lower()} ({why})")
    return MetaValue(vtype, o.value)


def resolve(overrides: list[KVOverride], metadata: dict[str, MetaValue],
            flavor: str) -> list[tuple[str, MetaValue]]:
    """(key, the value written) of each override, in order, checked against the input's
    ``metadata`` (see the module doc)."""
    return [(o.key, _value_for(o, metadata.get(o.key), flavor)) for o in overrides]


def apply_overrides(metadata: dict[str, MetaValue], values: list[tuple[str, MetaValue]],
                    flavor: str) -> dict[str, MetaValue]:
    """``metadata`` with the values of :func:`resolve` written the flavor's way, in order (a key
    given twice: the last one wins, as in C): in place (ik) or moved to the end (mainline)."""
    out = dict(metadata)
    for key, mv in values:
        if flavor == "mainline":
            out.pop(key, None)
        out[key] = mv
    return out


def overridden_getter(get, overrides: list[KVOverride]):
    """``get(key, default)`` of the model as the C loader sees it with the overrides."""
    values = {o.key: o.value for o in overrides}

    def overridden(key, default=None):
        return values[key] if key in values else get(key, default)
    return overridden
