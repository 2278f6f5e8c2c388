"""Preset mixes (Q4_K_M, IQ4_K, …): the per-tensor types llama-quantize chooses, and its imatrix rules.

ik flavor: checked against the real tool, the wheel's ``llama-quantize`` (ik_llama.cpp @ 55d3c05),
on SmolLM2 and on tiny synthetic models shaped to reach the architecture-specific rules (the i-quant,
bitnet and mxfp4 mixes through its --dry-run, with a unit imatrix: the C quantizers of those are slow).
Mainline flavor (no binary at hand): the worked examples of specs/ggml-quants.md §2.3 and llama-quant.cpp's
rules as written (@ 007dbbf) on in-memory tensor tables.
quantkit's side is the library (quantkit.plan_quantize / quantize_model) in-process; the CLI only
where what it prints is tested (a dry run's note of what a real run would stop on).
"""
from __future__ import annotations

import random
import re
import subprocess
from types import SimpleNamespace as NS

import numpy as np
import pytest

import peers
import quantkit
from models import deepseek_v3_tensors, write_deepseek2, write_llama, write_llama_sized
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import save_dat
from quantkit.plan import PlanOptions, check_imatrix, make_plan
from quantkit.presets import ALIASES, PRESETS, ModelInfo, find_preset
from quantkit.recipes import load_recipe
from quantkit.types import QuantType as T, traits, type_from_name, type_name

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

WHEEL_PRESETS = ["Q4_K_M", "Q3_K_M", "Q5_K_S", "Q6_K", "IQ4_XS", "IQ4_K"]


def targets(plan) -> dict[str, str]:
    """tensor name -> the name of the type it is planned to get."""
    return {tp.name: type_name(tp.dst_type) for tp in plan.tensors}


def wheel_quantize(src, preset, out, *extra):
    return subprocess.run([str(peers.llama_quantize_bin()), *extra, str(src), str(out), preset, "2"],
                          capture_output=True, text=True, timeout=600)


def wheel_types(src, preset, out) -> tuple[dict, int]:
    p = wheel_quantize(src, preset, out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # quantkit's reader, not gguf-py's: gguf.GGUFReader rejects the IQK type ids (139 = iq4_k, …)
    with open_model(out) as m:
        return {t.name: T(t.qtype) for t in m.tensors}, m.get("general.file_type")


def assert_same_types_as_wheel(src, preset, tmp_path):
    theirs, file_type = wheel_types(src, preset, tmp_path / f"{preset}.gguf")
    plan = quantkit.plan_quantize(src, preset)
    ours = {tp.name: tp.dst_type for tp in plan.tensors}
    assert ours.keys() == theirs.keys()
    wrong = {n: (ours[n].name, theirs[n].name) for n in ours if ours[n] != theirs[n]}
    assert not wrong, f"{preset}: quantkit vs llama-quantize: {wrong}"
    assert plan.file_type == file_type
    return plan


# ---------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def smollm2_f32(tmp_path_factory, smollm2_path):
    f32 = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    quantkit.quantize_model(smollm2_path, f32, "f32", allow_requantize=True)
    return f32


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    # 6 layers (3 dense), 4 experts: the n_expert >= 4 rules, layers parsed from names, and a dense
    # ffn_down with 384-wide rows that no 256-block type fits (row fallbacks)
    return write_deepseek2(tmp_path_factory.mktemp("ds") / "ds.gguf", n_layer=6, n_dense=3, n_ff=384)


@pytest.fixture(scope="module")
def llama_tied_gqa4(tmp_path_factory):
    # no output.weight (token_embd is the output), n_gqa = 4, 384-wide ffn_down rows
    return write_llama(tmp_path_factory.mktemp("lt") / "lt.gguf", n_layer=8, n_head=8, n_head_kv=2, tied=True,
                       n_ff=384)


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    return write_llama_sized(tmp_path_factory.mktemp("l8") / "l8.gguf", n_layer=32, vocab_size=128256)


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory):
    return write_llama_sized(tmp_path_factory.mktemp("l70") / "l70.gguf", n_layer=80, vocab_size=32000)


# ---------------------------------------------------------------------------------- (1) the real tool
@needs_wheel
@pytest.mark.parametrize("preset", WHEEL_PRESETS)
def test_smollm2_types_match_llama_quantize(smollm2_f32, preset, tmp_path):
    """SmolLM2: tied embeddings, 576-wide rows (K-quants fall back), n_gqa = 3, 30 layers."""
    plan = assert_same_types_as_wheel(smollm2_f32, preset, tmp_path)
    if preset == "Q4_K_M":
        by = targets(plan)
        assert by["token_embd.weight"] == "q8_0"        # tied and 576 % 256 != 0
        assert by["blk.0.attn_q.weight"] == "q5_0"      # q4_K does not fit 576
        assert by["blk.0.ffn_down.weight"] == "q6_K"    # rows of 1536: use_more_bits(0, 30)
        assert by["blk.4.ffn_down.weight"] == "q4_K"


@needs_wheel
@pytest.mark.parametrize("preset", WHEEL_PRESETS + ["Q2_K", "Q3_K_S", "Q3_K_L", "Q4_K_S", "Q5_K_M", "Q4_0", "Q8_0",
                                                    "IQ4_NL", "IQ2_K", "IQ3_K", "IQ3_KL", "IQ4_KS", "IQ4_KSS",
                                                    "IQ5_K", "IQ6_K", "Q4_K_R4", "IQ4_K_R4", "Q6_0", "BF16",
                                                    "MXFP4", "IQ2_BN"])     # quick in C: a real file_type
def test_deepseek_types_match_llama_quantize(deepseek, preset, tmp_path):
    plan = assert_same_types_as_wheel(deepseek, preset, tmp_path)
    if preset == "Q4_K_M":
        by = targets(plan)
        # ik's substring test "attn_k" also catches attn_k_b and attn_kv_a_mqa: Q8_0 with >= 4 experts
        assert by["blk.3.attn_k_b.weight"] == by["blk.3.attn_kv_a_mqa.weight"] == "q8_0"
        assert by["blk.3.attn_output.weight"] == "q5_K"
        assert by["blk.2.ffn_down.weight"] == "q8_0"              # q6_K on 384-wide rows falls back
        assert by["blk.1.ffn_down.weight"] == "q5_0"              # q4_K on 384-wide rows falls back
        assert by["blk.5.ffn_down_exps.weight"] == "q6_K"         # layer parsed from the name
        assert by["blk.4.ffn_down_exps.weight"] == "q4_K"


@needs_wheel
@pytest.mark.parametrize("preset", WHEEL_PRESETS + ["Q2_K", "Q3_K_L", "Q4_K_S", "Q5_K_M", "Q4_0", "IQ3_K", "IQ3_KL",
                                                    "IQ3_S", "IQ3_M", "IQ3_XS", "IQ2_KL", "IQ3_KS", "IQ4_KS",
                                                    "IQ4_KSS", "Q3_K_R4", "IQ4_NL_R4", "IQ4_XS_R8", "Q8_K_R8"])
def test_tied_gqa4_llama_types_match_llama_quantize(llama_tied_gqa4, preset, tmp_path):
    assert_same_types_as_wheel(llama_tied_gqa4, preset, tmp_path)


