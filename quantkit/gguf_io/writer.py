"""Streaming GGUF writer.

The whole tensor table is known before any data is written (shapes and target types come from the
plan), so the header is written first and tensors are streamed after it one at a time, in table
order; nothing but the tensor in flight is held in memory.

Output goes to a temporary file in the target directory, renamed over the target only when every
shard is complete: an error, Ctrl-C, SIGTERM or SIGHUP leaves no output file behind
(:mod:`quantkit.outputs`).

The data is aligned to what each file's metadata declares (``general.alignment``, 32 without it):
a model read with another alignment keeps it, and readers find every tensor where the header says.

Layout written (gguf.cpp):

    "GGUF" u32 version=3  i64 n_tensors  i64 n_kv
    n_kv × (string key, i32 type, value)
    n_tensors × (string name, u32 n_dims, i64 ne[n_dims], i32 type, u64 offset)
    zero padding to the alignment
    tensor data, each tensor zero-padded to the alignment (the last one too)
"""
from __future__ import annotations

import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import signals
from ..errors import QuantkitError
from ..outputs import AtomicOutput
from ..types import QuantType, tensor_nbytes
from .constants import (DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, KEY_ALIGNMENT, KEY_SPLIT_COUNT,
                        KEY_SPLIT_NO, KEY_SPLIT_TENSORS, SCALAR_DTYPE, SCALAR_FORMAT, SPLIT_KEYS, MetaValue,
                        StringArray, ValueType, pad_to, split_shard_name)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]      # ggml order
    qtype: QuantType

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


_U64 = struct.Struct("<Q")


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(mv: MetaValue) -> bytes:
    if mv.vtype == ValueType.STRING:
        return _pack_string(mv.value)
    if mv.vtype != ValueType.ARRAY:
        return struct.pack(SCALAR_FORMAT[mv.vtype], mv.value)
    head = struct.pack("<iQ", int(mv.elem_type), len(mv.value))
    if mv.elem_type == ValueType.STRING:       # a vocabulary: 100k+ strings, one tight loop
        encoded = mv.value.encoded_if_unchanged() if isinstance(mv.value, StringArray) else None
        if encoded is not None:             # as read from a file, unchanged
            return head + encoded
        pack_len = _U64.pack
        return head + b"".join([pack_len(len(b)) + b for b in [s.encode("utf-8") for s in mv.value]])
    return head + np.asarray(mv.value, dtype=SCALAR_DTYPE[mv.elem_type]).tobytes()


def alignment_of(metadata: dict[str, MetaValue]) -> int:
    """The data alignment a file with this metadata declares (and readers use)."""
    mv = metadata.get(KEY_ALIGNMENT)
    if mv is None:
        return DEFAULT_ALIGNMENT
    if mv.vtype != ValueType.UINT32 or mv.value <= 0 or mv.value & (mv.value - 1):
        raise QuantkitError(f"{KEY_ALIGNMENT} must be a u32 power of two, got {mv.value!r}")
    return int(mv.value)


def encode_header(metadata: dict[str, MetaValue], tensors: list[TensorSpec],
                  alignment: int | None = None) -> tuple[bytes, list[int]]:
    """Header bytes (padded to the alignment) and each tensor's offset in the data section.

    The alignment is the one the metadata declares; ``alignment``, if given, must agree with it
    (readers align by the declared value, so any other would shift every tensor)."""
    declared = alignment_of(metadata)
    if alignment is not None and alignment != declared:
        raise ValueError(f"alignment {alignment} differs from the {declared} the metadata declares")
    alignment = declared
    parts = [GGUF_MAGIC, struct.pack("<Iqq", GGUF_VERSION, len(tensors), len(metadata))]
    for key, mv in metadata.items():
        parts += [_pack_string(key), struct.pack("<i", int(mv.vtype)), _pack_value(mv)]
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        parts += [_pack_string(t.name), struct.pack("<I", len(t.shape)),
                  struct.pack(f"<{len(t.shape)}q", *t.shape), struct.pack("<iQ", int(t.qtype), pos)]
        pos += pad_to(t.nbytes, alignment)
    header = b"".join(parts)
    return header + bytes(pad_to(len(header), alignment) - len(header)), offsets


def encode_shard(metadata: dict[str, MetaValue], tensors: list[TensorSpec]) -> tuple[bytes, int]:
    """A file's header bytes and the size of the whole file."""
    header, offsets = encode_header(metadata, tensors)
    alignment = alignment_of(metadata)
    return header, len(header) + (offsets[-1] + pad_to(tensors[-1].nbytes, alignment) if tensors else 0)


