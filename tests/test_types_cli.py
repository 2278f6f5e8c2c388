"""`quantkit types`, who loads each type (checked against gguf-py's mainline list and the ik wheel),
the nearest names for a mistyped type or preset, and `quantize --flavor mainline` refusing what
mainline llama.cpp cannot load.  Through the library (quantkit.list_types, plan_quantize,
quantize_model); the CLI for the types table's rendering and one subprocess for the exit-status
contract."""
from __future__ import annotations

from types import SimpleNamespace as NS

import gguf
import pytest
from gguf.constants import GGML_QUANT_SIZES

import peers
import quantkit
from hostile import Snapshot, assert_refused, run_cli
from models import write_llama
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.plan import PlanOptions, make_plan
from quantkit.presets import PRESETS, ModelInfo, preset_or_type
from quantkit.recipes import load_recipe
from quantkit.suggest import did_you_mean, nearest
from quantkit.types import QuantType as T, TYPE_TRAITS, file_types, loads, traits, type_from_name

ggml = peers.load_ggml()
needs_wheel = pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")


# ---------------------------------------------------------------------------------- who loads what
def test_mainline_loads_exactly_the_ids_gguf_py_lists_with_our_layout():
    """gguf-py's GGMLQuantizationType and GGML_QUANT_SIZES mirror mainline ggml.h's enum ggml_type."""
    mainline = {int(t): GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType}
    for t in file_types():
        same = mainline.get(int(t.qtype)) == (t.block_size, t.type_size) and t.row_meta_size == 0
        assert loads(t.qtype, "mainline") == same, t.name


@needs_wheel
def test_ik_loads_exactly_the_ids_the_wheels_ggml_defines():
    for t in file_types():
        if t.qtype == T.MXFP4_R8:       # ik @ 8337e4cd has it (353); the wheel's older ggml does not
            assert loads(t.qtype, "ik") and ggml.type_traits(int(t.qtype)) is None
            continue
        assert loads(t.qtype, "ik") == (ggml.type_traits(int(t.qtype)) is not None), t.name


def test_loaders_of_the_types_users_ask_about():
    ik_only = ["iq4_k", "iq4_ks", "iq2_kl", "iq2_kt", "iq3_kt", "iq4_kt", "iq1_kt", "q6_0", "bf16_r16", "q4_k_r4",
               "iq4_k_r4", "q8_0_r8", "iq4_xs_r8", "q8_KV", "iq1_bn", "q4_0_4x4", "i2_s"]
    for name in ik_only:
        assert traits(type_from_name(name)).loads == ("ik",), name
    for name in ("tq1_0", "tq2_0", "nvfp4"):
        assert traits(type_from_name(name)).loads == ("mainline",), name
    for name in ("f32", "bf16", "q4_0", "q8_0", "q4_K", "q6_K", "iq4_nl", "iq4_xs", "iq2_xxs", "mxfp4", "q1_0"):
        assert set(traits(type_from_name(name)).loads) == {"ik", "mainline"}, name
    # every interleaved layout is the fork's; activation-only formats are in no file
    assert all(t.loads == ("ik",) for t in TYPE_TRAITS.values() if t.interleave_rows > 1)
    assert all(t.loads == () for t in TYPE_TRAITS.values() if not t.in_files)


def _tensors(tied=False, n_layer=4, n_embd=256, n_ff=512):
    t = [NS(name="token_embd.weight", shape=(n_embd, 512), qtype=T.F32)]
    if not tied:
        t.append(NS(name="output.weight", shape=(n_embd, 512), qtype=T.F32))
    for i in range(n_layer):
        for w, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, 64)), ("attn_v", (n_embd, 64)),
                         ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_embd, n_ff)), ("ffn_up", (n_embd, n_ff)),
                         ("ffn_down", (n_ff, n_embd))):
            t.append(NS(name=f"blk.{i}.{w}.weight", shape=shape, qtype=T.F32))
    return t


@pytest.mark.parametrize("tied", [False, True])
def test_every_mainline_preset_plans_only_types_mainline_loads(tied):
    """The refusal never hits a mainline preset: its mix, fallbacks included, picks mainline types."""
    model = ModelInfo(arch="llama", n_layer=4, n_head=32, n_head_kv=8, n_vocab=512)
    for p in PRESETS.values():
        if "mainline" not in p.ftypes:
            continue
        for n_embd in (256, 96):        # 96: rows no 256-block divides, so row fallbacks too
            plan = make_plan(_tensors(tied, n_embd=n_embd, n_ff=2 * n_embd),
                             PlanOptions(preset=p, flavor="mainline", model=model))
            assert all(loads(tp.dst_type, "mainline") for tp in plan.tensors), p.name


