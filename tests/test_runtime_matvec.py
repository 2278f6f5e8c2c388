"""Generation's fused products (runtime/matvec.py over runtime/dot.py) and its attention of a few
tokens (kernels.attend_few), against their twins.

A fused product multiplies the packed rows with the activations rounded as ggml's q8_0 rounds them
(matvec.round_q8), so its twin is the decoded rows (each format's plain-numpy reference decoder)
times those rounded activations, in float64.  F32/F16 rows are multiplied in float.
"""
from __future__ import annotations

import numpy as np
import pytest
import runtime_twins
from numba import njit

from quantkit import formats
from quantkit.formats import interleave
from quantkit.formats import decode
from quantkit.runtime import code_dots, dot, kernels, matmul8, matvec, ops_cpu
from quantkit.runtime.weights import Weight
from quantkit.types import QuantType, traits, type_name

T = QuantType
FUSED = sorted({q for q in formats.registered() if matvec.kind_of(q) is not None} | {T.F32, T.F16}, key=int)


def rows_of(qtype, n_rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_rows, n)) * rng.uniform(0.01, 1.0, (n_rows, 1))).astype(np.float32)
    if qtype == T.F32:
        return w.view(np.uint8)
    if qtype == T.F16:
        return w.astype(np.float16).view(np.uint8)
    # ik's quantizer where it has one (tq1_0/tq2_0: mainline's); an imatrix where the type needs one
    flavor = "ik" if formats.can_quantize(qtype, "ik", True) else "mainline"
    imatrix = None if formats.can_quantize(qtype, flavor) else rng.uniform(0.5, 2.0, n).astype(np.float32)
    return formats.quantize(w, qtype, imatrix, flavor)


def decoded(blocks, qtype, n) -> np.ndarray:
    if qtype == T.F32:
        return blocks.view(np.float32).astype(np.float64)
    if qtype == T.F16:
        return blocks.view(np.float16).astype(np.float64)
    if qtype == T.IQ6_K:
        # the grid, as ik's matrix products decode IQ6_K (its to_float: a cubic in the code)
        return decode.dequantize(blocks, qtype, n, products=True).astype(np.float64)
    return formats.dequantize(blocks, qtype, n, reference=True).astype(np.float64)


def rounded(x: np.ndarray, qtype) -> np.ndarray:
    """The activations as the fused product uses them."""
    if qtype in (T.F32, T.BF16, T.BF16_R16):      # float rows times float activations
        return x
    if qtype == T.F16:
        return x.astype(np.float16).astype(np.float32)
    out = np.empty_like(x)
    kernels.round_q8_0_rows(x, out)
    return out


def test_every_kernel_is_reached():
    # code_dots' types are checked on the reference bytes (test_runtime_code_dots.py), here too once
    # their formats are registered
    kinds = {matvec.kind_of(q) for q in FUSED} | {matvec.kind_of(q) for q in code_dots.TYPES}
    assert kinds == set(matvec.KIND.values())
    names = {type_name(q) for q in FUSED}
    for must in ("q8_0_r8", "q4_0_r8", "iq4_nl_r4", "q4_k_r4", "q6_k_r4", "iq4_k_r4", "iq2_k_r4", "iq4_xs_r8"):
        assert must in names, must
    # group kernels of their own (after every plain kind), for the types bench/run.py measures
    assert {T.Q4_0_R8, T.IQ2_K_R4} <= set(matvec.STEP)
    assert min(matvec.STEP.values()) == len(matvec.KIND)


def _widths(qtype):
    # legacy rows: whole chunks of 8 blocks, and a tail of 4 + 2 + 1 blocks (480 = 256 + 224);
    # super-block rows: 3 super-blocks; float rows also with a tail of 8 and of 4
    if matvec.kind_of(qtype) < matvec.FLOAT_KINDS:
        return (576, 108)
    return (480, 1024) if traits(qtype).block_size == 32 else (768,)


