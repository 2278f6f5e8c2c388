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

from ..types import REPACKED_TYPE, QuantType, traits
from .. import formats
from ..formats import interleave
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

    exact_types: frozenset = frozenset()        # the types take_exact gives

    def take_exact(self, qtype: QuantType, index: np.ndarray, name: str, row_offset: int = 0) -> np.ndarray | None:
        """The rows as ``qtype`` blocks that decode to exactly the values :meth:`take` gives, where
        the checkpoint stores them so (compressed-tensors int4 as q4_0); None where it does not.
        ``name`` and ``row_offset`` (of these rows in it): the output tensor, for errors."""
        return None

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row, self.n_rows)


def read_rows_at(t: SafeTensor, index: np.ndarray) -> np.ndarray:
    """Rows ``index`` (not empty) of a stored tensor's matrix, raw.  Reads the span they lie in (with
    pread: touching the map would leave its pages counted in this process's memory) and picks the
    rows from it; gathers (q/k permutation, value band) ask for rows close together."""
    lo, hi = int(index.min()), int(index.max()) + 1
    raw = t.read_rows(lo, hi)
    if hi - lo != len(index) or index[0] != lo or not bool(np.all(np.diff(index) == 1)):
        raw = raw[index - lo]
    return raw


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
        index = np.asarray(index)
        if not len(index):
            return np.empty((0, self.n_per_row), STORAGE_DTYPE[self.qtype])
        raw = read_rows_at(self.t, index)
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
        self.exact_types = frozenset.intersection(*(p.exact_types for p in parts))

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        out = np.empty((len(index), self.n_per_row), STORAGE_DTYPE[self.qtype])
        part = index // self.rows_each
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p].take(index[sel] - p * self.rows_each)
        return out

    def take_exact(self, qtype: QuantType, index: np.ndarray, name: str, row_offset: int = 0) -> np.ndarray | None:
        index = np.asarray(index)
        out = np.empty((len(index), traits(qtype).row_size(self.n_per_row)), np.uint8)
        part = index // self.rows_each
        for p in np.unique(part):
            sel = part == p
            base = p * self.rows_each
            rows = self.parts[p].take_exact(qtype, index[sel] - base, name, row_offset + base)
            if rows is None:
                return None
            out[sel] = rows
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


class ExpertsTransposed(Lazy):
    """gpt-oss's float experts: ``t`` is (n_expert, n_in, n_cols), each expert's matrix stored
    input-major (the model computes x @ W); output row r of expert e is its column ``start + r *
    stride`` (gate_up_proj interleaves gate and up columns: stride 2, start 0 or 1), in the stored
    dtype.  Rows run expert by expert: ggml (n_in, n_out, n_expert)."""

    def __init__(self, t: SafeTensor, start: int = 0, stride: int = 1):
        self.t, self.start, self.stride = t, start, stride
        self.n_expert, self.n_per_row, n_cols = t.shape
        self.rows_each = len(range(start, n_cols, stride))
        self.n_rows = self.n_expert * self.rows_each
        self.qtype = {"F32": QuantType.F32, "F16": QuantType.F16, "BF16": QuantType.BF16}[t.dtype]

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        out = np.empty((len(index), self.n_per_row), STORAGE_DTYPE[self.qtype])
        expert = index // self.rows_each
        for e in np.unique(expert):
            sel = expert == e
            block = self.t.read_rows(e * self.n_per_row, (e + 1) * self.n_per_row)     # (n_in, n_cols)
            out[sel] = block[:, self.start + (index[sel] - e * self.rows_each) * self.stride].T
        return out

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row, self.rows_each, self.n_expert)


class Columns(Lazy):
    """Every ``stride``-th column of another lazy tensor's rows from ``start`` on (gpt-oss's
    interleaved gate/up biases)."""

    def __init__(self, src: Lazy, start: int, stride: int):
        self.src, self.start, self.stride = src, start, stride
        self.qtype, self.n_rows = src.qtype, src.n_rows
        self.n_per_row = len(range(start, src.n_per_row, stride))

    def take(self, index: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.src.take(index)[:, self.start::self.stride])


