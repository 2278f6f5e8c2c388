"""IQ4_NL and IQ4_XS: 4-bit codes that index a fixed non-linear table of 16 int8 values.

    IQ4_NL  32 values:  y = d*T[q]                     fp16 d, qs[16]
    IQ4_XS  256 values: y = d*(ls-32)*T[q] per 32      fp16 d, uint16 scales_h, scales_l[4], qs[128]

    T = kvalues_iq4nl = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

Both types run one quantizer (quantize_row_iq4_nl_impl) with ``ntry = 7``, with or without an
imatrix (specs/ggml-quants.md §1.6).  Per 32-value block: weights ``qw*sqrtf(sigma2 + x²)`` with an
imatrix (``sigma2 = 2*Σx²/super_block_size``), else ``x²``; start from ``d = max/127`` and try the
inverse scales ``(itry - 127)/max``, keeping the weighted least-squares scale with the best
``Σwqx²/Σwq²``.  ik_llama.cpp also tries ``(itry + 113)/max`` (the mirrored table), keeps the codes
of the best trial and then moves one code at a time while the fit improves; it does not guard the first
``Σwqx/Σwq²`` against 0/0.  IQ4_NL stores fp16(d) and re-derives the codes with the *unrounded* d;
IQ4_XS quantizes the eight block scales to 6 bits against ``d = -max_scale/32`` and re-derives the
codes from ``d*l`` (unrounded).

``best_index`` is "the nearest table value, an exact tie goes to the upper one".  Mainline finds it by
binary search, ik with a 241-entry lookup on ``(int)x`` whose entries are either that index or a pair
to compare (checked against the C table); the two agree except for NaN (mainline 15, ik 0) and for
|x| >= 2^31, where ik's float-to-int conversion overflows to INT_MIN and gives 0.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq4 as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, BlockFormat
from . import decode
from .kquants import GROUP_MAX_EPS, first_absmax, fp16_bytes, nearest_int, recip_or_zero, seq_sum

F = np.float32
QK4_NL = 32
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
KV = KVALUES.astype(np.float32)


def best_index(x: np.ndarray, flavor: str) -> np.ndarray:
    """Index of the table value nearest to float32 x (ties to the upper index), int64."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        mu = np.clip(np.searchsorted(KV, x, side="right"), 1, 15)   # KV[mu-1] <= x < KV[mu]
        res = np.where(x - KV[mu - 1] < KV[mu] - x, mu - 1, mu)
        res = np.where(x <= KV[0], 0, np.where(x >= KV[15], 15, res))
        if flavor == "ik":
            res = np.where(np.isnan(x) | (x >= F(2.0 ** 31)), 0, res)
    return res.astype(np.int64)


def _trial(x, w, iscale, flavor):
    """Codes of one trial inverse scale and their sums Σ(w*q)*x, Σ(w*q)*q (float32, C order)."""
    L = best_index(iscale[:, None] * x, flavor)
    q = KV[L]
    wq = w * q
    return L, seq_sum(wq * x), seq_sum(wq * q)