def product_cases(qtype):
    """(n, n_rows, seed) of the matrices check_fused_product multiplies for qtype."""
    group = traits(qtype).interleave_rows
    return [(n, 8 * group, int(qtype) + n) for n in _widths(qtype)]


def check_fused_product(qtype, rows=rows_of):
    """The fused product of each of qtype's product_cases (``rows(qtype, n_rows, n, seed)``: its
    blocks) against the decoded rows times the rounded activations, for 1 and FUSED_TOKENS tokens
    (also run by test_generic_cpu on the generic CPU target)."""
    for n, n_rows, seed in product_cases(qtype):
        blocks = rows(qtype, n_rows, n, seed)
        w = Weight("w", qtype, (n, n_rows), blocks)
        ref_rows = decoded(blocks, qtype, n)
        for n_tok in (1, ops_cpu.FUSED_TOKENS):
            x = np.random.default_rng(n_tok).standard_normal((n_tok, n)).astype(np.float32) * 3
            got = ops_cpu.matmul_q(w, x)
            ref = rounded(x, qtype).astype(np.float64) @ ref_rows.T
            assert got.shape == (n_tok, n_rows) and got.dtype == np.float32
            np.testing.assert_allclose(got, ref, rtol=0, atol=3e-6 * np.abs(ref).max(),
                                       err_msg=f"{type_name(qtype)} n={n} tokens={n_tok}")


@pytest.mark.parametrize("qtype", FUSED, ids=type_name)
def test_fused_product_equals_decoded_rows_times_rounded_activations(qtype):
    check_fused_product(qtype)


# interleaved types whose generation steps read the stored groups of rows (runtime/group_dot.py)
STEP_TYPES = sorted(matvec.STEP, key=int)


def check_step_product(qtype, rows=rows_of):
    """An interleaved type's generation kernel (matvec.STEP: R stored rows at once) gives every row
    the bits of the plain kernel over the regrouped rows (matvec.FUSED's), for 1 and FUSED_TOKENS
    tokens, alone, through ops_cpu.matmul_q (which then regroups nothing) and beside other weights
    in one matvec.Products launch (also run by test_generic_cpu on the generic CPU target)."""
    step = matvec.STEP[qtype]
    kind, regrouped = matvec.FUSED[qtype]
    assert regrouped
    for n, n_rows, seed in product_cases(qtype):
        blocks = rows(qtype, n_rows, n, seed)
        w = Weight("w", qtype, (n, n_rows), blocks)
        plain = interleave.deinterleave(blocks, qtype, n)
        products = matvec.Products([(kind, plain), (step, blocks)])
        for n_tok in (1, ops_cpu.FUSED_TOKENS):
            x = np.random.default_rng(seed + n_tok).standard_normal((n_tok, n)).astype(np.float32) * 3
            x[0, 32:64] = 0                                 # an all-zero block: scale 0
            want = matvec.matvec(kind, plain, x).view(np.uint32)
            msg = f"{type_name(qtype)} n={n} tokens={n_tok}"
            np.testing.assert_array_equal(matvec.matvec(step, blocks, x).view(np.uint32), want, err_msg=msg)
            np.testing.assert_array_equal(ops_cpu.matmul_q(w, x).view(np.uint32), want, err_msg=msg)
            both = products(x)
            np.testing.assert_array_equal(both[1].view(np.uint32), want, err_msg=msg)
            np.testing.assert_array_equal(both[0].view(np.uint32), want, err_msg=msg)
        assert not w._plain                                 # the step read the stored groups


@pytest.mark.parametrize("qtype", STEP_TYPES, ids=type_name)
def test_interleaved_step_kernel_equals_the_plain_kernel_row_for_row(qtype):
    check_step_product(qtype)