class MXFP4Experts(Lazy):
    """gpt-oss's MXFP4 experts as ggml MXFP4 rows, bit for bit (no float round trip).

    HF stores ``*_blocks`` (n_expert, n_rows, n_blocks, 16) uint8 and ``*_scales`` (n_expert,
    n_rows, n_blocks) uint8: per block of 32 weights one E8M0 exponent and 16 bytes of FP4 (E2M1)
    codes, byte k holding weights 2k (low nibble) and 2k + 1 (high nibble).  ggml's block_mxfp4 is
    the exponent then qs[16], qs[j] holding weights j (low nibble) and j + 16 (high nibble)::

        HF   byte k:  lo = w[2k],  hi = w[2k+1]        ggml qs[j]:  lo = w[j],  hi = w[j+16]

    The codes mean the same values (ggml's kvalues are E2M1 doubled and its E8M0 scale halved),
    so each block is the exponent byte and its nibbles moved.  Output row r of expert e is HF row
    ``start + r * stride`` (gate_up interleaves gate and up rows)."""

    def __init__(self, blocks: SafeTensor, scales: SafeTensor, start: int = 0, stride: int = 1):
        self.blocks, self.scales, self.start, self.stride = blocks, scales, start, stride
        self.n_expert, n_hf_rows, self.n_blocks, _ = blocks.shape
        self.hf_rows = n_hf_rows
        self.rows_each = len(range(start, n_hf_rows, stride))
        self.n_rows, self.n_per_row = self.n_expert * self.rows_each, self.n_blocks * 32
        self.qtype = QuantType.MXFP4

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        out = np.empty((len(index), self.n_blocks, 17), np.uint8)
        if not len(index):
            return out.reshape(0, self.n_blocks * 17)
        hf = (index // self.rows_each) * self.hf_rows + self.start + (index % self.rows_each) * self.stride
        lo, hi = int(hf.min()), int(hf.max()) + 1
        # the tensors as matrices: blocks (rows * n_blocks, 16), scales (rows, n_blocks)
        codes = self.blocks.read_rows(lo * self.n_blocks, hi * self.n_blocks).reshape(hi - lo, self.n_blocks, 16)
        exps = self.scales.read_rows(lo, hi)
        codes, exps = codes[hf - lo], exps[hf - lo]
        w = np.stack((codes & 0x0F, codes >> 4), axis=-1).reshape(len(index), self.n_blocks, 32)
        out[..., 0] = exps
        out[..., 1:] = w[..., :16] | (w[..., 16:] << 4)
        return out.reshape(len(index), self.n_blocks * 17)

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return (self.n_per_row, self.rows_each, self.n_expert)


class LazySource:
    """Byte ranges of one lazy tensor's stored data, as :class:`GGUFFile` serves its map: the
    quantize pipeline reads any tensor through ``read``/``view`` with offsets from 0."""

    def __init__(self, lazy: Lazy):
        self.lazy = lazy
        self.row_size = traits(lazy.qtype).row_size(lazy.n_per_row)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        first, last = offset // self.row_size, -(-(offset + nbytes) // self.row_size)
        data = self.lazy.rows(first, last).view(np.uint8).reshape(-1)
        skip = offset - first * self.row_size
        return data[skip:skip + nbytes]

    @property
    def exact_types(self) -> frozenset:
        """The types :meth:`exact_rows` gives: the lazy tensor's, and their row-interleaved forms."""
        exact = self.lazy.exact_types
        return exact | {REPACKED_TYPE[t] for t in exact if t in REPACKED_TYPE}

    def exact_rows(self, qtype: QuantType, start: int, stop: int, name: str) -> np.ndarray | None:
        """Rows ``start:stop`` as lossless ``qtype`` blocks where the checkpoint holds them so
        (:meth:`Lazy.take_exact`), else None: the quantize pipeline copies those instead of quantizing.
        A row-interleaved type (q4_0_r8) is its base's rows shuffled, as ``repack`` does; the
        caller's rows are whole groups of one matrix."""
        if qtype not in self.exact_types:
            return None
        t = traits(qtype)
        if t.interleave_rows == 1:
            return self.lazy.take_exact(qtype, np.arange(start, stop), name)
        return interleave.interleave(self.lazy.take_exact(t.base, np.arange(start, stop), name), qtype,
                                     self.lazy.n_per_row)

    def read(self, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        data = self.view(offset, nbytes)
        if out is None:
            return np.array(data, copy=True)
        buf = out.reshape(-1)[:nbytes]
        buf[:] = data
        return buf
