"""The codebooks of ik_llama.cpp's trellis types IQ1_KT..IQ4_KT (ik's source, not in the spec).

A KT code is an index i of ``num_bits`` bits; its group of ``group`` values comes from an integer
hash (the "trellis"): with x = i + offset (uint32) and, for each value, x = 0xCBAC1FED * x,

    s = x & 0x3f3f3f3f             four bytes of 0..63
    value = b0 + b1 + b2 + b3 - 126         (|value| for IQ3_KT, which stores signs apart)

so every value is an integer in [-126, 126] (a sum of four uniform bytes: roughly Gaussian).

Finding the nearest code among 2^16 groups is too slow, so the quantizer first picks a cluster and
searches only its members.  The clusters are fixed by ik's constructor, which this module rebuilds
exactly:

* groups of 8 (IQ1_KT, IQ2_KT, IQ3_KT), 256 clusters: bit k of the cluster number says whether
  value k is above ``mid[k]`` (the middle of the value range, or the median for IQ3_KT);
* groups of 4 (IQ4_KT), 625 clusters: each value falls in one of five bins, the cluster number
  is the base-5 number of the bins.

A cluster's centre is the mean of the groups in it (float32).  Every group then joins the
``num_neighbours`` clusters whose centres are nearest (float32 squared distance, ties to the lower
cluster), and a cluster whose member count is not a multiple of 8 is padded with the nearest
non-members (ties to the lower index), because ik's search scores 8 members per step.  A cluster
left empty (groups of 8 only) is searched over all groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..kernels.kt import nearest_clusters

F = np.float32
KA = np.uint64(0xCBAC1FED)
MASK32 = np.uint64(0xFFFFFFFF)


@dataclass(frozen=True)
class KTSpec:
    num_bits: int
    group: int
    is_abs: bool
    n_clusters: int
    n_neighbours: int


SPECS = {
    "iq1_kt": KTSpec(13, 8, False, 256, 32),
    "iq2_kt": KTSpec(16, 8, False, 256, 8),
    "iq3_kt": KTSpec(16, 8, True, 256, 8),
    "iq4_kt": KTSpec(15, 4, False, 625, 6),
}
OFFSET = 4096
IQ4_KT_SECOND_OFFSET = 4096 + 32768     # IQ4_KT blocks flagged "with offset" use this table


def trellis_values(indices: np.ndarray, group: int, is_abs: bool, offset: int = OFFSET) -> np.ndarray:
    """float32 (len(indices), group): the values of the groups with these codes."""
    x = (np.asarray(indices, np.uint64) + np.uint64(offset)) & MASK32
    out = np.empty((x.size, group), np.float32)
    for k in range(group):
        x = (x * KA) & MASK32
        s = x & np.uint64(0x3F3F3F3F)
        v = ((s & np.uint64(0xFF)) + ((s >> np.uint64(8)) & np.uint64(0xFF)) + ((s >> np.uint64(16)) & np.uint64(0xFF))
             + (s >> np.uint64(24))).astype(np.int64) - 126
        out[:, k] = np.abs(v) if is_abs else v
    return out


def _bin5(v: np.ndarray) -> np.ndarray:
    return (v >= -48).astype(np.int64) + (v >= -16) + (v >= 16) + (v >= 48)


@dataclass(frozen=True)
class Codebook:
    values: np.ndarray        # (2^bits, group) float32
    mid: np.ndarray           # (group,) float32: cluster bit thresholds (groups of 8)
    offsets: np.ndarray       # CSR over the concatenated members: cluster c is [offsets[c], offsets[c+1])
    flat_members: np.ndarray  # int32 (total,)
    flat_values_t: np.ndarray  # float32 (group, total): member values, one row per position


def cluster_of(spec: KTSpec, mid: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Cluster number of every scaled group v (..., group)."""
    if spec.group == 8:
        return ((v > mid).astype(np.int64) << np.arange(8)).sum(axis=-1)
    return (_bin5(v) * 5 ** np.arange(4)).sum(axis=-1)


def _dist2(values, centres):
    d2 = np.zeros((values.shape[0], centres.shape[0]), np.float32)
    for k in range(values.shape[1]):
        d = values[:, k, None] - centres[None, :, k]
        d2 += d * d
    return d2


@lru_cache(maxsize=None)
def codebook(name: str, offset: int = OFFSET) -> Codebook:
    """The codebook ik's constructor builds (the neighbour search is the numba kernel
    kernels.kt.nearest_clusters: a stable sort of the float32 distances, C order)."""
    spec = SPECS[name]
    n_val, g = 1 << spec.num_bits, spec.group
    values = trellis_values(np.arange(n_val), g, spec.is_abs, offset)
    if spec.group == 8:
        if spec.is_abs:
            srt = np.sort(values.astype(np.int64), axis=0)
            mid = (F(0.5) * (srt[n_val // 2] + srt[n_val // 2 - 1]).astype(np.float32)).astype(np.float32)
        else:
            mid = (F(0.5) * (values.min(axis=0) + values.max(axis=0))).astype(np.float32)
    else:
        mid = np.zeros(4, np.float32)
    u = cluster_of(spec, mid, values)
    counts = np.bincount(u, minlength=spec.n_clusters)
    sums = np.zeros((spec.n_clusters, g), np.float64)       # integer sums: exact in any order
    np.add.at(sums, u, values)
    with np.errstate(invalid="ignore", divide="ignore"):
        centres = np.where(counts[:, None] > 0, sums.astype(np.float32) / counts[:, None].astype(np.float32),
                           F(0)).astype(np.float32)
    near = np.empty((n_val, spec.n_neighbours), np.int64)
    nearest_clusters(values, np.ascontiguousarray(centres), near)
    # members of each cluster in ascending code order (a stable sort of the ip-major neighbour list)
    by_cluster = np.argsort(near.reshape(-1), kind="stable") // spec.n_neighbours
    bounds = np.searchsorted(np.sort(near.reshape(-1)), np.arange(spec.n_clusters + 1))
    members = []
    for c in range(spec.n_clusters):
        pts = by_cluster[bounds[c]:bounds[c + 1]]
        if pts.size % 8:
            outside = np.ones(n_val, bool)
            outside[pts] = False
            others = np.flatnonzero(outside)
            d = _dist2(values[others], centres[c:c + 1])[:, 0]
            nadd = 8 - pts.size % 8
            near_enough = d <= np.partition(d, nadd - 1)[nadd - 1]      # every tie of the last one
            others, d = others[near_enough], d[near_enough]
            pts = np.concatenate([pts, others[np.lexsort((others, d))[:nadd]]])
        members.append(pts)
    sizes = np.array([m.size for m in members])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.concatenate(members).astype(np.int32)
    return Codebook(values, mid, offsets, flat, np.ascontiguousarray(values[flat].T))
