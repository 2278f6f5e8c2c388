"""IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT: ik_llama.cpp's trellis quants (written from its source; not in
the spec).  Codes index groups of integer values made by a hash (:mod:`._kt_codebook`).

A row is a float32 scale d and 256-value blocks of eight 32-value sub-blocks:

    IQ1_KT (56 B):  sh[8] | ql[32] | qh[16]      13-bit codes, groups of 8
        sh[ib] = scale index (IQ4_K table) | bit 12 of code j at bit 4+j
        code (ib, j) = ql[4ib+j] | nibble ib/4 of qh[4(ib%4)+j] << 8 | sh bit << 12
    IQ2_KT (68 B):  scales[4] | ql[64]            16-bit codes, groups of 8, uint16 LE in order
        sub-block ib's scale = IQ4_K table[nibble ib/4 of scales[ib%4]]
    IQ3_KT (100 B): scales[4] | ql[64] | qh[32]   codes of |x|; bit ib of qh[j] = sign of value j of
        sub-block ib; the scale is the nibble itself (0..15)
    IQ4_KT (128 B): 32 uint32 words; word ib (ib < 8) = bit 0: second table | bits 1-7: scale+64 |
        bits 8+3j..10+3j: code bits 12-14 of group j; then ql[64] (code bits 0-7) and qh[32]
        (code bits 8-11 of group g in nibble g/32 of qh[g%32]); 15-bit codes, groups of 4
    value = d * scale * trellis value

The quantizer (per sub-block: a few trial scales, each matched to codes, keep the best; then the
row scale and the sub-block scales; then a final matching pass) follows ik's AVX2 code, whose
arithmetic is part of the format's bytes: the nearest-code search adds each score as
``((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`` (for groups of 4: ``(s0+s2)+(s1+s3)``), breaks ties
between equal scores by SIMD lane before position, and the scale fit accumulates with fused
multiply-adds in 8 lanes.  ``fma32`` reproduces a float32 FMA exactly.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..kernels import kt as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from . import decode
from ..tables import IQ4K_VALUES
from ._iqk import nearest_index
from ._kt_codebook import IQ4_KT_SECOND_OFFSET, SPECS, cluster_of, codebook
from ._numeric import seq_sum
from .kquants import nearest_int

F = np.float32
KV = IQ4K_VALUES[:16].astype(np.float32)
BLOCK = 32
# SIMD lane of member position p % 8 in ik's group-of-4 search (two groups per 8-wide register)
LANE4 = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def fma32(a, b, c):
    """float32 a*b + c with one rounding.  a*b is exact in float64; the float64 sum is rounded to
    odd (nudged to an odd last bit when inexact), which makes the final rounding to float32 correct."""
    p = np.float64(a) * np.float64(b)
    c = np.float64(c)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    s = np.asarray(s, np.float64)
    odd = s.view(np.int64) & 1
    fix = (err != 0) & (odd == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def hsum8(v):
    """ik's horizontal sum of 8 lanes (last axis): ((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))."""
    p = v[..., :4] + v[..., 4:]
    return (p[..., 0] + p[..., 2]) + (p[..., 1] + p[..., 3])


class Matcher:
    """ik's find_best_match / find_best_scale for one codebook."""

    def __init__(self, name: str, offset: int | None = None):
        self.spec = SPECS[name]
        self.cb = codebook(name) if offset is None else codebook(name, offset)
        self.g = self.spec.group
        self.all_codes = np.arange(self.cb.values.shape[0])

    def match(self, d, xb, wb):
        """Codes of the groups of sub-block xb (32,) at scale d (0 gives code 0 everywhere)."""
        g = self.g
        ng = BLOCK // g
        if d == 0:
            return np.zeros(ng, np.int64)
        inv = F(1) / F(d)
        out = np.empty(ng, np.int64)
        for l in range(ng):
            vx = inv * xb[g * l:g * l + g]
            w = wb[g * l:g * l + g]
            c = int(cluster_of(self.spec, self.cb.mid, vx))
            pts = self.cb.members[c]
            vals = self.cb.member_values[c]
            if pts.size == 0:
                pts, vals = self.all_codes, self.cb.values
            diff = vals - vx
            sq = w * (diff * diff)
            if g == 8:
                score = hsum8(sq)
                lane = np.arange(pts.size) % 8
            else:
                score = (sq[:, 0] + sq[:, 2]) + (sq[:, 1] + sq[:, 3])
                lane = LANE4[np.arange(pts.size) % 8]
            cand = np.flatnonzero(score == score.min())
            out[l] = pts[cand[np.lexsort((cand, lane[cand]))[0]]]
        return out

    def fit(self, xb, wb, codes):
        """(d, score) of find_best_scale: the least-squares scale of xb for these codes."""
        q = self.cb.values[codes].reshape(-1)
        qw = q * wb
        sx = np.zeros(8, np.float32)
        s2 = np.zeros(8, np.float32)
        for l in range(0, BLOCK, 8):
            sx = fma32(qw[l:l + 8], xb[l:l + 8], sx)
            s2 = fma32(qw[l:l + 8], q[l:l + 8], s2)
        sumqx, sumq2 = hsum8(sx), hsum8(s2)
        if sumq2 > 0:
            return F(sumqx / sumq2), F(sumqx * sumqx / sumq2)
        return F(0), F(0)


