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

A top-k base (``--kld-top-k K``, kld_topk.py) keeps only each position's K most probable tokens and
the rest's mass; ``read_base`` tells the two forms apart by their magic.
"""
from __future__ import annotations

import math
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import QuantkitError
from ..words import counted
from ..inputs import open_regular
from . import kld_topk
from .base_file import BaseFileWriter, read_tokens_and_rows
from .kld_topk import MAGIC as TOPK_MAGIC, TopK, TopkLogitsFile, topk_kld_logprobs
from .model import NonFiniteLogits
from .scoring import log_softmax, scored_span, token_nll
from .warmup import warm_up

MAGIC = b"_logits_"
MIN_LOG_PROB = -16.0            # logits further than this below the maximum are stored as 0
MAX_NLL = math.log(sys.float_info.max)      # exp of a larger mean negative log-likelihood overflows
_BAD_MODEL = "the model's weights or activations are out of range"


def chunk_tokens(tokens: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> list[np.ndarray]:
    """The chunks llama-perplexity evaluates."""
    if len(tokens) < 2 * n_ctx:
        raise QuantkitError(f"the text has {counted(len(tokens), 'token')}: at least 2 * n_ctx = {2 * n_ctx} are needed")
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


def chunk_logits(model, chunk: np.ndarray, where: str = "") -> np.ndarray:
    """Logits (n_ctx - n_ctx/2, n_vocab) of the scored half of one chunk, from an empty cache;
    ``where`` names the chunk in the error for logits that are not finite."""
    n_ctx = len(chunk)
    cache = model.new_cache(n_ctx)
    try:
        return model.forward(chunk, cache, logits_from=scored_span(n_ctx)[0])
    except NonFiniteLogits as e:
        raise e.at(where) from None


def check_nll(chunk_nll: np.ndarray, all_nll: list[float], where: str) -> None:
    """A chunk's negative log-likelihoods must be finite, and the mean of all so far small enough
    that the perplexity (exp of it) is a number: else no result is reported."""
    if not np.isfinite(chunk_nll).all():
        raise QuantkitError(f"{where}: a token's negative log-likelihood is not finite: {_BAD_MODEL}")
    mean = sum(all_nll) / len(all_nll)
    if mean > MAX_NLL:
        raise QuantkitError(f"{where}: the mean negative log-likelihood {mean:.4g} makes the perplexity "
                            f"overflow: {_BAD_MODEL}")


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


def perplexity(model, chunks: list[np.ndarray], on_chunk: Callable[[int, PplResult], None] | None = None,
               base_writer: "LogitsWriter | None" = None) -> PplResult:
    warm_up(model, {len(c) for c in chunks})      # before the first chunk, which would be timed
    res = PplResult()
    for i, chunk in enumerate(chunks):
        first, n_scored = scored_span(len(chunk))
        where = f"chunk {i + 1} of {len(chunks)}"
        logits = chunk_logits(model, chunk, where)[:n_scored]         # positions first .. n_ctx-2
        nll = token_nll(logits, chunk[first + 1:])
        res.nll.extend(nll.tolist())
        check_nll(nll, res.nll, where)
        res.chunk_ppl.append(res.ppl)
        if base_writer is not None:
            base_writer.add(logits, chunk[first + 1:])
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


class LogitsWriter(BaseFileWriter):
    """Writes a --kl-divergence-base file as llama-perplexity does: header and tokens first, then
    positions as they come (base_file.BaseFileWriter: nothing under its name until it is whole)."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, chunks: list[np.ndarray]):
        super().__init__(path, MAGIC + struct.pack("<iii", n_ctx, n_vocab, len(chunks)), chunks, n_vocab)

    def add(self, logits: np.ndarray, targets: np.ndarray | None = None) -> None:
        for row in logits:
            self._fh.write(quantize_log_probs(row))


