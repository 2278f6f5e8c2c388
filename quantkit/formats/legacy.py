"""The legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Each row is cut into blocks of 32 values; a block stores an fp16 scale ``d`` (plus an fp16 offset
``m`` for the ``_1`` types) and one small integer code per value (specs/ggml-quants.md §1.2–1.3)::

    Q4_0  y = (q - 8)*d     q in 0..15           d[0:2]                  qs[2:18]
    Q4_1  y = q*d + m       q in 0..15           d[0:2]  m[2:4]          qs[4:20]
    Q5_0  y = (q - 16)*d    q in 0..31           d[0:2]         qh[2:6]  qs[6:22]
    Q5_1  y = q*d + m       q in 0..31           d[0:2]  m[2:4] qh[4:8]  qs[8:24]
    Q8_0  y = q*d           q in -128..127       d[0:2]                  qs[2:34] (int8)

``qs`` byte j holds code j in bits 0-3 and code j+16 in bits 4-7; ``qh`` is a little-endian uint32
whose bit e is bit 4 of code e.  d and m are little-endian fp16.

Quantizers (§1.6).  Without an imatrix every flavor runs the ``quantize_row_*_ref`` functions: a
scale from the block's extreme values and codes by truncating casts.  With an imatrix the weight of
value ``x`` is ``qw*sqrt(sigma2 + x*x)`` (``sigma2`` = mean of x² over the whole row) and the scale
comes from a weighted search whose details differ between the projects:

* ``"ik"`` (ik_llama.cpp): Q4_0/Q5_0 use the fork's ``make_qx_quants`` (mainline's search, with
  every step also tried with the opposite sign, then a greedy one-code-at-a-time refinement);
  Q4_1/Q5_1 use the fork's ``make_qkx3_quants`` (double-precision sums, the error of a trial computed
  from the sums, then a greedy refinement).
* ``"mainline"`` (llama.cpp): ``make_qx_quants`` / ``make_qkx3_quants`` as in ggml-quants.c, all in
  float32 and without the refinements.

Q8_0 ignores the imatrix in both projects.

The reference code below is vectorised across blocks but keeps the C evaluation order of every
float32 (or double) expression and accumulates sums over the 32 values of a block one value at a time,
because any other order changes the last bit of a scale and, through it, codes.
"""
from __future__ import annotations

import numpy as np

from ..kernels import legacy as kernels
from ..types import QuantType
from ._numeric import first_absmax as _first_absmax, fp16_bytes as _fp16_bytes
from ._numeric import recip_or_zero as _recip_or_zero, seq_sum as _seq_sum
from ._base import BlockFormat, KernelFormat
from . import decode
# The weighted scale searches (both flavors) are shared with the k-quants, which use them most.
from .kquants import make_qkx3_quants, make_qx_quants

QK = 32                     # values per block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0)
F = np.float32

# ---- float helpers ----




def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: nearest integer, halves away from zero.  ``v - trunc(v)`` is exact in float32,
    so comparing it with 0.5 avoids the ``floor(|v| + 0.5)`` trap at 0.49999997."""
    t = np.trunc(v)
    frac = v - t
    return t + (frac >= F(0.5)).astype(np.float32) - (frac <= F(-0.5)).astype(np.float32)


def _c_int_cast(v: np.ndarray) -> np.ndarray:
    """Low byte (0..255) of C's float -> int8_t / uint8_t cast as x86 code does it: truncate to int32
    (NaN and out-of-range values give INT32_MIN) and keep 8 bits.  For in-range values this is
    trunc(v); the rest only happens when 1/d overflows to Inf, and C then writes code 0."""
    with np.errstate(invalid="ignore"):
        return v.astype(np.int32).astype(np.int64) & 0xFF


def _as_int8(b: np.ndarray) -> np.ndarray:
    """Sign-extend a low byte (the int8_t reading)."""
    return (b ^ 0x80) - 0x80






def _min_max(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequential ``if (v < min) min = v; if (v > max) max = v;`` from (FLT_MAX, -FLT_MAX).
    Written out because np.min may return -0.0 where C keeps an earlier +0.0 (m is stored)."""
    big = np.finfo(np.float32).max
    mn = np.full(xb.shape[0], big, np.float32)
    mx = np.full(xb.shape[0], -big, np.float32)
    for j in range(xb.shape[1]):
        v = xb[:, j]
        mn = np.where(v < mn, v, mn)
        mx = np.where(v > mx, v, mx)
    return mn, mx


