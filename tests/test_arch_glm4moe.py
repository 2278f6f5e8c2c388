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
float32 KV cache within 2e-5; the ik wheel on ``glm``'s file against transformers and ours;
its q4_K_M quantization against the wheel on the dequantized twin; perplexity and imatrix run.
ik_llama.cpp does not read expert groups for glm4moe (llm_load_hparams), so ``glm-groups`` is
checked against transformers only.  ``glm``'s checkpoint also stores GLM's nextn (MTP) layer (a
shard of its own, num_nextn_predict_layers 1), which the converter keeps as ik's convert_hf_to_gguf.py
does (the expected names from gguf-py's tensor map, not from quantkit); the file runs the same blocks
as the one converted without it, in our runtime and in the wheel, and the presets plan its tensors as
llama-quantize --dry-run does.
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
from models import rewrite_gguf  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.hf import open_hf  # noqa: E402
from quantkit.runtime import ops_cpu  # noqa: E402
from quantkit.runtime.model import Model  # noqa: E402
from quantkit.types import type_name  # noqa: E402

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")
SHAPE = dict(n_layer=3, n_dense=1, n_embd=128, n_head=8, head_dim=32, n_ff=192, n_ff_exp=48,
             n_expert=8, n_used=3, n_shared=1, scale=2.5)
VARIANTS = {"glm": dict(qk_norm=True), "glm-groups": dict(qk_norm=False, n_group=4, topk_group=2, n_head_kv=4)}
G = "glm4moe."


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_meta):
    """variant -> (checkpoint directory, converted F32 GGUF, transformers' logits of PROMPT)."""
    out = {}
    for name, kw in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        d = H.save_glm4moe(root / "hf", tok_meta, **SHAPE, **{"n_head_kv": 2, **kw})
        if name == "glm":
            # GLM checkpoints carry the nextn (MTP) layer after the last block; transformers does not build it
            H.append_glm_mtp_layer(d)
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
    dense lead layer, half-head rope; the nextn layer kept as block 3."""
    with open_model(models["glm"][1]) as g:
        names = set(g.by_name)
        assert {"blk.0.post_attention_norm.weight", "blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias",
                "blk.0.attn_q_norm.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_gate_inp.weight",
                "blk.1.exp_probs_b.bias", "blk.2.ffn_up_exps.weight", "blk.2.ffn_down_shexp.weight"} <= names
        assert "blk.3.nextn.eh_proj.weight" in names and "blk.0.ffn_norm.weight" not in names
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in names)
        meta = {k[len(G):]: g.get(k) for k in g.metadata if k.startswith(G)}
        assert meta["block_count"] == 4 and meta["nextn_predict_layers"] == 1
        assert meta["rope.dimension_count"] == 16 and meta["attention.key_length"] == 32
        assert (meta["expert_count"], meta["expert_used_count"], meta["expert_shared_count"],
                meta["leading_dense_block_count"], meta["expert_gating_func"], meta["expert_weights_norm"]) == \
            (8, 3, 1, 1, 2, True)
        assert meta["expert_weights_scale"] == pytest.approx(2.5)
        assert "expert_group_count" not in meta
    with open_model(models["glm-groups"][1]) as g:
        assert g.get(G + "expert_group_count") == 4 and g.get(G + "expert_group_used_count") == 2
        assert "blk.0.attn_q_norm.weight" not in g.by_name
        # transformers saves num_nextn_predict_layers 1 without the layer: the file has none
        assert g.get(G + "block_count") == 3 and g.get(G + "nextn_predict_layers") == 0


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
    assert distance(our_logits(path, PROMPT, cache_type="f32"), ref) <= EXACT


def test_expert_groups_change_the_routing(models, small, tmp_path):
    """Without its group keys the glm-groups file is another model: the groups are really used."""
    ref = models["glm-groups"][2][:, :8192]
    assert distance(our_logits(small["glm-groups"], PROMPT, cache_type="f32"), ref) <= EXACT
    ungrouped = rewrite_gguf(small["glm-groups"], tmp_path / "ungrouped.gguf",
                             {G + "expert_group_count": None, G + "expert_group_used_count": None})
    assert distance(our_logits(ungrouped, PROMPT, cache_type="f32"), ref) > 100 * EXACT


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

# ------------------------------------------------------------------------------ the nextn (MTP) layer
MTP_SHARD = "model_mtp.safetensors"


@pytest.fixture(scope="module")
def no_nextn(models, tmp_path_factory):
    """``glm``'s checkpoint without its nextn layer (num_nextn_predict_layers 0), converted to F32."""
    d = _copy_without_mtp(models["glm"][0], tmp_path_factory.mktemp("no-nextn") / "hf", 0)
    quantkit.quantize_model(d, d.parent / "f32.gguf", "f32")
    return d.parent / "f32.gguf"


