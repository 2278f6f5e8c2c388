"""What exists: every ggml type a file can hold and every preset of both flavors, with its size,
the flavors quantkit writes it in, and which runtimes load it (``quantkit types``).

Nothing here is a second table: sizes and loaders come from types.py, presets from presets.py,
what quantkit quantizes from the format registry, what its runtime computes with from
runtime.weights.
"""
from __future__ import annotations

from . import formats
from .presets import ALIASES, FLAVORS, PRESETS
from .runtime.weights import computes_with
from .types import PROJECTS, file_types, traits, type_name


def _writes(qtype, flavors) -> list[str]:
    """The flavors quantkit quantizes ``qtype`` in: where it has the quantizer and the flavor's
    llama.cpp loads the type (quantize refuses the others)."""
    t = traits(qtype)
    return [f for f in flavors if f in t.loads
            and (formats.can_quantize(qtype, f, False) or formats.can_quantize(qtype, f, True))]


def _loaded_by(qtype) -> dict[str, bool]:
    return {PROJECTS[f]: f in traits(qtype).loads for f in ("mainline", "ik")}


def type_rows() -> list[dict]:
    return [{"name": t.name, "id": int(t.qtype), "bits_per_weight": t.bits_per_weight, "block_size": t.block_size,
             "type_size": t.type_size, "row_meta_size": t.row_meta_size, "interleave_rows": t.interleave_rows,
             "quantkit_writes": _writes(t.qtype, FLAVORS), "loaded_by": _loaded_by(t.qtype),
             "quantkit_runs": computes_with(t.qtype)}
            for t in file_types()]


def preset_rows() -> list[dict]:
    """Each preset with the ftype it writes in each flavor that has it; size is that of its default
    type (a mix gives some tensors more bits).  llama.cpp loads a preset mainline has, written with
    --flavor mainline (its mix picks only mainline types; ik's mixes of the low-bit presets give
    some tensors ik-only types such as iq4_k, so only --flavor mainline promises that); ik_llama.cpp
    loads every preset whose default type it defines."""
    rows = []
    for p in PRESETS.values():
        t = traits(p.default_type)
        flavors = [f for f in FLAVORS if f in p.ftypes]
        rows.append({"name": p.name, "ftype": {f: p.ftypes[f] for f in flavors}, "default_type": type_name(t.qtype),
                     "bits_per_weight": t.bits_per_weight, "block_size": t.block_size,
                     "quantkit_writes": _writes(t.qtype, flavors),
                     "loaded_by": {PROJECTS["mainline"]: "mainline" in p.ftypes and "mainline" in t.loads,
                                   PROJECTS["ik"]: "ik" in t.loads},
                     "quantkit_runs": computes_with(t.qtype)})
    return rows


def catalog() -> dict:
    return {"types": type_rows(), "presets": preset_rows(), "aliases": dict(ALIASES)}
