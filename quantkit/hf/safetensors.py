"""Memory-mapped safetensors reader: a Hugging Face checkpoint's tensors, row by row.

A safetensors file is::

    u64 little-endian  header length N
    N bytes            JSON: {"name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [b, e]},
                              ..., "__metadata__": {...}}
    data               each tensor row-major (C order) at data_offsets relative to the data start

Our own parser rather than the ``safetensors`` package: that package's numpy interface cannot
return bfloat16 or float8, which are exactly what the checkpoints we read are stored in; here a
tensor is a zero-copy numpy view of the map with the raw element bits (uint16 for BF16, uint8 for
F8_E4M3), decoded by the caller a few rows at a time.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QuantkitError
from ..inputs import open_regular
from .config import Fields, describe, parse_json

# dtype name -> numpy dtype of the stored bits (the element types of safetensors' reference reader
# that take whole bytes)
STORED_DTYPE = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"), "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("u1"), "F8_E5M2": np.dtype("u1"), "F8_E8M0": np.dtype("u1"),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass
class SafeTensor:
    """One stored tensor: ``shape`` in HF (row-major) order, ``data`` its raw element bits."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    data: np.ndarray = field(repr=False)
    fd: int = field(default=-1, repr=False)     # the file, for pread
    offset: int = 0                             # absolute byte offset of the data in it

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def matrix(self) -> np.ndarray:
        """The data as 2-D (rows, cols): a 1-D tensor is one row, higher dimensions fold into rows."""
        cols = self.shape[-1] if self.shape else 1
        return self.data.reshape(-1, cols)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows of :meth:`matrix` as a private copy, read with pread: a bulk copy from the page cache
        leaves nothing of the file resident in this process, so streaming a checkpoint of any size
        costs only the rows in flight."""
        m = self.matrix()
        buf = np.empty((stop - start, m.shape[1]), m.dtype)
        row_bytes = m.shape[1] * m.dtype.itemsize
        view, done, total, at = memoryview(buf.reshape(-1).view(np.uint8)), 0, buf.nbytes, self.offset + start * row_bytes
        while done < total:
            n = os.preadv(self.fd, [view[done:]], at + done)
            if n <= 0:
                raise QuantkitError(f"{self.path}: unexpected end of file while reading '{self.name}'")
            done += n
        return buf


class SafetensorsFile:
    """One safetensors file, validated as safetensors' own reader validates it: a JSON object header
    of at most 100 MB; each entry a known dtype, a shape of non-negative integers and two data
    offsets that hold exactly that shape; the entries' data laid end to end, from the start of the
    data section to the end of the file (no gap, no overlap); ``__metadata__`` strings only."""

    def __init__(self, path: Path):
        self.path, self._mm, self.tensors = path, None, {}
        self._fh = open_regular(path)
        try:
            self._read()
        except BaseException:
            self.close()
            raise

    def _fail(self, msg: str):
        raise QuantkitError(f"{self.path}: {msg}")

    def _read(self) -> None:
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            self._fail("not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", self._fh.read(8))
        if n > MAX_HEADER_BYTES:
            self._fail(f"not a safetensors file (its header length is over the {MAX_HEADER_BYTES >> 20} MiB limit)")
        if n > size - 8:
            self._fail(f"not a safetensors file (its header length runs past the end of the file, {size} bytes)")
        raw = self._fh.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            self._fail("not a safetensors file (its header is not UTF-8 text)")
        header = parse_json(text, f"{self.path}: safetensors header", lambda pairs: _unique_keys(pairs, self.path))
        if not isinstance(header, dict):
            self._fail(f"safetensors header is {describe(header)}, not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            self._fail("safetensors header's __metadata__ is not an object of strings")
        self.metadata = meta or {}
        data_start, data_size = 8 + n, size - 8 - n
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        spans = []
        for name, entry in header.items():
            dtype, shape, begin, end = self._entry(name, entry, data_size)
            spans.append((begin, end, name))
            item = STORED_DTYPE[dtype]
            count = (end - begin) // item.itemsize
            data = np.frombuffer(self._mm, dtype=item, count=count, offset=data_start + begin) if count else \
                np.empty(0, item)
            self.tensors[name] = SafeTensor(name, dtype, shape, self.path, data.reshape(shape), self._fh.fileno(),
                                            data_start + begin)
        at, last = 0, None
        for begin, end, name in sorted(spans):
            if begin != at:
                self._fail(f"tensor '{name}' data starts at {begin}, " +
                           (f"inside '{last}' (which ends at {at})" if begin < at else
                            f"leaving a gap after {f'{last!r}' if last else 'the header'} (which ends at {at})"))
            at, last = end, name
        if at != data_size:
            self._fail(f"the tensors' data ends at {at} but the file holds {data_size} bytes after the header")

    def _entry(self, name: str, entry, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
        """dtype, shape and data offsets of one header entry, checked against each other and the file."""
        if not isinstance(entry, dict):
            self._fail(f"tensor '{name}' has a header entry that is {describe(entry)}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in STORED_DTYPE:
            self._fail(f"tensor '{name}' has unsupported dtype {describe(dtype)} "
                       f"(known: {', '.join(STORED_DTYPE)})")
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            self._fail(f"tensor '{name}' has shape {describe(shape)}, expected a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            self._fail(f"tensor '{name}' has data_offsets {describe(offsets)}, expected [begin, end]")
        begin, end = offsets
        nbytes = STORED_DTYPE[dtype].itemsize
        for d in shape:
            nbytes *= d
        if not begin <= end <= data_size or end - begin != nbytes:
            self._fail(f"tensor '{name}' ({dtype} {shape}, {nbytes} bytes) has data offsets "
                       f"[{begin}, {end}] that do not fit its shape or the file ({data_size} bytes of data)")
        return dtype, tuple(shape), begin, end

    def close(self) -> None:
        self.tensors = {}
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a view is still alive; the map goes with it
                pass
            self._mm = None
        self._fh.close()


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _unique_keys(pairs: list, path: Path) -> dict:
    """A JSON object whose keys must differ (a repeated tensor name would leave one entry unseen)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise QuantkitError(f"{path}: the safetensors header has '{key}' twice")
        out[key] = value
    return out


