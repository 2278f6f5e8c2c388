"""IQ2_K and IQ2_KS: 2-bit codes into a 4-value non-linear table, with a shifted twin per sub-block.

    IQ2_K   76 B per 256:  d fp16 | extra u16 (shift bit per 16-block) | scales[8] (4 bits, ls+8) | qs[64]
    IQ2_KS  fp16 row scale, then 70 B per 256:
            extra u16 (bits 0-7 shift of 32-block ib, bits 8-15 bit 4 of its scale) | scales[4] | qs[64]

    value = d * ls * T[q + 4*shift],   T = {-31, -13, 1, 17 | -26, -8, 6, 22}
    qs: value p of a super-block, ib32 = p/32, k = p%32: byte 32*(ib32/4) + k, bits 2*(ib32%4)

With four levels an exhaustive search is affordable: sort the sub-block's values, and every split
of the sorted list into four runs (levels T[0] <= T[1] <= T[2] <= T[3], or the mirror order for a
negative scale) is a candidate whose weighted least-squares scale comes from prefix sums; the
split explaining most of Σw·x² wins (specs/ik-quants.md §3e).  The sub-block scales are then
quantized together with ik's own ``make_qx_quants`` (§3c) and the codes re-derived.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq2k as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from . import decode
from ..tables import IQ2NL_VALUES
from ._iqk import nearest_index
from ._numeric import fp16_bytes, recip_or_zero, seq_sum
from .kquants import nearest_int

F = np.float32
ZERO_EPS = F(1e-16)
BASE = IQ2NL_VALUES[:4].astype(np.float32)
SHIFTED = IQ2NL_VALUES[4:].astype(np.float32)


def _sorted_prefix_sums(xb, w):
    """Prefix sums of w and w*x over each row sorted by x (ties by position): (rows, K+1) each."""
    order = np.argsort(xb, axis=1, kind="stable")
    xs = np.take_along_axis(xb, order, axis=1)
    ws = np.take_along_axis(w, order, axis=1)
    k = xb.shape[1]
    sumw = np.zeros((xb.shape[0], k + 1), np.float32)
    sumx = np.zeros((xb.shape[0], k + 1), np.float32)
    for j in range(k):
        sumw[:, j + 1] = sumw[:, j] + ws[:, j]
        sumx[:, j + 1] = sumx[:, j] + ws[:, j] * xs[:, j]
    return sumx, sumw


def exhaustive_search(xb, w, i1_max, i3_min):
    """(scale, shifted) of every row of xb by the four-level split search (§3e)."""
    k = xb.shape[1]
    sumx, sumw = _sorted_prefix_sums(xb, w)
    m = xb.shape[0]
    best = np.zeros(m, np.float32)
    d = np.zeros(m, np.float32)
    shifted = np.zeros(m, bool)
    tables = ((BASE, False), (SHIFTED, True), (BASE[::-1], False), (SHIFTED[::-1], True))
    with np.errstate(all="ignore"):
        for i1 in range(i1_max):
            for i2 in range(i1, k):
                for i3 in range(max(i2, i3_min), k):
                    gx = (sumx[:, i1] - sumx[:, 0], sumx[:, i2] - sumx[:, i1], sumx[:, i3] - sumx[:, i2],
                          sumx[:, k] - sumx[:, i3])
                    gw = (sumw[:, i1] - sumw[:, 0], sumw[:, i2] - sumw[:, i1], sumw[:, i3] - sumw[:, i2],
                          sumw[:, k] - sumw[:, i3])
                    for a, is_shifted in tables:
                        sqx = ((gx[0] * a[0] + gx[1] * a[1]) + gx[2] * a[2]) + gx[3] * a[3]
                        sq2 = (((gw[0] * a[0]) * a[0] + (gw[1] * a[1]) * a[1]) + (gw[2] * a[2]) * a[2]) \
                            + (gw[3] * a[3]) * a[3]
                        better = (sq2 > 0) & (sqx * sqx > best * sq2)
                        d = np.where(better, sqx / sq2, d).astype(np.float32)
                        best = np.where(better, d * sqx, best).astype(np.float32)
                        shifted = np.where(better, is_shifted, shifted)
    return d, shifted


def make_qx_quants_iqk(x, qw, nmax):
    """ik's make_qx_quants (iqk_quantize.cpp, §3c) on rows of x: (scale, codes l + nmax)."""
    amax = np.zeros(x.shape[0], np.float32)
    mx = np.zeros(x.shape[0], np.float32)
    for j in range(x.shape[1]):                 # the signed value of the first largest |x|
        a = np.abs(x[:, j])
        upd = a > amax
        amax = np.where(upd, a, amax)
        mx = np.where(upd, x[:, j], mx)
    zero = amax == 0
    mx = np.where(zero, F(1), mx)

    def run(iscale):
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = l.astype(np.float32)
        return seq_sum((qw * x) * lf), seq_sum((qw * lf) * lf), l

    with np.errstate(all="ignore"):
        sumlx, suml2, L = run(F(-nmax) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, F(0)).astype(np.float32)
        best = scale * sumlx
        for is_ in range(-9, 10):
            if is_ == 0:
                continue
            sx, s2, lt = run(-(F(nmax) + F(0.1) * F(is_)) / mx)
            better = (s2 > 0) & (sx * sx > best * s2)
            scale = np.where(better, sx / s2, scale).astype(np.float32)
            best = np.where(better, scale * sx, best).astype(np.float32)
            L = np.where(better[:, None], lt, L)
    return np.where(zero, F(0), scale).astype(np.float32), np.where(zero[:, None], 0, L + nmax)


