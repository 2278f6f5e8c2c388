"""IQ3_XXS and IQ3_S against the C quantizers' bytes and decoders.

Oracles: ../shared/golden/ik and ../shared/golden/mainline (the two flavors write the same bytes for
these types; both folders are checked), with and without imatrix, on every input: the edge-case rows
include a zero 32-block at the start of a super-block (IQ3_S then moves the next blocks' codes and
signs into its place), 1e-30 blocks whose x² weights underflow to 0, an outlier, and imatrix columns
that are 0.  Decoding (numpy reference and numba) is compared bit for bit with the wheel's C
``to_float`` on the golden bytes and on random bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_golden, golden_bytes, golden_input, quantize, random_blocks
from quantkit import formats
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = [T.IQ3_XXS, T.IQ3_S]
ggml = peers.load_ggml()


@pytest.mark.parametrize("flavor", ["ik", "mainline"])
@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden(shared_dir, qtype, use_imatrix, flavor):
    for name in ("gauss", "heavy", "wide"):
        assert_golden(shared_dir, flavor, name, qtype, use_imatrix, flavors=(flavor,))


@pytest.mark.skipif(ggml is None, reason="needs the wheel's C decoders")
@pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_decoder_equals_wheel(shared_dir, qtype, reference):
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    cases = [(random_blocks(qtype, 3, 512, int(qtype)), 512),
             (golden_bytes(shared_dir, "ik", "heavy", qtype, True).reshape(x.shape[0], -1), x.shape[1])]
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        want = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_block_with_zero_weights_does_not_depend_on_earlier_blocks(qtype):
    """A 32-block whose weights are all 0 (imatrix columns of 0) fits no trial scale.  ik's C then
    encodes whatever codes an earlier block left in its scratch (mainline clears them): quantkit
    writes mainline's result in both flavors, so the block's bytes do not depend on the row's other
    blocks."""
    rng = np.random.default_rng(3)
    x = np.repeat(rng.standard_normal((1, 256)).astype(np.float32), 2, 0)
    x[1, :32] = rng.standard_normal(32)                             # only block 0 differs
    imatrix = np.ones(256, np.float32)
    imatrix[32:64] = 0                                              # block 1: no weight at all
    t = traits(qtype)
    for flavor in ("ik", "mainline"):
        q = quantize(x, qtype, imatrix, flavor)
        assert q.shape == (2, t.type_size)
        codes = slice(2 + 8, 2 + 16)                                # block 1's 8 grid indices
        assert np.array_equal(q[0, codes], q[1, codes])
        if qtype == T.IQ3_XXS:      # IQ3_S re-fits every point after the search; IQ3_XXS keeps level 0
            assert not q[0, codes].any()