def _search(x, w, flavor):
    """Per-block scale search of quantize_row_iq4_nl_impl (ntry = 7); lanes = 32-value blocks."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        d = -mx / KV[0]
        L, sumqx, sumq2 = _trial(x, w, F(1) / d, flavor)
        if flavor == "ik":
            d = sumqx / sumq2                           # unguarded: 0/0 gives NaN (kept)
        else:
            d = np.where(sumq2 > 0, sumqx / sumq2, F(0)).astype(np.float32)
        best = d * sumqx
        for itry in range(-7, 8):
            starts = (KVALUES[0], KVALUES[15]) if flavor == "ik" else (KVALUES[0],)
            for v0 in starts:
                lt, sx, s2 = _trial(x, w, F(itry + v0) / mx, flavor)
                better = (s2 > 0) & (sx * sx > best * s2)
                d = np.where(better, sx / s2, d)
                best = np.where(better, d * sx, best)
                sumqx = np.where(better, sx, sumqx)
                sumq2 = np.where(better, s2, sumq2)
                L = np.where(better[:, None], lt, L)
        if flavor == "ik":
            d = _refine(x, w, d, best, sumqx, sumq2, L, ~zero)
    return np.where(zero, F(0), d).astype(np.float32)


def _refine(x, w, d, best, sumqx, sumq2, L, active):
    """ik: move the code with the smallest step (value gap / gradient ``d*w*(x - d*T[L])``) one level
    towards x while ``sumqx²/sumq2`` grows; at most 32*32 steps."""
    d, best, sumqx, sumq2, L = d.copy(), best.copy(), sumqx.copy(), sumq2.copy(), L.copy()
    act = np.nonzero(active)[0]
    inf = F(np.inf)
    for _ in range(32 * QK4_NL):
        if act.size == 0:
            break
        xa, wa, la, da = x[act], w[act], L[act], d[act]
        g = (da[:, None] * wa) * (xa - da[:, None] * KV[la])
        up = (g > 0) & (la < 15)
        down = (g < 0) & (la > 0)
        with np.errstate(all="ignore"):
            step = np.where(up, (KV[np.minimum(la + 1, 15)] - KV[la]) / g,
                            np.where(down, (KV[np.maximum(la - 1, 0)] - KV[la]) / g, inf))
        j = np.argmin(step, axis=1)                    # first of equal minima (C: strict '<')
        rows = np.arange(act.size)
        found = step[rows, j] < inf
        direction = np.where(up[rows, j], 1, -1)
        lj = la[rows, j]
        lt = np.clip(lj + direction, 0, 15)
        a, b = KVALUES[lt], KVALUES[lj]
        wj, xj = wa[rows, j], xa[rows, j]
        nsx = sumqx[act] + (wj * xj) * (a - b).astype(np.float32)
        ns2 = sumq2[act] + wj * (a * a - b * b).astype(np.float32)
        ok = found & (ns2 > 0) & (nsx * nsx > best[act] * ns2)
        k = act[ok]
        sumqx[k], sumq2[k] = nsx[ok], ns2[ok]
        d[k] = sumqx[k] / sumq2[k]
        best[k] = d[k] * sumqx[k]
        L[k, j[ok]] = lt[ok]
        act = k
    return d


def _weights(x, qw, sbs):
    """(n_blocks, 32) weights: ``qw*sqrtf(sigma2 + x*x)`` (sigma2 per super-block of sbs) or ``x*x``."""
    xs = x.reshape(-1, sbs)
    if qw is None:
        return (xs * xs).reshape(-1, QK4_NL)
    sigma2 = seq_sum(xs * xs) * (F(2) / F(sbs))          # C: sigma2 *= 2.f/super_block_size
    w = np.tile(qw, x.shape[0]).reshape(-1, sbs) * np.sqrt(sigma2[:, None] + xs * xs)
    return w.astype(np.float32).reshape(-1, QK4_NL)


def pack_nibbles(L: np.ndarray) -> np.ndarray:
    """(n_blocks, 32) codes -> (n_blocks, 16): byte j = code j (low nibble) | code j+16 (high)."""
    q = L.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_iq4_nl(x, qw, flavor):
    xb = x.reshape(-1, QK4_NL)
    d = _search(xb, _weights(x, qw, QK4_NL), flavor)
    with np.errstate(all="ignore"):
        L = best_index(recip_or_zero(d)[:, None] * xb, flavor)   # a NaN d is truthy: 1/NaN
    return np.concatenate([fp16_bytes(d), pack_nibbles(L)], axis=1)


def quantize_iq4_xs(x, qw, flavor):
    xb = x.reshape(-1, QK4_NL)
    n_sb = xb.shape[0] // 8
    scales = _search(xb, _weights(x, qw, QK_K), flavor).reshape(n_sb, 8)
    amax_scale = np.zeros(n_sb, np.float32)
    max_scale = np.zeros(n_sb, np.float32)
    for ib in range(8):
        a = np.abs(scales[:, ib])
        upd = a > amax_scale
        amax_scale = np.where(upd, a, amax_scale)
        max_scale = np.where(upd, scales[:, ib], max_scale)
    d = -max_scale / F(32)
    idv = recip_or_zero(d)
    l = np.clip(nearest_int(idv[:, None] * scales), -32, 31)
    dl = d[:, None] * l.astype(np.float32)
    idl = recip_or_zero(dl.reshape(-1))
    L = best_index(idl[:, None] * xb, flavor)
    ls = (l + 32).astype(np.int64)
    # scales_l[k]: low 4 bits of block 2k (bits 0-3) and 2k+1 (bits 4-7);
    # scales_h (uint16, little-endian): bits 2ib..2ib+1 = high 2 bits of block ib
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.zeros(n_sb, np.int64)
    for ib in range(8):
        scales_h |= (ls[:, ib] >> 4) << (2 * ib)
    sh = scales_h.astype("<u2").view(np.uint8).reshape(n_sb, 2)
    qs = pack_nibbles(L).reshape(n_sb, 128)
    return np.concatenate([fp16_bytes(d), sh, scales_l, qs], axis=1)


class _IQ4(BlockFormat):
    kernel_id: int = 0
    quant_paths = ALL_PATHS

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        x = np.ascontiguousarray(x, np.float32)
        qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
        out = cls._quantize_blocks(x, qw, flavor)
        return np.ascontiguousarray(out, np.uint8).reshape(n_rows, cls.traits.row_size(n))

    dequantize_ref = decode.dequantize_ref

    @classmethod
    def quantize_fast(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        out = cls.empty_blocks(n_rows, n)
        x = np.ascontiguousarray(x, np.float32)
        has_qw = imatrix is not None
        qw = np.ascontiguousarray(imatrix, np.float32) if has_qw else np.zeros(n, np.float32)
        kernels.quantize_rows(cls.kernel_id, x, qw, has_qw, flavor == "ik", out)
        return out

    @classmethod
    def dequantize_fast(cls, blocks, n_per_row):
        out = np.empty((blocks.shape[0], n_per_row), np.float32)
        kernels.dequantize_rows(cls.kernel_id, np.ascontiguousarray(blocks, np.uint8), kernels.FP16_TABLE, out)
        return out


class IQ4_NL(_IQ4, qtype=QuantType.IQ4_NL):
    kernel_id = kernels.IQ4_NL
    # block_iq4_nl { fp16 d @0; uint8 qs[16] }
    scale_fields = ((0, "<f2"),)

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return quantize_iq4_nl(x, qw, flavor)


class IQ4_XS(_IQ4, qtype=QuantType.IQ4_XS):
    kernel_id = kernels.IQ4_XS
    # block_iq4_xs { fp16 d @0; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128] }
    scale_fields = ((0, "<f2"),)

    @classmethod
    def _quantize_blocks(cls, x, qw, flavor):
        return quantize_iq4_xs(x, qw, flavor)
