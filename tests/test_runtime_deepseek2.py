"""The reference runtime on architecture deepseek2 (MLA + MoE) against ik_llama.cpp.

Tiny random DeepSeek models (tests/models.py) in several layouts are run by quantkit's runtime and
by the wheel on the same 64 tokens; every position's logits must agree:

* F32: max |Δ| <= 1e-3 x max |logit| (observed about 2.5e-4: the float16 KV cache rounds a little
  differently once earlier layers differ in the last bits) and the same top token at >= 98% of
  positions, for: DeepSeek-V3 layout (attn_k_b/attn_v_b, sigmoid gating); the same with a random
  exp_probs_b, 3 of 8 experts and YaRN rope scaling; the older fused attn_kv_b layout; a
  DeepSeek-V2-Lite layout (attn_q without q_lora, softmax gating, two shared experts, 27 layers);
* Q8_0 (quantized by quantkit): max |Δ| <= 2e-2 x max |logit| (ggml rounds activations to 8 bits
  inside its quantized products);
* decoding token by token with the cache gives the logits of the full-sequence forward pass.

Group-limited routing (expert_group_count) is not implemented by ik_llama.cpp for deepseek2, so it
is checked against DeepSeek's reference algorithm written out here.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

import peers
import quantkit
from models import write_deepseek2
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
from quantkit.runtime.model import Model

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

N_TOKENS = 64
# head sizes that ik_llama.cpp accepts only in the fused-attn_kv_b layout, to keep 27 layers quick
SMALL = dict(n_embd=128, n_ff=256, n_ff_exp=64, kv_lora_rank=64, qk_nope=32, qk_rope=32, v_head=32, n_vocab=320)
VARIANTS = {
    "v3": dict(),
    "v3-bias-yarn": dict(probs_bias=0.1, n_expert=8, n_expert_used=3, seed=2,
                         yarn=dict(factor=4.0, original_context_length=16, log_multiplier=0.0707, attn_factor=1.1)),
    "fused-kv_b": dict(fused_kv_b=True, seed=4),
    "v2-lite": dict(n_layer=27, n_dense=1, q_lora_rank=0, fused_kv_b=True, gating=1, weights_norm=False,
                    weights_scale=1.0, n_expert=8, n_expert_used=2, n_shared=2, seed=5, **SMALL),
}


@contextmanager
def ik_mla_model():
    """Load models in the wheel with ``llama_model_params.mla = 3``.

    Its contexts default to ``mla_attn = 3``, but its models to ``mla = 0``, and only with mla > 0
    does the loader derive attn_k_b/attn_v_b from a fused attn_kv_b: without them the graph builder
    dereferences a null attn_k_b (a segfault).  The split layout computes the same either way."""
    from ik_llama_cpp import _ctypes_api as C

    default = C.llama_model_default_params

    def with_mla():
        params = default()
        params.mla = 3
        return params

    C.llama_model_default_params = with_mla
    try:
        yield
    finally:
        C.llama_model_default_params = default


def ik_logits(path, tokens) -> np.ndarray:
    with ik_mla_model():
        return peers.ik_logits(path, tokens, all_positions=True)


def our_logits(path, tokens) -> np.ndarray:
    with open_model(path) as g:
        model = Model(g, ops_cpu)
        return model.forward(tokens, model.new_cache(len(tokens)))


def tokens_for(n_vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(3, n_vocab, N_TOKENS)]


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float, argmax: float) -> None:
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    same = (ours.argmax(axis=1) == ref.argmax(axis=1)).mean()
    assert err <= rel, f"max|Δ| = {err:.2e} x max|logit|"
    assert same >= argmax, f"same top token at {same:.0%} of positions"


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_deepseek2(tmp_path_factory.mktemp("ds") / "v3-f32.gguf")


@needs_wheel
@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_logits_match_ik(variant, v3, tmp_path):
    kw = VARIANTS[variant]
    path = v3 if not kw else write_deepseek2(tmp_path / f"{variant}.gguf", **kw)
    tokens = tokens_for(kw.get("n_vocab", 512))
    assert_close(our_logits(path, tokens), ik_logits(path, tokens), rel=1e-3, argmax=0.98)


@needs_wheel
def test_q8_0_logits_match_ik(v3, tmp_path):
    q8 = tmp_path / "v3-q8_0.gguf"
    quantkit.quantize_model(v3, q8, "q8_0")
    with open_model(q8) as g:       # the test is about quantized weights: make sure they are
        assert g.by_name["blk.1.attn_k_b.weight"].qtype == 8 and g.by_name["blk.1.ffn_up_exps.weight"].qtype == 8
    tokens = tokens_for(512)
    assert_close(our_logits(q8, tokens), ik_logits(q8, tokens), rel=2e-2, argmax=0.95)


def test_incremental_decoding_matches_full_forward(v3):
    tokens = tokens_for(512)
    n_prompt = 48
    with open_model(v3) as g:
        model = Model(g, ops_cpu)
        full = model.forward(tokens, model.new_cache(N_TOKENS))
        cache = model.new_cache(N_TOKENS)
        steps = [model.forward(tokens[:n_prompt], cache, logits_from=n_prompt - 1)]
        steps += [model.forward([t], cache) for t in tokens[n_prompt:]]
    assert cache.n_past == N_TOKENS
    step = np.concatenate(steps)
    # only the float16 cache can differ (a product of one row rounds like one of many, almost)
    assert np.abs(step - full[n_prompt - 1:]).max() <= 1e-4 * np.abs(full).max()


def deepseek_route(logits, n_used, gating, bias, norm, scale, n_group, n_group_used):
    """DeepSeek's MoEGate, one token at a time: V3 (sigmoid, noaux_tc) ranks groups by the sum of
    their two best biased scores, V2 (softmax, group_limited_greedy) by their best probability."""
    ids, weights = [], []
    for row in logits.astype(np.float64):
        p = 1 / (1 + np.exp(-row)) if gating == "sigmoid" else np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        choice = p + (bias if bias is not None else 0)
        groups = choice.reshape(n_group, -1)
        rank = np.sort(groups, axis=1)[:, -2:].sum(axis=1) if gating == "sigmoid" else groups.max(axis=1)
        kept = np.argsort(-rank)[:n_group_used]
        allowed = np.isin(np.arange(len(row)) // groups.shape[1], kept)
        top = np.argsort(-np.where(allowed, choice, -np.inf))[:n_used]
        w = p[top] / p[top].sum() if norm else p[top]
        ids.append(top)
        weights.append(w * scale)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
def test_group_limited_routing(gating):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.3).astype(np.float32) if gating == "sigmoid" else None
    args = dict(n_used=4, gating=gating, bias=bias, norm=gating == "sigmoid", scale=2.5)
    ids, w = ops_cpu.moe_route(logits, **args, n_group=4, n_group_used=2)
    ref_ids, ref_w = deepseek_route(logits, **args, n_group=4, n_group_used=2)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5)
    # the groups matter for these scores, and all groups used is plain top-k
    plain, _ = ops_cpu.moe_route(logits, **args)
    assert (np.sort(plain, axis=1) != np.sort(ids, axis=1)).any()
    np.testing.assert_array_equal(ops_cpu.moe_route(logits, **args, n_group=4, n_group_used=4)[0], plain)


def test_group_metadata_is_read(tmp_path):
    path = write_deepseek2(tmp_path / "groups.gguf", n_layer=2, n_expert=8, n_group=4, n_group_used=2,
                           fused_kv_b=True, **SMALL)
    with open_model(path) as g:
        model = Model(g, ops_cpu)
        assert (model.config.moe.n_group, model.config.moe.n_group_used) == (4, 2)
        assert np.isfinite(model.forward(tokens_for(SMALL["n_vocab"])[:8], model.new_cache(8))).all()
