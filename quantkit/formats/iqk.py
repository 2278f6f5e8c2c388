"""IQ3_K, IQ4_K, IQ5_K, IQ6_K and IQ4_KS: ik_llama.cpp's non-linear types with a scale per sub-block.

Every value is ``d * ls * T[q]`` with T a fixed table of integers (specs/ik-quants.md §2) and a
per-sub-block bit choosing the table's "shifted" half.  Blocks (one 256-value super-block):

    IQ3_K  110 B  d fp16 | extra u16 | signs u16 | scales_l[8] 4-bit |ls|  | qs[64] 2 bits | qh[32] 1 bit
    IQ4_K  144 B  d fp16 | extra u16 | scales_h[4] 2 bits | scales_l[8] 4 bits | qs[128] 4 bits
    IQ5_K  176 B  d fp16 | extra u16 | scales_h[4] | scales_l[8]                 | qs[128] | qh[32] 1 bit
    IQ6_K  212 B  d fp16 | extra u16 | scales int8[16]                           | qs[128] | qh[64] 2 bits
    IQ4_KS 136 B  scales[8] (7-bit odd scale << 1 | shift bit) | qs[128], after a float32 row scale

Sub-blocks hold 16 values (32 for IQ4_KS).  Bit layouts, for value p of a super-block, ib32 = p/32,
k = p%32 (ib = p/16 is the sub-block):

    qs, 2 bits (IQ3_K):  qs[32*(ib32/4) + k] >> 2*(ib32%4)            (Q2_K's layout)
    qs, 4 bits, IQ4_K:   qs[16*ib32 + k%16], low nibble for k < 16, high nibble for k >= 16
    qs, 4 bits, IQ5/6_K: qs[32*(ib32/2) + k], low nibble for even ib32, high for odd
    qh, 1 bit:           qh[k] >> ib32
    qh, 2 bits (IQ6_K):  qh[32*(ib32/4) + k] >> 2*(ib32%4)

Quantization (§3b): for each sub-block try a range of inverse scales around ``T[0]/max`` against the
base and the shifted table, each with the codes of x and of -x (a negative scale mirrors the
table), and keep the weighted least-squares scale that explains most of Σw·x² (largest
``Σwqx²/Σwq²``).  IQ3/5/6_K then re-fit the scale to the chosen codes.  The sub-block scales are
quantized against one super-block scale and the codes re-derived with the quantized scales; the
stored ``d`` is the least-squares fit over the whole super-block (row for IQ4_KS).  Weights are
``qw*sqrtf(sigma2 + x²)`` with an imatrix (cleaned by QHelper first), else ``x²`` (IQ4_K, IQ4_KS)
or ``sigma2/4 + x²``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import iqk as kernels
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from . import decode
from ..tables import IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from ._iqk import TWO_POW_31, imatrix_cleanup, nearest_index
from ._numeric import first_absmax, fp16_bytes, recip_or_zero, seq_sum
from .kquants import nearest_int

F = np.float32
ZERO_EPS = F(1e-16)         # a sub-block whose max |x| is below this is stored as zero


@dataclass(frozen=True)
class Search:
    """How one type searches a sub-block's scale."""
    values: np.ndarray          # float32 base table
    shifted: np.ndarray         # float32 shifted table
    ntry: int                   # inverse scales (itry*step + T[0])/max for itry in -ntry..ntry
    step: int
    guarded_first_fit: bool     # IQ3_K: the first fit only if Σwq² > 0 (else it keeps -max/T[0])
    refit: bool                 # IQ3/5/6_K: least-squares re-fit to the chosen codes
    overflow: float = float(TWO_POW_31)     # where ik's (int)x lookup gives up (NaN, huge)


def _f(v):
    return np.asarray(v, np.float32)


