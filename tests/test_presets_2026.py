"""Preset mixes on the 2026 architectures: qwen3, qwen3moe, glm4moe, gpt-oss, DeepSeek-V3.2 and Kimi-K2.

llama_tensor_get_type has no branch named after these architectures; what makes their mixes theirs is what
the rules read from them: expert counts (>= 4 and >= 8 in ik, == 8 in mainline), the GQA ratio, the layer
count (the first/last eighths, ``use_more_bits``; layers parsed from names with experts, counted in file
order without), Qwen3's MODEL_8B class with a >= 128k vocabulary, name substrings (ik's "attn_k" also
catches DeepSeek's attn_k_b, attn_kv_a_mqa and V3.2's indexer.attn_k; mainline's "attn_k.weight" only the
indexer's), GLM's NextN layer counted as a layer, gpt-oss's 2880-wide rows that no 256-block fits and its
experts already MXFP4.

ik flavor: checked against the wheel's llama-quantize --dry-run on tiny GGUFs shaped as the converters
write these models (tests/models.py; the data a hole: the dry run never reads it), and against real runs
where the dry run skips a check (requantizing gpt-oss's MXFP4 experts).  Mainline flavor (no binary at
hand): llama-quant.cpp's rules as written (@ 007dbbf) on the same files.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import peers
import quantkit
from models import write_deepseek32, write_glm4moe, write_gptoss, write_qwen3, write_qwen3moe
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.presets import PRESETS
from quantkit.types import QuantType as T, type_name
from test_presets import needs_wheel, targets, wheel_dry_run, write_ones_imatrix

# the real models' classes (layer and head counts; widths shrunk; 16 experts or more, see tests/models.py):
# what the rules look at
FAMILIES = {
    "qwen3_8b": lambda p: write_qwen3(p),                                       # MODEL_8B, vocab 151936, n_gqa 4
    "qwen3_4b": lambda p: write_qwen3(p, n_embd=2560, tied=True),               # MODEL_4B: tied, no 8B rules
    "qwen3_30b_a3b": lambda p: write_qwen3moe(p),                               # 48 layers, n_gqa 8
    "glm45_air": lambda p: write_glm4moe(p),                                    # 46 + NextN, 1 dense, n_gqa 12
    "glm46": lambda p: write_glm4moe(p, n_layer=92, n_dense=3, qk_norm=True),
    "gptoss_120b": lambda p: write_gptoss(p, n_layer=36),                       # MXFP4 experts, 2880-like rows
    "qwen3_30b_a3b_fused": lambda p: write_qwen3moe(p, fused_gate_up=True),   # ffn_gate_up_exps
    "gptoss_20b_fused": lambda p: write_gptoss(p, fused_gate_up=True),
    "deepseek32": lambda p: write_deepseek32(p),                                # 61 layers, 3 dense, indexer
    "kimi_k2": lambda p: write_deepseek32(p, index_n_heads=0, n_dense=1, n_group=1, n_group_used=1,
                                          vocab_size=163840),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = FAMILIES[name](tmp_path_factory.mktemp(name) / f"{name}.gguf")
        return made[name]
    return get


@pytest.fixture(scope="module")
def ones_imatrix(tmp_path_factory):
    made = {}

    def get(src):
        if src not in made:
            made[src] = write_ones_imatrix(src, tmp_path_factory.mktemp("imatrix") / "ones.dat")
        return made[src]
    return get


def plan_types(src, preset, **kw) -> dict[str, str]:
    return targets(quantkit.plan_quantize(src, preset, **kw))


# ---------------------------------------------------------------------------------- against the wheel
# Per family the presets whose rules its shapes steer: the _M mixes' layer counters and use_more_bits,
# the n_gqa bumps of attn_v (IQ4_XS, IQ3_S), the 8B/70B rules (Q5_K_S, IQ5_K), the expert-count branches
# of the IQ1/IQ2 tables, IQ3_XS's middle ffn_gate/up, IQ3_M/IQ3_KL's ffn_down, and the row fallbacks.
# Presets that need an imatrix (IQ3_XXS: for its iq2_s attn_q/attn_k) get unit weights; the others run without
# one (their no-imatrix branches).
_NEED_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ2_M_R4",
                 "IQ1_S_R4", "IQ1_M_R4", "Q2_K_S", "IQ2_KT", "IQ1_KT", "IQ3_XXS", "IQ3_XXS_R4"}
_COMMON = ["Q4_K_M", "Q3_K_M", "IQ4_XS", "IQ3_XS", "IQ2_KS"]
WHEEL_CASES = (
    [("qwen3_8b", p) for p in _COMMON + ["Q5_K_S", "IQ5_K", "IQ3_XXS", "IQ2_M"]]
    + [("qwen3_4b", p) for p in ["Q5_K_S", "Q4_K_M", "IQ2_XXS"]]
    + [("qwen3_30b_a3b", p) for p in _COMMON + ["IQ3_M", "IQ1_S_R4", "IQ2_XXS", "IQ3_KL"]]
    + [("qwen3_30b_a3b_fused", p) for p in ["IQ3_XS", "IQ3_KL", "Q4_K_M"]]
    + [("gptoss_20b_fused", p) for p in ["IQ3_XS", "IQ2_KS"]]
    + [("glm45_air", p) for p in _COMMON + ["IQ3_M", "IQ1_M_R4", "IQ2_KT"]]
    + [("glm46", p) for p in ["Q4_K_M", "IQ2_XXS"]]
    + [("gptoss_120b", p) for p in _COMMON + ["MXFP4", "Q5_K_S", "IQ4_K", "IQ1_BN", "IQ2_M"]]
    + [("deepseek32", p) for p in _COMMON + ["IQ3_M", "IQ1_S_R4", "Q4_0_8_8"]]
    + [("kimi_k2", p) for p in ["Q4_K_M", "IQ2_XXS", "IQ3_KS"]]
)


@needs_wheel
@pytest.mark.parametrize("name,preset", WHEEL_CASES)
def test_mix_matches_llama_quantize_dry_run(family, ones_imatrix, name, preset):
    src = family(name)
    imatrix = ones_imatrix(src) if preset in _NEED_IMATRIX else None
    rc, theirs, out = wheel_dry_run(src, preset, imatrix)
    assert rc == 0, out[-3000:]
    # the dry run skips the requantize check (gpt-oss's MXFP4 experts): see the real runs below
    plan = quantkit.plan_quantize(src, preset, imatrix=imatrix, allow_requantize=True)
    ours = {tp.name: tp.dst_type for tp in plan.tensors}
    assert ours.keys() == theirs.keys()
    wrong = {n: (type_name(ours[n]), type_name(theirs[n])) for n in ours if ours[n] != theirs[n]}
    assert not wrong, f"{name} {preset}: quantkit vs llama-quantize --dry-run: {wrong}"
    assert plan.file_type == PRESETS[preset].ftype("ik")


@needs_wheel
@pytest.mark.parametrize("name,first", [("qwen3_8b", "blk.0.attn_k.weight"), ("glm45_air", "blk.0.attn_q.weight"),
                                        ("deepseek32", "blk.0.indexer.attn_q_b.weight"),
                                        ("kimi_k2", "blk.0.attn_q_a.weight")])
def test_iq3_xxs_without_imatrix_stops_on_the_same_tensor(family, name, first):
    """IQ3_XXS gives attn_q/attn_k (ik: every name holding them, attn_q_a included) iq2_s, which needs an
    imatrix: both stop on the first such tensor in file order, which the checkpoint's sorted names decide
    (Qwen3's self_attn.k_proj comes before q_proj, V3.2's self_attn.indexer.wq_b before q_a_proj)."""
    src = family(name)
    rc, _, out = wheel_dry_run(src, "IQ3_XXS")
    assert rc != 0 and f"Missing importance matrix for tensor {first} in a very low-bit quantization" in out
    with quantkit.open_quantization(src, None, "IQ3_XXS") as q:
        assert q.problems and str(q.problems[0]).startswith(
            f"this quantization requires an imatrix! Missing importance matrix for tensor {first} "
            f"in a very low-bit quantization (iq2_s)"), q.problems


# ---------------------------------------------------------------------------------- the rules, spelled out
def test_qwen3_8b_class_big_vocab_rules(family):
    """36 layers and a width other than 2560 make Qwen3 MODEL_8B in ik, and its vocabulary is >= 127999:
    Q5_K_S gives attn_v q6_K and attn_q q4_K; the 4B (width 2560, tied embeddings) keeps q5_K for both and
    its token embeddings take the output's rule."""
    by = plan_types(family("qwen3_8b"), "Q5_K_S")
    assert (by["blk.0.attn_v.weight"], by["blk.0.attn_q.weight"], by["blk.0.attn_k.weight"]) == ("q6_K", "q4_K", "q5_K")
    by = plan_types(family("qwen3_4b"), "Q5_K_S")
    assert (by["blk.0.attn_v.weight"], by["blk.0.attn_q.weight"], by["token_embd.weight"]) == ("q5_K", "q5_K", "q6_K")
    # mainline asks only for MODEL_70B
    by = plan_types(family("qwen3_8b"), "Q5_K_S", flavor="mainline")
    assert (by["blk.0.attn_v.weight"], by["blk.0.attn_q.weight"]) == ("q5_K", "q5_K")


