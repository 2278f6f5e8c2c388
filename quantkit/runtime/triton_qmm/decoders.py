"""The decoder contract of the fused Triton kernels, and the registry of decoders by type.

A :class:`Decoder` is a ``@triton.jit`` device function that decodes one block of every row of a
tile of weight rows, with what the kernels need to know to walk a row:

    @triton.jit
    def fn(row_ptr, blk_ptr, t0_ptr, t1_ptr, QK: tl.constexpr):
        # row_ptr: [BN] uint8 pointers to each row's first byte (where a row scale sits: iq4_ks, ...)
        # blk_ptr: [BN] uint8 pointers to the first byte of the block being decoded
        # t0_ptr, t1_ptr: float32 lookup tables on the device (grids, value tables; unused: any pointer)
        # returns [BN, QK] float32: the block's values, row by row
        ...

A row of a type is ``row_meta_bytes`` bytes of row metadata, then ``n_per_row // block_values``
blocks of ``block_bytes`` bytes; block ``k`` of row ``r`` starts at ``row + row_meta_bytes + k *
block_bytes``.  The kernels (template.py) take the decoder's ``fn`` as a ``tl.constexpr`` argument,
so each (kernel, decoder) pair compiles to its own specialised kernel; ``tables`` (up to two numpy
arrays, float32 on upload) are put on the device once and passed as ``t0_ptr`` / ``t1_ptr``.

Decoders load without masks: the kernels hand them only pointers inside the weight tensor (rows
past the end are clamped to the last row, and their results never stored).  A decoder computes
its values with the same float32 operations in the same order as the numba decoders
(formats.dequantize; ggml's dequantize_row_*), so ``qdecode`` equals them bit for bit.

The family modules (legacy.py, kquants.py, iqk.py, iquants.py) each export
``DECODERS: dict[QuantType, Decoder]``; registry.py merges them (apart from this module, which the
families import: a family module imported first would otherwise import itself half-made).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...types import traits


@dataclass(frozen=True)
class Decoder:
    fn: object                  # the triton.JITFunction (see the module docstring)
    block_values: int           # QK: values decoded per call (32 or 256)
    block_bytes: int
    row_meta_bytes: int = 0     # bytes in front of a row's first block (a row scale: iq4_ks, iq5_ks, ...)
    tables: tuple = ()          # up to two numpy arrays, passed as t0_ptr / t1_ptr

    def row_bytes(self, n_per_row: int) -> int:
        return self.row_meta_bytes + self.block_bytes * (n_per_row // self.block_values)


def for_type(qtype, fn, tables=(), block_values: int | None = None, block_bytes: int | None = None) -> Decoder:
    """A Decoder with ``qtype``'s block geometry from types.py (``traits``): block size, bytes per
    block and per row; ``block_values`` / ``block_bytes`` for floats, decoded 32 values at a time."""
    t = traits(qtype)
    return Decoder(fn=fn, block_values=block_values or t.block_size, block_bytes=block_bytes or t.type_size,
                   row_meta_bytes=t.row_meta_size, tables=tuple(tables))
