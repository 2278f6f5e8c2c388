"""Row-interleaved layouts (_r4/_r8/_r16): the byte shuffles and quantizing straight to them.

Oracles: ../shared/golden/ik holds, for every interleaved type, the C library's bytes of the same
inputs as the plain types, so ``interleave(golden plain bytes)`` must equal the golden interleaved
bytes wherever the C quantizer does not change its input (no imatrix; with one, the QHelper
clean-up makes q6_k_r4/q3_k_r4/q2_k_r4 differ, spec §0.1); quantizing to the interleaved type must
equal the golden bytes always.  The wheel's C decoders decode interleaved and plain bytes to the
same values; ``deinterleave`` undoes ``interleave`` on random bytes of many shapes.
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.formats import interleave
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = sorted(interleave.LAYOUTS)
# with an imatrix these quantize differently from repack(plain): QHelper (16-blocks); q2_k_r4 also
# runs q2_K's "is it ternary" test per row instead of per chunk
CLEANED = {T.Q6_K_R4, T.Q3_K_R4, T.Q2_K_R4, T.IQ2_XS_R4, T.IQ2_S_R4, T.IQ3_S_R4}
ggml = peers.load_ggml()


def _plain_golden(shared_dir, qtype, name, use_imatrix):
    base = traits(qtype).base
    return golden_bytes(shared_dir, "ik", name, base, use_imatrix)


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden_layout(shared_dir, qtype, use_imatrix):
    if qtype == T.BF16_R16:
        pytest.skip("bf16_r16 truncates where bf16 rounds: covered by the quantize test")
    if (use_imatrix and qtype in CLEANED) or qtype == T.Q2_K_R4:
        pytest.skip("the C wrapper quantizes differently from the plain type here (see the docstring)")
    for name in ("gauss", "heavy", "wide"):
        _, x, _ = golden_input(shared_dir, "ik", name)
        n = x.shape[1]
        plain = _plain_golden(shared_dir, qtype, name, use_imatrix).reshape(x.shape[0], -1)
        packed = golden_bytes(shared_dir, "ik", name, qtype, use_imatrix).reshape(x.shape[0], -1)
        assert_same_bytes(interleave.interleave(plain, qtype, n), packed, qtype, n, f"{type_name(qtype)} {name}")
        np.testing.assert_array_equal(interleave.deinterleave(packed, qtype, n), plain)


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_quantize_to_interleaved_equals_golden(shared_dir, qtype, use_imatrix):
    for name in ("gauss", "heavy", "wide"):
        _, x, imatrix = golden_input(shared_dir, "ik", name)
        want = golden_bytes(shared_dir, "ik", name, qtype, use_imatrix)
        got = quantize(x, qtype, imatrix if use_imatrix else None, "ik")
        assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name}")


def _random_plain(qtype, n_rows, n, rng):
    base = traits(qtype).base
    x = (rng.standard_normal((n_rows, n)) * 10.0 ** rng.uniform(-3, 2, (n_rows, 1))).astype(np.float32)
    if base == T.BF16:
        return (x.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(n_rows, -1), x
    # iq2_xxs / iq2_xs: llama-quantize (and so formats.quantize) needs an imatrix for them
    imatrix = None if formats.can_quantize(base) else np.ones(n, np.float32)
    return formats.quantize(x, base, imatrix), x


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_round_trip_on_random_shapes(qtype):
    """Property test: random bytes (not only valid blocks) of random shapes, 3-D expert tensors
    interleaved matrix by matrix."""
    rng = np.random.default_rng(int(qtype))
    lay = interleave.LAYOUTS[qtype]
    t = traits(qtype)
    for _ in range(6):
        n = lay.block_values * int(rng.integers(1, 5)) * (256 // lay.block_values if lay.block_values < 256 and
                                                             rng.random() < 0.3 else 1)
        n_rows = lay.rows * int(rng.integers(1, 4))
        n_experts = int(rng.integers(1, 4))
        raw = rng.integers(0, 256, (n_experts * n_rows, t.row_size(n)), dtype=np.uint8)
        packed = np.concatenate([interleave.interleave(raw[e * n_rows:(e + 1) * n_rows], qtype, n)
                                 for e in range(n_experts)])
        back = np.concatenate([interleave.deinterleave(packed[e * n_rows:(e + 1) * n_rows], qtype, n)
                               for e in range(n_experts)])
        np.testing.assert_array_equal(back, raw)
        if n_rows > lay.rows:            # groups are independent: a group's bytes only move inside it
            head = interleave.interleave(raw[:lay.rows], qtype, n)
            np.testing.assert_array_equal(head, packed[:lay.rows])


@pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")
@pytest.mark.parametrize("qtype", [q for q in TYPES if q != T.BF16_R16 and (ggml is None or ggml.knows(int(q)))],
                         ids=type_name)     # the wheel knows no mxfp4_r8 (test_formats_mxfp4.py decodes it)
def test_wheel_decodes_interleaved_like_plain(qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    n = 512
    plain, _ = _random_plain(qtype, 2 * traits(qtype).interleave_rows, n, rng)
    packed = interleave.interleave(plain, qtype, n)
    a = np.asarray(ggml.to_float(int(traits(qtype).base), plain.tobytes(), plain.shape[0] * n, n), np.float32)
    if qtype == T.IQ2_BN_R4:    # ik's iq2_bn to_float reads from the row scale on and leaves it out
        a = formats.dequantize(plain, T.IQ2_BN, n).reshape(-1)      # (test_formats_ternary: = the wheel's)
    b = np.asarray(ggml.to_float(int(qtype), packed.tobytes(), packed.shape[0] * n, n), np.float32)
    if qtype in (T.Q5_0_R4, T.Q6_0_R4):     # their C decoders compute d*q - 16d, not d*(q - 16)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    else:
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))
    # and quantkit's own decoder of the interleaved type
    ours = formats.dequantize(packed, qtype, n)
    np.testing.assert_array_equal(ours, formats.dequantize(plain, traits(qtype).base, n))


def test_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        interleave.interleave(np.zeros((3, 76), np.uint8), T.IQ2_K_R4, 256)
    with pytest.raises(NotImplementedError):
        interleave.interleave(np.zeros((4, 34), np.uint8), T.Q8_0, 32)        # no interleaved layout
    with pytest.raises(ValueError, match="are 76 bytes"):                 # the kernel checks no bounds
        interleave.interleave(np.zeros((4, 75), np.uint8), T.IQ2_K_R4, 256)
    frozen = np.frombuffer(bytes(4 * 76), np.uint8).reshape(4, 76)
    with pytest.raises(ValueError, match="writable"):
        interleave.interleave(np.zeros((4, 76), np.uint8), T.IQ2_K_R4, 256, out=frozen)