def test_qwen3_dense_counters_run_in_file_order(family):
    """Without experts ffn_down's layer is the running count of ffn_down tensors, in the file's order: a
    converted checkpoint lists layers 0, 1, 10, 11, …, so blk.10 is the third (first eighth of 36: q6_K in
    Q4_K_M) and blk.3 the 26th."""
    src = family("qwen3_8b")
    with open_model(src) as m:
        downs = [t.name for t in m.tensors if "ffn_down" in t.name]
    assert downs[:4] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.10.ffn_down.weight",
                         "blk.11.ffn_down.weight"]
    by = plan_types(src, "Q4_K_M")
    more = lambda i, n=36: i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2  # noqa: E731
    for k, name in enumerate(downs):
        assert by[name] == ("q6_K" if more(k) else "q4_K"), (k, name)
    assert by["blk.10.ffn_down.weight"] == "q6_K" and by["blk.3.ffn_down.weight"] == "q4_K"


def test_moe_layers_from_names_and_expert_bumps(family):
    """qwen3moe (>= 8 experts): layers parsed from the names, attn_v/attn_k q8_0, attn_output q5_K (>= 4
    experts); mainline bumps those only for exactly 8 experts (Mixtral)."""
    src = family("qwen3_30b_a3b")
    more = lambda i, n=48: i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2  # noqa: E731
    by = plan_types(src, "Q4_K_M")
    for i in range(48):
        assert by[f"blk.{i}.ffn_down_exps.weight"] == ("q6_K" if more(i) else "q4_K"), i
    assert [by[f"blk.5.{t}.weight"] for t in ("attn_v", "attn_k", "attn_q", "attn_output")] == \
        ["q8_0", "q8_0", "q4_K", "q5_K"]
    ml = plan_types(src, "Q4_K_M", flavor="mainline")
    assert [ml[f"blk.5.{t}.weight"] for t in ("attn_k", "attn_q", "attn_output")] == ["q4_K", "q4_K", "q4_K"]
    assert all(ml[f"blk.{i}.ffn_down_exps.weight"] == ("q6_K" if more(i) else "q4_K") for i in range(48))
    # ik's IQ1_S_R4 table: with >= 8 experts attn_k/attn_q q4_k_r4 and blk.0's experts iq3_k_r4
    by = plan_types(src, "IQ1_S_R4")
    assert by["blk.7.attn_q.weight"] == by["blk.7.attn_k.weight"] == "q4_k_r4"
    assert by["blk.0.ffn_up_exps.weight"] == "iq3_k_r4" and by["blk.1.ffn_up_exps.weight"] == "iq1_s_r4"


