"""Named mixes beside llama-quantize's presets: TYPE names for the recipes of published quants that
no C tool has as an ftype.

``Q4_X`` is the "full quality" Kimi-K2 quant (ubergarm's Kimi-K2-Thinking/2.5/2.6 ``Q4_X``, made with
jukofyork's q4_0 patch, llama.cpp PR #17064): routed experts q4_0, every other weight q8_0. Kimi's
routed experts are int4 (compressed-tensors, groups of 32 with one scale: what a q4_0 block holds),
so from the checkpoint itself quantkit copies each group into its q4_0 block bit for bit
(hf/compressed_tensors.py): the file holds Moonshot's own weights. The patch got there from a BF16
GGUF with ``d = max / -7``, which recovers a group only where its largest code is +-7; from any
input that is not the int4 checkpoint quantkit's q4_0 is llama.cpp's ordinary quantizer, and the
run says so. The file type written is the base type's (Q8_0).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .types import QuantType, type_name

log = logging.getLogger("quantkit")


@dataclass(frozen=True)
class NamedMix:
    name: str
    base: str           # the TYPE every tensor no rule names gets (its ftype is the file's)
    rules: str          # --custom-q rules, tried before the base
    exact: tuple        # (regex searched in a tensor name, type) that the input should hold exactly


Q4_X = NamedMix("Q4_X", "Q8_0", "\n".join([
    r"blk\..*\.ffn_(gate|up|down)_exps\.weight=q4_0",        # routed experts: the int4 groups
    r"blk\..*\.ffn_(gate|up|down)_shexp\.weight=q8_0",       # shared experts
    r"blk\..*\.ffn_(gate|up|down)\.weight=q8_0",             # the dense lead layer
    r"blk\..*\.attn_.*=q8_0",                                 # attention
    r"token_embd\.weight=q8_0",
    r"^output\.weight$=q8_0",
]), ((r"_exps\.weight$", QuantType.Q4_0),))

MIXES = {m.name: m for m in (Q4_X,)}


def find_mix(text: str | None) -> NamedMix | None:
    """The named mix a TYPE argument names (case-insensitive), or None."""
    return MIXES.get(text.strip().upper()) if isinstance(text, str) else None


def note_exact_copies(mix: NamedMix | None, plan, model) -> None:
    """Mark in ``plan`` the tensors whose blocks the input holds exactly (copied, not quantized:
    hf.lazy.LazySource.exact_types); for ``mix``, warn where a tensor it wants copied is not."""
    import re
    lossy = []
    for tp in plan.tensors:
        exact = getattr(model.by_name[tp.input_name].source, "exact_types", frozenset())
        if tp.action == "quantize" and tp.dst_type in exact:
            tp.notes.append("the checkpoint's int4 groups copied (lossless)")
        elif mix is not None and tp.action != "copy" and any(
                re.search(p, tp.name) and tp.dst_type == t for p, t in mix.exact):
            lossy.append(tp)
    if lossy:
        tp = lossy[0]
        log.warning(f"{mix.name}: {tp.name}{f' and {len(lossy) - 1} more' if len(lossy) > 1 else ''} are "
                    f"{type_name(tp.src_type)} in the input, not compressed-tensors int4: quantized to "
                    f"{type_name(tp.dst_type)} by llama.cpp's quantizer (with its loss), not copied")
