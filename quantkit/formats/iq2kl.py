"""IQ2_KL: pairs of values coded together, 2.6875 bits per weight (ik_llama.cpp; not in the spec,
written from its source).

A row is an fp16 scale and 86-byte blocks of 256 values:

    scales_h u16  | scales_l[4] | qs[64] | qh[16]
    32-value sub-block ib: 6-bit scale ls+32 = nibble ib/4 of scales_l[ib%4] | bits 2ib..2ib+1 of scales_h
    value pair j (values 2j, 2j+1) of sub-block ib: 5-bit pair code =
        nibble ib%2 of qs[16*(ib/2) + j] | bit ib of qh[j] << 4
    (value 2j, value 2j+1) = d * ls * PAIRS[code]

PAIRS are 32 of the 64 pairs of IQ3_K's base table.  A pair of values is coded by rounding each to
the table; if that pair is not one of the 32, the best of eight listed neighbours (weighted squared
distance) replaces it.  The scale search is IQ3_K-like without the shifted table (11 trial scales,
both signs); the row scale then re-picks each sub-block's 6-bit scale among three neighbours by
weighted error.  Weights: ``qw*sqrtf(sigma2 + x²)`` (sigma2 = 2.25*Σx²/256) or ``|x|``.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq2kl as kernels
from ..kernels.iq2kl import NEIGHBOURS, PAIR_INDEX, PAIRS
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from . import decode
from ..tables import IQ3NL_VALUES
from ._iqk import nearest_index
from ._numeric import first_absmax, fp16_bytes, seq_sum
from .kquants import nearest_int

F = np.float32
ZERO_EPS = F(1e-16)
BASE = IQ3NL_VALUES[:8].astype(np.float32)


def pair_codes(isc, x1, x2, w1, w2):
    """Pair code of every (x1, x2) at inverse scales isc (broadcast), see the module docstring."""
    s1, s2 = isc * x1, isc * x2
    i = PAIR_INDEX[8 * nearest_index(BASE, s1) + nearest_index(BASE, s2)]
    neigh = NEIGHBOURS[np.maximum(-i - 1, 0)]                          # (..., 8)
    d1 = PAIRS[neigh, 0] - s1[..., None]
    d2 = PAIRS[neigh, 1] - s2[..., None]
    score = (w1[..., None] * d1) * d1 + (w2[..., None] * d2) * d2
    best = np.take_along_axis(neigh, np.argmin(score, axis=-1)[..., None], axis=-1)[..., 0]
    return np.where(i >= 0, i, best)


def _fit(x1, x2, w1, w2, codes, ls=None):
    """Σ(w*q)*x and Σ(w*q)*q per row, pair by pair (the two products of a pair added first)."""
    q1, q2 = PAIRS[codes, 0], PAIRS[codes, 1]
    if ls is not None:
        q1, q2 = ls * q1, ls * q2
    return seq_sum((w1 * q1) * x1 + (w2 * q2) * x2), seq_sum((w1 * q1) * q1 + (w2 * q2) * q2)


def _search(xb, wb):
    x1, x2, w1, w2 = xb[:, 0::2], xb[:, 1::2], wb[:, 0::2], wb[:, 1::2]
    amax, mx = first_absmax(xb)
    zero = amax < ZERO_EPS
    with np.errstate(all="ignore"):
        mx = np.where(zero, F(1), mx)
        d = -mx / BASE[0]
        isc = (F(1) / d)[:, None]
        sp, s2p = _fit(x1, x2, w1, w2, pair_codes(isc, x1, x2, w1, w2))
        sm, s2m = _fit(x1, x2, w1, w2, pair_codes(-isc, x1, x2, w1, w2))
        d = sp / s2p
        best = d * sp
        better = (s2m > 0) & (sm * sm > best * s2m)
        d = np.where(better, sm / s2m, d).astype(np.float32)
        best = np.where(better, d * sm, best).astype(np.float32)
        for itry in range(-5, 6):
            isc = (F(itry + BASE[0]) / mx)[:, None]
            for sign in (F(1), F(-1)):
                sx, s2 = _fit(x1, x2, w1, w2, pair_codes(sign * isc, x1, x2, w1, w2))
                better = (s2 > 0) & (sx * sx > best * s2)
                d = np.where(better, sx / s2, d).astype(np.float32)
                best = np.where(better, d * sx, best).astype(np.float32)
    return np.where(zero, F(0), d).astype(np.float32)


def quantize_iq2_kl_row(x, qw):
    n_sb = x.size // QK_K
    xs = x.reshape(-1, QK_K)
    sigma2 = (seq_sum(xs * xs) * (F(2.25) / F(QK_K)))[:, None]
    w = qw.reshape(xs.shape) * np.sqrt(sigma2 + xs * xs) if qw is not None else np.abs(xs)
    xb, wb = x.reshape(-1, 32), w.astype(np.float32).reshape(-1, 32)
    scales = _search(xb, wb)
    blocks = np.zeros((n_sb, 86), np.uint8)
    amax = np.abs(scales)
    if not amax.any():
        return np.concatenate([fp16_bytes(np.zeros(1, np.float32))[0], blocks.reshape(-1)])
    max_scale = scales[np.argmax(amax)]                 # first largest |scale|
    d = -max_scale / F(32)
    x1, x2, w1, w2 = xb[:, 0::2], xb[:, 1::2], wb[:, 0::2], wb[:, 1::2]
    ls = np.clip(nearest_int((F(1) / d) * scales), -32, 31)
    best_score = np.full(len(xb), np.finfo(np.float32).max, np.float32)
    best_ls = ls.copy()
    with np.errstate(all="ignore"):
        for off in (-1, 0, 1):
            ils = ls + off
            ok = (ils >= -32) & (ils <= 31)
            dl = d * ils.astype(np.float32)
            idl = np.where(dl != 0, F(1) / dl, F(0))[:, None]
            c = pair_codes(idl, x1, x2, w1, w2)
            d1 = dl[:, None] * PAIRS[c, 0] - x1
            d2 = dl[:, None] * PAIRS[c, 1] - x2
            score = seq_sum((w1 * d1) * d1 + (w2 * d2) * d2)
            better = ok & (score < best_score)
            best_score = np.where(better, score, best_score)
            best_ls = np.where(better, ils, best_ls)
        ls = best_ls
        dl = d * ls.astype(np.float32)
        idl = np.where(ls != 0, F(1) / dl, F(0))[:, None]
        codes = np.where((ls != 0)[:, None], pair_codes(idl, x1, x2, w1, w2), 0)
        lsf = np.where(ls != 0, ls, 0).astype(np.float32)[:, None]
        a, b = _fit(x1.reshape(1, -1), x2.reshape(1, -1), w1.reshape(1, -1), w2.reshape(1, -1),
                    codes.reshape(1, -1), np.repeat(lsf, 16, axis=1).reshape(1, -1))
    sumqx, sumq2 = a[0], b[0]
    if sumq2 > 0:
        d = sumqx / sumq2
    uls = (ls + 32).reshape(n_sb, 8)
    sh = ((uls >> 4) << (2 * np.arange(8))).sum(axis=1)
    lo = (uls & 0xF).astype(np.uint8)
    c = codes.reshape(n_sb, 8, 16)
    blocks[:, 0] = sh & 0xFF
    blocks[:, 1] = sh >> 8
    blocks[:, 2:6] = lo[:, :4] | (lo[:, 4:] << 4)
    blocks[:, 6:70] = ((c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)).reshape(n_sb, 64).astype(np.uint8)
    blocks[:, 70:86] = np.bitwise_or.reduce(((c >> 4) & 1) << np.arange(8)[None, :, None], axis=1).astype(np.uint8)
    return np.concatenate([fp16_bytes(np.float32(F(1.025) * F(d)).reshape(1))[0], blocks.reshape(-1)])


class IQ2_KL(RowwiseReference, KernelFormat, qtype=QuantType.IQ2_KL):
    quant_paths = ALL_PATHS
    _quantize_row = staticmethod(quantize_iq2_kl_row)
    _kernel_quantize = staticmethod(kernels.quantize_rows)
    dequantize_ref = decode.dequantize_ref

    @staticmethod
    def _kernel_dequantize(blocks, out):
        kernels.dequantize_rows(blocks, kernels.FP16_TABLE, out)
