"""Run a plan: stream every tensor from the input model to the output file.

One tensor is in flight at a time and it is processed in row chunks, so peak memory is bounded by a
chunk of float32 rows plus its quantized bytes, whatever the model size.  3-D (stacked expert)
tensors are quantized expert by expert, each with its own imatrix slice, as llama-quantize does.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from . import formats, row_threads, signals
from .compiling import CompileLog, announced
from .errors import QuantkitError
from .gguf_io.constants import KEY_FILE_TYPE, KEY_QUANT_VERSION, MetaValue, ValueType
from .gguf_io.reader import GGUFModel, TensorInfo
from .gguf_io.writer import GGUFWriter, TensorSpec, encode_shard, plan_shards, shard_paths
from .formats import q8_0_numpy
from .formats.limits import row_extent, sum_factor
from .outputs import AtomicOutput, check_outputs
from .resume import resumable_output
from .inputs import open_regular
from .kv_override import apply_overrides
from .plan import Plan, TensorPlan
from .prune import block_count_key
from .types import QuantType, traits, type_name
from .version import __version__

CHUNK_BYTES = 4 * 1024 * 1024         # float32 rows converted per step (cache-friendly)
# bytes a copy or shuffle part moves: a part's input and output stay in the core's L2 between the
# read, the shuffle and the write (1 MiB: 1.45 GB/s for q4_K -> q4_k_r4 on 2 threads, 4 MiB: 0.8)
PART_BYTES = 1024 * 1024
QUANT_VERSION = 2                   # GGML_QNT_VERSION
LLAMA_CHUNK_ELEMENTS = 32 * 512     # llama-quantize quantizes rows in chunks of at least this many
ROWS_PER_THREAD = 8                 # rows of a chunk per quantizing thread, at least (load balance)


@dataclass
class WriteOptions:
    split_max_size: int | None = None
    keep_split: bool = False
    imatrix_info: dict | None = None    # file, dataset, entries_count, chunks_count
    recipe_text: str | None = None
    threads: int | None = None
    metadata: dict | None = None        # the output's metadata, written as given (repack: the input's own)
    inputs: tuple = ()                  # other files the run reads (imatrix, recipes): never written
    # ik's --partial-requant: an output file (shard) that is already there, whole and as this run
    # would write it, is kept; only the missing ones are written, each renamed into place as soon
    # as it is complete (so that an interrupted run leaves whole shards for the next one)
    partial_requant: bool = False
    # --resume: write a resumable partial with a journal beside OUT, kept after an interrupt or
    # error; a partial (and journal) left there by such a run is verified and continued (resume.py)
    resume: bool = False


@dataclass
class Result:
    paths: list[Path]
    bytes_written: int
    seconds: float
    n_weights: int
    tensor_seconds: dict[str, float] = field(default_factory=dict)
    missing_imatrix: list[str] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)      # --partial-requant: files already complete
    compile_seconds: float = 0.0        # numba compiling kernels before ``seconds`` started (warm_up_plan)
    reused_tensors: int = 0             # --resume: tensors an interrupted run had written, verified and kept
    reused_bytes: int = 0
    started_over: str | None = None     # --resume: why the partial found was not used

    def to_json(self) -> dict:
        return {"files": [str(p) for p in self.paths], "kept": [str(p) for p in self.kept],
                "bytes_written": self.bytes_written,
                "seconds": self.seconds,
                "weights_per_second": self.n_weights / self.seconds if self.seconds else None,
                "compile_seconds": self.compile_seconds,
                "reused": {"tensors": self.reused_tensors, "bytes": self.reused_bytes,
                           "started_over": self.started_over},
                "missing_imatrix": self.missing_imatrix}


def read_rows(info: TensorInfo, rows: slice) -> np.ndarray:
    """The stored bytes of some rows, (n, row_size) uint8, as a private copy."""
    row_size = traits(info.qtype).row_size(info.shape[0])
    raw = info.source.read(info.offset + rows.start * row_size, (rows.stop - rows.start) * row_size)
    return raw.reshape(-1, row_size)


def to_float32(info: TensorInfo, rows: slice) -> np.ndarray:
    """Rows of a tensor as float32 (n, n_per_row), decoded from any readable type."""
    return decode_rows(info, read_rows(info, rows))


def decode_rows(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Stored rows of ``info`` (read_rows) as float32 (n, n_per_row)."""
    n_per_row = info.shape[0]
    if info.qtype == QuantType.F32:
        return np.ascontiguousarray(raw).view(np.float32).reshape(-1, n_per_row)
    return formats.dequantize(raw, info.qtype, n_per_row)


