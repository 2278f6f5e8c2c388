"""Public entry points for converting rows to and from ggml block formats.

    quantize(x, qtype, imatrix=None, flavor="ik")  -> uint8 (n_rows, row_size)
    dequantize(blocks, qtype, n_per_row)           -> float32 (n_rows, n_per_row)

Types quantkit does not implement itself are decoded with gguf-py where it knows the layout, so a
file of any common type can be requantized.
"""
from __future__ import annotations

import importlib
import threading

import numpy as np

from ..types import QuantType, traits, type_name
from ._base import ALL_PATHS, FLAVORS, BlockFormat, first_non_finite
from ._base import registered as _registered
from .limits import first_excess

__all__ = ["quantize", "dequantize", "can_quantize", "can_dequantize", "find_non_finite", "non_finite_column",
           "first_excess", "numpy_only", "FLAVORS", "BlockFormat"]

# gguf-py decodes these mainline layouts; ids where the fork differs are left out.
_GGUF_PY_DECODABLE = {
    QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K,
    QuantType.IQ2_XXS, QuantType.IQ2_XS, QuantType.IQ2_S, QuantType.IQ3_XXS, QuantType.IQ3_S,
    QuantType.IQ1_S, QuantType.IQ1_M, QuantType.IQ4_NL, QuantType.IQ4_XS, QuantType.MXFP4,
    QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0,
    QuantType.BF16, QuantType.F16, QuantType.F32,
}


T = QuantType
#: the module that registers each plain type's format.  A format module is imported (and so
#: registered) on the first use of one of its types, not with the package: the i-quant modules build
#: their lattice tables on import (~2 s of numpy for iq2xs, iq3xs and iq1 together), which a Q4_K_M
#: quantize or a `quantkit repack` has no use for.  tests/test_formats_api.py holds it to the full
#: registration (_all.py).
FORMAT_MODULES: dict[str, tuple[QuantType, ...]] = {
    "floats": (T.F32, T.F16, T.BF16),
    "legacy": (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q6_0),
    "kquants": (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K),
    "iq4": (T.IQ4_NL, T.IQ4_XS),
    "iqk": (T.IQ3_K, T.IQ4_K, T.IQ5_K, T.IQ6_K, T.IQ5_KS, T.IQ3_KS, T.IQ4_KS),
    "iq2k": (T.IQ2_K, T.IQ2_KS),
    "iq2kl": (T.IQ2_KL,),
    "iq4kss": (T.IQ4_KSS,),
    "kt": (T.IQ1_KT, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT),
    "ternary": (T.IQ1_BN, T.IQ2_BN, T.TQ1_0, T.TQ2_0),
    "iq3xs": (T.IQ3_XXS, T.IQ3_S),
    "mxfp4": (T.MXFP4,),
    "q8kv": (T.Q8_KV, T.Q8_KV_R8, T.Q8_K_R8),
    "iq1": (T.IQ1_S, T.IQ1_M, T.IQ1_S_R4, T.IQ1_M_R4),
    "iq2xs": (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S),
}
_MODULE_OF = {qtype: module for module, types in FORMAT_MODULES.items() for qtype in types}
_loading = threading.RLock()


def registered() -> dict[QuantType, type[BlockFormat]]:
    """Every implemented format by type (imports every format module: see :data:`FORMAT_MODULES`)."""
    from . import _all  # noqa: F401  (the import lock makes the registration happen once)
    return _registered()


def _format(qtype) -> type[BlockFormat] | None:
    """``qtype``'s format, its module imported on first use; an interleaved type's (q4_k_r4) is
    registered once its plain type's module is (formats/repacked.py)."""
    qtype = QuantType(qtype)
    fmt = _registered().get(qtype)
    if fmt is not None:
        return fmt
    module = _MODULE_OF.get(qtype) or _MODULE_OF.get(traits(qtype).base)
    if module is None:
        return None
    with _loading:
        importlib.import_module(f"{__name__}.{module}")
        if qtype not in _MODULE_OF:
            from . import repacked
            repacked.register_available()
    return _registered().get(qtype)


def can_quantize(qtype, flavor: str = "ik", with_imatrix: bool = False) -> bool:
    fmt = _format(qtype)
    return fmt is not None and (flavor, with_imatrix) in fmt.quant_paths


def numpy_only(src, dst) -> bool:
    """Whether rows of ``src`` become ``dst`` without a numba kernel: decoded (F32 needs no
    decoding) and quantized by numpy alone (BlockFormat.numpy_decode / numpy_quantize)."""
    src_fmt, dst_fmt = _format(src), _format(dst)
    return (src_fmt is not None and dst_fmt is not None and src_fmt.numpy_decode and dst_fmt.numpy_quantize)


