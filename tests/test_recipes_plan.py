"""Recipe parsing and per-tensor type selection (ik_llama.cpp --custom-q semantics)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from quantkit.errors import QuantkitError
from quantkit.plan import PlanOptions, make_plan
from quantkit.recipes import load_recipe
from quantkit.types import QuantType as T

from models import deepseek_v3_tensors


def _t(name, shape, qtype=T.F32):
    return NS(name=name, shape=shape, qtype=qtype)


def test_file_syntax_comments_blank_lines_and_trailing_comments(tmp_path):
    p = tmp_path / "r.txt"
    p.write_text("# header\n\nattn_v\\.weight=Q8_0   # values at 8 bits\n  ffn_.*=iq2_K_R4\n")
    r = load_recipe([str(p)])
    assert [(x.pattern, x.qtype) for x in r.rules] == [("attn_v\\.weight", T.Q8_0), ("ffn_.*", T.IQ2_K_R4)]
    assert r.rules[0].source == f"{p}:3"
    assert r.text == "attn_v\\.weight=q8_0\nffn_.*=iq2_k_r4"     # canonical names


def test_inline_comma_form_accumulates_in_order(tmp_path):
    r = load_recipe(["a=q8_0,b=q4_0", "c=f16"])
    assert [x.pattern for x in r.rules] == ["a", "b", "c"]


def test_first_match_wins_and_search_not_anchored():
    r = load_recipe(["output\\.weight=q8_0,attn_.*=q4_0"])
    # regex *search*: output\.weight is found inside attn_output.weight, and it comes first
    assert r.match("blk.3.attn_output.weight").qtype == T.Q8_0
    assert r.match("blk.3.attn_q.weight").qtype == T.Q4_0
    assert r.match("token_embd.weight") is None


@pytest.mark.parametrize("text,msg", [
    ("attn=q9_9\n", "unknown type 'q9_9'"),
    ("attn(=q8_0\n", "invalid regex"),
    ("# c\nno_equals_sign\n", "expected 'regex=type'"),
    ("=q8_0\n", "expected 'regex=type'"),
])
def test_bad_rules_name_file_and_line(tmp_path, text, msg):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(QuantkitError, match=msg) as e:
        load_recipe([str(p)])
    line = text.count("\n", 0, text.rindex(text.strip().splitlines()[-1])) + 1
    assert f"{p}:{line}" in str(e.value)


def test_missing_recipe_file():
    with pytest.raises(QuantkitError, match="not found"):
        load_recipe(["no/such/recipe.txt"])


def test_never_quantized_tensors_stay():
    tensors = [_t("blk.0.attn_norm.weight", (64,)), _t("blk.0.ffn_gate_inp.weight", (64, 8)),
               _t("blk.0.exp_probs_b.bias", (8,)), _t("blk.0.attn_q.weight", (64, 64)),
               _t("rope_freqs.weight", (32,))]
    plan = make_plan(tensors, PlanOptions(default_type=T.Q8_0))
    assert [p.dst_type for p in plan.tensors] == [T.F32, T.F32, T.F32, T.Q8_0, T.F32]


def test_token_embedding_and_output_options_win_over_recipe():
    tensors = [_t("token_embd.weight", (64, 100)), _t("output.weight", (64, 100)), _t("blk.0.attn_q.weight", (64, 64))]
    opts = PlanOptions(default_type=T.Q4_0, recipe=load_recipe([".*=q5_0"]),
                       token_embedding_type=T.Q8_0, output_tensor_type=T.F16)
    plan = make_plan(tensors, opts)
    assert [p.dst_type for p in plan.tensors] == [T.Q8_0, T.F16, T.Q5_0]
    assert plan.file_type == 2          # LLAMA_FTYPE_MOSTLY_Q4_0


def test_row_fallbacks_follow_ik_and_are_flagged():
    tensors = [_t("blk.0.attn_k_b.weight", (128, 512, 4)),      # DeepSeek MLA rows of 128
               _t("blk.0.attn_v_b.weight", (512, 128, 4)),
               _t("blk.0.ffn_down.weight", (1408, 2048)),
               _t("blk.0.odd.weight", (48, 8))]
    r = load_recipe(["attn_k_b=iq4_k,attn_v_b=iq4_k,ffn_down=iq6_k,odd=q4_0"])
    plan = make_plan(tensors, PlanOptions(recipe=r))
    assert [(p.requested, p.dst_type) for p in plan.tensors] == [
        (T.IQ4_K, T.Q5_0), (None, T.IQ4_K), (T.IQ6_K, T.Q8_0), (T.Q4_0, T.F16)]
    assert "not a multiple" in plan.tensors[0].notes[0]
    mainline = make_plan(tensors, PlanOptions(recipe=load_recipe(["attn_k_b=q2_K"]), flavor="mainline"))
    assert mainline.tensors[0].dst_type == T.Q4_0       # mainline: q2_K -> q4_0, ik: -> iq4_nl
    ik = make_plan(tensors, PlanOptions(recipe=load_recipe(["attn_k_b=q2_K"])))
    assert ik.tensors[0].dst_type == T.IQ4_NL
    with pytest.raises(QuantkitError, match="--strict"):
        make_plan(tensors, PlanOptions(recipe=r, strict=True))


def test_interleaved_fallbacks():
    tensors = [_t("token_embd.weight", (256, 1000)), _t("blk.0.attn_q.weight", (256, 6)),
               _t("blk.0.ffn_up_exps.weight", (256, 8, 4))]
    plan = make_plan(tensors, PlanOptions(default_type=T.IQ2_K_R4))
    assert [p.dst_type for p in plan.tensors] == [T.IQ2_K, T.IQ2_K, T.IQ2_K_R4]
    assert "never stored interleaved" in plan.tensors[0].notes[0]
    assert "6 rows" in plan.tensors[1].notes[0]


def test_requantize_needs_permission():
    tensors = [_t("blk.0.attn_q.weight", (64, 64), T.Q4_1), _t("blk.0.attn_k.weight", (64, 64), T.Q8_0)]
    with pytest.raises(QuantkitError, match="--allow-requantize"):
        make_plan(tensors, PlanOptions(default_type=T.Q8_0))
    plan = make_plan(tensors, PlanOptions(default_type=T.Q8_0, allow_requantize=True))
    assert [p.action for p in plan.tensors] == ["quantize", "copy"]   # same type: copied verbatim


def test_unused_and_shadowed_rules_warn():
    tensors = [_t("blk.0.attn_q.weight", (64, 64)), _t("blk.0.attn_norm.weight", (64,))]
    r = load_recipe(["attn_q=q8_0,attn_q\\.weight=q4_0,attn_norm=q8_0,nothing_here=q4_0"])
    plan = make_plan(tensors, PlanOptions(recipe=r))
    w = "\n".join(plan.warnings)
    assert "attn_q\\.weight=q4_0' matches only" in w
    assert "attn_norm=q8_0' matches only" in w
    assert "nothing_here=q4_0' matches no tensor" in w
    assert "attn_q=q8_0" not in w


def test_deepseek_v3_recipe_plan(repo_root):
    """ubergarm's DeepSeek-V3 IQ2_K_R4 recipe on the real 671B tensor table."""
    tensors = [_t(n, s, T(q)) for n, s, q in deepseek_v3_tensors()]
    opts = PlanOptions(default_type=T.IQ2_K_R4, recipe=load_recipe([str(repo_root / "recipes/deepseek-v3-iq2_k_r4.txt")]),
                       token_embedding_type=T.Q8_0, output_tensor_type=T.Q8_0)
    plan = make_plan(tensors, opts)
    by = {p.name: p for p in plan.tensors}
    assert by["blk.3.ffn_down_exps.weight"].dst_type == T.IQ3_K_R4
    assert by["blk.60.ffn_up_exps.weight"].dst_type == T.IQ2_K_R4
    assert by["blk.0.ffn_down.weight"].dst_type == T.Q8_0
    assert by["blk.10.attn_k_b.weight"].dst_type == T.Q8_0
    assert by["blk.10.ffn_gate_inp.weight"].dst_type == T.F32
    assert by["token_embd.weight"].rule == "--token-embedding-type"
    types = {r["group"]: r for r in plan.by_type()}
    assert set(types) == {"q8_0", "iq2_k_r4", "iq3_k_r4", "f32"}
    # the published model card (shared/seeds/001): "model size = 226.003 GiB (2.889 BPW)"
    assert round(plan.bytes_out / 2**30, 3) == 226.003
    assert round(8 * plan.bytes_out / plan.n_elements, 3) == 2.889
    assert types["iq2_k_r4"]["tensors"] == 2 * 58 and types["iq3_k_r4"]["tensors"] == 58