IQ3_SEARCH = Search(_f(IQ3NL_VALUES[:8]), _f(IQ3NL_VALUES[8:]), 3, 2, True, True)
IQ4_SEARCH = Search(_f(IQ4K_VALUES[:16]), _f(IQ4K_VALUES[16:]), 7, 1, False, False)
IQ5_SEARCH = Search(_f(IQ5NL_VALUES[:32]), _f(IQ5NL_VALUES[32:]), 5, 1, False, True)
# IQ6_K's lookup is (int)(x - T[0]): it overflows once x + 127 rounds to 2^31
IQ5_KS_SEARCH = Search(_f(IQ5NL_VALUES[:32]), _f(IQ5NL_VALUES[32:]), 5, 1, False, False)
IQ3_KS_SEARCH = Search(_f(IQ3NL_VALUES[:8]), _f(IQ3NL_VALUES[8:]), 5, 1, True, False)
IQ6_SEARCH = Search(_f(IQ6NL_VALUES[:64]), _f(IQ6NL_VALUES[:64]) + F(1), 5, 1, False, True,
                    overflow=float(F(2.0 ** 31) - F(128)))


def _codes(tab, x, overflow):
    return nearest_index(tab, x, overflow)


def _trial(xb, w, isc, tab, overflow):
    """Σ(w*q)*x and Σ(w*q)*q (float32, in value order) for the codes of x*isc and of -x*isc."""
    al = isc[:, None] * xb
    qp = tab[_codes(tab, al, overflow)]
    qm = tab[_codes(tab, -al, overflow)]
    wp, wm = w * qp, w * qm
    return seq_sum(wp * xb), seq_sum(wp * qp), seq_sum(wm * xb), seq_sum(wm * qm)


def search_scales(xb: np.ndarray, w: np.ndarray, s: Search) -> tuple[np.ndarray, np.ndarray]:
    """Scale and shifted-table flag of every sub-block (rows of xb), §3b."""
    amax, mx = first_absmax(xb)
    zero = amax < ZERO_EPS
    with np.errstate(all="ignore"):
        mx_safe = np.where(zero, F(1), mx)
        d = -mx_safe / s.values[0]
        sp, s2p, sm, s2m = _trial(xb, w, F(1) / d, s.values, s.overflow)
        if s.guarded_first_fit:
            ok = s2p > 0
            d = np.where(ok, sp / s2p, d).astype(np.float32)
            best = np.where(ok, d * sp, F(0)).astype(np.float32)
        else:
            d = sp / s2p
            best = d * sp
        better = (s2m > 0) & (sm * sm > best * s2m)
        d = np.where(better, sm / s2m, d).astype(np.float32)
        best = np.where(better, d * sm, best).astype(np.float32)
        shifted = np.zeros(xb.shape[0], bool)
        for itry in range(-s.ntry, s.ntry + 1):
            for tab, is_shifted in ((s.values, False), (s.shifted, True)):
                sp, s2p, sm, s2m = _trial(xb, w, F(itry * s.step + tab[0]) / mx_safe, tab, s.overflow)
                for sx, s2 in ((sp, s2p), (sm, s2m)):
                    better = (s2 > 0) & (sx * sx > best * s2)
                    d = np.where(better, sx / s2, d).astype(np.float32)
                    best = np.where(better, d * sx, best).astype(np.float32)
                    shifted = np.where(better, is_shifted, shifted)
        if s.refit:
            tab_rows = np.where(shifted[:, None], s.shifted[None, :], s.values[None, :])
            al = recip_or_zero(d)[:, None] * xb
            idx = np.where(shifted[:, None], _codes(s.shifted, al, s.overflow), _codes(s.values, al, s.overflow))
            q = np.take_along_axis(tab_rows, idx, axis=1)
            wq = w * q
            sx, s2 = seq_sum(wq * xb), seq_sum(wq * q)
            d = np.where((d != 0) & (s2 > 0), sx / s2, d).astype(np.float32)
    return np.where(zero, F(0), d).astype(np.float32), shifted & ~zero


def _sigma2(x: np.ndarray, factor: float) -> np.ndarray:
    """factor*Σx²/256 per super-block, (n_sb,) float32 (C: ``(factor*sumx2)/256``)."""
    xs = x.reshape(-1, QK_K)
    return (F(factor) * seq_sum(xs * xs)) / F(QK_K)


def _weights(x, qw, factor, plain_sigma):
    """(n_values,) weights in value order: ``qw*sqrtf(sigma2 + x²)`` with an imatrix, else ``x²`` or
    ``sigma2/4 + x²`` (``plain_sigma``)."""
    xs = x.reshape(-1, QK_K)
    sigma2 = _sigma2(x, factor)[:, None]
    if qw is not None:
        w = qw.reshape(xs.shape) * np.sqrt(sigma2 + xs * xs)
    elif plain_sigma:
        w = F(0.25) * sigma2 + xs * xs
    else:
        w = xs * xs
    return w.astype(np.float32).reshape(-1)