def is_plain_file_name(name) -> bool:
    """A file name with no directory part: what an index may name (never a path out of the model
    directory, absolute or through '..')."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def open_checkpoint(directory: Path) -> tuple[dict[str, SafeTensor], list[SafetensorsFile]]:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names (all of them must be there), or else every
    ``*.safetensors`` file in it."""
    index = directory / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        doc = Fields.load(index, "a safetensors index")
        weight_map = doc.object("weight_map").raw
        if not weight_map:
            doc.fail("weight_map", "an object mapping tensor names to shard files")
        for tensor, shard in weight_map.items():
            if not is_plain_file_name(shard):
                raise QuantkitError(f"{index}: weight_map puts '{tensor}' in {describe(shard)}: a shard must be "
                                    "named by a file name in the model directory (no directory part, no '..')")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).exists()]
        if missing:
            raise QuantkitError(f"{directory}: missing shard{'s' if len(missing) > 1 else ''} "
                                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                                f"(named in {index.name})")
        paths = [directory / s for s in shards]
    else:
        paths = sorted(directory.glob("*.safetensors"))
        weight_map = None
        if not paths:
            raise QuantkitError(f"{directory}: no *.safetensors files")
    files, tensors = [], {}
    try:
        for p in paths:
            f = SafetensorsFile(p)
            files.append(f)
            for name, t in f.tensors.items():
                if name in tensors:
                    raise QuantkitError(f"{directory}: tensor '{name}' is in both {tensors[name].path.name} "
                                        f"and {p.name}")
                tensors[name] = t
        if weight_map is not None:
            lost = [n for n, s in weight_map.items() if n not in tensors]
            if lost:
                raise QuantkitError(f"{directory}: tensor '{lost[0]}' is listed in the index under "
                                    f"{weight_map[lost[0]]} but that file does not hold it")
    except BaseException:
        for f in files:
            f.close()
        raise
    return tensors, files
