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

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QuantkitError

# dtype name -> numpy dtype of the stored bits
STORED_DTYPE = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"), "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
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
    def __init__(self, path: Path):
        self.path = path
        try:
            self._fh = open(path, "rb")
        except OSError as e:
            raise QuantkitError(f"{path}: {e.strerror}") from None
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            raise QuantkitError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", self._fh.read(8))
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise QuantkitError(f"{path}: not a safetensors file (header length {n} past the end)")
        try:
            header = json.loads(self._fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise QuantkitError(f"{path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise QuantkitError(f"{path}: safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + n, size - 8 - n
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.tensors: dict[str, SafeTensor] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, data_start, data_size)

    def _entry(self, name: str, entry, data_start: int, data_size: int) -> SafeTensor:
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise QuantkitError(f"{self.path}: tensor '{name}' has a malformed header entry") from None
        if dtype not in STORED_DTYPE:
            raise QuantkitError(f"{self.path}: tensor '{name}' has unsupported dtype {dtype}")
        item = STORED_DTYPE[dtype]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= begin <= end <= data_size or end - begin != count * item.itemsize:
            raise QuantkitError(f"{self.path}: tensor '{name}' ({dtype} {list(shape)}) has data offsets "
                                f"[{begin}, {end}] that do not fit its shape or the file")
        data = np.frombuffer(self._mm, dtype=item, count=count, offset=data_start + begin) if count else \
            np.empty(0, item)
        return SafeTensor(name, dtype, shape, self.path, data.reshape(shape), self._fh.fileno(), data_start + begin)

    def close(self) -> None:
        self.tensors = {}
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a view is still alive; the map goes with it
                pass
            self._mm = None
        self._fh.close()


def open_checkpoint(directory: Path) -> tuple[dict[str, SafeTensor], list[SafetensorsFile]]:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names (all of them must be there), or else every
    ``*.safetensors`` file in it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise QuantkitError(f"{index}: cannot read its weight_map ({e})") from None
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
