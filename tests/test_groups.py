"""Tensor groups and their candidate types (quantkit/groups.py), and the recipes written from a
choice (quantkit/recipe_emit.py): the emitted rules, given back to the planner as a --custom-q file
or a --tensor-type-file, write exactly the chosen types and the predicted bytes."""
from __future__ import annotations

import random
import re
import subprocess

import pytest

import peers
from models import deepseek_v3_tensors, rewrite_gguf, write_deepseek2, write_sparse

from quantkit import api
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.groups import MIXED, make_groups, parse_budget
from quantkit.placement import parse_placement
from quantkit.plan import PlanOptions, make_plan
from quantkit.recipe_emit import (check_reproduces, compact_rules, custom_q_arg, layers_regex, names_regex,
                                  recipe_text, tensor_type_file_text)
from quantkit.recipes import parse_recipe_text, parse_tensor_type
from quantkit.speed import plan_speed
from quantkit.tensor_regex import compile_bounded
from quantkit.types import QuantType as T, type_from_name

IK_TYPES = [type_from_name(n) for n in "q8_0 q6_K q5_K q4_K iq4_k iq4_ks iq3_k iq2_k q4_K_r4".split()]
MAINLINE_TYPES = [type_from_name(n) for n in "q8_0 q6_K q5_K q4_K q3_K q2_K iq4_xs".split()]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with open_model(smollm2_path) as m:
        yield m


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    return write_deepseek2(tmp_path_factory.mktemp("groups") / "ds.gguf")


@pytest.fixture(scope="module")
def deepseek(deepseek_path):
    with open_model(deepseek_path) as m:
        yield m


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """DeepSeek-V3's tensor table (61 layers, 3 dense), sparse: planned, never read."""
    path = write_sparse(tmp_path_factory.mktemp("groups") / "dsv3.gguf", "deepseek2",
                        {"deepseek2.block_count": 61, "deepseek2.expert_count": 256,
                         "deepseek2.expert_used_count": 8}, deepseek_v3_tensors())
    with open_model(path) as m:
        yield m


def random_choice(gs, seed):
    rng = random.Random(seed)
    return {g.key: rng.choice(g.options).qtype for g in gs.groups}


def plan_types(plan):
    return {tp.name: tp.dst_type for tp in plan.tensors}


# --------------------------------------------------------------------------- groups
def test_smollm2_groups(smollm2):
    gs = make_groups(smollm2, IK_TYPES)
    keys = [g.key for g in gs.groups]
    # 30 layers x (attn, ffn_up_gate, ffn_down) and the token embeddings (the output is tied)
    assert len(keys) == len(set(keys)) == 91
    assert keys[0] == "token_embd" and "output" not in keys
    g = gs.group("blk.7.ffn_up_gate")
    assert g.kind == "ffn_up_gate" and g.layers == (7,) and g.device == "cpu"
    assert sorted(g.tensors) == ["blk.7.ffn_gate.weight", "blk.7.ffn_up.weight"]
    assert sorted(gs.group("blk.7.attn").tensors) == [f"blk.7.attn_{n}.weight" for n in ("k", "output", "q", "v")]
    grouped = {n for g in gs.groups for n in g.tensors}
    assert set(gs.kept) == {t.name for t in smollm2.tensors} - grouped
    assert all(n.endswith("_norm.weight") for n in gs.kept)
    assert gs.fixed == {"cpu": sum(t.nbytes for t in smollm2.tensors if t.name in gs.kept)}
    assert gs.n_elements == sum(t.n_elements for t in smollm2.tensors)
    for g in gs.groups:         # options are distinct by the types they write
        assert len({tuple(sorted(o.types.items())) for o in g.options}) == len(g.options)


