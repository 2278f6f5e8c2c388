"""The blocks of architecture ``deepseek2`` (DeepSeek-V2/V2-Lite/V3/R1): multi-head latent attention
(MLA) and the routed mixture of experts, computed as ik_llama.cpp does (llm_build_deepseek2 with
its default MLA mode and flash attention off).

MLA keeps one compressed vector per position instead of per-head keys and values.  The cache holds
``kv`` = rmsnorm of the first kv_lora_rank outputs of attn_kv_a_mqa, and the shared roped key part
``k_rope`` (its last n_rot outputs).  Each head's key is (attn_k_b · kv, k_rope) and its value
attn_v_b · kv, so the query's non-rope part is moved into the latent space once
(q_nope · attn_k_b), attention runs against the cache rows themselves, and attn_v_b maps the
result back to each head's values: the same numbers with far less cache.

Files from ik_llama.cpp's and mainline's MLA converters store attn_k_b [qk_nope, kv_lora, n_head]
and attn_v_b [kv_lora, v_head, n_head]; older files only the fused attn_kv_b
[kv_lora, n_head * (qk_nope + v_head)], whose rows are, per head, qk_nope key rows then v_head
value rows; both are used in place, the key rows transposed (``matmul_q_t``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuantkitError
from .experts import expert_tensors, expert_weights
from .weights import Weight
from . import dsa

# The configuration (MLAConfig, MoEConfig) is read and validated in hparams.py.


# ---- weights ----

@dataclass(frozen=True)
class MLAHeads:
    """One layer's per-head latent maps (views of the file's tensors)."""
    k_b: list[Weight]           # per head: q_nope (qk_nope) -> latent (kv_lora); rows of attn_kv_b if k_b_t
    k_b_t: bool                 # k_b are attn_kv_b's key rows (kv_lora -> qk_nope), to be used transposed
    v_b: list[Weight]           # per head: latent (kv_lora) -> value (v_head)


def _rows(w: Weight, r0: int, r1: int) -> Weight:
    """Rows r0:r1 of a matrix as a 2-D Weight (a view)."""
    return Weight(f"{w.name}[{r0}:{r1}]", w.qtype, (w.n_in, r1 - r0), w.blocks[r0:r1])


def _per_head(w: Weight, n_in: int, n_out: int, n_head: int) -> list[Weight]:
    """The n_head matrices (n_out rows of n_in) of a 3-D tensor, also when stored flattened to 2-D."""
    if w.n_in != n_in or w.n_out * w.n_matrices != n_out * n_head:
        raise QuantkitError(f"tensor {w.name}: shape {list(w.shape)}, expected [{n_in}, {n_out}, {n_head}]")
    return [_rows(w, h * n_out, (h + 1) * n_out) for h in range(n_head)]


def load_layer(m, i: int) -> MLAHeads:
    """Check that layer i has every tensor it needs (so a bad file fails at load) and return its
    per-head latent maps."""
    c, mla, moe = m.config, m.config.mla, m.config.moe
    p = f"blk.{i}."
    names = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
    names += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if mla.q_lora_rank else ["attn_q"]
    if i < moe.n_dense_lead:
        names += ["ffn_gate", "ffn_up", "ffn_down"]
    else:
        names += ["ffn_gate_inp", *expert_tensors(m, p)]
        names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if moe.n_expert_shared else []
    for name in names:
        m.w.need(p + name + ".weight")
    for name in dsa.TENSORS if c.dsa else ():
        m.w.need(p + name)
    nope, lora, v_dim, n_head = mla.qk_nope, mla.kv_lora_rank, mla.v_head_dim, c.n_head
    if p + "attn_k_b.weight" in m.w and p + "attn_v_b.weight" in m.w:
        return MLAHeads(_per_head(m.w.need(p + "attn_k_b.weight"), nope, lora, n_head), False,
                        _per_head(m.w.need(p + "attn_v_b.weight"), lora, v_dim, n_head))
    kv_b = m.w.need(p + "attn_kv_b.weight")
    heads = _per_head(kv_b, lora, nope + v_dim, n_head)
    return MLAHeads([_rows(h, 0, nope) for h in heads], True, [_rows(h, nope, nope + v_dim) for h in heads])


# ---- blocks ----

def attention(m, i: int, h, pos, cache):
    """MLA self-attention of layer i on the normed input h (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    c, mla, ops, heads = m.config, m.config.mla, m.ops, m.mla_heads[i]
    p, n = f"blk.{i}.", h.shape[0]
    if mla.q_lora_rank:
        q_resid = ops.rmsnorm(m.linear(p + "attn_q_a", h), m.vector(p + "attn_q_a_norm.weight"), c.rms_eps)
        q = m.linear(p + "attn_q_b", q_resid)
    else:
        q_resid, q = None, m.linear(p + "attn_q", h)
    q = q.reshape(n, c.n_head, mla.qk_nope + mla.qk_rope)
    q_nope, q_rope = q[..., :mla.qk_nope], q[..., mla.qk_nope:]

    kv = m.linear(p + "attn_kv_a_mqa", h)                                  # (n, kv_lora + qk_rope)
    k_rope = kv[:, mla.kv_lora_rank:].reshape(n, 1, mla.qk_rope)
    kv = ops.rmsnorm(kv[:, :mla.kv_lora_rank], m.vector(p + "attn_kv_a_norm.weight"), c.rms_eps)

    # ggml's "normal" rope (adjacent pairs) on the rope dims of every query head and the shared key
    rope = dict(freq_scale=mla.freq_scale, ext_factor=mla.ext_factor, mscale=mla.rope_mscale,
                beta_fast=mla.beta_fast, beta_slow=mla.beta_slow, n_ctx_orig=mla.n_ctx_orig)
    q_rope = ops.rope_ext(q_rope, pos, mla.qk_rope, c.rope_base, **rope)
    k_rope = ops.rope_ext(k_rope, pos, mla.qk_rope, c.rope_base, **rope)

    pos0 = cache.n_past
    cache.store(i, pos0, k_rope, kv)
    q_lat = ops.matmul_q_heads(heads.k_b, q_nope, transposed=heads.k_b_t)   # (n, n_head, kv_lora)
    # DeepSeek-V3.2: the keys the indexer keeps (None: all of them)
    keep = dsa.select(m, i, h, q_resid, pos, cache) if c.dsa else None
    a = ops.attention_mla(q_rope, q_lat, cache, i, pos0, mla.kq_scale, keep=keep)   # (n, n_head, kv_lora)
    o = ops.matmul_q_heads(heads.v_b, a)                                     # (n, n_head, v_head)
    return m.linear(p + "attn_output", o.reshape(n, c.n_head * mla.v_head_dim))


def moe(m, i: int, h):
    """Routed experts plus the shared ones of layer i on the normed input h -> (n_tokens, n_embd)."""
    moe_c, ops, p = m.config.moe, m.ops, f"blk.{i}."
    ids, weights = ops.moe_route(m.linear(p + "ffn_gate_inp", h), moe_c.n_expert_used, moe_c.gating,
                                 bias=m.vector(p + "exp_probs_b.bias"), norm=moe_c.weights_norm,
                                 scale=moe_c.weights_scale, n_group=moe_c.n_group, n_group_used=moe_c.n_group_used)
    out = ops.moe_ffn(h, ids, weights, **expert_weights(m, p))
    if moe_c.n_expert_shared:
        out = out + m.ffn(p, h, "_shexp")
    return out