# ---------------------------------------------------------------------------------- nearest names
def test_nearest_ignores_case_and_separators_and_an_exact_key_wins():
    names = {n: n for n in ("Q4_K_M", "Q4_K_S", "Q5_K_M", "IQ4_K")}
    assert nearest("q4km", names) == ["Q4_K_M"]
    assert nearest("q-4 k_m", names) == ["Q4_K_M"]
    assert set(nearest("Q4_K_XL", names)[:2]) == {"Q4_K_M", "Q4_K_S"}      # equally near
    assert nearest("zzzz", names) == [] and did_you_mean("zzzz", names) == ""
    assert did_you_mean("q4_k_m", names) == "did you mean Q4_K_M?"
    hint = did_you_mean("Q4_K_XL", names)
    assert hint.startswith("did you mean ") and hint.endswith("?") and "Q4_K_M" in hint and "Q4_K_S" in hint
    assert nearest("q4k", {"Q4_K": "Q4_K_M", "q4_K": "q4_K"}) == ["Q4_K_M"]     # first spelling of a key wins


@pytest.mark.parametrize("text,flavor,needles", [
    ("q4km", "ik", ["unknown type 'q4km'", "nor an ik preset", "did you mean Q4_K_M?"]),
    ("q4km", "mainline", ["nor a mainline preset", "did you mean Q4_K_M?"]),
    ("Q4_K_XL", "ik", ["did you mean Q4_K_M", "Q4_K_S"]),
    ("iq4k", "ik", ["did you mean IQ4_K?"]),
    ("zzzz", "ik", ["unknown type 'zzzz'", "quantkit types lists them all"]),
    ("MXFP4_MOE", "ik", ["MXFP4_MOE is a mainline preset, not an ik one: add --flavor mainline"]),
    ("36", "ik", ["'36' names TQ1_0, which is a mainline preset"]),
])
def test_unknown_type_argument_names_the_nearest(text, flavor, needles):
    with pytest.raises(QuantkitError) as e:
        preset_or_type(text, flavor)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_mainline_suggestions_are_types_mainline_loads():
    with pytest.raises(QuantkitError) as e:
        preset_or_type("iq4k", "mainline")
    assert "iq4_k" not in str(e.value).lower().replace("'iq4k'", "")


