"""Raw importance matrices (sums and counts): what `quantkit imatrix` collects, merges, converts and
describes.

:mod:`quantkit.imatrix` reads files the way llama-quantize uses them (normalised weights); this
module keeps what llama-imatrix accumulates, Σx² per column and tokens per matrix, so files can be
merged by counts and written in either format (specs/ggml-quants.md §3.2-3.4):

* GGUF in: sums and counts as stored.  Legacy ``.dat`` in: the file holds mean·ncall per column and
  ncall, so Σx² ≈ value·chunk_size and count = ncall·chunk_size, as llama-imatrix reconstructs it
  (``chunk_size`` is the ``-c`` of the run that made it: pass it).
* ``.dat`` out: per entry ncall = ceil(max count / chunk_size), values = Σx²/count·ncall per matrix
  (1·ncall for a matrix without data); entries without any data are left out.
* GGUF out: sums and counts as they are, with ``imatrix.datasets/chunk_count/chunk_size``.

Experts that got no token (a routed expert the calibration text never reached: count 0, a row of
zero sums) are "partial data".  What is written for them is the ``partial`` policy of
:meth:`RawImatrix.save` (:data:`PARTIAL_POLICIES`):

* ``keep`` (mainline llama-imatrix): every entry with data is written; GGUF keeps the zero counts,
  .dat stores 1 for those experts.  llama-quantize gives them the neutral weight 1 either way.
* ``ik`` (ik_llama.cpp's llama-imatrix, examples/imatrix/imatrix.cpp save_imatrix): an entry is
  written only if fewer than round(5% of its experts) miss data ("Storing **but be aware**"; their
  weight is 1 as above), else skipped whole ("- skipping"), so llama-quantize quantizes that tensor
  without an imatrix ("did not find weights for ...") and refuses the very-low-bit types for it.

Both skip entries without any data ("has no data - skipping"); an expert with a few tokens is an
expert with data (its mean over those tokens) for both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import imatrix as imx
from .errors import QuantkitError

PARTIAL_POLICIES = ("keep", "ik")
IK_MISSING_SHARE = 0.05     # ik's llama-imatrix stores an entry if fewer than round(this x experts) miss data


def _c_round(x: float) -> int:
    """C ``round`` of a non-negative double: halves away from zero."""
    r = math.floor(x)
    return r + 1 if x - r >= 0.5 else r


def ik_stores(counts: np.ndarray) -> bool:
    """Whether ik_llama.cpp's llama-imatrix writes an entry with these per-matrix token counts:
    one with data everywhere, or a per-expert one (more than one count) where fewer than
    round(5% of the experts) got no token."""
    missing = int((counts == 0).sum())
    if missing == 0:
        return True
    return counts.size > 1 and missing < counts.size and missing < _c_round(counts.size * IK_MISSING_SHARE)


@dataclass
class RawImatrix:
    sums: dict[str, np.ndarray]                 # entry -> float64 (n_mat, n_per_row), Σx²
    counts: dict[str, np.ndarray]               # entry -> int64 (n_mat,) tokens, or (1,) for one count
    chunk_size: int
    datasets: list[str] = field(default_factory=list)
    # entries whose split into matrices the file did not record (legacy .dat: one ncall for all)
    shapeless: frozenset[str] = frozenset()

    @property
    def chunk_count(self) -> int:
        """llama-imatrix's m_last_chunk: tokens of the busiest matrix in chunks."""
        top = max((int(c.max()) for c in self.counts.values()), default=0)
        return top // self.chunk_size if self.chunk_size else 0

    @classmethod
    def from_file(cls, path, chunk_size: int) -> "RawImatrix":
        data = imx.load_imatrix(path)
        if data.orphan_sums:
            name, m = next(iter(data.orphan_sums.items()))
            raise QuantkitError(f"{path}: imatrix entry '{name}': matrix {m} has sums but a count of 0 "
                                "(counts that do not match the sums)")
        sums, counts = {}, {}
        for name, w in data.weights.items():
            if data.format == "gguf":
                c = data.counts[name].astype(np.int64)
                s = w.astype(np.float64).reshape(c.size, -1) * c[:, None]
            else:
                ncall = int(data.counts[name][0])
                if ncall == 0 and w.any():
                    raise QuantkitError(f"{path}: imatrix entry '{name}' has values but ncall 0: no count "
                                        "to weigh them by (counts that do not match the sums)")
                c = np.array([ncall * chunk_size], np.int64)
                s = w.astype(np.float64).reshape(1, -1) * c[0]
            sums[name], counts[name] = s, c
        size = data.chunk_size if data.format == "gguf" and data.chunk_size else chunk_size
        shapeless = frozenset(sums) if data.format == "dat" else frozenset()
        return cls(sums, counts, size, list(data.datasets), shapeless)

    @classmethod
    def from_stats(cls, stats, chunk_size: int, datasets: list[str]) -> "RawImatrix":
        """From what a run observed (:class:`quantkit.runtime.collect.ActivationStats`); built here,
        not there, so that the runtime does not import the library above it (issue 24 item 5)."""
        return cls({n: e.sums for n, e in stats.entries.items()},
                   {n: e.counts for n, e in stats.entries.items()}, chunk_size, list(datasets))

    def shape(self, name: str) -> tuple[int, int]:
        """(matrices, values per matrix) of an entry: one matrix per count."""
        c = self.counts[name]
        return c.size, self.sums[name].size // c.size

    def merged(self, other: "RawImatrix") -> "RawImatrix":
        """Sums and counts added entry by entry.  Entries must have the same shape (matrices and
        values per matrix); an entry of a legacy .dat file, which does not record its matrices,
        only the same number of values: its single count meets per-expert counts by being spread
        over the experts, as llama-imatrix merges."""
        sums = {n: s.copy() for n, s in self.sums.items()}
        counts = {n: c.copy() for n, c in self.counts.items()}
        shapeless = set(self.shapeless)
        for name, s in other.sums.items():
            c = other.counts[name]
            if name not in sums:
                sums[name], counts[name] = s.copy(), c.copy()
                if name in other.shapeless:
                    shapeless.add(name)
                continue
            if sums[name].size != s.size:
                raise QuantkitError(f"imatrix entry '{name}': {sums[name].size} values in one file, "
                                    f"{s.size} in the other")
            a_shape, b_shape = self.shape(name), other.shape(name)
            if a_shape != b_shape and name not in self.shapeless and name not in other.shapeless:
                raise QuantkitError(f"imatrix entry '{name}': {_shape_text(a_shape)} in one file, "
                                    f"{_shape_text(b_shape)} in the other: not the same tensor")
            if name not in other.shapeless:
                shapeless.discard(name)
            sums[name] = sums[name] + s.reshape(sums[name].shape)
            a, b = counts[name], c
            if a.size != b.size:
                n = max(a.size, b.size)
                a, b = np.broadcast_to(a, (n,)), np.broadcast_to(b, (n,))
                sums[name] = sums[name].reshape(n, -1)
            if int(a.max()) + int(b.max()) >= imx.MAX_COUNT:
                raise QuantkitError(f"imatrix entry '{name}': merged token counts pass 2^62")
            counts[name] = a + b
        return RawImatrix(sums, counts, self.chunk_size, self.datasets + other.datasets, frozenset(shapeless))

    def skipped(self, partial: str = "keep") -> list[str]:
        """Entries the ``partial`` policy leaves out of a file (see the module docstring): none for
        ``keep`` (a .dat leaves out entries without any data all the same), for ``ik`` those
        without data and those with too many experts without a token."""
        if partial not in PARTIAL_POLICIES:
            raise QuantkitError(f"partial experts: '{partial}' is none of {', '.join(PARTIAL_POLICIES)}")
        if partial == "keep":
            return []
        return [n for n in sorted(self.counts) if not ik_stores(self.counts[n])]

    def save(self, path, partial: str = "keep") -> Path:
        """Write the file (.dat: legacy, else GGUF), the entries the ``partial`` policy keeps."""
        path = Path(path)
        skip = set(self.skipped(partial))
        if skip:
            kept = [n for n in self.sums if n not in skip]
            if not kept:
                raise QuantkitError(f"{path}: nothing to write: all {len(skip)} entries have experts without "
                                    "data, which ik_llama.cpp's llama-imatrix skips (--partial-experts keep "
                                    "writes them)")
            return RawImatrix({n: self.sums[n] for n in kept}, {n: self.counts[n] for n in kept}, self.chunk_size,
                              self.datasets, self.shapeless - skip).save(path)
        if path.suffix == ".dat":
            means, ncalls = {}, {}
            for name in sorted(self.sums, key=lambda n: n.encode()):
                c = self.counts[name]
                if not c.any():
                    continue                    # llama-imatrix skips entries without data
                s = self.sums[name].reshape(c.size, -1)
                m = np.where(c[:, None] > 0, s / np.maximum(c, 1)[:, None], 1.0)
                means[name] = m.astype(np.float32).reshape(-1)
                ncalls[name] = max(1, math.ceil(int(c.max()) / self.chunk_size))
                if ncalls[name] >= 2 ** 31:
                    raise QuantkitError(f"{path}: imatrix entry '{name}': {int(c.max())} tokens are "
                                        f"{ncalls[name]} chunks of {self.chunk_size}, more than the legacy "
                                        "format's int32 ncall holds (write GGUF)")
            if not means:
                raise QuantkitError(f"{path}: no entry has data")
            return imx.save_dat(path, means, ncalls, chunk_count=self.chunk_count,
                                dataset=self.datasets[-1] if self.datasets else "")
        return imx.save_gguf(path, self.sums, self.counts, datasets=self.datasets,
                             chunk_count=self.chunk_count, chunk_size=self.chunk_size)

    # ---- what users look at ----
    def never_fired(self) -> dict[str, list[int]]:
        """Entries with matrices (experts) that got no token: name -> their indices."""
        return {n: np.nonzero(c == 0)[0].tolist() for n, c in sorted(self.counts.items())
                if c.size > 1 and (c == 0).any()}

    def stats(self, top: int = 5) -> list[dict]:
        """Per entry: values, matrices, experts without data, and the statistics of its importance
        (mean x² per column, averaged over the matrices with data) that llama-imatrix's
        --show-statistics prints: sum, min, max, mean, standard deviation, share of active columns
        (> 1e-5), entropy of the normalised importance in bits and divided by log2(columns), share
        of columns more than one standard deviation above the mean, and the cosine similarity with
        the same tensor of the previous layer; plus max/mean and the most important columns."""
        imps, rows = {}, []
        for name in sorted(self.sums):
            c = self.counts[name]
            s = self.sums[name].reshape(c.size, -1) if c.size > 1 else self.sums[name].reshape(1, -1)
            seen = c > 0
            imp = (s[seen] / c[seen][:, None]).mean(axis=0) if seen.any() else np.zeros(s.shape[1])
            imps[name] = imp
            total, mean, std = float(imp.sum()), float(imp.mean()), float(imp.std())
            p = imp / total if total > 0 else np.zeros_like(imp)
            nz = p[p > 0]
            entropy = float(-(nz * np.log2(nz)).sum())
            order = np.argsort(-imp, kind="stable")[:top]
            rows.append({"name": name, "values": int(s.size), "matrices": int(c.size),
                         "tokens": int(c.sum()), "no_data": np.nonzero(~seen)[0].tolist() if c.size > 1 else [],
                         "sum": total, "min": float(imp.min()), "max": float(imp.max()), "mean": mean, "std": std,
                         "active_pct": 100.0 * float((imp > 1e-5).mean()),
                         "entropy": entropy, "entropy_norm": entropy / np.log2(imp.size) if imp.size > 1 else 0.0,
                         "zd_pct": 100.0 * float(((imp - mean) > std).mean()) if std > 0 else 0.0,
                         "cos_prev": None,
                         "max_over_mean": float(imp.max() / mean) if mean > 0 else 0.0,
                         "top_columns": order.tolist()})
        for r in rows:                          # the same tensor one layer up: blk.{i-1}.<rest>
            parts = r["name"].split(".", 2)
            if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
                prev = imps.get(f"blk.{int(parts[1]) - 1}.{parts[2]}")
                cur = imps[r["name"]]
                if prev is not None and prev.size == cur.size:
                    norm = float(np.linalg.norm(prev) * np.linalg.norm(cur))
                    r["cos_prev"] = float(prev @ cur) / norm if norm > 0 else 0.0
        return rows


def _shape_text(shape: tuple[int, int]) -> str:
    n_mat, per = shape
    return f"{n_mat} matri{'x' if n_mat == 1 else 'ces'} of {per} values"