_MATCHERS: dict = {}


def matcher(name: str, offset: int | None = None) -> Matcher:
    key = (name, offset)
    if key not in _MATCHERS:
        _MATCHERS[key] = Matcher(name, offset)
    return _MATCHERS[key]


def kt_weights(x, qw):
    """set_weights with sigma2 scale 2: per 256 block sigma2 = 2*Σx²/256; with an imatrix
    qw*sqrtf(sigma2 + x²) per 32-block (1e-4 where the block's sums are degenerate), else
    0.25*sigma2 + x²; an all-(almost)-zero 256 block gets 1e-4."""
    xs = x.reshape(-1, QK_K)
    sumx2 = seq_sum(xs * xs)
    sigma2 = (F(2) * sumx2) / F(QK_K)
    if qw is not None:
        xb = xs.reshape(xs.shape[0], 8, BLOCK)
        w = qw.reshape(xb.shape) * np.sqrt(sigma2[:, None, None] + xb * xb)
        bad = ((seq_sum(xb * xb) < F(1e-14)) | (seq_sum(w * w) < F(1e-14)) | (seq_sum(w * np.abs(xb)) < F(1e-14)))
        w = np.where(bad[..., None], F(1e-4), w).reshape(xs.shape)
    else:
        w = F(0.25) * sigma2[:, None] + xs * xs
    w = np.where((sumx2 < F(1e-14) * F(QK_K))[:, None], F(1e-4), w)
    return w.astype(np.float32).reshape(-1)


def _row_sums(xs, ws, qs):
    """Σ(w*x)*q and Σ(w*q)*q over a whole row, in order."""
    return seq_sum(((ws * xs) * qs).reshape(1, -1))[0], seq_sum(((ws * qs) * qs).reshape(1, -1))[0]


def _iq4k(v):
    return nearest_index(KV, np.asarray(v, np.float32))