@dataclass
class LogitsFile:
    n_ctx: int
    n_vocab: int
    chunks: list[np.ndarray]
    data: np.ndarray            # uint16 (n_positions, nv)

    @classmethod
    def read(cls, path: Path) -> "LogitsFile":
        """The file's header, tokens and (memory-mapped) rows, each checked: the header against
        the file's size, the tokens against the vocabulary it names, the rows' scales."""
        path = Path(path)
        with open_regular(path, "--kl-divergence-base") as f:      # a FIFO or device: refused, not read
            size = os.fstat(f.fileno()).st_size
            try:
                head = f.read(20)
            except OSError as e:
                raise QuantkitError(f"{path}: {e.strerror}") from None
        if len(head) < 20 or head[:8] != MAGIC:
            raise QuantkitError(f"{path}: not a llama-perplexity logits file (no '_logits_' magic) nor a top-k "
                                "one (no '_kldtopk')")
        n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[8:])
        header = f"n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}"
        # at least one scored position per chunk: llama-perplexity scores n_ctx - 1 - n_ctx/2
        if n_ctx < 3 or n_vocab < 1 or n_chunk < 1:
            raise QuantkitError(f"{path}: inconsistent logits file header ({header}): n_ctx must be at least 3, "
                                "n_vocab and n_chunk at least 1")
        n_tok = n_ctx * n_chunk
        nv = 2 * ((n_vocab + 1) // 2) + 4
        n_pos = n_chunk * scored_span(n_ctx)[1]
        need = 20 + 4 * n_tok + 2 * nv * n_pos
        if size != need:
            raise QuantkitError(f"{path}: truncated or inconsistent logits file: its header ({header}) "
                                f"means {need} bytes, the file has {size}")
        tokens, data = read_tokens_and_rows(path, 20, n_tok, n_ctx, n_vocab, np.uint16, (n_pos, nv))
        # per row: float32 scale >= 0 and min_log_prob <= 0, finite, and so every log p it stands for
        scale_min = np.ascontiguousarray(data[:, :4]).view(np.float32)
        with np.errstate(all="ignore"):
            top = scale_min[:, 0] * np.float32(65535) + scale_min[:, 1]
        ok = np.isfinite(scale_min).all(axis=1) & np.isfinite(top) & (scale_min[:, 0] >= 0) & (scale_min[:, 1] <= 0)
        if not ok.all():
            r = int(np.argmin(ok))
            per_chunk = n_pos // n_chunk
            raise QuantkitError(f"{path}: corrupt logits row {r} (chunk {r // per_chunk + 1}): scale "
                                f"{scale_min[r, 0]!r} and minimum log-probability {scale_min[r, 1]!r} must be "
                                "finite, >= 0 and <= 0")
        return cls(n_ctx, n_vocab, [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)], data)

    def check_model(self, model) -> None:
        """The model must have the base's vocabulary (its logits are compared entry by entry)."""
        if model.config.n_vocab != self.n_vocab:
            raise QuantkitError(f"the base logits file has a vocabulary of {self.n_vocab}, the model "
                                f"{model.config.n_vocab}: they come from different models")

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
    top_k: int | None = None    # the base's k for a top-k base (its KLD a lower bound of the full one)

    def add(self, logits: np.ndarray, base_lp: np.ndarray, target: int) -> None:
        lp = log_softmax(logits[None])[0]
        self.nll.append(float(-lp[target]))
        self.nll_base.append(float(-base_lp[target]))
        keep = base_lp > MIN_LOG_PROB
        pb = np.exp(base_lp[keep].astype(np.float64))
        self.kld.append(float((pb * (base_lp[keep].astype(np.float64) - lp[keep])).sum()))
        self.dp.append(math.exp(-self.nll[-1]) - math.exp(-self.nll_base[-1]))
        self.same_top += int(np.argmax(logits) == np.argmax(base_lp))

    def add_topk(self, logits: np.ndarray, base_top, base_target_lp: np.ndarray, targets: np.ndarray) -> None:
        """Positions of a top-k base (kld_topk.py): ``logits`` (n, n_vocab), the base's TopK and
        next-token log-probabilities of the same n positions, their next tokens.  All but the KLD
        are what the full base gives (exactly: the base's next-token log-probability and top token
        are stored); the KLD is over the top-k tokens and the rest."""
        step = kld_topk.BLOCK_ROWS                      # float64 work arrays of step x n_vocab
        for r in range(0, len(targets), step):
            rows = slice(r, r + step)
            lp = log_softmax(logits[rows])
            nll = -lp[np.arange(len(lp)), targets[rows]]
            base_lp = np.asarray(base_target_lp[rows], np.float64)
            self.nll.extend(nll.tolist())
            self.nll_base.extend((-base_lp).tolist())
            self.kld.extend(topk_kld_logprobs(TopK(*(a[rows] for a in base_top)), lp).tolist())
            self.dp.extend((np.exp(-nll) - np.exp(base_lp)).tolist())
            self.same_top += int((np.argmax(logits[rows], axis=1) == base_top.ids[rows, 0]).sum())

    def running(self) -> dict:
        """The statistics llama-perplexity --kl-divergence prints after each chunk, of the
        positions so far: PPL(Q), ln(PPL(Q)/PPL(base)), mean KLD, RMS Δp (%) and same top p (%),
        each (value, uncertainty); uncertainties are 0 below 11 positions, as there."""
        n = len(self.kld)
        a, b, kld, dp = (np.array(v) for v in (self.nll, self.nll_base, self.kld, self.dp))
        m1, u1 = _mean_unc(a.sum(), (a * a).sum(), n)
        m2, u2 = _mean_unc(b.sum(), (b * b).sum(), n)
        cov = ((a * b).sum() / n - m1 * m2) / (n - 1) if n >= 10 else 0.0
        ppl = math.exp(m1) if m1 <= MAX_NLL else math.inf
        mse, mse_unc = _mean_unc((dp * dp).sum(), (dp ** 4).sum(), n)
        rms = math.sqrt(max(mse, 0.0))
        p_same = self.same_top / n
        return {"ppl": (ppl, ppl * u1), "ln_ppl_ratio": (m1 - m2, math.sqrt(max(u1 * u1 + u2 * u2 - 2 * cov, 0.0))),
                "kld": _mean_unc(kld.sum(), (kld * kld).sum(), n),
                "dp_rms": (100 * rms, 100 * 0.5 / rms * mse_unc if rms > 0 else 0.0),
                "same_top_p": (100 * p_same, 100 * math.sqrt(p_same * (1 - p_same) / (n - 1)) if n > 1 else 0.0)}

    def summary(self) -> dict:
        n = len(self.kld)
        if n < 2:
            raise QuantkitError("KL divergence needs at least 2 scored positions")
        a, b = np.array(self.nll), np.array(self.nll_base)
        for v, whose in ((a, "model's"), (b, "base file's")):
            if v.mean() > MAX_NLL:
                raise QuantkitError(f"the {whose} mean negative log-likelihood {v.mean():.4g} makes its perplexity "
                                    "overflow")
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
        doc = {
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
        if self.top_k is not None:
            doc["kld_top_k"] = self.top_k
        if not all(math.isfinite(x) for x in _numbers(doc)):
            raise QuantkitError("the KL divergence statistics overflow (a result is NaN or infinite): "
                                f"{_BAD_MODEL}, or the base file's")
        return doc


def _numbers(doc):
    """Every number in a nested dict / list."""
    for v in doc.values() if isinstance(doc, dict) else doc:
        if isinstance(v, (dict, list)):
            yield from _numbers(v)
        else:
            yield v


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


def read_base(path: Path) -> "LogitsFile | TopkLogitsFile":
    """A --kl-divergence-base file of either form, told apart by its magic."""
    path = Path(path)
    with open_regular(path, "--kl-divergence-base") as f:      # a FIFO or device: refused, not read
        try:
            magic = f.read(8)
        except OSError as e:
            raise QuantkitError(f"{path}: {e.strerror}") from None
    return TopkLogitsFile.read(path) if magic == TOPK_MAGIC else LogitsFile.read(path)


def kl_divergence(model, base: "LogitsFile | TopkLogitsFile",
                  on_chunk: Callable[[int, KldStats], None] | None = None) -> KldStats:
    base.check_model(model)
    warm_up(model, {len(c) for c in base.chunks})
    topk = isinstance(base, TopkLogitsFile)
    stats = KldStats(top_k=base.k if topk else None)
    first, per_chunk = scored_span(base.n_ctx)
    for i, chunk in enumerate(base.chunks):
        where = f"chunk {i + 1} of {len(base.chunks)}"
        logits = chunk_logits(model, chunk, where)[:per_chunk]
        if topk:
            top, target_lp = base.rows(i * per_chunk, (i + 1) * per_chunk)
            stats.add_topk(logits, top, target_lp, chunk[first + 1:])
        else:
            for j in range(per_chunk):
                stats.add(logits[j], base.log_probs(i * per_chunk + j), int(chunk[first + 1 + j]))
        for j in range(len(stats.kld) - per_chunk, len(stats.kld)):
            if not (math.isfinite(stats.kld[j]) and math.isfinite(stats.nll[j])):
                raise QuantkitError(f"{where}, position {first + j % per_chunk}: the KL divergence is not finite: "
                                    f"{_BAD_MODEL}")
        if on_chunk is not None:
            on_chunk(i, stats)
    return stats
