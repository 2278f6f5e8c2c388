"""IQ1_BN, IQ2_BN, IQ2_BN_R4 (ik_llama.cpp) and TQ1_0, TQ2_0 (mainline) against real references.

Quantizers (the numba kernels): ../shared/golden/ik for the bn types, ../shared/golden/mainline for
the tq types, with and without the imatrix (no quantizer reads it: the golden files are equal).
Decoders (numba and the numpy reference): the wheel's C ``to_float`` for the bn types (for IQ1_BN /
IQ2_BN on the blocks after the row scale, times the scale: ik's to_float starts at the row's first
byte and leaves the scale out, see formats/ternary.py), gguf-py's ``gguf.quants.dequantize`` for the
tq types, which the ik wheel does not know.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, quantize, random_blocks
from quantkit import formats
from quantkit.errors import QuantkitError
from quantkit.formats import interleave
from quantkit.plan import PlanOptions, make_plan
from quantkit.recipes import load_recipe
from quantkit.types import REPACKED_TYPE, QuantType, traits, type_name

T = QuantType
IK_TYPES = [T.IQ1_BN, T.IQ2_BN, T.IQ2_BN_R4]
MAINLINE_TYPES = [T.TQ1_0, T.TQ2_0]
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype", IK_TYPES + MAINLINE_TYPES, ids=type_name)
def test_golden(shared_dir, qtype, name, use_imatrix):
    folder = "ik" if qtype in IK_TYPES else "mainline"
    _, x, imatrix = golden_input(shared_dir, folder, name)
    want = golden_bytes(shared_dir, folder, name, qtype, use_imatrix)
    # ik-only types run one algorithm in both flavors; the tq types quantize in the mainline flavor
    for flavor in (("ik", "mainline") if qtype in IK_TYPES else ("mainline",)):
        got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
        assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name} {flavor}")


def test_tq_types_have_no_ik_quantizer():
    """ik_llama.cpp has no tq1_0/tq2_0: the library says so rather than writing ik-flavored bytes."""
    x = np.ones((1, 256), np.float32)
    for qtype in MAINLINE_TYPES:
        assert not formats.can_quantize(qtype, "ik") and formats.can_quantize(qtype, "mainline")
        with pytest.raises(NotImplementedError, match="ik flavor"):
            formats.quantize(x, qtype, None, "ik")


@pytest.mark.parametrize("qtype", MAINLINE_TYPES, ids=type_name)
def test_plan_refuses_tq_types_for_ik(qtype):
    """The plan's flavor check: ik_llama.cpp cannot load a tq type (types.py loads=MAINLINE)."""
    tensors = [NS(name="blk.0.ffn_down.weight", shape=(256, 4), qtype=T.F32)]
    recipe = load_recipe([f"ffn_down={type_name(qtype)}"])
    with pytest.raises(QuantkitError, match=rf"ik_llama.cpp cannot load {type_name(qtype)} .*--flavor mainline"):
        make_plan(tensors, PlanOptions(recipe=recipe, flavor="ik"))
    assert make_plan(tensors, PlanOptions(recipe=recipe, flavor="mainline")).tensors[0].dst_type == qtype


def _cases(shared_dir, qtype):
    folder = "ik" if qtype in IK_TYPES else "mainline"
    _, x, _ = golden_input(shared_dir, folder, "heavy")
    return [(random_blocks(qtype, 4, 512, int(qtype), d_at=-2), 512),
            (golden_bytes(shared_dir, folder, "heavy", qtype, False).reshape(x.shape[0], -1), x.shape[1])]


def _wheel_to_float(qtype, blocks, n):
    """The wheel's to_float; for IQ1_BN / IQ2_BN handed each row's blocks (ik's to_float reads
    from the pointer it gets, row scale or not) and multiplied by the row scale."""
    meta = traits(qtype).row_meta_size
    if qtype == T.IQ2_BN_R4:
        return np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
    rows = []
    for r in blocks:
        body = np.concatenate([r[meta:], np.zeros(meta, np.uint8)])
        t = np.asarray(ggml.to_float(int(qtype), body.tobytes(), n), np.float32)
        d = np.ascontiguousarray(r[:meta]).view("<f4" if meta == 4 else "<f2").astype(np.float32)[0]
        assert set(np.unique(t)) <= {-1.0, 0.0, 1.0, 2.0}      # unscaled (iq2_bn code 3: 2)
        rows.append(t * d)
    return np.stack(rows)


@pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")
@IMPLS
@pytest.mark.parametrize("qtype", IK_TYPES, ids=type_name)
def test_bn_decoders_equal_the_wheel(shared_dir, qtype, reference):
    for blocks, n in _cases(shared_dir, qtype):
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        want = _wheel_to_float(qtype, blocks, n).reshape(got.shape)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@IMPLS
@pytest.mark.parametrize("qtype", MAINLINE_TYPES, ids=type_name)
def test_tq_decoders_equal_gguf_py(shared_dir, qtype, reference):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    for blocks, n in _cases(shared_dir, qtype):
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        want = gguf_quants.dequantize(blocks, GGMLQuantizationType(int(qtype))).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


def test_iq2_bn_repacks_both_ways(shared_dir):
    """ik's get_repack_info maps iq2_bn to iq2_bn_r4: the golden iq2_bn rows repack to the golden
    iq2_bn_r4 bytes and back."""
    assert REPACKED_TYPE[T.IQ2_BN] == T.IQ2_BN_R4
    _, x, _ = golden_input(shared_dir, "ik", "wide")
    plain = golden_bytes(shared_dir, "ik", "wide", T.IQ2_BN, False).reshape(x.shape[0], -1)
    packed = golden_bytes(shared_dir, "ik", "wide", T.IQ2_BN_R4, False).reshape(x.shape[0], -1)
    np.testing.assert_array_equal(interleave.interleave(plain, T.IQ2_BN_R4, x.shape[1]), packed)
    np.testing.assert_array_equal(interleave.deinterleave(packed, T.IQ2_BN_R4, x.shape[1]), plain)


@pytest.mark.parametrize("qtype", [T.IQ1_BN, T.IQ2_BN], ids=type_name)
def test_output_check_reads_the_row_scale(qtype):
    """The output check looks at the bn row scales only (scale_fields), and finds what decoding
    finds: iq1_bn's fp16 max|x| overflows above 65504, a non-finite scale spoils its whole row."""
    x = np.ones((3, 128), np.float32)
    x[1, 5] = 1e5
    blocks = quantize(x, qtype, None, "ik")
    if qtype == T.IQ2_BN:       # a float32 max|x| of finite input is finite: spoil it by hand
        blocks[1, :4] = np.array([np.inf], "<f4").view(np.uint8)
    decoded = formats.dequantize(blocks, qtype, 128)
    assert tuple(np.argwhere(~np.isfinite(decoded))[0]) == (1, 0)
    assert formats.find_non_finite(blocks, qtype, 128) == (1, 0)
    assert formats.non_finite_column(blocks, qtype, x) == (1, 5)
    assert formats.find_non_finite(blocks[[0, 2]], qtype, 128) is None


@pytest.mark.parametrize("qtype", MAINLINE_TYPES, ids=type_name)
def test_tq_scale_field_is_the_decoders(qtype):
    """scale_fields names the fp16 d the decoder reads: Inf there spoils that block only."""
    t = traits(qtype)
    (off, dtype), = formats.registered()[qtype].scale_fields
    x = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
    blocks = quantize(x, qtype, None, "mainline")
    assert formats.find_non_finite(blocks, qtype, 512) is None
    blocks.reshape(2, -1, t.type_size)[1, 1, off:off + 2] = np.array([0x00, 0x7C], np.uint8)     # +Inf
    assert formats.find_non_finite(blocks, qtype, 512) == (1, 1)
    with np.errstate(invalid="ignore"):
        y = formats.dequantize(blocks, qtype, 512).reshape(2, -1, t.block_size)
    assert not np.isfinite(y[1, 1]).all() and np.isfinite(y[1, 0]).all() and np.isfinite(y[0]).all()
