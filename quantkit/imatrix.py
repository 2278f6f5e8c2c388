"""Importance matrices (imatrix files) as llama-quantize reads them.

Two file formats exist (specs/ggml-quants.md §3.2, §3.3):

* **GGUF** (llama-imatrix's default): per weight ``<name>.in_sum2`` (raw Σx², F32, ne = [n_per_row,
  n_matrices]) and ``<name>.counts`` (F32, ne = [1, n_matrices]: tokens per matrix, i.e. per expert),
  metadata ``imatrix.datasets`` / ``imatrix.chunk_count`` / ``imatrix.chunk_size``.  An optional
  ``<name>.in_sum`` (Σx) is accepted and ignored.
* **legacy .dat**: ``int32 n_entries``, then per entry ``int32 len, name, int32 ncall, int32 nval,
  float values[nval]`` (mean x² times ncall), then an optional trailer ``int32 chunk_count, int32
  len, dataset``.

A file starting with the GGUF magic is read as GGUF, anything else as .dat.  Both are normalised
the way llama-quantize does it (§3.5), in float32: GGUF ``in_sum2 / count`` per matrix (1.0 for a
matrix with count 0, an expert that never saw a token), legacy ``values / ncall`` when ncall > 0.
The result is the per-input-column mean of x² that ``ggml_quantize_chunk`` takes as ``imatrix``.

Tensor lookup (:meth:`ImatrixData.weights_for`) follows ik_llama.cpp's ``llama-quantize.cpp``:
exact name first, then the fallbacks for merged/split FFN tensors and MLA (specs/ik-quants.md §11).
(ik_llama.cpp's own llama-quantize reads only the .dat format; mainline reads both.)
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import GGUFFormatError, QuantkitError
from .formats.limits import imatrix_excess
from .inputs import open_regular
from .outputs import AtomicOutput
from .gguf_io.constants import MetaValue, ValueType
from .gguf_io.reader import GGUFFile
from .gguf_io.writer import GGUFWriter, TensorSpec
from .types import QuantType

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUM2 = ".in_sum2"
SUFFIX_COUNTS = ".counts"
SUFFIX_SUM = ".in_sum"          # newer llama-imatrix: Σx (activations); not used for quantization

TOKEN_EMBD = "token_embd.weight"
MAX_COUNT = 2.0 ** 62           # token counts are kept as int64
MISSING_EXPERT_POLICIES = ("unit", "fill-mean", "error")


@dataclass
class ImatrixData:
    """Normalised importance weights per imatrix entry, plus what the file says about itself.

    Attributes:
        weights: entry name -> read-only float32 vector of ``n_per_row * n_matrices`` weights
            (matrix-major: matrix j occupies ``[j*n_per_row, (j+1)*n_per_row)``).
        n_matrices: entry name -> number of counts stored (experts for MoE weights, else 1;
            legacy files do not record it, so 1).
        counts: entry name -> int64 token counts per matrix (legacy: ``[ncall]``).
        path: the file read (None for data built in memory).
        format: ``"gguf"`` or ``"dat"``.
        datasets: calibration text names the file lists.
        chunk_count: chunks processed (GGUF ``imatrix.chunk_count``, legacy trailer; 0 if absent).
        chunk_size: tokens per chunk (GGUF only; 0 for legacy files).
        partial: entries with at least one zero-count matrix (their weights are 1.0 there).
        orphan_sums: entry -> first matrix with sums but a count of 0 (GGUF): llama-quantize
            ignores those sums; merging or converting by counts would drop them.
    """
    weights: dict[str, np.ndarray]
    n_matrices: dict[str, int] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    path: Path | None = None
    format: str = "gguf"
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    partial: list[str] = field(default_factory=list)
    orphan_sums: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for name, w in list(self.weights.items()):
            w = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
            w.flags.writeable = False
            self.weights[name] = w
            self.n_matrices.setdefault(name, 1)

    # ---- container protocol ----
    def __len__(self) -> int:
        return len(self.weights)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    @property
    def names(self) -> list[str]:
        return sorted(self.weights)

    def _where(self) -> str:
        return f"{self.path}: " if self.path is not None else ""

    # ---- filtering (--include-weights / --exclude-weights) ----
    def filtered(self, include: list[str] | None = None, exclude: list[str] | None = None) -> "ImatrixData":
        """A copy keeping only some entries, like llama-quantize's ``--include/--exclude-weights``.

        Entries whose name contains any ``exclude`` substring are dropped first; then, if
        ``include`` is non-empty, only entries containing one of its substrings are kept.  (Mainline
        refuses both options together; ik_llama.cpp applies both in this order.)
        """
        keep = list(self.weights)
        if exclude:
            keep = [n for n in keep if not any(s in n for s in exclude)]
        if include:
            keep = [n for n in keep if any(s in n for s in include)]
        return ImatrixData(weights={n: self.weights[n] for n in keep},
                           n_matrices={n: self.n_matrices[n] for n in keep},
                           counts={n: self.counts[n] for n in keep if n in self.counts},
                           path=self.path, format=self.format, datasets=list(self.datasets),
                           chunk_count=self.chunk_count, chunk_size=self.chunk_size,
                           partial=[n for n in self.partial if n in keep],
                           orphan_sums={n: m for n, m in self.orphan_sums.items() if n in keep})

    def with_missing_experts(self, policy: str) -> "ImatrixData":
        """Handle matrices (experts) that got no token, which only GGUF files can tell:

        ``unit``: weight 1.0 there, what llama-quantize does; ``fill-mean``: the mean weights of
        the entry's experts that have data; ``error``: refuse, naming them."""
        if policy not in MISSING_EXPERT_POLICIES:
            raise ValueError(f"unknown missing-expert policy '{policy}'")
        if not self.partial:
            return self
        if policy == "error":
            names = ", ".join(f"{n} ({int((self.counts[n] <= 0).sum())} of {self.counts[n].size})"
                              for n in self.partial[:8])
            raise QuantkitError(f"{self._where()}experts without imatrix data: {names}"
                                + (" ..." if len(self.partial) > 8 else "")
                                + " (--missing-expert unit or fill-mean to quantize anyway)")
        weights = dict(self.weights)
        if policy == "fill-mean":
            for name in self.partial:
                c = self.counts[name]
                w = weights[name].reshape(c.size, -1).copy()
                seen = c > 0
                if seen.any():
                    w[~seen] = w[seen].mean(axis=0)
                weights[name] = w.reshape(-1)
        return ImatrixData(weights=weights, n_matrices=dict(self.n_matrices), counts=dict(self.counts),
                           path=self.path, format=self.format, datasets=list(self.datasets),
                           chunk_count=self.chunk_count, chunk_size=self.chunk_size, partial=list(self.partial))

    def check_finite(self) -> None:
        """Raise QuantkitError naming the entry and column of the first weight that is NaN or
        infinite (llama-quantize aborts then), negative (a mean of squares cannot be) or so large
        that the quantizers' float32 sums of squared weights overflow
        (:data:`quantkit.formats.limits.IMATRIX_LIMIT`)."""
        for name in sorted(self.weights):
            self._check_entry(name)

    def _check_entry(self, entry: str) -> None:
        w = self.weights[entry]
        bad = imatrix_excess(w)
        if bad is not None:
            i, why = bad
            where = _position(i, w.size, self.n_matrices[entry])
            raise QuantkitError(f"{self._where()}imatrix entry '{entry}', {where}: value {w[i]:.6g} is {why}")

    # ---- lookup ----
    def lookup_name(self, tensor_name: str) -> str | None:
        """The entry llama-quantize (ik_llama.cpp) would use for a tensor, or None."""
        if tensor_name in self.weights:
            return tensor_name
        for alt in fallback_names(tensor_name):
            if alt in self.weights:
                return alt
        return None

    def weights_for(self, tensor_name: str, n_per_row: int, n_matrices: int = 1) -> np.ndarray | None:
        """Importance weights for a tensor as a read-only float32 array ``(n_matrices, n_per_row)``.

        Row ``k`` is the weight vector for matrix (expert) ``k`` of a 3-D tensor.  Returns None when
        the file has no entry for the tensor (it is then quantized without an imatrix).

        Raises:
            QuantkitError: the entry's size is not ``n_per_row * n_matrices`` (except for
                ``token_embd.weight``, where llama-quantize only warns: None is returned), or the
                entry holds non-finite values.
        """
        entry = self.lookup_name(tensor_name)
        if entry is None:
            log.debug("did not find imatrix weights for %s", tensor_name)
            return None
        w = self.weights[entry]
        want = n_per_row * n_matrices
        if w.size != want:
            msg = (f"{self._where()}imatrix size {w.size} is different from tensor size {want} "
                   f"({n_per_row} x {n_matrices}) for {tensor_name}"
                   + (f" (entry '{entry}')" if entry != tensor_name else ""))
            if tensor_name == TOKEN_EMBD:
                log.warning("%s; quantizing it without imatrix", msg)
                return None
            raise QuantkitError(msg)
        self._check_entry(entry)
        return w.reshape(n_matrices, n_per_row)


