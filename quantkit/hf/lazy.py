"""Output tensors built lazily from checkpoint tensors, a few rows at a time.

A converted tensor is rarely a checkpoint tensor as stored: llama's q/k rows are permuted, experts
are stacked into one 3-D tensor, DeepSeek's ``kv_b_proj`` is cut per head and half of it
transposed, float8 weights are scaled. Each class here describes one such rule and produces any
range of the output's rows on demand, in the output's storage dtype, reading only the checkpoint
rows it needs from the memory maps. :class:`LazySource` then serves byte ranges of it to the
quantize pipeline, exactly as a GGUF file's memory map would.

Rows are ggml rows: ``shape[0]`` (the row length) is the checkpoint's last dimension, and a 3-D
tensor's rows run expert by expert.
"""
from __future__ import annotations

import numpy as np

from ..types import QuantType
from .. import formats
from ..kernels.floats import fp8_blocks_to_bf16_rows
from .numerics import E4M3FN, block_scales
from .safetensors import SafeTensor

STORAGE_DTYPE = {QuantType.F32: np.dtype("<f4"), QuantType.F16: np.dtype("<f2"), QuantType.BF16: np.dtype("<u2")}


class Lazy:
    """``qtype`` (F32/F16/BF16), ``n_rows``, ``n_per_row``; ``take(index)``: those rows."""
    qtype: QuantType
    n_rows: int
    n_per_row: int

    def take(self, index: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.take(np.arange(start, stop))

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row, self.n_rows)


class Constant(Lazy):
    """A 1-D float32 tensor the converter computes (llama 3's rope factors)."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, np.float32).reshape(1, -1)
        self.qtype, self.n_rows, self.n_per_row = QuantType.F32, 1, self.values.shape[1]

    def take(self, index: np.ndarray) -> np.ndarray:
        return self.values[np.asarray(index)]

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row,)


class Stored(Lazy):
    """A checkpoint tensor as it is (2-D, or 1-D as one row): float8 with its block scales becomes
    BF16, and ``as_f32`` stores it as F32 (the converter's rule for 1-D tensors and a few others)."""

    def __init__(self, t: SafeTensor, scale_inv: SafeTensor | None = None, as_f32: bool = False):
        self.t, self.scale_inv = t, scale_inv
        # the scale grid is small (one float per 128 x 128 block): read once
        self.scale_grid = None if scale_inv is None else block_scales(scale_inv.dtype, scale_inv.data).reshape(
            scale_inv.shape[0], -1)
        self.n_rows, self.n_per_row = t.matrix().shape
        self.as_f32 = as_f32
        stored = {"F32": QuantType.F32, "F16": QuantType.F16, "BF16": QuantType.BF16, "F8_E4M3": QuantType.BF16}
        self.qtype = QuantType.F32 if as_f32 else stored[t.dtype]

    def take(self, index: np.ndarray) -> np.ndarray:
        # read the span the rows lie in (with pread: touching the map would leave its pages counted
        # in this process's memory) and pick the rows from it; gathers (q/k permutation, value band)
        # ask for rows close together
        index = np.asarray(index)
        if not len(index):
            return np.empty((0, self.n_per_row), STORAGE_DTYPE[self.qtype])
        lo, hi = int(index.min()), int(index.max()) + 1
        raw = self.t.read_rows(lo, hi)
        if hi - lo != len(index) or index[0] != lo or not bool(np.all(np.diff(index) == 1)):
            raw = raw[index - lo]
        if self.t.dtype == "F8_E4M3":
            bf16 = np.empty(raw.shape, np.uint16)
            fp8_blocks_to_bf16_rows(np.ascontiguousarray(raw), self.scale_grid, index, E4M3FN, bf16)
            raw = bf16
        if not self.as_f32:
            return np.ascontiguousarray(raw)
        if self.t.dtype in ("BF16", "F8_E4M3"):
            return formats.dequantize(np.ascontiguousarray(raw).view(np.uint8), QuantType.BF16, self.n_per_row)
        return np.asarray(raw, dtype=np.float32)

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row,) if len(self.t.shape) == 1 else (self.n_per_row, self.n_rows)


class Gathered(Lazy):
    """Rows of another lazy tensor in another order: ``out row r = src row index[r]``."""

    def __init__(self, src: Lazy, index: np.ndarray):
        self.src, self.index = src, np.asarray(index, dtype=np.int64)
        self.qtype, self.n_rows, self.n_per_row = src.qtype, len(self.index), src.n_per_row

    def take(self, index: np.ndarray) -> np.ndarray:
        return self.src.take(self.index[np.asarray(index)])


class Stacked(Lazy):
    """Equal-shaped tensors one after the other: the 3-D ``ffn_*_exps`` tensor of a layer's experts."""

    def __init__(self, parts: list[Lazy]):
        self.parts = parts
        first = parts[0]
        self.rows_each, self.n_per_row, self.qtype = first.n_rows, first.n_per_row, first.qtype
        self.n_rows = self.rows_each * len(parts)

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        out = np.empty((len(index), self.n_per_row), STORAGE_DTYPE[self.qtype])
        part = index // self.rows_each
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p].take(index[sel] - p * self.rows_each)
        return out

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row, self.rows_each, len(self.parts))


class HeadsTransposed(Lazy):
    """Per head, a band of ``band`` rows starting ``band_start`` rows into the head's ``head_rows``,
    transposed: DeepSeek's ``attn_k_b`` is kv_b_proj's key band of each head, turned so that its
    rows run over the latent dimension.  Output rows: head h's ``src.n_per_row`` rows, each of
    length ``band``."""

    def __init__(self, src: Lazy, n_head: int, head_rows: int, band_start: int, band: int):
        self.src, self.n_head, self.head_rows, self.band_start, self.band = src, n_head, head_rows, band_start, band
        self.qtype, self.n_per_row = src.qtype, band
        self.n_rows = n_head * src.n_per_row

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        cols = self.src.n_per_row
        out = np.empty((len(index), self.band), STORAGE_DTYPE[self.qtype])
        head = index // cols
        for h in np.unique(head):
            sel = head == h
            start = h * self.head_rows + self.band_start
            block = self.src.rows(start, start + self.band)          # (band, cols)
            out[sel] = block.T[index[sel] - h * cols]
        return out

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.band, self.src.n_per_row, self.n_head)


class LazySource:
    """Byte ranges of one lazy tensor's stored data, as :class:`GGUFFile` serves its map: the
    quantize pipeline reads any tensor through ``read``/``view`` with offsets from 0."""

    def __init__(self, lazy: Lazy):
        self.lazy = lazy
        self.row_size = lazy.n_per_row * STORAGE_DTYPE[lazy.qtype].itemsize

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        first, last = offset // self.row_size, -(-(offset + nbytes) // self.row_size)
        data = self.lazy.rows(first, last).view(np.uint8).reshape(-1)
        skip = offset - first * self.row_size
        return data[skip:skip + nbytes]

    def read(self, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        data = self.view(offset, nbytes)
        if out is None:
            return np.array(data, copy=True)
        buf = out.reshape(-1)[:nbytes]
        buf[:] = data
        return buf
