"""GptOssForCausalLM -> GGUF ``gpt-oss``, as mainline llama.cpp's converter writes it (ik_llama.cpp's
converter has no gpt-oss class; its runtime loads mainline's files).

Per layer: grouped-query attention with biases on q/k/v/o, NEOX rope (so q/k rows are kept as they
are), one learned "sink" logit per head (``attn_sinks.weight``), and routed experts with biases
whose router (``ffn_gate_inp`` weight and bias) picks the top-k logits.  The experts come either
as floats, ``gate_up_proj`` (n_expert, n_embd, 2 * n_ff) with gate and up columns interleaved and
``down_proj`` (n_expert, n_ff, n_embd), both input-major (the model computes x @ W), or as MXFP4
``*_blocks``/``*_scales`` pairs (output-major), which are repacked into ggml's block_mxfp4 bit for
bit (:class:`~quantkit.hf.lazy.MXFP4Experts`).  Either way the GGUF has ``ffn_{gate,up,down}_exps``
and their biases, the post-attention norm under ``post_attention_norm``.

YaRN's ``truncate: false`` (gpt-oss's config) has no GGUF key and is not written: llama.cpp always
rounds the correction range out to whole dims (transformers does so only with ``truncate: true``).

Sliding-window attention alternates, even layers windowed, as llama.cpp's gpt-oss graph hard-codes
(a checkpoint with other ``layer_types`` is refused); so does the activation's clamp (7) and alpha
(1.702), which the GGUF has no keys for.
"""
from __future__ import annotations

from dataclasses import astuple

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from . import gqa
from .checkpoint import Checkpoint, Conversion, add_output_head, base_conversion
from .config import Config
from .lazy import Columns, ExpertsTransposed, MXFP4Experts

