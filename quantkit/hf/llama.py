"""LlamaForCausalLM (Llama 1-3, SmolLM, Mistral-style dense models) -> GGUF ``llama``."""
from __future__ import annotations

import math

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion, permute_qk_rows
from .config import Config
from .lazy import Constant, Gathered

U32, F32, STR = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING

# HF name inside a layer -> GGUF name inside blk.N
_LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)


def llama3_rope_factors(cfg: Config, head_dim: int) -> np.ndarray:
    """Llama 3's per-frequency rope divisors (``rope_freqs.weight``): 1 for short wavelengths,
    ``factor`` for long ones, a smooth blend between (computed in float32, as the converter does)."""
    rope = cfg.rope_scaling
    base = np.float32(cfg.rope_theta)
    freqs = np.float32(1.0) / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    factor = np.float32(rope.number("factor", 8.0, positive=True))
    low, high = np.float32(rope.number("low_freq_factor", 1.0, positive=True)), \
        np.float32(rope.number("high_freq_factor", 4.0, positive=True))
    if not high > low:      # the blend divides by high - low (transformers requires high > low too)
        rope.fail("high_freq_factor", f"a number greater than low_freq_factor ({low:g})")
    old_ctx = np.float32(rope.dim("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = np.float32(2 * math.pi) / f
        if wavelen < high_wavelen:
            out.append(np.float32(1.0))
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(np.float32(1.0) / ((np.float32(1.0) - smooth) / factor + smooth))
    return np.array(out, np.float32)


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "llama"
    n_layer, n_embd = cfg.dim("num_hidden_layers"), cfg.dim("hidden_size")
    n_head = cfg.dim("num_attention_heads")
    n_head_kv = cfg.dim("num_key_value_heads", n_head)
    head_dim = cfg.integer("head_dim", 0) or n_embd // n_head
    n_ff = cfg.dim("intermediate_size")
    n_vocab = cfg.dim("vocab_size")
    if n_head % n_head_kv:
        raise QuantkitError(f"{cfg.path}: num_attention_heads {n_head} is not a multiple of "
                            f"num_key_value_heads {n_head_kv}")
    if head_dim % 2:
        raise QuantkitError(f"{cfg.path}: the head size {head_dim} is odd (head_dim, or hidden_size / "
                            "num_attention_heads): rotary embeddings rotate pairs of dimensions")
    q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
    # the first layer's shapes before anything is computed from the head size (rope factors)
    ck.get("model.layers.0.self_attn.q_proj.weight", (q_rows, n_embd))

    c = base_conversion(a, cfg, 1e-5)
    c.meta(f"{a}.rope.dimension_count", head_dim, U32)
    if head_dim != n_embd // n_head:
        c.meta(f"{a}.attention.key_length", head_dim, U32)
        c.meta(f"{a}.attention.value_length", head_dim, U32)
    rope_type = cfg.rope_type
    if rope_type in ("linear", "yarn"):
        rope = cfg.rope_scaling
        c.meta(f"{a}.rope.scaling.type", rope_type, STR)
        c.meta(f"{a}.rope.scaling.factor", rope.number("factor", positive=True), F32)
        if rope_type == "yarn":
            c.meta(f"{a}.rope.scaling.original_context_length", rope.dim("original_max_position_embeddings"), U32)
    elif rope_type not in ("default", "llama3"):
        raise QuantkitError(f"{cfg.path}: rope scaling '{rope_type}' is not supported for llama")

    ck.skip(r"rotary_emb\.inv_freq$")
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, n_embd)))
    if rope_type == "llama3":
        c.add("rope_freqs.weight", Constant(llama3_rope_factors(cfg, head_dim)))
    shapes = {"self_attn.q_proj.weight": (q_rows, n_embd), "self_attn.k_proj.weight": (kv_rows, n_embd),
              "self_attn.v_proj.weight": (kv_rows, n_embd), "self_attn.o_proj.weight": (n_embd, q_rows),
              "mlp.gate_proj.weight": (n_ff, n_embd), "mlp.up_proj.weight": (n_ff, n_embd),
              "mlp.down_proj.weight": (n_embd, n_ff)}
    for i in range(n_layer):
        for hf, gg in _LAYER:
            t = ck.get(f"model.layers.{i}.{hf}", shapes.get(hf, (n_embd,)))
            if hf == "self_attn.q_proj.weight":
                t = Gathered(t, permute_qk_rows(q_rows, n_head))
            elif hf == "self_attn.k_proj.weight":
                t = Gathered(t, permute_qk_rows(kv_rows, n_head_kv))
            c.add(f"blk.{i}.{gg}", t)
    add_output_head(c, ck, cfg)
    return c