def test_options_are_the_planners_fallbacks(smollm2):
    """Rows of 576 (SmolLM2's width) are no multiple of 256: the k-quants fall back as the planner
    says; the rule type is the one written when all of a group's tensors fall back alike."""
    gs = make_groups(smollm2, IK_TYPES)
    attn, down = gs.group("blk.3.attn"), gs.group("blk.3.ffn_down")
    for qtype in IK_TYPES:
        plan = make_plan(smollm2.tensors, PlanOptions(default_type=qtype, allow_requantize=True))
        written = plan_types(plan)
        for g in (attn, down):
            o = next((o for o in g.options if o.types == {n: written[n] for n in g.tensors}), None)
            assert o is not None or type_from_name("q4_k_r4") == qtype and g is attn
            if o is not None:
                assert o.file_bytes == sum(o.nbytes.values()) == sum(tp.nbytes_out for tp in plan.tensors
                                                                      if tp.name in g.tensors)
    # q4_K on 576-long rows is q5_0 (ik), and the option's rule says q5_0; ffn_down's rows (1536) keep q4_K
    assert attn.option(T.Q5_0).types == {n: T.Q5_0 for n in attn.tensors}
    assert down.option(T.Q4_K).types == {"blk.3.ffn_down.weight": T.Q4_K}
    assert all(o.qtype != T.Q4_K for o in attn.options)


def test_interleaved_only_on_cpu_and_never_for_token_embd(deepseek):
    gs = make_groups(deepseek, IK_TYPES, parse_placement([r"exps=cpu"], gpu=True))
    r4 = type_from_name("q4_k_r4")
    for g in gs.groups:
        has_r4 = any(o.qtype == r4 for o in g.options)
        assert has_r4 == (g.device == "cpu" and g.kind != "token_embd"), g.key
        assert g.device == ("cpu" if g.kind.endswith("_exps") or g.kind == "token_embd" else "gpu"), g.key
        for o in g.options:
            assert set(o.nbytes) == set(o.bytes_per_token) == {g.device}
    # all on the CPU: every group may be interleaved but the token embeddings
    gs = make_groups(deepseek, IK_TYPES)
    assert [g.key for g in gs.groups if not any(o.qtype == r4 for o in g.options)] == ["token_embd"]


def test_ffn_up_and_gate_on_two_devices_is_one_mixed_group(deepseek):
    gs = make_groups(deepseek, IK_TYPES, parse_placement([r"ffn_up_exps=cpu"], gpu=True))
    g = gs.group("blk.2.ffn_up_gate_exps")
    assert g.device == MIXED
    assert all(set(o.nbytes) == {"cpu", "gpu"} for o in g.options)
    assert not any(o.qtype == type_from_name("q4_k_r4") for o in g.options)