def output_metadata(model: GGUFModel, plan: Plan, opts: WriteOptions) -> dict[str, MetaValue]:
    """Input metadata, then file type, quantization version and how the file was made (or
    ``opts.metadata`` as given)."""
    if opts.metadata is not None:
        return opts.metadata
    meta = {k: v for k, v in model.metadata.items()
            if not (k.startswith("quantize.imatrix.") or k.startswith("quantkit."))}
    # llama-quantize copies the input's keys, then sets these two with gguf_set_val_u32: ik's sets
    # a key where it stands (so a converted model keeps its order), mainline's moves it to the end
    meta = apply_overrides(meta, [(KEY_QUANT_VERSION, MetaValue(ValueType.UINT32, QUANT_VERSION)),
                                  (KEY_FILE_TYPE, MetaValue(ValueType.UINT32, plan.file_type))], plan.flavor)
    # --override-kv, then the importance matrix's keys (the C tools pass both as overrides, the
    # user's first), then --prune-layers' block count (llama-quant.cpp sets it last)
    meta = apply_overrides(meta, plan.kv_overrides, plan.flavor)
    if opts.imatrix_info:
        info = opts.imatrix_info
        meta["quantize.imatrix.file"] = MetaValue(ValueType.STRING, str(info["file"])[:127])
        if info.get("dataset"):
            meta["quantize.imatrix.dataset"] = MetaValue(ValueType.STRING, str(info["dataset"])[:127])
        meta["quantize.imatrix.entries_count"] = MetaValue(ValueType.UINT32, int(info["entries_count"]))
        if info.get("chunks_count"):
            meta["quantize.imatrix.chunks_count"] = MetaValue(ValueType.UINT32, int(info["chunks_count"]))
    if plan.block_count is not None:
        meta = apply_overrides(meta, [(block_count_key(model.metadata), MetaValue(ValueType.UINT32, plan.block_count))],
                               plan.flavor)
    meta["quantkit.version"] = MetaValue(ValueType.STRING, __version__)
    meta["quantkit.flavor"] = MetaValue(ValueType.STRING, plan.flavor)
    if opts.recipe_text:
        meta["quantkit.recipe"] = MetaValue(ValueType.STRING, opts.recipe_text)
    if plan.default_type is not None:
        meta["quantkit.default_type"] = MetaValue(ValueType.STRING, type_name(plan.default_type))
    return meta