def test_interleaved_step_kernels_refuse_partial_groups_and_other_lengths():
    """The group kernels read whole groups of rows without bounds checks: matvec and Products
    refuse a row count that is not a multiple of the group, rows of another length than x's, and
    Products an input of another length than its rows'."""
    for qtype in STEP_TYPES:
        group = traits(qtype).interleave_rows
        n = 256 if traits(qtype).block_size == 256 else 64
        blocks = rows_of(qtype, 2 * group, n, 1)
        step = matvec.STEP[qtype]
        x = np.ones((1, n), np.float32)
        with pytest.raises(ValueError, match="multiple"):
            matvec.matvec(step, blocks[:group + group // 2], x)
        with pytest.raises(ValueError, match="multiple"):
            matvec.Products([(step, blocks[:group // 2])])
        with pytest.raises(ValueError, match="values"):
            matvec.matvec(step, blocks, np.ones((1, 2 * n), np.float32))
        with pytest.raises(ValueError, match="values"):
            matvec.Products([(step, blocks)])(np.ones((1, 2 * n), np.float32))
        with pytest.raises(ValueError, match="lengths"):
            matvec.Products([(step, blocks), (matvec.kind_of(T.Q8_0), rows_of(T.Q8_0, 4, 2 * n, 1))])


# the types whose batches matmul8 multiplies: one per kernel, and interleaved ones (their plain rows)
BATCHED = [q for q in FUSED if matmul8.supports(matvec.kind_of(q))]
BATCH_TYPES = [*{matvec.kind_of(q): q for q in reversed(BATCHED)}.values(), T.Q4_0_R8, T.IQ4_K_R4, T.IQ2_K_R4,
               T.Q8_0_R8, T.Q4_K_R4, T.IQ4_XS_R8]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.IQ2_XXS, T.IQ3_S], ids=type_name)
def test_batch_products_refuse_rows_of_another_length(qtype):
    """The batch kernels (matmul8's tiles, grid_tiles' included) read rows without bounds checks:
    rows whose length is not x's are refused before any kernel runs, alone or among several."""
    kind = matvec.kind_of(qtype)
    blocks = rows_of(qtype, 8, 256, 1)
    x = np.ones((32, 512), np.float32)
    with pytest.raises(ValueError, match="values"):
        matmul8.matmul8(kind, blocks, x)
    with pytest.raises(ValueError, match="values"):
        matmul8.matmul8_many([(kind, rows_of(qtype, 8, 512, 1)), (kind, blocks)], x)


def check_batch_product(qtype, rows=rows_of):
    """A batch's product (more than FUSED_TOKENS tokens: matmul8) token for token the bits of the
    generation step's fused kernel (matvec), so a prompt's logits are its steps' (also run by
    test_generic_cpu on the generic CPU target).  37 tokens: a whole block of 32 and a part one.
    Interleaved types: a batch multiplies their rows regrouped into plain ones, a step the stored
    rows where a group kernel reads them (matvec.STEP: q4_0_r8, iq2_k_r4), else the same plain rows."""
    for n, n_rows, seed in product_cases(qtype)[:2]:
        blocks = rows(qtype, n_rows, n, seed)
        w = Weight("w", qtype, (n, n_rows), blocks)
        x = np.random.default_rng(seed).standard_normal((37, n)).astype(np.float32) * 3
        x[3, :32] = 0                                   # an all-zero block: scale 0
        steps = np.concatenate([matvec.matvec(*ops_cpu._kernel_rows(w, step=True), x[t:t + 1]) for t in range(len(x))])
        for n_tok in (ops_cpu.FUSED_TOKENS + 1, 37):
            got = ops_cpu.matmul_q(w, x[:n_tok])
            np.testing.assert_array_equal(got.view(np.uint32), steps[:n_tok].view(np.uint32),
                                          err_msg=f"{type_name(qtype)} n={n} tokens={n_tok}")


@pytest.mark.parametrize("qtype", BATCH_TYPES, ids=type_name)
def test_batch_product_equals_the_fused_kernel_token_for_token(qtype):
    check_batch_product(qtype)


def test_batch_products_of_a_shared_input_equal_the_fused_kernel():
    """ops_cpu.matmul_q_many of a batch (matmul8_many: the input rounded once, the rows of all the
    weights split between the threads together, tiles of rows cut at the weights' ends) gives each
    weight the bits of the generation step's kernel, a type with run mins among them."""
    n, n_tok = 512, 21
    shapes = [(T.Q8_0, 24), (T.Q2_K, 40), (T.Q4_K, 7), (T.IQ4_KS, 16)]
    ws = [Weight("w", q, (n, n_rows), rows_of(q, n_rows, n, seed)) for seed, (q, n_rows) in enumerate(shapes)]
    x = np.random.default_rng(5).standard_normal((n_tok, n)).astype(np.float32) * 3
    x[2, 64:96] = 0
    for w, got in zip(ws, ops_cpu.matmul_q_many(ws, x)):
        steps = matvec.matvec(matvec.FUSED[w.qtype][0], w.blocks, x)
        np.testing.assert_array_equal(got.view(np.uint32), steps.view(np.uint32), err_msg=type_name(w.qtype))


def test_float_products_of_a_batch():
    """ops_cpu.float_products (--float-products): from FUSED_TOKENS + 1 tokens on the product is the
    float one (decoded tiles and BLAS), as fused=False asks of any backend; a few tokens and
    fused=True stay the 8-bit ones."""
    qtype, n = T.Q4_K, 512
    blocks = rows_of(qtype, 16, n, seed=1)
    w = Weight("w", qtype, (n, 16), blocks)
    x = np.random.default_rng(2).standard_normal((ops_cpu.FUSED_TOKENS + 1, n)).astype(np.float32)
    ref = x.astype(np.float64) @ decoded(blocks, qtype, n).T
    fp = ops_cpu.float_products
    for got in (fp.matmul_q(w, x), ops_cpu.matmul_q(w, x, fused=False), fp.matmul_q_heads([w, w], np.stack([x, x], 1))[:, 1]):
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    eight = ops_cpu.matmul_q(w, x)
    assert np.abs(eight - ref).max() > 1e-4 * np.abs(ref).max()         # rounded activations differ
    np.testing.assert_array_equal(fp.matmul_q(w, x, fused=True), eight)
    np.testing.assert_array_equal(fp.matmul_q(w, x[:2]), eight[:2])
    assert fp.FLOAT_BATCHES and not ops_cpu.FLOAT_BATCHES and fp.rmsnorm is ops_cpu.rmsnorm


def test_activation_rounding_equals_the_q8_0_kernel():
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32) * 5
    x[1, :32] = 0                       # an all-zero block: scale 0, codes 0
    xq = np.zeros((3, 256), np.int8)
    xd, xsum = np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32)
    matvec.round_q8(x, xq, xd, xsum)
    ref = np.empty_like(x)
    kernels.round_q8_0_rows(x, ref)
    np.testing.assert_array_equal(xq * np.repeat(xd, 32, axis=1), ref)
    assert np.abs(xq).max() <= 127
    np.testing.assert_allclose(xsum, ref.reshape(3, 8, 32).sum(-1), rtol=1e-6, atol=1e-6)


def _chunks():
    out = []
    for q, lay in matvec.LEGACY.items():
        for n_blocks, chunk in zip(matvec.CHUNK_BLOCKS, matvec._LEGACY_CHUNKS[q]):
            out.append((f"{type_name(q)}x{n_blocks}", chunk, lay.block_bytes * n_blocks, matvec.TABLES[q]))
    for q, chunk in matvec.SUPER_CHUNKS.items():
        out.append((type_name(q), chunk, traits(q).type_size, matvec.TABLES[q]))
    return out


@pytest.mark.parametrize("name,chunk,n_bytes,tab", _chunks(), ids=[c[0] for c in _chunks()])
def test_chunk_dot_equals_its_twin_on_random_bytes(name, chunk, n_bytes, tab):
    check_chunk(name, chunk, n_bytes, tab)


def check_chunk(name, chunk, n_bytes, tab):
    """Any bytes (not only what a quantizer writes), at an offset inside a longer row: random
    codes, packed scales, mins and grid bits; float16 fields hold random finite values.  Returns
    the chunk dot's value (the same bytes for the same name)."""
    rng = np.random.default_rng(len(name))
    o = 3 * n_bytes
    a = rng.integers(0, 256, o + n_bytes + 8, dtype=np.uint8)
    halves = [at for r in chunk.runs for at in (r.d_at, r.m_at) if at is not None]
    if chunk.sup is not None:
        halves += [at for at in (chunk.sup.d_at, chunk.sup.dmin_at) if at is not None]
    for at in halves:
        a[o + at:o + at + 2] = np.frombuffer(np.float16(rng.uniform(-2, 2)).tobytes(), np.uint8)
    if chunk.e8m0:
        # E8M0 exponents 2^(e - 128) around 1, and (blocks 2 and 3) the subnormal ones, e = 0 and 1
        for i, r in enumerate(chunk.runs):
            a[o + r.d_at] = {1: 0, 2: 1}.get(i, rng.integers(120, 136))
    n_values = max(r.xoff + r.n for r in chunk.runs)
    xo = 64
    xq = rng.integers(-127, 128, xo + n_values).astype(np.int8)
    xd = rng.uniform(0.01, 1, (xo + n_values) // 32).astype(np.float32)
    xsum = (xq[:len(xd) * 32].reshape(-1, 32).sum(-1, dtype=np.int64) * xd).astype(np.float32)
    call = njit(lambda a, o, t, q, d, m, x0: chunk(a, o, t, q, d, m, x0))
    got = call(a, o, tab, xq, xd, xsum, xo)
    ref = runtime_twins.chunk_twin(chunk, a, o, tab, xq, xd, xo)
    assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (got, ref)
    return got


def _random_cache(cls, args, n_ctx, rng):
    cache = cls(*args)
    cache.k[...] = (rng.standard_normal(cache.k.shape) * 2).astype(np.float16)
    if cls is ops_cpu.KVCache:
        cache.v[...] = rng.standard_normal(cache.v.shape).astype(np.float16)
    return cache


def test_a_value_beyond_float16_is_cached_as_inf_without_a_warning():
    """The f16 caches store +-inf for values beyond float16's range, as ggml's conversion does,
    and print nothing (numpy's cast warns: the warm-up's pass of token 0 printed it)."""
    import warnings
    caches = [ops_cpu.KVCache(1, 4, 1, 8, 8), ops_cpu.MLACache(1, 4, 4, 8)]
    big = np.full((2, 1, 8), 1e6, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        caches[0].store(0, 1, big, -big)
        caches[1].store(0, 1, big[:, :, :4], -big[:, 0])
    assert np.isposinf(caches[0].k[0, 1:3]).all() and np.isneginf(caches[0].v[0, 1:3]).all()
    assert np.isposinf(caches[1].k[0, 1:3, 0, :4]).all() and np.isneginf(caches[1].k[0, 1:3, 0, 4:]).all()


def _ggml_attention(q, keys, values, pos0, scale):
    """ggml's attention numbers in float64 where ggml keeps float32: the query rounded to f16, the
    scores' softmax, the probabilities rounded to f16, then Σ p v.  q (n_tok, n_head, k_dim), keys
    (n_kv, n_head_kv, k_dim), values (n_kv, n_head_kv, v_dim) as float16 -> (n_tok, n_head, v_dim)."""
    n_tok, n_head, _ = q.shape
    g = n_head // keys.shape[1]
    q16 = q.astype(np.float16).astype(np.float64)
    out = np.empty((n_tok, n_head, values.shape[2]))
    for t in range(n_tok):
        n_seen = pos0 + t + 1
        for h in range(n_head):
            s = keys[:n_seen, h // g].astype(np.float64) @ q16[t, h] * scale
            e = np.exp(s - s.max())
            p = (e / e.sum()).astype(np.float16).astype(np.float64)
            out[t, h] = p @ values[:n_seen, h // g].astype(np.float64)
    return out


@pytest.mark.parametrize("n_head,n_head_kv,head_dim", [(9, 3, 64), (4, 4, 44), (6, 2, 8)])
def test_attention_of_a_batch_is_its_steps_and_ggmls_numbers(n_head, n_head_kv, head_dim):
    """Attention over an f16 cache (kernels.attend_few, for any number of tokens): a batch's rows
    are each token's own step, bit for bit (odd and even batches: the kernel visits the tokens
    from both ends), and ggml's numbers to float32 rounding; head sizes with an 8-wide and a
    scalar tail, grouped-query heads."""
    rng = np.random.default_rng(head_dim)
    cache = _random_cache(ops_cpu.KVCache, (2, 40, n_head_kv, head_dim, head_dim), 40, rng)
    for pos0, n_tok in ((0, 1), (17, 1), (30, 3), (0, 7), (11, 24)):
        q = rng.standard_normal((n_tok, n_head, head_dim)).astype(np.float32)
        got = ops_cpu.attention(q, cache, 1, pos0, 0.125)
        steps = np.concatenate([ops_cpu.attention(q[t:t + 1], cache, 1, pos0 + t, 0.125) for t in range(n_tok)])
        assert np.array_equal(got.view(np.uint32), steps.view(np.uint32))
        ref = _ggml_attention(q, cache.k[1], cache.v[1], pos0, 0.125).reshape(n_tok, -1)
        # a probability near an f16 rounding boundary may round the other way from a float64
        # score: one f16 ulp (2^-11 relative) of p, times |v|
        np.testing.assert_allclose(got, ref, rtol=0, atol=2.0 ** -10 * np.abs(cache.v[1]).max())


def test_latent_attention_reads_the_value_view():
    """MLA: the values are a strided view of the cache rows (their last kv_lora_rank entries)."""
    rng = np.random.default_rng(5)
    cache = _random_cache(ops_cpu.MLACache, (1, 24, 16, 64), 24, rng)
    for n_tok in (2, 9):
        q_rope = rng.standard_normal((n_tok, 4, 16)).astype(np.float32)
        q_lat = rng.standard_normal((n_tok, 4, 64)).astype(np.float32)
        got = ops_cpu.attention_mla(q_rope, q_lat, cache, 0, 10, 0.1)
        assert got.shape == (n_tok, 4, 64)
        values = cache.k[0, :, :, 16:]
        ref = _ggml_attention(np.concatenate([q_rope, q_lat], -1), cache.k[0], values, 10, 0.1)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2.0 ** -10 * np.abs(values).max())


def test_products_of_weights_sharing_an_input_are_each_weights_matvec():
    """matvec.Products (a generation step's q/k/v and gate/up: weights of any kinds, legacy, super-block,
    float and unpacked-block ones side by side, in one parallel launch with the input rounded once)
    gives each weight the bits of its own product; ops_cpu.matmul_q_many computes one weight's
    product apart where its activations differ (F16 rows: rounded to f16) and a batch's as matmul_q."""
    n = 256
    cases = ((T.Q8_0, 40, 1), (T.F32, 5, 2), (T.Q4_K, 17, 3), (T.IQ2_XXS, 33, 4), (T.IQ1_S, 9, 5))
    parts = [(matvec.kind_of(q), rows_of(q, n_rows, n, seed)) for q, n_rows, seed in cases]
    products = matvec.Products(parts)
    rng = np.random.default_rng(7)
    for n_tok in (1, 3, 1):
        x = rng.standard_normal((n_tok, n)).astype(np.float32)
        got = products(x)
        assert len(got) == len(parts)
        for (kind, blocks), y in zip(parts, got):
            np.testing.assert_array_equal(y, matvec.matvec(kind, blocks, x))
    ws = [Weight(f"w{i}", q, (n, n_rows), rows_of(q, n_rows, n, i)) for i, (q, n_rows) in
          enumerate(((T.Q8_0, 24), (T.F16, 8), (T.Q4_K, 16), (T.TQ2_0, 8)))]
    for n_tok in (2, ops_cpu.FUSED_TOKENS + 1):
        x = rng.standard_normal((n_tok, n)).astype(np.float32)
        for group in (ws, ws[::2], ws[2:]):             # with F16 rows: each apart; then in one launch
            for w, y in zip(group, ops_cpu.matmul_q_many(group, x)):
                np.testing.assert_array_equal(y, ops_cpu.matmul_q(w, x))


def test_products_of_unpacked_block_kinds_are_each_weights_matvec():
    """The kinds whose rows unpack their blocks into buffers (code_dots.FILLS: ternary, q8_KV,
    iq1_s_r4, ...) through matvec.Products beside a legacy kind: each of the weight's tasks (three
    each: more rows than ROWS_PER_TASK) makes its own buffers on its thread, and every weight's
    product is the bits of its own matvec, call after call."""
    n, n_rows = 256, 2 * matvec.ROWS_PER_TASK + 8
    qtypes = (T.Q4_0, *code_dots.FILLS)
    parts = [(matvec.kind_of(q), rows_of(q, n_rows, n, int(q))) for q in qtypes]
    products = matvec.Products(parts)
    rng = np.random.default_rng(8)
    for n_tok in (1, 3, 1, 1):
        x = rng.standard_normal((n_tok, n)).astype(np.float32)
        for q, (kind, blocks), y in zip(qtypes, parts, products(x)):
            np.testing.assert_array_equal(y, matvec.matvec(kind, blocks, x), err_msg=type_name(q))


def test_the_dispatch_table_is_each_types_kernel_and_row_layout():
    """matvec.FUSED, the one lookup a generation step's product makes, says what kind_of and
    regroups say, for every type: a type without a fused kernel keeps the tile path."""
    from quantkit.types import TYPE_TRAITS
    for q in TYPE_TRAITS:
        kind = matvec.kind_of(q)
        assert matvec.FUSED.get(q) == (None if kind is None else (kind, matvec.regroups(q))), type_name(q)
    assert matvec.FUSED[T.IQ4_K_R4] == (matvec.kind_of(T.IQ4_K), True)


def test_interleaved_weights_are_regrouped_once_and_per_expert():
    qtype, n, n_rows, n_expert = T.IQ4_K_R4, 256, 8, 3
    blocks = rows_of(qtype, n_rows * n_expert, n, seed=4)
    w = Weight("exps", qtype, (n, n_rows, n_expert), blocks)
    base, plain = w.plain_layout()
    assert base == T.IQ4_K
    np.testing.assert_array_equal(plain, interleave.deinterleave(blocks, qtype, n))
    assert w.plain_layout()[1] is plain                                 # kept, not regrouped again
    x = np.random.default_rng(0).standard_normal((1, n)).astype(np.float32)
    for e in range(n_expert):
        expert = w.expert(e)
        assert np.shares_memory(expert.plain_layout()[1], plain)
        assert expert.plain_layout()[1].base is plain
        ref = rounded(x, qtype).astype(np.float64) @ decoded(blocks[e * n_rows:(e + 1) * n_rows], qtype, n).T
        np.testing.assert_allclose(ops_cpu.matmul_q(expert, x), ref, rtol=0, atol=3e-6 * np.abs(ref).max())
