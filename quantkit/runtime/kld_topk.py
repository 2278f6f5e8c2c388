"""Top-k KL-divergence base files: KLD without a base file of vocabulary x tokens.

llama-perplexity's ``--kl-divergence-base`` stores every log-probability of every scored position
(2 bytes x n_vocab each: 100 chunks of 512 tokens of a 129k vocabulary are 13 GB).  This form keeps,
per scored position, only what the statistics need::

    "_kldtopk"  int32 n_ctx  int32 n_vocab  int32 n_chunk  int32 k  int32 tokens[n_chunk * n_ctx]
    then per scored position (8k + 8 bytes, little-endian):
        int32   ids[k]        the k most probable tokens, most probable first (ties: lower id first)
        float32 logp[k]       their natural log-probabilities, non-increasing
        float32 logp_target   the log-probability of the token that follows (the scored one)
        float32 log_rest      log of the probability of every other token, 1 - sum exp(logp)
                              (summed over those tokens, not subtracted; -inf when k = n_vocab)

The KLD of a model q from such a base p is the KLD of the two distributions over k + 1 outcomes
(each top-k token, and "any other token")::

    KLD_k = sum_topk p (log p - log q) + p_rest (log p_rest - log q_rest),  q_rest = 1 - sum_topk q

By the log-sum inequality, merging outcomes never raises a KL divergence: KLD_k <= the full KLD,
non-decreasing in k, equal to it at k = n_vocab.  Every other statistic of --kl-divergence (the base
perplexity, Δp, same top token) needs only logp_target and ids[0], and is exact.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import QuantkitError
from ..inputs import open_regular
from .base_file import BaseFileWriter, read_tokens_and_rows
from .scoring import log_softmax, scored_span

MAGIC = b"_kldtopk"
HEADER = struct.Struct("<8siiii")
MASS_TOLERANCE = 1e-3           # |sum of a row's probabilities - 1| allowed (float32 log-probabilities)
BLOCK_ROWS = 64                 # positions per block of the float64 work arrays (n_vocab wide)
_CHECK_ROWS = 1 << 16           # positions per block when a file's rows are checked


def record_dtype(k: int) -> np.dtype:
    """One scored position's record (see the module doc)."""
    return np.dtype([("ids", "<i4", (k,)), ("logp", "<f4", (k,)), ("logp_target", "<f4"), ("log_rest", "<f4")])


class TopK(NamedTuple):
    """The top-k summary of n positions' distributions: ``ids`` (n, k), ``logp`` (n, k) their
    log-probabilities, most probable first, and ``log_rest`` (n,) the log of the remaining mass."""
    ids: np.ndarray
    logp: np.ndarray
    log_rest: np.ndarray


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, in float64; -inf for a row of -inf only."""
    m = x.max(axis=-1)
    finite = np.isfinite(m)
    shift = np.where(finite, m, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(finite, shift + np.log(np.exp(x - shift[:, None]).sum(axis=-1)), m)


def _rest_log_mass(lp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log of the probability of the tokens not in ``ids`` (summed directly: 1 - sum of the
    top-k would cancel to 0 or below when the rest is tiny)."""
    rest = lp.copy()
    np.put_along_axis(rest, ids, -np.inf, axis=1)
    return _logsumexp(rest)