@needs_wheel
@pytest.mark.parametrize("preset,tensor,target", [("Q5_K_S", "blk.5.attn_v.weight", "q6_K"),
                                                  ("Q5_K_S", "blk.5.attn_q.weight", "q4_K"),
                                                  ("IQ5_K", "blk.5.attn_v.weight", "iq6_k")])
def test_8b_class_rules_match_llama_quantize(llama_8b, preset, tensor, target, tmp_path):
    """32 layers and a >= 128K vocabulary make MODEL_8B: Q5_K_S/IQ5_K bump attn_v, lower attn_q."""
    plan = assert_same_types_as_wheel(llama_8b, preset, tmp_path)
    assert targets(plan)[tensor] == target


@needs_wheel
@pytest.mark.parametrize("preset,target", [("Q4_K_M", "q5_K"), ("IQ3_K", "iq5_k")])
def test_70b_class_rules_match_llama_quantize(llama_70b, preset, target, tmp_path):
    """80 layers with GQA make MODEL_70B: attn_v gets more bits whatever the mix."""
    plan = assert_same_types_as_wheel(llama_70b, preset, tmp_path)
    assert targets(plan)["blk.5.attn_v.weight"] == target


@needs_wheel
def test_preset_table_is_the_wheels_list():
    p = subprocess.run([str(peers.llama_quantize_bin()), "--help"], capture_output=True, text=True, timeout=60)
    listed = {name: int(n) for n, name in re.findall(r"^\s*(\d+)\s+or\s+(\S+)\s*:", p.stdout + p.stderr, re.M)}
    ours = {name: pr.ftype("ik") for name, pr in PRESETS.items() if "ik" in pr.ftypes}
    ours.update({alias: PRESETS[target].ftype("ik") for alias, target in ALIASES.items()})
    assert ours == listed


@needs_wheel
def test_iq3_xxs_without_imatrix_fails_like_llama_quantize(llama_tied_gqa4, tmp_path):
    """IQ3_XXS itself needs no imatrix, but the mix puts attn_q on IQ2_S, which does."""
    msg = "Missing importance matrix for tensor blk.0.attn_q.weight in a very low-bit quantization"
    p = wheel_quantize(llama_tied_gqa4, "IQ3_XXS", tmp_path / "w.gguf")
    assert p.returncode != 0 and msg in p.stdout + p.stderr
    out = tmp_path / "q.gguf"
    with pytest.raises(QuantkitError) as e:
        quantkit.quantize_model(llama_tied_gqa4, out, "IQ3_XXS")
    assert not out.exists() and msg in str(e.value)
    assert "this quantization requires an imatrix!" in str(e.value)


# ------------------------------------------------------------------------------ (1b) i-quant, bitnet, mxfp4 mixes
# Checked against llama-quantize --dry-run: the same type choices as a real run (rules, row and interleave
# fallbacks, the imatrix checks) at a fraction of the cost; the C i-quant quantizers take seconds per tiny model.
LOW_BIT_PRESETS = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
                   "IQ1_BN", "IQ2_BN", "MXFP4", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ2_M_R4", "IQ1_S_R4", "IQ1_M_R4",
                   "IQ3_XXS_R4", "IQ3_S_R4", "IQ2_BN_R4"]
_DRY_RUN_TENSOR = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+) - \[[^\]]*\], type =\s*(\S+),", re.M)


def write_ones_imatrix(src, path):
    """An imatrix of unit weights for every matrix of ``src`` (per expert for 3-D tensors): the mixes
    only ask whether there is one, and the very-low-bit types refuse to run without."""
    with open_model(src) as m:
        weights = {t.name: np.ones(t.shape[0] * (t.shape[2] if len(t.shape) > 2 else 1), np.float32)
                   for t in m.tensors if len(t.shape) >= 2}
    return save_dat(path, weights)


@pytest.fixture(scope="module")
def ones_imatrix(tmp_path_factory):
    made = {}

    def get(src):
        if src not in made:
            made[src] = write_ones_imatrix(src, tmp_path_factory.mktemp("imatrix") / "ones.dat")
        return made[src]
    return get


