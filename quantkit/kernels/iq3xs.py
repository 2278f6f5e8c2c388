"""numba kernels for IQ3_XXS and IQ3_S (see :mod:`quantkit.formats.iq3xs`).

Both quantizers are ggml's ``quantize_row_iq3_xxs_impl`` / ``quantize_row_iq3_s_impl``: per 32-value
block, the magnitudes are fitted by a scale and 8 lattice points of 4 values each (levels 2l+1,
l = 0..7), trying 31 (IQ3_XXS) or 19 (IQ3_S) scales.  A point off the lattice is replaced by its
nearest neighbour on it (``iq3_find_best_neighbour``: the lattice points at the two (IQ3_XXS) or
three (IQ3_S) smallest distances of ``iq3xs_init_impl``'s neighbour lists, built once here in numpy).
The float32 operations follow the C order; ik_llama.cpp and mainline write the same bytes (mainline
clears the codes of every block first, where ik reads a previous block's: that only differs when a
block's weights are all zero, and there mainline's defined result is used for both).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..grids import IQ3S_GRID, IQ3XXS_GRID, KGRID_256, KGRID_512, KSIGNS_IQ2XS
from ..tables import FP16_TABLE  # noqa: F401  (the decoders' table, which formats pass in)
from ..types import QuantType as T
from .common import (F, FLT_MAX, QK_K, block_bytes, decode_rows, fp16_at, nint, run_rows, store_fp16,
                     superblock_sum_sq, type_ids)

IQ3_XXS, IQ3_S = type_ids(T.IQ3_XXS, T.IQ3_S)
IQ3_XXS_BYTES, IQ3_S_BYTES = block_bytes(T.IQ3_XXS, T.IQ3_S)
# block_iq3_xxs { fp16 d; qs[64]: a grid index per 4 values; uint32 sas[8]: per 32 values 4 x 7 sign
#                 bits (the 8th of each 8 makes their parity even) and a 4-bit scale in bits 28-31 }
XXS_SAS = 2 + QK_K // 4
# block_iq3_s { fp16 d; qs[64]: grid index bits 0-7; qh[8]: bit 8 (bit k of qh[ib]: point k of 32-block
#               ib); signs[32]: a bit per value; scales[4]: a 4-bit scale per 32 values }
S_QH = 2 + QK_K // 4
S_SIGNS = S_QH + QK_K // 32
S_SCALES = S_SIGNS + QK_K // 8

KMAX_Q = 8                      # levels per value
GROUP_MAX_EPS_IQ3_XXS = F(1e-8)


def lattice_points(kgrid: np.ndarray) -> np.ndarray:
    """iq3xs_init_impl's grid: point k's 4 values 2l+1 from the 3-bit levels l of kgrid[k] (int32)."""
    k = kgrid.astype(np.int64)
    return (2 * ((k[:, None] >> (3 * np.arange(4))) & 7) + 1).astype(np.int32)


def map_and_neighbours(points: np.ndarray, nwant: int) -> tuple[np.ndarray, np.ndarray]:
    """iq3xs_init_impl's ``kmap_q3xs`` and ``kneighbors_q3xs``.  kmap[u] for the 12-bit levels u of a
    point: its grid index, or -(offset + 1) of its neighbour list, which is a count n followed by
    the n grid indices of the points at the ``nwant`` smallest squared distances, ordered by
    (distance, index)."""
    n_grid = len(points)
    levels = (points - 1) // 2
    kmap = np.full(1 << 12, -1, np.int32)
    kmap[(levels << (3 * np.arange(4))).sum(1)] = np.arange(n_grid, dtype=np.int32)
    off = np.flatnonzero(kmap < 0)
    pos = 2 * ((off[:, None] >> (3 * np.arange(4))) & 7) + 1                          # (M, 4)
    d2 = ((points[None, :, :] - pos[:, None, :]) ** 2).sum(-1)                          # (M, n_grid)
    order = np.argsort(d2 * n_grid + np.arange(n_grid), axis=1)
    sd2 = np.take_along_axis(d2, order, 1)
    rank = np.concatenate([np.zeros((len(off), 1), np.int64), np.cumsum(sd2[:, 1:] != sd2[:, :-1], 1)], 1)
    counts = (rank < nwant).sum(1)
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    neighbours = np.empty(int((counts + 1).sum()), np.int32)
    neighbours[starts] = counts
    for s, c, o in zip(starts, counts, order):
        neighbours[s + 1:s + 1 + c] = o[:c]           # C sorts by (distance, index): the first c
    kmap[off] = -(starts + 1).astype(np.int32)
    return kmap, neighbours


XXS_POINTS = lattice_points(KGRID_256)
XXS_POINTS_F = XXS_POINTS.astype(np.float32)
XXS_MAP, XXS_NEIGHBOURS = map_and_neighbours(XXS_POINTS, 2)
S_POINTS = lattice_points(KGRID_512)
S_POINTS_F = S_POINTS.astype(np.float32)
S_MAP, S_NEIGHBOURS = map_and_neighbours(S_POINTS, 3)

# decoders: the 4 magnitudes of every grid point (bytes of the uint32 entries) and the sign bytes
XXS_GRID_VALUES = IQ3XXS_GRID.view(np.uint8).reshape(-1, 4).astype(np.float32)
S_GRID_VALUES = IQ3S_GRID.view(np.uint8).reshape(-1, 4).astype(np.float32)
KSIGNS = KSIGNS_IQ2XS.astype(np.int64)

_OPTS = dict(cache=True, error_model="numpy")


@njit(cache=True, error_model="numpy", inline="always")
def _best_neighbour(neighbours, start, pts_f, xval, waux, o, scale):
    """iq3_find_best_neighbour: the neighbour of the list at ``start`` with the least Σ waux (scale q
    - x)², the first of equals.  (C asserts that one is below FLT_MAX; with overflowing input, where
    it would abort, the first neighbour is taken.)"""
    n = neighbours[start]
    best_d2 = FLT_MAX
    gi = neighbours[start + 1]
    for j in range(1, n + 1):
        g = neighbours[start + j]
        d2 = F(0)
        for i in range(4):
            diff = scale * pts_f[g, i] - xval[o + i]
            d2 += waux[o + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = g
    return gi


@njit(cache=True, error_model="numpy", inline="always")
def _levels(id_, xval, o, L):
    """L[o..o+3] = clamp(nearest_int(0.5 (id x - 1)), 0, 7); returns their 12-bit index."""
    u = 0
    for i in range(4):
        l = min(KMAX_Q - 1, max(0, nint(F(0.5) * (id_ * xval[o + i] - F(1)))))
        L[o + i] = l
        u |= l << (3 * i)
    return u


@njit(cache=True, error_model="numpy", inline="always")
def _on_lattice(u, id_scale, xval, waux, o, L, kmap, neighbours, pts, pts_f):
    """The grid index of the levels L[o..o+3] (index u); off the lattice, the best neighbour for
    the scale ``id_scale``, whose levels replace L[o..o+3].  Returns (grid index, was on it)."""
    gi = kmap[u]
    if gi >= 0:
        return gi, True
    gi = _best_neighbour(neighbours, -gi - 1, pts_f, xval, waux, o, id_scale)
    for i in range(4):
        L[o + i] = (pts[gi, i] - 1) // 2
    return gi, False


@njit(cache=True, error_model="numpy", inline="always")
def _fit_sums(weight, xval, L):
    """Σ w x q and Σ w q² over the block, q = 2 L + 1 (C order: (w x) q, (w q) q)."""
    sumqx = F(0)
    sumq2 = F(0)
    for i in range(32):
        w = weight[i]
        q = F(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(**_OPTS)
def _search_block(xval, weight, waux, max_, ntry, all_again, L, Laux, on_grid, on_aux, kmap, neighbours, pts, pts_f):
    """The scale of one 32-block and its levels in L: the scales (15 + 0.2 is)/max, is = -ntry..ntry,
    with the least-squares fit of each kept while Σwqx²/Σwq² grows; then the points left off the
    lattice (IQ3_S, ``all_again``: every point) are re-found for the best scale, which is refitted."""
    best = F(0)
    scale = max_ / F(2 * KMAX_Q - 1)
    for is_ in range(-ntry, ntry + 1):
        id_ = (F(2 * KMAX_Q - 1) + F(is_) * F(0.2)) / max_
        this_scale = F(1) / id_
        for k in range(8):
            u = _levels(id_, xval, 4 * k, Laux)
            on_aux[k] = _on_lattice(u, this_scale, xval, waux, 4 * k, Laux, kmap, neighbours, pts, pts_f)[1]
        sumqx, sumq2 = _fit_sums(weight, xval, Laux)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(32):
                L[i] = Laux[i]
            for k in range(8):
                on_grid[k] = on_aux[k]
    n_off = 0
    for k in range(8):
        n_off += 0 if on_grid[k] else 1
    if n_off > 0 and scale > 0:
        id_ = F(1) / scale
        for k in range(8):
            if on_grid[k] and not all_again:
                continue
            u = _levels(id_, xval, 4 * k, L)
            _on_lattice(u, scale, xval, waux, 4 * k, L, kmap, neighbours, pts, pts_f)
        sumqx, sumq2 = _fit_sums(weight, xval, L)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit(cache=True, error_model="numpy", inline="always")
def _scale_code(id_, scale):
    """A block scale as 4 bits against the super-block's 1/d: clamp(nearest_int(0.5 (id s - 1)), 0, 15)."""
    return min(15, max(0, nint(F(0.5) * (id_ * scale - F(1)))))


