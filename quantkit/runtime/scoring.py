"""Scores of a model's logits (host arrays, whichever backend computed them), as llama-perplexity
forms them: the perplexity, KL-divergence and imatrix passes and the warm-up score with these."""
from __future__ import annotations

import numpy as np

from . import kernels
from .tiles import by_rows


def scored_span(n_ctx: int) -> tuple[int, int]:
    """(first position whose logits are scored, how many) in a chunk of ``n_ctx`` tokens:
    llama-perplexity scores the second half, the logits at positions n_ctx/2 .. n_ctx-2 predicting
    tokens n_ctx/2+1 .. n_ctx-1."""
    first = n_ctx // 2
    return first, n_ctx - 1 - first


def log_softmax(x: np.ndarray) -> np.ndarray:
    """In float64, as llama-perplexity sums exp in double."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row as llama-perplexity computes it: exp of (logit - max) in float, summed
    in double (only the target's log-probability is formed, not the whole row's)."""
    logits = np.ascontiguousarray(logits, np.float32)
    targets = np.ascontiguousarray(targets, np.int64)
    out = np.empty(len(targets), np.float64)
    by_rows(lambda r0, r1: kernels.target_nll(logits[r0:r1], targets[r0:r1], out[r0:r1]), len(targets))
    return out