def _position(i: int, size: int, n_matrices: int) -> str:
    """'column c' (or 'matrix m, column c' for per-expert entries) of flat index i."""
    per = size // max(n_matrices, 1)
    return f"column {i}" if n_matrices <= 1 or not per else f"matrix {i // per}, column {i % per}"


def fallback_names(tensor_name: str) -> list[str]:
    """Entry names ik_llama.cpp tries after the exact name, in order (src/llama-quantize.cpp).

    * ``…ffn_up_exps.weight`` / ``…ffn_gate_exps.weight`` -> merged ``…ffn_gate_up_exps.weight``,
      then ``…ffn_up_exps.weight`` (gate and up see the same input activations);
    * ``…ffn_gate_up_exps.weight`` -> ``…ffn_up_exps.weight``;
    * ``…ffn_gate.weight`` -> ``…ffn_up.weight``;
    * MLA: ``….attn_v_b.weight`` <-> ``….attn_kv_b.weight`` (files computed with standard attention).

    The part of the name after the matched suffix is dropped, as the C code does.
    """
    name = tensor_name
    pos = name.find("ffn_up_exps.weight")
    if pos < 0:
        pos = name.find("ffn_gate_exps.weight")
    if pos >= 0:
        return [name[:pos] + "ffn_gate_up_exps.weight", name[:pos] + "ffn_up_exps.weight"]
    pos = name.find("ffn_gate_up_exps.weight")
    if pos >= 0:
        return [name[:pos] + "ffn_up_exps.weight"]
    pos = name.find("ffn_gate.weight")
    if pos >= 0:
        return [name[:pos] + "ffn_up.weight"]
    alternatives = (".attn_v_b.weight", ".attn_kv_b.weight")
    for j, alt in enumerate(alternatives):
        pos = name.find(alt)
        if pos >= 0:
            return [name[:pos] + alternatives[(j + 1) % 2]]
    return []


