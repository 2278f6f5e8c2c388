"""Model weights as they are stored: zero-copy views of the GGUF file, never dequantized as a whole.

A :class:`Weight` is one tensor in ggml order (``shape[0]`` is the row length, the input dimension
of a matrix product); its ``blocks`` are the file's bytes as ``(n_rows, row_size)`` uint8.  A 3-D
expert tensor ``[n_in, n_out, n_expert]`` is ``n_expert`` matrices of ``n_out`` rows each, and
``expert(e)`` is the view of one of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import formats
from ..formats import interleave
from ..errors import QuantkitError
from ..gguf_io.reader import GGUFModel, TensorInfo
from ..types import QuantType, traits, type_name

# dtypes whose rows are plain numbers: read without a decoder
PLAIN_DTYPE = {QuantType.F32: np.float32, QuantType.F16: np.float16}


@dataclass(frozen=True)
class Weight:
    name: str
    qtype: QuantType
    shape: tuple[int, ...]          # ggml order
    blocks: np.ndarray              # uint8 (n_rows, row_size), a view of the file
    # interleaved types: rows regrouped into the plain type's layout, made on first use; the dict
    # is shared with the tensor's expert views (key: first and last row in the whole tensor)
    _plain: dict = field(default_factory=dict, compare=False, repr=False)
    _row0: int = 0                  # this view's first row in the whole tensor

    @property
    def n_in(self) -> int:
        return self.shape[0]

    @property
    def n_out(self) -> int:
        return self.shape[1] if len(self.shape) > 1 else 1

    @property
    def n_matrices(self) -> int:
        return int(np.prod(self.shape[2:], dtype=np.int64)) if len(self.shape) > 2 else 1

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def expert(self, e: int) -> "Weight":
        """Matrix ``e`` of a 3-D tensor."""
        n = self.n_out
        return Weight(f"{self.name}[{e}]", self.qtype, self.shape[:2], self.blocks[e * n:(e + 1) * n],
                      self._plain, self._row0 + e * n)

    def plain_layout(self) -> tuple[QuantType, np.ndarray]:
        """The rows as (type, blocks) in a layout that is not interleaved: the stored ones, or for
        an ``_r4``/``_r8`` type its plain type's rows, regrouped once and kept (a copy in memory
        the size of the tensor: the fused kernels of generation read plain rows)."""
        t = traits(self.qtype)
        if t.interleave_rows == 1:
            return self.qtype, self.blocks
        r0, r1 = self._row0, self._row0 + self.blocks.shape[0]
        for (a, b), rows in self._plain.items():
            if a <= r0 and r1 <= b:
                return t.base, rows if (a, b) == (r0, r1) else rows[r0 - a:r1 - a]
        rows = self._plain[r0, r1] = interleave.deinterleave(self.blocks, self.qtype, self.n_in)
        return t.base, rows

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as float32 (stop - start, n_in); start/stop on interleave boundaries."""
        return self._decode(self.blocks[start:stop])

    def plain_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as ``rows`` gives them, decoded from ``plain_layout``: an interleaved
        type's rows are regrouped once for the whole tensor instead of once per call (the products
        of a prompt decode every tile of every matrix once per batch)."""
        if not interleave.supports(self.qtype):     # not interleaved, or decoded as stored (iq1_s_r4)
            return self.rows(start, stop)
        qtype, blocks = self.plain_layout()
        return formats.dequantize(blocks[start:stop], qtype, self.n_in)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any order, repeats allowed) as float32 (len(ids), n_in), decoded in one
        call: the interleave groups holding them are gathered, decoded, and the rows picked."""
        group = traits(self.qtype).interleave_rows
        row_size = self.blocks.shape[1]
        groups = self.blocks.reshape(-1, group, row_size)[ids // group].reshape(-1, row_size)
        return self._decode(groups).reshape(len(ids), group, self.n_in)[np.arange(len(ids)), ids % group]

    def _decode(self, b: np.ndarray) -> np.ndarray:
        dtype = PLAIN_DTYPE.get(self.qtype)
        if dtype is not None:
            return b.view(dtype).astype(np.float32, copy=dtype is not np.float32)
        return formats.dequantize(b, self.qtype, self.n_in)

    def plain(self) -> np.ndarray:
        """Rows of an F32 tensor without a copy (n_rows, n_in)."""
        assert self.qtype == QuantType.F32
        return self.blocks.view(np.float32)

    def vector(self) -> np.ndarray:
        """A 1-D tensor (norm weights, biases) as float32."""
        return self.rows(0, self.blocks.shape[0]).reshape(-1)


def computes_with(qtype: QuantType) -> bool:
    """Whether the runtime (run, perplexity, imatrix) can use a tensor of ``qtype``: it decodes
    rows, so every type quantkit can read."""
    return qtype in PLAIN_DTYPE or formats.can_dequantize(qtype)


def load_weight(info: TensorInfo) -> Weight:
    qt = QuantType(info.qtype)
    if not computes_with(qt):
        raise QuantkitError(f"tensor {info.name}: the runtime cannot compute with {type_name(qt)}")
    t = traits(qt)
    # per matrix (an expert's rows): products read an interleaved row inside its group of rows
    rows = info.shape[1] if info.n_dims > 1 else info.n_rows
    if t.interleave_rows > 1 and rows % t.interleave_rows:
        raise QuantkitError(f"tensor {info.name}: {rows} rows are not a multiple of "
                            f"{t.interleave_rows} ({type_name(qt)})")
    return Weight(info.name, qt, tuple(info.shape), info.raw())


class WeightStore:
    """Name -> Weight for one model file, loaded on first use."""

    def __init__(self, model: GGUFModel):
        self.model = model
        self._cache: dict[str, Weight] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.model.by_name

    def get(self, name: str) -> Weight | None:
        if name not in self.model.by_name:
            return None
        w = self._cache.get(name)
        if w is None:
            w = self._cache[name] = load_weight(self.model.by_name[name])
        return w

    def need(self, name: str) -> Weight:
        w = self.get(name)
        if w is None:
            raise QuantkitError(f"{self.model.path}: tensor '{name}' is missing")
        return w