# ---------------------------------------------------------------- IQ1_KT / IQ2_KT
def _quantize_small(name, x, qw):
    """IQ1_KT and IQ2_KT (groups of 8, signed values, IQ4_K scale table)."""
    m = matcher(name)
    one = name == "iq1_kt"
    n = x.size
    nsub = n // BLOCK
    w = kt_weights(x, qw)
    amax_row = np.abs(x).max()
    scales = np.zeros(nsub, np.float32)
    idx = np.zeros((nsub, 4), np.int64)
    max_scale = F(0)
    for ib in range(nsub):
        xb, wb = x[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        amax = np.abs(xb).max()
        if amax < F(1e-16):
            continue
        scale_0 = max(F(90), F(F(124) * amax) / amax_row)
        ip = m.match(F(amax / scale_0), xb, wb)
        dp, sp = m.fit(xb, wb, ip)
        im = m.match(F(-amax / scale_0), xb, wb)
        dm, sm = m.fit(xb, wb, im)
        if sp > sm:
            scales[ib], idx[ib] = dp, ip
        else:
            scales[ib], idx[ib], sp = dm, im, sm
        if one:
            scale_0 = F(scale_0 - F(8))
            ip = m.match(F(amax / scale_0), xb, wb)
            dp1, sp1 = m.fit(xb, wb, ip)
            im = m.match(F(-amax / scale_0), xb, wb)
            dm1, sm1 = m.fit(xb, wb, im)
            if sp1 > sp or sm1 > sp:
                if sp1 > sm1:
                    scales[ib], idx[ib] = dp1, ip
                else:
                    scales[ib], idx[ib] = dm1, im
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    row_bytes = 56 if one else 68
    nbl = n // QK_K
    blocks = np.zeros((nbl, row_bytes), np.uint8)
    if max_scale == 0:
        return np.concatenate([np.zeros(4, np.uint8), blocks.reshape(-1)])
    d = F(max_scale / KV[0])
    best = F(0)
    vals = m.cb.values
    for itry in range(-9, 10):
        inv = F(F(itry + int(KV[0])) / max_scale)
        dl = KV[_iq4k(inv * scales)]
        q = (dl[:, None] * vals[idx].reshape(nsub, BLOCK)).reshape(-1)
        sumqx, sumq2 = _row_sums(x, w, q)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = F(sumqx / sumq2)
            best = F(d * sumqx)
    inv = F(1) / d if d != 0 else F(0)
    ls = _iq4k(inv * scales)
    if d == 0:                          # unreachable (d comes from a nonzero sum); ik stops here
        return _pack_small(one, F(0), ls, np.zeros_like(idx), blocks)
    sumqx = sumq2 = F(0)
    for ib in range(nsub):
        xb, wb = x[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        lv = KV[ls[ib]]
        dl = F(d * lv)
        best_idx = m.match(dl, xb, wb)
        q1 = vals[idx[ib]].reshape(-1)
        q2 = vals[best_idx].reshape(-1)
        e1 = xb - dl * q1
        e2 = xb - dl * q2
        mse1 = seq_sum(((wb * e1) * e1)[None])[0]
        mse2 = seq_sum(((wb * e2) * e2)[None])[0]
        if mse1 < mse2:
            best_idx = idx[ib].copy()
        else:
            idx[ib] = best_idx
        q = vals[best_idx].reshape(-1) * lv
        for k in range(BLOCK):
            sumqx = F(sumqx + F(F(wb[k] * xb[k]) * q[k]))
            sumq2 = F(sumq2 + F(F(wb[k] * q[k]) * q[k]))
    if sumq2 > 0:
        d = F(sumqx / sumq2)
        if one:
            d = F(d * F(1.07))
    return _pack_small(one, d, ls, idx, blocks)


def _pack_small(one, d, ls, idx, blocks):
    nbl = blocks.shape[0]
    ls = ls.reshape(nbl, 8)
    idx = idx.reshape(nbl, 8, 4)
    if one:
        j = np.arange(4)
        blocks[:, 0:8] = (ls | ((idx >> 12) << (4 + j)).sum(axis=2)).astype(np.uint8)
        blocks[:, 8:40] = (idx & 0xFF).reshape(nbl, 32).astype(np.uint8)
        hi = (idx >> 8) & 0xF                                   # (nbl, 8, 4)
        blocks[:, 40:56] = (hi[:, :4] | (hi[:, 4:] << 4)).reshape(nbl, 16).astype(np.uint8)
    else:
        blocks[:, 0:4] = (ls[:, :4] | (ls[:, 4:] << 4)).astype(np.uint8)
        blocks[:, 4:68] = idx.astype("<u2").reshape(nbl, 32).view(np.uint8)
    return np.concatenate([np.array([d], "<f4").view(np.uint8), blocks.reshape(-1)])


# ---------------------------------------------------------------- IQ3_KT
def _quantize_iq3_kt(x, qw):
    m = matcher("iq3_kt")
    n = x.size
    nsub, nbl = n // BLOCK, n // QK_K
    blocks = np.zeros((nbl, 100), np.uint8)
    amax_row = np.abs(x).max()
    if amax_row == 0:
        return np.concatenate([np.zeros(4, np.uint8), blocks.reshape(-1)])
    w = kt_weights(x, qw)
    ax = np.abs(x)
    scales = np.zeros(nsub, np.float32)
    qtmp = np.zeros(n, np.float32)
    max_scale = F(0)
    for ib in range(nsub):
        xb, wb = ax[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        amax = xb.max()
        if amax < F(1e-16):
            continue
        scale_0 = max(F(84), F(F(123) * amax) / amax_row)
        best = F(0)
        keep = None
        for itry in range(-3, 4):
            codes = m.match(F(amax / F(scale_0 + F(8 * itry))), xb, wb)
            dd, score = m.fit(xb, wb, codes)
            if score > best:
                best, scales[ib], keep = score, dd, codes
        if keep is None:
            raise ValueError("IQ3_KT: no scale found for a block (ik aborts here)")
        qtmp[BLOCK * ib:BLOCK * ib + BLOCK] = m.cb.values[keep].reshape(-1)
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    d = F(max_scale / F(15))
    best = F(0)
    for itry in range(-9, 10):
        inv = F(F(F(itry * F(0.2)) + F(15)) / max_scale)
        ls = np.clip(nearest_int(inv * scales), 0, 15).astype(np.float32)
        q = (ls[:, None] * qtmp.reshape(nsub, BLOCK)).reshape(-1)
        sumqx, sumq2 = _row_sums(ax, w, q)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = F(sumqx / sumq2)
            best = F(d * sumqx)
    inv = F(1) / d if d != 0 else F(0)
    ls = np.clip(nearest_int(inv * scales), 0, 15).astype(np.int64)
    idx = np.zeros((nsub, 4), np.int64)
    sumqx = sumq2 = F(0)
    vals = m.cb.values
    for ib in range(nsub):
        xb, wb = ax[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        dl = F(d * F(ls[ib]))
        idx[ib] = m.match(dl, xb, wb)
        q = vals[idx[ib]].reshape(-1) * F(ls[ib])
        for k in range(BLOCK):
            sumqx = F(sumqx + F(F(wb[k] * xb[k]) * q[k]))
            sumq2 = F(sumq2 + F(F(wb[k] * q[k]) * q[k]))
    if sumq2 > 0:
        d = F(sumqx / sumq2)
    ls = ls.reshape(nbl, 8)
    blocks[:, 0:4] = (ls[:, :4] | (ls[:, 4:] << 4)).astype(np.uint8)
    blocks[:, 4:68] = idx.reshape(nbl, 32).astype("<u2").view(np.uint8)
    neg = (x.reshape(nbl, 8, BLOCK) < 0).astype(np.int64)
    blocks[:, 68:100] = (neg << np.arange(8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([np.array([d], "<f4").view(np.uint8), blocks.reshape(-1)])


# ---------------------------------------------------------------- IQ4_KT
def _iq4_trials(m, xb, wb, amax, scale_0, best):
    """IQ4_KT's ten trial scales ±amax/(scale_0 + 8*itry) with one codebook: (best score, the
    scale that beat ``best`` last, or None)."""
    scale = None
    for itry in range(-2, 3):
        den = F(F(8 * itry) + scale_0)
        for sgn in (1, -1):
            dd, score = m.fit(xb, wb, m.match(F(sgn * amax / den), xb, wb))
            if score > best:
                best, scale = score, dd
    return best, scale


def _quantize_iq4_kt(x, qw):
    m1, m2 = matcher("iq4_kt"), matcher("iq4_kt", IQ4_KT_SECOND_OFFSET)
    n = x.size
    nsub, nbl = n // BLOCK, n // QK_K
    w = kt_weights(x, qw)
    words = np.zeros((nbl, 32), np.uint32)
    amax_row = np.abs(x).max()
    if amax_row == 0:
        return np.concatenate([np.zeros(4, np.uint8), words.view(np.uint8).reshape(-1)])
    scales = np.zeros(nsub, np.float32)
    second = np.zeros(nsub, bool)
    max_scale = F(0)
    for ib in range(nsub):
        xb, wb = x[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        amax = np.abs(xb).max()
        if amax < F(1e-16):
            continue
        scale_0 = max(F(90), F(F(124) * amax) / amax_row)
        best, scale = _iq4_trials(m1, xb, wb, amax, scale_0, F(0))
        if scale is not None:
            scales[ib] = scale
        dd, score = m2.fit(xb, wb, m2.match(scales[ib], xb, wb))
        if score > best:               # ik does not raise best here
            scales[ib] = dd
            second[ib] = True
        best, scale = _iq4_trials(m2, xb, wb, amax, scale_0, best)
        if scale is not None:
            scales[ib] = scale
            second[ib] = True
        if abs(scales[ib]) > abs(max_scale):
            max_scale = scales[ib]
    d = F(-max_scale / F(64))
    if d == 0:
        return np.concatenate([np.zeros(4, np.uint8), words.view(np.uint8).reshape(-1)])
    inv = F(1) / d
    ls = np.minimum(nearest_int(inv * scales), 63).astype(np.int64)
    idx = np.zeros((nsub, 8), np.int64)
    sumqx = sumq2 = F(0)
    for ib in range(nsub):
        m = m2 if second[ib] else m1
        xb, wb = x[BLOCK * ib:BLOCK * ib + BLOCK], w[BLOCK * ib:BLOCK * ib + BLOCK]
        dl = F(d * F(ls[ib]))
        idx[ib] = m.match(dl, xb, wb)
        q = m.cb.values[idx[ib]].reshape(-1) * F(ls[ib])
        for k in range(BLOCK):
            sumqx = F(sumqx + F(F(wb[k] * xb[k]) * q[k]))
            sumq2 = F(sumq2 + F(F(wb[k] * q[k]) * q[k]))
    if sumq2 > 0:
        d = F(sumqx / sumq2)
    idx = idx.reshape(nbl, 8, 8)
    j = np.arange(8)
    head = ((((ls.reshape(nbl, 8) + 64) << 1) & 0xFF) | second.reshape(nbl, 8)
            | ((idx >> 12) << (8 + 3 * j)).sum(axis=2))
    words[:, :8] = head.astype(np.uint32)
    tail = np.zeros((nbl, 96), np.uint8)
    flat = idx.reshape(nbl, 64)
    tail[:, :64] = flat & 0xFF
    hi = (flat >> 8) & 0xF
    tail[:, 64:96] = hi[:, :32] | (hi[:, 32:] << 4)
    words[:, 8:] = tail.view("<u4")
    return np.concatenate([np.array([d], "<f4").view(np.uint8), words.view(np.uint8).reshape(-1)])


_QUANTIZERS = {
    "iq1_kt": lambda x, qw: _quantize_small("iq1_kt", x, qw),
    "iq2_kt": lambda x, qw: _quantize_small("iq2_kt", x, qw),
    "iq3_kt": _quantize_iq3_kt,
    "iq4_kt": _quantize_iq4_kt,
}


def quantize_kt_row(name, x, qw):
    return _QUANTIZERS[name](np.asarray(x, np.float32), qw)


# ---------------------------------------------------------------- formats
@lru_cache(maxsize=None)
def _kernel_tables(name, offset=None):
    """The codebook as the kernels take it (kernels/kt.py), built once per process."""
    cb = codebook(name) if offset is None else codebook(name, offset)
    # float16 bits: the search widens them in one instruction (numba has no float16 arrays)
    return (cb.mid, cb.offsets, cb.flat_members, cb.flat_values_t.astype(np.float16).view(np.uint16),
            np.ascontiguousarray(cb.values.T).astype(np.float16).view(np.uint16), cb.values)


def _fast_small(one):
    def run(x, qw, has_qw, out):
        kernels.quantize_small_rows(x, qw, has_qw, out, one, *_kernel_tables("iq1_kt" if one else "iq2_kt"))
    return run


def _fast_iq3(x, qw, has_qw, out):
    kernels.quantize_iq3_rows(x, qw, has_qw, out, *_kernel_tables("iq3_kt"))


def _fast_iq4(x, qw, has_qw, out):
    kernels.quantize_iq4_rows(x, qw, has_qw, out, _kernel_tables("iq4_kt"),
                              _kernel_tables("iq4_kt", IQ4_KT_SECOND_OFFSET))


class _KT(RowwiseReference, KernelFormat):
    """The KT quantizers take the imatrix as it is (no QHelper clean-up)."""
    kind: int = 0

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        x = np.ascontiguousarray(x, np.float32)
        qw = None if imatrix is None else np.asarray(imatrix, np.float32)
        out = np.empty((x.shape[0], cls.traits.row_size(x.shape[1])), np.uint8)
        with np.errstate(all="ignore"):
            for r in range(x.shape[0]):
                out[r] = quantize_kt_row(cls.traits.name, x[r], qw)
        return out

    dequantize_ref = decode.dequantize_ref

    @classmethod
    def _kernel_dequantize(cls, blocks, out):
        kernels.dequantize_rows(blocks, cls.kind, out)


class IQ1_KT(_KT, qtype=QuantType.IQ1_KT):
    quant_paths = ALL_PATHS
    kind = 1
    _kernel_quantize = staticmethod(_fast_small(True))


class IQ2_KT(_KT, qtype=QuantType.IQ2_KT):
    quant_paths = ALL_PATHS
    kind = 2
    _kernel_quantize = staticmethod(_fast_small(False))


class IQ3_KT(_KT, qtype=QuantType.IQ3_KT):
    quant_paths = ALL_PATHS
    kind = 3
    _kernel_quantize = staticmethod(_fast_iq3)


class IQ4_KT(_KT, qtype=QuantType.IQ4_KT):
    quant_paths = ALL_PATHS
    kind = 4
    _kernel_quantize = staticmethod(_fast_iq4)
