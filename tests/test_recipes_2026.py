"""The 2026 recipes in recipes/ (Qwen3, Qwen3-MoE, GLM-4.5/4.6, gpt-oss, DeepSeek-V3.2, Kimi-K2), dry-run tested
on tiny GGUFs with their families' real layer and expert counts (tests/models.py, the data a hole).

For each recipe: every tensor gets the type the recipe's comments promise, written out here by role and
layer number rather than by regex (so a pattern that matches more, or less, than it says fails); every rule
claims some tensor; the plan is what the wheel's llama-quantize --dry-run --custom-q gives, and every type is
one the wheel's ggml knows.
"""
from __future__ import annotations

import re

import pytest

import peers
import quantkit
from conftest import REPO
from models import write_qwen3moe
from quantkit.recipes import load_recipe
from quantkit.types import type_name
from test_presets import needs_wheel, wheel_dry_run
from test_presets_2026 import FAMILIES

RECIPES = "recipes"
_LAYER = re.compile(r"^blk\.(\d+)\.")
_QUANTIZED_NEVER = ("_norm.", ".bias", "ffn_gate_inp.")     # and every 1-D tensor


def _role(name: str) -> str:
    """attention / dense ffn / shared / routed experts / indexer / nextn / …, by the tensor's own name."""
    for role, key in (("indexer", ".indexer."), ("nextn", ".nextn."), ("routed_down", "ffn_down_exps"),
                      ("routed_gate_up", "_exps."), ("shared", "_shexp."), ("ffn_down", "ffn_down."),
                      ("ffn_gate_up", "ffn_"), ("attn_kv", "attn_k."), ("attn_kv", "attn_v."), ("attn", "attn_")):
        if key in name:
            return role
    return name


def _qwen3_8b(name, i):
    r = _role(name)
    edge = i is not None and (i < 4 or i >= 32)
    return {"attn_kv": "q8_0", "attn": "iq5_ks", "ffn_down": "iq6_k" if edge else "iq5_ks",
            "ffn_gate_up": "iq5_ks" if edge else "iq4_ks", "token_embd.weight": "iq4_k", "output.weight": "q8_0"}[r]


def _qwen3moe(n_layer, up, down, rest_gate_up, rest_down, attn_q):
    def expect(name, i):
        r = _role(name)
        edge = i is not None and (i < 4 or i >= n_layer - 4)
        return {"attn_kv": "q8_0", "attn": attn_q, "routed_down": down if edge else rest_down,
                "routed_gate_up": up if edge else rest_gate_up, "token_embd.weight": "iq4_k",
                "output.weight": "iq6_k"}[r]
    return expect


def _glm46(name, i):
    r = _role(name)
    if r in ("attn", "attn_kv", "shared") or (i is not None and i < 3 and r.startswith("ffn_")):
        return "q8_0"
    if r == "nextn":
        return "q8_0" if "eh_proj" in name else "iq4_ks"
    if r in ("routed_down", "routed_gate_up"):
        first = i < 6
        return ("iq5_ks" if first else "iq4_ks") if r == "routed_down" else ("iq4_ks" if first else "iq3_ks")
    return {"token_embd.weight": "iq4_k", "output.weight": "iq6_k"}[r]


def _gptoss(name, i):
    return "mxfp4" if _role(name).startswith("routed") else "q8_0"


def _deepseek32(name, i):
    r = _role(name)
    if r in ("routed_down", "routed_gate_up") and i >= 3:
        first = i < 6
        return ("iq5_ks" if first else "iq4_ks") if r == "routed_down" else ("iq4_ks" if first else "iq3_ks")
    return "q8_0"


def _kimi(name, i):
    return "q4_0" if _role(name).startswith("routed") else "q8_0"