def test_fused_gate_up_experts_count_as_ffn_gate(family):
    """ffn_gate_up_exps holds "ffn_gate" (and not "ffn_up"): both forks give it ffn_gate's rules, e.g. IQ3_XS's
    iq3_xxs in the middle layers (n/8 <= i < 7n/8) and iq3_s at the ends; ffn_up has no tensor left."""
    src = family("qwen3_30b_a3b_fused")
    for flavor in ("ik", "mainline"):
        by = plan_types(src, "IQ3_XS", flavor=flavor)
        assert [by[f"blk.{i}.ffn_gate_up_exps.weight"] for i in (5, 6, 41, 42)] == \
            ["iq3_s", "iq3_xxs", "iq3_xxs", "iq3_s"], flavor
    by = plan_types(src, "IQ3_KL")      # ik: use_more_bits layers iq4_ks, the rest iq3_k
    assert [by[f"blk.{i}.ffn_gate_up_exps.weight"] for i in (0, 6, 7, 8)] == ["iq4_ks", "iq3_k", "iq3_k", "iq4_ks"]


def test_glm4moe_nextn_layer_is_a_layer(family):
    """block_count counts GLM's NextN layer (46 of 0-46 in GLM-4.5-Air): its experts are in the last eighth;
    its embed_tokens/shared_head_head are neither token_embd nor output to the rules (default type), and
    the q/k/v biases stay f32."""
    src = family("glm45_air")
    by = plan_types(src, "Q4_K_M")
    assert by["blk.46.ffn_down_exps.weight"] == by["blk.46.ffn_down_shexp.weight"] == "q6_K"
    assert by["blk.20.ffn_down_exps.weight"] == "q4_K" and by["blk.0.ffn_down.weight"] == "q6_K"
    assert by["blk.46.nextn.embed_tokens.weight"] == by["blk.46.nextn.shared_head_head.weight"] == "q4_K"
    assert by["blk.46.nextn.eh_proj.weight"] == "q4_K" and by["output.weight"] == "q6_K"
    assert by["blk.46.attn_q.bias"] == "f32" and by["blk.46.nextn.enorm.weight"] == "f32"
    # ik's IQ2_XXS: the >= 8 experts rule takes attn_q/attn_k to q4_K; mainline (== 8) does not
    assert plan_types(src, "IQ2_XXS")["blk.3.attn_q.weight"] == "q4_K"
    assert plan_types(src, "IQ2_XXS", flavor="mainline")["blk.3.attn_q.weight"] == "iq2_xxs"


