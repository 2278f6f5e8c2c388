"""Block formats: the contract every quant type implements, and the registry.

A format converts whole rows.  Shapes and dtypes are fixed:

    x        float32 (n_rows, n_per_row)        C-contiguous
    imatrix  float32 (n_per_row,) or None       per-column importance (mean of squared activations)
    blocks   uint8   (n_rows, row_size)         row_size = traits.row_size(n_per_row)

A format quantizes one way, ``quantize``: for every quantized type that is the numba kernel of
:mod:`quantkit.kernels`, which tests/test_formats_*.py check byte for byte against the C quantizers'
reference vectors (../shared/golden) and the executable ports of ../shared/reference.  Decoding has
two paths with the same contract:

* ``dequantize_ref``   the reference decoder (formats/decode.py: one per type, for numpy and torch,
                       derived from the block layouts of quantkit/layouts.py).
* ``dequantize_fast``  a numba kernel from :mod:`quantkit.kernels`; defaults to the reference.

Quantizers come in flavors: ``"ik"`` reproduces ik_llama.cpp's ggml, ``"mainline"`` llama.cpp's.
Most paths are the same in both; a format lists the (flavor, with_imatrix) pairs it implements in
``quant_paths``.
"""
from __future__ import annotations

from types import ModuleType
from typing import ClassVar

import numpy as np

from ..types import QuantType, TypeTraits, traits

FLAVORS = ("ik", "mainline")
ALL_PATHS = frozenset((f, imat) for f in FLAVORS for imat in (False, True))

_registry: dict[QuantType, type["BlockFormat"]] = {}