def wheel_dry_run(src, preset, imatrix=None, extra=()) -> tuple[int, dict, str]:
    """llama-quantize --dry-run (and ``extra`` options): its exit status, {tensor: the type it would
    write}, its output."""
    args = (["--imatrix", str(imatrix)] if imatrix is not None else []) + list(extra)
    p = subprocess.run([str(peers.llama_quantize_bin()), "--dry-run", *args, str(src), preset, "2"],
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    heads = list(_DRY_RUN_TENSOR.finditer(out))
    types = {}
    for k, m in enumerate(heads):
        # a fallback's warning comes between the tensor's line and "converting to <the type written>"
        rest = out[m.end(): heads[k + 1].start() if k + 1 < len(heads) else len(out)]
        converted = re.search(r"converting to (\S+) \.\.", rest)
        types[m[1]] = type_from_name(converted[1] if converted else m[2])
    return p.returncode, types, out


def assert_same_plan_as_wheel_dry_run(src, preset, imatrix=None):
    rc, theirs, out = wheel_dry_run(src, preset, imatrix)
    assert rc == 0, out[-3000:]
    plan = quantkit.plan_quantize(src, preset, imatrix=imatrix)
    ours = {tp.name: tp.dst_type for tp in plan.tensors}
    assert ours.keys() == theirs.keys()
    wrong = {n: (type_name(ours[n]), type_name(theirs[n])) for n in ours if ours[n] != theirs[n]}
    assert not wrong, f"{preset}: quantkit vs llama-quantize --dry-run: {wrong}"
    # the dry run writes no file: its general.file_type is the preset's number, which
    # test_preset_table_is_the_wheels_list checks against the wheel's own list
    assert plan.file_type == PRESETS[preset].ftype("ik")
    return plan


# the model that exercises a mix's rules best: the DeepSeek fixture (4 experts: attn_output, attn_v and the
# "attn_k" substring rules, layers from names, 384-wide rows), the tied GQA-4 llama (the output rule on the
# embeddings, n_gqa >= 4), SmolLM2 (n_gqa = 3, 576-wide rows: every 256-block type falls back), the 70B
# llama (ik's 70B attn_v branch runs before the mix's own)
LOW_BIT_CASES = ([("deepseek", p) for p in LOW_BIT_PRESETS] + [("llama_tied_gqa4", p) for p in LOW_BIT_PRESETS]
                 + [("smollm2_f32", p) for p in ("IQ1_S", "IQ2_XXS", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_M", "IQ1_BN",
                                                 "MXFP4", "IQ1_M_R4", "IQ2_XS_R4", "IQ3_S_R4", "IQ2_BN_R4")]
                 + [("llama_70b", p) for p in ("IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_M")])


@needs_wheel
@pytest.mark.parametrize("model,preset", LOW_BIT_CASES)
def test_low_bit_mixes_match_llama_quantize(request, ones_imatrix, model, preset):
    src = request.getfixturevalue(model)
    plan = assert_same_plan_as_wheel_dry_run(src, preset, ones_imatrix(src))
    by = targets(plan)
    if (model, preset) == ("deepseek", "IQ1_S_R4"):
        # its own table: shared experts iq4_k_r4, attn_output q5_k_r4 with >= 4 experts
        assert by["blk.3.ffn_up_shexp.weight"] == "iq4_k_r4" and by["blk.3.attn_output.weight"] == "q5_k_r4"
        assert by["blk.3.ffn_up_exps.weight"] == "iq1_s_r4" and by["token_embd.weight"] == "q2_K"
    if (model, preset) == ("deepseek", "MXFP4"):
        assert by["blk.3.attn_kv_a_mqa.weight"] == by["blk.3.attn_k_b.weight"] == "q8_0"   # "attn_k", 4 experts
        assert by["blk.3.ffn_down_exps.weight"] == "mxfp4" and by["output.weight"] == "q6_K"
    if (model, preset) == ("llama_tied_gqa4", "IQ2_M_R4"):
        # the tied embeddings take the output rule; attn_v and attn_output leave the _r4 layout
        assert by["token_embd.weight"] == "iq4_k" and by["blk.0.attn_v.weight"] == "iq4_k"
        assert by["blk.0.attn_output.weight"] == "iq3_s" and by["blk.0.ffn_up.weight"] == "iq2_s_r4"
        assert by["blk.0.ffn_down.weight"] == "iq4_nl"      # iq3_s (first eighth) on 384-wide rows falls back
    if (model, preset) == ("smollm2_f32", "IQ2_XXS"):
        assert by["blk.0.attn_q.weight"] == "iq4_nl" and by["blk.0.ffn_down.weight"] == "q2_K"
        assert by["blk.0.attn_v.weight"] == "iq4_nl"        # iq3_k (n_gqa = 3) does not fit 576 either
    if (model, preset) == ("llama_70b", "IQ3_S"):
        assert by["blk.5.attn_v.weight"] == "iq3_s"         # the 70B branch bumps only q3_K/q4_K/iq3_k


@needs_wheel
@pytest.mark.parametrize("preset", ["IQ3_XXS", "IQ3_XXS_R4"])
def test_iq3_xxs_mixes_without_imatrix_match_llama_quantize(smollm2_f32, ones_imatrix, preset):
    """Without an imatrix IQ3_XXS gives ffn_down q4_K/q3_K (R4: q4_k_r4/iq3_k_r4); SmolLM2's 576-wide
    attn_q/attn_k fall back from iq2_s to iq4_nl, so the wheel runs without one."""
    plan = assert_same_plan_as_wheel_dry_run(smollm2_f32, preset)
    by = targets(plan)
    r4 = preset.endswith("_R4")
    # ik counts ffn_down tensors in file order, and SmolLM2's is blk.0, 1, 10, 11, …: blk.10 is the third
    # (< 30 / 8), blk.11 the fourth
    assert by["blk.10.ffn_down.weight"] == ("q4_k_r4" if r4 else "q4_K")
    assert by["blk.11.ffn_down.weight"] == by["blk.2.ffn_down.weight"] == ("iq3_k_r4" if r4 else "q3_K")
    # with one, ffn_down keeps the mix's default (checked against the wheel in the test above)
    with_imatrix = targets(quantkit.plan_quantize(smollm2_f32, preset, imatrix=ones_imatrix(smollm2_f32)))
    assert with_imatrix["blk.11.ffn_down.weight"] == ("iq3_xxs_r4" if r4 else "iq3_xxs")


_WHEEL_IMATRIX_REFUSAL = re.compile(r"Please do not use [^\n]* without an importance matrix"
                                    r"|Missing importance matrix for tensor \S+ in a very low-bit quantization")


@needs_wheel
@pytest.mark.parametrize("preset", ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_XXS_R4", "IQ2_XS_R4",
                                    "IQ1_S_R4", "IQ1_M_R4",                     # refused for the preset itself
                                    "IQ2_M", "IQ2_M_R4", "IQ3_XXS_R4"])         # for their first iq2_s tensor
def test_low_bit_mixes_without_imatrix_refused_like_llama_quantize(llama_tied_gqa4, preset):
    rc, _, out = wheel_dry_run(llama_tied_gqa4, preset)
    theirs = _WHEEL_IMATRIX_REFUSAL.search(out)
    assert rc != 0 and theirs, out[-3000:]
    with quantkit.open_quantization(llama_tied_gqa4, None, preset) as q:
        assert q.problems and theirs[0] in str(q.problems[0]), (theirs[0], q.problems)
        assert str(q.problems[0]).startswith("this quantization requires an imatrix!")


@needs_wheel
def test_imatrix_without_a_tensors_entry_like_llama_quantize(llama_tied_gqa4, tmp_path):
    """With an imatrix that lacks a very-low-bit tensor's entry both stop on that tensor.  ik @ 8337e4c (not
    yet the wheel's 55d3c05: #1805) takes ffn_up's entry for an ffn_gate without one (they see the same
    input); mainline has no such stand-ins."""
    with open_model(llama_tied_gqa4) as m:
        ones = {t.name: np.ones(t.shape[0], np.float32) for t in m.tensors if len(t.shape) >= 2}
    no_up = save_dat(tmp_path / "no-up.dat", {n: w for n, w in ones.items() if n != "blk.1.ffn_up.weight"})
    no_gate = save_dat(tmp_path / "no-gate.dat", {n: w for n, w in ones.items() if n != "blk.1.ffn_gate.weight"})
    rc, _, out = wheel_dry_run(llama_tied_gqa4, "IQ2_XXS", no_up)
    assert rc != 0 and "Missing importance matrix for tensor blk.1.ffn_up.weight in a very low-bit" in out
    for flavor in ("ik", "mainline"):
        with quantkit.open_quantization(llama_tied_gqa4, None, "IQ2_XXS", imatrix=no_up, flavor=flavor) as q:
            assert str(q.problems[0]).startswith("Missing importance matrix for tensor blk.1.ffn_up.weight in a "
                                                 "very low-bit quantization (iq2_xxs)"), q.problems
    with quantkit.open_quantization(llama_tied_gqa4, None, "IQ2_XXS", imatrix=no_gate) as q:
        assert not [p for p in q.problems if "importance" in str(p)], q.problems
        assert next(tp for tp in q.plan.tensors if tp.name == "blk.1.ffn_gate.weight").imatrix
    with quantkit.open_quantization(llama_tied_gqa4, None, "IQ2_XXS", imatrix=no_gate, flavor="mainline") as q:
        assert str(q.problems[0]).startswith("Missing importance matrix for tensor blk.1.ffn_gate.weight")
        assert not next(tp for tp in q.plan.tensors if tp.name == "blk.1.ffn_gate.weight").imatrix


# ---------------------------------------------------------------------------------- in-memory models
def _t(name, shape, qtype=T.F32):
    return NS(name=name, shape=tuple(shape), qtype=qtype)


def llama_tensors(n_layer=32, n_embd=256, n_ff=512, kv=64, n_vocab=512, tied=False, n_expert=0):
    t = [_t("token_embd.weight", (n_embd, n_vocab)), _t("output_norm.weight", (n_embd,))]
    if not tied:
        t.append(_t("output.weight", (n_embd, n_vocab)))
    for i in range(n_layer):
        p = f"blk.{i}."
        t += [_t(p + "attn_norm.weight", (n_embd,)), _t(p + "attn_q.weight", (n_embd, n_embd)),
              _t(p + "attn_k.weight", (n_embd, kv)), _t(p + "attn_v.weight", (n_embd, kv)),
              _t(p + "attn_output.weight", (n_embd, n_embd)), _t(p + "ffn_norm.weight", (n_embd,))]
        if n_expert:
            t += [_t(p + "ffn_gate_inp.weight", (n_embd, n_expert)),
                  *[_t(p + f"ffn_{w}_exps.weight", (n_embd, n_ff, n_expert)) for w in ("gate", "up")],
                  _t(p + "ffn_down_exps.weight", (n_ff, n_embd, n_expert))]
        else:
            t += [_t(p + "ffn_gate.weight", (n_embd, n_ff)), _t(p + "ffn_up.weight", (n_embd, n_ff)),
                  _t(p + "ffn_down.weight", (n_ff, n_embd))]
    return t


