"""The runtime's warm-up run: kernels made ready before anything is timed.

llama.cpp runs the model once on a throwaway batch before it starts timing ("warming up the model
with an empty run").  quantkit's runtime needs it more: numba compiles the kernels of each weight
type on their first call (seconds each, the first time; a load from numba's cache after that, still
tens of milliseconds), and a first timed pass that did it would report a speed a hundred times too
low.  So :func:`warm_up` runs one forward pass per way the command computes (a generation step's
fused products of packed rows; a batch's decoded tiles) on a scratch cache and throws it away.
"""
from __future__ import annotations

import numpy as np

from ..compiling import CompileLog, announced
from ..types import type_name
from .model import NonFiniteLogits
from .ops import Ops
from .scoring import token_nll

_warmed: set = set()        # (ops, weight types, architecture, path) done in this process


def _layers(ops) -> list:
    """The ops wrappers (imatrix's ObservingOps, MainlineRounding: each keeps the one it wraps as
    ``_ops``) from the outside in, the backend last."""
    layers = [ops]
    while "_ops" in getattr(layers[-1], "__dict__", {}):
        layers.append(layers[-1].__dict__["_ops"])
    return layers


def weight_types(model) -> list[str]:
    """The names of the types of the model's matrices, sorted."""
    return sorted({type_name(t.qtype) for t in model.gguf.tensors if t.n_dims >= 2})


def token_counts(ops: Ops, n_tokens) -> list[int]:
    """One pass per path the forward pass takes: up to FUSED_TOKENS tokens the fused products (one
    token computes them as any such count does), from there the decoded tiles (FEW_TOKENS: the
    tile pool's path, which larger batches take)."""
    counts = set()
    for n in n_tokens:
        if n >= 1:
            counts.add(1 if n <= ops.FUSED_TOKENS else min(n, ops.FEW_TOKENS))
    return sorted(counts)


def warm_up(model, n_tokens, what: str | None = None) -> CompileLog:
    """Make ready every kernel that forward passes of ``n_tokens`` (counts) tokens use: one pass
    per path (:func:`token_counts`) from an empty scratch cache, its logits scored as perplexity
    scores a chunk.  Kernels that compile say so once ("compiling kernels for the runtime (q4_K,
    q6_K) ..."); a second call for the same backend, weight types, architecture and path does
    nothing.  Logits that are not finite are left to the real pass to report."""
    types = weight_types(model)
    layers = _layers(model.ops)
    ops = layers[-1]            # the passes go to the backend: an observer must not see them
    c = model.config
    shape = (id(ops), tuple(types), c.arch, c.mla is not None, c.moe is not None)
    counts = [n for n in token_counts(ops, n_tokens) if (shape, n) not in _warmed]
    with announced(what or f"the runtime ({', '.join(types)})") as log:
        for layer in layers[:-1]:       # a wrapper's own kernels (rounding, sums of squares)
            warm = getattr(type(layer), "warm_up", None)
            if warm is not None:
                warm(layer, [t.qtype for t in model.gguf.tensors if t.n_dims >= 2])
        if not counts:
            return log
        saved = model.ops
        model.ops = ops
        try:
            for n in counts:
                tokens = np.zeros(n, np.int64)
                try:
                    logits = model.forward(tokens, model.new_cache(n), logits_from=0)
                    token_nll(logits[:max(1, n - 1)], tokens[:max(1, n - 1)])
                    if n > ops.FUSED_TOKENS:
                        # a prompt's last logits alone: the head's product of a step, which a
                        # step in one call (ops.layer_steps) no longer asks of the backend
                        model.head(ops.from_host(np.zeros((1, c.n_embd), np.float32)), 0)
                except NonFiniteLogits:
                    pass
                _warmed.add((shape, n))
        finally:
            model.ops = saved
    return log