class BlockFormat:
    qtype: ClassVar[QuantType]
    traits: ClassVar[TypeTraits]
    #: (flavor, uses_imatrix) pairs the quantizer reproduces byte for byte; empty = decode only
    quant_paths: ClassVar[frozenset] = frozenset()
    #: paths an interleaved type's wrapper (formats/repacked.py) may call the quantizer on, where more
    #: than ``quant_paths``: ik's quantize_iq2_xxs_r4 runs the plain quantizer without an imatrix,
    #: which llama-quantize refuses for the plain type.  None: ``quant_paths``
    wrapped_paths: ClassVar[frozenset | None] = None
    #: (byte offset in the block, numpy dtype) of every float field (scales, mins); lets the output
    #: check look at those instead of decoding whole tensors.  None: decode and check everything.
    #: A row-scaled type lists its row scale (offset in the row) only where that alone decides.
    scale_fields: ClassVar[tuple[tuple[int, str], ...] | None] = None
    #: ``quantize`` / ``dequantize_fast`` run numpy alone (no numba kernel): a quantize whose every
    #: conversion is such a pair never imports numba (formats.numpy_only)
    numpy_quantize: ClassVar[bool] = False
    numpy_decode: ClassVar[bool] = False

    def __init_subclass__(cls, qtype: QuantType | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if qtype is None:       # an intermediate base class
            return
        assert qtype not in _registry, f"{qtype!r} registered twice"
        cls.qtype = qtype
        cls.traits = traits(qtype)
        _registry[qtype] = cls

    # ---- to implement ----
    @classmethod
    def quantize(cls, x: np.ndarray, imatrix: np.ndarray | None, flavor: str) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def dequantize_ref(cls, blocks: np.ndarray, n_per_row: int) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def dequantize_fast(cls, blocks: np.ndarray, n_per_row: int) -> np.ndarray:
        return cls.dequantize_ref(blocks, n_per_row)

    # ---- helpers for implementations ----
    @classmethod
    def empty_blocks(cls, n_rows: int, n_per_row: int) -> np.ndarray:
        return np.zeros((n_rows, cls.traits.row_size(n_per_row)), dtype=np.uint8)


@classmethod
def reference_decoder(cls, blocks: np.ndarray, n_per_row: int) -> np.ndarray:
    """``BlockFormat.dequantize_ref`` of every format that formats/decode.py decodes
    (``dequantize_ref = reference_decoder`` in its class).  decode.py is imported on the first call,
    not with the formats: it and the kernel modules it takes tables from (iq2kl, iqk, kt, ternary)
    are ~0.1 s of imports that every quantize paid and only the reference path uses."""
    from . import decode
    return decode.dequantize(blocks, cls.qtype, n_per_row)


def first_non_finite(fmt: type[BlockFormat], blocks: np.ndarray, n_per_row: int) -> tuple[int, int] | None:
    """(row, element or block index) of the first non-finite value a decoder would produce, or None."""
    own = getattr(fmt, "first_non_finite_value", None)  # a format that finds it without decoding all
    if own is not None:
        return own(blocks, n_per_row)
    t = fmt.traits
    if fmt.scale_fields is not None and t.row_meta_size:
        # the row's scale times a small integer is every value (ternary types): a row whose scale is
        # not finite decodes to inf/NaN from its first value on (0 * inf is NaN), no other row does
        for off, dtype in fmt.scale_fields:
            size = np.dtype(dtype).itemsize
            vals = np.ascontiguousarray(blocks[:, off:off + size]).view(dtype).reshape(-1)
            bad = ~np.isfinite(vals)
            if bad.any():
                return int(np.argmax(bad)), 0
        return None
    if fmt.scale_fields is not None and t.row_meta_size == 0:
        per_row = n_per_row // t.block_size
        b = blocks.reshape(-1, t.type_size)
        for off, dtype in fmt.scale_fields:
            size = np.dtype(dtype).itemsize
            vals = np.ascontiguousarray(b[:, off:off + size]).view(dtype).reshape(-1)
            bad = ~np.isfinite(vals)
            if bad.any():
                i = int(np.argmax(bad))
                return i // per_row, i % per_row
        return None
    x = fmt.dequantize_fast(blocks, n_per_row)
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        return int(row), int(col)
    return None


def registered() -> dict[QuantType, type[BlockFormat]]:
    return dict(_registry)


class KernelFormat(BlockFormat):
    """``quantize``/``dequantize_fast`` through numba row kernels.  Subclasses set
    ``_kernel_quantize(x, qw, has_qw, out)`` (or ``(x, qw, has_qw, ik, out)`` with
    ``kernel_takes_flavor``) and ``_kernel_dequantize(blocks, out)`` (static- or classmethods);
    without an imatrix the kernels get a dummy ``qw`` and ``has_qw=False``."""
    #: the quantizer kernel takes ``ik`` (reproduce ik_llama.cpp, else mainline); the types only
    #: ik_llama.cpp has run one algorithm for both flavors
    kernel_takes_flavor: ClassVar[bool] = False

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        out = cls.empty_blocks(n_rows, n)
        has_qw = imatrix is not None
        qw = np.ascontiguousarray(imatrix, np.float32) if has_qw else np.zeros(n, np.float32)
        x = np.ascontiguousarray(x, np.float32)
        if cls.kernel_takes_flavor:
            cls._kernel_quantize(x, qw, has_qw, flavor == "ik", out)
        else:
            cls._kernel_quantize(x, qw, has_qw, out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        cls._kernel_dequantize(np.ascontiguousarray(blocks, np.uint8), out)
        return out


class FamilyKernelFormat(KernelFormat):
    """A family whose kernels module (``kernel_module``) runs each of its types by ggml type id:
    ``quantize_rows(type_id, <KernelFormat's arguments>)``, ``dequantize_rows(type_id, blocks,
    FP16_TABLE, out)``."""
    kernel_module: ClassVar[ModuleType]

    @classmethod
    def _kernel_quantize(cls, *args):
        cls.kernel_module.quantize_rows(int(cls.qtype), *args)

    @classmethod
    def _kernel_dequantize(cls, blocks, out):
        cls.kernel_module.dequantize_rows(int(cls.qtype), blocks, cls.kernel_module.FP16_TABLE, out)