def _quantize_with(xb, d_sub, shifted, s):
    """Codes of every sub-block for the quantized sub-block scales d_sub (0 -> codes of 0)."""
    al = recip_or_zero(d_sub)[:, None] * xb
    return np.where(shifted[:, None], _codes(s.shifted, al, s.overflow), _codes(s.values, al, s.overflow))


def _fit(x, w, q_values, n_groups):
    """Σ(w*q)*x / Σ(w*q)*q over groups of values in order -> (sumqx, sumq2) per group."""
    wq = (w * q_values).reshape(n_groups, -1)
    return seq_sum(wq * x.reshape(n_groups, -1)), seq_sum(wq * q_values.reshape(n_groups, -1))


# ---------------------------------------------------------------------------------- bit packing
def _pack_2bit_q2k(L):
    """(n_sb, 256) codes 0..3 -> (n_sb, 64): value p in byte 32*(p/128) + p%32, bits 2*((p%128)/32)."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _pack_bits(L, nbits_shift):
    """(n_sb, 256) one bit (after >> nbits_shift) per value -> (n_sb, 32): bit ib32 of byte k."""
    b = ((L >> nbits_shift) & 1).reshape(-1, 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(b << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def _pack_nibbles_64(L):
    """(n_sb, 256) 4-bit codes -> (n_sb, 128): chunk c of 64 values in bytes 32c.., low nibble the
    first 32 values, high nibble the next 32 (IQ5_K/IQ6_K)."""
    L = (L & 0xF).reshape(-1, 4, 2, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def _pack_nibbles_32(L):
    """(n, 32k) 4-bit codes -> bytes: per 32 values, byte j = code j | code j+16 << 4 (IQ4_K/IQ4_KS)."""
    L = (L & 0xF).reshape(-1, 2, 16).astype(np.uint8)
    return L[:, 0] | (L[:, 1] << 4)


def _pack_6bit_scales(ls6):
    """(n_sb, 16) stored scales 0..63 -> scales_h (n_sb, 4), scales_l (n_sb, 8)."""
    ls6 = ls6.astype(np.uint8)
    sl = (ls6[:, 0::2] & 0xF) | ((ls6[:, 1::2] & 0xF) << 4)
    h = (ls6 >> 4).reshape(-1, 4, 4)
    sh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    return sh, sl


def _u16_bytes(v):
    return np.asarray(v, "<u2").view(np.uint8).reshape(-1, 2)


def _extra_bits(flags):
    """(n_sb, 16) bool -> uint16 with bit ib set."""
    return (flags.astype(np.uint32) << np.arange(flags.shape[1], dtype=np.uint32)).sum(axis=1)


# ---------------------------------------------------------------------------------- quantizers
def _track_max_scale(scales):
    """The signed scale with the largest |.| of each super-block (first on ties, strict '>')."""
    amax = np.zeros(scales.shape[0], np.float32)
    mxs = np.zeros(scales.shape[0], np.float32)
    for ib in range(scales.shape[1]):
        a = np.abs(scales[:, ib])
        upd = a > amax
        amax = np.where(upd, a, amax)
        mxs = np.where(upd, scales[:, ib], mxs)
    return amax, mxs


def _sub_blocks(x, qw, search, factor, plain_sigma, block=16):
    w = _weights(x, qw, factor, plain_sigma)
    xb = x.reshape(-1, block)
    wb = w.reshape(-1, block)
    d, shifted = search_scales(xb, wb, search)
    return xb, wb, d, shifted


def quantize_iq4_k(x, qw):
    n_sb = x.size // QK_K
    s = IQ4_SEARCH
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 2.0, False)
    scales, shifted = scales.reshape(n_sb, 16), shifted.reshape(n_sb, 16)
    _, max_scale = _track_max_scale(scales)
    d = -max_scale / F(32)
    l = np.clip(nearest_int(recip_or_zero(d)[:, None] * scales), -32, 31)
    dl = (d[:, None] * l.astype(np.float32)).reshape(-1)
    L = _quantize_with(xb, dl, shifted.reshape(-1), s)
    q = np.where(shifted.reshape(-1)[:, None], s.shifted[L], s.values[L]) * l.reshape(-1, 1).astype(np.float32)
    sumqx, sumq2 = _fit(xb, wb, q, n_sb)
    with np.errstate(all="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, d).astype(np.float32)
    sh, sl = _pack_6bit_scales(l + 32)
    return np.concatenate([fp16_bytes(d), _u16_bytes(_extra_bits(shifted)), sh, sl,
                           _pack_nibbles_32(L.reshape(n_sb, QK_K)).reshape(n_sb, 128)], axis=1)


def _quantize_iq56(x, qw, s, smax):
    n_sb = x.size // QK_K
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 2.0, True)
    scales, shifted = scales.reshape(n_sb, 16), shifted.reshape(n_sb, 16)
    amax, max_scale = _track_max_scale(scales)
    with np.errstate(all="ignore"):
        d = -max_scale / F(smax)
        ls = np.clip(nearest_int((F(1) / d)[:, None] * scales), -smax, smax - 1 if smax == 32 else smax)
    dl = (d[:, None] * ls.astype(np.float32)).reshape(-1)
    L = np.where((dl != 0)[:, None], _quantize_with(xb, dl, shifted.reshape(-1), s), 0)
    q = np.where(shifted.reshape(-1)[:, None], s.shifted[L], s.values[L]) * ls.reshape(-1, 1).astype(np.float32)
    q = np.where((dl != 0)[:, None], q, F(0))
    sumqx, sumq2 = _fit(xb, wb, q, n_sb)
    with np.errstate(all="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, d).astype(np.float32)
    zero = amax == 0
    L = L.reshape(n_sb, QK_K)
    return zero, d, _u16_bytes(_extra_bits(shifted)), ls, L


def quantize_iq5_k(x, qw):
    zero, d, extra, ls, L = _quantize_iq56(x, qw, IQ5_SEARCH, 32)
    sh, sl = _pack_6bit_scales(ls + 32)
    out = np.concatenate([fp16_bytes(d), extra, sh, sl, _pack_nibbles_64(L), _pack_bits(L, 4)], axis=1)
    out[zero] = 0
    return out


def quantize_iq6_k(x, qw):
    zero, d, extra, ls, L = _quantize_iq56(x, qw, IQ6_SEARCH, 127)
    hi = (L >> 4).reshape(-1, 2, 4, 32).astype(np.uint8)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([fp16_bytes(d), extra, ls.astype(np.int8).view(np.uint8), _pack_nibbles_64(L), qh], axis=1)
    out[zero] = 0
    return out


def quantize_iq3_k(x, qw):
    n_sb = x.size // QK_K
    s = IQ3_SEARCH
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 1.5, True)
    shifted = shifted & (scales != 0)               # a sub-block that ends at scale 0 keeps no flag
    scales, shifted = scales.reshape(n_sb, 16), shifted.reshape(n_sb, 16)
    max_abs = np.max(np.abs(scales), axis=1)
    with np.errstate(all="ignore"):
        d = max_abs / F(31)
        ls = np.clip(nearest_int(F(0.5) * ((F(1) / d)[:, None] * np.abs(scales) - F(1))), 0, 15)
    neg = scales < 0
    sls = (2 * ls + 1) * np.where(neg, -1, 1)
    dl = (d[:, None] * sls.astype(np.float32)).reshape(-1)
    ok = (dl != 0)[:, None]
    L = np.where(ok, _quantize_with(xb, dl, shifted.reshape(-1), s), 0)
    q = np.where(shifted.reshape(-1)[:, None], s.shifted[L], s.values[L]) * sls.reshape(-1, 1).astype(np.float32)
    sumqx, sumq2 = _fit(xb, wb, np.where(ok, q, F(0)), n_sb)
    with np.errstate(all="ignore"):
        d = F(1.01) * np.where(sumq2 > 0, sumqx / sumq2, d).astype(np.float32)
    L = L.reshape(n_sb, QK_K)
    sl = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    out = np.concatenate([fp16_bytes(d), _u16_bytes(_extra_bits(shifted)), _u16_bytes(_extra_bits(neg)), sl,
                          _pack_2bit_q2k(L & 3), _pack_bits(L, 2)], axis=1)
    out[max_abs == 0] = 0
    return out


def quantize_iq4_ks_row(x, qw):
    """One row: float32 row scale, then 136-byte blocks."""
    n_sb = x.size // QK_K
    s = IQ4_SEARCH
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 2.0, False, block=32)
    d = F(np.fmax.reduce(np.abs(scales), initial=F(0))) / F(127)
    if d == 0:
        blocks = np.zeros((n_sb, 136), np.uint8)
        blocks[:, :8] = shifted.reshape(n_sb, 8)
        return np.concatenate([np.float32(0).reshape(1).view(np.uint8), blocks.reshape(-1)])
    l = (np.clip(nearest_int(F(0.5) * (F(1) / d * scales + F(127))), 0, 127) << 1)
    scale_bytes = (l | shifted).astype(np.uint8)
    dl = d * (l - 127).astype(np.float32)
    L = _quantize_with(xb, dl, shifted, s)
    q = np.where(shifted[:, None], s.shifted[L], s.values[L]) * (l - 127).astype(np.float32)[:, None]
    # C adds the products of values j and j+16 before accumulating
    wq, xq = wb * q, xb
    a = (wq[:, :16] * xq[:, :16] + wq[:, 16:] * xq[:, 16:]).reshape(-1)
    b = (wq[:, :16] * q[:, :16] + wq[:, 16:] * q[:, 16:]).reshape(-1)
    sumqx, sumq2 = seq_sum(a[None, :])[0], seq_sum(b[None, :])[0]
    if sumq2 > 0:
        d = sumqx / sumq2
    blocks = np.concatenate([scale_bytes.reshape(n_sb, 8), _pack_nibbles_32(L).reshape(n_sb, 128)], axis=1)
    return np.concatenate([np.float32(d).reshape(1).view(np.uint8), blocks.reshape(-1)])


def _row_fit(xb, wb, L, shifted, ls, s):
    """Σ(w*q)*x and Σ(w*q)*q over a whole row, value by value (q = T[code]*ls)."""
    q = np.where(shifted[:, None], s.shifted[L], s.values[L]) * ls.astype(np.float32)[:, None]
    wq = (wb * q).reshape(1, -1)
    return seq_sum(wq * xb.reshape(1, -1))[0], seq_sum(wq * q.reshape(1, -1))[0]


def quantize_iq5_ks_row(x, qw):
    """One row: float32 row scale, then 168-byte blocks (scales[8] as IQ4_KS, qs[128], qh[32])."""
    n_sb = x.size // QK_K
    s = IQ5_KS_SEARCH
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 2.0, False, block=32)
    d = F(np.fmax.reduce(np.abs(scales), initial=F(0))) / F(127)
    blocks = np.zeros((n_sb, 168), np.uint8)
    blocks[:, :8] = shifted.reshape(n_sb, 8)
    if d == 0:
        return np.concatenate([np.float32(0).reshape(1).view(np.uint8), blocks.reshape(-1)])
    l = np.clip(nearest_int(F(0.5) * (F(1) / d * scales + F(127))), 0, 127) << 1
    blocks[:, :8] |= l.reshape(n_sb, 8).astype(np.uint8)
    ls = l - 127
    L = _quantize_with(xb, d * ls.astype(np.float32), shifted, s)
    sumqx, sumq2 = _row_fit(xb, wb, L, shifted, ls, s)
    if sumq2 > 0:
        d = sumqx / sumq2
    L = L.reshape(n_sb, QK_K)
    blocks[:, 8:136] = _pack_nibbles_64(L)          # 32-block ib: qs[32*(ib/2) + j], nibble ib%2
    blocks[:, 136:] = _pack_bits(L, 4)
    return np.concatenate([np.float32(d).reshape(1).view(np.uint8), blocks.reshape(-1)])


def quantize_iq3_ks_row(x, qw):
    """One row: fp16 row scale, then 102-byte blocks (extra u16, scales[4], qs[64], qh[32])."""
    n_sb = x.size // QK_K
    s = IQ3_KS_SEARCH
    xb, wb, scales, shifted = _sub_blocks(x, qw, s, 2.0, False, block=32)
    _, max_scale = _track_max_scale(scales[None, :])
    d = -max_scale[0] / F(16)
    shift_bits = (shifted.reshape(n_sb, 8).astype(np.int64) << (8 + np.arange(8))).sum(axis=1)
    blocks = np.zeros((n_sb, 102), np.uint8)
    if d == 0:
        blocks[:, 1] = shift_bits >> 8
        return np.concatenate([fp16_bytes(np.float32(d).reshape(1))[0], blocks.reshape(-1)])
    ls = np.clip(nearest_int((F(1) / d) * scales), -16, 15)
    ul = (ls + 16).reshape(n_sb, 8)
    extra = shift_bits | ((ul >> 4) << np.arange(8)).sum(axis=1)
    L = _quantize_with(xb, d * ls.astype(np.float32), shifted, s)
    sumqx, sumq2 = _row_fit(xb, wb, L, shifted, ls, s)
    if sumq2 > 0:
        d = sumqx / sumq2
    L = L.reshape(n_sb, QK_K)
    lo = (ul & 0xF).astype(np.uint8)
    blocks[:, 0] = extra & 0xFF
    blocks[:, 1] = extra >> 8
    blocks[:, 2:6] = lo[:, :4] | (lo[:, 4:] << 4)          # block ib: nibble ib/4 of byte ib%4
    blocks[:, 6:70] = _pack_2bit_q2k(L & 3)
    blocks[:, 70:] = _pack_bits(L, 2)
    return np.concatenate([fp16_bytes(np.float32(d).reshape(1))[0], blocks.reshape(-1)])


# ---------------------------------------------------------------------------------- formats
class _SuperBlockIQK(KernelFormat):
    kernel_id: int = 0
    quant_paths = ALL_PATHS
    scale_fields = ((0, "<f2"),)
    qhelper_block = 16

    @classmethod
    def quantize_ref(cls, x, imatrix, flavor):
        n_rows, n = x.shape
        x = np.ascontiguousarray(x, np.float32)
        w_rows = imatrix_cleanup(x, imatrix, cls.qhelper_block)
        out = np.empty((n_rows, cls.traits.row_size(n)), np.uint8)
        with np.errstate(all="ignore"):
            if w_rows is None:          # without an imatrix every super-block is independent
                out[:] = cls._quantize(x.reshape(-1), None).reshape(n_rows, -1)
            else:
                for r in range(n_rows):
                    out[r] = cls._quantize(x[r], w_rows[r]).reshape(-1)
        return out

    dequantize_ref = decode.dequantize_ref

    @classmethod
    def _kernel_quantize(cls, x, qw, has_qw, out):
        kernels.quantize_rows(cls.kernel_id, x, qw, has_qw, out)

    @classmethod
    def _kernel_dequantize(cls, blocks, out):
        kernels.dequantize_rows(cls.kernel_id, blocks, kernels.FP16_TABLE, out)


class IQ3_K(_SuperBlockIQK, qtype=QuantType.IQ3_K):
    kernel_id = kernels.IQ3_K
    _quantize = staticmethod(quantize_iq3_k)


class IQ4_K(_SuperBlockIQK, qtype=QuantType.IQ4_K):
    kernel_id = kernels.IQ4_K
    _quantize = staticmethod(quantize_iq4_k)


class IQ5_K(_SuperBlockIQK, qtype=QuantType.IQ5_K):
    kernel_id = kernels.IQ5_K
    _quantize = staticmethod(quantize_iq5_k)


class IQ6_K(_SuperBlockIQK, qtype=QuantType.IQ6_K):
    kernel_id = kernels.IQ6_K
    _quantize = staticmethod(quantize_iq6_k)


class _RowScaled(RowwiseReference, _SuperBlockIQK):
    """Types whose rows start with a scale: the numpy twin works row by row."""
    scale_fields = None
    qhelper_block = 32


class IQ5_KS(_RowScaled, qtype=QuantType.IQ5_KS):
    kernel_id = kernels.IQ5_KS
    _quantize_row = staticmethod(quantize_iq5_ks_row)


class IQ3_KS(_RowScaled, qtype=QuantType.IQ3_KS):
    kernel_id = kernels.IQ3_KS
    _quantize_row = staticmethod(quantize_iq3_ks_row)


class IQ4_KS(_RowScaled, qtype=QuantType.IQ4_KS):
    kernel_id = kernels.IQ4_KS
    _quantize_row = staticmethod(quantize_iq4_ks_row)
