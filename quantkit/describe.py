"""A plain description of a GGUF model (metadata, tensors, totals per type) for `quantkit inspect`.

Each metadata entry is ``{"key", "type", "value"}`` with the value in its own JSON type (30, false,
a float32 as the value stored, a string whole); an array entry also has ``"length"`` (its item
count) and ``"truncated"``: its ``"value"`` holds the first ``JSON_ARRAY_ITEMS`` items (of each
array, in a nested one), and ``"truncated"`` says whether any were left out."""
from __future__ import annotations

from collections import defaultdict

from .gguf_io.constants import MetaValue, ValueType
from .gguf_io.reader import GGUFModel
from .types import type_name

_PREVIEW = 8                # items of an array shown in the table
_ITEM_CHARS = 200           # of each string item shown there: a preview, not the data
JSON_ARRAY_ITEMS = 1024     # items of an array in the JSON (a per-layer array is whole, a vocabulary cut)


def json_value(mv: MetaValue, limit: int = JSON_ARRAY_ITEMS) -> tuple[object, bool]:
    """A metadata value as JSON types (ints, floats, booleans, strings, lists) and whether an array
    in it (at any depth) was cut to its first ``limit`` items.  Strings are whole."""
    if mv.vtype != ValueType.ARRAY:
        return mv.value, False
    items = mv.value[:limit]
    cut = len(mv.value) > limit
    if mv.elem_type == ValueType.ARRAY:
        inner = [json_value(x, limit) for x in items]
        return [v for v, _ in inner], cut or any(c for _, c in inner)
    return (list(items) if mv.elem_type == ValueType.STRING else items.tolist()), cut


def _type_text(mv: MetaValue) -> str:
    if mv.vtype == ValueType.ARRAY:
        return f"array[{mv.elem_type.name.lower()}]"
    return mv.vtype.name.lower()


def _item_text(x) -> str:
    if isinstance(x, str) and len(x) > _ITEM_CHARS:
        return f"{x[:_ITEM_CHARS]!r}… ({len(x):,} characters)"
    return repr(x)


def value_text(entry: dict) -> str:
    """A metadata entry of :func:`describe` as the table shows it: a scalar whole (the table cuts
    long ones), an array as its first items and its length."""
    value = entry["value"]
    if "length" not in entry:
        return str(value)
    more = f", … ({entry['length']} items)" if entry["length"] > _PREVIEW else ""
    return "[" + ", ".join(_item_text(x) for x in value[:_PREVIEW]) + more + "]"


def describe(model: GGUFModel) -> dict:
    meta = []
    for f in model.files[:1]:
        for key, mv in f.metadata.items():
            value, cut = json_value(mv)
            entry = {"key": key, "type": _type_text(mv), "value": value}
            if mv.vtype == ValueType.ARRAY:
                entry.update(length=len(mv.value), truncated=cut)
            meta.append(entry)
    tensors, acc = [], defaultdict(lambda: [0, 0, 0])
    for t in model.tensors:
        tensors.append({"name": t.name, "shape": list(t.shape), "type": type_name(t.qtype),
                        "bytes": t.nbytes, "offset": t.offset, "file": t.source.path.name})
        a = acc[type_name(t.qtype)]
        a[0] += 1
        a[1] += t.n_elements
        a[2] += t.nbytes
    by_type = sorted(({"type": k, "tensors": n, "elements": e, "bytes": b, "bpw": 8 * b / e if e else 0.0}
                      for k, (n, e, b) in acc.items()), key=lambda r: -r["bytes"])
    n_el = sum(t.n_elements for t in model.tensors)
    n_b = sum(t.nbytes for t in model.tensors)
    return {"path": str(model.path), "shards": model.n_shards, "version": model.files[0].version,
            "alignment": model.files[0].alignment, "metadata": meta, "tensors": tensors,
            "by_type": by_type,
            "totals": {"tensors": len(tensors), "elements": n_el, "bytes": n_b,
                       "bpw": 8 * n_b / n_el if n_el else 0.0}}