def _row_chunks(n_rows_per_matrix: int, n_matrices: int, n_per_row: int, group: int, threads: int = 1):
    """(matrix index, row slice) pieces: never crossing a matrix, multiples of the row group and of
    llama-quantize's own chunk (ik's q2_K decides per chunk whether rows are ternary), and at least
    ROWS_PER_THREAD rows per thread: the quantizers split a chunk's rows between the threads, and a
    chunk of 144 rows (4 MiB of 7168-wide rows, DeepSeek's experts) leaves a quarter of 64 threads
    idle."""
    llama_chunk = max(1, -(-LLAMA_CHUNK_ELEMENTS // n_per_row))
    group = math.lcm(group, llama_chunk)
    rows = max(group, CHUNK_BYTES // (4 * n_per_row) // group * group,
               -(-ROWS_PER_THREAD * threads // group) * group)
    for m in range(n_matrices):
        base = m * n_rows_per_matrix
        for r in range(0, n_rows_per_matrix, rows):
            yield m, slice(base + r, base + min(r + rows, n_rows_per_matrix))


def quantize_rows(x: np.ndarray, qtype, imatrix: np.ndarray | None, flavor: str, name: str,
                  first_row: int = 0) -> np.ndarray:
    """``formats.quantize`` of rows starting at ``first_row`` of tensor ``name``, refusing what the
    quantizer cannot represent with a QuantkitError naming the row and column, never zeros:

    * a NaN or an infinity in the input;

    * values (and imatrix products) whose float32 scale search would overflow (and zero the
      block without a sign of it) are refused before quantizing (formats/limits.py derives the
      bounds per type);
    * a scale or value that overflowed its storage (an fp16 scale, an f16 value above 65504)
      decodes to Inf/NaN: llama-quantize's ggml_validate_row_data refuses such output, and so do
      we, naming the largest value of the block that scale covers."""
    extent = row_extent(x, imatrix)
    bad_rows = np.flatnonzero(np.isinf(extent[:, 0]))
    if bad_rows.size:
        row = int(bad_rows[0])
        col = int(np.flatnonzero(~np.isfinite(x[row]))[0])
        raise QuantkitError(f"tensor '{name}': the input holds a non-finite value ({x[row, col]}) at row "
                            f"{first_row + row}, column {col}")
    over = formats.first_excess(x, qtype, imatrix, extent)
    if over is not None:
        raise QuantkitError(f"tensor '{name}': row {first_row + over.row}, column {over.column}: {over.what}")
    q = formats.quantize(x, qtype, imatrix, flavor)
    bad = formats.non_finite_column(q, qtype, x)
    if bad is not None:
        row, col = bad
        raise QuantkitError(f"tensor '{name}': row {first_row + row}, column {col}: |x| = {x[row, col]:.6g} is "
                            f"beyond what {type_name(qtype)} can represent (the quantized output would decode to "
                            "inf or nan)")
    return q


def _threads() -> int:
    """The threads a chunk's rows are split between: numba's where it is loaded (its kernels run on
    as many), else row_threads' (the numpy conversions'); the same count in a quantize command."""
    numba = sys.modules.get("numba")
    return numba.get_num_threads() if numba is not None else row_threads.threads()


def needs_numba(model: GGUFModel, plan: Plan) -> bool:
    """Whether running ``plan`` calls a numba kernel: every conversion does but those numpy does
    alone (formats.numpy_only: F16/BF16/F32 to q8_0, F16 or F32) and copies, and so may a source
    that is not a GGUF file's plain bytes (a Hugging Face tensor may run a kernel to be read)."""
    for tp in plan.tensors:
        if tp.action == "copy":
            continue
        if tp.action == "repack" or not formats.numpy_only(tp.src_type, tp.dst_type):
            return True
        if not getattr(model.by_name[tp.input_name].source, "read_ahead", False):
            return True
    return False


def convert_tensor(info: TensorInfo, tp: TensorPlan, imatrix: np.ndarray | None, flavor: str):
    """Yield the output bytes of one tensor chunk by chunk.  ``imatrix``: (n_matrices, n_per_row).

    The next chunk's bytes are read on a helper thread while this one is quantized (pread releases
    the GIL): a 671B model streams 1.3 TB of BF16 in, and reading it between the quantizer's parallel
    runs would leave every thread but one idle for as long as the disk takes."""
    shape = info.shape
    n_per_row = shape[0]
    n_rows_per_matrix = shape[1] if len(shape) > 1 else 1
    n_matrices = info.n_rows // n_rows_per_matrix
    group = traits(tp.dst_type).interleave_rows
    # a source that stores these very blocks (a compressed-tensors int4 checkpoint's q4_0) is copied
    # (its rows are then taken on this thread alone: no read ahead beside it)
    exact_rows = getattr(info.source, "exact_rows", None)
    if tp.dst_type not in getattr(info.source, "exact_types", ()):
        exact_rows = None
    chunks = list(_row_chunks(n_rows_per_matrix, n_matrices, n_per_row, group, _threads()))
    # F16 -> Q8_0 straight from the half bits (formats/q8_0_numpy.py): the same bytes without the
    # float32 rows nor quantize_rows' checks, which find nothing there but what the quantizer
    # raises on: NaN and infinity (its chunk then takes the float32 path, which names the value);
    # no search to overflow (sum_factor 0); a scale max|x|/127 <= 65504/127, finite in fp16
    from_halves = (info.qtype == QuantType.F16 and tp.dst_type == QuantType.Q8_0 and exact_rows is None
                   and sys.byteorder == "little" and not sum_factor(tp.dst_type, n_per_row, imatrix is not None))
    # read ahead only from sources whose reads are plain preads (a GGUF file): a lazy Hugging Face
    # tensor may run a numba kernel to read (FP8 -> BF16), which must not run beside the quantizer's
    with ReadAhead(info, enabled=exact_rows is None and getattr(info.source, "read_ahead", False)) as ahead:
        for i, (m, rows) in enumerate(chunks):
            signals.check()
            if exact_rows is not None:
                q = exact_rows(tp.dst_type, rows.start, rows.stop, info.name)
                if q is not None:
                    yield q
                    continue
            raw = ahead.raw(rows, chunks[i + 1][1] if i + 1 < len(chunks) else None)
            if from_halves:
                q = np.empty((raw.shape[0], traits(QuantType.Q8_0).row_size(n_per_row)), np.uint8)
                try:
                    q8_0_numpy.quantize_f16_rows(np.ascontiguousarray(raw).view(np.uint16), q)
                    yield q
                    continue
                except q8_0_numpy.NonFinite:
                    pass
            x = decode_rows(info, raw)
            w = imatrix[m] if imatrix is not None else None
            yield quantize_rows(x, tp.dst_type, w, flavor, info.name, rows.start)


class ReadAhead:
    """Stored rows of one tensor, the next rows' bytes read on a helper thread meanwhile.
    Holds two chunks' bytes at most (the one being decoded and the one being read)."""

    def __init__(self, info: TensorInfo, enabled: bool = True):
        self.info, self.enabled = info, enabled
        self._pool = None
        self._pending: tuple[slice, object] | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)     # a read in flight ends first
        return False

    def raw(self, rows: slice, next_rows: slice | None) -> np.ndarray:
        """``read_rows(info, rows)``, starting the read of ``next_rows`` (None: no more)."""
        if self._pending is not None and self._pending[0] == rows:
            raw = self._pending[1].result()
        else:
            raw = read_rows(self.info, rows)
        self._pending = None
        if next_rows is not None and self.enabled:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="quantkit-read")
            self._pending = (next_rows, self._pool.submit(read_rows, self.info, next_rows))
        return raw


def repack_parts(info: TensorInfo, tp: TensorPlan, buffers: "ThreadBuffers", part_bytes: int = PART_BYTES):
    """(nbytes, make) parts of one tensor regrouped between its plain and row-interleaved layouts,
    for :meth:`GGUFWriter.write_tensor_parts`: each ``make`` reads its rows and shuffles them into
    buffers of the thread that runs it, so parts run side by side on the writer's workers.

    Parts are whole row groups; a group never crosses a matrix because the planner only repacks
    tensors whose rows per matrix are a multiple of the group."""
    n_per_row = info.shape[0]
    to_packed = traits(tp.dst_type).interleave_rows > 1
    packed = tp.dst_type if to_packed else tp.src_type
    group = traits(packed).interleave_rows
    row_size = traits(info.qtype).row_size(n_per_row)
    rows = max(group, part_bytes // row_size // group * group)
    from .formats import interleave     # numba's kernels: not imported by a quantize that repacks nothing
    shuffle = interleave.interleave if to_packed else interleave.deinterleave

    def make(start: int, n: int):
        src, dst = buffers.get(n * row_size)
        src, dst = src[:n * row_size].reshape(n, row_size), dst[:n * row_size].reshape(n, row_size)
        info.source.read(info.offset + start * row_size, n * row_size, src)
        return shuffle(src, packed, n_per_row, dst)

    for start in range(0, info.n_rows, rows):
        n = min(rows, info.n_rows - start)
        yield n * row_size, partial(make, start, n)


def copy_parts(info: TensorInfo, buffers: "ThreadBuffers", chunk_bytes: int = PART_BYTES):
    """(nbytes, make) parts of a tensor copied as it is."""
    def make(start: int, n: int):
        return info.source.read(info.offset + start, n, buffers.get(n)[0])

    for s in range(0, info.nbytes, chunk_bytes):
        n = min(chunk_bytes, info.nbytes - s)
        yield n, partial(make, s, n)


class ThreadBuffers:
    """Two byte buffers per thread (read and shuffled), reused by every part that thread makes: the
    writer writes a part before its thread makes the next one, so a buffer is free again by then."""

    def __init__(self):
        self._local = threading.local()

    def get(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].nbytes < nbytes:
            bufs = self._local.bufs = (np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8))
        return bufs


def complete_output(path: Path, metadata: dict[str, MetaValue], specs: list[TensorSpec]) -> bool:
    """--partial-requant: whether ``path`` already holds the file this run writes there (its header
    byte for byte and its size).  False where nothing is there; a QuantkitError where something
    else is (another TYPE, recipe, imatrix, quantkit version, or a file cut short)."""
    if not os.path.lexists(path):
        return False
    header, size = encode_shard(metadata, specs)
    with open_regular(path, "--partial-requant: OUT") as f:
        actual_size = os.fstat(f.fileno()).st_size
        head = f.read(len(header))
    if head != header or actual_size != size:
        why = "its header differs (another TYPE, recipe, imatrix, option or quantkit version)" if head != header \
            else f"it has {actual_size:,} bytes, not {size:,}"
        raise QuantkitError(f"--partial-requant: '{path}' exists but is not the file this run writes: {why}; "
                            f"remove it to have it written again")
    return True


def plan_label(plan: Plan) -> str:
    """What a plan computes, as the compile notice names it: ``Q4_K_M (q4_K, q6_K)``."""
    types = sorted({type_name(t.dst_type) for t in plan.tensors if t.action != "copy"})
    listed = ", ".join(types) or "no type"
    return f"{plan.preset.name} ({listed})" if getattr(plan, "preset", None) is not None else listed


def warm_up_plan(model: GGUFModel, plan: Plan,
                 imatrix_for: Callable[[TensorPlan], np.ndarray | None] = lambda tp: None) -> CompileLog:
    """Make ready every kernel the plan's run will call, before it is timed: for each kind of
    tensor it converts (source type, target type, with or without an imatrix) the first rows of
    the first such tensor go through the run's own path (read, decode, checks, quantize), and a
    repack shuffles one row group.  Kernels that compile say so once (compiling.announced).

    An input the run will refuse is left to the run to report, in its order.  A plan that needs no
    numba kernel (:func:`needs_numba`) has nothing to make ready."""
    if not needs_numba(model, plan):
        return CompileLog(plan_label(plan))
    seen = set()
    with announced(plan_label(plan)) as log:
        for tp in plan.tensors:
            imatrix = imatrix_for(tp) if tp.action in ("quantize", "convert") else None
            key = (tp.action, tp.src_type, tp.dst_type, imatrix is not None)
            info = model.by_name[tp.input_name]
            # copied from the input's own blocks (convert_tensor) needs no kernel
            if tp.action == "copy" or key in seen or tp.dst_type in getattr(info.source, "exact_types", ()):
                continue
            seen.add(key)
            signals.check()
            if tp.action == "repack":
                for _, make in repack_parts(info, tp, ThreadBuffers(), part_bytes=1):
                    make()
                    break
                continue
            rows = math.lcm(traits(tp.src_type).interleave_rows, traits(tp.dst_type).interleave_rows)
            try:
                x = to_float32(info, slice(0, min(rows, info.n_rows)))
                quantize_rows(x, tp.dst_type, None if imatrix is None else imatrix[0], plan.flavor, info.name)
            except QuantkitError:
                pass
    return log


def run_plan(model: GGUFModel, plan: Plan, out: Path, opts: WriteOptions,
             imatrix_for: Callable[[TensorPlan], np.ndarray | None] = lambda tp: None,
             progress: Callable[[str, int, int], None] | None = None) -> Result:
    """Write the planned model to ``out`` (or its shards).  ``progress(name, done, total)`` in bytes."""
    row_threads.set_threads(opts.threads)
    if opts.threads and needs_numba(model, plan):      # else numba stays unimported (~0.3 s)
        import numba
        numba.set_num_threads(max(1, min(opts.threads, numba.config.NUMBA_NUM_THREADS)))
    meta = output_metadata(model, plan, opts)
    specs = [TensorSpec(t.name, t.shape, t.dst_type) for t in plan.tensors]
    groups = None
    if opts.keep_split:
        file_index = {id(f): i for i, f in enumerate(model.files)}
        groups = [file_index[id(model.by_name[t.input_name].source)] for t in plan.tensors]
    shards = plan_shards(meta, specs, opts.split_max_size, groups)
    paths = shard_paths(out, len(shards))
    # every shard name against every file read (all input shards, a model directory's files, the
    # imatrix, recipes) before anything is written: --keep-split of A-0000N-of-M.gguf to A.gguf
    # would otherwise write over its input set
    inputs = [model.path, *(f.path for f in getattr(model, "files", ())), *opts.inputs]
    check_outputs(paths, inputs)
    keep = set()
    if opts.partial_requant:
        keep = {i for i, (p, (m, s)) in enumerate(zip(paths, shards)) if complete_output(p, m, s)}
    shard_of = {s.name: i for i, (_, specs_i) in enumerate(shards) for s in specs_i}
    total = plan.bytes_in
    done = 0
    t0 = time.perf_counter()
    per_tensor: dict[str, float] = {}
    # Copies and byte shuffles are read, shuffled and written a part at a time by every writer
    # thread side by side (pread, the shuffle kernel and pwrite all run without the GIL);
    # quantization runs its numba kernels on all threads itself, with one writer thread overlapping.
    workers = max(1, opts.threads or os.cpu_count() or 1)
    buffers = ThreadBuffers()
    output = AtomicOutput()
    with resumable_output(opts.resume, output, model, plan, paths, shards, imatrix_for, workers, inputs) as journal, \
            GGUFWriter(paths, shards, workers=workers, keep=keep, commit_each=opts.partial_requant, output=output,
                       resumable=journal is not None) as writer:
        # kernels made ready once the output is reserved (a full disk fails first), untimed
        tw = time.perf_counter()
        compiled = warm_up_plan(model, plan, imatrix_for)
        t0 += time.perf_counter() - tw
        for tp in plan.tensors:
            signals.check()
            if shard_of[tp.name] in keep:
                done += tp.nbytes_in
                continue
            if journal is not None and journal.reused(tp.name):
                writer.skip_tensor(tp.name)         # written and verified by an interrupted run
                done += tp.nbytes_in
                if progress:
                    progress(tp.name, done, total)
                continue
            ts = time.perf_counter()
            info = model.by_name[tp.input_name]
            if tp.action == "copy":
                writer.write_tensor_parts(tp.name, copy_parts(info, buffers))
            elif tp.action == "repack":
                writer.write_tensor_parts(tp.name, repack_parts(info, tp, buffers))
            else:
                writer.write_tensor(tp.name, convert_tensor(info, tp, imatrix_for(tp), plan.flavor))
            if journal is not None:
                journal.record(tp.name)
            per_tensor[tp.name] = time.perf_counter() - ts
            done += tp.nbytes_in
            if progress:
                progress(tp.name, done, total)
        written = writer.bytes_written
    reused = journal.verified if journal is not None else set()
    n_weights = sum(tp.n_elements for tp in plan.tensors if shard_of[tp.name] not in keep and tp.name not in reused)
    return Result(paths, written, time.perf_counter() - t0, n_weights, per_tensor,
                  kept=[p for i, p in enumerate(paths) if i in keep], compile_seconds=compiled.seconds,
                  reused_tensors=len(reused), reused_bytes=journal.reused_bytes if journal is not None else 0,
                  started_over=journal.started_over if journal is not None else None)
