"""Q6_0 (ik_llama.cpp's 6-bit block, the fallback for rows of IQ5_K/Q5_K that 256 does not divide).

Oracles: ../shared/golden/ik (the portable C build) for the quantizer (the numba kernel), with and
without imatrix, on inputs with edge-case rows (zero rows and blocks, 1e-30 blocks, a huge outlier);
its scale search is also checked against the port of the fork's make_qx_quants
(test_formats_kquants.py::test_ik_make_qx_quants, n=32 nmax=32).  The wheel's C ``to_float`` for
both decoders (numpy and numba).
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.types import QuantType

Q6_0 = QuantType.Q6_0
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


@pytest.mark.parametrize("flavor", ["ik", "mainline"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
def test_golden(shared_dir, name, use_imatrix, flavor):
    _, x, imatrix = golden_input(shared_dir, "ik", name)
    want = golden_bytes(shared_dir, "ik", name, Q6_0, use_imatrix)
    got = quantize(x, Q6_0, imatrix if use_imatrix else None, flavor)
    assert_same_bytes(got, want, Q6_0, x.shape[1], f"q6_0 {name}")


def _random_blocks(rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, n // 32 * 26), dtype=np.uint8)
    blk = b.reshape(-1, 26)
    blk[:, :2] = (rng.standard_normal(blk.shape[0]) * 10.0 ** rng.uniform(-6, 2, blk.shape[0])).astype("<f2") \
        .view(np.uint8).reshape(-1, 2)
    return b


@pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")
@IMPLS
def test_decoder_equals_the_wheel(shared_dir, reference):
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    cases = [(_random_blocks(4, 1024, 1), 1024),
             (golden_bytes(shared_dir, "ik", "heavy", Q6_0, True).reshape(x.shape[0], -1), x.shape[1])]
    for blocks, n in cases:
        got = formats.dequantize(blocks, Q6_0, n, reference=reference)
        want = np.asarray(ggml.to_float(int(Q6_0), blocks.tobytes(), blocks.shape[0] * n), np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))
