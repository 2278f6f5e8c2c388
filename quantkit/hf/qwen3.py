"""Qwen3ForCausalLM -> GGUF ``qwen3`` and Qwen3MoeForCausalLM -> ``qwen3moe``, as ik_llama.cpp's
convert_hf_to_gguf.py writes them (Qwen3Model / Qwen3MoeModel).

Attention is llama's plus a per-head RMSNorm of q and k (``attn_q_norm``/``attn_k_norm``, one
head_dim vector each), with NEOX rope over the whole head. Qwen3-MoE replaces every MLP by
``num_experts`` routed experts (softmax router, no shared expert).

ik_llama.cpp's qwen3moe graph always normalises the chosen experts' weights (norm_topk_prob, which
every released Qwen3-MoE sets); its converter writes no key for it. A checkpoint with
``norm_topk_prob: false`` gets ``qwen3moe.expert_weights_norm = false``, which quantkit's runtime
follows (ik_llama.cpp ignores it).
"""
from __future__ import annotations

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from . import gqa
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion
from .config import Config

U32, BOOL = ValueType.UINT32, ValueType.BOOL


def _common(cfg: Config, ck: Checkpoint, a: str) -> tuple[Conversion, gqa.Heads, int]:
    n_layer, n_vocab = cfg.dim("num_hidden_layers"), cfg.dim("vocab_size")
    h = gqa.heads(cfg, a)
    if cfg.boolean("use_sliding_window", False):
        raise QuantkitError(f"{cfg.path}: use_sliding_window is true: sliding-window attention is not supported "
                            f"for {a} (ik_llama.cpp's {a} attends to the whole context)")
    if cfg.boolean("attention_bias", False):
        raise QuantkitError(f"{cfg.path}: attention_bias is true: ik_llama.cpp's {a} has no attention biases")
    c = base_conversion(a, cfg, 1e-6)
    gqa.head_metadata(c, cfg, a, h)
    ck.skip(r"rotary_emb\.inv_freq$")
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, h.n_embd)))
    return c, h, n_layer


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    """Qwen3ForCausalLM (dense)."""
    c, h, n_layer = _common(cfg, ck, "qwen3")
    n_ff = cfg.dim("intermediate_size")
    for i in range(n_layer):
        gqa.add_attention(c, ck, i, h, bias=False, qk_norm=True)
        c.add(f"blk.{i}.ffn_norm.weight", ck.get(f"model.layers.{i}.post_attention_layernorm.weight", (h.n_embd,)))
        gqa.add_ffn(c, ck, f"model.layers.{i}.mlp.", f"blk.{i}.", h.n_embd, n_ff)
    add_output_head(c, ck, cfg)
    return c


def convert_moe(cfg: Config, ck: Checkpoint) -> Conversion:
    """Qwen3MoeForCausalLM."""
    a = "qwen3moe"
    # transformers 5 saves num_experts as num_local_experts
    n_expert = cfg.dim("num_experts" if cfg.has("num_experts") else "num_local_experts")
    n_used = cfg.dim("num_experts_per_tok")
    n_ff_exp = cfg.dim("moe_intermediate_size")
    gqa.check_used(cfg, n_used, n_expert)
    # every layer sparse, as in every released Qwen3-MoE: ik_llama.cpp's qwen3moe has no dense layers
    if cfg.integer("decoder_sparse_step", 1) != 1 or cfg.array("mlp_only_layers", []):
        raise QuantkitError(f"{cfg.path}: decoder_sparse_step other than 1 or mlp_only_layers (dense layers "
                            "among the expert layers) are not supported for qwen3moe")
    c, h, n_layer = _common(cfg, ck, a)
    c.meta(f"{a}.expert_used_count", n_used, U32)
    c.meta(f"{a}.expert_count", n_expert, U32)
    c.meta(f"{a}.expert_feed_forward_length", n_ff_exp, U32)
    if not cfg.boolean("norm_topk_prob", False):
        c.meta(f"{a}.expert_weights_norm", False, BOOL)
    for i in range(n_layer):
        gqa.add_attention(c, ck, i, h, bias=False, qk_norm=True)
        c.add(f"blk.{i}.ffn_norm.weight", ck.get(f"model.layers.{i}.post_attention_layernorm.weight", (h.n_embd,)))
        gqa.add_experts(c, ck, i, h.n_embd, n_ff_exp, n_expert)
    add_output_head(c, ck, cfg)
    return c