# recipe file -> (fixture, TYPE, the promised type of each quantized tensor)
CASES = {
    "qwen3-8b-iq4_ks.txt": ("qwen3_8b", "IQ4_KS", _qwen3_8b),
    "qwen3-30b-a3b-iq4_ks.txt": ("qwen3_30b_a3b", "IQ4_KS",
                                 _qwen3moe(48, "iq5_ks", "iq6_k", "iq4_ks", "iq5_ks", "q8_0")),
    "qwen3-235b-a22b-iq3_k.txt": ("qwen3_235b_a22b", "IQ3_K", _qwen3moe(94, "iq4_ks", "iq5_ks", "iq3_k", "iq4_ks",
                                                                      "iq6_k")),
    "glm-4.6-iq3_ks.txt": ("glm46", "IQ3_KS", _glm46),
    "gpt-oss-120b-mxfp4.txt": ("gptoss_120b", "Q8_0", _gptoss),
    "deepseek-v3.2-iq3_ks.txt": ("deepseek32", "IQ3_KS", _deepseek32),
}
# Kimi's Q4_X recipe comes with the kimi branch (TYPE Q4_X holds the same rules): tested here on the Kimi
# fixture once both are in the tree.  (Until the merge this branch has no such file.)
if (REPO / RECIPES / "kimi-k2-q4_x.txt").is_file():
    CASES["kimi-k2-q4_x.txt"] = ("kimi_k2", "Q8_0", _kimi)
FIXTURES = {**FAMILIES, "qwen3_235b_a22b": lambda p: write_qwen3moe(p, n_layer=94, n_head=16)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = FIXTURES[name](tmp_path_factory.mktemp(name) / f"{name}.gguf")
        return made[name]
    return get


def recipe_path(repo_root, file):
    return repo_root / RECIPES / file


def test_every_2026_recipe_is_listed_and_tested(repo_root):
    readme = (repo_root / RECIPES / "README.md").read_text()
    for file in CASES:
        assert f"`{file}`" in readme, file


@pytest.mark.parametrize("file", list(CASES))
def test_recipe_gives_what_it_promises(model, repo_root, file):
    fixture, preset, expect = CASES[file]
    plan = quantkit.plan_quantize(model(fixture), preset, custom_q=[str(recipe_path(repo_root, file))])
    assert not plan.warnings, plan.warnings          # every rule claims some tensor; no fallbacks
    wrong = {}
    for tp in plan.tensors:
        if len(tp.shape) == 1 or any(s in tp.name for s in _QUANTIZED_NEVER):
            assert tp.action == "copy", tp.name
            continue
        m = _LAYER.match(tp.name)
        want = expect(tp.name, int(m[1]) if m else None)
        if type_name(tp.dst_type) != want or tp.rule_index is None:
            wrong[tp.name] = (type_name(tp.dst_type), tp.rule, want)
    assert not wrong, f"{file}: {dict(list(wrong.items())[:10])}"


def _comma_form(path) -> str:
    """The rules as the published scripts pass them to ik's --custom-q: comments dropped, one line."""
    return ",".join(f"{r.pattern}={type_name(r.qtype)}" for r in load_recipe([str(path)]).rules)


@needs_wheel
@pytest.mark.parametrize("file", list(CASES))
def test_recipe_dry_run_matches_llama_quantize(model, repo_root, file):
    fixture, preset, _ = CASES[file]
    src, path = model(fixture), recipe_path(repo_root, file)
    rules = _comma_form(path)
    assert "," not in "".join(r.pattern for r in load_recipe([str(path)]).rules)     # the comma form holds
    rc, theirs, out = wheel_dry_run(src, preset, extra=["--custom-q", rules])
    assert rc == 0, out[-3000:]
    plan = quantkit.plan_quantize(src, preset, custom_q=[str(path)])
    ours = {tp.name: tp.dst_type for tp in plan.tensors}
    assert ours.keys() == theirs.keys()
    wrong = {n: (type_name(ours[n]), type_name(theirs[n])) for n in ours if ours[n] != theirs[n]}
    assert not wrong, f"{file}: quantkit vs llama-quantize --dry-run: {wrong}"
    ggml = peers.load_ggml()
    for qtype in set(ours.values()):
        assert ggml.type_traits(int(qtype)) is not None, type_name(qtype)