def _weights(x, qw):
    """Weights per value: ``qw*sqrtf(sigma2 + x²)``, else ``sigma2/4 + x²``; sigma2 = 1.5*Σx²/256."""
    xs = x.reshape(-1, QK_K)
    sigma2 = ((F(1.5) * seq_sum(xs * xs)) / F(QK_K))[:, None]
    if qw is not None:
        w = qw.reshape(xs.shape) * np.sqrt(sigma2 + xs * xs)
    else:
        w = F(0.25) * sigma2 + xs * xs
    return w.astype(np.float32).reshape(-1)


def _sub_block_scales(x, qw, block, i1_max, i3_min):
    w = _weights(x, qw)
    xb, wb = x.reshape(-1, block), w.reshape(-1, block)
    sw = seq_sum(wb)
    zero = np.max(np.abs(xb), axis=1) < ZERO_EPS
    d, shifted = exhaustive_search(xb, wb, i1_max, i3_min)
    return xb, wb, sw, np.where(zero, F(0), d).astype(np.float32), shifted & ~zero


def _codes_and_fit(xb, wb, ls, d, shifted):
    """Codes for sub-block scales d*ls (none where that is 0) and the fit Σwqx, Σwq² in order."""
    dl = d * ls.astype(np.float32)
    idl = recip_or_zero(dl)[:, None] * xb
    L = np.where(shifted[:, None], nearest_index(SHIFTED, idl), nearest_index(BASE, idl))
    L = np.where((dl != 0)[:, None], L, 0)
    q = np.where(shifted[:, None], SHIFTED[L], BASE[L]) * ls.astype(np.float32)[:, None]
    q = np.where((dl != 0)[:, None], q, F(0))
    return L, w_fit(xb, wb, q)


def w_fit(xb, wb, q):
    wq = (wb * q).reshape(1, -1)
    return seq_sum(wq * xb.reshape(1, -1))[0], seq_sum(wq * q.reshape(1, -1))[0]


