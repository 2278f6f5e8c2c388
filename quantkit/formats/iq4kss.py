"""IQ4_KSS: IQ4_KS squeezed to exactly 4 bits per weight (specs/ik-quants.md §9.3).

A row is a float32 scale and 128-byte blocks of 256 values; a block is 64 little-endian uint16
words, eight per 32-value sub-block.  Word k of sub-block ib carries

    bit 0      bit k of the sub-block's scale byte (7-bit odd scale << 1 | shifted-table bit)
    bits 1-15  the four 4-bit codes of values (2k, 2k+16, 2k+1, 2k+17), 16 bits squeezed to 15:

               word & 0xfffe = j << 1, and j ^ (j << 1) = codes (as qs[2k] | qs[2k+1] << 8)

The squeeze only works for code patterns with an even number of set bits, so the quantizer
"prunes" each group of four codes to even parity: if the parity is odd it moves the one code
(within +-2 levels, to a code of the other parity) whose move costs least in weighted squared
error.  Everything else is IQ4_KS's search: pass 1 finds a scale per sub-block, pass 2 quantizes
the scales against the row scale and picks, per sub-block, the table half with the smaller error.
"""
from __future__ import annotations

import numpy as np

from ..kernels import iq4kss as kernels
from ..kernels.iq4kss import POPCOUNT, SQUEEZE
from ..types import QK_K, QuantType
from ._base import ALL_PATHS, KernelFormat, RowwiseReference
from . import decode
from ..tables import IQ4K_VALUES
from ._iqk import nearest_index
from ._numeric import first_absmax, seq_sum
from .kquants import nearest_int

F = np.float32
ZERO_EPS = F(1e-16)
BASE = IQ4K_VALUES[:16].astype(np.float32)
SHIFTED = IQ4K_VALUES[16:].astype(np.float32)
#: value positions of the four codes of word k within a sub-block
GROUP = np.array([[2 * k, 2 * k + 16, 2 * k + 1, 2 * k + 17] for k in range(8)])


def prune(codes, table, xg, wg, dl):
    """Make each group of four codes (…, 4) even-parity (see the module docstring).

    The "before" error always uses the base table, as ik does."""
    codes = codes.copy()
    odd = (POPCOUNT[codes].sum(axis=-1) & 1) == 1
    if not odd.any():
        return codes
    cand = codes[..., :, None] + np.array([-2, -1, 1, 2])               # (..., 4, 4)
    valid = (cand >= 0) & (cand <= 15)
    cand_c = np.clip(cand, 0, 15)
    valid &= ((POPCOUNT[cand_c] - POPCOUNT[codes][..., None]) % 2) != 0
    dl = np.asarray(dl, np.float32).reshape(-1, 1, 1)                  # per sub-block
    diff0 = dl * BASE[codes] - xg                                       # (n, 8, 4)
    diff1 = dl[..., None] * table[cand_c] - xg[..., None]               # (n, 8, 4, 4)
    score = wg[..., None] * (diff1 * diff1 - (diff0 * diff0)[..., None])
    score = np.where(valid, score, np.inf).astype(np.float32)
    flat = score.reshape(score.shape[:-2] + (16,))
    pick = np.argmin(flat, axis=-1)
    jbest = pick // 4
    newq = np.take_along_axis(cand_c.reshape(flat.shape), pick[..., None], axis=-1)[..., 0]
    idx = np.nonzero(odd)
    codes[idx + (jbest[idx],)] = newq[idx]
    return codes


def _groups(a):
    """(n_blocks, 32) -> (n_blocks, 8, 4) in word order."""
    return a[:, GROUP]


def _trial(xg, wg, isc, table, dl):
    al = isc[:, None, None] * xg
    p = prune(nearest_index(table, al), table, xg, wg, dl)
    m = prune(nearest_index(table, -al), table, xg, wg, dl)
    qp, qm = table[p].reshape(len(xg), 32), table[m].reshape(len(xg), 32)
    x, w = xg.reshape(len(xg), 32), wg.reshape(len(xg), 32)
    return seq_sum((w * qp) * x), seq_sum((w * qp) * qp), seq_sum((w * qm) * x), seq_sum((w * qm) * qm)


