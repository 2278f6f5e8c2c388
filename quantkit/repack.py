"""Offline repacking: plain tensors to ik_llama.cpp's row-interleaved CPU layouts and back.

No arithmetic: each tensor's bytes are regrouped (:mod:`quantkit.formats.interleave`), so the result
is exactly what ik's ``llama-quantize --repack`` (and its ``-rtr`` runtime repack) produces, and
``--undo`` restores the plain bytes bit for bit.

Which tensors are repacked follows ik's ``iqk_repacked_type``: a type with an interleaved variant,
not a token embedding, with a row count per matrix that is a multiple of the variant's row group,
and (with ``--pattern``) a name one of the regexes finds.  The file type becomes the repacked mix's
(``repacked_ftype``: Q4_K_M -> Q4_K_R4, IQ4_K -> IQ4_K_R4, ...).

The metadata is the input's, in its order (ik's ``gguf_set_val`` replaces a value where the key
stands), with only ``general.file_type`` changed, so that ``--undo`` can give back the input file
byte for byte.  Most repacked mixes come from one plain mix and undo derives it; Q3_K_S/M/L, Q4_K_S/M
and Q5_K_S/M share one repacked type each, so for those repack also records the input's file type
in ``quantkit.plain_file_type`` (appended; ik's loaders ignore keys they do not know), which undo
restores and removes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import QuantkitError
from .gguf_io.constants import KEY_FILE_TYPE, MetaValue, ValueType
from .plan import Plan, TensorPlan, TOKEN_EMBD_NAMES
from .presets import PRESETS
from .tensor_regex import compile_bounded
from .types import REPACKED_TYPE, QuantType, traits, type_name

T = QuantType

# REPACKED_TYPE (types.py): plain type -> its interleaved variant, as ik's get_repack_info maps them.
# BF16/F16 -> BF16_R16 only in AVX512-BF16 builds of ik_llama.cpp, so it is not done by default.
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
# the input's file type, where undo could not derive it from the repacked one (Q4_K_M -> Q4_K_R4)
KEY_PLAIN_FILE_TYPE = "quantkit.plain_file_type"
_INTEGER_TYPES = (ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
                  ValueType.INT32, ValueType.UINT64, ValueType.INT64)


@dataclass
class RepackOptions:
    patterns: tuple[str, ...] = ()      # only tensors one of these regexes finds (re.search)
    undo: bool = False                  # interleaved -> plain
    bf16: bool = False                  # also BF16/F16 -> BF16_R16 (ik does it only in AVX512-BF16 builds)


def _compile(patterns) -> list[re.Pattern]:
    return [compile_bounded(p, "--pattern") for p in patterns]


def file_type_of(metadata: dict[str, MetaValue]) -> int | None:
    """``general.file_type`` (None when absent); a value ik's loader would refuse is an error."""
    mv = metadata.get(KEY_FILE_TYPE)
    if mv is None:
        return None
    if mv.vtype not in _INTEGER_TYPES or not 0 <= mv.value < 2**32:
        raise QuantkitError(f"{KEY_FILE_TYPE} is not a file type: a {mv.vtype.name.lower()} "
                            f"{str(mv.value)[:40]!r}")
    return int(mv.value)


def _recorded_plain_type(metadata: dict[str, MetaValue], file_type: int | None) -> int | None:
    """The file type repack recorded, when this file's type is its repacked form (a key left over
    from another file is not trusted)."""
    mv = metadata.get(KEY_PLAIN_FILE_TYPE)
    if mv is None or mv.vtype != ValueType.UINT32 or file_type is None:
        return None
    return int(mv.value) if REPACKED_FTYPE.get(int(mv.value)) == file_type else None


def output_file_type(metadata: dict[str, MetaValue], undo: bool) -> int | None:
    """The file type of the output when any tensor moves: ik's ``repacked_ftype`` of the input's,
    or with undo the plain type recorded or, without a record, the first plain mix of it."""
    ftype = file_type_of(metadata)
    if ftype is None:
        return None
    if not undo:
        return REPACKED_FTYPE.get(ftype, ftype)
    recorded = _recorded_plain_type(metadata, ftype)
    return recorded if recorded is not None else UNDONE_FTYPE.get(ftype, ftype)


def repack_metadata(metadata: dict[str, MetaValue], plan: Plan, undo: bool) -> dict[str, MetaValue]:
    """The output's metadata: the input's keys in their order, ``general.file_type`` set in place
    (ik's ``llama-quantize --repack`` does so, and the input's other keys, provenance included,
    stay), plus or minus ``quantkit.plain_file_type``.  A file without a file type keeps none (ik
    would write a guessed one), and ``general.quantization_version`` stays what it was: repack
    changes no quantization."""
    meta = dict(metadata)
    ftype = file_type_of(metadata)
    if ftype is None or not any(t.repack for t in plan.tensors):
        return meta
    meta[KEY_FILE_TYPE] = MetaValue(ValueType.UINT32, plan.file_type)
    if undo:
        if _recorded_plain_type(metadata, ftype) == plan.file_type:
            del meta[KEY_PLAIN_FILE_TYPE]
    elif plan.file_type != ftype and UNDONE_FTYPE.get(plan.file_type) != ftype:
        meta[KEY_PLAIN_FILE_TYPE] = MetaValue(ValueType.UINT32, ftype)
    return meta


_REPACKED_FROM = frozenset(REPACKED_TYPE.values())


def make_repack_plan(tensors, metadata: dict[str, MetaValue], opts: RepackOptions, can_shuffle) -> Plan:
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
            if dst is not None and traits(src).quantized and (src not in _REPACKED_FROM or not traits(dst).in_files):
                # iq1_s_r4, iq1_m_r4 (blocks of their own), q8_k_r8 (its base is no file type)
                dst, why = None, f"ik quantizes {type_name(src)} on its own: it is no repack of {type_name(traits(src).base)}"
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
    ftype = output_file_type(metadata, opts.undo) if any(p.repack for p in plans) else file_type_of(metadata)
    return Plan(plans, None, ftype if ftype is not None else 0, "ik")
