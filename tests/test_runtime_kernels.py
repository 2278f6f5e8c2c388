"""The runtime's numba kernels against their plain-numpy twins (tests/runtime_twins.py), and
the float16 rounding against numpy's own float16 cast."""
from __future__ import annotations

import numpy as np
import pytest

from quantkit.runtime import kernels, ops_cpu
import runtime_twins as ref

F32 = np.float32


def awkward_values(rng, shape) -> np.ndarray:
    """Normal values with zeros, tiny (f16-subnormal) and huge (f16-overflowing) ones mixed in."""
    x = rng.standard_normal(shape).astype(F32)
    flat = x.reshape(-1)
    idx = rng.permutation(flat.size)
    k = flat.size // 16
    flat[idx[:k]] = 0
    flat[idx[k:2 * k]] *= F32(1e-6)
    flat[idx[2 * k:3 * k]] *= F32(1e5)
    return x


def test_f16_round_equals_numpy_cast_on_every_range():
    rng = np.random.default_rng(1)
    x = awkward_values(rng, (64, 96))
    # ties between two float16 neighbours, in the normal and the subnormal range
    x[0, :4] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -24 * 0.5, 2.0 ** -24 * 1.5]
    x[1, :5] = [65504.0, 65519.0, 65520.0, -1e30, np.nan]
    with np.errstate(over="ignore"):
        expect = x.astype(np.float16).astype(F32)
    for kernel in (kernels.f16_round_rows, kernels.f16_round_few):       # parallel rows, rows in turn
        got = np.empty_like(x)
        kernel(x, got)
        np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(ref.f16_round(x), expect)


def test_expf_is_ggml_v_expf_within_few_ulp_of_exp():
    """kernels.expf (the softmax's and SiLU's exponential) == its twin bit for bit, within 2.5 ulp
    of exp over the normal range (2.22 measured), and its edges: exp(-inf) = 0, +inf
    above 88.73, 0 far below, NaN stays NaN, a gradual underflow in between."""
    rng = np.random.default_rng(11)
    x = np.concatenate([np.linspace(-104, 89, 200_003), rng.standard_normal(100_000) * 30,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 88.72, 88.73, -87.3, -103.5, -200.0, 1e10]])
    x = x.astype(F32).reshape(1, -1)
    got = x.copy()
    kernels.exp_shifted_rows(got, np.zeros(1, F32))                     # exp(x - 0), in place
    got, x = got[0], x[0]
    np.testing.assert_array_equal(got, ref.expf(x))                     # NaN where NaN, any payload
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64))
    normal = np.isfinite(exact) & (exact >= 2.0 ** -126) & (exact < np.finfo(F32).max)
    ulp = np.spacing(exact[normal].astype(F32)).astype(np.float64)
    assert (np.abs(got[normal] - exact[normal]) / ulp).max() <= 2.5
    tiny = (exact > 0) & (exact < 2.0 ** -126)                           # f32 subnormals: 2^-149 apart
    assert (np.abs(got[tiny] - exact[tiny]) <= 2 * 2.0 ** -149).all() and (got[tiny] > 0).any()
    edge = dict(zip(x[-11:].tolist(), got[-11:].tolist()))
    assert edge[0.0] == 1.0 and edge[-np.inf] == 0.0 and edge[np.inf] == np.inf and edge[-200.0] == 0.0
    assert edge[1e10] == np.inf and np.isnan(got[-7]) and np.isfinite(edge[float(F32(88.72))])


