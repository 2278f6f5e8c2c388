"""IQ2_K, IQ2_KS, IQ2_KL, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ4_KSS, IQ5_KS, IQ3_KS against real
references.

The quantizers are the numba kernels (the only implementation).  Oracles: ../shared/golden/ik (the
portable no-FMA C build) for every input, with and without imatrix (its edge-case rows: zero rows and
blocks, 1e-30 blocks, a huge outlier; an imatrix with zero columns and outliers); the executable ports
of ../shared/reference/ik_quantize.py (checked against that build) on fresh inputs (heavy tails,
ties, huge values, expert-by-expert imatrix slices; IQ5_KS/IQ3_KS/IQ2_KL have no port, so the golden
vectors are their only oracle); for decoding (numpy and numba decoders both) the ports of
ik_decode_repack.py and the wheel's C ``to_float`` (bit for bit, except IQ6_K's cubic, which the
FMA-built wheel rounds differently in the last bit).
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import (assert_same_bytes, expert_imatrix, fresh_input, golden_bytes, golden_input,
                          load_reference, quantize, random_blocks)
from quantkit import formats
from quantkit.formats import decode
from quantkit.types import QuantType, type_name

T = QuantType
TYPES = [T.IQ2_K, T.IQ2_KS, T.IQ2_KL, T.IQ3_K, T.IQ4_K, T.IQ5_K, T.IQ6_K, T.IQ4_KS, T.IQ4_KSS, T.IQ5_KS, T.IQ3_KS]
PORTS = {T.IQ2_K: "quantize_iq2_k", T.IQ2_KS: "quantize_iq2_ks", T.IQ3_K: "quantize_iq3_k", T.IQ4_K: "quantize_iq4_k", T.IQ5_K: "quantize_iq5_k",
         T.IQ6_K: "quantize_iq6_k", T.IQ4_KS: "quantize_iq4_ks", T.IQ4_KSS: "quantize_iq4_kss"}
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


@pytest.fixture(scope="module")
def ik_port(shared_dir):
    return load_reference(shared_dir, "ik_quantize")


@pytest.fixture(scope="module")
def ik_decoders(shared_dir):
    return load_reference(shared_dir, "ik_decode_repack")


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden(shared_dir, qtype, name, use_imatrix):
    _, x, imatrix = golden_input(shared_dir, "ik", name)
    want = golden_bytes(shared_dir, "ik", name, qtype, use_imatrix)
    for flavor in ("ik", "mainline"):           # ik-only types: one algorithm for both flavors
        got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
        assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name} {flavor}")


def _fresh(seed):
    x = fresh_input(seed, n_rows=4, n=512)
    x[3] = (np.random.default_rng(seed).standard_normal(512) * 3e5).astype(np.float32)   # huge values
    return x


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", list(PORTS), ids=type_name)
def test_reference_port_on_fresh_experts(ik_port, qtype, use_imatrix):
    """Two 'experts' of a 3-D tensor, each with its own imatrix slice, as llama-quantize does."""
    x = _fresh(int(qtype))
    ims = expert_imatrix(int(qtype) + 1, 2, x.shape[1]) if use_imatrix else [None, None]
    port = getattr(ik_port, PORTS[qtype])
    for e, im in enumerate(ims):
        xe = x[2 * e:2 * e + 2]
        with np.errstate(all="ignore"):
            want = np.frombuffer(port(xe, im), np.uint8)
        assert_same_bytes(quantize(xe, qtype, im, "ik"), want, qtype, x.shape[1], f"expert {e}")


_PORT_DECODERS = {T.IQ2_K: "deq_iq2_k", T.IQ2_KS: "deq_iq2_ks", T.IQ3_K: "deq_iq3_k", T.IQ4_K: "deq_iq4_k", T.IQ5_K: "deq_iq5_k", T.IQ6_K: "deq_iq6_k",
                  T.IQ4_KS: "deq_iq4_ks", T.IQ4_KSS: "deq_iq4_kss"}


@IMPLS
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_decoder(shared_dir, ik_decoders, qtype, reference):
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    cases = [(random_blocks(qtype, 3, 512, int(qtype)), 512),
             (golden_bytes(shared_dir, "ik", "heavy", qtype, True).reshape(x.shape[0], -1), x.shape[1])]
    port = getattr(ik_decoders, _PORT_DECODERS[qtype]) if qtype in _PORT_DECODERS else None
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        if port is not None:
            want = np.stack([np.asarray(port(bytes(r), n), np.float32) for r in blocks])
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        elif ggml is None:
            pytest.skip("no decoder oracle for this type without the wheel")
        if ggml is not None:
            c = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
            c = c.reshape(got.shape)
            if qtype == T.IQ6_K:        # the wheel evaluates the cubic with fused multiply-adds
                np.testing.assert_allclose(got, c, rtol=1e-5, atol=1e-6 * np.abs(c).max())
            else:
                np.testing.assert_array_equal(got.view(np.uint32), c.view(np.uint32))


def test_iq6_k_table_decoder(shared_dir, ik_decoders):
    """The decoder the matrix kernels use (int8 table) differs from to_float's cubic; both exist."""
    b = golden_bytes(shared_dir, "ik", "gauss", T.IQ6_K, False).reshape(-1, 212)
    want = np.concatenate([ik_decoders.deq_iq6_k(bytes(r), 256, poly=False) for r in b])
    n = b.size // 212 * 256
    table = decode.dequantize(b.reshape(1, -1), T.IQ6_K, n, products=True)
    np.testing.assert_array_equal(table.reshape(-1), want)
    assert not np.array_equal(decode.dequantize(b.reshape(1, -1), T.IQ6_K, n).reshape(-1), want)
