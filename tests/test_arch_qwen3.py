"""Qwen3 (``qwen3``) and Qwen3-MoE (``qwen3moe``): Hugging Face checkpoint -> GGUF -> quantkit's runtime.

Tiny random models saved by transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM (head_dim 32
with 8 query heads on 2 KV heads, so q is wider than the embedding; per-head q/k norms; 8 experts,
3 used, softmax routing with normalised weights) are converted to F32 by the library, then:

* quantkit's runtime (numba and torch backends) gives transformers' float32 logits within
  1e-3 x max |logit| and the same top token at >= 99% of the 64 positions (measured: about 5e-4,
  the float16 KV cache ggml keeps);
* with the float32 KV cache (cache_type="f32": nothing rounded to float16) within 2e-5 (measured ~1e-6);
* the ik wheel on the same file agrees with ours and with transformers to the same bound (the top
  token at the positions without a near tie);
* a token-by-token decode through the cache gives the batch's logits;
* quantized (q4_K_M) by quantkit, our logits meet the wheel's on the dequantized file.

Converter and runtime refusals (a sliding window, rope scaling, dense layers among the experts; a
wrong q_norm shape, a missing q_norm, more experts used than exist) are one-line QuantkitErrors.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

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

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")
SHAPE = dict(n_embd=128, n_head=8, n_head_kv=2, head_dim=32)
SAVERS = {"qwen3": lambda d, meta: H.save_qwen3(d, meta, n_layer=3, n_ff=192, **SHAPE),
          "qwen3moe": lambda d, meta: H.save_qwen3moe(d, meta, n_layer=2, n_ff_exp=48, n_expert=8, n_used=3, **SHAPE)}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_meta):
    """arch -> (checkpoint directory, converted F32 GGUF, transformers' logits of PROMPT)."""
    out = {}
    for arch, save in SAVERS.items():
        root = tmp_path_factory.mktemp(arch)
        d = save(root / "hf", tok_meta)
        gguf = root / "f32.gguf"
        quantkit.quantize_model(d, gguf, "f32")
        out[arch] = (d, gguf, H.hf_logits(d, PROMPT))
    return out


def test_qwen3_file_has_ik_converters_layout(models):
    """The names, shapes and keys of ik's convert_hf_to_gguf.py (Qwen3Model / Qwen3MoeModel); q and
    k rows in HF's order (NEOX rope needs no permutation)."""
    from safetensors.numpy import load_file
    d, path, _ = models["qwen3"]
    q_proj = load_file(str(d / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    with open_model(path) as g:
        assert g.get("qwen3.attention.key_length") == 32 and g.get("qwen3.attention.value_length") == 32
        assert "qwen3.rope.dimension_count" not in g.metadata         # the whole head, ik's default
        assert g.by_name["blk.0.attn_q.weight"].shape == (128, 256)
        assert g.by_name["blk.0.attn_q_norm.weight"].shape == (32,)
        assert g.by_name["blk.2.attn_k_norm.weight"].shape == (32,)
        assert (g.by_name["blk.0.attn_q.weight"].raw().view(np.float32).reshape(256, 128) == q_proj).all()
    with open_model(models["qwen3moe"][1]) as g:
        assert {k: g.get("qwen3moe." + k) for k in ("expert_count", "expert_used_count",
                                                    "expert_feed_forward_length")} == \
            {"expert_count": 8, "expert_used_count": 3, "expert_feed_forward_length": 48}
        assert "qwen3moe.expert_weights_norm" not in g.metadata      # norm_topk_prob true: ik's default
        assert g.by_name["blk.1.ffn_down_exps.weight"].shape == (48, 128, 8)
        assert g.by_name["blk.1.ffn_gate_inp.weight"].qtype.name == "F32"


@pytest.mark.parametrize("ops", ["numba", "torch"])
@pytest.mark.parametrize("arch", list(SAVERS))
def test_runtime_matches_transformers(models, arch, ops):
    _, path, ref = models[arch]
    ours = our_logits(path, PROMPT, backend(ops))
    assert distance(ours, ref) <= TOL
    assert top_agreement(ours, ref) >= TOP_AGREE


@pytest.mark.parametrize("arch", list(SAVERS))
def test_float32_attention_matches_transformers_exactly(models, arch):
    _, path, ref = models[arch]
    assert distance(our_logits(path, PROMPT, cache_type="f32"), ref) <= EXACT


@needs_wheel
@pytest.mark.parametrize("arch", list(SAVERS))
def test_the_wheel_agrees_on_the_same_file(models, arch):
    _, path, ref = models[arch]
    ik = np.asarray(peers.ik_logits(path, PROMPT, all_positions=True)).reshape(ref.shape)
    # the wheel's float16 roundings differ from ours (it keeps q and the probabilities in float32
    # here): one near tie of 64 positions goes the other way in it
    assert distance(ik, ref) <= TOL and top_agreement(ik, ref, decided_only=True) >= TOP_AGREE
    ours = our_logits(path, PROMPT)
    assert distance(ours, ik) <= TOL and top_agreement(ours, ik, decided_only=True) >= TOP_AGREE



@needs_wheel
def test_quantized_file_reads_as_the_wheel_reads_it(models, tmp_path):
    """q4_K_M by quantkit's presets (q5_0/q6_0/q8_0 here: the 128-wide rows take the fallbacks):
    our products on the quantized file against the wheel on its dequantized twin (measured ~6e-4)."""
    assert quantized_vs_dequantized_in_the_wheel(models["qwen3moe"][1], tmp_path) <= 2 * TOL

def test_decoding_token_by_token_equals_the_batch(models):
    """The cache path: a prompt, then single tokens (the few-token kernels of the per-head norms
    and of the routed experts)."""
    _, path, _ = models["qwen3moe"]
    tokens = PROMPT[:20]
    with open_model(path) as g:
        model = Model(g, ops_cpu)
        full = model.forward(tokens, model.new_cache(len(tokens)))
        cache = model.new_cache(len(tokens))
        steps = [model.forward(tokens[:16], cache)[-1:]] + [model.forward([t], cache) for t in tokens[16:]]
    assert distance(np.concatenate(steps), full[15:]) <= TOL


def test_qwen3moe_without_norm_topk_prob(tmp_path, tok_meta):
    """norm_topk_prob false: the converter notes it (expert_weights_norm false) and the runtime
    leaves the chosen softmax weights as they are, as transformers does."""
    d = H.save_qwen3moe(tmp_path / "hf", tok_meta, n_layer=1, norm=False, **SHAPE)
    path = quantkit.quantize_model(d, tmp_path / "f32.gguf", "f32") and tmp_path / "f32.gguf"
    with open_model(path) as g:
        assert g.get("qwen3moe.expert_weights_norm") is False
    ref = H.hf_logits(d, PROMPT[:16])
    assert distance(our_logits(path, PROMPT[:16], cache_type="f32"), ref) <= EXACT
    # the same file read as ik reads it (normalised) is another model: the key matters
    small = shrink_vocab(path, tmp_path / "small.gguf")
    normed = rewrite_gguf(small, tmp_path / "normed.gguf", {"qwen3moe.expert_weights_norm": None})
    assert distance(our_logits(normed, PROMPT[:16], cache_type="f32"), ref[:, :8192]) > 100 * EXACT


CONFIG_BREAKAGES = [
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window is true"),
    ("qwen3", {"attention_bias": True}, "attention_bias is true"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling 'yarn'"),
    ("qwen3", {"head_dim": 31}, "head size 31"),
    ("qwen3moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
]


@pytest.mark.parametrize("arch, change, needle", CONFIG_BREAKAGES)
def test_converter_refuses_what_it_cannot_write(models, tmp_path, arch, change, needle):
    src = models[arch][0]
    d = tmp_path / "hf"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value) and "\n" not in str(e.value)


def _refused(path, *needles):
    with open_model(path) as g:
        with pytest.raises(QuantkitError) as e:
            Model(g, ops_cpu)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_runtime_refuses_bad_qk_norms_and_expert_counts(models, tmp_path):
    qwen3, moe = (shrink_vocab(models[a][1], tmp_path / f"{a}.gguf") for a in ("qwen3", "qwen3moe"))
    _refused(rewrite_gguf(qwen3, tmp_path / "a.gguf", tensors={"blk.1.attn_q_norm.weight": np.ones(16)}),
             "blk.1.attn_q_norm.weight", "[16]", "[32]")
    _refused(rewrite_gguf(qwen3, tmp_path / "b.gguf", tensors={"blk.0.attn_k_norm.weight": None}),
             "blk.0.attn_k_norm.weight", "missing")
    _refused(rewrite_gguf(moe, tmp_path / "c.gguf", {"qwen3moe.expert_used_count": 9}),
             "qwen3moe.expert_used_count", "at most 8")
    _refused(rewrite_gguf(moe, tmp_path / "d.gguf", {"qwen3moe.expert_count": None}),
             "qwen3moe.expert_count", "missing")