def _copy_without_mtp(src, dst, n_nextn):
    """``src`` less its MTP shard (model.safetensors hard-linked), num_nextn_predict_layers ``n_nextn``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "model.safetensors":
            (dst / f.name).hardlink_to(f)
        elif f.name != MTP_SHARD:
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": n_nextn}))
    return dst


def _ik_converter_tensors(directory, outtype="bf16"):
    """What convert_hf_to_gguf.py's Glm4MoeModel writes for ``directory`` with --outtype ``outtype``,
    derived from its code and gguf-py's tensor map (not from quantkit): [(GGUF name, ggml shape,
    type name)] in its order, the shards' sorted names one after the other; model.embed_tokens is
    token_embd, a layer's experts are stacked when the last of them is read,
    e_score_correction_bias becomes e_score_correction.bias; 1-D tensors, *_norm.weight,
    ffn_gate_inp and non-.weight tensors stay F32."""
    import gguf
    from safetensors import safe_open
    cfg = json.loads((directory / "config.json").read_text())
    n_block = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n_block)
    n_expert, seen, out, shape_of = cfg["n_routed_experts"], {}, [], {}

    def emit(hf_name, new_name, shape):
        n_dims = len(shape)
        f32 = (n_dims <= 1 or new_name.endswith("_norm.weight") or not hf_name.endswith(".weight")
               or new_name.endswith("ffn_gate_inp.weight"))
        out.append((new_name, tuple(reversed(shape)), "f32" if f32 else outtype))

    parts = sorted(f.name for f in directory.iterdir() if f.name.startswith("model") and f.suffix == ".safetensors")
    for part in parts:
        with safe_open(str(directory / part), "np") as f:
            for name in sorted(f.keys()):
                shape = tuple(f.get_slice(name).get_shape())
                if name == "model.embed_tokens.weight":
                    emit(name, "token_embd.weight", shape)
                    continue
                if ".mlp.experts." in name:
                    bid = int(name.split(".")[2])
                    seen.setdefault(bid, []).append(name)
                    shape_of[name.rsplit(".", 2)[1]] = shape
                    if len(seen[bid]) == 3 * n_expert:
                        for w in ("down_proj", "gate_proj", "up_proj"):
                            merged = f"model.layers.{bid}.mlp.experts.{w}.weight"
                            emit(merged, tmap.get_name(merged, try_suffixes=(".weight",)), (n_expert, *shape_of[w]))
                    continue
                mapped = name.replace("e_score_correction_bias", "e_score_correction.bias")
                new = tmap.get_name(mapped, try_suffixes=(".weight", ".bias"))
                assert new is not None, f"ik's converter cannot map {name}"
                emit(name, new, shape)
    return out


def test_nextn_layer_as_ik_converter_writes_it(models, tmp_path):
    """The checkpoint in BF16 (as GLM's are stored) converted: the tensors ik's converter writes with
    --outtype bf16 (names, ggml shapes, which stay F32), the nextn ones in its order, each block
    after the one before; block_count 4 (3 + the nextn layer), nextn_predict_layers 1."""
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bf16"
    d.mkdir()
    for f in models["glm"][0].iterdir():
        if f.suffix == ".safetensors":
            save_file({n: t.to(torch.bfloat16) for n, t in load_file(str(f)).items()}, str(d / f.name),
                      metadata={"format": "pt"})
        else:
            shutil.copy(f, d / f.name)
    expected = _ik_converter_tensors(d)
    with open_hf(d) as g:
        ours = [(t.name, t.shape, type_name(t.qtype)) for t in g.tensors]
        assert (g.get(G + "block_count"), g.get(G + "nextn_predict_layers")) == (4, 1)
    assert sorted(ours) == sorted(expected)
    nextn = [f"blk.3.nextn.{n}.weight" for n in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head",
                                                  "shared_head_norm")]
    assert [n for n, _, _ in ours if ".nextn." in n] == [n for n, _, _ in expected if ".nextn." in n] == nextn
    blocks = [int(n.split(".")[1]) for n, _, _ in ours if n.startswith("blk.")]
    assert blocks == sorted(blocks) and blocks[-1] == 3
    assert {n: t for n, _, t in ours if n.startswith("blk.3.nextn.")} == {
        nextn[0]: "bf16", nextn[1]: "bf16", nextn[2]: "f32", nextn[3]: "f32", nextn[4]: "bf16", nextn[5]: "f32"}


def test_the_nextn_block_is_not_run(models, no_nextn):
    """Our runtime on the file with the nextn layer: the logits of the file without it, bit for bit
    (and transformers', which never builds the layer)."""
    ours = our_logits(models["glm"][1], PROMPT)
    assert np.array_equal(ours, our_logits(no_nextn, PROMPT))
    assert distance(ours, models["glm"][2]) <= TOL


@needs_wheel
def test_the_wheel_loads_the_nextn_layer_and_skips_it(models, no_nextn):
    with_nextn = np.asarray(peers.ik_logits(models["glm"][1], PROMPT, all_positions=True))
    assert np.array_equal(with_nextn, np.asarray(peers.ik_logits(no_nextn, PROMPT, all_positions=True)))


@needs_wheel
def test_presets_plan_the_nextn_layer_as_llama_quantize(models):
    """Q4_K_M straight from the checkpoint: every tensor, the nextn ones included, gets the type
    llama-quantize --dry-run gives it in the converted file -- where a real run could write it: the
    dry run does not check that the fallback's 32-block divides the 48-wide expert rows (ours:
    f16, the last resort)."""
    from test_presets import wheel_dry_run
    rc, theirs, out = wheel_dry_run(models["glm"][1], "Q4_K_M")
    assert rc == 0, out[-3000:]
    plan = quantkit.plan_quantize(models["glm"][0], "Q4_K_M").tensors
    assert {tp.name for tp in plan} == theirs.keys()
    ours = {tp.name: tp.dst_type for tp in plan if len(tp.shape) == 1 or tp.shape[0] % 32 == 0}
    assert ours == {n: theirs[n] for n in ours}
    compared = {n for n in theirs if n.startswith("blk.3.")} - {"blk.3.ffn_down_exps.weight",
                                                                "blk.3.ffn_down_shexp.weight"}
    assert compared <= ours.keys() and "blk.3.nextn.shared_head_head.weight" in compared


@pytest.fixture(scope="module")
def mtp_layer(models):
    """The MTP shard's tensors less the vocabulary-sized ones (GLM-4.6 stores no embed_tokens and
    shared_head.head there): small enough to rewrite per case."""
    from safetensors.torch import load_file
    tensors = load_file(str(models["glm"][0] / MTP_SHARD))
    return {n: t for n, t in tensors.items() if not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}


def _with_mtp(models, mtp_layer, dst, tensors, n_nextn=1):
    from safetensors.torch import save_file
    d = _copy_without_mtp(models["glm"][0], dst, n_nextn)
    save_file(tensors, str(d / MTP_SHARD), metadata={"format": "pt"})
    return d


def test_glm46_nextn_layer_without_its_own_embeddings(models, mtp_layer, tmp_path):
    """GLM-4.6's MTP layer has no embed_tokens or shared_head.head (the loader does not require
    them, nor shared_head_norm): converted without them."""
    d = _with_mtp(models, mtp_layer, tmp_path / "hf", mtp_layer)
    with open_hf(d) as g:
        assert sorted(n for n in g.by_name if ".nextn." in n) == [
            "blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
            "blk.3.nextn.shared_head_norm.weight"]
        assert sorted(t.name for t in g.tensors) == sorted(t[0] for t in _ik_converter_tensors(d))


L3 = "model.layers.3."
MTP_BREAKAGES = [
    ("eh_proj.weight", None, 1, "the nextn (MTP) layer 3 (of num_nextn_predict_layers 1) is incomplete: "
                                "tensor 'model.layers.3.eh_proj.weight' is missing"),
    ("hnorm.weight", None, 1, "tensor 'model.layers.3.hnorm.weight' is missing"),
    ("mlp.experts.5.up_proj.weight", None, 1, "tensor 'model.layers.3.mlp.experts.5.up_proj.weight' is missing"),
    ("self_attn.k_proj.bias", None, 1, "tensor 'model.layers.3.self_attn.k_proj.bias' is missing"),
    ("mlp.gate.e_score_correction_bias", None, 1, "'model.layers.3.mlp.gate.e_score_correction_bias' is missing"),
    ("eh_proj.weight", (128, 128), 1, "'model.layers.3.eh_proj.weight' has shape [128, 128] but config.json "
                                      "implies [128, 256]"),
    ("enorm.weight", (256,), 1, "'model.layers.3.enorm.weight' has shape [256]"),
    ("bogus.weight", (4,), 1, "cannot map tensor 'model.layers.3.bogus.weight'"),
    (None, None, 0, "has tensors of layer 3, beyond the num_hidden_layers 3 blocks and the "
                    "num_nextn_predict_layers 0 nextn (MTP) layers"),
    (None, None, 2, "has num_nextn_predict_layers 2 but the checkpoint has no tensor of the nextn (MTP) layer 4"),
]


@pytest.mark.parametrize("name, shape, n_nextn, needle", MTP_BREAKAGES)
def test_converter_refuses_an_incomplete_nextn_layer(models, mtp_layer, tmp_path, name, shape, n_nextn, needle):
    tensors = dict(mtp_layer)
    if name is not None and shape is None:
        del tensors[L3 + name]
    elif name is not None:
        tensors[L3 + name] = torch.zeros(shape)
    d = _with_mtp(models, mtp_layer, tmp_path / "hf", tensors, n_nextn)
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


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
    ({G + "nextn_predict_layers": 4}, None, (G + "nextn_predict_layers", "at most 3")),
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
