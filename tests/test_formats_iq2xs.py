"""IQ2_XXS, IQ2_XS, IQ2_S and their interleaved _r4 layouts against the C references.

Quantizers: ../shared/golden/ik and ../shared/golden/mainline (no-FMA C builds) on every input, with
and without imatrix where the C quantizer runs (IQ2_XXS and IQ2_XS need one; ik's _r4 wrappers call
them without).  The flavors differ for IQ2_XS and for IQ2_S with an imatrix (whose zero columns leave
a block with no fit: ik writes the previous block's levels there).  Decoders (numba and numpy): equal
bit for bit to the wheel's ``to_float`` on the golden bytes and on random bytes.  The _r4 types'
quantizers and layouts are checked against golden/ik by tests/test_interleave.py (every registered
interleaved type).
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, quantize, random_blocks
from quantkit import formats
from quantkit.types import QuantType, traits, type_name

T = QuantType
PLAIN = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S]
INTERLEAVED = [T.IQ2_XXS_R4, T.IQ2_XS_R4, T.IQ2_S_R4]
NAMES = ["gauss", "heavy", "wide"]
ggml = peers.load_ggml()


# the plain C quantizers run without an imatrix only for IQ2_S
PLAIN_PATHS = [(T.IQ2_XXS, True), (T.IQ2_XS, True), (T.IQ2_S, False), (T.IQ2_S, True)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("flavor", ["ik", "mainline"])
@pytest.mark.parametrize("qtype,use_imatrix", PLAIN_PATHS,
                         ids=[f"{type_name(q)}-{'imat' if i else 'noimat'}" for q, i in PLAIN_PATHS])
def test_golden(shared_dir, qtype, flavor, name, use_imatrix):
    _, x, imatrix = golden_input(shared_dir, flavor, name)
    want = golden_bytes(shared_dir, flavor, name, qtype, use_imatrix)
    got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
    assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name} {flavor}")


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ2_XS], ids=type_name)
def test_imatrix_required(qtype):
    """Like llama-quantize: no plain IQ2_XXS / IQ2_XS without an imatrix (the C quantizers assert)."""
    x = np.ones((1, 256), np.float32)
    for flavor in ("ik", "mainline"):
        assert not formats.can_quantize(qtype, flavor, with_imatrix=False)
        assert formats.can_quantize(qtype, flavor, with_imatrix=True)
        with pytest.raises(NotImplementedError, match="without imatrix"):
            formats.quantize(x, qtype, None, flavor=flavor)


def test_zero_weight_block_does_not_abort():
    """An imatrix that is 0 over a whole 32-block: ik's IQ2_XXS C code aborts (0/0 scale, levels off
    the grid); quantkit writes what mainline does there: grid point 0, no signs, scale 0."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    imatrix = rng.uniform(0.5, 2, 512).astype(np.float32)
    imatrix[32:64] = 0
    ik = quantize(x, T.IQ2_XXS, imatrix, "ik")
    np.testing.assert_array_equal(ik, quantize(x, T.IQ2_XXS, imatrix, "mainline"))
    first = ik.reshape(2, 2, 66)[:, 0]                                  # super-block 0 of each row
    assert not first[:, 10:18].any() and first[:, 2:10].all(axis=1).any()     # its 32-block 1
    assert np.isfinite(formats.dequantize(ik, T.IQ2_XXS, 512)).all()


@pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
@pytest.mark.parametrize("qtype", PLAIN, ids=type_name)
def test_decoder_equals_wheel(shared_dir, qtype, reference):
    if ggml is None:
        pytest.skip("needs the ik wheel's to_float")
    _, x, _ = golden_input(shared_dir, "mainline", "heavy")
    cases = [(random_blocks(qtype, 2, 512, int(qtype)), 512)]
    for flavor in ("ik", "mainline"):
        cases.append((golden_bytes(shared_dir, flavor, "heavy", qtype, True).reshape(x.shape[0], -1), x.shape[1]))
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        want = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=type_name)
def test_interleaved_decoder_equals_wheel(shared_dir, qtype):
    """The C bytes of the _r4 types (quantized without an imatrix, which only the _r4 wrappers do)
    decode as the wheel decodes them: deinterleave (with the sign recoding) + the plain decoder.
    Quantizing to them and interleaving are checked by test_interleave.py like every _r4 type."""
    if ggml is None:
        pytest.skip("needs the ik wheel's to_float")
    _, x, _ = golden_input(shared_dir, "ik", "gauss")
    blocks = golden_bytes(shared_dir, "ik", "gauss", qtype, False).reshape(x.shape[0], -1)
    want = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.size // traits(qtype).type_size * 256,
                                    x.shape[1]), np.float32).reshape(x.shape)
    for reference in (True, False):
        got = formats.dequantize(blocks, qtype, x.shape[1], reference=reference)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