U32, F32, STR = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING
# llama.cpp's LLM_FFN_SWIGLU_OAI constants
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "gpt-oss"
    n_layer, n_vocab = cfg.dim("num_hidden_layers"), cfg.dim("vocab_size")
    n_embd, n_head, n_head_kv, head_dim = astuple(gqa.heads(cfg, a, rope_scaling=True))
    n_ff, n_expert, n_used = cfg.dim("intermediate_size"), cfg.dim("num_local_experts"), cfg.dim("num_experts_per_tok")
    window = cfg.dim("sliding_window")
    if n_used > n_expert:
        raise QuantkitError(f"{cfg.path}: num_experts_per_tok {n_used} is more than num_local_experts {n_expert}")
    if n_ff % 32 and _has_mxfp4(ck):
        raise QuantkitError(f"{cfg.path}: intermediate_size {n_ff} is not a multiple of MXFP4's 32-weight blocks")
    for key, want in (("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)):
        got = cfg.number(key, want)
        if abs(got - want) > 1e-6:
            raise QuantkitError(f"{cfg.path}: {key} {got:g} is not supported: llama.cpp's gpt-oss uses {want:g}")
    layer_types = cfg.array("layer_types", None)
    want_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if layer_types is not None and layer_types != want_types:
        raise QuantkitError(f"{cfg.path}: layer_types is not supported: llama.cpp's gpt-oss alternates "
                            "sliding_attention (even layers) and full_attention (odd layers)")

    c = base_conversion(a, cfg, 1e-5)
    c.meta(f"{a}.expert_count", n_expert, U32)
    c.meta(f"{a}.expert_used_count", n_used, U32)
    c.meta(f"{a}.attention.key_length", head_dim, U32)
    c.meta(f"{a}.attention.value_length", head_dim, U32)
    c.meta(f"{a}.attention.sliding_window", window, U32)
    c.meta(f"{a}.expert_feed_forward_length", n_ff, U32)
    rope = cfg.rope_scaling
    if cfg.rope_type == "yarn":
        c.meta(f"{a}.rope.scaling.type", "yarn", STR)
        c.meta(f"{a}.rope.scaling.factor", rope.number("factor", positive=True), F32)
        c.meta(f"{a}.rope.scaling.original_context_length", rope.dim("original_max_position_embeddings"), U32)
        for hf_key, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.has(hf_key):
                c.meta(f"{a}.rope.scaling.{key}", rope.number(hf_key, positive=True), F32)
        if rope.has("attention_factor") or rope.has("mscale") or rope.has("mscale_all_dim"):
            raise QuantkitError(f"{cfg.path}: yarn attention_factor/mscale are not supported for gpt-oss "
                                "(llama.cpp uses YaRN's own 1 + 0.1 ln(factor))")
    elif cfg.rope_type != "default":
        raise QuantkitError(f"{cfg.path}: rope scaling '{cfg.rope_type}' is not supported for gpt-oss")

    ck.skip(r"rotary_emb\.inv_freq$")
    q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
    c.add("token_embd.weight", ck.get("model.embed_tokens.weight", (n_vocab, n_embd)))
    for i in range(n_layer):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        sa, mlp = p + "self_attn.", p + "mlp."
        c.add(g + "attn_norm.weight", ck.get(p + "input_layernorm.weight", (n_embd,)))
        for proj, name, rows, cols in (("q_proj", "attn_q", q_rows, n_embd), ("k_proj", "attn_k", kv_rows, n_embd),
                                       ("v_proj", "attn_v", kv_rows, n_embd),
                                       ("o_proj", "attn_output", n_embd, q_rows)):
            c.add(f"{g}{name}.weight", ck.get(f"{sa}{proj}.weight", (rows, cols)))
            c.add(f"{g}{name}.bias", ck.get(f"{sa}{proj}.bias", (rows,)))
        c.add(g + "attn_sinks.weight", ck.get(sa + "sinks", (n_head,)))
        c.add(g + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight", (n_embd,)))
        # the router stays float32, as the converter keeps it (llama-quantize never quantizes it)
        c.add(g + "ffn_gate_inp.weight", ck.get(mlp + "router.weight", (n_expert, n_embd), as_f32=True))
        c.add(g + "ffn_gate_inp.bias", ck.get(mlp + "router.bias", (n_expert,)))
        ex = mlp + "experts."
        if ck.has(ex + "gate_up_proj_blocks") or ck.has(ex + "down_proj_blocks"):
            gate_up = _mxfp4(ck, ex + "gate_up_proj", (n_expert, 2 * n_ff, n_embd))
            down = _mxfp4(ck, ex + "down_proj", (n_expert, n_embd, n_ff))
            gate, up = MXFP4Experts(*gate_up, 0, 2), MXFP4Experts(*gate_up, 1, 2)
            down = MXFP4Experts(*down)
        else:
            gate_up = ck.get(ex + "gate_up_proj", (n_expert, n_embd, 2 * n_ff)).t
            gate, up = ExpertsTransposed(gate_up, 0, 2), ExpertsTransposed(gate_up, 1, 2)
            down = ExpertsTransposed(ck.get(ex + "down_proj", (n_expert, n_ff, n_embd)).t)
        # biases are float32 (the converter's rule for every tensor not named *.weight)
        gate_up_bias = ck.get(ex + "gate_up_proj_bias", (n_expert, 2 * n_ff), as_f32=True)
        c.add(g + "ffn_gate_exps.weight", gate)
        c.add(g + "ffn_gate_exps.bias", Columns(gate_up_bias, 0, 2))
        c.add(g + "ffn_up_exps.weight", up)
        c.add(g + "ffn_up_exps.bias", Columns(gate_up_bias, 1, 2))
        c.add(g + "ffn_down_exps.weight", down)
        c.add(g + "ffn_down_exps.bias", ck.get(ex + "down_proj_bias", (n_expert, n_embd), as_f32=True))
    add_output_head(c, ck, cfg)
    return c


def _has_mxfp4(ck: Checkpoint) -> bool:
    return any(n.endswith(("_blocks", "_scales")) for n in ck.tensors)


def _mxfp4(ck: Checkpoint, name: str, shape: tuple[int, int, int]):
    """The blocks and scales of an MXFP4 expert tensor of HF shape (n_expert, rows, cols)."""
    n_expert, rows, cols = shape
    if cols % 32:
        raise QuantkitError(f"{ck.directory}: '{name}' rows of {cols} weights are not whole MXFP4 blocks of 32")
    want = {"_blocks": (n_expert, rows, cols // 32, 16), "_scales": (n_expert, rows, cols // 32)}
    parts = []
    for suffix, part_shape in want.items():
        t = ck.tensors.get(name + suffix)
        if t is None:
            raise QuantkitError(f"{ck.directory}: tensor '{name + suffix}' is missing from the checkpoint "
                                "(MXFP4 experts come as _blocks and _scales)")
        if t.dtype != "U8" or tuple(t.shape) != part_shape:
            raise QuantkitError(f"{ck.directory}: tensor '{name + suffix}' is {t.dtype} {list(t.shape)}; "
                                f"config.json implies U8 {list(part_shape)}")
        ck.used.add(name + suffix)
        parts.append(t)
    return parts