def _as_bytes(chunk) -> memoryview:
    if isinstance(chunk, np.ndarray):
        chunk = np.ascontiguousarray(chunk)
    return memoryview(chunk).cast("B")


class GGUFWriter:
    """Writes one or more shards; feed tensors in table order with :meth:`write_tensor` or
    :meth:`write_tensor_parts`.

    ``shards`` is a list of (metadata, tensor specs) per output file; use :func:`plan_shards` to cut
    a model into shards.  ``workers``: threads that write (and make, for write_tensor_parts).  Use as
    a context manager: leaving the block without an exception commits the output, any exception
    removes it.

    Every write is a pwrite at a position known from the header, so helper threads can write
    pieces of a tensor in any order.

    ``keep``: indexes of shards that are not written (``--partial-requant`` keeps them as they
    are): their tensors are not fed.  ``commit_each``: rename each shard into place as soon as it
    is complete, not all of them at the end, so that an interrupted run leaves whole shards.
    ``output``: the AtomicOutput the shards are opened in; with ``resumable``, each shard is its
    resumable partial (quantize --resume: kept after an error, see :mod:`quantkit.resume`), and
    :meth:`skip_tensor` passes over a tensor it already holds.
    """

    def __init__(self, paths: list[Path], shards: list[tuple[dict[str, MetaValue], list[TensorSpec]]],
                 workers: int = 1, keep=frozenset(), commit_each: bool = False,
                 output: AtomicOutput | None = None, resumable: bool = False):
        if len(paths) != len(shards):
            raise ValueError("one path per shard")
        self.paths, self.shards = [Path(p) for p in paths], shards
        self.alignment = DEFAULT_ALIGNMENT      # of the shard being written
        self.workers = max(1, workers)
        self.keep, self.commit_each = frozenset(keep), commit_each
        self._order = [(i, t) for i, (_, specs) in enumerate(shards) if i not in self.keep for t in specs]
        self._next = 0
        self._out = output if output is not None else AtomicOutput()
        self.resumable = resumable
        self._fh = None
        self._pos = 0               # where the next tensor starts in the current shard
        self._shard = -1
        self._pool = None
        self.bytes_written = 0

    def __enter__(self):
        try:
            first = self._next_shard(-1)
            if first is not None:
                self._open_shard(first)
        except BaseException:
            self._out.discard()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                if self._next != len(self._order):
                    missing = self._order[self._next][1].name
                    raise QuantkitError(f"internal error: tensor '{missing}' was never written")
                self._close_shard()
                while (i := self._next_shard(self._shard)) is not None:     # shards without tensors
                    self._open_shard(i)
                    self._close_shard()
                self._out.commit()
                return False
        except BaseException:
            self._close_fh()
            self._out.discard()
            raise
        self._close_fh()
        self._out.discard()
        return False

    def _close_fh(self):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _next_shard(self, after: int) -> int | None:
        return next((i for i in range(after + 1, len(self.shards)) if i not in self.keep), None)

    def _open_shard(self, i: int) -> None:
        self._shard = i
        meta, specs = self.shards[i]
        self.alignment = alignment_of(meta)
        header, size = encode_shard(meta, specs)
        self._fh = self._out.open(self.paths[i], resumable=self.resumable)
        self._fh.reserve(size)
        self._fh.pwrite(header, 0)
        self._pos = len(header)
        self.bytes_written += len(header)

    def _close_shard(self) -> None:
        # no fsync: like llama-quantize we leave durability to the OS; the rename at the end still
        # guarantees that no partial file ever carries the output's name
        was_open = self._fh is not None
        self._close_fh()
        if was_open and self.commit_each:
            self._out.commit()

    def _begin(self, name: str) -> TensorSpec:
        """The spec of the next tensor, which must be ``name``; opens its shard."""
        if self._next >= len(self._order):
            raise ValueError(f"tensor '{name}' is not in the table")
        shard, spec = self._order[self._next]
        if spec.name != name:
            raise ValueError(f"expected tensor '{spec.name}', got '{name}'")
        while shard != self._shard:
            self._close_shard()
            self._open_shard(self._next_shard(self._shard))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="gguf-writer")
        return spec

    def _finish(self, spec: TensorSpec, n: int) -> None:
        if n != spec.nbytes:
            raise QuantkitError(f"internal error: tensor '{spec.name}' produced {n} bytes, "
                                f"expected {spec.nbytes}")
        pad = pad_to(n, self.alignment) - n
        if pad:
            self._fh.pwrite(bytes(pad), self._pos + n)
        self._pos += n + pad
        self.bytes_written += n + pad
        self._next += 1

    def skip_tensor(self, name: str) -> None:
        """Pass over the next tensor: its bytes are already in place (a resumable partial's)."""
        spec = self._begin(name)
        self._finish(spec, spec.nbytes)

    def write_tensor(self, name: str, chunks) -> None:
        """Write the next tensor; ``chunks`` is one array/bytes or an iterable of them, in order."""
        spec = self._begin(name)
        if isinstance(chunks, (bytes, bytearray, memoryview, np.ndarray)):
            chunks = (chunks,)
        fh, n = self._fh, 0
        # Chunk k is written by a helper thread while the producer computes chunk k+1, so a
        # producer that reuses buffers needs two of them, taking turns: when it is asked for chunk
        # k+2, the write of chunk k has finished.
        pending = None
        try:
            for chunk in chunks:
                buf = _as_bytes(chunk)
                if pending is not None:
                    pending.result()
                pending = self._pool.submit(fh.pwrite, buf, self._pos + n)
                n += buf.nbytes
        finally:
            if pending is not None:
                pending.result()
        self._finish(spec, n)

    def write_tensor_parts(self, name: str, parts) -> None:
        """Write the next tensor from parts that the worker threads make side by side.

        ``parts`` yields (nbytes, make) in order; ``make()`` returns the part's nbytes bytes.  The
        thread that made a part writes it at its place before it makes another, so ``make`` may
        return a buffer of its own thread that the next part on that thread reuses.  A few parts
        per worker are queued, never more: memory stays bounded whatever the tensor's size."""
        spec = self._begin(name)
        fh, n = self._fh, 0
        pending = deque()
        try:
            for nbytes, make in parts:
                signals.check()
                if len(pending) >= 2 * self.workers:
                    pending.popleft().result()
                pending.append(self._pool.submit(self._make_and_write, fh, make, nbytes, self._pos + n))
                n += nbytes
            while pending:
                pending.popleft().result()
        finally:
            for f in pending:       # after an error: nothing more is started, running parts end
                f.cancel()
        self._finish(spec, n)

    @staticmethod
    def _make_and_write(fh, make, nbytes: int, pos: int) -> None:
        buf = _as_bytes(make())
        if buf.nbytes != nbytes:
            raise QuantkitError(f"internal error: a part made {buf.nbytes} bytes, expected {nbytes}")
        fh.pwrite(buf, pos)