def plan_for(tensors, preset, flavor="mainline", model=None, **kw):
    p = find_preset(preset, flavor)
    assert p is not None
    model = model or ModelInfo(arch="llama", n_layer=32, n_head=32, n_head_kv=8, n_vocab=512)
    plan = make_plan(tensors, PlanOptions(preset=p, flavor=flavor, model=model, **kw))
    return plan, {t.name: t.dst_type for t in plan.tensors}, {t.name: t for t in plan.tensors}


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# ---------------------------------------------------------------------------------- (2) mainline rules
Q6K_LAYERS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}     # spec §2.3's example


@pytest.mark.parametrize("flavor", ["mainline", "ik"])
def test_q4_k_m_llama_32_layers(flavor):
    plan, types, _ = plan_for(llama_tensors(), "Q4_K_M", flavor)     # n_gqa = 32 / 8 = 4
    assert plan.file_type == 15
    for i in range(32):
        want = T.Q6_K if i in Q6K_LAYERS_32 else T.Q4_K
        assert types[f"blk.{i}.ffn_down.weight"] == want, i
        # ik ends its attn_v rules with a GQA bump mainline does not have: Q4_K -> Q5_K at n_gqa >= 4
        if flavor == "ik" and want == T.Q4_K:
            want = T.Q5_K
        assert types[f"blk.{i}.attn_v.weight"] == want, i
        for w in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{w}.weight"] == T.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert {p.rule for p in plan.tensors if p.dst_type == T.Q6_K} == {"Q4_K_M mix"}


@pytest.mark.parametrize("flavor", ["mainline", "ik"])
def test_tied_embeddings_get_the_output_type(flavor):
    _, types, _ = plan_for(llama_tensors(tied=True), "Q4_K_M", flavor)
    assert types["token_embd.weight"] == T.Q6_K
    # --output-tensor-type reaches the tied embeddings through the output rule …
    _, types, _ = plan_for(llama_tensors(tied=True), "Q4_K_M", flavor, output_tensor_type=T.Q8_0)
    assert types["token_embd.weight"] == T.Q8_0
    # … and --token-embedding-type wins over it
    _, types, _ = plan_for(llama_tensors(tied=True), "Q4_K_M", flavor, output_tensor_type=T.Q8_0,
                           token_embedding_type=T.Q5_0)
    assert types["token_embd.weight"] == T.Q5_0


def test_mixtral_8_experts_mainline():
    model = ModelInfo(arch="llama", n_layer=32, n_expert=8, n_head=32, n_head_kv=8)
    _, types, _ = plan_for(llama_tensors(n_expert=8), "Q4_K_M", model=model)
    for i in (0, 5, 31):
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.attn_k.weight"] == T.Q8_0
        assert types[f"blk.{i}.attn_output.weight"] == T.Q5_K
        # with experts the layer comes from the name: blk.N.ffn_down_exps follows use_more_bits(N, 32)
        assert types[f"blk.{i}.ffn_down_exps.weight"] == (T.Q6_K if i in Q6K_LAYERS_32 else T.Q4_K)
    assert types["blk.0.ffn_gate_inp.weight"] == T.F32


def test_70b_attn_v_mainline():
    model = ModelInfo(arch="llama", n_layer=80, n_head=64, n_head_kv=8)
    _, types, _ = plan_for(llama_tensors(n_layer=80), "Q4_K_M", model=model)
    # mainline bumps what the mix chose (Q4_K -> Q5_K) and keeps the use_more_bits layers at Q6_K;
    # ik's 70B branch replaces the mix and gives Q5_K everywhere (checked against the wheel above)
    assert types["blk.11.attn_v.weight"] == T.Q5_K
    assert types["blk.5.attn_v.weight"] == T.Q6_K
    _, ik, _ = plan_for(llama_tensors(n_layer=80), "Q4_K_M", "ik", model=model)
    assert ik["blk.5.attn_v.weight"] == ik["blk.11.attn_v.weight"] == T.Q5_K
    model = ModelInfo(arch="llama", n_layer=80, n_head=64, n_head_kv=64)     # 65B: no GQA, no bump
    _, types, _ = plan_for(llama_tensors(n_layer=80), "Q4_K_M", model=model)
    assert types["blk.11.attn_v.weight"] == T.Q4_K


def dsv3_model(n_layer=61):
    return ModelInfo(arch="deepseek2", n_layer=n_layer, n_expert=256, n_head=128, n_head_kv=1, n_vocab=129280)


def test_deepseek2_q4_k_m_mainline():
    tensors = [_t(n, s, T(q)) for n, s, q in deepseek_v3_tensors(with_kv_b=False)]
    _, types, by = plan_for(tensors, "Q4_K_M", model=dsv3_model())
    # attn_k_b is "other" in mainline; q4_K does not fit its 128-wide rows: fallback q5_0
    assert types["blk.10.attn_k_b.weight"] == T.Q5_0 and by["blk.10.attn_k_b.weight"].requested == T.Q4_K
    assert types["blk.10.attn_v_b.weight"] == T.Q4_K
    for w in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output", "ffn_gate_exps", "ffn_up_exps",
              "ffn_gate_shexp", "ffn_up_shexp"):
        assert types[f"blk.10.{w}.weight"] == T.Q4_K, w
    for i in range(61):
        want = T.Q6_K if use_more_bits(i, 61) else T.Q4_K
        names = ["ffn_down"] if i < 3 else ["ffn_down_exps", "ffn_down_shexp"]
        for w in names:
            assert types[f"blk.{i}.{w}.weight"] == want, (i, w)
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert types["blk.10.ffn_gate_inp.weight"] == T.F32 and types["blk.10.exp_probs_b.bias"] == T.F32


def test_deepseek2_q4_k_m_ik_differs():
    """ik tests substrings: "attn_k" catches attn_k_b/attn_kv_a_mqa (Q8_0 with >= 4 experts), and
    attn_output gets Q5_K; the attn_kv_b of ik-converted files is not attn_v-like."""
    tensors = [_t(n, s, T(q)) for n, s, q in deepseek_v3_tensors()]
    _, types, _ = plan_for(tensors, "Q4_K_M", flavor="ik", model=dsv3_model())
    assert types["blk.10.attn_k_b.weight"] == types["blk.10.attn_kv_a_mqa.weight"] == T.Q8_0
    assert types["blk.10.attn_kv_b.weight"] == T.Q8_0
    assert types["blk.10.attn_output.weight"] == T.Q5_K
    assert types["blk.10.attn_q_b.weight"] == T.Q4_K


def test_deepseek2_legacy_kv_b_is_attn_v_like_mainline():
    tensors = [_t(n, s, T(q)) for n, s, q in deepseek_v3_tensors(with_kv_b=True)]
    _, types, _ = plan_for(tensors, "Q4_K_M", model=dsv3_model())
    # 61 attn_kv_b tensors, counted in visiting order: use_more_bits(i_attention_wv, 61)
    for i in range(61):
        assert types[f"blk.{i}.attn_kv_b.weight"] == (T.Q6_K if use_more_bits(i, 61) else T.Q4_K), i