def _search(xb, wb):
    amax, mx = first_absmax(xb)
    zero = amax < ZERO_EPS
    xg, wg = _groups(xb), _groups(wb)
    with np.errstate(all="ignore"):
        mx1 = np.where(zero, F(1), mx)
        d = -mx1 / BASE[0]
        best = np.zeros(len(xb), np.float32)
        for itry in range(-7, 8):
            for table in (BASE, SHIFTED):
                isc = F(itry + table[0]) / mx1
                sp, s2p, sm, s2m = _trial(xg, wg, isc, table, F(1) / isc)
                for sx, s2 in ((sp, s2p), (sm, s2m)):
                    better = (s2 > 0) & (sx * sx > best * s2)
                    d = np.where(better, sx / s2, d).astype(np.float32)
                    best = np.where(better, d * sx, best).astype(np.float32)
    return np.where(zero, F(0), d).astype(np.float32)


def quantize_iq4_kss_row(x, qw):
    xs = x.reshape(-1, QK_K)
    sigma2 = (seq_sum(xs * xs) * (F(2) / F(QK_K)))[:, None]
    w = (qw.reshape(xs.shape) * np.sqrt(sigma2 + xs * xs)) if qw is not None else xs * xs
    xb, wb = x.reshape(-1, 32), w.astype(np.float32).reshape(-1, 32)
    scales = _search(xb, wb)
    d = F(np.fmax.reduce(np.abs(scales), initial=F(0))) / F(127)
    words = np.zeros((len(xb), 8), np.uint16)
    if d == 0:
        return np.concatenate([np.float32(0).reshape(1).view(np.uint8), words.reshape(-1).view(np.uint8)])
    l = (np.clip(nearest_int(F(0.5) * (F(1) / d * scales + F(127))), 0, 127) << 1) - 127
    nz = l != 0
    dl = d * l.astype(np.float32)
    xg, wg = _groups(xb), _groups(wb)
    with np.errstate(all="ignore"):
        idl = np.where(nz, F(1) / dl, F(0))
    al = idl[:, None, None] * xg
    vp = prune(nearest_index(BASE, al), BASE, xg, wg, dl)
    vm = prune(nearest_index(SHIFTED, al), SHIFTED, xg, wg, dl)
    ep = xg - dl[:, None, None] * BASE[vp]
    em = xg - dl[:, None, None] * SHIFTED[vm]
    mse_p = seq_sum(((wg * ep) * ep).reshape(len(xb), 32))
    mse_m = seq_sum(((wg * em) * em).reshape(len(xb), 32))
    use_m = mse_m < mse_p
    v = np.where(use_m[:, None, None], vm, vp)
    q = np.where(use_m[:, None, None], SHIFTED[v], BASE[v]) * l.astype(np.float32)[:, None, None]
    q = np.where(nz[:, None, None], q, F(0)).reshape(1, -1)
    wq = wg.reshape(1, -1) * q
    sumqx, sumq2 = seq_sum(wq * xg.reshape(1, -1))[0], seq_sum(wq * q)[0]
    scale_byte = np.where(nz, (l + 127) | use_m, 127)
    packed = (v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)).astype(np.int64)
    bits = (scale_byte[:, None] >> np.arange(8)) & 1
    words = np.where(nz[:, None], (SQUEEZE[packed & 0x7FFF].astype(np.int64) << 1) | bits, bits).astype(np.uint16)
    if sumq2 > 0:
        d = (sumqx / sumq2) * F(1.01)
    return np.concatenate([np.float32(d).reshape(1).view(np.uint8), words.reshape(-1).astype("<u2").view(np.uint8)])


class IQ4_KSS(RowwiseReference, KernelFormat, qtype=QuantType.IQ4_KSS):
    quant_paths = ALL_PATHS
    _quantize_row = staticmethod(quantize_iq4_kss_row)
    _kernel_quantize = staticmethod(kernels.quantize_rows)
    _kernel_dequantize = staticmethod(kernels.dequantize_rows)
    dequantize_ref = decode.dequantize_ref
