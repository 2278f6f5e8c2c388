"""Quantizing to the row-interleaved types (q4_k_r4, iq2_k_r4, q8_0_r8, bf16_r16, ...).

ik_llama.cpp quantizes N rows with the plain type's quantizer and regroups their bytes
(:mod:`quantkit.formats.interleave`).  The result equals "quantize to the plain type, then repack"
except where the C wrapper changes the quantizer's input:

* Several wrappers run the imatrix through the QHelper clean-up first (blocks of 16 or 32 weights
  whose Σw², Σx² or Σw|x| is ~0 get the weight 1e-9), while the plain quantizer sees the raw
  imatrix.  For the IQK types the plain quantizer does the clean-up itself, so nothing differs.
* q2_k_r4 calls the q2_K quantizer one row at a time, so ik's "is this chunk ternary" test looks at
  one row, not at llama-quantize's chunk of rows.
* q8_0_r8 ignores the imatrix (q8_0 has no use for it); mxfp4_r8 too (mxfp4 does not use one).
* bf16_r16 truncates float32 to bf16 (plain bf16 rounds to nearest even).

These types exist only in ik_llama.cpp, so the flavor is ignored: ik's quantizers are used.
Decoding regroups the bytes back and decodes the plain type.  A wrapper reaches the plain type's
format (types.py's ``base``) through the registry, not through the package's quantize/dequantize,
which import this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..types import QuantType, traits
from . import interleave
from ._base import ALL_PATHS, BlockFormat, registered
from ._iqk import imatrix_cleanup

T = QuantType


@dataclass(frozen=True)
class WrapperRule:
    """What the C ``quantize_<type>_r<N>`` wrapper does around the plain quantizer."""
    cleanup_block: int | None = None    # QHelper block size applied to the imatrix, or None (raw)
    uses_imatrix: bool = True
    rows_one_at_a_time: bool = False    # the plain quantizer is called per row (matters for q2_K)
    truncate_bf16: bool = False


WRAPPERS: dict[QuantType, WrapperRule] = {
    T.Q4_0_R8: WrapperRule(cleanup_block=32),
    T.Q8_0_R8: WrapperRule(uses_imatrix=False),
    T.Q5_0_R4: WrapperRule(),
    T.Q6_0_R4: WrapperRule(cleanup_block=32),
    T.IQ4_NL_R4: WrapperRule(cleanup_block=32),
    T.IQ4_XS_R8: WrapperRule(cleanup_block=32),
    T.Q2_K_R4: WrapperRule(cleanup_block=16, rows_one_at_a_time=True),
    T.Q3_K_R4: WrapperRule(cleanup_block=16),
    T.Q4_K_R4: WrapperRule(cleanup_block=32),
    T.Q5_K_R4: WrapperRule(cleanup_block=32),
    T.Q6_K_R4: WrapperRule(cleanup_block=16),
    T.IQ2_K_R4: WrapperRule(), T.IQ3_K_R4: WrapperRule(), T.IQ4_K_R4: WrapperRule(),
    T.IQ5_K_R4: WrapperRule(), T.IQ4_KS_R4: WrapperRule(), T.IQ5_KS_R4: WrapperRule(),
    T.BF16_R16: WrapperRule(uses_imatrix=False, truncate_bf16=True),
    T.IQ2_BN_R4: WrapperRule(),             # quantize_iq2_bn ignores the imatrix it is handed
    T.IQ3_XXS_R4: WrapperRule(cleanup_block=32), T.IQ3_S_R4: WrapperRule(cleanup_block=16),
    T.MXFP4_R8: WrapperRule(uses_imatrix=False),        # quantize_mxfp4_r8: mxfp4's blocks, regrouped
    T.IQ2_XXS_R4: WrapperRule(cleanup_block=32), T.IQ2_XS_R4: WrapperRule(cleanup_block=16),
    T.IQ2_S_R4: WrapperRule(cleanup_block=16),
}


def _groups_by_weights(w_rows: np.ndarray):
    """Rows that end up with identical weights, as (row indices, weights) pairs: the clean-up only
    replaces whole blocks, so most rows of a matrix share one weight vector."""
    _, first, inverse = np.unique(w_rows, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    for g, row in enumerate(first):
        yield np.nonzero(inverse == g)[0], w_rows[row]


_IK_PATHS = frozenset({("ik", False), ("ik", True)})


class _Interleaved(BlockFormat):
    rule: WrapperRule
    quant_paths = ALL_PATHS

    @classmethod
    def _plain_blocks(cls, x, imatrix):
        rule = cls.rule
        if rule.truncate_bf16:
            return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype("<u2").view(np.uint8)
        base_format = registered()[cls.traits.base]
        quantize = base_format.quantize
        if imatrix is None or not rule.uses_imatrix:
            if rule.rows_one_at_a_time:
                return np.concatenate([quantize(x[r:r + 1], None, "ik") for r in range(len(x))])
            return quantize(x, None, "ik")
        if rule.cleanup_block is None:
            if rule.rows_one_at_a_time:
                return np.concatenate([quantize(x[r:r + 1], imatrix, "ik") for r in range(len(x))])
            return quantize(x, imatrix, "ik")
        w_rows = imatrix_cleanup(x, imatrix, rule.cleanup_block)
        out = np.empty((x.shape[0], base_format.traits.row_size(x.shape[1])), np.uint8)
        if rule.rows_one_at_a_time:
            for r in range(x.shape[0]):
                out[r:r + 1] = quantize(x[r:r + 1], w_rows[r], "ik")
            return out
        for group, w in _groups_by_weights(w_rows):
            out[group] = quantize(np.ascontiguousarray(x[group]), w, "ik")
        return out

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        group = cls.traits.interleave_rows
        if n_rows % group:
            raise ValueError(f"{cls.traits.name} needs a multiple of {group} rows, got {n_rows}")
        plain = cls._plain_blocks(x, imatrix)
        return interleave.interleave(plain.reshape(n_rows, -1), cls.qtype, n)

    @classmethod
    def _dequantize(cls, blocks, n_per_row, reference):
        base_format = registered()[cls.traits.base]
        plain = interleave.deinterleave(blocks, cls.qtype, n_per_row)
        return (base_format.dequantize_ref if reference else base_format.dequantize_fast)(plain, n_per_row)

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        return cls._dequantize(blocks, n_per_row, True)

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        return cls._dequantize(blocks, n_per_row, False)


def register_available() -> list[QuantType]:
    """Register a format for every interleaved type whose plain quantizer (ik's, with and without an
    imatrix: the wrappers call it directly) and byte layout exist."""
    done = []
    have = registered()
    for qtype, rule in WRAPPERS.items():
        base = traits(qtype).base
        if (qtype in have or base not in have
                or not _IK_PATHS <= (have[base].wrapped_paths or have[base].quant_paths)
                or not interleave.supports(qtype)):
            continue
        type(f"Interleaved_{traits(qtype).name}", (_Interleaved,), {"rule": rule}, qtype=qtype)
        done.append(qtype)
    return done
