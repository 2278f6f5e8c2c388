"""Text generation: sampling and the prompt -> tokens loop, with llama.cpp's timing split
(prompt processing vs. generation)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..compiling import ready_kernels
from ..errors import QuantkitError
from ..words import counted
from .model import NonFiniteLogits
from .warmup import warm_up


@dataclass
class SamplerOptions:
    temp: float = 0.8           # 0: greedy
    top_k: int = 40             # 0: all tokens
    top_p: float = 0.95         # 1: no nucleus cut
    seed: int | None = None     # None or -1 (llama.cpp's "random"): a random seed

    def __post_init__(self):
        if not (math.isfinite(self.temp) and self.temp >= 0):
            raise QuantkitError(f"--temp {self.temp}: the temperature must be a finite number >= 0 (0: greedy)")
        if self.top_k < 0:
            raise QuantkitError(f"--top-k {self.top_k}: must be >= 0 (0: all tokens)")
        if not 0.0 <= self.top_p <= 1.0:
            raise QuantkitError(f"--top-p {self.top_p}: must be between 0 and 1 (1: off)")
        if self.seed == -1:
            self.seed = None
        elif self.seed is not None and self.seed < 0:
            raise QuantkitError(f"--seed {self.seed}: must be >= 0, or -1 for a random seed")


class Sampler:
    """top-k, then top-p, then temperature, as llama.cpp's default chain orders them."""

    def __init__(self, opts: SamplerOptions):
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)

    def __call__(self, logits: np.ndarray) -> int:
        o = self.opts
        if o.temp <= 0:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64)
        k = len(logits) if o.top_k <= 0 else min(o.top_k, len(logits))
        idx = np.argpartition(-logits, k - 1)[:k]
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        p = np.exp(logits[idx] - logits[idx[0]])
        p /= p.sum()
        if o.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), o.top_p) + 1)
            idx, p = idx[:keep], p[:keep]
        z = (logits[idx] - logits[idx[0]]) / o.temp      # <= 0, the best 0: exp neither overflows nor is all 0
        p = np.exp(z)
        p /= p.sum()
        return int(idx[self.rng.choice(len(idx), p=p)])


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_generated: int = 0
    gen_seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)
    warm_up_seconds: float = 0.0    # the warm-up run before the timed passes (kernels made ready)
    kernels_while_timed: int = 0    # kernels compiled or loaded from numba's cache inside the timed passes

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_generated / self.gen_seconds if self.gen_seconds else 0.0


def context_size(model, prompt: list[int], n_predict: int, n_ctx: int | None = None) -> int:
    """The context a generation of ``n_predict`` tokens after ``prompt`` uses, or an error when they
    do not fit in ``n_ctx``.  A caller checks this before it shows anything."""
    if not prompt:
        raise QuantkitError("the prompt is empty (no tokens)")
    n_ctx = n_ctx or min(model.config.n_ctx_train, len(prompt) + n_predict)
    if len(prompt) + n_predict > n_ctx:
        raise QuantkitError(f"the prompt ({counted(len(prompt), 'token')}) and {counted(n_predict, 'token')} to "
                            f"generate exceed the context of {counted(n_ctx, 'token')}")
    return n_ctx


def generate(model, prompt: list[int], n_predict: int, sampler: Sampler, stop_ids=(),
             n_ctx: int | None = None, stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield up to ``n_predict`` sampled tokens after ``prompt``; stops early at a token of
    ``stop_ids`` (not yielded).  ``stats`` is filled as it goes.

    The arguments are checked and the warm-up run made by the call itself, before a caller shows
    anything (a compile notice gets a line of its own); the tokens are computed as iterated."""
    n_ctx = context_size(model, prompt, n_predict, n_ctx)
    stats = stats if stats is not None else GenerationStats()
    stats.n_prompt = len(prompt)
    t0 = time.perf_counter()
    # as llama.cpp does: a throwaway run first, so the timed ones compute and only compute
    warm_up(model, (len(prompt), 1) if n_predict else (len(prompt),))
    stats.warm_up_seconds = time.perf_counter() - t0
    return _generate(model, prompt, n_predict, sampler, stop_ids, n_ctx, stats)


def _generate(model, prompt: list[int], n_predict: int, sampler: Sampler, stop_ids, n_ctx: int,
              stats: GenerationStats) -> Iterator[int]:
    ready = ready_kernels()
    cache = model.new_cache(n_ctx)
    t0 = time.perf_counter()
    try:
        logits = model.forward(prompt, cache, logits_from=len(prompt) - 1)[-1]
    except NonFiniteLogits as e:
        raise e.at("the prompt (generation step 1)") from None
    stats.prompt_seconds = time.perf_counter() - t0
    stats.kernels_while_timed = ready_kernels() - ready
    t0 = time.perf_counter()
    for step in range(1, n_predict + 1):
        tok = sampler(logits)
        if tok in stop_ids:
            break
        stats.tokens.append(tok)
        stats.n_generated += 1
        yield tok
        if stats.n_generated == n_predict:
            break
        try:
            logits = model.forward([tok], cache, logits_from=0)[-1]
        except NonFiniteLogits as e:
            raise e.at(f"generation step {step + 1}") from None
        stats.gen_seconds = time.perf_counter() - t0
    stats.gen_seconds = time.perf_counter() - t0
    stats.kernels_while_timed = ready_kernels() - ready
