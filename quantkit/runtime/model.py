"""One model definition for the runtime: configuration from GGUF metadata and the forward pass.

It calls only the ops module it is given (``ops_cpu`` by default), so the same code runs on any
backend.  Architectures: ``llama`` (SmolLM2, Llama 2/3, Mistral and friends) and ``deepseek2``
(DeepSeek-V2/V3/R1: latent attention and routed experts, whose blocks live in ``deepseek2.py``).
Every architecture shares the embedding, the pre-norm residual layer loop and the output head.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.reader import GGUFModel
from . import deepseek2, ops_cpu
from .deepseek2 import MLAConfig, MoEConfig
from .weights import WeightStore

SUPPORTED = ("llama", "deepseek2")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int               # per head, keys and values alike
    n_rot: int                  # leading dims of each head that get the rotary embedding
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_scale: float           # positions are multiplied by this (1 / linear scaling factor)
    mla: MLAConfig | None = None    # latent attention (deepseek2) instead of per-head keys and values
    moe: MoEConfig | None = None    # routed experts after moe.n_dense_lead plain-FFN layers

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> "ModelConfig":
        arch = model.architecture
        if arch not in SUPPORTED:
            raise QuantkitError(f"{model.path}: architecture '{arch}' is not supported by the runtime "
                                f"(supported: {', '.join(SUPPORTED)})")

        def key(name, default=None):
            v = model.get(f"{arch}.{name}", default)
            if v is None:
                raise QuantkitError(f"{model.path}: metadata key {arch}.{name} is missing")
            return v

        n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        n_vocab = model.get(f"{arch}.vocab_size")
        if n_vocab is None:
            tokens = model.metadata.get("tokenizer.ggml.tokens")
            n_vocab = len(tokens.to_python()) if tokens is not None else model.by_name["token_embd.weight"].shape[1]
        n_head_kv, n_ctx_train = int(key("attention.head_count_kv", n_head)), int(key("context_length"))
        scaling = model.get(f"{arch}.rope.scaling.type", "none")
        factor = float(model.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
        rope_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        mla = moe = None
        if arch == "deepseek2":
            mla, moe = deepseek2.read_config(model, key, n_ctx_train)
            # per query head; keys and values exist per head only inside the latent attention
            head_dim, n_head_kv, rope_scale = mla.qk_nope + mla.qk_rope, n_head, mla.freq_scale
        elif scaling not in ("none", "linear"):
            raise QuantkitError(f"{model.path}: rope scaling '{scaling}' is not supported for {arch}")
        return cls(arch=arch, n_layer=int(key("block_count")), n_embd=n_embd, n_head=n_head,
                   n_head_kv=n_head_kv, head_dim=head_dim,
                   n_rot=int(key("rope.dimension_count", head_dim)), n_vocab=int(n_vocab),
                   n_ctx_train=n_ctx_train, rms_eps=float(key("attention.layer_norm_rms_epsilon")),
                   rope_base=float(key("rope.freq_base", 10000.0)), rope_scale=rope_scale, mla=mla, moe=moe)


class Model:
    """Weights, configuration and the forward pass of one GGUF model."""

    def __init__(self, gguf: GGUFModel, ops=ops_cpu):
        self.gguf = gguf
        self.config = ModelConfig.from_gguf(gguf)
        self.ops = ops
        self.w = WeightStore(gguf)
        self.tok_embd = self.w.need("token_embd.weight")
        # tied embeddings: no output.weight, the token embedding doubles as the output matrix
        self.output = self.w.get("output.weight") or self.tok_embd
        self.w.need("output_norm.weight")
        self._norms = {}
        self._linears = {}                  # name -> (weight, bias or None)
        # load every layer now: a missing tensor fails early
        if self.config.mla:
            self.mla_heads = [deepseek2.load_layer(self, i) for i in range(self.config.n_layer)]
        else:
            for i in range(self.config.n_layer):
                for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                             "ffn_gate", "ffn_up", "ffn_down"):
                    self.w.need(f"blk.{i}.{name}.weight")

    def new_cache(self, n_ctx: int) -> ops_cpu.KVCache:
        c = self.config
        if c.mla:
            return self.ops.MLACache(c.n_layer, n_ctx, c.mla.qk_rope, c.mla.kv_lora_rank)
        return self.ops.KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim, c.head_dim)

    def vector(self, name: str) -> np.ndarray | None:
        """A 1-D tensor (norm weight, bias) as float32 (where the ops backend keeps it), or None
        when the file has none."""
        v = self._norms.get(name)
        if v is None and name in self.w:
            v = self._norms[name] = self.ops.param(self.w.need(name).vector())
        return v

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x @ ``name``.weight^T (+ ``name``.bias)."""
        wb = self._linears.get(name)
        if wb is None:
            wb = self._linears[name] = (self.w.need(name + ".weight"), self.vector(name + ".bias"))
        y = self.ops.matmul_q(wb[0], x)
        return y if wb[1] is None else y + wb[1]

    def ffn(self, prefix: str, x: np.ndarray, suffix: str = "") -> np.ndarray:
        """SwiGLU feed-forward ffn_down(silu(ffn_gate x) * ffn_up x) of tensors ``prefix``ffn_*``suffix``."""
        ops = self.ops
        g = ops.silu_mul(self.linear(prefix + "ffn_gate" + suffix, x), self.linear(prefix + "ffn_up" + suffix, x))
        return self.linear(prefix + "ffn_down" + suffix, g)

    def _attention(self, i: int, h: np.ndarray, pos: np.ndarray, cache) -> np.ndarray:
        """Grouped-query self-attention of layer i (llama) -> (n_tokens, n_embd)."""
        c, ops, p, n = self.config, self.ops, f"blk.{i}.", h.shape[0]
        q = self.linear(p + "attn_q", h).reshape(n, c.n_head, c.head_dim)
        k = self.linear(p + "attn_k", h).reshape(n, c.n_head_kv, c.head_dim)
        v = self.linear(p + "attn_v", h).reshape(n, c.n_head_kv, c.head_dim)
        q = ops.rope(q, pos, c.n_rot, c.rope_base, c.rope_scale)
        k = ops.rope(k, pos, c.n_rot, c.rope_base, c.rope_scale)
        cache.store(i, cache.n_past, k, v)
        a = ops.attention(q, cache, i, cache.n_past, ops.attention_scale(c.head_dim))  # (n, n_head * head_dim)
        return self.linear(p + "attn_output", a)

    def forward(self, tokens, cache: ops_cpu.KVCache, logits_from: int = 0) -> np.ndarray:
        """Run ``tokens`` at the cache's next positions; logits (n, n_vocab), a numpy array, of the
        tokens from index ``logits_from`` on (the last one only: ``logits_from=len(tokens) - 1``)."""
        c, ops = self.config, self.ops
        tokens = np.asarray(tokens, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.tok_embd.n_out):
            raise QuantkitError(f"token id outside the vocabulary (0..{self.tok_embd.n_out - 1})")
        n, pos0 = len(tokens), cache.n_past
        pos = np.arange(pos0, pos0 + n)
        x = ops.embed(self.tok_embd, tokens)                        # (n, n_embd)
        for i in range(c.n_layer):
            p = f"blk.{i}."
            h = ops.rmsnorm(x, self.vector(p + "attn_norm.weight"), c.rms_eps)
            x = x + (deepseek2.attention(self, i, h, pos, cache) if c.mla else self._attention(i, h, pos, cache))
            h = ops.rmsnorm(x, self.vector(p + "ffn_norm.weight"), c.rms_eps)
            x = x + (deepseek2.moe(self, i, h) if c.moe and i >= c.moe.n_dense_lead else self.ffn(p, h))
        cache.n_past = pos0 + n
        x = ops.rmsnorm(x[logits_from:], self.vector("output_norm.weight"), c.rms_eps)
        # a batch's last logits alone stay a batch's (float activations): fused only for a generation step
        return ops.host(ops.matmul_q(self.output, x, fused=n <= ops_cpu.FUSED_TOKENS))