def topk_of_logprobs(lp: np.ndarray, k: int) -> TopK:
    """The top-k summary of rows of log-probabilities (float64, (n, n_vocab)); ids ordered by
    decreasing probability, ties by increasing id (so ids[:, 0] is np.argmax's choice)."""
    n, n_vocab = lp.shape
    if not 1 <= k <= n_vocab:
        raise QuantkitError(f"top-k: k = {k} must be between 1 and the vocabulary's {n_vocab}")
    cand = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k < n_vocab else np.broadcast_to(np.arange(n_vocab), (n, k))
    cand = np.sort(cand, axis=1)                        # by id, then a stable sort by probability
    order = np.argsort(-np.take_along_axis(lp, cand, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(cand, order, axis=1)
    # a tie at the k-th place: argpartition may have kept a higher id of equal probability
    kth = np.take_along_axis(lp, ids[:, -1:], axis=1)
    for r in np.flatnonzero((lp == kth).sum(axis=1) > (np.take_along_axis(lp, ids, axis=1) == kth).sum(axis=1)):
        ids[r] = np.lexsort((np.arange(n_vocab), -lp[r]))[:k]
    return TopK(ids.astype(np.int32), np.take_along_axis(lp, ids, axis=1), _rest_log_mass(lp, ids))


def topk_of(logits: np.ndarray, k: int) -> TopK:
    """The top-k summary of a model's logits (n, n_vocab), log-probabilities as llama-perplexity
    forms them (scoring.log_softmax, float64)."""
    if len(logits) == 0:
        return TopK(np.zeros((0, k), np.int32), np.zeros((0, k)), np.zeros(0))
    parts = [topk_of_logprobs(log_softmax(logits[r:r + BLOCK_ROWS]), k)
             for r in range(0, len(logits), BLOCK_ROWS)]
    return TopK(*(np.concatenate(p) for p in zip(*parts)))


def topk_kld_logprobs(base_top: TopK, lq: np.ndarray) -> np.ndarray:
    """Per position, the KLD over the base's top-k tokens and the rest (the module doc) of the
    model whose log-probabilities are ``lq`` (float64 (n, n_vocab)) from the base ``base_top``."""
    ids, logp, log_rest = base_top
    logp = np.asarray(logp, np.float64)
    log_rest = np.asarray(log_rest, np.float64)
    ids = np.asarray(ids, np.int64)
    lq_top = np.take_along_axis(lq, ids, axis=1)
    kld = (np.exp(logp) * (logp - lq_top)).sum(axis=1)
    lq_rest = _rest_log_mass(lq, ids)
    has_rest = log_rest > -np.inf           # 0 log 0 = 0: no rest (k = n_vocab, or underflow)
    with np.errstate(invalid="ignore"):
        rest = np.where(has_rest, np.exp(log_rest) * (log_rest - lq_rest), 0.0)
    return kld + rest


def topk_kld(base_top, logits_q: np.ndarray) -> np.ndarray:
    """Per position (float64 (n,)), the top-k KLD of a model from a base: ``base_top`` the base's
    (ids, logp, log_rest) (a TopK, from topk_of or a TopkLogitsFile's rows), ``logits_q`` the
    model's logits at the same positions (n, n_vocab).  A lower bound of the full KLD."""
    base_top = TopK(*base_top)
    n = len(logits_q)
    if len(base_top.ids) != n:
        raise QuantkitError(f"top-k KLD: the base has {len(base_top.ids)} positions, the logits {n}")
    if n == 0:
        return np.zeros(0)
    return np.concatenate([topk_kld_logprobs(TopK(*(a[r:r + BLOCK_ROWS] for a in base_top)),
                                             log_softmax(logits_q[r:r + BLOCK_ROWS]))
                           for r in range(0, n, BLOCK_ROWS)])


class TopkWriter(BaseFileWriter):
    """Writes a top-k base file as LogitsWriter writes the full one: header and tokens first, then
    positions as they come (``add(logits, targets)``), under its name only when the block ends
    without an error."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, chunks: list[np.ndarray], k: int):
        if not 1 <= k <= n_vocab:
            raise QuantkitError(f"--kld-top-k {k}: it must be between 1 and the model's vocabulary of {n_vocab}")
        super().__init__(path, HEADER.pack(MAGIC, n_ctx, n_vocab, len(chunks), k), chunks, n_vocab)
        self.k = k

    def add(self, logits: np.ndarray, targets: np.ndarray) -> None:
        for r in range(0, len(logits), BLOCK_ROWS):
            lp = log_softmax(logits[r:r + BLOCK_ROWS])
            top = topk_of_logprobs(lp, self.k)
            rec = np.zeros(len(lp), record_dtype(self.k))
            rec["ids"], rec["logp"], rec["log_rest"] = top.ids, top.logp, top.log_rest
            next_tokens = np.asarray(targets[r:r + BLOCK_ROWS], np.int64)[:, None]
            rec["logp_target"] = np.take_along_axis(lp, next_tokens, axis=1)[:, 0]
            self._fh.write(rec.tobytes())


@dataclass
class TopkLogitsFile:
    n_ctx: int
    n_vocab: int
    chunks: list[np.ndarray]
    k: int
    data: np.ndarray            # record_dtype(k) (n_positions,), memory-mapped

    @classmethod
    def read(cls, path: Path) -> "TopkLogitsFile":
        """The file's header, tokens and (memory-mapped) rows, each checked before any is used:
        the header against the file's size, tokens and ids against the vocabulary, every row's
        ids distinct, log-probabilities finite (the rest's may be -inf), <= 0 and sorted, its
        mass summing to 1, and its next token's log-probability agreeing with its top-k."""
        path = Path(path)
        with open_regular(path, "--kl-divergence-base") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                head = f.read(HEADER.size)
            except OSError as e:
                raise QuantkitError(f"{path}: {e.strerror}") from None
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise QuantkitError(f"{path}: not a top-k logits file (no '_kldtopk' magic and header)")
        _, n_ctx, n_vocab, n_chunk, k = HEADER.unpack(head)
        header = f"n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}, k={k}"
        if n_ctx < 3 or n_vocab < 1 or n_chunk < 1 or not 1 <= k <= n_vocab:
            raise QuantkitError(f"{path}: inconsistent top-k logits file header ({header}): n_ctx must be at "
                                "least 3, n_vocab and n_chunk at least 1, k between 1 and n_vocab")
        n_tok = n_ctx * n_chunk
        first, per_chunk = scored_span(n_ctx)
        n_pos = n_chunk * per_chunk
        dtype = record_dtype(k)
        need = HEADER.size + 4 * n_tok + dtype.itemsize * n_pos
        if size != need:
            raise QuantkitError(f"{path}: truncated or inconsistent top-k logits file: its header ({header}) "
                                f"means {need} bytes, the file has {size}")
        tokens, data = read_tokens_and_rows(path, HEADER.size, n_tok, n_ctx, n_vocab, dtype, (n_pos,))
        chunks = [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)]
        targets = np.concatenate([c[first + 1:] for c in chunks])
        for r0 in range(0, n_pos, _CHECK_ROWS):
            problem = _row_problem(np.asarray(data[r0:r0 + _CHECK_ROWS]), targets[r0:r0 + _CHECK_ROWS], n_vocab)
            if problem is not None:
                r, what = problem
                r += r0
                raise QuantkitError(f"{path}: corrupt top-k logits row {r} (chunk {r // per_chunk + 1}): {what}")
        return cls(n_ctx, n_vocab, chunks, k, data)

    def check_model(self, model) -> None:
        """The model must have the base's vocabulary (ids index its logits)."""
        if model.config.n_vocab != self.n_vocab:
            raise QuantkitError(f"the base logits file has a vocabulary of {self.n_vocab}, the model "
                                f"{model.config.n_vocab}: they come from different models")

    def rows(self, start: int, stop: int) -> tuple[TopK, np.ndarray]:
        """Positions [start, stop): their TopK and the next tokens' log-probabilities."""
        d = np.asarray(self.data[start:stop])
        return TopK(d["ids"], d["logp"], d["log_rest"]), d["logp_target"]


def _row_problem(d: np.ndarray, targets: np.ndarray, n_vocab: int) -> tuple[int, str] | None:
    """The first row of records ``d`` that breaks the format's rules, and how; None if none."""
    ids, logp = d["ids"], d["logp"].astype(np.float64)
    target_lp, log_rest = d["logp_target"].astype(np.float64), d["log_rest"].astype(np.float64)

    def first(bad, what):
        return (int(np.argmax(bad)), what) if bad.any() else None
    checks = [
        lambda: first(((ids < 0) | (ids >= n_vocab)).any(axis=1), f"a token id is outside the vocabulary of {n_vocab}"),
        lambda: first((np.diff(np.sort(ids, axis=1), axis=1) == 0).any(axis=1), "a token id appears twice"),
        lambda: first(~(np.isfinite(logp) & (logp <= 0)).all(axis=1) | ~(np.isfinite(target_lp) & (target_lp <= 0)),
                      "log-probabilities must be finite and <= 0"),
        lambda: first(np.isnan(log_rest) | (log_rest > 0), "the rest's log-probability must be <= 0 (or -inf)"),
        lambda: first((np.diff(logp, axis=1) > 0).any(axis=1),
                      "the top-k log-probabilities are not in decreasing order"),
        lambda: first(np.abs(np.exp(logp).sum(axis=1) + np.exp(log_rest) - 1) > MASS_TOLERANCE,
                      "its probabilities do not sum to 1"),
    ]
    for check in checks:
        problem = check()
        if problem is not None:
            return problem
    # the next token: its log-probability is its top-k entry, or in the rest (below the k-th)
    hit = ids == targets[:, None]
    in_top = hit.any(axis=1)
    top_lp = np.where(in_top, (np.where(hit, logp, 0)).sum(axis=1), np.nan)
    with np.errstate(invalid="ignore"):
        bad = np.where(in_top, top_lp != target_lp, (target_lp > logp[:, -1]) | (target_lp > log_rest))
    return first(bad, "the next token's log-probability disagrees with the top-k")
