"""Memory-mapped GGUF reader with zero-copy tensor views.

Validates what the C loader validates and reports the first problem as a GGUFFormatError naming
the file and the byte offset.  Split models (``*-00001-of-0000N.gguf``) are read as one model by
:func:`open_model`.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GGUFFormatError, QuantkitError
from ..inputs import open_regular
from ..types import QuantType, is_known_type_id, traits
from .constants import (DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_ALIGNMENT, KEY_ARCHITECTURE, KEY_SPLIT_COUNT, KEY_SPLIT_NO,
                        KEY_SPLIT_TENSORS, MAX_DIMS, MAX_NAME_BYTES, SCALAR_DTYPE, SCALAR_FORMAT,
                        SCALAR_SIZE, SPLIT_KEYS, SPLIT_NAME_RE, MetaValue, StringArray, ValueType,
                        pad_to, split_shard_name)

_INT64_MAX = 2**63 - 1


@dataclass
class TensorInfo:
    """One tensor of a GGUF file.  ``shape`` is in ggml order: shape[0] is the row length."""
    name: str
    shape: tuple[int, ...]
    qtype: QuantType
    offset: int                 # absolute byte offset of the data in ``source``
    nbytes: int
    source: "GGUFFile" = field(repr=False)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def n_per_row(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def n_dims(self) -> int:
        return len(self.shape)

    def raw(self) -> np.ndarray:
        """Zero-copy uint8 view (n_rows, row_size) of the stored bytes."""
        row_size = traits(self.qtype).row_size(self.shape[0])
        return self.source.view(self.offset, self.nbytes).reshape(self.n_rows, row_size)


_U64 = struct.Struct("<Q")


# arrays of arrays: deeper ones are refused (each level is a Python call)
MAX_ARRAY_DEPTH = 8


class _Cursor:
    """Sequential little-endian reader over a buffer that raises GGUFFormatError past its end.

    ``nested_arrays``: read arrays of arrays (gguf-py writes them; the C loaders refuse or abort on
    them, so only ``inspect`` asks for them)."""

    def __init__(self, buf, path, nested_arrays: bool = False):
        self.buf, self.path, self.pos = buf, path, 0
        self.nested_arrays = nested_arrays

    def fail(self, msg: str, at: int | None = None):
        raise GGUFFormatError(self.path, self.pos if at is None else at, msg)

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            self.fail(f"truncated file: {what} needs {n} bytes, file ends at {len(self.buf)}")
        self.pos += n
        return start

    def scalar(self, vtype: ValueType, what: str):
        start = self.take(SCALAR_SIZE[vtype], what)
        return struct.unpack_from(SCALAR_FORMAT[vtype], self.buf, start)[0]

    def u32(self, what): return self.scalar(ValueType.UINT32, what)
    def i32(self, what): return self.scalar(ValueType.INT32, what)
    def u64(self, what): return self.scalar(ValueType.UINT64, what)
    def i64(self, what): return self.scalar(ValueType.INT64, what)

    def string(self, what: str) -> str:
        at = self.pos
        n = self.u64(f"{what} length")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8", at)

    def strings(self, n: int, what: str) -> StringArray:
        """n strings in a row (a vocabulary: 100k+ of them, so one tight loop, not n string() calls;
        its bounds and UTF-8 failures are told apart once the loop stops), with their bytes."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), [None] * n
        first = pos
        unpack_len = _U64.unpack_from
        i, at = 0, pos
        try:
            for i in range(n):
                at = pos
                pos += 8
                stop = pos + unpack_len(buf, at)[0]     # struct.error: the length runs past the end
                if stop > end:
                    break
                out[i] = str(buf[pos:stop], "utf-8")
                pos = stop
            else:
                self.pos = pos
                return StringArray(out, bytes(buf[first:pos]))
        except struct.error:
            pass
        except UnicodeDecodeError:
            self.fail(f"{what}[{i}] is not valid UTF-8", at)
        self.pos = at
        self.fail(f"truncated file: {what}[{i}] runs past the end of the file ({end} bytes)")

    def value(self, vtype: int, what: str, depth: int = 0) -> MetaValue:
        at = self.pos
        try:
            vtype = ValueType(vtype)
        except ValueError:
            self.fail(f"{what}: unknown value type {vtype}", at)
        if vtype == ValueType.STRING:
            return MetaValue(vtype, self.string(what))
        if vtype != ValueType.ARRAY:
            return MetaValue(vtype, self.scalar(vtype, what))
        elem = self.i32(f"{what} array type")
        n = self.u64(f"{what} array length")
        try:
            elem = ValueType(elem)
        except ValueError:
            self.fail(f"{what}: unknown array element type {elem}", at)
        if elem == ValueType.ARRAY:
            if not self.nested_arrays:
                self.fail(f"{what}: nested arrays are not supported (llama.cpp cannot load them either)", at)
            if depth + 1 >= MAX_ARRAY_DEPTH:
                self.fail(f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep", at)
            if n > (len(self.buf) - self.pos) // 12:    # each array takes at least its type and length
                self.fail(f"truncated file: {what} claims {n} arrays, the rest of the file holds at most "
                          f"{(len(self.buf) - self.pos) // 12}")
            items = [self.value(ValueType.ARRAY, f"{what}[{i}]", depth + 1) for i in range(n)]
            return MetaValue(vtype, items, elem)
        if elem == ValueType.STRING:
            if n > (len(self.buf) - self.pos) // 8:     # each string takes at least its 8-byte length
                self.fail(f"truncated file: {what} claims {n} strings, the rest of the file holds at most "
                          f"{(len(self.buf) - self.pos) // 8}")
            return MetaValue(vtype, self.strings(n, what), elem)
        size = SCALAR_SIZE[elem]
        if n > len(self.buf):
            self.fail(f"truncated file: {what} claims {n} elements")
        start = self.take(n * size, what)
        arr = np.frombuffer(self.buf, dtype=SCALAR_DTYPE[elem], count=n, offset=start).copy()
        return MetaValue(vtype, arr, elem)


class GGUFFile:
    """One GGUF file, memory-mapped read-only."""

    read_ahead = True       # read() is a pread, safe beside the quantizer (quantize.ReadAhead)

    def __init__(self, path: str | os.PathLike, nested_arrays: bool = False):
        self.path = Path(path)
        self.nested_arrays = nested_arrays
        self._fh = open_regular(self.path)
        size = os.fstat(self._fh.fileno()).st_size
        if size == 0:
            self._fh.close()
            raise GGUFFormatError(self.path, 0, "empty file, not a GGUF model")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self.metadata: dict[str, MetaValue] = {}
        self.tensors: list[TensorInfo] = []
        try:
            self._parse()
        except Exception:
            self.close()
            raise

    # ---- parsing ----
    def _parse(self) -> None:
        c = _Cursor(self._mm, self.path, self.nested_arrays)
        start = c.take(4, "magic")
        if bytes(self._mm[start:start + 4]) != GGUF_MAGIC:
            c.fail(f"bad magic {bytes(self._mm[start:start + 4])!r}, not a GGUF file", 0)
        self.version = c.u32("version")
        if self.version & 0xFFFF == 0:
            c.fail(f"version {self.version:#x}: big-endian files are not supported", 4)
        if self.version not in (2, 3):
            c.fail(f"unsupported GGUF version {self.version} (supported: 2, 3)", 4)
        n_tensors = c.i64("tensor count")
        n_kv = c.i64("metadata count")
        if n_tensors < 0 or n_kv < 0 or n_tensors > self.file_size or n_kv > self.file_size:
            c.fail(f"implausible counts: {n_tensors} tensors, {n_kv} metadata entries", 8)

        for i in range(n_kv):
            at = c.pos
            key = c.string(f"metadata key #{i}")
            if not key:
                c.fail("empty metadata key", at)
            if key in self.metadata:
                c.fail(f"duplicate metadata key '{key}'", at)
            vtype = c.i32(f"type of '{key}'")
            self.metadata[key] = c.value(vtype, f"value of '{key}'")

        self.alignment = DEFAULT_ALIGNMENT
        if KEY_ALIGNMENT in self.metadata:
            al = self.metadata[KEY_ALIGNMENT]
            if al.vtype != ValueType.UINT32 or al.value == 0 or al.value & (al.value - 1):
                c.fail(f"{KEY_ALIGNMENT} must be a u32 power of two, got {al.value!r}")
            self.alignment = al.value

        infos = []
        names = set()
        for i in range(n_tensors):
            at = c.pos
            name = c.string(f"tensor #{i} name")
            if not name:
                c.fail(f"tensor #{i} has an empty name", at)
            if name in names:
                c.fail(f"duplicate tensor name '{name}'", at)
            names.add(name)
            if len(name.encode()) > MAX_NAME_BYTES:
                c.fail(f"tensor name '{name}' is longer than {MAX_NAME_BYTES} bytes", at)
            n_dims = c.u32(f"'{name}' n_dims")
            if n_dims > MAX_DIMS:
                c.fail(f"tensor '{name}' has {n_dims} dimensions (at most {MAX_DIMS})", at)
            # ggml keeps four dimensions, 1 past n_dims, and writes a tensor back with at least one
            # (ggml_n_dims): a 0-dimensional tensor is one element, shape [1]
            shape = tuple(c.i64(f"'{name}' shape") for _ in range(n_dims)) or (1,)
            type_at = c.pos
            type_id = c.i32(f"'{name}' type")
            offset = c.u64(f"'{name}' offset")
            if any(n < 0 for n in shape):
                c.fail(f"tensor '{name}' has a negative dimension {list(shape)}", at)
            if 0 in shape:      # ik_llama.cpp's loader asserts every dimension > 0 (gguf_tensor_info_sanitize)
                c.fail(f"tensor '{name}' has a zero dimension {list(shape)} (ggml needs every dimension > 0)", at)
            n_elem = 1
            for n in shape:
                n_elem *= n
            if n_elem > _INT64_MAX:
                c.fail(f"tensor '{name}' shape {list(shape)} overflows", at)
            if not is_known_type_id(type_id):
                c.fail(f"tensor '{name}' has unknown type id {type_id}", type_at)
            t = traits(type_id)
            if shape[0] % t.block_size:
                c.fail(f"tensor '{name}': row size {shape[0]} is not a multiple of {t.name} "
                       f"block size {t.block_size}", at)
            nbytes = n_elem // shape[0] * t.row_size(shape[0])
            if nbytes > _INT64_MAX:
                c.fail(f"tensor '{name}' shape {list(shape)} overflows", at)
            infos.append((at, name, shape, QuantType(type_id), offset, nbytes))

        self.data_offset = pad_to(c.pos, self.alignment)
        for at, name, shape, qtype, offset, nbytes in infos:
            if offset % self.alignment:
                c.fail(f"tensor '{name}' offset {offset} is not a multiple of the alignment "
                       f"{self.alignment}", at)
            abs_off = self.data_offset + offset
            if abs_off + nbytes > self.file_size:
                c.fail(f"tensor '{name}' data ({nbytes} bytes at {abs_off}) extends past the end of "
                       f"the file ({self.file_size} bytes): truncated or corrupt file", at)
            self.tensors.append(TensorInfo(name, shape, qtype, abs_off, nbytes, self))
        # overlapping tensors mean a corrupt tensor table
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors if t.nbytes)
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                c.fail(f"tensors '{an}' and '{bn}' overlap", b0)

    # ---- access ----
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=offset)

    def read(self, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """A private copy of a byte range, read with pread (into ``out``'s first bytes if given:
        streaming loops reuse one buffer, whose pages are then already mapped).

        Streaming code uses this rather than the map: one bulk copy from the page cache is much
        cheaper than a page fault per 4 KiB page, and nothing stays resident afterwards.
        """
        buf = np.empty(nbytes, dtype=np.uint8) if out is None else out.reshape(-1)[:nbytes]
        view, done = memoryview(buf), 0
        while done < nbytes:
            n = os.preadv(self._fh.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise GGUFFormatError(self.path, offset + done, "unexpected end of file while reading")
            done += n
        return buf

    def get(self, key: str, default=None):
        mv = self.metadata.get(key)
        return default if mv is None else mv.to_python()

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:     # a caller still holds a view; the map closes when it is freed
                pass
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ModelView:
    """What the tools read of a model: ``metadata`` ({key: MetaValue}), ``tensors`` and ``by_name``
    (TensorInfo), ``close()``; subclasses fill them in (GGUF files here, Hugging Face checkpoints
    in :mod:`quantkit.hf`)."""
    metadata: dict
    tensors: list
    by_name: dict

    @property
    def architecture(self) -> str | None:
        return self.get(KEY_ARCHITECTURE)

    def get(self, key: str, default=None):
        mv = self.metadata.get(key)
        return default if mv is None else mv.to_python()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GGUFModel(ModelView):
    """A model stored in one GGUF file or in split shards, read as one.

    ``metadata`` is the first shard's metadata without the ``split.*`` keys; ``tensors`` lists the
    tensors of all shards in shard order.
    """

    def __init__(self, files: list[GGUFFile]):
        self.files = files
        self.path = files[0].path
        self.metadata = {k: v for k, v in files[0].metadata.items() if k not in SPLIT_KEYS}
        self.tensors: list[TensorInfo] = [t for f in files for t in f.tensors]
        seen = set()
        for t in self.tensors:
            if t.name in seen:
                raise GGUFFormatError(t.source.path, t.offset, f"tensor '{t.name}' appears in two shards")
            seen.add(t.name)
        self.by_name = {t.name: t for t in self.tensors}

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()


def open_model(path: str | os.PathLike, nested_arrays: bool = False) -> GGUFModel:
    """Open a GGUF model; a path named like ``x-00001-of-00003.gguf`` opens all its shards.
    ``nested_arrays``: read arrays of arrays (for ``inspect``) rather than refuse them."""
    path = Path(path)
    if not path.exists():
        raise QuantkitError(f"{path}: no such file")
    m = SPLIT_NAME_RE.match(path.name)
    if not m:
        f = GGUFFile(path, nested_arrays)
        try:
            if _split_key(f, KEY_SPLIT_COUNT, 1) > 1:
                raise QuantkitError(f"{path}: is shard of a split model but not named "
                                    "<prefix>-0000N-of-0000M.gguf")
        except BaseException:
            f.close()
            raise
        return GGUFModel([f])
    prefix, count = m["prefix"], int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise QuantkitError(f"{path}: not a shard name (shard {int(m['no'])} of {count})")
    if int(m["no"]) != 1:
        raise QuantkitError(f"{path}: open the first shard (-00001-of-{count:05d}.gguf) of a split model")
    files: list[GGUFFile] = []
    try:
        for i in range(count):
            shard = path.with_name(split_shard_name(prefix, i, count))
            if not shard.exists():
                raise QuantkitError(f"{shard}: missing shard {i + 1} of {count}")
            files.append(GGUFFile(shard, nested_arrays))
        _check_shards_belong_together(files)
        return GGUFModel(files)
    except BaseException:
        for f in files:
            f.close()
        raise


def _split_key(f: GGUFFile, key: str, default=None):
    """An integer ``split.*`` value of one shard (``default`` when the key is absent)."""
    mv = f.metadata.get(key)
    if mv is None:
        return default
    if mv.vtype in (ValueType.STRING, ValueType.ARRAY, ValueType.BOOL, ValueType.FLOAT32, ValueType.FLOAT64):
        raise GGUFFormatError(f.path, None, f"{key} is a {mv.vtype.name.lower()}, expected an integer")
    return int(mv.value)


# keys each file of a set holds for itself: the others must agree between shards
_PER_FILE_KEYS = SPLIT_KEYS + (KEY_ALIGNMENT,)


def _check_shards_belong_together(files: list[GGUFFile]) -> None:
    """The shards named ``-0000i-of-0000N`` are the N parts of one model, as llama.cpp's loader and
    gguf-split would read them (shard i says split.no i, all say split.count N and the same
    split.tensors.count, which is the number of tensors they hold together; a tensor is in one shard
    only), and none comes from another model: a key that a later shard carries besides ``split.*``
    (llama.cpp's tools write the metadata into the first shard only) has the first shard's value.

    A shard of another model with the same split layout and tensor names cannot be told apart by
    its container; the runtime checks every tensor's shape against the first shard's metadata."""
    count = len(files)
    first = files[0]
    total = _split_key(first, KEY_SPLIT_TENSORS)
    if count > 1 and total is None:
        raise GGUFFormatError(first.path, None, f"has no {KEY_SPLIT_TENSORS} (llama.cpp needs it to load a split "
                              "model)")
    for i, f in enumerate(files):
        n_split, no = _split_key(f, KEY_SPLIT_COUNT), _split_key(f, KEY_SPLIT_NO)
        if count == 1 and n_split is None:
            break           # x-00001-of-00001.gguf written without split keys: a single file
        if n_split != count:
            said = "no split.count" if n_split is None else f"split.count {n_split}"
            raise GGUFFormatError(f.path, None, f"shard {i + 1} of {count} has {said}: not a shard of this set "
                                  f"(another model's file?)")
        if no != i:
            said = "no split.no" if no is None else f"split.no {no}"
            raise GGUFFormatError(f.path, None, f"shard {i + 1} of {count} has {said}, expected {i}: not a shard "
                                  "of this set (another model's file, or shards renamed?)")
        tensors = _split_key(f, KEY_SPLIT_TENSORS, total)
        if tensors != total:
            raise GGUFFormatError(f.path, None, f"shard {i + 1} of {count} says the model has {tensors} tensors, "
                                  f"shard 1 says {total}: the shards come from different models")
        for key, mv in f.metadata.items():
            ref = first.metadata.get(key)
            if i and key not in _PER_FILE_KEYS and ref is not None and not _same_value(mv, ref):
                raise GGUFFormatError(f.path, None, f"shard {i + 1} of {count} has another {key} than shard 1: "
                                      "the shards come from different models")
    n = sum(len(f.tensors) for f in files)
    if total is not None and total != n:
        raise GGUFFormatError(first.path, None, f"split.tensors.count is {total} but the {count} shards hold {n}")


def _same_value(a: MetaValue, b: MetaValue) -> bool:
    if a.vtype != b.vtype or a.elem_type != b.elem_type:
        return False
    if isinstance(a.value, np.ndarray):
        return bool(np.array_equal(a.value, b.value))
    if a.elem_type == ValueType.ARRAY:
        return len(a.value) == len(b.value) and all(_same_value(x, y) for x, y in zip(a.value, b.value))
    return a.value == b.value