def test_type_names_in_rules_and_options_name_the_nearest(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tensor type 'q4k_r4' \(did you mean q4_k_r4"):
        type_from_name("q4k_r4")
    with pytest.raises(QuantkitError, match=r"unknown type 'iq4xs' in rule 'ffn=iq4xs' \(did you mean iq4_xs"):
        load_recipe(["ffn=iq4xs"])
    src = write_llama(tmp_path / "m.gguf", n_layer=1)
    for option in ("output_tensor_type", "token_embedding_type"):
        with pytest.raises(QuantkitError) as e:
            quantkit.plan_quantize(src, "q8_0", **{option: "Q8-0x"})
        assert f"--{option.replace('_', '-')}: unknown type 'Q8-0x' (did you mean q8_0" in str(e.value)
        assert "\n" not in str(e.value)
    for option, value in (("tensor_type", "attn=q4km"), ("ffn_gate_inp_type", "q4km")):
        with pytest.raises(QuantkitError) as e:
            quantkit.plan_quantize(src, "q8_0", **{option: value})
        assert "'q4km'" in str(e.value) and "did you mean" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------- quantkit types
def test_types_json_lists_every_file_type_and_preset():
    doc = quantkit.list_types()
    types = {r["name"]: r for r in doc["types"]}
    assert set(types) == {t.name for t in file_types()} and "q8_K" not in types
    q4k, iq4k, nvfp4 = types["q4_K"], types["iq4_k"], types["nvfp4"]
    assert (q4k["id"], q4k["bits_per_weight"], q4k["block_size"]) == (12, 4.5, 256)
    assert q4k["loaded_by"] == {"llama.cpp": True, "ik_llama.cpp": True} and q4k["quantkit_writes"] == ["ik", "mainline"]
    assert iq4k["loaded_by"] == {"llama.cpp": False, "ik_llama.cpp": True} and iq4k["quantkit_writes"] == ["ik"]
    assert iq4k["quantkit_runs"] and types["iq4_k_r4"]["interleave_rows"] == 4
    assert nvfp4["loaded_by"] == {"llama.cpp": True, "ik_llama.cpp": False}
    assert nvfp4["quantkit_writes"] == [] and not nvfp4["quantkit_runs"]
    presets = {r["name"]: r for r in doc["presets"]}
    assert set(presets) == set(PRESETS) and doc["aliases"]["Q4_K"] == "Q4_K_M"
    assert presets["Q4_K_M"]["ftype"] == {"ik": 15, "mainline": 15} and presets["Q4_K_M"]["default_type"] == "q4_K"
    assert presets["IQ4_K"]["ftype"] == {"ik": 140} and presets["IQ4_K"]["bits_per_weight"] == 4.5
    assert presets["IQ4_K"]["loaded_by"] == {"llama.cpp": False, "ik_llama.cpp": True}
    assert presets["TQ1_0"]["ftype"] == {"mainline": 36} and presets["TQ1_0"]["loaded_by"]["ik_llama.cpp"] is False
    # a preset only ik has is not loaded by llama.cpp even when its type is (ik's MXFP4 is mainline's MXFP4_MOE)
    assert presets["MXFP4"]["loaded_by"]["llama.cpp"] is False and presets["MXFP4_MOE"]["loaded_by"]["llama.cpp"]


def test_types_table_names_every_type_and_preset_whole(capsys):
    assert main(["types"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    for t in file_types():
        assert t.name in rows, t.name
    for name in PRESETS:
        assert name in rows, name
    assert rows["iq4_k"] == ["iq4_k", "139", "4.5", "256", "ik_llama.cpp", "ik", "yes"]
    assert rows["tq1_0"] == ["tq1_0", "34", "1.6875", "256", "llama.cpp", "mainline", "yes"]
    assert rows["nvfp4"] == ["nvfp4", "40", "4.5", "64", "llama.cpp", "-", "-"]
    assert rows["Q4_K_M"] == ["Q4_K_M", "15", "both", "q4_K", "4.5", "both", "both", "yes"]
    assert rows["IQ2_KT"] == ["IQ2_KT", "151", "ik", "iq2_kt", "2.125", "ik_llama.cpp", "ik", "yes"]
    assert "aliases: Q3_K = Q3_K_M" in text
    assert max(map(len, text.splitlines())) <= 80         # a pipe's width: nothing is cut


# ---------------------------------------------------------------------------------- --flavor mainline
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("m") / "llama.gguf", n_layer=2)


@pytest.mark.parametrize("qtype,options,needles", [
    ("IQ4_K", {}, ["mainline llama.cpp cannot load iq4_k", "blk.0.attn_k.weight", "from TYPE"]),
    ("q6_0", {}, ["cannot load q6_0"]),
    ("Q4_K_R4", {}, ["cannot load q4_k_r4"]),
    ("iq2_kt", {}, ["cannot load iq2_kt"]),
    ("Q4_K_M", {"custom_q": "ffn_down=iq4_ks_r4"},
     ["cannot load iq4_ks_r4 (blk.0.ffn_down.weight, blk.1.ffn_down.weight; from rule 'ffn_down=iq4_ks_r4' "
      "(--custom-q #1 item 1))"]),
    ("Q4_K_M", {"output_tensor_type": "bf16_r16"}, ["cannot load bf16_r16 (output.weight; from --output-tensor-type)"]),
    ("Q4_K_M", {"token_embedding_type": "iq2_kl"}, ["iq2_kl (token_embd.weight; from --token-embedding-type)"]),
])
def test_mainline_flavor_refuses_types_mainline_cannot_load(llama, tmp_path, qtype, options, needles):
    out = tmp_path / "o.gguf"
    snap = Snapshot(llama, tmp_path)
    for call in (lambda: quantkit.quantize_model(llama, out, qtype, flavor="mainline", **options),
                 lambda: quantkit.plan_quantize(llama, qtype, flavor="mainline", **options)):       # a dry run
        with pytest.raises(QuantkitError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message, message
        for n in ("--flavor mainline: mainline llama.cpp cannot load", "use --flavor ik (ik_llama.cpp loads", *needles):
            assert n in message, message
    snap.assert_unchanged()
    # the same request with the ik flavor plans
    assert quantkit.plan_quantize(llama, qtype, **options).flavor == "ik"


def test_mainline_flavor_writes_mainline_types(llama):
    for qtype, options in (("Q4_K_M", {}), ("q6_K", {"custom_q": "ffn=q8_0", "output_tensor_type": "q5_K"}),
                           ("mxfp4", {})):
        plan = quantkit.plan_quantize(llama, qtype, flavor="mainline", **options)
        assert all(loads(tp.dst_type, "mainline") for tp in plan.tensors)


def test_mainline_refusal_exit_status_and_files(llama, tmp_path):
    out = tmp_path / "o.gguf"
    snap = Snapshot(llama, tmp_path)
    rc, o, e = run_cli("quantize", llama, out, "IQ4_K", "--flavor", "mainline")
    assert_refused(rc, o, e, "mainline llama.cpp cannot load iq4_k", "--flavor ik")
    snap.assert_unchanged()