# ---- loading ----

def load_imatrix(path: str | os.PathLike, *, include: list[str] | None = None,
                 exclude: list[str] | None = None, check_finite: bool = True) -> ImatrixData:
    """Read a GGUF or legacy .dat imatrix file and normalise it as llama-quantize does.

    Args:
        path: the imatrix file.
        include: keep only entries whose name contains one of these substrings.
        exclude: drop entries whose name contains one of these substrings (applied first).
        check_finite: raise on NaN/Inf, negative or too large weights (after filtering, as
            llama-quantize does for NaN/Inf).

    Raises:
        QuantkitError: the file is missing or malformed (the message names the file), or it holds
            non-finite values.
    """
    path = Path(path)
    with open_regular(path, "imatrix file") as fh:     # a device or FIFO: refused, never read
        magic = fh.read(4)
        data = _load_gguf(path) if magic == GGUF_MAGIC else _load_dat(path, fh)
    if include or exclude:
        data = data.filtered(include, exclude)
    if check_finite:
        data.check_finite()
    log.info("%s: %d imatrix entries (%s, %d chunks)", path, len(data), data.format, data.chunk_count)
    return data


def _normalise_gguf(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """in_sum2 / count per matrix in float32; 1.0 for matrices with count <= 0."""
    n_mat = counts.size
    sums = sums.reshape(n_mat, -1)
    out = np.ones_like(sums)
    seen = counts > 0
    out[seen] = sums[seen] / counts[seen].astype(np.float32)[:, None]
    return out.reshape(-1)


def _lround(x: np.ndarray) -> np.ndarray:
    """C ``lround``: nearest integer, halves away from zero."""
    return (np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)).astype(np.int64)