def test_gptoss_rows_fall_back_by_flavor(family):
    """gpt-oss's width is a multiple of 64, not 256: the k-quant targets fall back, and the forks differ
    (ik: q4_K -> q5_0, q5_K -> q6_0, q6_K -> q8_0; mainline: q5_K -> q5_1); the output goes q8_0."""
    src = family("gptoss_120b")
    by = plan_types(src, "Q5_K_S", allow_requantize=True)
    assert by["blk.0.attn_q.weight"] == by["blk.0.ffn_up_exps.weight"] == "q6_0"
    assert by["blk.0.attn_output.weight"] == "q5_K"        # rows of n_head x head_dim fit
    ml = plan_types(src, "Q5_K_S", allow_requantize=True, flavor="mainline")
    assert ml["blk.0.attn_q.weight"] == ml["blk.0.ffn_up_exps.weight"] == "q5_1"
    by = plan_types(src, "Q4_K_M", allow_requantize=True)
    assert by["blk.0.ffn_down_exps.weight"] == "q8_0" and by["blk.13.ffn_down_exps.weight"] == "q5_0"
    assert by["output.weight"] == "q8_0" and by["blk.0.attn_sinks.weight"] == "f32"


def test_gptoss_mxfp4_presets_keep_the_experts(family):
    """ik's MXFP4 and mainline's MXFP4_MOE leave the MXFP4 experts as they are (a copy: no requantizing);
    MXFP4_MOE puts every other matrix at q8_0, ik's MXFP4 only attn_k/attn_v (>= 4 experts) and the output
    (rows off 256)."""
    src = family("gptoss_120b")
    plan = quantkit.plan_quantize(src, "MXFP4")
    by = {tp.name: tp for tp in plan.tensors}
    assert by["blk.3.ffn_up_exps.weight"].action == "copy" and by["blk.3.ffn_down_exps.weight"].action == "copy"
    assert [type_name(by[f"blk.3.{t}.weight"].dst_type) for t in ("attn_q", "attn_k", "attn_v")] == \
        ["mxfp4", "q8_0", "q8_0"]
    assert type_name(by["output.weight"].dst_type) == "q8_0"
    plan = quantkit.plan_quantize(src, "MXFP4_MOE", flavor="mainline")
    for tp in plan.tensors:
        if "_exps.weight" in tp.name:
            assert tp.action == "copy" and tp.dst_type == T.MXFP4, tp.name
        elif tp.name.endswith("weight") and len(tp.shape) > 1 and tp.action != "copy":
            assert tp.dst_type == T.Q8_0, tp.name
    assert next(tp for tp in plan.tensors if tp.name == "blk.0.ffn_gate_inp.weight").action == "copy"


def test_gptoss_requantizing_the_mxfp4_experts_needs_the_option(family):
    with pytest.raises(QuantkitError, match="blk.0.ffn_down_exps.weight' is already mxfp4: requantizing it to "
                                            "q8_0 needs --allow-requantize"):
        quantkit.plan_quantize(family("gptoss_120b"), "Q4_K_M")


