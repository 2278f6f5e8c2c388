"""The trellis types IQ1_KT..IQ4_KT against real references.

Oracles: ../shared/golden/ik (ik's C quantizer) for the numba kernels (the only implementation) on
every input with and without imatrix (edge-case rows: zero rows and blocks, 1e-30 blocks, a huge
outlier; an imatrix with zero columns and outliers); decoders (numpy and numba) must equal the
wheel's C ``to_float`` bit for bit.  Two pieces of the search are checked on their own: ``fma32``
(the exact float32 fused multiply-add the scale fit needs) against exact rational arithmetic, and
the nearest-code search's tie-break against ik's rule written out here.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.formats import kt
from quantkit.formats._kt_codebook import SPECS, cluster_of, codebook
from quantkit.kernels import kt as kt_kernels
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = [T.IQ1_KT, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT]
ggml = peers.load_ggml()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden(shared_dir, qtype, name, use_imatrix):
    _, x, imatrix = golden_input(shared_dir, "ik", name)
    want = golden_bytes(shared_dir, "ik", name, qtype, use_imatrix)
    got = quantize(x, qtype, imatrix if use_imatrix else None, "ik")
    assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name}")


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_decoders_match_wheel(shared_dir, qtype):
    rng = np.random.default_rng(int(qtype))
    t = traits(qtype)
    rand = rng.integers(0, 256, (3, t.row_size(512)), dtype=np.uint8)
    rand[:, :4] = (rng.standard_normal(3) * 1e-3).astype("<f4").view(np.uint8).reshape(3, 4)
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    cases = [(rand, 512), (golden_bytes(shared_dir, "ik", "heavy", qtype, True).reshape(x.shape[0], -1), x.shape[1])]
    for blocks, n in cases:
        fast = formats.dequantize(blocks, qtype, n)
        slow = formats.dequantize(blocks, qtype, n, reference=True)
        np.testing.assert_array_equal(fast.view(np.uint32), slow.view(np.uint32))
        if ggml is None:
            continue
        c = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
        np.testing.assert_array_equal(fast.view(np.uint32), c.reshape(fast.shape).view(np.uint32))
    if ggml is None:
        pytest.skip("the wheel's decoder is not available")


def _exact_fma32(a, b, c) -> np.float32:
    """Round a*b + c (exact rationals) to the nearest float32, ties to even."""
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    lo = np.float32(float(v))            # within one float32 ulp of v
    best = None
    for cand in (np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - v)
        key = (err, int(np.array(cand).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return np.float32(best[1])


def test_fma32_is_exact():
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(400) * 10.0 ** rng.integers(-8, 8, 400)).astype(np.float32)
    b = (rng.standard_normal(400) * 10.0 ** rng.integers(-8, 8, 400)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(400) * 1e-7)).astype(np.float32)  # cancellation
    c[::3] = rng.standard_normal(c[::3].size).astype(np.float32)
    want = np.array([_exact_fma32(*t) for t in zip(a, b, c)], np.float32)
    fused = np.empty_like(a)
    kt_kernels.fma32_arrays(a, b, c, fused)
    np.testing.assert_array_equal(fused.view(np.uint32), want.view(np.uint32))
    plain = (a * b + c).astype(np.float32)
    assert not np.array_equal(plain.view(np.uint32), want.view(np.uint32))     # the test can tell


# SIMD lane of member position p % 8 in ik's group-of-4 search (two groups per 8-wide register)
LANE4 = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def _match_by_rule(name, d, x, w):
    """ik's find_best_match as its rule, per group: (the winning code, the code at the first position
    holding the minimum).  The group's cluster's members (every code for an empty cluster) are scored
    in ik's summation order, ``((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`` (groups of 4:
    ``(s0+s2)+(s1+s3)``); the lowest score wins, equal scores go to the lower SIMD lane, then to the
    earlier position."""
    spec, cb = SPECS[name], codebook(name)
    g = spec.group
    inv = np.float32(1) / d
    found = []
    for l in range(32 // g):
        vx, wl = inv * x[g * l:g * l + g], w[g * l:g * l + g]
        c = int(cluster_of(spec, cb.mid, vx))
        pts = cb.flat_members[cb.offsets[c]:cb.offsets[c + 1]]
        if pts.size == 0:
            pts = np.arange(cb.values.shape[0])
        diff = cb.values[pts] - vx
        sq = wl * (diff * diff)
        if g == 8:
            p = sq[:, :4] + sq[:, 4:]
            score = (p[:, 0] + p[:, 2]) + (p[:, 1] + p[:, 3])
            lane = np.arange(pts.size) % 8
        else:
            score = (sq[:, 0] + sq[:, 2]) + (sq[:, 1] + sq[:, 3])
            lane = LANE4[np.arange(pts.size) % 8]
        cand = np.flatnonzero(score == score.min())
        found.append((pts[cand[np.lexsort((cand, lane[cand]))[0]]], pts[cand[0]]))
    return found


@pytest.mark.parametrize("name", sorted(SPECS))
def test_search_breaks_ties_as_ik(name):
    """Equal scores go to ik's SIMD lane first, then to the earlier position: the kernel's one-pass
    vector search equals the explicit rule.  Ties are made on purpose: a group with zero weights
    scores 0 at every code, and one with zero weights on all values but one or two ties the codes
    that agree on the others (imatrix columns of unused inputs are zero like this)."""
    spec = SPECS[name]
    g = spec.group
    tables = kt._kernel_tables(name)
    rng = np.random.default_rng(spec.num_bits + g)
    n_blocks, lane_decided = 60, 0
    for b in range(n_blocks):
        x = rng.standard_normal(32).astype(np.float32)
        x = np.abs(x) if spec.is_abs else x
        w = (rng.random(32) + 0.1).astype(np.float32)
        w[:g] = 0                                   # every code ties
        w[g:2 * g - 1] = 0                          # ties among codes equal in the last value
        w[2 * g:3 * g - 2] = 0                      # ... in the last two
        d = np.float32(np.abs(x).max() / 100)
        codes = np.empty(32 // g, np.int64)
        kt_kernels.match(d, x, w, 0, *tables[:5], codes, 0)
        found = _match_by_rule(name, d, x, w)
        np.testing.assert_array_equal(codes, [want for want, _ in found], err_msg=f"{name} block {b}")
        # the groups whose winner is not the first position holding the minimum: only the lane rule
        # decides those
        lane_decided += sum(want != first for want, first in found)
    assert lane_decided > 10, lane_decided          # the test can tell a positional tie-break


@pytest.mark.parametrize("name", sorted(SPECS))
def test_codebook_shape(name):
    """ik's search steps 8 members at a time: every cluster is a multiple of 8, and every code is in
    n_neighbours clusters (padding adds more)."""
    spec = SPECS[name]
    cb = codebook(name)
    sizes = np.diff(cb.offsets)
    assert (sizes % 8 == 0).all()
    counts = np.bincount(cb.flat_members, minlength=1 << spec.num_bits)
    assert counts.min() >= spec.n_neighbours
    assert cb.values.min() >= (0 if spec.is_abs else -126) and cb.values.max() <= 126
