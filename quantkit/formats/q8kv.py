"""ik_llama.cpp's 8-bit row types: q8_KV, q8_KV_r8 and q8_k_r8 (ik only, imatrix ignored).

    q8_KV     row: float32 d @0 | int32 Σ codes @4 | int8 codes[n] @8        value = d * code
    q8_KV_r8  8 rows: float32 d[8] | codes, 4 bytes of each row in turn      (no code sums)
    q8_k_r8   8 rows, per 256 values: float16 d[8] | codes, 4 bytes of each row in turn

d is amax/127 of the row (q8_KV) or of the 256 values (q8_k_r8); codes round x/d to nearest even
(:mod:`quantkit.kernels.q8kv`).  ik quantizes q8_KV_r8 as q8_KV then repacks it, and q8_k_r8 as
its activation type q8_K32 then repacks that (q8_K has no file form), so neither interleaved type is
a regrouping of a plain type's bytes: quantkit quantizes both, but ``repack`` keeps q8_KV tensors
(ik's offline repack of q8_KV writes the smaller q8_KV_r8 groups at q8_KV's stride).

Reference decoders: q8_KV's is formats/decode.py's (numpy and torch); the interleaved types' are
the numpy regroupings below (the runtime decodes interleaved types through their formats only).
"""
from __future__ import annotations

import numpy as np

from ..kernels import q8kv as kernels
from ..types import QK_K, QuantType, type_name
from . import decode
from ._base import ALL_PATHS, BlockFormat, FamilyKernelFormat, reference_decoder

T = QuantType
GROUP = kernels.GROUP


class Q8_KV(FamilyKernelFormat, qtype=T.Q8_KV):
    kernel_module = kernels
    kernel_takes_flavor = True
    quant_paths = ALL_PATHS                  # ik only: one algorithm for both flavors
    dequantize_ref = reference_decoder

    @classmethod
    def first_non_finite_value(cls, blocks, n_per_row):
        return _first_non_finite_row(cls, blocks, np.ascontiguousarray(blocks[:, :4]).view("<f4")[:, 0], n_per_row)


def _first_non_finite_row(fmt, blocks, d, n_per_row):
    """(row, element) of the first non-finite value of rows whose float32 scales are d (one per
    row), decoding only the rows where d * 128 (the largest code's value) is not finite; None if
    no value is."""
    with np.errstate(over="ignore", invalid="ignore"):
        suspect = np.flatnonzero(~np.isfinite(d.astype(np.float32) * np.float32(128)))
    for r in suspect:
        group = fmt.traits.interleave_rows
        first = r // group * group
        y = fmt.dequantize_fast(blocks[first:first + group], n_per_row)[r - first]
        bad = np.flatnonzero(~np.isfinite(y))
        if bad.size:
            return int(r), int(bad[0])
    return None


def _check_groups(qtype, n_rows):
    if n_rows % GROUP:
        raise ValueError(f"{type_name(qtype)} needs a multiple of {GROUP} rows, got {n_rows}")


def _unwords(codes, n_groups, n_bytes):
    """(n_groups, n_bytes // 4 * 8 * 4) interleaved codes -> (n_groups * 8, n_bytes) row codes."""
    return codes.reshape(n_groups, n_bytes // 4, GROUP, 4).transpose(0, 2, 1, 3).reshape(n_groups * GROUP, n_bytes)


class _Interleaved8(BlockFormat):
    """Quantize and regroup 8 rows at a time (kernels.quantize_groups8); decode by
    kernels.decode_groups8, or by the numpy regrouping of ``dequantize_ref``."""
    quant_paths = ALL_PATHS
    scale_fields = None                      # decode to find a non-finite value (groups, not rows;
                                             # q8_k_r8's float16 d overflows from amax ~65520*127 on)

    @classmethod
    def quantize(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        _check_groups(cls.qtype, n_rows)
        out = cls.empty_blocks(n_rows, n)
        kernels.quantize_groups8(np.ascontiguousarray(x, np.float32), cls.qtype == T.Q8_KV_R8, out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        n_rows = blocks.shape[0]
        _check_groups(cls.qtype, n_rows)
        packed = np.ascontiguousarray(blocks, np.uint8).reshape(-1)
        packed.flags.writeable = False          # one compiled signature, writable blocks or mapped
        out = np.empty((n_rows, n_per_row), np.float32)
        kernels.decode_groups8(packed, blocks.shape[1], cls.qtype == T.Q8_KV_R8, n_per_row,
                               kernels.FP16_TABLE, out.reshape(-1))
        return out


class Q8_KV_R8(_Interleaved8, qtype=T.Q8_KV_R8):
    @classmethod
    def first_non_finite_value(cls, blocks, n_per_row):
        _check_groups(cls.qtype, blocks.shape[0])
        d = np.ascontiguousarray(blocks.reshape(-1, GROUP * blocks.shape[1])[:, :4 * GROUP]).view("<f4").reshape(-1)
        return _first_non_finite_row(cls, blocks, d, n_per_row)

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        """The q8_KV rows they came from (code sums left 0: decoding reads none), decoded."""
        _check_groups(cls.qtype, blocks.shape[0])
        b = np.ascontiguousarray(blocks, np.uint8)
        g = b.reshape(-1, GROUP * b.shape[1])
        keep = kernels.Q8_KV_R8_META
        plain = np.zeros((b.shape[0], kernels.Q8_KV_META + n_per_row), np.uint8)
        plain[:, :keep] = g[:, :GROUP * keep].reshape(-1, keep)
        plain[:, kernels.Q8_KV_META:] = _unwords(g[:, GROUP * keep:], g.shape[0], n_per_row)
        return decode.dequantize(plain, T.Q8_KV, n_per_row)


class Q8_K_R8(_Interleaved8, qtype=T.Q8_K_R8):
    @classmethod
    def first_non_finite_value(cls, blocks, n_per_row):
        """Only a non-finite float16 d decodes to a non-finite value (65504 * 128 is finite):
        (row, first element of its 256 values) of the first."""
        _check_groups(cls.qtype, blocks.shape[0])
        n_blocks = n_per_row // QK_K
        g = blocks.reshape(-1, n_blocks, GROUP * (kernels.Q8_K_R8_HEAD + QK_K))
        d = np.ascontiguousarray(g[:, :, :2 * GROUP]).view("<f2")                 # (groups, block, row)
        bad = np.argwhere(~np.isfinite(d.transpose(0, 2, 1).reshape(blocks.shape[0], n_blocks)))
        return (int(bad[0, 0]), int(bad[0, 1]) * QK_K) if bad.size else None

    @classmethod
    def dequantize_ref(cls, blocks, n_per_row):
        _check_groups(cls.qtype, blocks.shape[0])
        b = np.ascontiguousarray(blocks, np.uint8)
        n_blocks = n_per_row // QK_K
        g = b.reshape(-1, n_blocks, GROUP * (kernels.Q8_K_R8_HEAD + QK_K))        # (groups, block, bytes)
        d = np.ascontiguousarray(g[:, :, :2 * GROUP]).view("<f2").astype(np.float32)    # (groups, block, 8)
        codes = _unwords(g[:, :, 2 * GROUP:].reshape(-1, GROUP * QK_K), g.shape[0] * n_blocks, QK_K)
        codes = codes.view(np.int8).reshape(g.shape[0], n_blocks, GROUP, QK_K).astype(np.float32)
        y = d.transpose(0, 2, 1)[:, :, :, None] * codes.transpose(0, 2, 1, 3)         # (groups, 8, block, 256)
        return np.ascontiguousarray(y.reshape(b.shape[0], n_per_row), np.float32)