def _load_gguf(path: Path) -> ImatrixData:

    try:
        f = GGUFFile(path)
    except QuantkitError:
        raise
    except Exception as e:      # a reader bug must still name the file
        raise QuantkitError(f"{path}: cannot read GGUF imatrix: {e}") from None
    with f:
        if not f.tensors:
            raise GGUFFormatError(path, None, "no data in imatrix file (no tensors)")
        parts: dict[str, dict[str, object]] = {}
        for t in f.tensors:
            for suffix, key in ((SUFFIX_SUM2, "sum2"), (SUFFIX_COUNTS, "counts"), (SUFFIX_SUM, "sum")):
                if t.name.endswith(suffix) and len(t.name) > len(suffix):
                    parts.setdefault(t.name[:-len(suffix)], {})[key] = t
                    break
        if not parts:
            raise GGUFFormatError(path, None, "no '<name>.in_sum2' / '<name>.counts' tensors: "
                                  "not an imatrix file")

        def values(t) -> np.ndarray:
            if t.qtype != QuantType.F32:
                raise GGUFFormatError(path, t.offset, f"imatrix tensor '{t.name}' is {t.qtype.name.lower()}, "
                                      "must be f32")
            return np.frombuffer(f.view(t.offset, t.nbytes), dtype="<f4").astype(np.float32)

        weights, n_mat, counts_of, partial, orphans = {}, {}, {}, [], {}
        for name in sorted(parts):
            p = parts[name]
            if "sum2" not in p or "counts" not in p:
                have = ", ".join(f"'{name}{s}'" for s, k in ((SUFFIX_SUM2, "sum2"), (SUFFIX_COUNTS, "counts"),
                                                              (SUFFIX_SUM, "sum")) if k in p)
                missing = SUFFIX_COUNTS if "sum2" in p else SUFFIX_SUM2
                raise GGUFFormatError(path, None, f"mismatched sums and counts: {have} without '{name}{missing}'")
            sums = values(p["sum2"])
            raw_counts = values(p["counts"])
            if "sum" in p and values(p["sum"]).size != sums.size:
                raise GGUFFormatError(path, None, f"'{name}{SUFFIX_SUM}' has {p['sum'].n_elements} values, "
                                      f"'{name}{SUFFIX_SUM2}' {sums.size}")
            if raw_counts.size == 0 or sums.size == 0:
                raise GGUFFormatError(path, None, f"imatrix entry '{name}' is empty "
                                      f"({sums.size} sums, {raw_counts.size} counts)")
            if sums.size % raw_counts.size:
                raise GGUFFormatError(path, None, f"imatrix entry '{name}': {sums.size} sums do not split "
                                      f"into {raw_counts.size} matrices")
            bad = np.flatnonzero(~np.isfinite(raw_counts) | (raw_counts < 0) | (raw_counts >= MAX_COUNT))
            if bad.size:
                raise GGUFFormatError(path, None, f"imatrix entry '{name}': count {raw_counts[bad[0]]:.6g} of matrix "
                                      f"{bad[0]} is not a token count (a number from 0 to 2^62)")
            counts = _lround(raw_counts)
            unseen = np.flatnonzero((counts == 0) & (sums.reshape(counts.size, -1) != 0).any(axis=1))
            if unseen.size:     # llama-quantize ignores them (weight 1); merging would drop them
                orphans[name] = int(unseen[0])
            weights[name] = _normalise_gguf(sums, counts)
            n_mat[name] = int(counts.size)
            counts_of[name] = counts
            if (counts <= 0).any():
                partial.append(name)

        # llama-quantize refuses GGUF imatrices without all three metadata keys
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in f.metadata]
        if missing:
            raise GGUFFormatError(path, None, f"missing imatrix metadata: {', '.join(missing)}")
        ds = f.metadata[KEY_DATASETS]
        datasets = list(ds.value) if ds.vtype == ValueType.ARRAY and ds.elem_type == ValueType.STRING else []

        def int_key(key: str) -> int:
            v = f.metadata[key]
            if v.vtype in (ValueType.ARRAY, ValueType.STRING, ValueType.FLOAT32, ValueType.FLOAT64,
                           ValueType.BOOL):
                raise GGUFFormatError(path, None, f"{key} must be an integer, got {v.vtype.name.lower()}")
            return int(v.value)

        chunk_count, chunk_size = int_key(KEY_CHUNK_COUNT), int_key(KEY_CHUNK_SIZE)
    if partial:
        log.info("%s: %d entries have matrices without data (weight 1.0 used): %s", path, len(partial),
                 ", ".join(partial[:5]) + (" …" if len(partial) > 5 else ""))
    return ImatrixData(weights=weights, n_matrices=n_mat, counts=counts_of, path=path, format="gguf",
                       datasets=datasets, chunk_count=chunk_count, chunk_size=chunk_size, partial=partial,
                       orphan_sums=orphans)