@pytest.mark.parametrize("pos0,rows_per_pos", [(0, 1), (0, 3), (5, 2), (40, 1)])
def test_causal_softmax_f16(pos0, rows_per_pos):
    rng = np.random.default_rng(pos0 + rows_per_pos)
    n_pos = 12
    n_kv = pos0 + n_pos
    s = (rng.standard_normal((n_pos * rows_per_pos, n_kv)) * 4).astype(F32)
    expect = ref.causal_softmax_f16(s, pos0, rows_per_pos, 0.125)
    got = s.copy()
    ops_cpu.causal_softmax_f16(got, pos0, rows_per_pos, 0.125)
    # numpy sums a row pairwise, the kernel in order: a last-bit difference of the factor can move
    # an f16 rounding
    np.testing.assert_allclose(got, expect, rtol=2 ** -10, atol=0)
    # masked keys are exact zeros and every row sums to 1 up to f16 rounding
    future = np.arange(n_kv)[None, :] > (pos0 + np.arange(len(s)) // rows_per_pos)[:, None]
    assert (got[future] == 0).all() and (got[~future] > 0).any()
    np.testing.assert_allclose(got.sum(axis=1), 1, rtol=2e-3)


@pytest.mark.parametrize("kernel,twin,block", [(kernels.round_q8_0_rows, ref.round_q8_0, 32),
                                                (kernels.round_q8_K_rows, ref.round_q8_K, 256)])
def test_activation_rounding(kernel, twin, block):
    rng = np.random.default_rng(block)
    x = awkward_values(rng, (7, 4 * block))
    x[0, :block] = 0                                     # an all-zero block
    x[1, :block] = -3.0                                  # the largest magnitude is negative
    got = np.empty_like(x)
    kernel(x, got)
    np.testing.assert_array_equal(got, twin(x))
    # 8 bits per value: at most 255 distinct values per block
    assert all(len(np.unique(b)) <= 255 for b in got.reshape(-1, block))


@pytest.mark.parametrize("loop", ["rows", "few"])
def test_silu_mul_and_rmsnorm(loop):
    """Both loops over the rows (parallel, and in turn for a generation step's few rows)."""
    silu_mul, rmsnorm = getattr(kernels, f"silu_mul_{loop}"), getattr(kernels, f"rmsnorm_{loop}")
    rng = np.random.default_rng(3)
    g, u = rng.standard_normal((2, 9, 100)).astype(F32) * 5
    got = np.empty_like(g)
    silu_mul(g, u, got)
    np.testing.assert_array_equal(got, ref.silu_mul(g, u))
    x = awkward_values(rng, (9, 100))
    w = rng.standard_normal(100).astype(F32)
    got = np.empty_like(x)
    rmsnorm(x, w, 1e-5, got)
    np.testing.assert_allclose(got, ref.rmsnorm(x, w, 1e-5), rtol=1e-6)
    np.testing.assert_array_equal(ops_cpu.rmsnorm(x, w, 1e-5), got)
    np.testing.assert_array_equal(ops_cpu.rmsnorm(x[:2], w, 1e-5), got[:2])


@pytest.mark.parametrize("n_head,n_head_kv,pos0,n_tok", [(6, 2, 0, 150), (4, 4, 7, 3), (8, 1, 20, 1)])
def test_attention_equals_dense_reference(n_head, n_head_kv, pos0, n_tok):
    """The blocked attention against the whole-matrix formula (all heads at once, full mask)."""
    rng = np.random.default_rng(n_head + pos0)
    k_dim, v_dim = 16, 8
    cache = ops_cpu.KVCache(1, pos0 + n_tok, n_head_kv, k_dim, v_dim)
    cache.store(0, 0, rng.standard_normal((pos0 + n_tok, n_head_kv, k_dim)),
                rng.standard_normal((pos0 + n_tok, n_head_kv, v_dim)))
    q = rng.standard_normal((n_tok, n_head, k_dim)).astype(F32)
    got = ops_cpu.attention(q, cache, 0, pos0, 0.25)
    k = cache.k[0].astype(F32)
    v = cache.v[0].astype(F32)
    g = n_head // n_head_kv
    expect = np.empty((n_tok, n_head, v_dim), F32)
    for h in range(n_head):
        s = ref.f16_round(q[:, h]) @ k[:, h // g].T
        p = ref.causal_softmax_f16(s, pos0, 1, 0.25)
        expect[:, h] = p @ v[:, h // g]
    # BLAS may sum a score in another order for another block shape, and a last-bit difference
    # can move a probability's f16 rounding (2^-11 relative): tolerances of that size
    np.testing.assert_allclose(got.reshape(n_tok, n_head, v_dim), expect, rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize("neox,n_tok", [(False, 1), (True, 3)])
def test_rope_store_is_rope_rope_and_store(neox, n_tok):
    """ops_cpu.rope_store (one kernel for a step: q and k rotated, k and v written to the f16
    cache as float16 bits) == rope, rope and KVCache.store apart, bit for bit: values that round to
    f16 subnormals, ties, overflow to inf, NaN; grouped-query heads, a partial rotation (n_rot <
    head_dim); another cache position and layer untouched."""
    rng = np.random.default_rng(n_tok)
    n_head, n_head_kv, head_dim, n_rot, pos0 = 6, 2, 16, 12, 5
    q = awkward_values(rng, (n_tok, n_head, head_dim))
    k, v = awkward_values(rng, (n_tok, n_head_kv, head_dim)), awkward_values(rng, (n_tok, n_head_kv, head_dim))
    v[0, 0, :6] = [1 + 2.0 ** -11, 2.0 ** -24 * 1.5, 65519.0, 65520.0, -1e30, np.nan]
    pos = np.arange(pos0, pos0 + n_tok)
    caches = [ops_cpu.KVCache(2, 12, n_head_kv, head_dim, head_dim) for _ in range(2)]
    with np.errstate(over="ignore", invalid="ignore"):
        got = ops_cpu.rope_store(q.copy(), k.copy(), v, caches[0], 1, pos, n_rot, 10000.0, 0.5, neox)
        expect = ops_cpu.rope(q.copy(), pos, n_rot, 10000.0, 0.5, neox)
        caches[1].store(1, pos0, ops_cpu.rope(k.copy(), pos, n_rot, 10000.0, 0.5, neox), v)
    np.testing.assert_array_equal(got, expect)
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        nan = np.isnan(b)
        assert (np.isnan(a) == nan).all() and nan.any() == (a is caches[0].v)
        np.testing.assert_array_equal(a.view(np.uint16)[~nan], b.view(np.uint16)[~nan])
    assert not caches[0].k[0].any() and not caches[0].k[1, pos0 + n_tok:].any()
    with pytest.raises(ValueError, match="context is full"):
        ops_cpu.rope_store(q.copy(), k.copy(), v, caches[0], 1, pos + 12 - pos0 - n_tok + 1, n_rot, 10000.0)


def test_add_rmsnorm_is_the_add_then_the_norm():
    """ops_cpu.add_rmsnorm == x + y and rmsnorm of it, bit for bit: a step's rows (one kernel) and
    a batch's (the two apart)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal(96).astype(F32)
    for n in (1, 4, 9):
        x, y = awkward_values(rng, (n, 96)), awkward_values(rng, (n, 96))
        total, h = ops_cpu.add_rmsnorm(x, y, w, 1e-6)
        np.testing.assert_array_equal(total, x + y)
        np.testing.assert_array_equal(h, ops_cpu.rmsnorm(x + y, w, 1e-6))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_kernel_equals_rotation_formula(neox):
    rng = np.random.default_rng(int(neox))
    x = rng.standard_normal((5, 3, 16)).astype(F32)
    pos = np.arange(7, 12)
    n_rot, half = 12, 6
    theta = pos[:, None] * (10000.0 ** (-2.0 * np.arange(half) / n_rot))[None, :]
    cos, sin = np.cos(theta).astype(F32)[:, None], np.sin(theta).astype(F32)[:, None]
    ia, ib = (np.arange(half), np.arange(half) + half) if neox else (np.arange(0, n_rot, 2), np.arange(1, n_rot, 2))
    expect = x.copy()
    expect[..., ia] = x[..., ia] * cos - x[..., ib] * sin
    expect[..., ib] = x[..., ia] * sin + x[..., ib] * cos
    got = ops_cpu.rope(x.copy(), pos, n_rot, 10000.0, neox=neox)
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])
    # a non-contiguous view is rotated in place too
    y = np.concatenate([x, x], axis=-1)
    ops_cpu.rope(y[..., :16], pos, n_rot, 10000.0, neox=neox)
    np.testing.assert_array_equal(y[..., :16], got)
    # a generation step's few tokens (the rows in turn)
    few = ops_cpu.rope(x[:2].copy(), pos[:2], n_rot, 10000.0, neox=neox)
    np.testing.assert_array_equal(few, got[:2])


def test_square_sums_and_target_nll():
    from quantkit.runtime.scoring import token_nll
    rng = np.random.default_rng(5)
    x = awkward_values(rng, (40, 24))
    sums = np.full(24, 0.5)
    kernels.add_square_sums(x, sums)
    np.testing.assert_array_equal(sums, 0.5 + np.square(x, dtype=F32).sum(axis=0, dtype=np.float64))
    logits = (rng.standard_normal((20, 300)) * 3).astype(F32)
    targets = rng.integers(0, 300, 20)
    expect = -ref_log_softmax(logits)[np.arange(20), targets]
    np.testing.assert_allclose(token_nll(logits, targets), expect, rtol=1e-6)


def ref_log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(axis=1, keepdims=True) - np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
