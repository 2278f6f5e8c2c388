"""The per-type facts other modules read from types.py stay in step with its rows (issue 24 item 1).

types.py's rows say, for each type: its interleaved base (``base``), the type a row length the block
does not divide falls back to (``row_fallback``), and mainline's activation type (``vec_dot_type``).
repack.py, plan.py, runtime/activations.py, formats/interleave.py and formats/repacked.py derive
their tables from those; these tests fail when a row is added or changed in a way those derivations
cannot follow (a wrapper whose base cannot be quantized or has another block, a 256-block type
without a fallback, a type quantkit writes for mainline without a vec-dot type).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from quantkit import formats
from quantkit.formats import interleave
from quantkit.formats.repacked import WRAPPERS
from quantkit.plan import PlanOptions, make_plan
from quantkit.repack import BF16_REPACK
from quantkit.runtime.activations import VEC_DOT_TYPE
from quantkit.types import PROJECTS, QK_K, REPACKED_TYPE, TYPE_TRAITS, QuantType, loads, traits

T = QuantType

# Interleaved types ik_llama.cpp quantizes on their own rather than by repacking base rows (their
# blocks are 32 values with a row scale, their bases' 256): ik's get_repack_info has no entry for them.
QUANTIZED_ON_THEIR_OWN = {T.IQ1_S_R4, T.IQ1_M_R4}
# 256-blocks without a row fallback: q8_k_r16 is in neither change_type_if_necessary nor
# tensor_type_fallback (a runtime layout of ik's: f16 it is, as for every type without one).
NO_ROW_FALLBACK = {T.Q8_K_R16}
# The activation roundings runtime/activations.py implements (its kernels and block sizes).
ROUNDED_ACTIVATIONS = {T.Q8_0: 32, T.Q8_1: 32, T.Q8_K: QK_K}


def _interleaved():
    return [t for t in TYPE_TRAITS.values() if t.interleave_rows > 1]


# ---- base / repacked ----

@pytest.mark.parametrize("qtype", sorted(set(WRAPPERS) | set(interleave.LAYOUTS)), ids=lambda q: traits(q).name)
def test_interleaved_formats_regroup_a_quantizable_base_of_the_same_rows(qtype):
    """A wrapper quantizes base rows and regroups their bytes: the base must be registered with ik's
    quantizer and decoder, and its rows must be the interleaved type's byte for byte."""
    t = traits(qtype)
    base = formats.registered().get(t.base)
    assert base is not None, f"{t.name}: base {t.base!r} has no format"
    assert {("ik", False), ("ik", True)} <= (base.wrapped_paths or base.quant_paths) and formats.can_dequantize(t.base)
    assert base.traits.block_size == t.block_size and base.traits.row_meta_size == t.row_meta_size
    for n in (QK_K, 4 * QK_K):
        assert base.traits.row_size(n) == t.row_size(n)
    lay = interleave.LAYOUTS.get(qtype)
    if lay is not None:
        assert lay.rows == t.interleave_rows and lay.block_values % t.block_size == 0
    assert qtype in formats.registered(), f"{t.name}: has a wrapper and a layout but was not registered"


def test_repacked_type_is_the_inverse_of_base():
    assert REPACKED_TYPE, "no repackable type"
    for plain, packed in REPACKED_TYPE.items():
        assert traits(packed).base == plain and traits(packed).quantized
    assert len(set(REPACKED_TYPE.values())) == len(REPACKED_TYPE)
    # every quantized interleaved type with a base is a repack of it, or is quantized on its own
    with_base = {t.qtype for t in _interleaved() if t.base is not None and t.quantized}
    assert with_base - set(REPACKED_TYPE.values()) == QUANTIZED_ON_THEIR_OWN
    # ik's get_repack_info: q8_K repacks into q8_k_r8 (not a byte regroup; quantkit has no layout)
    assert REPACKED_TYPE[T.Q8_K] == T.Q8_K_R8 and REPACKED_TYPE[T.Q4_K] == T.Q4_K_R4


def test_what_quantize_writes_interleaved_repack_can_write_too():
    """quantize (formats/repacked.py) and repack (repack.py) agree on the interleaved variants."""
    table = {**REPACKED_TYPE, **BF16_REPACK}
    for qtype in WRAPPERS:
        assert table.get(traits(qtype).base) == qtype, traits(qtype).name


# ---- row fallbacks ----

@pytest.mark.parametrize("flavor", sorted(PROJECTS))
def test_every_256_block_type_has_a_row_fallback(flavor):
    missing = [t.name for t in TYPE_TRAITS.values()
               if t.block_size == QK_K and t.quantized and t.in_files and loads(t.qtype, flavor)
               and t.row_fallback_for(flavor) is None and t.qtype not in NO_ROW_FALLBACK]
    assert missing == [], f"{flavor}: 256-block types without a row fallback"


def test_row_fallbacks_are_smaller_blocks_the_flavor_loads_and_quantkit_writes():
    for t in TYPE_TRAITS.values():
        flavors = [f for f, _ in t.row_fallback]
        assert len(flavors) == len(set(flavors)) and set(flavors) <= set(t.loads), t.name
        for flavor, fb in t.row_fallback:
            f = traits(fb)
            assert f.block_size < t.block_size and t.block_size % f.block_size == 0, (t.name, flavor)
            assert loads(fb, flavor) and formats.can_quantize(fb, flavor), (t.name, flavor)


@pytest.mark.parametrize("qtype, flavor, expected", [
    (T.Q5_K, "ik", T.Q6_0), (T.Q5_K, "mainline", T.Q5_1), (T.Q2_K_R4, "ik", T.IQ4_NL),
    (T.IQ4_K, "ik", T.Q5_0), (T.Q8_K_R16, "ik", T.F16)], ids=lambda v: traits(v).name if isinstance(v, QuantType) else v)
def test_the_plan_takes_the_row_fallback_from_the_type(qtype, flavor, expected):
    """A 2-D tensor of rows of 128 values (not a multiple of 256)."""
    tensor = SimpleNamespace(name="blk.0.attn_q.weight", shape=(128, 8), qtype=int(T.F32))
    plan = make_plan([tensor], PlanOptions(default_type=qtype, flavor=flavor))
    assert plan.tensors[0].dst_type == expected and plan.tensors[0].requested == qtype


# ---- vec-dot types ----

def test_types_quantkit_writes_for_mainline_have_its_vec_dot_type():
    missing = [t.name for t in TYPE_TRAITS.values() if t.quantized and loads(t.qtype, "mainline")
               and formats.can_quantize(t.qtype, "mainline") and t.vec_dot_type is None]
    assert missing == []
    assert VEC_DOT_TYPE == {q: t.vec_dot_type for q, t in TYPE_TRAITS.items() if t.vec_dot_type is not None}
    for qtype, vt in VEC_DOT_TYPE.items():
        t = traits(qtype)
        assert loads(qtype, "mainline") and t.quantized, t.name
        assert vt in ROUNDED_ACTIVATIONS and traits(vt).block_size == ROUNDED_ACTIVATIONS[vt], t.name
        assert t.block_size % traits(vt).block_size == 0, t.name