def test_layer_spans(deepseek):
    gs = make_groups(deepseek, IK_TYPES, layer_span=2)
    keys = [g.key for g in gs.groups]
    assert "blk.0-1.attn" in keys and "blk.2-3.attn" in keys
    assert "blk.0.ffn_down" in keys                     # the one dense layer
    assert "blk.1.ffn_down_exps" in keys and "blk.2-3.ffn_down_exps" in keys
    assert gs.group("blk.2-3.ffn_up_gate_exps").layers == (2, 3)
    assert sum(g.n_elements for g in gs.groups) == sum(g.n_elements for g in make_groups(deepseek, IK_TYPES).groups)
    # a span is split where the device changes
    gs = make_groups(deepseek, IK_TYPES, parse_placement([r"blk\.2\.ffn_down_exps=cpu"], gpu=True), layer_span=4)
    assert [g.key for g in gs.groups if g.kind == "ffn_down_exps"] == ["blk.1.ffn_down_exps", "blk.2.ffn_down_exps",
                                                                      "blk.3.ffn_down_exps"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(QuantkitError, match="layer span"):
            make_groups(deepseek, IK_TYPES, layer_span=bad)


def test_bytes_per_token_are_the_active_experts(deepseek):
    gs = make_groups(deepseek, IK_TYPES)
    o = gs.group("blk.2.ffn_down_exps").option(T.Q8_0)
    assert o.bytes_per_token["cpu"] * 4 == o.nbytes["cpu"] * 2      # 2 of 4 experts
    o = gs.group("blk.2.attn").option(T.Q8_0)
    assert o.bytes_per_token == o.nbytes
    o = gs.group("token_embd").option(T.Q8_0)
    assert o.bytes_per_token["cpu"] * 512 == o.nbytes["cpu"]         # one row of 512


def test_imatrix_rules(deepseek):
    iq2_xxs = type_from_name("iq2_xxs")
    with pytest.raises(QuantkitError, match="iq2_xxs needs importance weights"):
        make_groups(deepseek, [iq2_xxs, T.Q8_0])
    gs = make_groups(deepseek, [iq2_xxs, T.Q8_0], has_imatrix=True)
    # no imatrix covers the token embeddings: iq2_xxs cannot be quantized there
    assert [o.qtype for o in gs.group("token_embd").options] == [T.Q8_0]
    assert iq2_xxs in [o.qtype for o in gs.group("blk.2.ffn_down_exps").options]
    # an imatrix without this tensor
    gs = make_groups(deepseek, [iq2_xxs, T.Q8_0], has_imatrix=True, has_entry=lambda n: "exps" not in n)
    assert [o.qtype for o in gs.group("blk.2.ffn_down_exps").options] == [T.Q8_0]
    with pytest.raises(QuantkitError, match="group token_embd: none of the candidate types"):
        make_groups(deepseek, [iq2_xxs], has_imatrix=True)


def test_a_loaded_imatrix_says_which_tensors_have_weights(deepseek, tmp_path):
    import numpy as np
    from quantkit.imatrix import load_imatrix, save_dat
    iq2_xxs = type_from_name("iq2_xxs")
    weights = {"blk.2.ffn_down_exps.weight": np.ones(256 * 4, np.float32),
               "blk.2.attn_output.weight": np.ones(512, np.float32)}
    imat = load_imatrix(save_dat(tmp_path / "imatrix.dat", weights))
    for flavor in ("ik", "mainline"):
        gs = make_groups(deepseek, [iq2_xxs, T.Q8_0], imatrix=imat, flavor=flavor)
        can = [g.key for g in gs.groups if any(o.qtype == iq2_xxs for o in g.options)]
        assert can == ["blk.2.ffn_down_exps"], flavor      # attn holds other tensors without weights
    # an entry of the wrong size is the real run's error
    bad = load_imatrix(save_dat(tmp_path / "bad.dat", {"blk.2.ffn_down_exps.weight": np.ones(256, np.float32)}))
    with pytest.raises(QuantkitError, match="imatrix size 256 is different from tensor size 1024"):
        make_groups(deepseek, [iq2_xxs, T.Q8_0], imatrix=bad)


@pytest.mark.parametrize("types, flavor, message", [
    (["iq4_k"], "mainline", "mainline llama.cpp cannot load iq4_k"),
    (["q4_0_4x4"], "ik", "quantizing to q4_0_4x4 .ik flavor. is not implemented"),
    (["tq1_0"], "ik", "cannot load"),
    ([], "ik", "no candidate type"),
    (["q8_0"], "other", "flavor"),
])
def test_bad_types(deepseek, types, flavor, message):
    with pytest.raises(QuantkitError, match=message):
        make_groups(deepseek, [type_from_name(t) for t in types], flavor=flavor)


@pytest.mark.parametrize("text, expected", [
    ("220G", 220 * 10 ** 9), ("220GiB", 220 * 2 ** 30), ("123456789", 123456789), ("1.5k", 1500),
    ("4.5bpw", 4.5 * 1000 / 8), (" 8 BPW ", 1000), ("0.001bpw", None), ("0", None), ("abc", None),
    ("4.5 bits", None), ("-3G", None), ("nanbpw", None), ("", None),
])
def test_parse_budget(text, expected):
    if expected is None:
        with pytest.raises(QuantkitError, match="--budget"):
            parse_budget(text, 1000)
    else:
        assert parse_budget(text, 1000) == int(expected)


# --------------------------------------------------------------------------- emitted rules
@pytest.mark.parametrize("layers", [[0], [7], list(range(16)), list(range(3, 61)), [1, 3, 5, 7, 8, 9, 10, 11],
                                    [9, 10, 99, 100, 101, 250, 1000], list(range(0, 200, 3))])
def test_layers_regex_matches_exactly_its_numbers(layers):
    regex = re.compile(layers_regex(layers))
    assert [n for n in range(1200) if regex.fullmatch(str(n))] == sorted(layers)
    assert not regex.fullmatch("07") and not regex.fullmatch("")
    compile_bounded(rf"blk\.{layers_regex(layers)}\.ffn_down_exps\.weight", "test")


def test_layers_regex_reads_as_published_recipes():
    assert layers_regex(range(16)) == "(?:[0-9]|1[0-5])"
    assert layers_regex(range(3, 61)) == "(?:[3-9]|[1-5][0-9]|60)"
    assert names_regex(["ffn_up.weight", "ffn_gate.weight"]) == r"ffn_(?:gate|up)\.weight"


def test_compact_rules_for_dsv3(dsv3):
    """Layer ranges merged as people write them: one rule per type and tensor kind."""
    gs = make_groups(dsv3, IK_TYPES)
    choice = {}
    for g in gs.groups:
        if g.kind == "ffn_down_exps":
            choice[g.key] = type_from_name("iq3_k") if g.layers[0] < 16 else type_from_name("iq2_k")
        elif g.kind == "ffn_up_gate_exps":
            choice[g.key] = type_from_name("iq2_k")
        else:
            choice[g.key] = T.Q8_0
    rules = compact_rules(gs, choice)
    text = tensor_type_file_text(rules)
    assert r"blk\.(?:[3-9]|1[0-5])\.ffn_down_exps\.weight=iq3_k" in text.splitlines()
    assert r"blk\.(?:1[6-9]|[2-5][0-9]|60)\.ffn_down_exps\.weight=iq2_k" in text.splitlines()
    assert r"blk\.(?:[3-9]|[1-5][0-9]|60)\.ffn_(?:gate|up)_exps\.weight=iq2_k" in text.splitlines()
    assert r"blk\.[0-2]\.ffn_(?:down|gate|up)\.weight=q8_0" in text.splitlines()
    # token_embd, output, attention, dense ffn, shared experts, up/gate experts, down experts twice
    assert len(rules) == 8, text
    check_reproduces(dsv3, rules, gs.tensor_types(choice), "ik")


@pytest.mark.parametrize("seed", [0, 1])
def test_rules_are_exact_bounded_and_lower_case(dsv3, seed):
    gs = make_groups(dsv3, IK_TYPES, parse_placement([r"exps=cpu"], gpu=True), layer_span=1 + seed * 3)
    choice = random_choice(gs, seed)
    rules = compact_rules(gs, choice)
    wanted = gs.tensor_types(choice)
    rule_of = {g.key: choice[g.key] for g in gs.groups}
    names = [t.name for t in dsv3.tensors]
    for pattern, qtype in rules:
        assert pattern.lower() == pattern and "," not in pattern and "=" not in pattern
        regex = compile_bounded(pattern, "test")
        hits = [n for n in names if regex.search(n)]
        assert hits and all(n in wanted for n in hits)
    for g in gs.groups:             # every grouped tensor matched by exactly one rule, of its type
        for n in g.tensors:
            matching = [q for p, q in rules if re.search(p, n)]
            assert matching == [rule_of[g.key]], n
    check_reproduces(dsv3, rules, wanted, "ik")


def test_output_and_token_embd_rules_are_anchored_where_they_must_be(deepseek):
    gs = make_groups(deepseek, IK_TYPES)
    choice = {g.key: T.Q8_0 for g in gs.groups}
    choice["output"] = T.Q6_K
    choice["blk.1.attn"] = T.Q6_K
    rules = dict((q, p) for p, q in compact_rules(gs, choice) if "output" in p and "attn" not in p)
    assert rules == {T.Q6_K: r"^output\.weight"}


def test_check_reproduces_refuses_a_wrong_recipe(deepseek):
    gs = make_groups(deepseek, IK_TYPES)
    choice = {g.key: T.Q8_0 for g in gs.groups}
    rules = compact_rules(gs, choice)
    wanted = gs.tensor_types(choice)
    check_reproduces(deepseek, rules, wanted, "ik")
    with pytest.raises(QuantkitError, match="does not reproduce"):
        check_reproduces(deepseek, rules[1:], wanted, "ik")
    with pytest.raises(QuantkitError, match="blk.2.ffn_down_exps.weight: the recipe makes it q8_0, the choice q6_K"):
        check_reproduces(deepseek, rules, {**wanted, "blk.2.ffn_down_exps.weight": T.Q6_K}, "ik")


def test_recipe_text_forms():
    rules = [(r"blk\.[0-3]\.attn_(?:k|q)\.weight", T.Q8_0), (r"^output\.weight", type_from_name("iq4_k"))]
    text = recipe_text(rules, ["made by quantkit recipe", "budget 4.5bpw\nsecond line"])
    assert text.splitlines()[:3] == ["# made by quantkit recipe", "# budget 4.5bpw", "# second line"]
    assert [str(r) for r in parse_recipe_text(text, "r")] == [r"blk\.[0-3]\.attn_(?:k|q)\.weight=q8_0",
                                                              r"^output\.weight=iq4_k"]
    tt = tensor_type_file_text(rules)
    assert "#" not in tt
    assert [str(parse_tensor_type(i, "f")) for i in tt.split()] == [str(r) for r in parse_recipe_text(text, "r")]


# --------------------------------------------------------------------------- round trips
def _round_trip(path, model, gs, choice, tmp_path, flavor, placement):
    rules = compact_rules(gs, choice)
    wanted = gs.tensor_types(choice)
    check_reproduces(model, rules, wanted, flavor)
    recipe = tmp_path / "recipe.txt"
    recipe.write_text(recipe_text(rules, ["test"]))
    tt_file = tmp_path / "tensor-types.txt"
    tt_file.write_text(tensor_type_file_text(rules))
    for plan in (api.plan_quantize(path, custom_q=str(recipe), allow_requantize=True, flavor=flavor),
                 api.plan_quantize(path, "q8_0", tensor_type_file=str(tt_file), allow_requantize=True, flavor=flavor)):
        assert {n: t for n, t in plan_types(plan).items() if n in wanted} == wanted
        assert all(tp.action == "copy" for tp in plan.tensors if tp.name not in wanted)
        assert plan.bytes_out == gs.file_bytes(choice)
        speed = plan_speed(plan, model.get, placement, {"cpu": 1e10, "gpu": 1e11})
        assert {d: b for d, b in speed.stored.items() if b} == gs.nbytes(choice)
        assert {d: b for d, b in speed.bytes_per_token.items() if b} == {d: b for d, b in gs.per_token(choice).items()
                                                                         if b}


@pytest.mark.parametrize("seed", [0, 1])
def test_smollm2_round_trip(smollm2_path, smollm2, tmp_path, seed):
    placement = parse_placement()
    gs = make_groups(smollm2, IK_TYPES, placement)
    _round_trip(smollm2_path, smollm2, gs, random_choice(gs, seed), tmp_path, "ik", placement)


@pytest.mark.parametrize("flavor, types, span, ot", [
    ("ik", IK_TYPES, 1, [r"exps=cpu"]),
    ("ik", IK_TYPES, 2, [r"blk\.[0-2]\.ffn_down_exps=cpu,exps=gpu"]),
    ("mainline", MAINLINE_TYPES, 1, [r"blk\.[23]\.=cpu"]),
])
def test_deepseek_round_trip(deepseek_path, deepseek, tmp_path, flavor, types, span, ot):
    placement = parse_placement(ot, gpu=True)
    gs = make_groups(deepseek, types, placement, flavor=flavor, layer_span=span)
    for seed in range(3):
        _round_trip(deepseek_path, deepseek, gs, random_choice(gs, seed), tmp_path, flavor, placement)


def test_mtp_layers_and_tied_output_count_as_speed_does(tmp_path):
    """A tied output (no output.weight) is read from token_embd each token, a second copy on the GPU;
    the MTP block is stored but not read."""
    path = write_deepseek2(tmp_path / "ds.gguf", n_layer=3)
    path = rewrite_gguf(path, tmp_path / "tied.gguf", keys={"deepseek2.nextn_predict_layers": 1},
                        tensors={"output.weight": None})
    placement = parse_placement([r"exps=cpu"], gpu=True)
    with open_model(path) as m:
        gs = make_groups(m, IK_TYPES, placement)
        assert "output" not in [g.key for g in gs.groups]
        o = gs.group("token_embd").option(T.Q8_0)
        assert o.nbytes["gpu"] == o.nbytes["cpu"] == o.file_bytes and o.bytes_per_token["gpu"] == o.file_bytes
        assert gs.group("blk.2.attn").option(T.Q8_0).bytes_per_token == {}
        _round_trip(path, m, gs, random_choice(gs, 0), tmp_path, "ik", placement)


def test_metadata_kept_for_the_solver(deepseek):
    gs = make_groups(deepseek, IK_TYPES)
    assert gs.metadata_get("deepseek2.expert_count", None) == 4
    assert gs.flavor == "ik"


@pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")
def test_ik_llama_quantize_writes_the_chosen_types(deepseek_path, deepseek, tmp_path):
    """ik_llama.cpp's own llama-quantize, given the rules as its --custom-q argument, writes every
    tensor as chosen (interleaved experts, fallbacks and ranges included) and the predicted bytes."""
    gs = make_groups(deepseek, IK_TYPES, parse_placement([r"exps=cpu"], gpu=True), layer_span=2)
    choice = random_choice(gs, 5)
    choice["blk.2-3.ffn_down_exps"] = type_from_name("q4_k_r4")
    rules = compact_rules(gs, choice)
    out = tmp_path / "theirs.gguf"
    p = subprocess.run([str(peers.llama_quantize_bin()), "--custom-q", custom_q_arg(rules), str(deepseek_path),
                        str(out), "Q8_0", "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    wanted = gs.tensor_types(choice)
    with open_model(out) as m:
        written = {t.name: t.qtype for t in m.tensors}
        assert {n: written[n] for n in wanted} == wanted
        assert sum(t.nbytes for t in m.tensors) == gs.file_bytes(choice)


def test_hf_checkpoint_round_trip(tmp_path):
    from hf_models import write_tiny_llama
    path = write_tiny_llama(tmp_path / "hf", n_layer=2, n_embd=64, n_ff=128, n_head=2)
    from quantkit.hf import open_hf
    placement = parse_placement()
    with open_hf(path) as m:
        gs = make_groups(m, [T.Q8_0, T.Q4_K, T.Q4_0], placement)
        assert [g.key for g in gs.groups] == ["token_embd", "blk.0.attn", "blk.0.ffn_up_gate", "blk.0.ffn_down",
                                              "blk.1.attn", "blk.1.ffn_up_gate", "blk.1.ffn_down", "output"]
        for seed in range(2):
            _round_trip(path, m, gs, random_choice(gs, seed), tmp_path, "ik", placement)


@pytest.mark.parametrize("name, layer, kind", [
    ("token_embd.weight", None, "token_embd"), ("output.weight", None, "output"),
    ("per_layer_token_embd.weight", None, "per_layer_token_embd"),
    ("blk.12.attn_kv_b.weight", 12, "attn"), ("blk.0.attn_qkv.weight", 0, "attn"),
    ("blk.3.ffn_gate_up_exps.weight", 3, "ffn_up_gate_exps"), ("blk.3.ffn_gate_exps.weight", 3, "ffn_up_gate_exps"),
    ("blk.3.ffn_down_shexp.weight", 3, "ffn_down_shexp"), ("blk.3.ffn_up.weight", 3, "ffn_up_gate"),
    ("blk.5.indexer.attn_k.weight", 5, "indexer"), ("blk.5.indexer.proj.weight", 5, "indexer"),
    ("blk.61.nextn.eh_proj.weight", 61, "nextn"), ("blk.2.ssm_in.weight", 2, "ssm_in"),
])
def test_kind_of(name, layer, kind):
    from quantkit.groups import kind_of
    assert kind_of(name) == (layer, kind)


def test_upper_case_tensor_names(tmp_path):
    """Patterns stay their own lower case (mainline lower-cases them) and still tell ffn_Down from
    ffn_down; names no lower-case pattern can separate are a one-line error."""
    def model(names):
        table = [("token_embd.weight", (64, 32), 0)] + [(n, (64, 64), 0) for n in names]
        return write_sparse(tmp_path / f"m{len(names)}.gguf", "llama", {"llama.block_count": 1}, table)

    with open_model(model(["blk.0.ffn_Down.weight", "blk.0.ffn_down.weight"])) as m:
        gs = make_groups(m, [T.Q8_0, T.Q4_0])
        choice = {"token_embd": T.Q8_0, "blk.0.ffn_Down": T.Q4_0, "blk.0.ffn_down": T.Q8_0}
        rules = compact_rules(gs, choice)
        assert (r"blk\.0\.ffn_[^d]own\.weight", T.Q4_0) in rules
        check_reproduces(m, rules, gs.tensor_types(choice), "ik")
    with open_model(model(["blk.0.ffn_Down.weight", "blk.0.ffn_down.weight", "blk.0.ffn_xown.weight"])) as m:
        gs = make_groups(m, [T.Q8_0, T.Q4_0])
        choice = {"token_embd": T.Q8_0, "blk.0.ffn_Down": T.Q4_0, "blk.0.ffn_down": T.Q8_0, "blk.0.ffn_xown": T.Q8_0}
        with pytest.raises(QuantkitError, match="upper-case letters .blk.0.ffn_Down.weight. cannot all be told apart"):
            compact_rules(gs, choice)


def test_scattered_layers_and_many_names_stay_within_the_regex_bound(tmp_path):
    """120 layers whose types alternate, 72 tensors each: one pattern would have 60 x 72 alternatives,
    more than tensor_regex allows; a rule per name instead."""
    names = [f"attn_{i}" for i in range(72)]
    table = [("token_embd.weight", (64, 32), 0)] + [(f"blk.{i}.{n}.weight", (64, 32), 0)
                                                     for i in range(120) for n in names]
    with open_model(write_sparse(tmp_path / "wide.gguf", "llama", {"llama.block_count": 120}, table)) as m:
        gs = make_groups(m, [T.Q8_0, T.Q4_0])
        choice = {g.key: (T.Q8_0, T.Q4_0)[(g.layers[0] if g.layers else 0) % 2] for g in gs.groups}
        rules = compact_rules(gs, choice)      # each rule checked to match exactly its tensors
        assert len(rules) == 1 + 2 * len(names)
        assert {q for p, q in rules if p.endswith(r".attn_7\.weight")} == {T.Q8_0, T.Q4_0}


def test_a_source_type_quantkit_cannot_read_leaves_no_option(tmp_path):
    """A real run cannot convert an f64 tensor (check_implemented): no candidate is an option there."""
    table = [("token_embd.weight", (64, 32), 0), ("blk.0.attn_q.weight", (64, 64), 28)]     # f64
    with open_model(write_sparse(tmp_path / "f64.gguf", "llama", {"llama.block_count": 1}, table)) as m:
        with pytest.raises(QuantkitError, match=r"group blk.0.attn: none of the candidate types \(q8_0, q4_0\)"):
            make_groups(m, [T.Q8_0, T.Q4_0])