def test_deepseek_v2_lite_widths_fall_back_mainline():
    tensors = [_t(n, s, T(q)) for n, s, q in deepseek_v3_tensors(
        n_layer=27, n_dense=1, n_embd=2048, n_ff=10944, n_ff_exp=1408, n_expert=64, n_head=16, with_kv_b=False)]
    model = ModelInfo(arch="deepseek2", n_layer=27, n_expert=64, n_head=16, n_head_kv=1)
    _, types, by = plan_for(tensors, "Q4_K_M", model=model)
    assert types["blk.0.ffn_down.weight"] == T.Q8_0            # Q6_K (layer 0) → Q8_0
    assert types["blk.5.ffn_down_exps.weight"] == T.Q8_0       # use_more_bits(5, 27): Q6_K → Q8_0
    assert types["blk.4.ffn_down_exps.weight"] == T.Q5_0       # Q4_K → Q5_0
    assert by["blk.4.ffn_down_exps.weight"].requested == T.Q4_K
    assert types["blk.4.ffn_gate_exps.weight"] == T.Q4_K       # rows of n_embd = 2048 fit


def test_recipe_claimed_tensors_skip_the_counters_in_mainline_only():
    recipe = load_recipe(["blk\\.0\\.attn_v=q8_0"])
    _, ml, _ = plan_for(llama_tensors(), "Q4_K_M", "mainline", recipe=recipe)
    _, ik, _ = plan_for(llama_tensors(), "Q4_K_M", "ik", recipe=recipe)
    assert ml["blk.0.attn_v.weight"] == ik["blk.0.attn_v.weight"] == T.Q8_0
    # mainline never ran the heuristics for blk.0.attn_v, so blk.4 is its 4th attn_v: use_more_bits(3, 32)
    assert ml["blk.4.attn_v.weight"] == T.Q6_K
    # ik ran them (the custom type wins afterwards): blk.4 is its 5th, not a use_more_bits one
    # (Q4_K, then ik's n_gqa >= 4 bump to Q5_K)
    assert ik["blk.4.attn_v.weight"] == T.Q5_K


def test_visiting_order_mainline_sorted_ik_file_order():
    """Without experts the ffn_down rule counts tensors: mainline visits them sorted by layer number,
    ik in file order."""
    tensors = llama_tensors(n_layer=16)
    head, rest = tensors[:3], tensors[3:]
    layers = [rest[i * 9:(i + 1) * 9] for i in range(16)]
    random.Random(1).shuffle(layers)
    shuffled = head + [t for layer in layers for t in layer]
    model = ModelInfo(arch="llama", n_layer=16, n_head=32, n_head_kv=8)
    _, ml, _ = plan_for(shuffled, "Q4_K_M", "mainline", model=model)
    _, ik, _ = plan_for(shuffled, "Q4_K_M", "ik", model=model)
    for i in range(16):
        assert ml[f"blk.{i}.ffn_down.weight"] == (T.Q6_K if use_more_bits(i, 16) else T.Q4_K)
    file_pos = [int(layer[0].name.split(".")[1]) for layer in layers]
    for k, i in enumerate(file_pos):
        assert ik[f"blk.{i}.ffn_down.weight"] == (T.Q6_K if use_more_bits(k, 16) else T.Q4_K)


def test_falcon_output_and_ffn_down_mainline():
    model = ModelInfo(arch="falcon", n_layer=32, n_head=32, n_head_kv=8)
    _, types, _ = plan_for(llama_tensors(), "Q4_K_M", model=model)
    assert types["output.weight"] == T.Q8_0
    assert types["blk.0.ffn_down.weight"] == T.Q6_K             # i < n/16
    assert types["blk.6.ffn_down.weight"] == T.Q5_K             # use_more_bits
    assert types["blk.7.ffn_down.weight"] == T.Q4_K


def test_q3_k_m_and_q2_k_mainline():
    _, types, _ = plan_for(llama_tensors(), "Q3_K_M")
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(3)] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert types["blk.1.ffn_down.weight"] == T.Q5_K and types["blk.2.ffn_down.weight"] == T.Q4_K
    assert types["blk.3.attn_output.weight"] == T.Q4_K and types["blk.3.attn_q.weight"] == T.Q3_K
    _, types, _ = plan_for(llama_tensors(), "Q2_K")            # n_gqa = 4
    assert types["blk.3.attn_v.weight"] == T.Q4_K and types["blk.3.ffn_down.weight"] == T.Q3_K
    assert types["blk.3.attn_output.weight"] == T.Q3_K and types["blk.3.attn_q.weight"] == T.Q2_K