def _row_sigma2(x: np.ndarray) -> np.ndarray:
    """Σx²/n_per_row per row, accumulated in float32 from column 0 on (the legacy *_impl functions)."""
    return _seq_sum(x * x) / F(x.shape[1])


def _imatrix_weights(x: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """``qw*sqrtf(sigma2 + x*x)`` as (n_rows*n_blocks, 32) float32."""
    n_rows, n = x.shape
    sigma2 = _row_sigma2(x)[:, None]
    w = imatrix[None, :] * np.sqrt(sigma2 + x * x)
    return w.astype(np.float32).reshape(n_rows * (n // QK), QK)


# ---- bit packing ----


def _pack_nibbles(q: np.ndarray, mask: bool) -> np.ndarray:
    """(n_blocks, 32) codes -> qs (n_blocks, 16): byte j = code j (low nibble) | code j+16 (high).

    C's 4-bit packers write ``lo | hi << 4`` as uint8 and the 5-bit ones mask both to 4 bits first;
    the two differ only for codes above 15, which the 4-bit quantizers never produce.
    """
    q = (q & 0xFF).astype(np.uint8)
    lo, hi = q[:, :16], q[:, 16:]
    if mask:
        lo, hi = lo & 0x0F, hi & 0x0F
    return lo | (hi << 4)


def _pack_qh(q: np.ndarray) -> np.ndarray:
    """(n_blocks, 32) 5-bit codes -> qh (n_blocks, 4).

    qh is one little-endian uint32; bit e holds bit 4 of code e::

        qh[0]: codes 7..0  (bit 0 = code 0)     qh[2]: codes 23..16
        qh[1]: codes 15..8                      qh[3]: codes 31..24
    """
    bits = (((q & 0xFF).astype(np.uint8) >> 4) & 1)
    return np.packbits(bits, axis=-1, bitorder="little")


class _LegacyFormat(BlockFormat):
    """Shared driver: rows -> (n_blocks, 32) blocks -> per-type block code -> rows of bytes."""
    nmax: int               # Q*_0: codes are l + nmax with l in -nmax..nmax-1; Q*_1: codes 0..nmax
    affine: bool = False    # stores an fp16 offset m after d
    high_bits: bool = False  # stores the 5th code bit in qh

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
        # Extreme inputs overflow in C too (1/d of a block of tiny values, x² of huge ones, a scale
        # beyond the fp16 range); the Inf/NaN then flow through exactly as they do there.
        with np.errstate(invalid="ignore", over="ignore"):
            if imatrix is None:
                parts = cls._quantize_blocks_plain(xb)
            else:
                parts = cls._quantize_blocks_imatrix(xb, _imatrix_weights(x, imatrix), flavor)
        return np.concatenate(parts, axis=-1).reshape(n_rows, cls.traits.row_size(n))

    @classmethod
    def quantize_fast(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        out = cls.empty_blocks(n_rows, n)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if imatrix is None or cls.qtype == QuantType.Q8_0:
            kernels.quantize_rows_plain(int(cls.qtype), x, out)
        else:
            kernels.quantize_rows_imatrix(int(cls.qtype), x, np.ascontiguousarray(imatrix, np.float32),
                                          flavor == "ik", out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        blocks = np.ascontiguousarray(blocks, np.uint8)
        kernels.dequantize_rows(int(cls.qtype), blocks, kernels.FP16_TABLE, out)
        return out

    @classmethod
    def _pack(cls, d, m, q):
        """Block fields in struct order: d, [m], [qh], qs."""
        parts = [_fp16_bytes(d)]
        if cls.affine:
            parts.append(_fp16_bytes(m))
        if cls.high_bits:
            parts.append(_pack_qh(q))
        parts.append(_pack_nibbles(q, cls.high_bits))
        return parts

    @classmethod
    def _quantize_blocks_plain(cls, xb):
        if cls.affine:     # quantize_row_q4_1_ref / q5_1_ref
            mn, mx = _min_max(xb)
            d = (mx - mn) / F(cls.nmax)
            id_ = _recip_or_zero(d)
            q = _c_int_cast((xb - mn[:, None]) * id_[:, None] + F(0.5))
            if not cls.high_bits:       # Q4_1: MIN(15, (int8_t)v); Q5_1: (uint8_t)v
                q = np.minimum(_as_int8(q), cls.nmax)
            return cls._pack(d, mn, q)
        # quantize_row_q4_0_ref / q5_0_ref: d = max/-nmax, so the extreme value maps to code 0
        _, mx = _first_absmax(xb)
        d = mx / F(-cls.nmax)
        id_ = _recip_or_zero(d)
        q = _c_int_cast(xb * id_[:, None] + (F(cls.nmax) + F(0.5)))
        return cls._pack(d, None, np.minimum(_as_int8(q), 2 * cls.nmax - 1))

    @classmethod
    def _quantize_blocks_imatrix(cls, xb, w, flavor):
        if cls.affine:
            d, the_min, L = make_qkx3_quants(xb, w, cls.nmax, flavor)
            return cls._pack(d, -the_min, L)
        d, L = make_qx_quants(xb, w, cls.nmax, flavor)
        return cls._pack(d, None, L)

    dequantize_ref = decode.dequantize_ref


# Without an imatrix mainline and ik run the same *_ref code; with one they differ (see above).
_LEGACY_PATHS = frozenset({("ik", False), ("ik", True), ("mainline", False), ("mainline", True)})


class Q4_0(_LegacyFormat, qtype=QuantType.Q4_0):
    nmax = 8
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS


class Q4_1(_LegacyFormat, qtype=QuantType.Q4_1):
    nmax = 15
    affine = True
    scale_fields = ((0, "<f2"), (2, "<f2"))
    quant_paths = _LEGACY_PATHS


class Q5_0(_LegacyFormat, qtype=QuantType.Q5_0):
    nmax = 16
    high_bits = True
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS


class Q5_1(_LegacyFormat, qtype=QuantType.Q5_1):
    nmax = 31
    affine = True
    high_bits = True
    scale_fields = ((0, "<f2"), (2, "<f2"))
    quant_paths = _LEGACY_PATHS


class Q8_0(_LegacyFormat, qtype=QuantType.Q8_0):
    """``d = amax/127``, ``q = roundf(x/d)``; the imatrix is ignored by both projects."""
    quant_paths = _LEGACY_PATHS
    scale_fields = ((0, "<f2"),)

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
        amax = np.zeros(xb.shape[0], np.float32)
        for j in range(QK):                         # C: amax = MAX(amax, fabsf(v))
            v = np.abs(xb[:, j])
            amax = np.where(amax > v, amax, v)
        d = amax / F(127)
        id_ = _recip_or_zero(d)
        with np.errstate(invalid="ignore", over="ignore"):       # 1/d may overflow, as in C
            q = _c_int_cast(_roundf(xb * id_[:, None])).astype(np.uint8)     # (int8_t)roundf(x/d)
        return np.concatenate([_fp16_bytes(d), q], axis=-1).reshape(n_rows, cls.traits.row_size(n))


class Q6_0(KernelFormat, _LegacyFormat, qtype=QuantType.Q6_0):
    """ik_llama.cpp's 6-bit block (llama-quantize's fallback for IQ5_K/Q5_K rows that are not a
    multiple of 256).  Its quantizer is always the fork's ``make_qx_quants`` with nmax 32, weighted by
    ``x²`` or, with an imatrix, ``qw*sqrtf(sigma2 + x²)``; it exists only in ik, so both flavors run it.

        d[0:2]  qh[2:10]  qs[10:26]
        qs[j]: low nibble = low 4 bits of code j, high nibble = those of code j+16 (j < 16)
        qh[k]: 2-bit pairs (code k, code k+16, code k+8, code k+24) >> 4, from bit 0 up
    """
    nmax = 32
    scale_fields = ((0, "<f2"),)
    quant_paths = _LEGACY_PATHS
    _kernel_quantize = staticmethod(kernels.quantize_rows_q6_0)

    @staticmethod
    def _kernel_dequantize(blocks, out):
        kernels.dequantize_rows_q6_0(blocks, kernels.FP16_TABLE, out)

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        xb = x.reshape(-1, QK)
        with np.errstate(invalid="ignore", over="ignore"):
            w = xb * xb if imatrix is None else _imatrix_weights(x, imatrix)
            d, L = make_qx_quants(xb, w.astype(np.float32), cls.nmax, "ik")
        L = (L & 0x3F).astype(np.uint8)
        qs = (L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)
        h = (L[:, :16] >> 4) | ((L[:, 16:] >> 4) << 2)           # (n_blocks, 16) 4-bit pairs
        qh = h[:, :8] | (h[:, 8:] << 4)
        return np.concatenate([_fp16_bytes(d), qh, qs], axis=-1).reshape(n_rows, cls.traits.row_size(n))
