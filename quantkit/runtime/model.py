"""One model definition for the runtime: the forward pass over a configuration read and validated
from the GGUF metadata (``hparams.py``).

It computes only through the ops backend it is given (the interface of ``ops.py``: ``ops_cpu`` or
``ops_torch.TorchOps``, chosen by ``session.make_ops``), so the same code runs on any backend.
Architectures: ``llama`` (SmolLM2, Llama 2/3, Mistral and friends), ``deepseek2``
(DeepSeek-V2/V3/R1: latent attention and routed experts, whose blocks live in ``deepseek2.py``),
``qwen3``/``qwen3moe``/``glm4moe`` (llama's grouped-query attention with NEOX rope, per-head q/k
norms, GLM's partial rope and biases; their experts are deepseek2's MoE block).
Every architecture shares the embedding, the pre-norm residual layer loop and the output head.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import signals
from ..errors import QuantkitError
from ..gguf_io.reader import GGUFModel
from . import deepseek2, experts, gptoss
from .cache_type import cache_types
from .hparams import ModelConfig
from .ops import Cache, Ops
from .weights import WeightStore


class NonFiniteLogits(QuantkitError):
    """Logits that are NaN or infinite: the model's weights or activations are not finite (a
    result computed from them would be NaN).  ``where``: what was being computed (a chunk, a
    generation step), added by the caller."""

    def __init__(self, position: int, where: str = ""):
        self.position = position
        super().__init__(f"{where + ': ' if where else ''}the logits at position {position} are NaN or infinite: "
                         "the model's weights or activations are not finite")

    def at(self, where: str) -> "NonFiniteLogits":
        return NonFiniteLogits(self.position, where)


class _LayerPlan(NamedTuple):
    """A llama-like layer's norm weights (None: the file has none), groups of weights (as
    Model._products takes them) and attention scale; ``down`` None: the layer's FFN is MoE."""
    attn_norm: Any
    qkv: tuple
    q_norm: Any
    k_norm: Any
    scale: float
    attn_output: tuple
    ffn_norm: Any
    gate_up: tuple
    down: tuple | None


class StepShape(NamedTuple):
    """What ops.layer_steps needs of the configuration besides the weights."""
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    neox: bool
    rope_base: float
    rope_scale: float
    eps: float
    scale: float


