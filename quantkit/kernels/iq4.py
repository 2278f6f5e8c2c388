"""numba kernels for IQ4_NL and IQ4_XS.

The quantizers of :mod:`quantkit.formats.iq4` (its docstring).  Rows run in parallel through
the shared driver of :mod:`quantkit.kernels.common` (the row kernels have its row signature); within
a row the 32-value blocks are lanes, ``xt[i, k]`` = value i of block k, so every trial scale is one
pass over the block with an inner loop over all blocks that LLVM vectorises (each SIMD lane keeps
one block's sums in C order).  ik's greedy refinement runs per block.

``best_index`` (nearest table value, an exact tie to the upper index) is computed without a search:
for every pair of neighbours (T[t-1], T[t]) the float32 threshold from which C's comparison
``x - T[t-1] < T[t] - x`` picks the upper one is found once at import, and the index is the number
of thresholds <= x.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import FP16_TABLE, IQ4NL_VALUES  # noqa: F401  (FP16_TABLE: the decoders' table, which formats pass in)
from ..types import QuantType as T
from ..types import traits
from ._iqk import thresholds
from .common import (fp16_at, decode_rows, F, GROUP_MAX_EPS, I32, OVERFLOW, QK_K, block_bytes, first_absmax, lane_sumsq, lanes_first_absmax,
                     nint, row_lanes, run_rows, store_fp16, type_ids)
from .kquants import superblock_sumsq

IQ4_NL, IQ4_XS = type_ids(T.IQ4_NL, T.IQ4_XS)
IQ4_NL_BYTES, IQ4_XS_BYTES = block_bytes(T.IQ4_NL, T.IQ4_XS)
QK4_NL = traits(T.IQ4_NL).block_size
KVALUES = IQ4NL_VALUES.astype(np.int32)
KV = KVALUES.astype(np.float32)
DKV = np.diff(KV).astype(np.float32)            # KV[t] - KV[t-1], t = 1..15


THR = thresholds(KV)           # THR[t-1]: from here on x rounds to KV[t] (ties up)


@njit(cache=True, error_model="numpy")
def best_index(a, ik):
    """Index into KV of the value nearest to float32 a (ties to the upper one).  ik's lookup does
    ``(int)a`` first: NaN and a >= 2^31 overflow to INT_MIN there and give 0."""
    idx = I32(0)
    for t in range(15):
        idx += I32(a >= THR[t])
    if ik and not (a < OVERFLOW):
        idx = I32(0)
    return idx


@njit(cache=True, error_model="numpy")
def _trial(xt, wt, isc, ik, sqx, sq2):
    """Σ(w*q)*x and Σ(w*q)*q per lane for the codes of inverse scales isc[k] (q = KV[best_index])."""
    n, nl = xt.shape
    for k in range(nl):
        sqx[k] = F(0)
        sq2[k] = F(0)
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            a = isc[k] * v
            q = KV[0]
            for t in range(15):
                q += DKV[t] if a >= THR[t] else F(0)
            if ik and not (a < OVERFLOW):
                q = KV[0]
            wq = wt[i, k] * q
            sqx[k] += wq * v
            sq2[k] += wq * q


@njit(cache=True, error_model="numpy")
def search_lanes(xt, wt, ik, d_out):
    """Per-block scale of quantize_row_iq4_nl_impl (ntry = 7) for every lane; 0 for blocks with
    max|x| < 1e-15.  ik: extra trials against the top of the table, codes of the best trial, greedy
    refinement, and no 0/0 guard on the first scale."""
    n, nl = xt.shape
    st = np.empty((10, nl), np.float32)
    amax, mx, d, best, bsx, bs2, bid, isc, sqx, sq2 = (st[0], st[1], st[2], st[3], st[4], st[5],
                                                      st[6], st[7], st[8], st[9])
    lanes_first_absmax(xt, amax, mx)
    for k in range(nl):
        isc[k] = F(1) / (-mx[k] / KV[0])
    _trial(xt, wt, isc, ik, sqx, sq2)
    for k in range(nl):
        if ik:
            d[k] = sqx[k] / sq2[k]
        else:
            d[k] = sqx[k] / sq2[k] if sq2[k] > 0 else F(0)
        best[k] = d[k] * sqx[k]
        bsx[k] = sqx[k]
        bs2[k] = sq2[k]
        bid[k] = isc[k]
    n_starts = 2 if ik else 1
    for itry in range(-7, 8):
        for s in range(n_starts):
            num = F(itry + (KVALUES[0] if s == 0 else KVALUES[15]))
            for k in range(nl):
                isc[k] = num / mx[k]
            _trial(xt, wt, isc, ik, sqx, sq2)
            for k in range(nl):
                if sq2[k] > 0 and sqx[k] * sqx[k] > best[k] * sq2[k]:
                    d[k] = sqx[k] / sq2[k]
                    best[k] = d[k] * sqx[k]
                    bsx[k] = sqx[k]
                    bs2[k] = sq2[k]
                    bid[k] = isc[k]
    if ik:
        L = np.empty(n, np.int32)
        for k in range(nl):
            if amax[k] < GROUP_MAX_EPS:
                continue
            for i in range(n):
                L[i] = best_index(bid[k] * xt[i, k], True)
            # move the code with the smallest step (table gap / gradient) one level towards x
            # while sumqx²/sumq2 grows
            dk = d[k]
            bk = best[k]
            sumqx = bsx[k]
            sumq2 = bs2[k]
            for _ in range(32 * n):
                min_step = F(np.inf)
                best_j = -1
                direction = 0
                for j in range(n):
                    l = L[j]
                    g = dk * wt[j, k] * (xt[j, k] - dk * KV[l])
                    if g > 0 and l < 15:
                        step = F(KVALUES[l + 1] - KVALUES[l]) / g
                        if step < min_step:
                            min_step = step
                            best_j = j
                            direction = 1
                    elif g < 0 and l > 0:
                        step = F(KVALUES[l - 1] - KVALUES[l]) / g
                        if step < min_step:
                            min_step = step
                            best_j = j
                            direction = -1
                if best_j < 0:
                    break
                w = wt[best_j, k]
                a = KVALUES[L[best_j] + direction]
                b = KVALUES[L[best_j]]
                nsx = sumqx + w * xt[best_j, k] * F(a - b)
                ns2 = sumq2 + w * F(a * a - b * b)
                if ns2 > 0 and nsx * nsx > bk * ns2:
                    sumqx = nsx
                    sumq2 = ns2
                    dk = sumqx / sumq2
                    bk = dk * sumqx
                    L[best_j] += direction
                else:
                    break
            d[k] = dk
    for k in range(nl):
        d_out[k] = F(0) if amax[k] < GROUP_MAX_EPS else d[k]


@njit(cache=True, error_model="numpy")
def _weights(xt, qw, has_qw, sigma2, per, wt):
    """wt = qw*sqrtf(sigma2 + x*x) (sigma2 of lane k = sigma2[k // per]) or x*x."""
    n, nl = xt.shape
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            wt[i, k] = qw[k * n + i] * np.sqrt(sigma2[k // per] + v * v) if has_qw else v * v


@njit(cache=True, error_model="numpy")
def _pack_block(xt, k, idv, ik, y, off):
    """Codes of lane k against the inverse scale idv -> 16 bytes: byte j = code j | code j+16 << 4."""
    for j in range(16):
        lo = best_index(idv * xt[j, k], ik)
        hi = best_index(idv * xt[j + 16, k], ik)
        y[off + j] = lo | (hi << 4)


@njit(cache=True, error_model="numpy")
def iq4_nl_row(xr, qw, has_qw, ik, y):
    xt, wt, _, lane = row_lanes(xr, QK4_NL, 2)
    nl = xt.shape[1]
    sigma2, d = lane[0], lane[1]
    lane_sumsq(xt, sigma2)
    for k in range(nl):
        sigma2[k] *= F(2) / F(QK4_NL)               # C: sigma2 *= 2.f/super_block_size
    _weights(xt, qw, has_qw, sigma2, 1, wt)
    search_lanes(xt, wt, ik, d)
    for k in range(nl):
        store_fp16(y, IQ4_NL_BYTES * k, d[k])
        # codes from the unrounded d (C: ``scales[0] ? 1/scales[0] : 0``; a NaN d is truthy)
        _pack_block(xt, k, F(1) / d[k] if d[k] != 0 else F(0), ik, y, IQ4_NL_BYTES * k + 2)


@njit(cache=True, error_model="numpy")
def iq4_xs_row(xr, qw, has_qw, ik, y):
    nsb = xr.shape[0] // QK_K
    xt, wt, _, lane = row_lanes(xr, QK4_NL, 1)
    scales = lane[0]
    sigma2 = np.empty(nsb, np.float32)
    superblock_sumsq(xr, sigma2)
    for sb in range(nsb):
        sigma2[sb] *= F(2) / F(QK_K)
    _weights(xt, qw, has_qw, sigma2, QK_K // QK4_NL, wt)
    search_lanes(xt, wt, ik, scales)
    for sb in range(nsb):
        ob = sb * IQ4_XS_BYTES
        d = -first_absmax(scales[8 * sb:8 * sb + 8])[1] / F(32)
        store_fp16(y, ob, d)
        idv = F(1) / d if d != 0 else F(0)
        scales_h = 0
        for ib in range(8):
            l = min(I32(31), max(I32(-32), nint(idv * scales[8 * sb + ib])))
            dl = d * F(l)
            idl = F(1) / dl if dl != 0 else F(0)
            _pack_block(xt, 8 * sb + ib, idl, ik, y, ob + 8 + 16 * ib)
            ls = np.int64(l) + 32
            # scales_l[ib/2]: block 2k in bits 0-3, block 2k+1 in bits 4-7;
            # scales_h (uint16 LE): bits 2ib..2ib+1 = high 2 bits of block ib
            if ib % 2 == 0:
                y[ob + 4 + ib // 2] = ls & 0xF
            else:
                y[ob + 4 + ib // 2] = (np.int64(y[ob + 4 + ib // 2]) | ((ls & 0xF) << 4)) & 0xFF
            scales_h |= (ls >> 4) << (2 * ib)
        y[ob + 2] = scales_h & 0xFF
        y[ob + 3] = (scales_h >> 8) & 0xFF


ROW_KERNELS = {IQ4_NL: iq4_nl_row, IQ4_XS: iq4_xs_row}


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Quantize rows x (n_rows, n_per_row) to IQ4_NL / IQ4_XS blocks in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


@njit(cache=True, error_model="numpy")
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y."""
    n = y.shape[0]
    if qtype == IQ4_NL:
        for ib in range(n // QK4_NL):
            o = IQ4_NL_BYTES * ib
            d = fp16_at(b, o, fp16_table)
            for j in range(16):
                q = np.int64(b[o + 2 + j])
                y[32 * ib + j] = d * KV[q & 0xF]
                y[32 * ib + j + 16] = d * KV[q >> 4]
    else:
        for sb in range(n // QK_K):
            o = IQ4_XS_BYTES * sb
            d = fp16_at(b, o, fp16_table)
            scales_h = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
            for ib in range(8):
                ls = ((np.int64(b[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
                dl = d * F(ls - 32)
                for j in range(16):
                    q = np.int64(b[o + 8 + 16 * ib + j])
                    y[QK_K * sb + 32 * ib + j] = dl * KV[q & 0xF]
                    y[QK_K * sb + 32 * ib + j + 16] = dl * KV[q >> 4]


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