def test_mxfp4_moe_mainline():
    model = ModelInfo(arch="gpt-oss", n_layer=4, n_expert=8, n_head=32, n_head_kv=8)
    plan, types, _ = plan_for(llama_tensors(n_layer=4, n_expert=8), "MXFP4_MOE", model=model)
    assert plan.file_type == 38
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == T.MXFP4
    assert types["blk.1.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == T.Q8_0


# mainline's i-quant, ternary and MXFP4_MOE mixes (llama-quant.cpp llama_tensor_get_type_impl and
# tensor_type_fallback, as written).  A row a preset: the type each kind of tensor gets; "a/b" for ffn_down is
# (the first eighth of the layers / the rest), for ffn_gate/up (the layers between the first and the last
# eighth / the others).  Llama, 32 layers, output not tied, with an imatrix:
_ML_MIXES = """
#           output token_embd attn_v attn_k  attn_q  attn_output ffn_gate/up    ffn_down
IQ1_S       q5_K   q2_K       q4_K   iq1_s   iq1_s   iq2_xxs     iq1_s          q2_K/iq1_s
IQ1_M       q5_K   q2_K       q4_K   iq1_m   iq1_m   iq2_xxs     iq1_m          q2_K/iq1_m
IQ2_XXS     q5_K   q2_K       q4_K   iq2_xxs iq2_xxs iq2_xxs     iq2_xxs        q2_K/iq2_xxs
IQ2_XS      q5_K   q2_K       q4_K   iq2_xs  iq2_xs  iq2_xs      iq2_xs         q2_K/iq2_xs
IQ2_S       q5_K   iq3_s      q4_K   iq2_xs  iq2_xs  iq3_s       iq2_xs         iq3_s/iq2_xs
IQ2_M       q5_K   iq3_s      q4_K   iq2_s   iq2_s   iq3_s       iq2_s          iq3_s/iq2_s
IQ3_XXS     q5_K   iq3_s      q4_K   iq2_s   iq2_s   iq3_s       iq3_xxs        iq3_xxs
IQ3_XS      q6_K   iq3_s      q4_K   iq3_xxs iq3_xxs iq3_s       iq3_xxs/iq3_s  iq3_s
IQ3_S       q6_K   iq3_s      q4_K   iq3_s   iq3_s   iq3_s       iq3_s          iq3_s
IQ3_M       q6_K   iq3_s      q4_K   iq3_s   iq3_s   q4_K        iq3_s          q4_K/iq3_s
TQ1_0       q6_K   q4_K       tq1_0  tq1_0   tq1_0   tq1_0       tq1_0          tq1_0
TQ2_0       q6_K   q4_K       tq2_0  tq2_0   tq2_0   tq2_0       tq2_0          tq2_0
MXFP4_MOE   q8_0   q8_0       q8_0   q8_0    q8_0    q8_0        q8_0           q8_0
"""
# LLAMA_FTYPE_MOSTLY_* of mainline's include/llama.h (what general.file_type says)
ML_FTYPES = {"IQ1_S": 24, "IQ1_M": 31, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ2_M": 29, "IQ3_XXS": 23,
             "IQ3_XS": 22, "IQ3_S": 26, "IQ3_M": 27, "TQ1_0": 36, "TQ2_0": 37, "MXFP4_MOE": 38}
_ML_COLUMNS = ("output", "token_embd", "attn_v", "attn_k", "attn_q", "attn_output", "ffn_gate/up", "ffn_down")
ML_MIXES = {line.split()[0]: dict(zip(_ML_COLUMNS, line.split()[1:]))
            for line in _ML_MIXES.splitlines() if line.strip() and not line.startswith("#")}


def expected_mainline_types(row: dict, n_layer: int) -> dict[str, str]:
    def pick(cell, bumped):
        a, _, b = cell.partition("/")
        return a if bumped or not b else b
    want = {"output.weight": row["output"], "token_embd.weight": row["token_embd"]}
    for i in range(n_layer):
        p = f"blk.{i}."
        want.update({p + w + ".weight": row[w] for w in ("attn_v", "attn_k", "attn_q", "attn_output")})
        want[p + "ffn_down.weight"] = pick(row["ffn_down"], i < n_layer // 8)
        for w in ("ffn_gate", "ffn_up"):
            want[p + w + ".weight"] = pick(row["ffn_gate/up"], n_layer // 8 <= i < 7 * n_layer // 8)
    return want


@pytest.mark.parametrize("preset", list(ML_MIXES))
def test_mainline_low_bit_mixes(preset):
    plan, types, _ = plan_for(llama_tensors(), preset, has_imatrix=True)        # n_gqa = 32 / 8 = 4
    assert plan.file_type == ML_FTYPES[preset]
    got = {n: type_name(t) for n, t in types.items() if "norm" not in n}
    assert got == expected_mainline_types(ML_MIXES[preset], 32)


@pytest.mark.parametrize("preset,imatrix,attn_v", [
    ("IQ1_S", True, "q2_K"), ("IQ2_XXS", True, "q2_K"), ("IQ2_S", True, "iq3_s"), ("IQ2_M", True, "iq3_s"),
    ("IQ3_XXS", True, "iq3_xxs"), ("IQ3_XXS", False, "iq3_s"), ("IQ3_XS", True, "iq3_s"), ("IQ3_S", True, "iq3_s"),
    ("IQ3_M", True, "q4_K"), ("TQ1_0", True, "tq1_0")])
def test_mainline_low_bit_mixes_attn_v_without_gqa(preset, imatrix, attn_v):
    """n_gqa = 1: the q4_K bumps of attn_v that need n_gqa >= 4 are gone (IQ3_M's is not conditional)."""
    model = ModelInfo(arch="llama", n_layer=32, n_head=32, n_head_kv=32)
    _, types, _ = plan_for(llama_tensors(), preset, model=model, has_imatrix=imatrix)
    assert {type_name(types[f"blk.{i}.attn_v.weight"]) for i in range(32)} == {attn_v}
    if preset == "IQ3_XXS" and not imatrix:
        # without an imatrix ffn_down is q4_K in the first eighth, q3_K after
        assert types["blk.3.ffn_down.weight"] == T.Q4_K and types["blk.4.ffn_down.weight"] == T.Q3_K


@pytest.mark.parametrize("preset,attn_v,attn_k,attn_output,down", [
    ("IQ2_XXS", "q4_K", "q4_K", "q5_K", {0: "q2_K", 3: "q2_K", 4: "iq2_xxs", 9: "iq2_xxs", 31: "iq2_xxs"}),
    ("IQ2_M", "q4_K", "q4_K", "q5_K", {0: "iq3_s", 4: "iq2_s", 31: "iq2_s"}),
    ("IQ3_XS", "q8_0", "q8_0", "q5_K", {0: "iq3_s", 31: "iq3_s"}),
    ("IQ3_M", "q8_0", "q8_0", "q5_K", {0: "q4_K", 4: "iq3_s", 6: "q4_K", 7: "iq3_s", 28: "q4_K"}),
    ("TQ1_0", "q8_0", "q8_0", "tq1_0", {0: "tq1_0", 31: "tq1_0"})])
def test_mainline_low_bit_mixes_with_8_experts(preset, attn_v, attn_k, attn_output, down):
    """Mixtral: mainline's expert rules ask for exactly 8 (ik: 4 or more).  The IQ1/IQ2 mixes bump the first
    n_layer/8 ffn_down tensors by a raw count, the others (IQ3_M) parse the layer from the name."""
    model = ModelInfo(arch="llama", n_layer=32, n_expert=8, n_head=32, n_head_kv=8)
    _, types, _ = plan_for(llama_tensors(n_expert=8), preset, model=model, has_imatrix=True)
    by = {n: type_name(t) for n, t in types.items()}
    assert (by["blk.5.attn_v.weight"], by["blk.5.attn_k.weight"], by["blk.5.attn_output.weight"]) == \
        (attn_v, attn_k, attn_output)
    assert {i: by[f"blk.{i}.ffn_down_exps.weight"] for i in down} == down


def test_mainline_low_bit_mixes_70b():
    """The 70B bump (q3_K/q4_K -> q5_K) follows the attn_v rules in mainline, but not the IQ1/IQ2 mixes' own
    attn_v branch; ik's 70B branch replaces the mix's rule (checked against the wheel above)."""
    model = ModelInfo(arch="llama", n_layer=80, n_head=64, n_head_kv=8)
    tensors = llama_tensors(n_layer=80)
    for preset, want in (("IQ3_S", T.Q5_K), ("IQ3_M", T.Q5_K), ("IQ3_XXS", T.Q5_K), ("IQ2_XXS", T.Q4_K)):
        _, types, _ = plan_for(tensors, preset, model=model, has_imatrix=True)
        assert types["blk.5.attn_v.weight"] == want, preset
        _, ik, _ = plan_for(tensors, preset, "ik", model=model, has_imatrix=True)
        assert ik["blk.5.attn_v.weight"] == {"IQ3_S": T.IQ3_S, "IQ3_M": T.IQ3_S, "IQ3_XXS": T.IQ3_XXS,
                                             "IQ2_XXS": T.IQ4_K}[preset], preset


@pytest.mark.parametrize("preset,fallback", [("IQ1_S", "iq4_nl"), ("IQ2_XS", "iq4_nl"), ("IQ3_XXS", "iq4_nl"),
                                             ("IQ3_S", "iq4_nl"), ("IQ1_M", "iq4_nl"), ("TQ1_0", "q4_0"),
                                             ("TQ2_0", "q4_0")])
def test_mainline_low_bit_fallbacks(preset, fallback):
    """576-wide rows (SmolLM2): tensor_type_fallback takes each 256-block type to its 32-block stand-in;
    the tied embeddings get the output rule, q8_0 for rows its block does not divide."""
    model = ModelInfo(arch="llama", n_layer=8, n_head=9, n_head_kv=3)
    _, types, by = plan_for(llama_tensors(n_layer=8, n_embd=576, n_ff=1536, kv=192, tied=True), preset,
                            model=model, has_imatrix=True)
    assert types["token_embd.weight"] == T.Q8_0
    assert type_name(types["blk.5.ffn_up.weight"]) == fallback
    assert by["blk.5.ffn_up.weight"].requested == PRESETS[preset].default_type
    assert types["blk.5.ffn_down.weight"] == PRESETS[preset].default_type     # 1536-wide rows fit


def test_mxfp4_moe_mainline_3d_tensors():
    """MXFP4_MOE gives mxfp4 to every 3-D tensor with more than one matrix (mainline's "experts"), except
    bailingmoe3's MLA tensors, which only are 3-D; ik's MXFP4 preset is a plain mix (the wheel test above)."""
    tensors = llama_tensors(n_layer=4, n_expert=8) + [_t(f"blk.{i}.attn_k_b.weight", (128, 512, 4)) for i in range(4)]
    for arch, attn_k_b in (("llama", T.MXFP4), ("bailingmoe3", T.Q8_0)):
        model = ModelInfo(arch=arch, n_layer=4, n_expert=8, n_head=32, n_head_kv=8)
        _, types, _ = plan_for(tensors, "MXFP4_MOE", model=model)
        assert types["blk.2.attn_k_b.weight"] == attn_k_b, arch
        assert types["blk.2.ffn_gate_exps.weight"] == T.MXFP4 and types["blk.2.attn_k.weight"] == T.Q8_0
    assert find_preset("MXFP4", "mainline") is None and find_preset("MXFP4_MOE", "ik") is None
    assert find_preset("MXFP4").ftype("ik") == find_preset("MXFP4_MOE", "mainline").ftype("mainline") == 38


def test_mainline_only_and_ik_only_low_bit_presets(tmp_path):
    """TQ1_0/TQ2_0 are mainline presets of types ik_llama.cpp cannot load, IQ1_BN/IQ2_BN and the _R4 presets
    ik ones of types mainline cannot load: each flavor refuses the other's, saying which flavor has it."""
    src = write_llama(tmp_path / "m.gguf", n_layer=2)
    for name in ("TQ1_0", "tq2_0"):
        with pytest.raises(QuantkitError, match=rf"--flavor ik: ik_llama.cpp cannot load {name.lower()} .*"
                                                rf"use --flavor mainline"):
            quantkit.plan_quantize(src, name)
        assert quantkit.plan_quantize(src, name, flavor="mainline").preset.name == name.upper()
    for name in ("IQ1_BN", "IQ2_BN", "IQ2_BN_R4", "IQ1_S_R4", "IQ3_XXS_R4"):      # also ggml type names
        with pytest.raises(QuantkitError, match=r"--flavor mainline: mainline llama.cpp cannot load .*use --flavor ik"):
            quantkit.plan_quantize(src, name, flavor="mainline")
    for name, other, flavor in (("IQ2_M_R4", "ik", "mainline"), ("MXFP4_MOE", "mainline", "ik")):   # presets only
        with pytest.raises(QuantkitError, match=rf"TYPE: {name} is an? {other} preset, not an? {flavor} one: "
                                                rf"add --flavor {other}"):
            quantkit.plan_quantize(src, name, flavor=flavor)


# ---------------------------------------------------------------------------------- presets, TYPE, --pure
def test_find_preset_names_aliases_numbers_and_flavors():
    assert find_preset("q4_k_m").name == "Q4_K_M"
    assert find_preset("Q4_K").name == find_preset("q4_k").name == "Q4_K_M"
    assert find_preset("q3_K").name == "Q3_K_M" and find_preset("Q5_K").name == "Q5_K_M"
    assert find_preset("15").name == "Q4_K_M" and find_preset("140").name == "IQ4_K"
    assert find_preset("iq4_k", "mainline") is None and find_preset("140", "mainline") is None
    assert find_preset("tq1_0") is None and find_preset("tq1_0", "mainline").ftype("mainline") == 36
    assert find_preset("mxfp4_moe", "mainline").default_type == T.MXFP4
    assert find_preset("q1_0", "mainline").ftype("mainline") == 40
    assert find_preset("IQ3_KL").default_type == T.IQ3_K and find_preset("IQ3_KL").ftype("ik") == 146
    assert find_preset("q4_0_x") is None


def test_single_type_presets_write_the_types_ftype():
    for p in PRESETS.values():
        try:
            same = type_from_name(p.name) == p.default_type
        except ValueError:
            continue
        if same and traits(p.default_type).ftype is not None:
            for flavor, n in p.ftypes.items():
                assert n == traits(p.default_type).ftype, (p.name, flavor)


def test_pure_and_float_presets_skip_the_mix():
    plan, types, _ = plan_for(llama_tensors(), "Q4_K_M", "ik", pure=True)
    assert {types[n] for n in types if "norm" not in n} == {T.Q4_K}
    assert plan.file_type == 15                 # still the preset's ftype
    _, types, _ = plan_for(llama_tensors(), "F16", "ik")
    assert {types[n] for n in types if "norm" not in n} == {T.F16}


def test_iq1_r4_interleave_fallback_rechecks_the_row_length():
    """iq1_s_r4/iq1_m_r4 have 32-blocks, their plain layouts 256-blocks: where a tensor cannot be interleaved
    (token embeddings, a row count not a multiple of 4) a 576-wide row does not fit the plain type either,
    and falls back as that type does (the C tools write iq1_s there and fail)."""
    tensors = [_t("token_embd.weight", (576, 512)), _t("blk.0.attn_k.weight", (576, 6)),
               _t("blk.0.attn_q.weight", (576, 8)), _t("blk.0.ffn_up.weight", (512, 6))]
    for qtype, plain in ((T.IQ1_S_R4, T.IQ1_S), (T.IQ1_M_R4, T.IQ1_M)):
        plan = make_plan(tensors, PlanOptions(default_type=qtype, pure=True, model=ModelInfo(arch="llama", n_layer=1)))
        by = {tp.name: tp for tp in plan.tensors}
        assert by["blk.0.attn_q.weight"].dst_type == qtype
        for name in ("token_embd.weight", "blk.0.attn_k.weight"):
            assert by[name].dst_type == T.IQ4_NL and by[name].requested == qtype, name
            assert by[name].notes[-1] == (f"row length 576 is not a multiple of {type_name(plain)}'s block 256: "
                                          f"using iq4_nl")
        assert by["blk.0.ffn_up.weight"].dst_type == plain       # 512 fits the plain type
        assert all(tp.nbytes_out for tp in plan.tensors)


def test_recipe_overrides_the_preset_and_leave_output():
    recipe = load_recipe(["ffn_down=q5_0"])
    plan, types, by = plan_for(llama_tensors(), "Q4_K_M", "ik", recipe=recipe, leave_output_tensor=True)
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(32)} == {T.Q5_0}
    assert by["blk.0.ffn_down.weight"].rule == "ffn_down=q5_0"
    assert types["blk.0.attn_v.weight"] == T.Q6_K and by["blk.0.attn_v.weight"].rule == "Q4_K_M mix"
    assert types["output.weight"] == T.F32


def test_type_argument_presets_win_over_type_names(tmp_path):
    src = write_llama(tmp_path / "m.gguf", n_layer=2)
    plan = quantkit.plan_quantize(src, "q4_0")   # the Q4_0 preset: output.weight gets q6_K, as in llama-quantize
    by = targets(plan)
    assert plan.preset.name == "Q4_0" and by["output.weight"] == "q6_K" and by["blk.0.attn_q.weight"] == "q4_0"
    plan = quantkit.plan_quantize(src, "q4_0", pure=True)
    assert targets(plan)["output.weight"] == "q4_0"
    # not a preset in mainline (ik's MXFP4 is mainline's MXFP4_MOE): a plain type, every tensor gets it
    plan = quantkit.plan_quantize(src, "mxfp4", flavor="mainline")
    assert plan.preset is None and {type_name(tp.dst_type) for tp in plan.tensors if tp.action != "copy"} == {"mxfp4"}
    # a type mainline llama.cpp does not define is refused (tests/test_types_cli.py has the cases)
    with pytest.raises(QuantkitError, match="mainline llama.cpp cannot load q6_0"):
        quantkit.plan_quantize(src, "q6_0", flavor="mainline")
    plan = quantkit.plan_quantize(src, "Q4_K", flavor="mainline")
    assert plan.preset.name == "Q4_K_M" and plan.file_type == 15
    with pytest.raises(QuantkitError, match="unknown type 'Q4_K_Z'"):
        quantkit.quantize_model(src, tmp_path / "o.gguf", "Q4_K_Z")


# ---------------------------------------------------------------------------------- (3) imatrix required
def _imatrix_error(preset, flavor, tensors=None, imatrix_given=False, covered=(), **kw):
    model = ModelInfo(arch="llama", n_layer=4, n_head=32, n_head_kv=8)
    plan, _, _ = plan_for(tensors or llama_tensors(n_layer=4), preset, flavor, model=model, **kw)
    check_imatrix(plan, imatrix_given, lambda tp: tp.name in covered)


@pytest.mark.parametrize("preset", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K_S", "IQ2_XXS_R4",
                                    "IQ1_S_R4", "IQ1_M_R4"])
def test_ik_presets_that_need_an_imatrix(preset):
    with pytest.raises(QuantkitError, match=r"this quantization requires an imatrix! Please do not use .* without "
                                            r"an importance matrix"):
        _imatrix_error(preset, "ik")


# mainline visits tensors in its loader's order (by layer, then by name): attn_k comes first
# mainline refuses in its first pass, naming the first tensor that needs one; it has no per-preset refusal
@pytest.mark.parametrize("preset,target", [("IQ2_XXS", "iq2_xxs"), ("Q2_K_S", "q2_K"), ("IQ3_XXS", "iq2_s"),
                                           ("IQ1_S", "iq1_s"), ("IQ2_M", "iq2_s"),
                                           ("IQ3_XS", "iq3_xxs")])       # iq3_xxs needs one in mainline only
def test_mainline_needs_an_imatrix(preset, target):
    with pytest.raises(QuantkitError, match=rf"^this quantization requires an imatrix! offending tensor: "
                                            rf"blk\.0\.attn_k\.weight, target type: {target}; pass --imatrix FILE$"):
        _imatrix_error(preset, "mainline")
    if preset == "IQ3_XS":
        _imatrix_error(preset, "ik")


@pytest.mark.parametrize("preset", ["IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0", "MXFP4_MOE"])
def test_mainline_mixes_that_need_no_imatrix(preset):
    _imatrix_error(preset, "mainline")


@pytest.mark.parametrize("flavor", ["ik", "mainline"])
def test_missing_imatrix_entry(flavor):
    names = [t.name for t in llama_tensors(n_layer=4)]
    covered = set(names) - {"blk.2.ffn_up.weight"}
    with pytest.raises(QuantkitError) as e:
        _imatrix_error("IQ2_XXS", flavor, imatrix_given=True, covered=covered, has_imatrix=True)
    assert str(e.value).startswith("Missing importance matrix for tensor blk.2.ffn_up.weight in a very low-bit "
                                   "quantization")
    _imatrix_error("IQ2_XXS", flavor, imatrix_given=True, covered=set(names), has_imatrix=True)   # all there: fine


def test_imatrix_not_needed_for_embeddings_output_or_plain_q2_k():
    covered = {t.name for t in llama_tensors(n_layer=4)} - {"token_embd.weight", "output.weight"}
    _imatrix_error("IQ2_XXS", "mainline", imatrix_given=True, covered=covered, has_imatrix=True,
                   token_embedding_type=T.IQ2_XXS, output_tensor_type=T.IQ2_XXS)
    _imatrix_error("Q2_K", "ik")
    _imatrix_error("Q2_K", "mainline")
    # ik's trellis types IQ1_KT/IQ2_KT need one too; mainline has neither type
    with pytest.raises(QuantkitError, match="iq1_kt"):
        _imatrix_error("Q4_K_M", "ik", recipe=load_recipe(["ffn_up=iq1_kt"]))


def test_imatrix_required_dry_run_notes_real_run_fails(tmp_path, capsys):
    src = write_llama(tmp_path / "m.gguf", n_layer=2)
    out = tmp_path / "o.gguf"
    with quantkit.open_quantization(src, out, "iq2_xxs") as q:
        assert any("this quantization requires an imatrix!" in str(p) for p in q.problems)
    # the CLI's dry run shows the plan and notes the problem
    assert main(["quantize", str(src), str(out), "iq2_xxs", "--dry-run"]) == 0
    assert "a real run would stop here: this quantization requires an imatrix!" in capsys.readouterr().err
    with pytest.raises(QuantkitError) as e:
        quantkit.quantize_model(src, out, "iq2_xxs", flavor="mainline")
    assert not out.exists()
    assert ("this quantization requires an imatrix! offending tensor: blk.0.attn_k.weight, target type: iq2_xxs"
            in str(e.value))


def test_ignore_imatrix_rules(tmp_path):
    """--ignore-imatrix-rules (ik's llama-quantize flag) quantizes very-low-bit types without one."""
    src = write_llama(tmp_path / "m.gguf", n_layer=1)
    out = tmp_path / "o.gguf"
    with pytest.raises(QuantkitError, match="requires an imatrix"):
        quantkit.quantize_model(src, out, "iq2_kt", pure=True)
    assert not out.exists()
    quantkit.quantize_model(src, out, "iq2_kt", pure=True, ignore_imatrix_rules=True)
    with open_model(out) as m:
        assert {t.name: t.qtype for t in m.tensors}["blk.0.ffn_up.weight"] == T.IQ2_KT


@pytest.mark.parametrize("qtype", ["iq1_s", "iq2_xxs", "iq2_xs"])
def test_ignore_imatrix_rules_cannot_quantize_what_needs_weights(tmp_path, qtype):
    """--ignore-imatrix-rules lifts llama-quantize's refusal, but ggml's iq1_s / iq2_xxs / iq2_xs
    quantizers abort without importance weights: the plan says so (not "not implemented")."""
    src = write_llama(tmp_path / "m.gguf", n_layer=1)
    out = tmp_path / "o.gguf"
    with pytest.raises(QuantkitError, match=rf"{qtype} needs importance weights and the imatrix has none"):
        quantkit.quantize_model(src, out, qtype, pure=True, ignore_imatrix_rules=True)
    assert not out.exists()