def _load_dat(path: Path, fh) -> ImatrixData:
    """The legacy format, read through a map of the open file: every length it declares is checked
    against the file's size before anything of that length is read or allocated."""
    size = os.fstat(fh.fileno()).st_size
    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        return _parse_dat(path, buf)
    finally:
        if size:
            buf.close()


def _parse_dat(path: Path, buf) -> ImatrixData:
    pos = 0

    def fail(msg: str, at: int):
        raise GGUFFormatError(path, at, f"legacy imatrix: {msg}")

    def i32(what: str) -> int:
        nonlocal pos
        if pos + 4 > len(buf):
            fail(f"truncated file: {what} needs 4 bytes, file ends at {len(buf)}", pos)
        (v,) = struct.unpack_from("<i", buf, pos)
        pos += 4
        return v

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            fail(f"truncated file: {what} needs {n} bytes, file ends at {len(buf)}", pos)
        pos += n
        return buf[pos - n:pos]

    if len(buf) < 4:
        fail(f"no data in file ({len(buf)} bytes)", 0)
    n_entries = i32("entry count")
    if n_entries < 1:
        fail(f"no data in file (entry count {n_entries})", 0)
    if n_entries > len(buf) // 12:      # each entry needs at least 12 bytes of header
        fail(f"implausible entry count {n_entries} for a {len(buf)}-byte file", 0)
    weights, counts_of = {}, {}
    for i in range(n_entries):
        at = pos
        n = i32(f"name length of entry {i + 1}")
        if n < 0 or n > 4096:
            fail(f"entry {i + 1} has an implausible name length {n}", at)
        raw = take(n, f"name of entry {i + 1}").split(b"\0", 1)[0]      # C reads it as a C string
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            fail(f"entry {i + 1} name is not valid UTF-8", at)
        ncall = i32(f"ncall of '{name}'")
        if ncall < 0:
            fail(f"entry '{name}' has a negative ncall ({ncall})", pos - 4)
        nval = i32(f"value count of '{name}'")
        if nval < 1:
            fail(f"entry '{name}' has {nval} values", pos - 4)
        vals = np.frombuffer(take(4 * nval, f"{nval} values of '{name}'"), dtype="<f4").astype(np.float32)
        if ncall > 0:
            vals = vals / np.float32(ncall)
        if name in weights:
            log.warning("%s: duplicate imatrix entry '%s', the later one is used", path, name)
        weights[name] = vals
        counts_of[name] = np.array([ncall], np.int64)

    chunk_count, datasets = 0, []
    if pos < len(buf):      # optional trailer: chunk count and dataset name
        chunk_count = i32("trailer chunk count")
        if pos < len(buf):
            at = pos
            n = i32("trailer dataset name length")
            if n < 0:
                fail(f"trailer dataset name length {n}", at)
            ds = take(n, "trailer dataset name").split(b"\0", 1)[0]
            if ds:
                datasets.append(ds.decode("utf-8", errors="replace"))
        if pos != len(buf):
            fail(f"{len(buf) - pos} unexpected bytes after the trailer", pos)
    return ImatrixData(weights=weights, n_matrices={n: 1 for n in weights}, counts=counts_of, path=path,
                       format="dat", datasets=datasets, chunk_count=chunk_count, chunk_size=0)


