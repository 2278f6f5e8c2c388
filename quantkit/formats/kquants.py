"""The k-quants: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value super-blocks).

A super-block of 256 values is cut into sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
Every sub-block gets its own small integer scale (and for Q2_K/Q4_K/Q5_K a min), quantized against
one fp16 super-scale ``d`` (and ``dmin``); specs/ggml-quants.md §1.2-1.6 give layouts and decoding::

    Q2_K  y = d*(sc&0xF)*q - dmin*(sc>>4)         q in 0..3      scales[16] qs[64] d dmin
    Q3_K  y = d*(sc6-32)*(q-4)                     q in 0..7      hmask[32] qs[64] scales[12] d
    Q4_K  y = d*sc6*q - dmin*m6                    q in 0..15     d dmin scales[12] qs[128]
    Q5_K  y = d*sc6*q - dmin*m6                    q in 0..31     d dmin scales[12] qh[32] qs[128]
    Q6_K  y = d*sc8*(q-32)                         q in 0..63     ql[128] qh[64] scales[16] d

Quantizers.  ``ggml_quantize_chunk`` runs the ``quantize_row_*_ref`` function when no imatrix is
given and the ``*_impl`` function with one.  Both end the same way: the super-scales are stored as
fp16 and every code is re-derived from the *rounded* scales.  The scale searches are helpers shared
with the legacy types, and ik_llama.cpp changed several of them:

* ``make_qkx2_quants`` (Q2_K/Q4_K/Q5_K without imatrix): a sub-block is "flat" (all codes 0) when
  ``max == min`` in mainline, ``max - min < 1e-10`` in ik;
* ``make_qkx3_quants`` (Q2_K/Q4_K/Q5_K with imatrix): mainline is make_qkx2 in float32; ik keeps the
  sums in double, evaluates each trial's error from the sums and ends with a greedy refinement;
* ``make_qx_quants`` (Q3_K with imatrix, Q6_K): ik tries two scales per step (also ``is = 0``) and
  ends with a greedy refinement;
* ``make_q3_quants`` / ``make_qp_quants`` (ik): no guard against ``0/0`` in the returned scale, and
  ``make_qp_quants`` treats a maximum below 1e-16 (not 1e-15) as zero;
* ik's Q2_K: without imatrix a "TriNet" test on the whole chunk of rows handed to
  ``ggml_quantize_chunk`` may store a ternary encoding.  quantkit applies it to llama-quantize's
  chunks, ``chunk_rows(n_per_row)`` rows counted from the first row of the array given to
  ``quantize`` (so callers that quantize a tensor in slabs should cut them at multiples of that, and
  3-D tensors one expert at a time, as llama-quantize does).  With an imatrix ``sigma2`` is
  ``0.75*Σx²/256`` (mainline ``Σx²/256``) and the codes are re-derived from the unrounded float scales.

The quantizers are the numba kernels of :mod:`quantkit.kernels.kquants`, which keep the C
evaluation order of every float32 (or double) expression; the numpy decoders below are vectorised
across super-blocks.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ..kernels import kquants as kernels
from ..types import QuantType
from ._base import ALL_PATHS, BlockwiseReference, FamilyKernelFormat

#: llama-quantize hands ggml_quantize_chunk chunks of ceil(16384 / n_per_row) rows (at least one
#: row); ik's Q2_K TriNet test looks at one chunk at a time (llama-quantize.cpp, min_chunk_size)
MIN_CHUNK_ELEMENTS = 32 * 512


def chunk_rows(n_per_row: int) -> int:
    """Rows per llama-quantize chunk (the unit of ik's Q2_K TriNet test)."""
    if n_per_row >= MIN_CHUNK_ELEMENTS:
        return 1
    return (MIN_CHUNK_ELEMENTS + n_per_row - 1) // n_per_row


def fp16_values(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 fp16 bytes -> float32 (n,)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32).reshape(-1)


# ---- bit unpacking (arrays (n_super_blocks, ...)) ----


def unpack_2bit(qs: np.ndarray) -> np.ndarray:
    """qs[64] -> 256 codes 0..3 (Q2_K, and the low bits of Q3_K).

    For each half h (128 values) byte ``32h + l`` holds, from bit 0 up, the codes of values
    ``128h + l``, ``+32``, ``+64``, ``+96``::

        qs[32h + l] = L[128h+l] | L[128h+l+32]<<2 | L[128h+l+64]<<4 | L[128h+l+96]<<6
    """
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def unpack_scales_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales[12] -> (8 scales, 8 mins) of Q4_K/Q5_K (get_scale_min_k4).

    bytes 0-3:  sc0..sc3 (bits 0-5) | high 2 bits of sc4..sc7 (bits 6-7)
    bytes 4-7:  m0..m3  (bits 0-5) | high 2 bits of m4..m7  (bits 6-7)
    bytes 8-11: low 4 bits of sc4..sc7 (bits 0-3) | low 4 bits of m4..m7 (bits 4-7)
    """
    sc = sc.astype(np.int64)
    ls = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def unpack_scales_q3(sc: np.ndarray) -> np.ndarray:
    """scales[12] -> sixteen signed scales (ls - 32) of Q3_K as int64; ls is 6 bits:

    bytes 0-7:  low 4 bits of scale j (bits 0-3) | low 4 bits of scale j+8 (bits 4-7)
    bytes 8-11: byte 8+k holds the high 2 bits of scales k, k+4, k+8, k+12 at bits 0-1, 2-3, 4-5, 6-7
    """
    sc = sc.astype(np.int64)
    low = np.concatenate([sc[:, 0:8] & 0xF, sc[:, 0:8] >> 4], axis=1)
    j = np.arange(16)
    high = (sc[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


def unpack_nibbles_k(qs: np.ndarray) -> np.ndarray:
    """qs[128] -> 256 codes (Q4_K, low 4 bits of Q5_K): ``qs[32c + l] = L[64c+l] | L[64c+32+l]<<4``."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0xF, q >> 4], axis=2).reshape(-1, 256)


def unpack_q6(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """(ql[128], qh[64]) -> 256 codes 0..63 of Q6_K.

    Per half h (128 values, ql offset 64h, qh offset 32h), l = 0..31::

        ql[64h + l]      = L[128h+l] & 0xF    | (L[128h+l+64] & 0xF) << 4
        ql[64h + l + 32] = L[128h+l+32] & 0xF | (L[128h+l+96] & 0xF) << 4
        qh[32h + l]      = L[128h+l]>>4 | (L[128h+l+32]>>4)<<2 | (L[128h+l+64]>>4)<<4 | (L[128h+l+96]>>4)<<6
    """
    ql = ql.reshape(-1, 2, 2, 32)
    qh = qh.reshape(-1, 2, 1, 32)
    lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (lo | (hi << 4)).reshape(-1, 256)


# ---- decoders ----


def dequantize_q2_k(b):
    sc = b[:, 0:16].astype(np.int64)
    q = unpack_2bit(b[:, 16:80]).astype(np.int64).reshape(-1, 16, 16)
    d = fp16_values(b[:, 80:82])[:, None]
    dmin = fp16_values(b[:, 82:84])[:, None]
    dl = (d * (sc & 0xF).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(-1, 256)


def dequantize_q3_k(b):
    hmask = b[:, 0:32]
    low = unpack_2bit(b[:, 32:96]).astype(np.int64)
    hbit = np.unpackbits(hmask[:, None, :], axis=1, count=8, bitorder="little").reshape(-1, 256)
    q = low - np.where(hbit == 1, 0, 4)
    sc = unpack_scales_q3(b[:, 96:108])
    d = fp16_values(b[:, 108:110])[:, None]
    dl = (d * sc.astype(np.float32))[:, :, None]
    return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)


def dequantize_q45_k(b, nmax):
    d = fp16_values(b[:, 0:2])[:, None]
    dmin = fp16_values(b[:, 2:4])[:, None]
    ls, lm = unpack_scales_k4(b[:, 4:16])
    if nmax == 15:
        q = unpack_nibbles_k(b[:, 16:144]).astype(np.int64)
    else:
        q = unpack_nibbles_k(b[:, 48:176]).astype(np.int64)
        hbit = np.unpackbits(b[:, None, 16:48], axis=1, count=8, bitorder="little").reshape(-1, 256)
        q = q + 16 * hbit
    dl = (d * ls.astype(np.float32))[:, :, None]
    ml = (dmin * lm.astype(np.float32))[:, :, None]
    return (dl * q.reshape(-1, 8, 32).astype(np.float32) - ml).reshape(-1, 256)


def dequantize_q6_k(b):
    q = unpack_q6(b[:, 0:128], b[:, 128:192]).astype(np.int64) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = fp16_values(b[:, 208:210])[:, None]
    return ((d * sc)[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)


# ---- the formats ----


class _KQuant(BlockwiseReference, FamilyKernelFormat):
    """The row kernels of kernels/kquants.py; numpy decoding per super-block."""
    kernel_module = kernels
    kernel_takes_flavor = True
    quant_paths = ALL_PATHS


class Q2_K(_KQuant, qtype=QuantType.Q2_K):
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; fp16 d @80; fp16 dmin @82 }
    scale_fields = ((80, "<f2"), (82, "<f2"))
    _dequantize_blocks = staticmethod(dequantize_q2_k)

    @classmethod
    def _kernel_quantize(cls, x, qw, has_qw, ik, out):
        super()._kernel_quantize(x, qw, has_qw, ik, out)
        if ik and not has_qw:           # ik's TriNet test, one llama-quantize chunk at a time
            kernels.q2_k_trinet(x, chunk_rows(x.shape[1]), out)


class Q3_K(_KQuant, qtype=QuantType.Q3_K):
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d @108 }
    scale_fields = ((108, "<f2"),)
    _dequantize_blocks = staticmethod(dequantize_q3_k)


class Q4_K(_KQuant, qtype=QuantType.Q4_K):
    # block_q4_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))
    _dequantize_blocks = staticmethod(partial(dequantize_q45_k, nmax=15))


class Q5_K(_KQuant, qtype=QuantType.Q5_K):
    # block_q5_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))
    _dequantize_blocks = staticmethod(partial(dequantize_q45_k, nmax=31))


class Q6_K(_KQuant, qtype=QuantType.Q6_K):
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d @208 }
    scale_fields = ((208, "<f2"),)
    _dequantize_blocks = staticmethod(dequantize_q6_k)