class Model:
    """Weights, configuration and the forward pass of one GGUF model."""

    def __init__(self, gguf: GGUFModel, ops: Ops, cache_type="f16"):
        self.gguf = gguf
        self.config = ModelConfig.from_gguf(gguf)
        self.ops = ops
        # the (K, V) cache types new_cache makes ("f16" or "f32", cache_type.py)
        self.cache_type = cache_types(cache_type, mla=bool(self.config.mla))
        self.w = WeightStore(gguf)
        self.tok_embd = self.w.need("token_embd.weight")
        # tied embeddings: no output.weight, the token embedding doubles as the output matrix
        self.output = self.w.get("output.weight") or self.tok_embd
        self._head = [self.output]          # the head as matmul_q_many takes it (made once: a step makes no list)
        self.w.need("output_norm.weight")
        self._norms = {}
        self._groups = {}                   # names -> ([weight], [bias or None] or None) of linears()
        self._plans = {}                    # layer -> _LayerPlan (llama-like layers)
        self._steps = (None, None)          # (ops, its layer_steps for this model or None)
        # load every layer now: a missing tensor fails early
        if self.config.mla:
            self.mla_heads = [deepseek2.load_layer(self, i) for i in range(self.config.n_layer)]
        elif self.config.gptoss:
            for i in range(self.config.n_layer):
                gptoss.load_layer(self, i)
        else:
            c = self.config
            for i in range(c.n_layer):
                names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", c.ffn_norm]
                if c.moe and i >= c.moe.n_dense_lead:
                    names += ["ffn_gate_inp", *experts.expert_tensors(self, f"blk.{i}.")]
                    names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if c.moe.n_expert_shared else []
                else:
                    names += ["ffn_gate", "ffn_up", "ffn_down"]
                for name in names:
                    self.w.need(f"blk.{i}.{name}.weight")

    def new_cache(self, n_ctx: int) -> Cache:
        c = self.config
        if c.mla:
            return self.ops.MLACache(c.n_layer, n_ctx, c.mla.qk_rope, c.mla.kv_lora_rank,
                                     index_dim=c.dsa.head_dim if c.dsa else 0, cache_type=self.cache_type[0])
        return self.ops.KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim, c.head_dim, *self.cache_type)

    def vector(self, name: str) -> np.ndarray | None:
        """A 1-D tensor (norm weight, bias) as float32 (where the ops backend keeps it), or None
        when the file has none."""
        v = self._norms.get(name, self)         # self: not looked up yet
        if v is self:
            v = self._norms[name] = self.ops.param(self.w.need(name).vector()) if name in self.w else None
        return v

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x @ ``name``.weight^T (+ ``name``.bias)."""
        return self.linears((name,), x)[0]

    def linears(self, names: tuple[str, ...], x: np.ndarray) -> list:
        """[linear(name, x) for name in names]: products that share their input, which the backend
        computes together (ops.matmul_q_many: a generation step's q/k/v in one launch, and each
        dense product without the per-call preparations of matmul_q)."""
        return self._products(self._group(names), x)

    def _group(self, names: tuple[str, ...]) -> tuple:
        """(weights, biases or None where none has one) of ``names``, as :meth:`_products` takes them."""
        group = self._groups.get(names)
        if group is None:
            biases = [self.vector(n + ".bias") for n in names]
            group = self._groups[names] = ([self.w.need(n + ".weight") for n in names],
                                           None if all(b is None for b in biases) else biases)
        return group

    def _products(self, group: tuple, x: np.ndarray) -> list:
        ys = self.ops.matmul_q_many(group[0], x)
        return ys if group[1] is None else [y if b is None else y + b for y, b in zip(ys, group[1])]

    def ffn(self, prefix: str, x: np.ndarray, suffix: str = "") -> np.ndarray:
        """SwiGLU feed-forward ffn_down(silu(ffn_gate x) * ffn_up x) of tensors ``prefix``ffn_*``suffix``."""
        gate, up = self.linears((prefix + "ffn_gate" + suffix, prefix + "ffn_up" + suffix), x)
        return self.linear(prefix + "ffn_down" + suffix, self.ops.silu_mul(gate, up))

    def _head_norm(self, weight, x, n_heads: int):
        """Per-head RMSNorm (Qwen3's and GLM's q_norm/k_norm, ``weight``) of x (n_tokens, n_heads, head_dim)."""
        n, d = x.shape[0], self.config.head_dim
        return self.ops.rmsnorm(x.reshape(n * n_heads, d), weight, self.config.rms_eps).reshape(n, n_heads, d)

    def _attention(self, i: int, h: np.ndarray, pos: np.ndarray, cache) -> np.ndarray:
        """Grouped-query self-attention of layer i (llama, qwen3, glm4moe) -> (n_tokens, n_embd)."""
        c, ops, n = self.config, self.ops, h.shape[0]
        plan = self._plan(i)
        q, k, v = self._products(plan.qkv, h)
        q = q.reshape(n, c.n_head, c.head_dim)
        k = k.reshape(n, c.n_head_kv, c.head_dim)
        v = v.reshape(n, c.n_head_kv, c.head_dim)
        if plan.q_norm is not None:
            q = self._head_norm(plan.q_norm, q, c.n_head)
        if plan.k_norm is not None:
            k = self._head_norm(plan.k_norm, k, c.n_head_kv)
        q = ops.rope_store(q, k, v, cache, i, pos, c.n_rot, c.rope_base, c.rope_scale, neox=c.rope_neox)
        a = ops.attention(q, cache, i, cache.n_past, plan.scale)  # (n, n_head * head_dim)
        return self._products(plan.attn_output, a)[0]

    def _plan(self, i: int) -> "_LayerPlan":
        """What layer i's step looks up by name (llama-like layers), looked up once: a step then
        builds no names (SmolLM2's 30 layers made ~300 strings and dict look-ups a step)."""
        plan = self._plans.get(i)
        if plan is None:
            c, p = self.config, f"blk.{i}."
            dense = not (c.moe and i >= c.moe.n_dense_lead)
            plan = self._plans[i] = _LayerPlan(
                attn_norm=self.vector(p + "attn_norm.weight"),
                qkv=self._group((p + "attn_q", p + "attn_k", p + "attn_v")),
                q_norm=self.vector(p + "attn_q_norm.weight"), k_norm=self.vector(p + "attn_k_norm.weight"),
                scale=self.ops.attention_scale(c.head_dim),
                attn_output=self._group((p + "attn_output",)),
                ffn_norm=self.vector(p + c.ffn_norm + ".weight"),
                gate_up=self._group((p + "ffn_gate", p + "ffn_up")) if dense else None,
                down=self._group((p + "ffn_down",)) if dense else None)
        return plan

    def forward(self, tokens, cache: Cache, logits_from: int = 0) -> np.ndarray:
        """Run ``tokens`` at the cache's next positions; logits (n, n_vocab), a numpy array, of the
        tokens from index ``logits_from`` on (the last one only: ``logits_from=len(tokens) - 1``).
        Logits that are not finite raise :class:`NonFiniteLogits`: nothing computed from them
        (a sampled token, a perplexity) would mean anything."""
        signals.check()         # an interrupt lost in a callback (signals.py) ends the run here
        c, ops = self.config, self.ops
        tokens = np.asarray(tokens, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.tok_embd.n_out):
            raise QuantkitError(f"token id outside the vocabulary (0..{self.tok_embd.n_out - 1})")
        n, pos0 = len(tokens), cache.n_past
        pos = np.arange(pos0, pos0 + n)
        x = ops.embed(self.tok_embd, tokens)                        # (n, n_embd)
        if n <= ops.FUSED_TOKENS:
            steps = self.layer_steps()
            logits = None if steps is None else steps(x, pos, cache, logits_from)
            if logits is not None:
                cache.n_past = pos0 + n
                return self._finite(ops.host(logits), pos0 + logits_from)
        for i in range(c.n_layer):
            x = self.layer(i, x, pos, cache)
        cache.n_past = pos0 + n
        return self.head(x[logits_from:], pos0 + logits_from, fused=n <= ops.FUSED_TOKENS)

    def layer_steps(self):
        """The backend's generation step in one call for this model (ops.layer_steps: every layer
        and the head, the same values as :meth:`layer` and :meth:`head` one by one), or None where
        it has none: for llama layers without biases or per-head norms only."""
        ops, steps = self._steps
        if ops is self.ops:
            return steps
        c, steps = self.config, None
        if not (c.mla or c.gptoss or c.moe):
            plans = [self._plan(i) for i in range(c.n_layer)]
            if plans and all(p.attn_norm is not None and p.ffn_norm is not None and p.q_norm is None and p.k_norm is None
                   and all(g[1] is None for g in (p.qkv, p.attn_output, p.gate_up, p.down)) for p in plans):
                shape = StepShape(c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.rope_neox, c.rope_base,
                                  c.rope_scale, c.rms_eps, plans[0].scale)
                steps = self.ops.layer_steps(
                    [(p.attn_norm, p.qkv[0], p.attn_output[0][0], p.ffn_norm, p.gate_up[0], p.down[0][0])
                     for p in plans], self.output, self.vector("output_norm.weight"), shape)
        self._steps = (self.ops, steps)
        return steps

    # forward's steps, also driven one by one by the sensitivity measurement (quantkit.sensitivity),
    # which starts a pass at the first layer whose weights it changed
    def layer(self, i: int, x, pos: np.ndarray, cache: Cache):
        """Layer ``i`` of the residual stream x (n, n_embd) at positions ``pos`` (its K/V stored in
        ``cache``'s layer i)."""
        c, ops = self.config, self.ops
        if c.gptoss:
            return gptoss.layer(self, i, x, pos, cache)
        if c.mla:
            p = f"blk.{i}."
            h = ops.rmsnorm(x, self.vector(p + "attn_norm.weight"), c.rms_eps)
            a = deepseek2.attention(self, i, h, pos, cache)
            x, h = ops.add_rmsnorm(x, a, self.vector(p + c.ffn_norm + ".weight"), c.rms_eps)
            return x + (deepseek2.moe(self, i, h) if c.moe and i >= c.moe.n_dense_lead else self.ffn(p, h))
        plan = self._plan(i)
        h = ops.rmsnorm(x, plan.attn_norm, c.rms_eps)
        a = self._attention(i, h, pos, cache)
        x, h = ops.add_rmsnorm(x, a, plan.ffn_norm, c.rms_eps)
        if plan.down is None:
            return x + deepseek2.moe(self, i, h)
        gate, up = self._products(plan.gate_up, h)         # self.ffn's, its names looked up once
        return x + self._products(plan.down, ops.silu_mul(gate, up))[0]

    def head(self, x, first_pos: int, fused: bool = False) -> np.ndarray:
        """Logits (n, n_vocab) of the last layer's output x, a numpy array (the first at position
        ``first_pos``, named in the error for logits that are not finite)."""
        x = self.ops.rmsnorm(x, self.vector("output_norm.weight"), self.config.rms_eps)
        # a batch's last logits alone stay a batch's: its kind of product (8-bit, as a generation
        # step's, or float32 with ops.FLOAT_BATCHES), whatever their count.  8-bit ones go through
        # matmul_q_many as a step's do (a few rows: the same launch and bits as a step's head), so
        # the warm-up's step makes ready the kernel a prompt's last logits use
        ops = self.ops
        logits = ops.host(ops.matmul_q_many(self._head, x)[0] if fused or not ops.FLOAT_BATCHES else
                          ops.matmul_q(self.output, x, fused=False))
        return self._finite(logits, first_pos)

    @staticmethod
    def _finite(logits: np.ndarray, first_pos: int) -> np.ndarray:
        finite = np.isfinite(logits).all(axis=1)
        if not finite.all():
            raise NonFiniteLogits(first_pos + int(np.argmin(finite)))
        return logits
