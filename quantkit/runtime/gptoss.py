"""The blocks of architecture ``gpt-oss``, computed as llama.cpp's graph does (build_openai_moe,
flash attention off).

Attention is grouped-query with biases on every projection, NEOX rope (rotate-half pairs) with
YaRN, and two twists: each head has a learned "sink" logit that joins the softmax without a value
(so a head can attend to nothing), and even layers see only the last ``sliding_window`` positions.
The feed-forward is a mixture of experts whose router keeps the top-k raw logits and softmaxes
them; each expert is biased and gated with swiglu_oai (clamped at 7, sigmoid slope 1.702, up + 1).
The gate and up experts may be fused in one ffn_gate_up_exps (runtime/experts.py), their biases in
ffn_gate_up_exps.bias (n_ff gate biases, then n_ff up biases per expert), as ik_llama.cpp loads them.
The post-attention norm is stored as ``post_attention_norm``.
"""
from __future__ import annotations

from .experts import FUSED, expert_tensors, expert_weights

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks", "post_attention_norm",
                 "ffn_gate_inp")


def load_layer(m, i: int) -> None:
    """Check that layer i has every tensor it needs (so a bad file fails at load)."""
    for name in LAYER_TENSORS:
        m.w.need(f"blk.{i}.{name}.weight")
    for name in expert_tensors(m, f"blk.{i}."):
        m.w.need(f"blk.{i}.{name}.weight")
        m.w.need(f"blk.{i}.{name}.bias")


def layer(m, i: int, x, pos, cache):
    """Layer i (pre-norm residual attention, then the experts) on x (n_tokens, n_embd)."""
    c, ops, p = m.config, m.ops, f"blk.{i}."
    h = ops.rmsnorm(x, m.vector(p + "attn_norm.weight"), c.rms_eps)
    x = x + attention(m, i, h, pos, cache)
    h = ops.rmsnorm(x, m.vector(p + "post_attention_norm.weight"), c.rms_eps)
    return x + moe(m, i, h)


def attention(m, i: int, h, pos, cache):
    c, g, ops, p, n = m.config, m.config.gptoss, m.ops, f"blk.{i}.", h.shape[0]
    q = m.linear(p + "attn_q", h).reshape(n, c.n_head, c.head_dim)
    k = m.linear(p + "attn_k", h).reshape(n, c.n_head_kv, c.head_dim)
    v = m.linear(p + "attn_v", h).reshape(n, c.n_head_kv, c.head_dim)
    rope = dict(freq_scale=c.rope_scale, ext_factor=g.ext_factor, beta_fast=g.beta_fast, beta_slow=g.beta_slow,
                n_ctx_orig=g.n_ctx_orig, neox=True)
    q = ops.rope_ext(q, pos, c.n_rot, c.rope_base, **rope)
    k = ops.rope_ext(k, pos, c.n_rot, c.rope_base, **rope)
    cache.store(i, cache.n_past, k, v)
    a = ops.attention(q, cache, i, cache.n_past, ops.attention_scale(c.n_rot),
                      sinks=m.vector(p + "attn_sinks.weight"), window=g.window if g.sliding(i) else 0)
    return m.linear(p + "attn_output", a)


def moe(m, i: int, h):
    moe_c, ops, p = m.config.moe, m.ops, f"blk.{i}."
    ids, weights = ops.moe_route(m.linear(p + "ffn_gate_inp", h), moe_c.n_expert_used, moe_c.gating)
    experts = expert_weights(m, p)
    if experts["gate_up_exps"] is not None:
        gate_up = _expert_bias(m, f"{p}{FUSED}.bias")
        n_ff = gate_up.shape[1] // 2
        gate_b, up_b = gate_up[:, :n_ff], gate_up[:, n_ff:]
    else:
        gate_b, up_b = _expert_bias(m, f"{p}ffn_gate_exps.bias"), _expert_bias(m, f"{p}ffn_up_exps.bias")
    return ops.moe_ffn(h, ids, weights, **experts, biases=(gate_b, up_b, _expert_bias(m, f"{p}ffn_down_exps.bias")),
                       activation="swiglu_oai")


def _expert_bias(m, name: str):
    """A per-expert bias, ggml (n_out, n_expert), as (n_expert, n_out) float32 on the backend."""
    w = m.w.need(name)
    return m.vector(name).reshape(w.n_out, w.n_in)
