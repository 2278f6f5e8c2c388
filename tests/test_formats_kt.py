"""The trellis types IQ1_KT..IQ4_KT against real references.

Oracles: ../shared/golden/ik (ik's C quantizer) for the numba kernels on every input with and
without imatrix, and for the numpy twin on one input (it is slow); on fresh inputs (zero rows and
blocks, 1e-30 blocks, heavy tails, huge values, expert imatrix slices) the kernel must equal the
twin; decoders must equal the wheel's C ``to_float`` bit for bit.  ``fma32`` (the exact float32
fused multiply-add the scale fit needs) is checked against exact rational arithmetic.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, expert_imatrix, fresh_input, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.formats import kt
from quantkit.formats._kt_codebook import SPECS, codebook
from quantkit.kernels import kt as kt_kernels
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = [T.IQ1_KT, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT]
ggml = peers.load_ggml()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden_numba(shared_dir, qtype, name, use_imatrix):
    _, x, imatrix = golden_input(shared_dir, "ik", name)
    want = golden_bytes(shared_dir, "ik", name, qtype, use_imatrix)
    got = quantize(x, qtype, imatrix if use_imatrix else None, "ik", False)
    assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name}")


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden_numpy(shared_dir, qtype, use_imatrix):
    _, x, imatrix = golden_input(shared_dir, "ik", "gauss")
    x = x[:10]          # the edge-case rows and a few ordinary ones: the twin is slow
    want = golden_bytes(shared_dir, "ik", "gauss", qtype, use_imatrix).reshape(16, -1)[:10]
    got = quantize(x, qtype, imatrix if use_imatrix else None, "ik", True)
    assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} gauss numpy")


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_kernel_equals_twin_on_fresh_experts(qtype, use_imatrix):
    x = fresh_input(int(qtype), n_rows=4, n=512)
    x[3] = (np.random.default_rng(int(qtype)).standard_normal(512) * 3e5).astype(np.float32)
    ims = expert_imatrix(int(qtype) + 1, 2, 512) if use_imatrix else [None, None]
    for e, im in enumerate(ims):
        xe = x[2 * e:2 * e + 2]
        assert_same_bytes(quantize(xe, qtype, im, "ik", False), quantize(xe, qtype, im, "ik", True),
                          qtype, 512, f"expert {e}")


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
    np.testing.assert_array_equal(kt.fma32(a, b, c).view(np.uint32), want.view(np.uint32))
    fused = np.empty_like(a)
    kt_kernels.fma32_arrays(a, b, c, fused)
    np.testing.assert_array_equal(fused.view(np.uint32), want.view(np.uint32))
    plain = (a * b + c).astype(np.float32)
    assert not np.array_equal(plain.view(np.uint32), want.view(np.uint32))     # the test can tell


@pytest.mark.parametrize("name", sorted(SPECS))
def test_search_breaks_ties_as_ik(name):
    """Equal scores go to ik's SIMD lane first, then to the earlier position: the kernel's one-pass
    vector search equals the twin's explicit rule.  Ties are made on purpose: a group with zero
    weights scores 0 at every code, and one with zero weights on all values but one or two ties the
    codes that agree on the others (imatrix columns of unused inputs are zero like this)."""
    spec = SPECS[name]
    g = spec.group
    twin = kt.matcher(name)
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
        want = twin.match(d, x, w)
        np.testing.assert_array_equal(codes, want, err_msg=f"{name} block {b}")
        # count the groups whose winner is not the first position holding the minimum: only the
        # lane rule decides those
        inv = np.float32(1) / d
        for l in range(32 // g):
            vx, wl = inv * x[g * l:g * l + g], w[g * l:g * l + g]
            c = int(kt.cluster_of(spec, twin.cb.mid, vx))
            vals = twin.cb.member_values[c]
            sq = wl * (vals - vx) ** 2
            score = kt.hsum8(sq) if g == 8 else (sq[:, 0] + sq[:, 2]) + (sq[:, 1] + sq[:, 3])
            first = int(np.flatnonzero(score == score.min())[0])
            lane_decided += twin.cb.members[c][first] != want[l]
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


@pytest.mark.parametrize("name", ["iq1_kt", "iq4_kt"])
def test_codebook_builders_agree(name):
    """The numba neighbour search builds the same clusters as the numpy reference (stable sort)."""
    a, b = codebook(name), codebook(name, reference=True)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.flat_members, b.flat_members)
    np.testing.assert_array_equal(a.mid, b.mid)
