"""Perplexity and KL divergence the way llama-perplexity computes them.

The text is tokenized once; chunk i is tokens [i*n_ctx, (i+1)*n_ctx) (first token replaced by BOS
when the vocabulary adds one), the KV cache starts empty for every chunk, and the second half of
each chunk is scored: the logits at position p predict token p+1 for p = n_ctx/2 .. n_ctx-2.

``--kl-divergence-base`` files are llama-perplexity's own format, so either tool can read the
other's::

    "_logits_"  int32 n_ctx  int32 n_vocab  int32 n_chunk  int32 tokens[n_chunk * n_ctx]
    then per scored position, nv = 2*((n_vocab+1)/2) + 4 uint16:
        float32 scale, float32 min_log_prob (as 4 uint16), uint16 q[n_vocab] (+1 pad if odd)
    log p_i = scale * q_i + min_log_prob
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import QuantkitError
from ..outputs import AtomicOutput
from . import kernels, ops_cpu
from .ops_cpu import log_softmax

MAGIC = b"_logits_"
MIN_LOG_PROB = -16.0            # logits further than this below the maximum are stored as 0


def chunk_tokens(tokens: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> list[np.ndarray]:
    """The chunks llama-perplexity evaluates."""
    if len(tokens) < 2 * n_ctx:
        raise QuantkitError(f"the text has {len(tokens)} tokens: at least 2 * n_ctx = {2 * n_ctx} are needed")
    n = len(tokens) // n_ctx
    if n_chunks is not None and n_chunks > 0:
        n = min(n, n_chunks)
    out = []
    for i in range(n):
        c = np.array(tokens[i * n_ctx:(i + 1) * n_ctx], np.int64)
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def chunk_logits(model, chunk: np.ndarray) -> np.ndarray:
    """Logits (n_ctx - n_ctx/2, n_vocab) of the scored half of one chunk, from an empty cache."""
    n_ctx = len(chunk)
    cache = model.new_cache(n_ctx)
    return model.forward(chunk, cache, logits_from=n_ctx // 2)


def _mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    mean = s / n
    var = s2 / n - mean * mean
    return mean, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


@dataclass
class PplResult:
    nll: list[float] = field(default_factory=list)          # per scored token
    chunk_ppl: list[float] = field(default_factory=list)     # running estimate after each chunk

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))

    @property
    def ppl_error(self) -> float:
        """llama-perplexity's "+/-": PPL * standard error of the mean NLL."""
        n = len(self.nll)
        m = sum(self.nll) / n
        var = sum(v * v for v in self.nll) / n - m * m
        return math.sqrt(var / (n - 1)) * self.ppl if var > 0 else 0.0


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row as llama-perplexity computes it: exp of (logit - max) in float, summed
    in double (only the target's log-probability is formed, not the whole row's)."""
    logits = np.ascontiguousarray(logits, np.float32)
    targets = np.ascontiguousarray(targets, np.int64)
    out = np.empty(len(targets), np.float64)
    ops_cpu.by_rows(lambda r0, r1: kernels.target_nll(logits[r0:r1], targets[r0:r1], out[r0:r1]), len(targets))
    return out


def perplexity(model, chunks: list[np.ndarray], on_chunk: Callable[[int, PplResult], None] | None = None,
               base_writer: "LogitsWriter | None" = None) -> PplResult:
    res = PplResult()
    for i, chunk in enumerate(chunks):
        n_ctx = len(chunk)
        first = n_ctx // 2
        logits = chunk_logits(model, chunk)[:n_ctx - 1 - first]         # positions first .. n_ctx-2
        res.nll.extend(token_nll(logits, chunk[first + 1:]).tolist())
        res.chunk_ppl.append(res.ppl)
        if base_writer is not None:
            base_writer.add(logits)
        if on_chunk is not None:
            on_chunk(i, res)
    return res


# ---- KL divergence ----

def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """One position's logits as llama-perplexity stores them: nv uint16 (see the module doc)."""
    n_vocab = logits.shape[0]
    logits = logits.astype(np.float32)
    max_logit = float(logits.max())
    min_logit = max(float(logits.min()), max_logit + MIN_LOG_PROB)
    log_sum_exp = math.log(float(np.exp((logits - max_logit).astype(np.float64)).sum()))
    scale = np.float32((max_logit - min_logit) / 65535.0)
    min_log_prob = np.float32(min_logit - max_logit - log_sum_exp)
    out = np.zeros(2 * ((n_vocab + 1) // 2) + 4, np.uint16)
    out[:4] = np.array([scale, min_log_prob], np.float32).view(np.uint16)
    if scale != 0:
        inv = np.float32(1.0) / scale
        v = inv * (logits - np.float32(min_logit))
        q = np.where(logits > np.float32(min_logit), np.floor(v + np.float32(0.5)), 0)   # nearest_int
        out[4:4 + n_vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


class LogitsWriter:
    """Writes a --kl-divergence-base file: header and tokens first, then positions as they come.

    A context manager: the file appears under its name only when the block ends without an error
    (a temporary file is renamed), so an interrupted run leaves no truncated base file behind."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, chunks: list[np.ndarray]):
        self.path, self.n_vocab = Path(path), n_vocab
        self._head = MAGIC + struct.pack("<iii", n_ctx, n_vocab, len(chunks))
        self._tokens = np.concatenate(chunks).astype("<i4")
        self._out = AtomicOutput()
        self._fh = None

    def add(self, logits: np.ndarray) -> None:
        for row in logits:
            self._fh.write(quantize_log_probs(row))

    def __enter__(self):
        self._out.__enter__()
        try:
            self._fh = self._out.open(self.path)
            self._fh.write(self._head)
            self._fh.write(self._tokens)
        except BaseException:
            self._out.discard()
            raise
        return self

    def __exit__(self, *exc):
        return self._out.__exit__(*exc)


@dataclass
class LogitsFile:
    n_ctx: int
    n_vocab: int
    chunks: list[np.ndarray]
    data: np.ndarray            # uint16 (n_positions, nv)

    @classmethod
    def read(cls, path: Path) -> "LogitsFile":
        path = Path(path)
        try:
            raw = np.fromfile(path, np.uint8)
        except OSError as e:
            raise QuantkitError(f"{path}: {e.strerror}") from None
        if raw.size < 20 or raw[:8].tobytes() != MAGIC:
            raise QuantkitError(f"{path}: not a llama-perplexity logits file (no '_logits_' magic)")
        n_ctx, n_vocab, n_chunk = struct.unpack("<iii", raw[8:20].tobytes())
        n_tok = n_ctx * n_chunk
        nv = 2 * ((n_vocab + 1) // 2) + 4
        n_pos = n_chunk * (n_ctx - 1 - n_ctx // 2)
        need = 20 + 4 * n_tok + 2 * nv * n_pos
        if n_ctx <= 0 or n_vocab <= 0 or n_chunk <= 0 or raw.size < need:
            raise QuantkitError(f"{path}: truncated or inconsistent logits file "
                                f"(n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}, {raw.size} bytes)")
        tokens = raw[20:20 + 4 * n_tok].view("<i4").astype(np.int64)
        data = raw[20 + 4 * n_tok:need].view("<u2").reshape(n_pos, nv)
        return cls(n_ctx, n_vocab, [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)], data)

    def log_probs(self, i: int) -> np.ndarray:
        row = self.data[i]
        scale, min_lp = row[:4].copy().view(np.float32)
        return scale * row[4:4 + self.n_vocab].astype(np.float32) + min_lp


@dataclass
class KldStats:
    """Accumulates llama-perplexity's --kl-divergence statistics position by position."""
    nll: list[float] = field(default_factory=list)
    nll_base: list[float] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    same_top: int = 0

    def add(self, logits: np.ndarray, base_lp: np.ndarray, target: int) -> None:
        lp = log_softmax(logits[None])[0]
        self.nll.append(float(-lp[target]))
        self.nll_base.append(float(-base_lp[target]))
        keep = base_lp > MIN_LOG_PROB
        pb = np.exp(base_lp[keep].astype(np.float64))
        self.kld.append(float((pb * (base_lp[keep].astype(np.float64) - lp[keep])).sum()))
        self.dp.append(math.exp(-self.nll[-1]) - math.exp(-self.nll_base[-1]))
        self.same_top += int(np.argmax(logits) == np.argmax(base_lp))

    def summary(self) -> dict:
        n = len(self.kld)
        if n < 2:
            raise QuantkitError("KL divergence needs at least 2 scored positions")
        a, b = np.array(self.nll), np.array(self.nll_base)
        m1, u1 = _mean_unc(a.sum(), (a * a).sum(), n)
        m2, u2 = _mean_unc(b.sum(), (b * b).sum(), n)
        cov = ((a * b).sum() / n - m1 * m2) / (n - 1)
        ppl_q, ppl_b = math.exp(m1), math.exp(m2)
        lr_unc = math.sqrt(max(u1 * u1 + u2 * u2 - 2 * cov, 0.0))
        kld = np.array(self.kld)
        k_mean, k_unc = _mean_unc(kld.sum(), (kld * kld).sum(), n)
        dp = np.array(self.dp)
        dp_mean, dp_unc = _mean_unc(dp.sum(), (dp * dp).sum(), n)
        dp2_mean, dp2_unc = _mean_unc((dp * dp).sum(), (dp ** 4).sum(), n)
        rms = math.sqrt(dp2_mean)
        p_same = self.same_top / n
        return {
            "positions": n,
            "ppl": [ppl_q, ppl_q * u1], "ppl_base": [ppl_b, ppl_b * u2],
            "cor_ln_ppl": cov / (u1 * u2) if u1 > 0 and u2 > 0 else 0.0,
            "ln_ppl_ratio": [m1 - m2, lr_unc],
            "ppl_ratio": [math.exp(m1 - m2), math.exp(m1 - m2) * lr_unc],
            "ppl_diff": [ppl_q - ppl_b, math.sqrt(max(ppl_q ** 2 * u1 ** 2 + ppl_b ** 2 * u2 ** 2
                                                       - 2 * ppl_q * ppl_b * cov, 0.0))],
            "kld": {"mean": [k_mean, k_unc], **percentiles(kld, (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1))},
            "delta_p": {"mean": [100 * dp_mean, 100 * dp_unc],
                        **{k: 100 * v for k, v in percentiles(dp, (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0,
                                                                   5.0, 1.0, 0.1)).items()},
                        "rms": [100 * rms, 100 * 0.5 / rms * dp2_unc if rms > 0 else 0.0]},
            "same_top_p": [100 * p_same, 100 * math.sqrt(p_same * (1 - p_same) / (n - 1))],
        }


def percentiles(v: np.ndarray, fractions) -> dict:
    """Maximum, the given percentiles (linear interpolation at f*(N-1) of the sorted values),
    median and minimum, as llama-perplexity reports them."""
    s = np.sort(v)
    n = len(s)

    def at(f):
        x = f * (n - 1)
        i = int(x)
        return float(s[i] + (s[min(i + 1, n - 1)] - s[i]) * (x - i))
    out = {"max": float(s[-1])}
    for f in fractions:
        out[f"{f:.1f}%"] = at(f / 100)
    out["median"] = float((s[(n - 1) // 2] + s[n // 2]) / 2)
    out["min"] = float(s[0])
    return out


def kl_divergence(model, base: LogitsFile, on_chunk: Callable[[int, KldStats], None] | None = None) -> KldStats:
    stats = KldStats()
    per_chunk = base.n_ctx - 1 - base.n_ctx // 2
    for i, chunk in enumerate(base.chunks):
        logits = chunk_logits(model, chunk)[:per_chunk]
        if logits.shape[1] != base.n_vocab:
            raise QuantkitError(f"the model has {logits.shape[1]} logits, the base file {base.n_vocab}")
        first = base.n_ctx // 2
        for j in range(per_chunk):
            stats.add(logits[j], base.log_probs(i * per_chunk + j), int(chunk[first + 1 + j]))
        if on_chunk is not None:
            on_chunk(i, stats)
    return stats