@njit(cache=True, error_model="numpy", inline="always")
def _signs(xb, k, xval):
    """The 8 sign bits of values 8k..8k+7, and xval = |x| (C: ``x >= 0 ? x : -x``)."""
    s = 0
    for i in range(8):
        v = xb[8 * k + i]
        if v >= 0:
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            s |= 1 << i
    return s


@njit(cache=True, error_model="numpy", inline="always")
def _xxs_signs(xb, weight, k, xval):
    """IQ3_XXS's 7 sign bits of values 8k..8k+7: an odd number of minus signs flips the value with
    the least w x² (xval < 0 there), as the 8th sign is implied by their parity."""
    s = _signs(xb, k, xval)
    nflip = 0
    for i in range(8):
        nflip += (s >> i) & 1
    if nflip % 2:
        imin = 0
        mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
        for i in range(1, 8):
            ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
            if ax < mn:
                mn = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s & 127


@njit(**_OPTS)
def _quantize_row(xr, qw, has_qw, y, xxs):
    """quantize_row_iq3_xxs_impl (``xxs``) or quantize_row_iq3_s_impl, one row."""
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.empty(32, np.int32)
    Laux = np.empty(32, np.int32)
    on_grid = np.empty(8, np.bool_)
    on_aux = np.empty(8, np.bool_)
    scales = np.empty(8, np.float32)
    signs = np.empty(4, np.int64)
    nbytes = IQ3_XXS_BYTES if xxs else IQ3_S_BYTES
    kmap = XXS_MAP if xxs else S_MAP
    neighbours = XXS_NEIGHBOURS if xxs else S_NEIGHBOURS
    pts = XXS_POINTS if xxs else S_POINTS
    pts_f = XXS_POINTS_F if xxs else S_POINTS_F
    for ibl in range(xr.shape[0] // QK_K):
        ob = ibl * nbytes
        for j in range(nbytes):
            y[ob + j] = 0
        xbl = xr[QK_K * ibl:QK_K * (ibl + 1)]
        sigma2 = F(2) * superblock_sum_sq(xr, QK_K * ibl) / F(QK_K)
        max_scale = F(0)
        # IQ3_S: C advances its qs and signs pointers only past the blocks it quantizes, so a
        # skipped (zero) block leaves its place to the next one (IQ3_XXS indexes by block)
        qs_at = ob + 2
        signs_at = ob + S_SIGNS
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            for i in range(32):
                v = xb[i]
                weight[i] = qw[QK_K * ibl + 32 * ib + i] * np.sqrt(sigma2 + v * v) if has_qw else v * v
                waux[i] = np.sqrt(weight[i])
            for k in range(4):
                signs[k] = _xxs_signs(xb, weight, k, xval) if xxs else _signs(xb, k, xval)
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            for i in range(32):
                L[i] = 0
            if (mx < GROUP_MAX_EPS_IQ3_XXS) if xxs else (not mx):
                scales[ib] = F(0)
                continue
            for k in range(8):
                on_grid[k] = xxs
            scale = _search_block(xval, weight, waux, mx, 15 if xxs else 9, not xxs, L, Laux, on_grid, on_aux,
                                  kmap, neighbours, pts, pts_f)
            if scale < 0:
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & (127 if xxs else 255)
            at = ob + 2 + 8 * ib if xxs else qs_at
            for k in range(8):
                u = 0
                for i in range(4):
                    u |= L[4 * k + i] << (3 * i)
                gi = kmap[u]
                y[at + k] = gi & 255
                if not xxs:
                    y[ob + S_QH + ib] = np.int64(y[ob + S_QH + ib]) | ((gi >> 8) << k)
            if xxs:
                sas = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                for j in range(4):
                    y[ob + XXS_SAS + 4 * ib + j] = (sas >> (8 * j)) & 0xFF
            else:
                for k in range(4):
                    y[signs_at + k] = signs[k]
                signs_at += 4
            qs_at += 8
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if not max_scale:
            if xxs:                 # C: memset(qs, 0, quant_size) (IQ3_S keeps its codes and signs)
                for j in range(nbytes):
                    y[ob + j] = 0
            continue
        d = max_scale / F(31)
        store_fp16(y, ob, d * (F(1.0125) if xxs else F(1.033)))      # fudge factors of the C code
        id_ = F(1) / d
        for ib in range(8):
            code = _scale_code(id_, scales[ib])
            if xxs:
                y[ob + XXS_SAS + 4 * ib + 3] = np.int64(y[ob + XXS_SAS + 4 * ib + 3]) | (code << 4)
            else:
                at = ob + S_SCALES + ib // 2
                y[at] = np.int64(y[at]) | (code << (4 * (ib % 2)))


@njit(**_OPTS)
def iq3_xxs_row(xr, qw, has_qw, ik, y):
    _quantize_row(xr, qw, has_qw, y, True)


@njit(**_OPTS)
def iq3_s_row(xr, qw, has_qw, ik, y):
    _quantize_row(xr, qw, has_qw, y, False)


ROW_KERNELS = {IQ3_XXS: iq3_xxs_row, IQ3_S: iq3_s_row}


def quantize_rows(qtype, x, qw, has_qw, out):
    """Quantize rows x (n_rows, n_per_row) to IQ3_XXS / IQ3_S blocks in out (n_rows, row_size)."""
    run_rows(ROW_KERNELS[qtype], x, qw, has_qw, True, out)


@njit(**_OPTS)
def decode_row(qtype, b, y, fp16_table):
    """One row: its bytes b -> its values y (dequantize_row_iq3_xxs / _iq3_s: (db * grid) * ±1)."""
    n = y.shape[0]
    if qtype == IQ3_XXS:
        for sb in range(n // QK_K):
            o = IQ3_XXS_BYTES * sb
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                w = o + XXS_SAS + 4 * ib
                aux = np.int64(b[w]) | (np.int64(b[w + 1]) << 8) | (np.int64(b[w + 2]) << 16) | (np.int64(b[w + 3]) << 24)
                db = d * (F(0.5) + F(aux >> 28)) * F(0.5)
                for l in range(4):
                    signs = KSIGNS[(aux >> (7 * l)) & 127]
                    for h in range(2):
                        g = np.int64(b[o + 2 + 8 * ib + 2 * l + h])
                        for j in range(4):
                            neg = (signs >> (4 * h + j)) & 1
                            y[QK_K * sb + 32 * ib + 8 * l + 4 * h + j] = db * XXS_GRID_VALUES[g, j] * (F(-1) if neg else F(1))
    else:
        for sb in range(n // QK_K):
            o = IQ3_S_BYTES * sb
            d = fp16_at(b, o, fp16_table)
            for ib in range(8):
                sc = (np.int64(b[o + S_SCALES + ib // 2]) >> (4 * (ib % 2))) & 0xF
                db = d * F(1 + 2 * sc)
                qh = np.int64(b[o + S_QH + ib])
                for k in range(8):
                    g = np.int64(b[o + 2 + 8 * ib + k]) | (((qh >> k) & 1) << 8)
                    signs = np.int64(b[o + S_SIGNS + 4 * ib + k // 2])
                    for j in range(4):
                        neg = (signs >> (4 * (k % 2) + j)) & 1
                        y[QK_K * sb + 32 * ib + 4 * k + j] = db * S_GRID_VALUES[g, j] * (F(-1) if neg else F(1))


def dequantize_rows(qtype, blocks, fp16_table, out):
    """blocks (n_rows, row_size) uint8 -> out (n_rows, n_per_row) float32."""
    decode_rows(decode_row, qtype, blocks, fp16_table, out)
