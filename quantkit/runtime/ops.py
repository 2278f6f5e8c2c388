"""The ops interface: every operation the model (``model.py``, ``deepseek2.py``) and the passes over it
(``perplexity.py``, ``collect.py``, ``warmup.py``, ``activations.py``) ask of a compute backend.

Two backends implement it: ``ops_cpu`` (a module: numpy + numba) and ``ops_torch.TorchOps`` (torch,
on a GPU or the CPU).  The backend is chosen once, by ``session.make_ops`` (or by whoever builds a
:class:`~quantkit.runtime.model.Model`), and handed to the model, which keeps it as ``model.ops``;
wrappers (imatrix's ``ObservingOps``, ``activations.MainlineRounding``) implement the interface
around another backend.  Nothing above the backends imports one of them.

Values are the backend's own arrays (numpy arrays on the CPU, torch tensors on a device) except
where a name says host: ``host``/``from_host`` convert, and the logits ``Model.forward`` returns are
host arrays.  ``tests/test_runtime_ops.py`` checks that both backends provide every operation with
these parameters and that the callers use no other.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .weights import Weight


class Cache(Protocol):
    """A KV cache (or MLA latent cache) of one sequence: ``n_past`` positions filled of ``n_ctx``."""
    n_ctx: int
    n_past: int

    def store(self, layer: int, pos0: int, k: Any, v: Any) -> None: ...

    def clear(self) -> None: ...


class Ops(Protocol):
    # products of at most this many tokens are a generation step's (fused 8-bit products where the
    # backend has them); the warm-up runs one pass per path: FUSED_TOKENS, FEW_TOKENS (ops_cpu's)
    FUSED_TOKENS: int
    FEW_TOKENS: int
    # whether a batch's quantized products (more than FUSED_TOKENS tokens) are float32 ones
    # (decoded tiles) rather than 8-bit ones: the head of a batch asks for the same kind
    FLOAT_BATCHES: bool

    # ---- values in and out of the backend ----
    def host(self, x: Any) -> np.ndarray: ...

    def from_host(self, x: np.ndarray) -> Any: ...

    def param(self, v: np.ndarray) -> Any: ...

    # ---- a generation step in one call ----
    # every layer and the head of a llama model, as model.Model.layer and .head compute them one
    # by one (the same values): ``layers`` per layer (attn_norm, [wq, wk, wv], attn_output,
    # ffn_norm, [gate, up], down), ``shape`` a model.StepShape.  Returns steps(x, pos, cache,
    # logits_from) -> the logits (host array) of tokens logits_from.. of x, or None for a call it
    # does not compute; or None itself where the backend has no such step for these weights.  A
    # wrapper that sees the products (an observer, another rounding) returns None: the step's
    # products would pass it by
    def layer_steps(self, layers: list, head: Weight, output_norm: Any, shape: Any) -> Any: ...

    # ---- matrix products ----
    def matmul_q(self, w: Weight, x: Any, fused: bool | None = None) -> Any: ...

    # the products of weights that share their input x: [matmul_q(w, x) for w in ws], the same values
    def matmul_q_many(self, ws: list[Weight], x: Any) -> list: ...

    def matmul_q_heads(self, ws: list[Weight], x: Any, transposed: bool = False) -> Any: ...

    def embed(self, w: Weight, ids: np.ndarray) -> Any: ...

    # ---- elementwise ----
    def rmsnorm(self, x: Any, weight: Any, eps: float) -> Any: ...

    # (x + y, rmsnorm(x + y)): a residual add and the norm after it, the same values as the two apart
    def add_rmsnorm(self, x: Any, y: Any, weight: Any, eps: float) -> tuple[Any, Any]: ...

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any: ...

    def silu_mul(self, gate: Any, up: Any) -> Any: ...

    def rope_ext(self, x: Any, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
                 ext_factor: float = 0.0, mscale: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 n_ctx_orig: int = 0, neox: bool = False) -> Any: ...

    # the rotary embedding of q and of k (the first n_rot dims; neox: (x[i], x[i + n_rot/2]) pairs,
    # else adjacent ones), then cache.store(layer, pos[0], k, v) (positions pos in a row); returns
    # the roped q.  One operation: a step's rope and cache write are one kernel on the CPU
    def rope_store(self, q: Any, k: Any, v: Any, cache: Cache, layer: int, pos: np.ndarray, n_rot: int,
                   freq_base: float, freq_scale: float = 1.0, neox: bool = False) -> Any: ...

    # ---- attention ----
    # k_type / v_type / cache_type: "f16" or "f32" (cache_type.py)
    def KVCache(self, n_layer: int, n_ctx: int, n_head_kv: int, k_dim: int, v_dim: int, k_type: str = "f16",
                v_type: str = "f16") -> Cache: ...

    def MLACache(self, n_layer: int, n_ctx: int, n_rot: int, kv_lora_rank: int, index_dim: int = 0,
                 cache_type: str = "f16") -> Cache: ...

    def attention(self, q: Any, cache: Cache, layer: int, pos0: int, scale: float, sinks: Any = None,
                  window: int = 0) -> Any: ...

    def attention_mla(self, q_rope: Any, q_lat: Any, cache: Cache, layer: int, pos0: int, scale: float,
                      keep: Any = None) -> Any: ...

    def dsa_topk(self, q: Any, weights: Any, cache: Cache, layer: int, pos0: int, top_k: int) -> Any: ...

    def attention_scale(self, k_dim: int) -> float: ...

    # ---- mixture of experts ----
    def moe_route(self, logits: Any, n_used: int, gating: str, bias: Any = None, norm: bool = False,
                  scale: float = 1.0, n_group: int = 1, n_group_used: int = 1) -> tuple[np.ndarray, np.ndarray]: ...

    def moe_ffn(self, x: Any, ids: np.ndarray, weights: np.ndarray, gate_exps: Weight | None, up_exps: Weight | None,
                down_exps: Weight, matmul=None, gate_up_exps: Weight | None = None, biases=None,
                activation: str = "silu") -> Any: ...