def can_dequantize(qtype) -> bool:
    qtype = QuantType(qtype)
    if qtype in _GGUF_PY_DECODABLE:
        return True
    fmt = _format(qtype)
    return fmt is not None and _implements(fmt, "dequantize_ref")


def _implements(fmt: type[BlockFormat], method: str) -> bool:
    return getattr(fmt, method).__func__ is not getattr(BlockFormat, method).__func__


def _check_rows(x: np.ndarray, n_per_row: int, qtype) -> None:
    t = traits(qtype)
    if n_per_row % t.block_size:
        raise ValueError(f"row size ({n_per_row}) is not a multiple of {t.name} block size ({t.block_size})")


def quantize(x: np.ndarray, qtype, imatrix: np.ndarray | None = None, flavor: str = "ik") -> np.ndarray:
    """Quantize float32 rows ``x`` (n_rows, n_per_row) to ``qtype`` blocks."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor '{flavor}' (expected one of {', '.join(FLAVORS)})")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D array of rows, got shape {x.shape}")
    _check_rows(x, x.shape[1], qtype)
    fmt = _format(qtype)
    if fmt is None or (flavor, imatrix is not None) not in fmt.quant_paths:
        how = "with" if imatrix is not None else "without"
        raise NotImplementedError(f"quantizing to {type_name(qtype)} {how} imatrix ({flavor} flavor) "
                                  "is not implemented")
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (x.shape[1],):
            raise ValueError(f"imatrix has {imatrix.size} values, rows have {x.shape[1]}")
        if not imatrix.flags.writeable:     # numba's compiled signatures take writable arrays
            imatrix = imatrix.copy()
    if not x.flags.writeable:
        x = x.copy()
    return fmt.quantize(x, imatrix, flavor)


def dequantize(blocks: np.ndarray, qtype, n_per_row: int, reference: bool = False) -> np.ndarray:
    """Decode ``blocks`` (n_rows, row_size) uint8 of ``qtype`` to float32 (n_rows, n_per_row)."""
    qtype = QuantType(qtype)
    _check_rows(blocks, n_per_row, qtype)
    row_size = traits(qtype).row_size(n_per_row)
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, row_size)
    fmt = _format(qtype)
    if fmt is not None and _implements(fmt, "dequantize_ref"):
        fn = fmt.dequantize_ref if reference else fmt.dequantize_fast
        return fn(blocks, n_per_row)
    if qtype in _GGUF_PY_DECODABLE:
        import gguf
        out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(qtype)))
        return np.ascontiguousarray(out, dtype=np.float32).reshape(blocks.shape[0], n_per_row)
    raise NotImplementedError(f"decoding {type_name(qtype)} is not implemented")


def find_non_finite(blocks: np.ndarray, qtype, n_per_row: int) -> tuple[int, int] | None:
    """Where decoding ``blocks`` would give NaN/Inf: (row, element or block), or None if nowhere.

    Looks only at the scale fields when the format lists them (cheap), else decodes.
    """
    fmt = _format(qtype)
    if fmt is None:
        x = dequantize(blocks, qtype, n_per_row)
        bad = ~np.isfinite(x)
        return tuple(int(v) for v in np.argwhere(bad)[0]) if bad.any() else None
    return first_non_finite(fmt, np.ascontiguousarray(blocks), n_per_row)


def non_finite_column(blocks: np.ndarray, qtype, x: np.ndarray) -> tuple[int, int] | None:
    """Where quantizing ``x`` (n_rows, n_per_row) to ``blocks`` gave a non-finite scale or value:
    (row, column of the input value that caused it), or None.  A scale covers a block (a row for
    types with a row scale), so the column is that block's (row's) largest |x|."""
    bad = find_non_finite(blocks, qtype, x.shape[1])
    if bad is None:
        return None
    row, at = bad
    t = traits(qtype)
    fmt = _format(qtype)
    reports_blocks = fmt is not None and fmt.scale_fields is not None and t.row_meta_size == 0
    if t.row_meta_size:
        start, stop = 0, x.shape[1]
    else:
        block = at if reports_blocks else at // t.block_size
        start, stop = block * t.block_size, (block + 1) * t.block_size
    values = np.abs(x[row, start:stop])
    with np.errstate(invalid="ignore"):
        return row, start + int(np.argmax(np.where(np.isnan(values), np.inf, values)))
