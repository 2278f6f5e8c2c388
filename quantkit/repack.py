"""Offline repacking: plain tensors to ik_llama.cpp's row-interleaved CPU layouts and back.

No arithmetic: each tensor's bytes are regrouped (:mod:`quantkit.formats.interleave`), so the result
is exactly what ik's ``llama-quantize --repack`` (and its ``-rtr`` runtime repack) produces, and
``--undo`` restores the plain bytes bit for bit.

Which tensors are repacked follows ik's ``iqk_repacked_type``: a type with an interleaved variant,
not a token embedding, with a row count per matrix that is a multiple of the variant's row group,
and (with ``--pattern``) a name one of the regexes finds.  The file type becomes the repacked mix's
(``repacked_ftype``: Q4_K_M -> Q4_K_R4, IQ4_K -> IQ4_K_R4, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .plan import Plan, TensorPlan, TOKEN_EMBD_NAMES
from .presets import PRESETS
from .tensor_regex import compile_bounded
from .types import QuantType, traits, type_name

T = QuantType

# get_repack_info: plain type -> its interleaved variant (BF16/F16 -> BF16_R16 only in AVX512-BF16
# builds of ik_llama.cpp, so it is not done by default; MXFP4 -> MXFP4_R8 is left out: the wheel's
# ggml does not know that type)
REPACKED_TYPE: dict[QuantType, QuantType] = {
    T.IQ2_K: T.IQ2_K_R4, T.IQ3_K: T.IQ3_K_R4, T.IQ4_K: T.IQ4_K_R4, T.IQ5_K: T.IQ5_K_R4,
    T.IQ4_XS: T.IQ4_XS_R8, T.IQ4_KS: T.IQ4_KS_R4, T.IQ5_KS: T.IQ5_KS_R4, T.IQ4_NL: T.IQ4_NL_R4,
    T.IQ2_BN: T.IQ2_BN_R4, T.IQ2_XXS: T.IQ2_XXS_R4, T.IQ2_XS: T.IQ2_XS_R4, T.IQ2_S: T.IQ2_S_R4,
    T.IQ3_XXS: T.IQ3_XXS_R4, T.IQ3_S: T.IQ3_S_R4, T.Q2_K: T.Q2_K_R4, T.Q3_K: T.Q3_K_R4,
    T.Q4_K: T.Q4_K_R4, T.Q5_K: T.Q5_K_R4, T.Q6_K: T.Q6_K_R4, T.Q4_0: T.Q4_0_R8, T.Q5_0: T.Q5_0_R4,
    T.Q6_0: T.Q6_0_R4, T.Q8_0: T.Q8_0_R8, T.Q8_K: T.Q8_K_R8, T.Q8_KV: T.Q8_KV_R8,
}
BF16_REPACK = {T.BF16: T.BF16_R16, T.F16: T.BF16_R16}

# repacked_ftype: the mix a file becomes (names of PRESETS; ftype numbers are ik's)
_REPACKED_MIX = {
    "Q4_0": "Q4_0_R8", "Q8_0": "Q8_0_R8", "Q5_0": "Q5_0_R4", "Q2_K": "Q2_K_R4", "Q3_K_S": "Q3_K_R4",
    "Q3_K_M": "Q3_K_R4", "Q3_K_L": "Q3_K_R4", "Q4_K_S": "Q4_K_R4", "Q4_K_M": "Q4_K_R4", "Q5_K_S": "Q5_K_R4",
    "Q5_K_M": "Q5_K_R4", "Q6_K": "Q6_K_R4", "IQ2_XXS": "IQ2_XXS_R4", "IQ2_XS": "IQ2_XS_R4",
    "IQ3_XXS": "IQ3_XXS_R4", "IQ1_S": "IQ1_S_R4", "IQ4_NL": "IQ4_NL_R4", "IQ3_S": "IQ3_S_R4",
    "IQ2_M": "IQ2_M_R4", "IQ4_XS": "IQ4_XS_R8", "IQ1_M": "IQ1_M_R4", "Q6_0": "Q6_0_R4", "BF16": "BF16_R16",
    "IQ2_BN": "IQ2_BN_R4", "IQ2_K": "IQ2_K_R4", "IQ3_K": "IQ3_K_R4", "IQ4_K": "IQ4_K_R4", "IQ5_K": "IQ5_K_R4",
    "IQ4_KS": "IQ4_KS_R4", "IQ5_KS": "IQ5_KS_R4", "Q8_KV": "Q8_KV_R8",
}
REPACKED_FTYPE = {PRESETS[a].ftypes["ik"]: PRESETS[b].ftypes["ik"] for a, b in _REPACKED_MIX.items()}
# --undo: the plain mix of a repacked one (several mixes share one repacked ftype: take the first)
UNDONE_FTYPE: dict[int, int] = {}
for _plain, _packed in REPACKED_FTYPE.items():
    UNDONE_FTYPE.setdefault(_packed, _plain)


@dataclass
class RepackOptions:
    patterns: tuple[str, ...] = ()      # only tensors one of these regexes finds (re.search)
    undo: bool = False                  # interleaved -> plain
    bf16: bool = False                  # also BF16/F16 -> BF16_R16 (ik does it only in AVX512-BF16 builds)


def _compile(patterns) -> list[re.Pattern]:
    return [compile_bounded(p, "--pattern") for p in patterns]


def make_repack_plan(tensors, file_type: int | None, opts: RepackOptions, can_shuffle) -> Plan:
    """One TensorPlan per tensor: a byte shuffle to the interleaved (or, with undo, plain) layout, or
    a copy with the reason.  ``can_shuffle(qtype)`` says whether quantkit has the layout."""
    patterns = _compile(opts.patterns)
    table = {**REPACKED_TYPE, **(BF16_REPACK if opts.bf16 else {})}
    plans = []
    for t in tensors:
        name, shape, src = t.name, tuple(t.shape), QuantType(t.qtype)
        n_rows = shape[1] if len(shape) > 1 else 1
        if opts.undo:
            dst = traits(src).base if traits(src).interleave_rows > 1 else None
            why = None if dst is not None else "not an interleaved type"
        else:
            dst = table.get(src)
            why = None if dst is not None else "no interleaved variant"
            if dst is not None and name in TOKEN_EMBD_NAMES:
                dst, why = None, "token embeddings are never interleaved"
            elif dst is not None and n_rows % traits(dst).interleave_rows:
                dst, why = None, f"{n_rows} rows are not a multiple of {traits(dst).interleave_rows}"
        if dst is not None and patterns and not any(p.search(name) for p in patterns):
            dst, why = None, "no --pattern matches"
        packed = src if opts.undo else dst
        if dst is not None and not can_shuffle(packed):
            dst, why = None, f"the {type_name(packed)} layout is not implemented"
        if dst is None:
            plans.append(TensorPlan(name, shape, src, src, f"kept: {why}"))
        else:
            plans.append(TensorPlan(name, shape, src, dst, "undo" if opts.undo else "repack", repack=True))
    ftype = file_type
    if ftype is not None and any(p.repack for p in plans):
        ftype = (UNDONE_FTYPE if opts.undo else REPACKED_FTYPE).get(ftype, ftype)
    return Plan(plans, None, ftype if ftype is not None else 0, "ik")
