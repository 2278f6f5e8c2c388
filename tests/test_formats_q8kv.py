"""q8_KV, q8_KV_r8 and q8_k_r8 (ik_llama.cpp only) against real references.

Oracles: ../shared/golden/ik (the C quantizers; none reads the imatrix, so both golden files of an
input are the same bytes) and the wheel's C ``to_float`` for decoding (numpy and numba decoders).
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_golden, assert_same_bytes, fresh_input, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = [T.Q8_KV, T.Q8_KV_R8, T.Q8_K_R8]
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden(shared_dir, qtype, name, use_imatrix):
    assert_golden(shared_dir, "ik", name, qtype, use_imatrix, flavors=("ik", "mainline"))


def _awkward_rows(n_rows=8, n=512):
    """fresh_input's cases, rows of halves (x/d lands on .5: ties to even), a subnormal row (its d
    rounds to 0 and C's codes saturate), huge values."""
    x = np.concatenate([fresh_input(151, 3, n), fresh_input(152, 3, n)])
    x = np.concatenate([x, np.zeros((n_rows - len(x), n), np.float32)])
    x[3] = (np.arange(n, dtype=np.float32) % 255 - 127) * np.float32(0.5)
    x[4, :] = np.float32(1e-45)
    x[4, ::3] = 0
    x[6] = np.float32(3e38) * np.sin(np.arange(n, dtype=np.float32))
    return x


@pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_wheel_quantizes_awkward_rows_alike(qtype):
    """The wheel's (FMA-built) quantizers of these types use no fused product: on rows with ties,
    subnormals and huge values it gives our bytes."""
    x = _awkward_rows()
    want = np.frombuffer(peers.quantize_chunk(int(qtype), x), np.uint8)
    assert_same_bytes(quantize(x, qtype, None, "ik"), want, qtype, x.shape[1], type_name(qtype))


@IMPLS
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_decoder(shared_dir, qtype, reference):
    """Golden bytes and random bytes (finite scales) decode as the wheel's C to_float, bit for bit."""
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    rng = np.random.default_rng(int(qtype))
    rnd = rng.integers(0, 256, (16, traits(qtype).row_size(512)), dtype=np.uint8)
    if qtype == T.Q8_KV:
        rnd[:, :4] = rng.uniform(-2, 2, (16, 1)).astype("<f4").view(np.uint8)
    elif qtype == T.Q8_KV_R8:
        g = rnd.reshape(2, -1)
        g[:, :32] = rng.uniform(-2, 2, (2, 8)).astype("<f4").view(np.uint8)
    else:
        blk = rnd.reshape(2, 2, -1)
        blk[:, :, :16] = rng.uniform(-2, 2, (2, 2, 8)).astype("<f2").view(np.uint8)
    cases = [(golden_bytes(shared_dir, "ik", "heavy", qtype, False).reshape(x.shape[0], -1), x.shape[1]), (rnd, 512)]
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        assert got.dtype == np.float32 and got.shape == (blocks.shape[0], n) and np.isfinite(got).all()
        if ggml is None:
            pytest.skip("no decoder oracle without the wheel")
        c = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), c.reshape(got.shape).view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q8_KV_R8, T.Q8_K_R8], ids=type_name)
def test_interleaved_need_groups_of_8_rows(qtype):
    x = np.ones((4, 256), np.float32)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        formats.quantize(x, qtype)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        formats.dequantize(np.zeros((4, traits(qtype).row_size(256)), np.uint8), qtype, 256)


def test_q8_kv_r8_is_q8_kv_regrouped(shared_dir):
    """ik quantizes q8_KV_r8 as q8_KV and repacks: the same float32 scales and codes, code sums dropped."""
    _, x, _ = golden_input(shared_dir, "ik", "gauss")
    plain = formats.quantize(x, T.Q8_KV)
    packed = formats.quantize(x, T.Q8_KV_R8)
    np.testing.assert_array_equal(formats.dequantize(packed, T.Q8_KV_R8, x.shape[1]),
                                  formats.dequantize(plain, T.Q8_KV, x.shape[1]))
    sums = plain[:, 4:8].copy().view("<i4").reshape(-1)
    np.testing.assert_array_equal(sums, plain[:, 8:].view(np.int8).sum(axis=1, dtype=np.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_values_that_decode_to_inf_are_refused(qtype):
    """d = amax/127 rounds so that d * 127 overflows for amax = FLT_MAX (q8_k_r8: its float16 d
    already from ~8.3e6): the output check refuses the row, naming the value, instead of writing it."""
    from quantkit.errors import QuantkitError
    from quantkit.quantize import quantize_rows
    x = np.ones((8, 256), np.float32)
    x[2, 5] = np.finfo(np.float32).max
    with pytest.raises(QuantkitError, match=r"row 2, column 5: .* beyond what"):
        quantize_rows(x, qtype, None, "ik", "blk.0.ffn_up.weight")
    x[2, 5] = 1e6 if qtype == T.Q8_K_R8 else 1e38
    assert np.isfinite(formats.dequantize(quantize_rows(x, qtype, None, "ik", "t"), qtype, 256)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_output_check_finds_what_a_full_decode_finds(qtype):
    """The formats' cheap non-finite checks (scales only; q8_KV: decoding the rows whose d * 128
    overflows) name the same row (and q8_k_r8 block) as decoding everything, on random bytes whose
    scales are finite, huge or non-finite."""
    rng = np.random.default_rng(7 + int(qtype))
    n = 512
    fmt = formats.registered()[qtype]
    for trial in range(20):
        b = rng.integers(0, 256, (16, traits(qtype).row_size(n)), dtype=np.uint8)
        scales = rng.choice(np.array([1.0, 3e38, np.inf, np.nan, 2e36], np.float32), 64, p=[.8, .05, .05, .05, .05])
        if qtype == T.Q8_KV:
            b[:, :4] = scales[:16, None].view(np.uint8)
        elif qtype == T.Q8_KV_R8:
            b.reshape(2, -1)[:, :32] = scales[:16].reshape(2, 8).view(np.uint8)
        else:
            with np.errstate(over="ignore"):
                b.reshape(2, 2, -1)[:, :, :16] = scales[:32].astype("<f2").reshape(2, 2, 8).view(np.uint8)
        with np.errstate(all="ignore"):
            y = formats.dequantize(b, qtype, n)
        bad = np.argwhere(~np.isfinite(y))
        got = fmt.first_non_finite_value(b, n)
        if not bad.size:
            assert got is None
        else:
            row, col = bad[0]
            want = (row, col // 256 * 256) if qtype == T.Q8_K_R8 else (row, col)
            assert got == tuple(int(v) for v in want), trial