def plan_shards(metadata: dict[str, MetaValue], tensors: list[TensorSpec], max_bytes: int | None = None,
                groups: list[int] | None = None) -> list[tuple[dict[str, MetaValue], list[TensorSpec]]]:
    """Cut a tensor list into shards, gguf-split style.

    ``max_bytes``: start a new shard when the next tensor would push the shard's data past it (a
    tensor is never split; a tensor larger than the limit gets a shard of its own).
    ``groups``: explicit shard index per tensor (``--keep-split``).
    The first shard holds all metadata plus ``split.*``; the others hold only ``split.*`` (and
    ``general.alignment`` where the model declares one, so that every shard is aligned alike).
    """
    base = {k: v for k, v in metadata.items() if k not in SPLIT_KEYS}
    alignment = alignment_of(base)
    if groups is None:
        groups, shard, used = [], 0, 0
        for t in tensors:
            size = pad_to(t.nbytes, alignment)
            if max_bytes is not None and used and used + size > max_bytes:
                shard, used = shard + 1, 0
            groups.append(shard)
            used += size
    n_shards = (max(groups) + 1) if groups else 1
    if n_shards == 1:
        return [(base, list(tensors))]
    per_shard: list[list[TensorSpec]] = [[] for _ in range(n_shards)]
    for g, t in zip(groups, tensors):
        per_shard[g].append(t)
    out = []
    for i, specs in enumerate(per_shard):
        split = {KEY_SPLIT_NO: MetaValue(ValueType.UINT16, i),
                 KEY_SPLIT_COUNT: MetaValue(ValueType.UINT16, n_shards),
                 KEY_SPLIT_TENSORS: MetaValue(ValueType.INT32, len(tensors))}
        if i > 0 and KEY_ALIGNMENT in base:
            split[KEY_ALIGNMENT] = base[KEY_ALIGNMENT]
        # the first shard: split.* where the metadata has them (llama-quantize --keep-split sets
        # them in place), else after it
        out.append(({**metadata, **split} if i == 0 else split, specs))
    return out


def shard_paths(out: Path, n_shards: int) -> list[Path]:
    out = Path(out)
    if n_shards == 1:
        return [out]
    prefix = out.name[:-5] if out.name.endswith(".gguf") else out.name
    return [out.with_name(split_shard_name(prefix, i, n_shards)) for i in range(n_shards)]
