"""Glm4MoeForCausalLM (GLM-4.5, 4.5-Air, 4.6, 4.7) -> GGUF ``glm4moe``, with the tensor names and
metadata of ik_llama.cpp's convert_hf_to_gguf.py (Glm4MoeModel).

Per layer: attention with q/k/v biases (``attention_bias``), optional per-head q/k RMSNorm
(``use_qk_norm``), NEOX rope over the first ``partial_rotary_factor`` of each head (GLM: half);
the norm before the MLP is ``post_attention_norm`` (gguf-py maps GLM's post_attention_layernorm
there); the first ``first_k_dense_replace`` layers have a dense MLP, the others a sigmoid router
with ``e_score_correction_bias`` (``exp_probs_b.bias``), routed experts and shared experts.

The multi-token-prediction (nextn) layers, ``num_nextn_predict_layers`` of them (GLM: one) stored
as ``model.layers.{num_hidden_layers + k}``, are kept as the converter keeps them: block_count
counts them, each is an ordinary MoE block ``blk.N`` plus its ``blk.N.nextn.*`` tensors (eh_proj,
enorm, hnorm, and where the checkpoint has them embed_tokens, shared_head_head, shared_head_norm:
GLM-4.6 stores no embed_tokens/shared_head.head, ik_llama.cpp's loader does not require them), and
``nextn_predict_layers`` is written when config.json has the key. llama.cpp's forward pass never
runs them (nor does quantkit's runtime). A nextn layer missing a tensor the loader requires, or a
layer beyond the ones config.json announces, is refused; a checkpoint that stores no nextn layer at
all (transformers drops it when it saves one, and writes ``num_nextn_predict_layers: 1`` by default)
is written without it (``nextn_predict_layers = 0``, with a warning) where the converter would count
blocks the file does not have.

Difference from convert_hf_to_gguf.py, deliberate: group-limited routing (``n_group`` > 1 with
``topk_group`` < ``n_group``, which transformers applies) is written as
``expert_group_count``/``expert_group_used_count``, which quantkit's runtime follows; ik_llama.cpp
does not read them for glm4moe (the released GLM models have one group).
"""
from __future__ import annotations

import logging
import re

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from . import gqa
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion
from .config import Config

U32, F32, BOOL = ValueType.UINT32, ValueType.FLOAT32, ValueType.BOOL
GATING_SIGMOID = 2
log = logging.getLogger("quantkit")

