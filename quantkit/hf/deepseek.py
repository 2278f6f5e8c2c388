"""DeepseekV3ForCausalLM / DeepseekV2ForCausalLM -> GGUF ``deepseek2``, in ik_llama.cpp's layout.

Per layer, attention (MLA) writes the fused ``attn_kv_b`` and also its two halves, which ik_llama.cpp
prefers (it multiplies queries into the latent space instead of expanding the cache)::

    kv_b_proj [n_head * (qk_nope + v_head), kv_lora]      HF rows, per head h:
        rows h*(qk_nope+v_head) ...           + qk_nope     key band   -> attn_k_b, transposed:
                                                            ggml (qk_nope, n_head * kv_lora)
        rows h*(qk_nope+v_head) + qk_nope ... + v_head      value band -> attn_v_b, as stored:
                                                            ggml (kv_lora, n_head * v_head)

Routed experts ``mlp.experts.E.{gate,up,down}_proj`` are stacked into ggml (cols, rows, n_expert)
``ffn_*_exps`` tensors; the MTP layers (index >= num_hidden_layers) are skipped. With DeepSeek-V3's
61 layers (3 dense) that is the 1147-tensor file ik_llama.cpp's converter writes.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion
from .config import Config, describe
from .lazy import Gathered, HeadsTransposed, Stacked

U32, F32, STR, BOOL = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING, ValueType.BOOL
GATING = {"softmax": 1, "sigmoid": 2}


def fp8_scale_format(cfg: Config) -> str | None:
    """quantization_config.scale_fmt of an FP8 checkpoint: absent (float32 scales, V3) or "ue8m0"
    (powers of two, V3.1/V3.2: numerics.py)."""
    q = cfg.object("quantization_config")
    scale_format = q.string("scale_fmt", None) if q.raw.get("quant_method") == "fp8" else None
    if scale_format not in (None, "ue8m0"):
        raise QuantkitError(f"{cfg.path}: quantization_config scale_fmt {describe(scale_format)} is not supported "
                            "(float32 scales, or ue8m0 as DeepSeek-V3.1/V3.2 ship)")
    return scale_format


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "deepseek2"
    n_layer, n_embd, n_vocab = cfg.dim("num_hidden_layers"), cfg.dim("hidden_size"), cfg.dim("vocab_size")
    n_head = cfg.dim("num_attention_heads")
    n_ff, n_ff_exp = cfg.dim("intermediate_size"), cfg.dim("moe_intermediate_size")
    n_expert, n_shared = cfg.dim("n_routed_experts"), cfg.integer("n_shared_experts", 0)
    n_dense, n_used = cfg.integer("first_k_dense_replace", 0), cfg.dim("num_experts_per_tok")
    q_lora, kv_lora = cfg.integer("q_lora_rank", 0), cfg.dim("kv_lora_rank")
    qk_nope, qk_rope, v_head = cfg.dim("qk_nope_head_dim"), cfg.dim("qk_rope_head_dim"), cfg.dim("v_head_dim")
    moe_every = cfg.integer("moe_layer_freq", 1)
    if moe_every != 1:
        raise QuantkitError(f"{cfg.path}: moe_layer_freq {moe_every} is not supported (DeepSeek uses 1)")
    if n_used > n_expert:
        raise QuantkitError(f"{cfg.path}: num_experts_per_tok {n_used} is more than n_routed_experts {n_expert}")
    if qk_rope % 2:
        raise QuantkitError(f"{cfg.path}: qk_rope_head_dim {qk_rope} is odd: rotary embeddings rotate pairs of "
                            "dimensions")
    # V3 routes with sigmoid scores (transformers' V3 config no longer writes scoring_func), V2 with softmax
    v3 = cfg.architecture in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
    scoring = cfg.string("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring not in GATING:
        raise QuantkitError(f"{cfg.path}: scoring_func '{scoring}' is not supported (softmax or sigmoid)")
    n_group, topk_group = cfg.integer("n_group", 1), cfg.integer("topk_group", 1)
    if n_group > 1 and (n_expert % n_group or not 1 <= topk_group <= n_group):
        raise QuantkitError(f"{cfg.path}: n_group {n_group} with topk_group {topk_group} does not fit "
                            f"{n_expert} routed experts (n_group must divide them, topk_group be 1 to n_group)")

    ck.scale_format = fp8_scale_format(cfg)
    c = base_conversion(a, cfg, 1e-6)
    c.meta(f"{a}.expert_used_count", n_used, U32)
    if q_lora:
        c.meta(f"{a}.attention.q_lora_rank", q_lora, U32)
    c.meta(f"{a}.attention.kv_lora_rank", kv_lora, U32)
    c.meta(f"{a}.attention.key_length", qk_nope + qk_rope, U32)
    c.meta(f"{a}.attention.value_length", v_head, U32)
    c.meta(f"{a}.leading_dense_block_count", n_dense, U32)
    c.meta(f"{a}.expert_feed_forward_length", n_ff_exp, U32)
    c.meta(f"{a}.expert_count", n_expert, U32)
    c.meta(f"{a}.expert_shared_count", n_shared, U32)
    c.meta(f"{a}.expert_weights_scale", cfg.number("routed_scaling_factor", 1.0), F32)
    c.meta(f"{a}.expert_weights_norm", cfg.boolean("norm_topk_prob", False), BOOL)
    c.meta(f"{a}.expert_gating_func", GATING[scoring], U32)
    c.meta(f"{a}.rope.dimension_count", qk_rope, U32)
    if n_group > 1:
        c.meta(f"{a}.expert_group_count", n_group, U32)
        c.meta(f"{a}.expert_group_used_count", topk_group, U32)
    rope = cfg.rope_scaling
    if cfg.rope_type == "yarn":
        c.meta(f"{a}.rope.scaling.type", "yarn", STR)
        c.meta(f"{a}.rope.scaling.factor", rope.number("factor", positive=True), F32)
        c.meta(f"{a}.rope.scaling.original_context_length", rope.dim("original_max_position_embeddings"), U32)
        c.meta(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * rope.number("mscale_all_dim", 0.0), F32)
    elif cfg.rope_type != "default":
        raise QuantkitError(f"{cfg.path}: rope scaling '{cfg.rope_type}' is not supported for deepseek2")

    ck.skip(r"rotary_emb\.inv_freq$")
    # the multi-token-prediction layers follow the last block; llama.cpp does not use them
    layer_of = re.compile(r"^model\.layers\.(\d+)\.")
    ck.used.update(n for n in ck.tensors if (m := layer_of.match(n)) and int(m[1]) >= n_layer)

    qk_head = qk_nope + qk_rope
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, n_embd)))
    for i in range(n_layer):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        sa = p + "self_attn."
        c.add(g + "attn_norm.weight", ck.get(p + "input_layernorm.weight", (n_embd,)))
        if q_lora:
            c.add(g + "attn_q_a_norm.weight", ck.get(sa + "q_a_layernorm.weight", (q_lora,)))
        c.add(g + "attn_kv_a_norm.weight", ck.get(sa + "kv_a_layernorm.weight", (kv_lora,)))
        if q_lora:
            c.add(g + "attn_q_a.weight", ck.get(sa + "q_a_proj.weight", (q_lora, n_embd)))
            c.add(g + "attn_q_b.weight", ck.get(sa + "q_b_proj.weight", (n_head * qk_head, q_lora)))
        else:
            c.add(g + "attn_q.weight", ck.get(sa + "q_proj.weight", (n_head * qk_head, n_embd)))
        c.add(g + "attn_kv_a_mqa.weight", ck.get(sa + "kv_a_proj_with_mqa.weight", (kv_lora + qk_rope, n_embd)))
        kv_b = ck.get(sa + "kv_b_proj.weight", (n_head * (qk_nope + v_head), kv_lora))
        c.add(g + "attn_kv_b.weight", kv_b)
        k_b = HeadsTransposed(kv_b, n_head, qk_nope + v_head, 0, qk_nope)
        c.add(g + "attn_k_b.weight", k_b, (qk_nope, n_head * kv_lora))
        v_rows = (np.arange(n_head)[:, None] * (qk_nope + v_head) + qk_nope + np.arange(v_head)).reshape(-1)
        c.add(g + "attn_v_b.weight", Gathered(kv_b, v_rows), (kv_lora, n_head * v_head))
        c.add(g + "attn_output.weight", ck.get(sa + "o_proj.weight", (n_embd, n_head * v_head)))
        c.add(g + "ffn_norm.weight", ck.get(p + "post_attention_layernorm.weight", (n_embd,)))
        mlp = p + "mlp."
        if i < n_dense:
            c.add(g + "ffn_gate.weight", ck.get(mlp + "gate_proj.weight", (n_ff, n_embd)))
            c.add(g + "ffn_up.weight", ck.get(mlp + "up_proj.weight", (n_ff, n_embd)))
            c.add(g + "ffn_down.weight", ck.get(mlp + "down_proj.weight", (n_embd, n_ff)))
            continue
        # the router stays float32, as the converter keeps it (llama-quantize never quantizes it)
        c.add(g + "ffn_gate_inp.weight", ck.get(mlp + "gate.weight", (n_expert, n_embd), as_f32=True))
        if ck.has(mlp + "gate.e_score_correction_bias"):
            c.add(g + "exp_probs_b.bias", ck.get(mlp + "gate.e_score_correction_bias", (n_expert,)))
        for proj, gg, shape in (("gate_proj", "ffn_gate_exps", (n_ff_exp, n_embd)),
                                ("up_proj", "ffn_up_exps", (n_ff_exp, n_embd)),
                                ("down_proj", "ffn_down_exps", (n_embd, n_ff_exp))):
            c.add(f"{g}{gg}.weight", Stacked([ck.get(f"{mlp}experts.{e}.{proj}.weight", shape)
                                              for e in range(n_expert)]))
        if n_shared:
            sh = n_ff_exp * n_shared
            c.add(g + "ffn_gate_shexp.weight", ck.get(mlp + "shared_experts.gate_proj.weight", (sh, n_embd)))
            c.add(g + "ffn_up_shexp.weight", ck.get(mlp + "shared_experts.up_proj.weight", (sh, n_embd)))
            c.add(g + "ffn_down_shexp.weight", ck.get(mlp + "shared_experts.down_proj.weight", (n_embd, sh)))
    add_output_head(c, ck, cfg)
    return c
