"""numba kernels for IQ2_XXS, IQ2_XS and IQ2_S: 8 values per lattice point of the E8-like 2-bit grids.

The quantizers of :mod:`quantkit.formats.iq2xs` (its docstring), ports of ggml-quants.c's
quantize_row_iq2_{xxs,xs,s}_impl in both flavors.  The grids' quantizer-side tables (ggml's
iq2xs_init_impl: the point of each grid index, the map from 8 packed 2-bit levels to a grid index,
and for every off-grid level pattern its neighbour list: the grid points at the ``nwant`` smallest
squared distances, in (distance, index) order) are built once at import from quantkit/grids.py.
Only the 3^8 patterns with levels 0..2 get a list: the quantizers clamp levels to 0..2.

Rows run in parallel through kernels.common's driver.  Within a row the order of float32 operations
is the C code's (the weighted neighbour search decides codes; one ulp changes them).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..grids import (IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, KGRID_2BIT_256, KGRID_2BIT_512, KGRID_2BIT_1024,
                     KSIGNS_IQ2XS)
from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from .common import (F, FLT_MAX, GROUP_MAX_EPS, I32, QK_K, block_bytes, decode_rows, fp16_at, nint, run_rows,
                     store_fp16, superblock_sum_sq, type_ids)
from .kquants import qp_quants

IQ2_XXS, IQ2_XS, IQ2_S = type_ids(T.IQ2_XXS, T.IQ2_XS, T.IQ2_S)
IQ2_XXS_BYTES, IQ2_XS_BYTES, IQ2_S_BYTES = block_bytes(T.IQ2_XXS, T.IQ2_XS, T.IQ2_S)
GROUP_MAX_EPS_IQ2_S = F(1e-8)
KMAP_SIZE = 43692                   # ggml's kmap_size: the largest packed pattern (all levels 2) + 2


def _grid_tables(kgrid: np.ndarray, nwant: int):
    """(kmap (KMAP_SIZE,) int32: the grid index of a packed level pattern, or -(start + 1) where
    neighbours[start] = n is followed by the packed patterns of the n neighbour points (uint16; their
    grid index is kmap's); the longest n)."""
    k = kgrid.astype(np.int64)
    levels = ((k[:, None] >> (2 * np.arange(8))) & 3).astype(np.int32)
    kmap = np.full(KMAP_SIZE, -1, np.int32)
    kmap[k] = np.arange(len(k), dtype=np.int32)
    # every pattern of levels 0..2, packed as the quantizers pack them
    pats = np.array(np.meshgrid(*[np.arange(3)] * 8, indexing="ij")).reshape(8, -1).T      # (6561, 8)
    packed = (pats << (2 * np.arange(8))).sum(1)
    off = packed[kmap[packed] < 0]
    off_levels = pats[kmap[packed] < 0]
    counts, points = [], []
    for c in range(0, len(off), 512):           # in chunks: a few MB at a time
        d2 = np.zeros((len(off[c:c + 512]), len(k)), np.int32)
        for i in range(8):
            d2 += (levels[None, :, i] - off_levels[c:c + 512, i, None]) ** 2       # (levels apart)²
        order = np.argsort(d2 * len(k) + np.arange(len(k), dtype=np.int32), axis=1)  # by (d2, index)
        d2_sorted = np.take_along_axis(d2, order, 1)
        # the points at the nwant smallest distances: rank of each distance among the distinct ones
        rank = np.concatenate([np.zeros((len(d2), 1), np.int64),
                               np.cumsum(d2_sorted[:, 1:] != d2_sorted[:, :-1], axis=1)], axis=1)
        keep = rank < nwant
        counts.append(keep.sum(1))
        points.append(k[order[keep]])           # row by row, nearest first
    counts = np.concatenate(counts)
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    kmap[off] = -(starts + 1)
    neighbours = np.empty(int((counts + 1).sum()), np.uint16)
    neighbours[starts] = counts
    is_point = np.ones(len(neighbours), bool)
    is_point[starts] = False
    neighbours[is_point] = np.concatenate(points)
    return kmap, neighbours, int(counts.max())


# nwant: IQ2_S keeps the nearest shell only, IQ2_XXS/IQ2_XS two (ggml's iq2xs_init_impl)
KMAP_XXS, NB_XXS, _MAX_XXS = _grid_tables(KGRID_2BIT_256, 2)
KMAP_XS, NB_XS, _MAX_XS = _grid_tables(KGRID_2BIT_512, 2)
KMAP_S, NB_S, _MAX_S = _grid_tables(KGRID_2BIT_1024, 1)
MAX_NEIGHBOURS = max(_MAX_XXS, _MAX_XS, _MAX_S)
# the decoders' grids: 8 magnitudes (8, 25 or 43) per point, as float32; signs: +-1 per bit pattern
GRID_XXS = IQ2XXS_GRID.view(np.uint8).reshape(-1, 8).astype(np.float32)
GRID_XS = IQ2XS_GRID.view(np.uint8).reshape(-1, 8).astype(np.float32)
GRID_S = IQ2S_GRID.view(np.uint8).reshape(-1, 8).astype(np.float32)
SIGN_BITS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.float32)     # (256, 8)
KSIGNS = KSIGNS_IQ2XS.astype(np.int64)


# ---- pieces the three quantizers share ----

@njit(cache=True, error_model="numpy")
def _weights(xr, xo, n, qw, has_qw, sigma2, weight, waux):
    """weight = qw*sqrtf(sigma2 + x²) with an imatrix, else 0.25f*sigma2 + x²; waux = sqrtf(weight)."""
    for i in range(n):
        v = xr[xo + i]
        weight[i] = qw[xo + i] * np.sqrt(sigma2 + v * v) if has_qw else F(0.25) * sigma2 + v * v
        waux[i] = np.sqrt(weight[i])


@njit(cache=True, error_model="numpy")
def _abs_signs(xr, xo, n_groups, weight, even, xval, signs):
    """xval = |x| and the sign bits per group of 8; ``even``: an odd number of minus signs flips the
    sign of the value with the smallest weight*x² (first one on ties) so that 7 bits store the signs."""
    for k in range(n_groups):
        nflip = 0
        s = 0
        for i in range(8):
            v = xr[xo + 8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if even and nflip % 2:
            imin = 0
            v = xr[xo + 8 * k]
            mn = weight[8 * k] * v * v
            for i in range(1, 8):
                v = xr[xo + 8 * k + i]
                ax = weight[8 * k + i] * v * v
                if ax < mn:
                    mn = ax
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127 if even else s


@njit(cache=True, error_model="numpy")
def _group_max(xval, n):
    mx = xval[0]
    for i in range(1, n):
        mx = mx if mx > xval[i] else xval[i]
    return mx


@njit(cache=True, error_model="numpy")
def _best_neighbour(kmap, nb, start, xval, waux, off, scale, L, d2):
    """iq2_find_best_neighbour: the neighbour with the smallest Σ waux*(scale*q - x)² (first on
    ties); its levels go to L[off:off+8]; returns its grid index.

    Same bits as C, faster: element i's term depends only on its level, so its three terms are
    computed once (C's float ops) and a candidate's sum adds 8 of them in C's order, read from its
    packed levels.  ``d2``: float32 scratch, the longest list + 32 (the sums, then the terms)."""
    n = np.int64(nb[start])
    terms = d2[MAX_NEIGHBOURS:]             # terms[4 i + l]: element i at level l
    for i in range(8):
        x = xval[off + i]
        w = waux[off + i]
        for l in range(3):
            diff = scale * F(2 * l + 1) - x
            terms[4 * i + l] = w * diff * diff
    for j in range(n):
        u = np.int64(nb[start + 1 + j])
        s = F(0)
        for i in range(8):
            s += terms[4 * i + ((u >> (2 * i)) & 3)]
        d2[j] = s
    best_d2 = FLT_MAX
    jb = 0                      # only NaN distances (C asserts): the first neighbour
    for j in range(n):
        if d2[j] < best_d2:
            best_d2 = d2[j]
            jb = j
    u = np.int64(nb[start + 1 + jb])
    for i in range(8):
        L[off + i] = (u >> (2 * i)) & 3
    return np.int64(kmap[u])


@njit(cache=True, error_model="numpy")
def _project(kmap, nb, xval, waux, k, idv, scale, L, d2):
    """Levels of group k at inverse scale idv (nearest_int(0.5f*(id*x - 1)) in 0..2) into L; off the
    grid, the best neighbour at ``scale``.  Returns (grid index, was on the grid)."""
    u = 0
    for i in range(8):
        l = min(I32(2), max(I32(0), nint(F(0.5) * (idv * xval[8 * k + i] - F(1)))))
        L[8 * k + i] = l
        u |= np.int64(l) << (2 * i)
    gi = np.int64(kmap[u])
    if gi >= 0:
        return gi, True
    return _best_neighbour(kmap, nb, -gi - 1, xval, waux, 8 * k, scale, L, d2), False


@njit(cache=True, error_model="numpy")
def _fit(xval, weight, L, n):
    """(Σ w*x*q, Σ w*q*q) for q = 2L + 1."""
    sumqx = F(0)
    sumq2 = F(0)
    for i in range(n):
        w = weight[i]
        q = F(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True, error_model="numpy")
def _grid_index(kmap, L, k):
    """The grid index of group k's levels, or -1 off the grid (where C aborts)."""
    u = 0
    for i in range(8):
        u |= np.int64(L[8 * k + i] & 3) << (2 * i)
        if L[8 * k + i] > 2 or L[8 * k + i] < 0:
            return -1
    return kmap[u]


@njit(cache=True, error_model="numpy")
def _trials(kmap, nb, xval, weight, waux, n, is_max, denom, scale, L, Laux, d2, best_gi, best_on):
    """The trial scales of every search here: inverse scales (5 + 0.1 is)/denom, is = -is_max..is_max,
    each group of 8 projected on the grid; the best fit (largest Σwqx²/Σwq², from 0) sets the scale,
    the levels in L, and per group its grid index and whether it was on the grid (best_gi, best_on:
    0 and True if no trial fits).  Returns (scale, its score)."""
    n_groups = n // 8
    aux_gi = np.empty(n_groups, np.int64)
    aux_on = np.empty(n_groups, np.bool_)
    best_gi[:n_groups] = 0
    best_on[:n_groups] = True
    best = F(0)
    for is_ in range(-is_max, is_max + 1):
        idv = (F(5) + F(is_) * F(0.1)) / denom
        this_scale = F(1) / idv
        for k in range(n_groups):
            aux_gi[k], aux_on[k] = _project(kmap, nb, xval, waux, k, idv, this_scale, Laux, d2)
        sumqx, sumq2 = _fit(xval, weight, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:n] = Laux[:n]
            best_gi[:n_groups] = aux_gi
            best_on[:n_groups] = aux_on
    return scale, best


@njit(cache=True, error_model="numpy")
def _scan_16(kmap, nb, xval, weight, waux, mx, L, Laux, on_grid, d2):
    """The search of mainline's IQ2_XS and of IQ2_S (both flavors) for one 16-value block: inverse
    scales (5 + 0.1 is)/max, is = -9..9, keep the best fit's levels in L; then re-project the groups
    that were off the grid at the best scale.  Returns the scale."""
    gi = np.empty(2, np.int64)
    scale = _trials(kmap, nb, xval, weight, waux, 16, 9, mx, mx / F(5), L, Laux, d2, gi, on_grid)[0]
    if (not on_grid[0] or not on_grid[1]) and scale > 0:
        idv = F(1) / scale
        for k in range(2):
            if not on_grid[k]:
                _project(kmap, nb, xval, waux, k, idv, scale, L, d2)
        sumqx, sumq2 = _fit(xval, weight, L, 16)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


# ---- the row quantizers ----

@njit(cache=True, error_model="numpy")
def _scratch(n):
    """Per-row scratch for blocks of n values: weight, waux, xval (float32), L, Laux (int64 levels;
    zero, as the first block's stale levels), d2 (the neighbour search's)."""
    f = np.empty((3, n), np.float32)
    lv = np.zeros((2, n), np.int64)
    return f[0], f[1], f[2], lv[0], lv[1], np.empty(MAX_NEIGHBOURS + 32, np.float32)


@njit(cache=True, error_model="numpy")
def _block_start(xr, xo, n, qw, has_qw, sigma2, even, weight, waux, xval, signs):
    """Weights, magnitudes and sign bits of the n values from xo; returns their largest magnitude."""
    _weights(xr, xo, n, qw, has_qw, sigma2, weight, waux)
    _abs_signs(xr, xo, n // 8, weight, even, xval, signs)
    return _group_max(xval, n)


@njit(cache=True, error_model="numpy")
def _scale_code(idv, scale):
    """A block scale as its 4-bit code: nearest_int(0.5f*(id*scale - 1)) in 0..15."""
    return min(I32(15), max(I32(0), nint(F(0.5) * (idv * scale - F(1)))))


@njit(cache=True, error_model="numpy")
def iq2_xxs_row(xr, qw, has_qw, ik, y):
    """block_iq2_xxs { fp16 d; u32 q2[16] }: per 32 values q2[2ib] the 4 grid indices (a byte
    each), q2[2ib+1] 4 x 7 sign bits and the 4-bit scale << 28."""
    weight, waux, xval, L, Laux, d2 = _scratch(32)
    gi4 = np.empty(4, np.int64)
    on4 = np.empty(4, np.bool_)
    signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    q2 = np.zeros(16, np.int64)
    for ibl in range(xr.shape[0] // QK_K):
        ob = ibl * IQ2_XXS_BYTES
        q2[:] = 0
        max_scale = F(0)
        sigma2 = superblock_sum_sq(xr, QK_K * ibl) / F(QK_K)
        for ib in range(8):
            xo = QK_K * ibl + 32 * ib
            if _block_start(xr, xo, 32, qw, has_qw, sigma2, True, weight, waux, xval, signs) < GROUP_MAX_EPS:
                scales[ib] = 0
                continue
            scale = qp_quants(xval, 4, weight, ik, L)      # make_qp_quants
            eff_max = scale * F(3)
            if not ik and eff_max <= 0:
                scales[ib] = 0
                continue
            scale = _trials(KMAP_XXS, NB_XXS, xval, weight, waux, 32, 6, eff_max, scale, L, Laux, d2, gi4, on4)[0]
            if scale > 0:
                idv = F(1) / scale
                for k in range(4):          # (the levels of the grid point it lands on)
                    _project(KMAP_XXS, NB_XXS, xval, waux, k, idv, scale, L, d2)
                sumqx, sumq2 = _fit(xval, weight, L, 32)
                if sumq2 > 0:
                    scale = sumqx / sumq2
            if scale < 0:
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 127
            ok = scale >= 0
            for k in range(4):
                ok = ok and _grid_index(KMAP_XXS, L, k) >= 0
            if not ok:          # ik's C aborts here (a block whose weights are all 0): leave it zero
                scales[ib] = 0
                continue
            for k in range(4):
                q2[2 * ib] |= np.int64(_grid_index(KMAP_XXS, L, k)) << (8 * k)
                q2[2 * ib + 1] |= signs[k] << (7 * k)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if not max_scale:
            store_fp16(y, ob, F(0))
            y[ob + 2:ob + IQ2_XXS_BYTES] = 0
            continue
        d = max_scale / F(31)
        store_fp16(y, ob, d)
        idv = F(1) / d
        for ib in range(8):
            l = _scale_code(idv, scales[ib])
            q2[2 * ib + 1] |= np.int64(l) << 28
        for j in range(16):
            for b in range(4):
                y[ob + 2 + 4 * j + b] = (q2[j] >> (8 * b)) & 0xFF


@njit(cache=True, error_model="numpy")
def _xs_search_ik(xval, weight, waux, L, Laux, index, d2):
    """ik's IQ2_XS search for one 16-value block: the best 3-level fit of the sorted values as the
    start, inverse scales (5 + 0.1 is)/(5 scale), is = -7..7, then up to 3 re-projections while the
    grid points change and the fit improves.  Returns the scale."""
    order = np.empty(16, np.int64)
    for j in range(16):             # stable insertion sort of xval (glibc's qsort is a merge sort)
        v = xval[j]
        p = j
        while p > 0 and xval[order[p - 1]] > v:
            order[p] = order[p - 1]
            p -= 1
        order[p] = j
    sumx = np.empty(17, np.float32)
    sumw = np.empty(17, np.float32)
    sumx[0] = F(0)
    sumw[0] = F(0)
    for j in range(16):
        i = order[j]
        sumx[j + 1] = sumx[j] + weight[i] * xval[i]
        sumw[j + 1] = sumw[j] + weight[i]
    best = F(0)
    scale = F(0)
    for i1 in range(17):
        for i2 in range(i1, 17):
            sumqx = (sumx[i1] - sumx[0]) * F(1) + (sumx[i2] - sumx[i1]) * F(3) + (sumx[16] - sumx[i2]) * F(5)
            sumq2 = (sumw[i1] - sumw[0]) * F(1) + (sumw[i2] - sumw[i1]) * F(9) + (sumw[16] - sumw[i2]) * F(25)
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
    on = np.empty(2, np.bool_)
    aux_index = np.empty(2, np.int64)
    scale, best = _trials(KMAP_XS, NB_XS, xval, weight, waux, 16, 7, scale * F(5), scale, L, Laux, d2, index, on)
    if scale:
        for _ in range(3):
            idv = F(1) / scale
            changed = False
            for k in range(2):
                aux_index[k] = _project(KMAP_XS, NB_XS, xval, waux, k, idv, scale, Laux, d2)[0]
                if aux_index[k] != index[k]:
                    changed = True
            if not changed:
                break
            sumqx, sumq2 = _fit(xval, weight, Laux, 16)
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                L[:16] = Laux[:16]
                index[0] = aux_index[0]
                index[1] = aux_index[1]
            else:
                break
    return scale


@njit(cache=True, error_model="numpy")
def iq2_xs_row(xr, qw, has_qw, ik, y):
    """block_iq2_xs { fp16 d; u16 qs[32]: grid index (9 bits) | 7 sign bits << 9; scales[8]: two
    4-bit scales per 32 values }.  ik: another search (_xs_search_ik) and a final refit of d over the
    whole super-block (1.05 Σwqx/Σwq²)."""
    weight, waux, xval, L, Laux, d2 = _scratch(16)      # ik keeps stale levels where no fit is taken
    signs = np.zeros(2, np.int64)
    index = np.zeros(2, np.int64)
    on_grid = np.empty(2, np.bool_)
    scales = np.zeros(16, np.float32)
    q2 = np.zeros(32, np.int64)
    for ibl in range(xr.shape[0] // QK_K):
        ob = ibl * IQ2_XS_BYTES
        q2[:] = 0
        max_scale = F(0)
        sigma2 = superblock_sum_sq(xr, QK_K * ibl) / F(QK_K)
        for ib in range(16):
            xo = QK_K * ibl + 16 * ib
            mx = _block_start(xr, xo, 16, qw, has_qw, sigma2, True, weight, waux, xval, signs)
            if not ik:
                L[:] = 0
            if mx < GROUP_MAX_EPS:
                L[:] = 0
                scales[ib] = 0
                continue
            if ik:
                scale = _xs_search_ik(xval, weight, waux, L, Laux, index, d2)
            else:
                scale = _scan_16(KMAP_XS, NB_XS, xval, weight, waux, mx, L, Laux, on_grid, d2)
            if scale < 0:
                scale = -scale
                for k in range(2):
                    signs[k] = ~signs[k] & 127
            ok = scale >= 0
            for k in range(2):
                ok = ok and _grid_index(KMAP_XS, L, k) >= 0
            if not ok:
                scales[ib] = 0
                continue
            for k in range(2):
                q2[2 * ib + k] = _grid_index(KMAP_XS, L, k) | (signs[k] << 9)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        y[ob + 2 + 64:ob + IQ2_XS_BYTES] = 0
        if not max_scale:
            store_fp16(y, ob, F(0))
            y[ob + 2:ob + 2 + 64] = 0
            continue
        d = max_scale / F(31)
        store_fp16(y, ob, d)
        idv = F(1) / d
        sumqx = F(0)
        sumq2 = F(0)
        for ib in range(16):
            l = _scale_code(idv, scales[ib])
            y[ob + 66 + ib // 2] |= l << (4 * (ib % 2))
            if not ik:
                continue
            fl = F(2 * l + 1)
            xo = QK_K * ibl + 16 * ib
            _weights(xr, xo, 16, qw, has_qw, sigma2, weight, waux)
            for k in range(2):
                g = q2[2 * ib + k] & 511
                s = KSIGNS[q2[2 * ib + k] >> 9]
                for j in range(8):
                    w = weight[8 * k + j]
                    q = F(0.125) * fl * GRID_XS[g, j] * (F(-1) if (s >> j) & 1 else F(1))
                    sumqx += w * q * xr[xo + 8 * k + j]
                    sumq2 += w * q * q
        for j in range(32):
            y[ob + 2 + 2 * j] = q2[j] & 0xFF
            y[ob + 3 + 2 * j] = q2[j] >> 8
        if ik and sumq2 > 0:
            store_fp16(y, ob, F(1.05) * sumqx / sumq2)


@njit(cache=True, error_model="numpy")
def iq2_s_row(xr, qw, has_qw, ik, y):
    """block_iq2_s { fp16 d; qs[32]: grid index bits 0-7 per 8 values; signs[32]: one bit per value;
    qh[8]: grid index bits 8-9, 2 bits per group; scales[8] }.  The flavors differ only where a
    block's search takes no fit: ik writes the previous block's levels, mainline zeros."""
    weight, waux, xval, L, Laux, d2 = _scratch(16)
    signs = np.zeros(2, np.int64)
    on_grid = np.empty(2, np.bool_)
    scales = np.zeros(16, np.float32)
    for ibl in range(xr.shape[0] // QK_K):
        ob = ibl * IQ2_S_BYTES
        y[ob:ob + IQ2_S_BYTES] = 0
        max_scale = F(0)
        sigma2 = F(2) * superblock_sum_sq(xr, QK_K * ibl) / F(QK_K)
        for ib in range(16):
            xo = QK_K * ibl + 16 * ib
            mx = _block_start(xr, xo, 16, qw, has_qw, sigma2, False, weight, waux, xval, signs)
            if not ik:
                L[:] = 0
            if mx < GROUP_MAX_EPS_IQ2_S:
                scales[ib] = 0
                continue
            scale = _scan_16(KMAP_S, NB_S, xval, weight, waux, mx, L, Laux, on_grid, d2)
            if scale < 0:
                scale = -scale
                for k in range(2):
                    signs[k] = ~signs[k] & 255
            ok = scale >= 0
            for k in range(2):
                ok = ok and _grid_index(KMAP_S, L, k) >= 0
            if not ok:
                scales[ib] = 0
                continue
            for k in range(2):
                gi = _grid_index(KMAP_S, L, k)
                i8 = 2 * ib + k
                y[ob + 2 + i8] = gi & 255
                y[ob + 66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                y[ob + 34 + i8] = signs[k]
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if not max_scale:
            continue
        d = max_scale / F(31)
        store_fp16(y, ob, d * F(0.9875))
        idv = F(1) / d
        for ib in range(16):
            l = _scale_code(idv, scales[ib])
            y[ob + 74 + ib // 2] |= l << (4 * (ib % 2))


ROW_KERNELS = {IQ2_XXS: iq2_xxs_row, IQ2_XS: iq2_xs_row, IQ2_S: iq2_s_row}


def quantize_rows(qtype, x, qw, has_qw, ik, out):
    """Quantize rows x (n_rows, n_per_row) to IQ2_XXS / IQ2_XS / IQ2_S blocks in out."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, ik, out)


# ---- the decoder (dequantize_row_iq2_*: y = (d*(0.5 + s)*0.25) * grid * sign) ----

@njit(cache=True, error_model="numpy")
def _put8(y, at, dl, grid, g, sign_bits):
    for j in range(8):
        v = dl * grid[g, j]
        y[at + j] = -v if (sign_bits >> j) & 1 else v


@njit(cache=True, error_model="numpy")
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y."""
    for ibl in range(y.shape[0] // QK_K):
        yo = QK_K * ibl
        if qtype == IQ2_XXS:
            o = IQ2_XXS_BYTES * ibl
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                p = o + 2 + 8 * ib
                aux = (np.int64(b[p + 4]) | (np.int64(b[p + 5]) << 8) | (np.int64(b[p + 6]) << 16)
                       | (np.int64(b[p + 7]) << 24))
                db = d * (F(0.5) + F(aux >> 28)) * F(0.25)
                for l in range(4):
                    _put8(y, yo + 32 * ib + 8 * l, db, GRID_XXS, np.int64(b[p + l]), KSIGNS[(aux >> (7 * l)) & 127])
        elif qtype == IQ2_XS:
            o = IQ2_XS_BYTES * ibl
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                sc = np.int64(b[o + 66 + ib])
                db0 = d * (F(0.5) + F(sc & 0xF)) * F(0.25)
                db1 = d * (F(0.5) + F(sc >> 4)) * F(0.25)
                for l in range(4):
                    p = o + 2 + 2 * (4 * ib + l)
                    v = np.int64(b[p]) | (np.int64(b[p + 1]) << 8)
                    _put8(y, yo + 32 * ib + 8 * l, db0 if l < 2 else db1, GRID_XS, v & 511, KSIGNS[v >> 9])
        else:
            o = IQ2_S_BYTES * ibl
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                sc = np.int64(b[o + 74 + ib])
                db0 = d * (F(0.5) + F(sc & 0xF)) * F(0.25)
                db1 = d * (F(0.5) + F(sc >> 4)) * F(0.25)
                qh = np.int64(b[o + 66 + ib])
                for l in range(4):
                    g = np.int64(b[o + 2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)
                    _put8(y, yo + 32 * ib + 8 * l, db0 if l < 2 else db1, GRID_S, g, np.int64(b[o + 34 + 4 * ib + l]))


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
