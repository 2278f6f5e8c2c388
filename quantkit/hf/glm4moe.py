"""Glm4MoeForCausalLM (GLM-4.5, 4.5-Air, 4.6, 4.7) -> GGUF ``glm4moe``, with the tensor names and
metadata of ik_llama.cpp's convert_hf_to_gguf.py (Glm4MoeModel).

Per layer: attention with q/k/v biases (``attention_bias``), optional per-head q/k RMSNorm
(``use_qk_norm``), NEOX rope over the first ``partial_rotary_factor`` of each head (GLM: half);
the norm before the MLP is ``post_attention_norm`` (gguf-py maps GLM's post_attention_layernorm
there); the first ``first_k_dense_replace`` layers have a dense MLP, the others a sigmoid router
with ``e_score_correction_bias`` (``exp_probs_b.bias``), routed experts and shared experts.

Differences from convert_hf_to_gguf.py, both deliberate:

* the multi-token-prediction (nextn) layers after the last block are skipped, as for DeepSeek:
  llama.cpp's forward pass never runs them. The file says so with ``nextn_predict_layers = 0``
  (the converter keeps them and counts them in block_count).
* group-limited routing (``n_group`` > 1 with ``topk_group`` < ``n_group``, which transformers
  applies) is written as ``expert_group_count``/``expert_group_used_count``, which quantkit's runtime
  follows; ik_llama.cpp does not read them for glm4moe (the released GLM models have one group).
"""
from __future__ import annotations

import re

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from . import gqa
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion
from .config import Config

U32, F32, BOOL = ValueType.UINT32, ValueType.FLOAT32, ValueType.BOOL
GATING_SIGMOID = 2


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "glm4moe"
    n_layer, n_vocab = cfg.dim("num_hidden_layers"), cfg.dim("vocab_size")
    h = gqa.heads(cfg, a)
    n_ff, n_ff_exp = cfg.dim("intermediate_size"), cfg.dim("moe_intermediate_size")
    n_expert, n_used = cfg.dim("n_routed_experts"), cfg.dim("num_experts_per_tok")
    n_shared, n_dense = cfg.integer("n_shared_experts", 0), cfg.integer("first_k_dense_replace", 0)
    gqa.check_used(cfg, n_used, n_expert)
    if n_dense > n_layer:
        raise QuantkitError(f"{cfg.path}: first_k_dense_replace {n_dense} is more than num_hidden_layers {n_layer}")
    # transformers reads partial_rotary_factor at the top level or in rope_parameters; GLM's default 0.5
    factor = cfg.number("partial_rotary_factor", None, low=0.0, high=1.0)
    if factor is None:
        factor = cfg.rope_scaling.number("partial_rotary_factor", 0.5, low=0.0, high=1.0)
    n_rot = int(h.head_dim * factor)
    if n_rot < 2 or n_rot % 2:
        raise QuantkitError(f"{cfg.path}: partial_rotary_factor {factor:g} of the head size {h.head_dim} gives "
                            f"{n_rot} rotary dimensions (must be even and at least 2)")
    n_group, topk_group = cfg.integer("n_group", 1, low=1), cfg.integer("topk_group", 1, low=1)
    if n_expert % n_group or topk_group > n_group:
        raise QuantkitError(f"{cfg.path}: n_group {n_group} with topk_group {topk_group} does not fit "
                            f"{n_expert} routed experts (n_group must divide them, topk_group be 1 to n_group)")
    if topk_group < n_group and n_used > topk_group * (n_expert // n_group):
        raise QuantkitError(f"{cfg.path}: num_experts_per_tok {n_used} is more than the experts of "
                            f"topk_group {topk_group} groups")

    c = base_conversion(a, cfg, 1e-5)
    gqa.head_metadata(c, cfg, a, h)
    c.meta(f"{a}.rope.dimension_count", n_rot, U32)
    c.meta(f"{a}.expert_used_count", n_used, U32)
    c.meta(f"{a}.expert_count", n_expert, U32)
    c.meta(f"{a}.expert_feed_forward_length", n_ff_exp, U32)
    c.meta(f"{a}.expert_shared_count", n_shared, U32)
    c.meta(f"{a}.leading_dense_block_count", n_dense, U32)
    c.meta(f"{a}.expert_gating_func", GATING_SIGMOID, U32)
    c.meta(f"{a}.expert_weights_scale", cfg.number("routed_scaling_factor", 1.0, positive=True), F32)
    c.meta(f"{a}.expert_weights_norm", cfg.boolean("norm_topk_prob", True), BOOL)
    c.meta(f"{a}.nextn_predict_layers", 0, U32)
    if topk_group < n_group:
        c.meta(f"{a}.expert_group_count", n_group, U32)
        c.meta(f"{a}.expert_group_used_count", topk_group, U32)

    ck.skip(r"rotary_emb\.inv_freq$")
    # the nextn (MTP) layers follow the last block
    layer_of = re.compile(r"^model\.layers\.(\d+)\.")
    ck.used.update(n for n in ck.tensors if (m := layer_of.match(n)) and int(m[1]) >= n_layer)
    bias, qk_norm = cfg.boolean("attention_bias", False), cfg.boolean("use_qk_norm", False)
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, h.n_embd)))
    for i in range(n_layer):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        gqa.add_attention(c, ck, i, h, bias=bias, qk_norm=qk_norm)
        c.add(g + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight", (h.n_embd,)))
        if i < n_dense:
            gqa.add_ffn(c, ck, p + "mlp.", g, h.n_embd, n_ff)
            continue
        gqa.add_experts(c, ck, i, h.n_embd, n_ff_exp, n_expert)
        c.add(g + "exp_probs_b.bias", ck.get(p + "mlp.gate.e_score_correction_bias", (n_expert,)))
        if n_shared:
            gqa.add_ffn(c, ck, p + "mlp.shared_experts.", g, h.n_embd, n_ff_exp * n_shared, "_shexp")
    add_output_head(c, ck, cfg)
    return c