def _pack_qs(L):
    """(n_sb, 256) codes 0..3 -> (n_sb, 64)."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def quantize_iq2_k_row(x, qw):
    n_sb = x.size // QK_K
    out = np.zeros((n_sb, 76), np.uint8)
    xb, wb, sw, scales, shifted = _sub_block_scales(x, qw, 16, 16, 0)
    for sb in range(n_sb):
        sl = slice(16 * sb, 16 * sb + 16)
        if np.max(np.abs(scales[sl])) == 0:
            continue
        d, _ = make_qx_quants_iqk(scales[None, sl], sw[None, sl], 8)
        d = d[0]
        if d == 0:
            continue
        with np.errstate(all="ignore"):
            ls = np.clip(nearest_int((F(1) / d) * scales[sl]), -8, 7)
        L, (sumqx, sumq2) = _codes_and_fit(xb[sl], wb[sl], ls, d, shifted[sl])
        dd = sumqx / sumq2 if sumq2 > 0 else d
        extra = int((shifted[sl].astype(np.int64) << np.arange(16)).sum())
        u = (ls + 8).astype(np.uint8)
        out[sb] = np.concatenate([fp16_bytes(np.float32(F(1.030) * F(dd)).reshape(1))[0],
                                  np.array([extra & 0xFF, extra >> 8], np.uint8), u[0::2] | (u[1::2] << 4),
                                  _pack_qs(L.reshape(1, -1))[0]])
    return out.reshape(-1)


def quantize_iq2_ks_row(x, qw):
    n_sb = x.size // QK_K
    xb, wb, sw, scales, shifted = _sub_block_scales(x, qw, 32, 24, 8)
    blocks = np.zeros((n_sb, 70), np.uint8)
    shift_bits = (shifted.reshape(n_sb, 8).astype(np.int64) << np.arange(8)).sum(axis=1)
    d, Ls = make_qx_quants_iqk(scales[None, :], sw[None, :], 16)
    d, Ls = d[0], Ls[0]
    if d == 0:
        blocks[:, 0] = shift_bits
        return np.concatenate([fp16_bytes(np.zeros(1, np.float32))[0], blocks.reshape(-1)])
    ls = Ls - 16
    L, (sumqx, sumq2) = _codes_and_fit(xb, wb, ls, d, shifted)
    extra = shift_bits | ((Ls.reshape(n_sb, 8) >> 4) << (8 + np.arange(8))).sum(axis=1)
    lo = (Ls & 0xF).reshape(n_sb, 8).astype(np.uint8)
    blocks[:, 0] = extra & 0xFF
    blocks[:, 1] = extra >> 8
    blocks[:, 2:6] = lo[:, 0::2] | (lo[:, 1::2] << 4)
    blocks[:, 6:] = _pack_qs(L.reshape(n_sb, QK_K))
    dd = sumqx / sumq2 if sumq2 > 0 else d
    return np.concatenate([fp16_bytes(np.float32(F(1.030) * F(dd)).reshape(1))[0], blocks.reshape(-1)])


class _IQ2(RowwiseReference, KernelFormat):
    kernel_id: int = 0
    quant_paths = ALL_PATHS
    dequantize_ref = decode.dequantize_ref

    @classmethod
    def _kernel_quantize(cls, x, qw, has_qw, out):
        kernels.quantize_rows(cls.kernel_id, x, qw, has_qw, out)

    @classmethod
    def _kernel_dequantize(cls, blocks, out):
        kernels.dequantize_rows(cls.kernel_id, blocks, kernels.FP16_TABLE, out)


class IQ2_K(_IQ2, qtype=QuantType.IQ2_K):
    kernel_id = kernels.IQ2_K
    scale_fields = ((0, "<f2"),)
    qhelper_block = 16
    _quantize_row = staticmethod(quantize_iq2_k_row)


class IQ2_KS(_IQ2, qtype=QuantType.IQ2_KS):
    kernel_id = kernels.IQ2_KS
    qhelper_block = 32
    _quantize_row = staticmethod(quantize_iq2_ks_row)
