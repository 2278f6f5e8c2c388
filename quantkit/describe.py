"""A plain description of a GGUF model (metadata, tensors, totals per type) for `quantkit inspect`."""
from __future__ import annotations

from collections import defaultdict

from .gguf_io.constants import ValueType
from .gguf_io.reader import GGUFModel
from .types import type_name

_PREVIEW = 8            # items of an array shown
_ITEM_CHARS = 200       # of each string item shown: a preview, not the data


def _item_text(x) -> str:
    if isinstance(x, str) and len(x) > _ITEM_CHARS:
        return f"{x[:_ITEM_CHARS]!r}… ({len(x):,} characters)"
    return repr(x)


def _value_text(mv) -> str:
    """A scalar whole (a chat template: the JSON output keeps it); an array as its first items."""
    if mv.vtype != ValueType.ARRAY:
        return str(mv.value)
    items = list(mv.value[:_PREVIEW]) if mv.elem_type == ValueType.STRING else mv.value[:_PREVIEW].tolist()
    more = f", … ({len(mv.value)} items)" if len(mv.value) > _PREVIEW else ""
    return "[" + ", ".join(_item_text(x) for x in items) + more + "]"


def describe(model: GGUFModel) -> dict:
    meta = []
    for f in model.files[:1]:
        for key, mv in f.metadata.items():
            vtype = mv.vtype.name.lower()
            if mv.vtype == ValueType.ARRAY:
                vtype = f"array[{mv.elem_type.name.lower()}]"
            meta.append({"key": key, "type": vtype, "value": _value_text(mv)})
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
