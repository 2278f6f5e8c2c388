"""How much a tensor group's quantization hurts the model: the numbers `quantkit recipe` minimises.

Two measures, per (group, candidate type):

* **fast** (:func:`fast_error`): the group's tensors are quantized as the candidate says (the
  planner's per-tensor types, after its fallbacks) and compared with the input, weighted by the
  importance matrix: ``Σ_rows Σ_j imat_j (w_j − q_j)²``.  With an imatrix (the mean square of each
  input column over the calibration text) that is the expected squared error of the group's matrix
  products per token.  Tensors larger than ``max_elements`` are sampled: runs of rows picked by a
  seeded generator, the sum scaled to all rows.  Without an imatrix every weight counts 1.

* **measured** (:func:`measured_kld`): the mean KL divergence over calibration tokens between the
  input model and the same model with only this group quantized, computed in this process by
  quantkit's runtime: the group's tensors are quantized in memory and swapped in, nothing is
  written.  The input model's pass is run once per worker process and its residual stream kept at
  every layer, so a job recomputes only from the first layer it changed (the output head: the head
  alone).  Measured mode reads GGUF files only (the runtime computes from GGUF tensors); an HF
  checkpoint has the fast mode (convert it to GGUF to measure).

A few measured samples calibrate the fast errors into predicted KLDs (:func:`calibrate`): one
factor per group kind.  Jobs are module-level functions of picklable specs (``FastJob``,
``MeasureJob``), so quantkit.workers can run them in worker processes or on a Ray cluster; each
worker keeps the model (and the base pass) it opened for the next job of the same model.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import formats, signals
from .errors import QuantkitError
from .gguf_io.reader import ModelView, TensorInfo, open_model
from .hf import open_hf
from .imatrix import load_imatrix
from .inputs import read_text
from .plan import TensorPlan, imatrix_weights
from .presets import layer_of
from .quantize import convert_tensor, quantize_rows, to_float32
from .runtime.kernels import kl_divergence_rows
from .runtime.model import Model
from .runtime.session import Session, make_ops, set_threads
from .runtime.scoring import log_softmax, scored_span
from .sensitivity_cache import SensitivityCache, file_fingerprint, fingerprint
from .text.tokenizer import Tokenizer
from .types import QuantType, traits, type_name

__all__ = ["FastJob", "MeasureJob", "fast_error", "measured_kld", "tensor_error", "calibrate", "Predictor",
           "SensitivityCache", "fingerprint", "file_fingerprint", "fast_jobs", "measure_jobs", "measure_sample",
           "cached_run", "release"]

MAX_ELEMENTS = 1 << 22          # a tensor with more weights is sampled (4M: ~0.1-0.5 s a type on one core)
RUN_ROWS = 32                   # rows of a sampled run (fewer where a matrix's rows are not a multiple)
MAX_TEXT_BYTES = 1 << 30        # calibration text, as api's -f
METHOD = 1                      # in every result's settings: a changed estimate does not reuse old results


@dataclass(frozen=True)
class FastJob:
    """One fast estimate: the tensors of a group, each with the type written for it."""
    model: str                                      # a GGUF file or an HF checkpoint directory
    tensors: tuple[tuple[str, QuantType], ...]      # (name, type written)
    imatrix: str | None = None
    flavor: str = "ik"
    max_elements: int = MAX_ELEMENTS
    seed: int = 0
    imatrix_id: str = ""                            # file_fingerprint of the imatrix: part of settings()
    threads: int | None = None                      # this worker's quantizing threads (None: as they are)

    def settings(self) -> dict:
        """What the result depends on besides the model and the types (the cache's key)."""
        return {"method": METHOD, "imatrix": self.imatrix_id if self.imatrix else None, "flavor": self.flavor,
                "max_elements": self.max_elements, "seed": self.seed}


@dataclass(frozen=True)
class MeasureJob:
    """One measured KLD: the tensors of a group, each with the type written for it."""
    model: str                                      # a GGUF file
    tensors: tuple[tuple[str, QuantType], ...]
    calibration: str                                # a text file
    imatrix: str | None = None
    flavor: str = "ik"
    n_ctx: int = 512
    chunks: int = 1
    threads: int | None = None                      # this worker's compute threads (None: all cores;
                                                    # give cores / workers where workers share a machine)
    imatrix_id: str = ""
    calibration_id: str = ""

    def settings(self) -> dict:
        return {"method": METHOD, "imatrix": self.imatrix_id if self.imatrix else None, "flavor": self.flavor,
                "calibration": self.calibration_id, "n_ctx": self.n_ctx, "chunks": self.chunks}


# ---------------------------------------------------------------- per worker process: what jobs share

_MODELS: dict = {}          # file identity -> open model (one kept: a worker serves one model's jobs)
_IMATRICES: dict = {}
_BASES: dict = {}


def release() -> None:
    """Close what this process keeps for the next job (open models, the base pass): after a search
    that ran its jobs here."""
    for store in (_MODELS, _BASES):
        while store:
            _, value = store.popitem()
            (value.gguf if isinstance(value, _BasePass) else value).close()
    _IMATRICES.clear()


def _identity(path) -> tuple:
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise QuantkitError(f"{path}: {e.strerror}") from None
    return (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


def _keep_one(store: dict, key, make, close=lambda v: None):
    """store[key], made on first use; whatever else the store held is closed and dropped."""
    if key not in store:
        for old in list(store):
            close(store.pop(old))
        store[key] = make()
    return store[key]


def _model(path):
    path = Path(path)
    return _keep_one(_MODELS, _identity(path), lambda: open_hf(path) if path.is_dir() else open_model(path),
                     lambda m: m.close())


def _imatrix(path):
    if path is None:
        return None
    return _keep_one(_IMATRICES, _identity(path), lambda: load_imatrix(Path(path)))


def imatrix_rows(imat, info: TensorInfo, flavor: str) -> np.ndarray | None:
    """(n_matrices, n_per_row) importance weights of a tensor as the quantize run looks them up
    (plan.attach_imatrix: mainline only under its own name, ik also its fallbacks), or None."""
    return imatrix_weights(imat, info.name, info.shape, flavor)


def _tensor(model, name: str) -> TensorInfo:
    info = model.by_name.get(name)
    if info is None:
        raise QuantkitError(f"{model.path}: tensor '{name}' is missing")
    return info


def _unchanged(src: QuantType, dst: QuantType) -> bool:
    """The planner copies (same type) or repacks (the same blocks, rows regrouped): no new error."""
    def plain(t):
        tr = traits(t)
        return tr.base if tr.interleave_rows > 1 else t
    return plain(QuantType(src)) == plain(QuantType(dst))


def _check_type(info: TensorInfo, qtype: QuantType):
    """The type's traits, if its blocks fit the tensor's rows (the planner's options always do)."""
    t = traits(qtype)
    if info.shape[0] % t.block_size:
        raise QuantkitError(f"tensor '{info.name}': rows of {info.shape[0]} values are not a multiple of "
                            f"{type_name(qtype)}'s block of {t.block_size}")
    return t


# ---------------------------------------------------------------- fast

def _run_length(rows_per_matrix: int, group: int, most: int) -> int:
    """Rows of a sampled run: at most ``most`` (at least a row group), a multiple of the type's
    row group dividing a matrix's rows."""
    n = max(group, min(most, RUN_ROWS) // group * group)
    while n > group and rows_per_matrix % n:
        n -= group
    return n


def sampled_rows(info: TensorInfo, group: int, max_elements: int, seed: int) -> tuple[list[int], int]:
    """(first rows, run length) of the runs of rows the estimate reads: every row (in pieces of one
    matrix) where the tensor has at most ``max_elements`` weights, else as many rows from every
    matrix (expert) of the tensor, in runs at seeded places: the experts differ, so each is sampled
    (a stratified sample: its variance is that within the experts only)."""
    n_per_row = info.shape[0]
    rows_per_matrix = info.shape[1] if len(info.shape) > 1 else 1
    n_matrices = info.n_rows // rows_per_matrix
    if rows_per_matrix % group:
        raise QuantkitError(f"tensor '{info.name}': {rows_per_matrix} rows are not a multiple of {group}")
    if info.n_rows * n_per_row <= max_elements:
        per = min(rows_per_matrix, max(group, (max_elements // 4 // n_per_row) // group * group))
        while rows_per_matrix % per:
            per -= group
        return list(range(0, info.n_rows, per)), per
    per_matrix = max(group, max_elements // n_per_row // n_matrices)
    run = _run_length(rows_per_matrix, group, per_matrix)
    slots = rows_per_matrix // run
    k = min(slots, max(1, per_matrix // run))
    rng = np.random.default_rng([seed, zlib.crc32(info.name.encode())])
    starts = [m * rows_per_matrix + int(s) * run
              for m in range(n_matrices) for s in np.sort(rng.choice(slots, size=k, replace=False))]
    return starts, run


def tensor_error(info: TensorInfo, qtype: QuantType, weights: np.ndarray | None, flavor: str = "ik",
                 max_elements: int = MAX_ELEMENTS, seed: int = 0) -> float:
    """Σ_rows Σ_j w_j (x_j − q_j)² of one tensor quantized to ``qtype`` (``weights``: the imatrix,
    (n_matrices, n_per_row), or None for 1); rows sampled where the tensor has more than
    ``max_elements`` weights (:func:`sampled_rows`), the sum scaled to all rows."""
    qtype = QuantType(qtype)
    if _unchanged(info.qtype, qtype):
        return 0.0
    n_per_row = info.shape[0]
    rows_per_matrix = info.shape[1] if len(info.shape) > 1 else 1
    starts, run = sampled_rows(info, _check_type(info, qtype).interleave_rows, max_elements, seed)
    total = 0.0
    for start in starts:
        signals.check()
        rows = slice(start, start + run)
        x = to_float32(info, rows)
        w = None if weights is None else weights[start // rows_per_matrix]
        try:
            q = quantize_rows(x, qtype, w, flavor, info.name, start)
        except NotImplementedError as e:
            raise QuantkitError(f"tensor '{info.name}': {e}") from None
        err = (x.astype(np.float64) - formats.dequantize(q, qtype, n_per_row)) ** 2
        total += float((err @ w).sum() if w is not None else err.sum())
    return total * info.n_rows / (len(starts) * run)


def fast_error(spec: FastJob) -> float:
    """The imatrix-weighted squared error of the group quantized as ``spec`` says (the module doc)."""
    if spec.threads is not None:
        set_threads(spec.threads)
    model = _model(spec.model)
    imat = _imatrix(spec.imatrix)
    total = 0.0
    for name, qtype in spec.tensors:
        info = _tensor(model, name)
        total += tensor_error(info, qtype, imatrix_rows(imat, info, spec.flavor), spec.flavor,
                              spec.max_elements, spec.seed)
    return total


# ---------------------------------------------------------------- measured

@dataclass
class _MemoryTensor:
    """A tensor whose quantized bytes are in memory: what the runtime's WeightStore reads."""
    name: str
    shape: tuple[int, ...]
    qtype: QuantType
    blocks: np.ndarray

    n_elements = TensorInfo.n_elements
    n_per_row = TensorInfo.n_per_row
    n_rows = TensorInfo.n_rows
    n_dims = TensorInfo.n_dims

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def raw(self) -> np.ndarray:
        return self.blocks


class _Swapped(ModelView):
    """A model view: the input's metadata and tensors, some of them replaced by in-memory ones."""

    def __init__(self, base, replaced: dict):
        self.path, self.metadata = base.path, base.metadata
        self.tensors = [replaced.get(t.name, t) for t in base.tensors]
        self.by_name = {t.name: t for t in self.tensors}

    def close(self) -> None:
        pass                # the input stays open for the worker's next job


@dataclass
class _BasePass:
    """The input model's pass over the calibration chunks: the residual stream entering every
    layer (and leaving the last), and the probabilities of the scored positions."""
    gguf: object
    ops: object
    chunks: list
    states: list = field(default_factory=list)      # per chunk: n_layer + 1 arrays (n_ctx, n_embd)
    probs: list = field(default_factory=list)       # per chunk: (scored, n_vocab) float64
    plp: list = field(default_factory=list)         # per chunk: Σ p log p of each scored position


def _embed(model: Model, chunk: np.ndarray):
    if chunk.min() < 0 or chunk.max() >= model.tok_embd.n_out:
        raise QuantkitError(f"token id outside the vocabulary (0..{model.tok_embd.n_out - 1})")
    return model.ops.embed(model.tok_embd, chunk)


def _base_pass(spec: MeasureJob) -> _BasePass:
    path = Path(spec.model)
    if path.is_dir():
        raise QuantkitError(f"{path}: measured sensitivity needs a GGUF model (the runtime computes from GGUF "
                            "tensors): convert the checkpoint first, or use the fast estimate alone")

    def make():
        text = read_text(spec.calibration, "-f", MAX_TEXT_BYTES, errors="replace")
        gguf = open_model(path)
        try:
            ops = make_ops("cpu")
            model = Model(gguf, ops)
            chunks = Session(gguf, model, Tokenizer.from_model(gguf), 1).chunks(text, spec.n_ctx, spec.chunks)
            base = _BasePass(gguf, ops, chunks)
            first, n = scored_span(spec.n_ctx)
            for i, chunk in enumerate(chunks):
                cache, pos = model.new_cache(len(chunk)), np.arange(len(chunk))
                x, states = _embed(model, chunk), []
                for layer in range(model.config.n_layer):
                    signals.check()
                    states.append(x)
                    x = model.layer(layer, x, pos, cache)
                states.append(x)
                base.states.append(states)
                logits = _head(model, x, first, n, f"calibration chunk {i + 1}")
                lp = log_softmax(logits)
                p = np.exp(lp)
                base.probs.append(p)
                base.plp.append((p * lp).sum(axis=1))
            return base
        except BaseException:
            gguf.close()
            raise
    key = (_identity(spec.model), _identity(spec.calibration), spec.n_ctx, spec.chunks)
    return _keep_one(_BASES, key, make, lambda b: b.gguf.close())


def _head(model: Model, x, first: int, n: int, where: str) -> np.ndarray:
    try:
        return model.head(x[first:first + n], first)
    except QuantkitError as e:
        raise QuantkitError(f"{where}: {e}") from None


def _quantized(info: TensorInfo, qtype: QuantType, weights, flavor: str) -> _MemoryTensor:
    """The whole tensor quantized by the quantize pipeline's own path (the bytes a run writes)."""
    _check_type(info, qtype)
    tp = TensorPlan(info.name, tuple(info.shape), QuantType(info.qtype), qtype, "sensitivity")
    try:
        blocks = np.concatenate(list(convert_tensor(info, tp, weights, flavor)))
    except NotImplementedError as e:
        raise QuantkitError(f"tensor '{info.name}': {e}") from None
    return _MemoryTensor(info.name, tuple(info.shape), qtype, blocks.reshape(info.n_rows, -1))


def first_layer(names, n_layer: int) -> int:
    """Where a pass must start when ``names`` change: -1 the embedding (token_embd, and any tensor
    outside the blocks but the output head), a layer index, or n_layer for the head alone (also
    for blocks past the runtime's layers, DeepSeek's next-token-prediction block, which no pass reads)."""
    start = n_layer
    for name in names:
        layer = layer_of(name)
        if layer is not None and layer >= 0:
            start = min(start, layer)
        elif not name.startswith("output."):
            return -1
    return start


def measured_kld(spec: MeasureJob) -> float:
    """Mean KL divergence over the calibration chunks' scored tokens (llama-perplexity's second
    halves) of the input model with only ``spec.tensors`` quantized, from the input model."""
    set_threads(spec.threads)
    base = _base_pass(spec)
    imat = _imatrix(spec.imatrix)
    replaced = {}
    for name, qtype in spec.tensors:
        info = _tensor(base.gguf, name)
        if not _unchanged(info.qtype, qtype):
            replaced[name] = _quantized(info, QuantType(qtype), imatrix_rows(imat, info, spec.flavor), spec.flavor)
    if not replaced:
        return 0.0
    model = Model(_Swapped(base.gguf, replaced), base.ops)
    start = first_layer(replaced, model.config.n_layer)
    first, n = scored_span(spec.n_ctx)
    total, count = 0.0, 0
    for i, chunk in enumerate(base.chunks):
        pos = np.arange(len(chunk))
        cache = model.new_cache(len(chunk))
        x = _embed(model, chunk) if start < 0 else base.states[i][start]
        for layer in range(max(start, 0), model.config.n_layer):
            signals.check()
            x = model.layer(layer, x, pos, cache)
        logits = np.ascontiguousarray(_head(model, x, first, n, f"calibration chunk {i + 1}"), np.float32)
        kld = np.empty(len(logits))
        kl_divergence_rows(logits, base.probs[i], base.plp[i], kld)
        total += float(kld.sum())
        count += len(kld)
    value = total / count
    if not math.isfinite(value):
        raise QuantkitError(f"the KL divergence with {', '.join(replaced)} quantized is not finite")
    return max(value, 0.0)


# ---------------------------------------------------------------- calibration

def _type_key(group, option) -> tuple[str, str]:
    return group.key, type_name(option.qtype)


def _depth(group) -> float | None:
    """Where a group sits in the model: its layers' mean (None outside the blocks)."""
    return float(np.mean(group.layers)) if group.layers else None


@dataclass
class Predictor:
    """Predicted KLD of a (group, option): the measured value where one was measured, else the
    fast error times its kind's factor.  The factor follows depth where a kind's samples sit in
    several layers (``profiles``: log factor at each sampled depth, interpolated in between, the
    end values beyond): the same weighted error costs more in some layers than in others (an early
    layer's error passes through every later one).  A kind without samples: ``overall``."""
    factors: dict[str, float]                       # per kind: the geometric mean factor
    overall: float
    fast: dict
    measured: dict
    spread: dict[str, float] = field(default_factory=dict)    # per kind: rms of log(measured / fitted)
    samples: dict[str, int] = field(default_factory=dict)
    profiles: dict[str, tuple] = field(default_factory=dict)  # per kind: (depths, log factors)

    def factor(self, kind: str, depth: float | None = None) -> float:
        profile = self.profiles.get(kind)
        if profile is not None and depth is not None:
            return math.exp(float(np.interp(depth, *profile)))
        return self.factors.get(kind, self.overall)

    def kld(self, group, option) -> float:
        key = _type_key(group, option)
        if key in self.measured:
            return self.measured[key]
        if key not in self.fast:
            raise QuantkitError(f"no sensitivity of {group.key} as {key[1]} was computed")
        return self.factor(group.kind, _depth(group)) * self.fast[key]

    def to_json(self) -> dict:
        return {"factors": self.factors, "overall": self.overall, "spread": self.spread, "samples": self.samples,
                "profiles": {k: [list(map(float, d)), list(map(float, v))] for k, (d, v) in self.profiles.items()}}


def calibrate(groupset, fast: dict, measured: dict) -> Predictor:
    """Fit predicted KLD = c * fast error on the measured samples: per kind c is the geometric mean
    of measured / fast (least squares of the logs: KLDs span decades, and a fit of the values would
    follow the largest alone), and where the kind's samples sit in two or more depths, a profile
    over depth (the mean log ratio at each, :class:`Predictor`).  A kind without samples: the fit
    over all kinds; no samples at all: c = 1, the fast error itself.  ``fast`` / ``measured``:
    {(group key, type name): value}; samples whose fast error or KLD is 0 (a type the input
    already has) say nothing about c and are left out."""
    groups = {g.key: g for g in groupset.groups}
    by_kind: dict[str, list] = {}
    for key, m in measured.items():
        f = fast.get(key)
        if f is not None and f > 0 and m > 0 and key[0] in groups:
            g = groups[key[0]]
            by_kind.setdefault(g.kind, []).append((_depth(g), math.log(m / f)))
    factors, spread, profiles = {}, {}, {}
    for kind, points in by_kind.items():
        logs = np.array([v for _, v in points])
        factors[kind] = math.exp(float(logs.mean()))
        at: dict[float, list] = {}
        for depth, v in points:
            if depth is not None:
                at.setdefault(depth, []).append(v)
        fitted = np.full(len(points), logs.mean())
        if len(at) >= 2:
            depths = sorted(at)
            profiles[kind] = (np.array(depths), np.array([np.mean(at[d]) for d in depths]))
            fitted = np.array([np.interp(d, *profiles[kind]) if d is not None else logs.mean() for d, _ in points])
        spread[kind] = float(np.sqrt(np.mean((logs - fitted) ** 2)))
    every = [v for points in by_kind.values() for _, v in points]
    overall = math.exp(float(np.mean(every))) if every else 1.0
    return Predictor(factors, overall, dict(fast), dict(measured), spread,
                     {kind: len(points) for kind, points in by_kind.items()}, profiles)


# ---------------------------------------------------------------- jobs of a group set

def _tensor_types(group, option) -> tuple[tuple[str, QuantType], ...]:
    return tuple((name, option.types[name]) for name in group.tensors)


def fast_jobs(groupset, model_path, *, imatrix=None, max_elements: int = MAX_ELEMENTS, seed: int = 0,
              threads: int | None = None) -> list[tuple[tuple[str, str], FastJob]]:
    """A fast job for every (group, option) of the group set, keyed (group key, type name).
    ``threads``: each job's threads (cores / workers where workers share a machine)."""
    imatrix_id = file_fingerprint(imatrix, "--imatrix") if imatrix else ""
    return [(_type_key(g, o), FastJob(str(model_path), _tensor_types(g, o), str(imatrix) if imatrix else None,
                                      groupset.flavor, max_elements, seed, imatrix_id, threads))
            for g in groupset.groups for o in g.options]


def measure_jobs(groupset, samples, model_path, calibration, *, imatrix=None, n_ctx: int = 512,
                 chunks: int = 1, threads: int | None = None) -> list[tuple[tuple[str, str], MeasureJob]]:
    """Measured jobs of ``samples`` ((group key, type name) pairs, as :func:`measure_sample` picks)."""
    imatrix_id = file_fingerprint(imatrix, "--imatrix") if imatrix else ""
    calibration_id = file_fingerprint(calibration, "-f")
    by_key = {_type_key(g, o): (g, o) for g in groupset.groups for o in g.options}
    jobs = []
    for key in samples:
        if key not in by_key:
            raise QuantkitError(f"no group {key[0]} with a {key[1]} option to measure")
        g, o = by_key[key]
        jobs.append((key, MeasureJob(str(model_path), _tensor_types(g, o), str(calibration),
                                     str(imatrix) if imatrix else None, groupset.flavor, n_ctx, chunks, threads,
                                     imatrix_id, calibration_id)))
    return jobs


def _spread_order(n: int) -> list[int]:
    """0..n-1 in an order that spreads every prefix over the range: the ends, the middle, the
    quarters, ... (a kind's first samples cover its layers from the first to the last)."""
    order, seen = [], set()
    steps = 1
    while len(order) < n:
        for k in range(steps + 1):
            i = round(k * (n - 1) / steps)
            if i not in seen:
                seen.add(i)
                order.append(i)
        steps *= 2
    return order


def measure_sample(groupset, n: int) -> list[tuple[str, str]]:
    """``n`` (group key, type name) pairs to measure, spread over the kinds (round robin), over
    each kind's layers (first, last, middle, quarters ...: the calibration's depth profile) and
    over its types (cycling through them from the smallest).  Deterministic."""
    by_kind: dict[str, list] = {}
    for g in groupset.groups:
        by_kind.setdefault(g.kind, []).append(g)
    queues = {}
    for kind, groups in by_kind.items():
        order = []
        spread = _spread_order(len(groups))
        max_options = max(len(g.options) for g in groups)
        for j in range(len(groups) * max_options):
            g = groups[spread[j % len(groups)]]
            options = sorted(g.options, key=lambda o: (sum(o.nbytes.values()), type_name(o.qtype)))
            if options:
                order.append(_type_key(g, options[(j + j // len(groups)) % len(options)]))
        queues[kind] = order
    picks, seen = [], set()
    while len(picks) < n and any(queues.values()):
        for kind in queues:
            while queues[kind] and len(picks) < n:
                key = queues[kind].pop(0)
                if key not in seen:
                    seen.add(key)
                    picks.append(key)
                    break
    return picks


def _in_process(fn, jobs, on_result=None) -> list:
    out = []
    for i, job in enumerate(jobs):
        out.append(fn(job))
        if on_result is not None:
            on_result(i, out[-1])
    return out


def cached_run(fn, keyed_jobs, *, cache: SensitivityCache | None = None, model_fp: str = "", mode: str = "fast",
               run=None, on_result=None) -> dict:
    """{(group key, type name): value} of every job: from ``cache`` where it holds the result, else
    computed by ``run(fn, jobs, on_result=...)`` (quantkit.workers.run_jobs with its options bound;
    by default one after the other here), each result put in the cache as it arrives, so an
    interrupted search keeps what finished.  ``on_result(key, value, cached)`` reports progress."""
    results, todo = {}, []
    for key, job in keyed_jobs:
        value = None if cache is None else cache.get(model_fp, mode, job.settings(), key[0], dict(job.tensors))
        if value is None:
            todo.append((key, job))
        else:
            results[key] = value
            if on_result is not None:
                on_result(key, value, True)

    def arrived(i: int, value: float) -> None:
        key, job = todo[i]
        results[key] = value
        if cache is not None:
            cache.put(model_fp, mode, job.settings(), key[0], dict(job.tensors), value)
        if on_result is not None:
            on_result(key, value, False)
    if todo:
        (run or _in_process)(fn, [job for _, job in todo], on_result=arrived)
    return {key: results[key] for key, _ in keyed_jobs}