def test_deepseek32_indexer_tensors_by_flavor(family):
    """V3.2's indexer: ik's "attn_k" substring rule gives indexer.attn_k (as attn_k_b and attn_kv_a_mqa) q8_0
    with >= 4 experts, "attn_q" puts indexer.attn_q_b under the attn_q rules (IQ3_XS: iq3_xxs); mainline
    files indexer.attn_k under attn_k ("attn_k.weight" is in its name: IQ3_XS gives iq3_xxs) and
    indexer.attn_q_b under no category.  indexer.proj takes the default, k_norm (and its bias) stays f32."""
    src = family("deepseek32")
    names = ["indexer.attn_k", "indexer.attn_q_b", "attn_q_b", "indexer.proj", "attn_k_b", "attn_kv_a_mqa"]
    by = plan_types(src, "IQ3_XS")
    assert [by[f"blk.7.{n}.weight"] for n in names] == ["q8_0", "iq3_xxs", "iq3_xxs", "iq3_s", "q8_0", "q8_0"]
    ml = plan_types(src, "IQ3_XS", flavor="mainline")
    # attn_k_b's 128-wide rows fall back from iq3_s to iq4_nl
    assert [ml[f"blk.7.{n}.weight"] for n in names] == ["iq3_xxs", "iq3_s", "iq3_s", "iq3_s", "iq4_nl", "iq3_s"]
    assert by["blk.7.indexer.k_norm.weight"] == by["blk.7.indexer.k_norm.bias"] == "f32"
    ml = plan_types(src, "Q4_K_M", flavor="mainline")
    assert ml["blk.7.indexer.attn_k.weight"] == "q4_K" and ml["blk.7.attn_k_b.weight"] == "q5_0"


def test_ik_arm_layouts_fall_back_per_row_group(tmp_path):
    """ik's interleaved_properties knows q4_0_4x4/4x8 (4 rows) and q4_0_8x8 (8): token embeddings and a
    V3.2 indexer.proj with 4 rows (4 indexer heads) fall back to q4_0, as for the _r4/_r8 layouts."""
    src = write_deepseek32(tmp_path / "ds.gguf", n_layer=4, n_dense=1, index_n_heads=4)
    by = plan_types(src, "Q4_0_8_8")
    assert by["token_embd.weight"] == "q4_0" and by["blk.1.indexer.proj.weight"] == "q4_0"
    assert by["blk.1.indexer.attn_k.weight"] == "q8_0" and by["blk.1.attn_q_b.weight"] == "q4_0_8x8"
    by = plan_types(src, "Q4_0_4_4")
    assert by["token_embd.weight"] == "q4_0" and by["blk.1.indexer.proj.weight"] == "q4_0_4x4"
    if peers.llama_quantize_bin() is not None:
        for preset in ("Q4_0_8_8", "Q4_0_4_4"):
            rc, theirs, out = wheel_dry_run(src, preset)
            assert rc == 0 and {n: type_name(t) for n, t in theirs.items()} == plan_types(src, preset), out[-2000:]


# ---------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def gptoss_small(tmp_path_factory):
    # real data this time: 2 layers of 32 MXFP4 experts
    return write_gptoss(tmp_path_factory.mktemp("gptoss") / "gptoss.gguf", n_layer=2, sparse=False)


def _wheel_run(src, out, preset, *extra):
    return subprocess.run([str(peers.llama_quantize_bin()), *extra, str(src), str(out), preset, "2"],
                          capture_output=True, text=True, timeout=600)


@needs_wheel
def test_gptoss_real_runs_refuse_and_copy_like_llama_quantize(gptoss_small, tmp_path):
    """What the dry run does not check: a real llama-quantize refuses to requantize the MXFP4 experts
    without --allow-requantize (as quantkit does), and with MXFP4 copies them byte for byte."""
    p = _wheel_run(gptoss_small, tmp_path / "q8.gguf", "Q8_0")
    assert p.returncode != 0 and "requantizing from type mxfp4 is disabled" in p.stdout + p.stderr
    with pytest.raises(QuantkitError, match="already mxfp4: requantizing it to q8_0 needs --allow-requantize"):
        quantkit.plan_quantize(gptoss_small, "Q8_0")

    out = tmp_path / "mxfp4.gguf"
    p = _wheel_run(gptoss_small, out, "MXFP4")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    plan = quantkit.plan_quantize(gptoss_small, "MXFP4")
    with open_model(out) as theirs, open_model(gptoss_small) as src:
        assert {t.name: T(t.qtype) for t in theirs.tensors} == {tp.name: tp.dst_type for tp in plan.tensors}
        mine = {t.name: t for t in src.tensors}
        for t in theirs.tensors:
            if t.name.endswith("_exps.weight"):
                assert t.qtype == T.MXFP4 and np.array_equal(t.raw(), mine[t.name].raw()), t.name
