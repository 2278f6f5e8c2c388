"""The parts the grouped-query-attention MoE converters share (qwen3, qwen3moe, glm4moe): the
attention hyperparameters and tensors of a layer, and a layer's routed experts stacked into ggml's
3-D ``ffn_*_exps`` tensors.

Unlike llama's, these converters keep the q and k rows in Hugging Face's order: the GGUF
architectures use ggml's NEOX rope, which pairs dimension i with i + n_rot/2 as HF's "rotate half"
does, so no permutation is needed (convert_hf_to_gguf.py permutes only for llama).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from .checkpoint import Checkpoint, Conversion
from .config import Config
from .lazy import Stacked

U32 = ValueType.UINT32


@dataclass(frozen=True)
class Heads:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int


def heads(cfg: Config, arch: str, rope_scaling: bool = False) -> Heads:
    """The attention shape of config.json, checked as the loaders need it; ``rope_scaling``: the
    caller writes the config's rope scaling (gpt-oss's YaRN), else only unscaled rope is accepted."""
    n_embd, n_head = cfg.dim("hidden_size"), cfg.dim("num_attention_heads")
    n_head_kv = cfg.dim("num_key_value_heads", n_head)
    head_dim = cfg.integer("head_dim", 0) or n_embd // n_head
    if n_head % n_head_kv:
        raise QuantkitError(f"{cfg.path}: num_attention_heads {n_head} is not a multiple of "
                            f"num_key_value_heads {n_head_kv}")
    if head_dim < 2 or head_dim % 2:
        raise QuantkitError(f"{cfg.path}: the head size {head_dim} is odd (head_dim, or hidden_size / "
                            "num_attention_heads): rotary embeddings rotate pairs of dimensions")
    if cfg.rope_type != "default" and not rope_scaling:
        raise QuantkitError(f"{cfg.path}: rope scaling '{cfg.rope_type}' is not supported for {arch} "
                            "(convert_hf_to_gguf.py writes no rope scaling for it)")
    return Heads(n_embd, n_head, n_head_kv, head_dim)


def head_metadata(c: Conversion, cfg: Config, arch: str, h: Heads) -> None:
    """key/value lengths where config.json gives head_dim, as the converter's base class writes them."""
    if cfg.has("head_dim"):
        c.meta(f"{arch}.attention.key_length", h.head_dim, U32)
        c.meta(f"{arch}.attention.value_length", h.head_dim, U32)


def add_attention(c: Conversion, ck: Checkpoint, i: int, h: Heads, *, bias: bool, qk_norm: bool) -> None:
    """Layer i's attention tensors: attn_norm, q/k/v (+ biases), q/k per-head norms, attn_output."""
    p, g = f"model.layers.{i}.", f"blk.{i}."
    sa = p + "self_attn."
    q_rows, kv_rows = h.n_head * h.head_dim, h.n_head_kv * h.head_dim
    c.add(g + "attn_norm.weight", ck.get(p + "input_layernorm.weight", (h.n_embd,)))
    for proj, gg, rows in (("q_proj", "attn_q", q_rows), ("k_proj", "attn_k", kv_rows), ("v_proj", "attn_v", kv_rows)):
        c.add(f"{g}{gg}.weight", ck.get(f"{sa}{proj}.weight", (rows, h.n_embd)))
        if bias:
            c.add(f"{g}{gg}.bias", ck.get(f"{sa}{proj}.bias", (rows,)))
    c.add(g + "attn_output.weight", ck.get(sa + "o_proj.weight", (h.n_embd, q_rows)))
    if qk_norm:
        c.add(g + "attn_q_norm.weight", ck.get(sa + "q_norm.weight", (h.head_dim,)))
        c.add(g + "attn_k_norm.weight", ck.get(sa + "k_norm.weight", (h.head_dim,)))


def add_ffn(c: Conversion, ck: Checkpoint, hf: str, gg: str, n_embd: int, n_ff: int, suffix: str = "") -> None:
    """A SwiGLU MLP ``hf``.{gate,up,down}_proj -> ``gg``ffn_{gate,up,down}``suffix``."""
    c.add(f"{gg}ffn_gate{suffix}.weight", ck.get(hf + "gate_proj.weight", (n_ff, n_embd)))
    c.add(f"{gg}ffn_up{suffix}.weight", ck.get(hf + "up_proj.weight", (n_ff, n_embd)))
    c.add(f"{gg}ffn_down{suffix}.weight", ck.get(hf + "down_proj.weight", (n_embd, n_ff)))


def add_experts(c: Conversion, ck: Checkpoint, i: int, n_embd: int, n_ff_exp: int, n_expert: int) -> None:
    """Layer i's router (kept float32, as the converter keeps it) and its routed experts stacked into
    ggml (cols, rows, n_expert) tensors."""
    mlp, g = f"model.layers.{i}.mlp.", f"blk.{i}."
    c.add(g + "ffn_gate_inp.weight", ck.get(mlp + "gate.weight", (n_expert, n_embd), as_f32=True))
    for proj, gg, shape in (("gate_proj", "ffn_gate_exps", (n_ff_exp, n_embd)),
                            ("up_proj", "ffn_up_exps", (n_ff_exp, n_embd)),
                            ("down_proj", "ffn_down_exps", (n_embd, n_ff_exp))):
        c.add(f"{g}{gg}.weight", Stacked([ck.get(f"{mlp}experts.{e}.{proj}.weight", shape)
                                          for e in range(n_expert)]))


def check_used(cfg: Config, n_used: int, n_expert: int) -> None:
    if n_used > n_expert:
        raise QuantkitError(f"{cfg.path}: num_experts_per_tok {n_used} is more than the {n_expert} routed experts")