def _check_storable(path, name: str, values: np.ndarray, n_matrices: int) -> None:
    """Refuse to write a value that float32 cannot hold (a sum or mean·ncall past 3.4e38)."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise QuantkitError(f"{path}: imatrix entry '{name}', {_position(int(bad[0]), values.size, n_matrices)}: "
                            "the value overflows float32 (activations too large to store)")


def save_dat(path: str | os.PathLike, weights: dict[str, np.ndarray], ncall: int | dict[str, int] = 1, *,
             chunk_count: int = 0, dataset: str = "") -> Path:
    """Write importance weights (entry name -> mean x² per column) as a legacy ``.dat`` file, the
    format ik_llama.cpp's llama-quantize reads.  Values are stored times ``ncall`` (one for all
    entries, or per entry), as llama-imatrix stores them; the trailer carries the chunk count and
    the dataset name.  Written to a temporary file that is renamed at the end (:mod:`quantkit.outputs`)."""
    ncalls = ncall if isinstance(ncall, dict) else dict.fromkeys(weights, ncall)
    if any(n < 1 for n in ncalls.values()):
        raise ValueError(f"ncall must be positive, got {min(ncalls.values())}")
    path = Path(path)
    parts = [struct.pack("<i", len(weights))]
    for name, vals in weights.items():
        raw = name.encode()
        ncall = ncalls[name]
        with np.errstate(over="ignore"):
            vals = np.asarray(vals, np.float32).reshape(-1) * np.float32(ncall)
        _check_storable(path, name, vals, 1)
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, vals.size), vals.astype("<f4").tobytes()]
    ds = dataset.encode()
    parts += [struct.pack("<ii", chunk_count, len(ds)), ds]
    with AtomicOutput() as out:
        out.open(path).write(b"".join(parts))
    return path


def save_gguf(path: str | os.PathLike, sums: dict[str, np.ndarray], counts: dict[str, np.ndarray], *,
              datasets: list[str], chunk_count: int, chunk_size: int) -> Path:
    """Write raw sums as mainline llama-imatrix's GGUF imatrix (specs/ggml-quants.md §3.2).

    ``sums``: entry -> (n_mat, n_per_row) Σx²; ``counts``: entry -> (n_mat,) tokens per matrix (or
    one count).  Entries in byte order of their names, each as ``<name>.in_sum2`` F32 [n_per_row,
    n_mat] then ``<name>.counts`` F32 [1, n_mat], trailing 1-dimensions dropped as ggml does;
    ``general.type = imatrix`` and the three ``imatrix.*`` keys llama-quantize needs."""

    def shape(ne0, n_mat):
        return (ne0,) if n_mat == 1 else (ne0, n_mat)

    meta = {"general.type": MetaValue(ValueType.STRING, "imatrix"),
            KEY_DATASETS: MetaValue(ValueType.ARRAY, list(datasets), ValueType.STRING),
            KEY_CHUNK_COUNT: MetaValue(ValueType.UINT32, int(chunk_count)),
            KEY_CHUNK_SIZE: MetaValue(ValueType.UINT32, int(chunk_size))}
    names = sorted(sums, key=lambda n: n.encode())
    specs, data = [], []
    for name in names:
        c = np.asarray(counts[name], np.float32).reshape(-1)
        with np.errstate(over="ignore"):
            s2 = np.asarray(sums[name], np.float32)
        # one row per count: per-head entries (several rows of sums, one count) are stored flat
        s2 = s2.reshape(c.size, -1)
        _check_storable(path, name, s2.reshape(-1), c.size)
        specs += [TensorSpec(name + SUFFIX_SUM2, shape(s2.shape[1], s2.shape[0]), QuantType.F32),
                  TensorSpec(name + SUFFIX_COUNTS, shape(1, c.size), QuantType.F32)]
        data += [s2, c]
    path = Path(path)
    with GGUFWriter([path], [(meta, specs)]) as w:
        for spec, arr in zip(specs, data):
            w.write_tensor(spec.name, np.ascontiguousarray(arr, "<f4"))
    return path