# A nextn layer's own tensors in the converter's order: (name after model.layers.N., name after
# blk.N.nextn., HF shape from (n_embd, n_vocab), whether ik_llama.cpp's loader requires it)
NEXTN_TENSORS = (
    ("eh_proj.weight", "eh_proj.weight", lambda e, v: (e, 2 * e), True),
    ("embed_tokens.weight", "embed_tokens.weight", lambda e, v: (v, e), False),
    ("enorm.weight", "enorm.weight", lambda e, v: (e,), True),
    ("hnorm.weight", "hnorm.weight", lambda e, v: (e,), True),
    ("shared_head.head.weight", "shared_head_head.weight", lambda e, v: (v, e), False),
    ("shared_head.norm.weight", "shared_head_norm.weight", lambda e, v: (e,), False),
)
_LAYER = re.compile(r"^model\.layers\.(\d{1,12})\.")     # (longer numbers: left unmapped, refused)


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "glm4moe"
    n_layer, n_vocab = cfg.dim("num_hidden_layers"), cfg.dim("vocab_size")
    h = gqa.heads(cfg, a)
    n_ff, n_ff_exp = cfg.dim("intermediate_size"), cfg.dim("moe_intermediate_size")
    n_expert, n_used = cfg.dim("n_routed_experts"), cfg.dim("num_experts_per_tok")
    n_shared, n_dense = cfg.integer("n_shared_experts", 0), cfg.integer("first_k_dense_replace", 0)
    n_nextn = _nextn_layers(cfg, ck, n_layer)
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
    c.meta(f"{a}.block_count", n_layer + n_nextn, U32)       # the nextn layers are blocks too
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
    if cfg.has("num_nextn_predict_layers"):
        c.meta(f"{a}.nextn_predict_layers", n_nextn, U32)
    if topk_group < n_group:
        c.meta(f"{a}.expert_group_count", n_group, U32)
        c.meta(f"{a}.expert_group_used_count", topk_group, U32)

    ck.skip(r"rotary_emb\.inv_freq$")
    bias, qk_norm = cfg.boolean("attention_bias", False), cfg.boolean("use_qk_norm", False)
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, h.n_embd)))
    for i in range(n_layer + n_nextn):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        nextn = i >= n_layer
        if nextn:
            # (where the converter's sorted tensor names put them: before the layer's own tensors)
            for nt in NEXTN_TENSORS[:4]:
                _add_nextn(c, ck, i, n_nextn, *nt, h.n_embd, n_vocab)
        gqa.add_attention(c, ck, i, h, bias=bias, qk_norm=qk_norm)
        c.add(g + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight", (h.n_embd,)))
        if i < n_dense:
            gqa.add_ffn(c, ck, p + "mlp.", g, h.n_embd, n_ff)
        else:
            gqa.add_experts(c, ck, i, h.n_embd, n_ff_exp, n_expert)
            c.add(g + "exp_probs_b.bias", ck.get(p + "mlp.gate.e_score_correction_bias", (n_expert,)))
            if n_shared:
                gqa.add_ffn(c, ck, p + "mlp.shared_experts.", g, h.n_embd, n_ff_exp * n_shared, "_shexp")
        if nextn:
            for nt in NEXTN_TENSORS[4:]:
                _add_nextn(c, ck, i, n_nextn, *nt, h.n_embd, n_vocab)
    add_output_head(c, ck, cfg)
    return c


def _nextn_layers(cfg: Config, ck: Checkpoint, n_layer: int) -> int:
    """The nextn layers to keep: num_nextn_predict_layers, checked against the layers the checkpoint
    stores after the blocks (the converter maps only the blocks it counts: "Can not map tensor" for
    any other; the loader requires every counted one).  A checkpoint that stores none of them
    (transformers drops them when it saves a model, and writes num_nextn_predict_layers 1 by
    default) is converted without them, where the converter would write blocks that are not there."""
    n_nextn = cfg.integer("num_nextn_predict_layers", 0)
    beyond = {int(m[1]) for n in ck.tensors if (m := _LAYER.match(n)) and int(m[1]) >= n_layer}
    if beyond and max(beyond) >= n_layer + n_nextn:
        raise QuantkitError(f"{ck.directory}: the checkpoint has tensors of layer {max(beyond)}, beyond the "
                            f"num_hidden_layers {n_layer} blocks and the num_nextn_predict_layers {n_nextn} "
                            f"nextn (MTP) layers of {cfg.path}")
    if n_nextn and not beyond:
        log.warning(f"{cfg.path}: num_nextn_predict_layers is {n_nextn} but the checkpoint stores no nextn (MTP) "
                    "layer: the file has none")
        return 0
    if len(beyond) < n_nextn:
        first = next(i for i in range(n_layer, n_layer + n_nextn) if i not in beyond)
        raise QuantkitError(f"{ck.directory}: {cfg.path} has num_nextn_predict_layers {n_nextn} but the "
                            f"checkpoint has no tensor of the nextn (MTP) layer {first}")
    return n_nextn


def _add_nextn(c: Conversion, ck: Checkpoint, i: int, n_nextn: int, hf: str, gg: str, shape, required: bool,
               n_embd: int, n_vocab: int) -> None:
    """Layer i's nextn tensor ``hf`` as ``blk.i.nextn.gg`` (left out where the checkpoint has none and
    ik_llama.cpp's loader does not require it)."""
    name = f"model.layers.{i}.{hf}"
    if not ck.has(name):
        if required:
            raise QuantkitError(f"{ck.directory}: the nextn (MTP) layer {i} (of num_nextn_predict_layers "
                                f"{n_nextn}) is incomplete: tensor '{name}' is missing")
        return
    c.add(f"blk.{i}.nextn.{gg}", ck.get(name, shape(n_embd, n_vocab)))
