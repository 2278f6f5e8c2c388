"""MXFP4 against real references.

Oracles: ../shared/golden/{ik,mainline} (the C quantizers of both projects: the same bytes, with and
without an imatrix, which neither reads); gguf-py's own MXFP4 quantizer and decoder (mainline's
Python port); the wheel's C ``to_float``.  mxfp4_r8 (ik's 8-row interleave) is checked by
tests/test_interleave.py like every interleaved layout (its golden bytes, and repack both ways).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import peers
from quant_checks import assert_golden, assert_same_bytes, fresh_input, golden_bytes, golden_input, quantize
from quantkit import formats
from quantkit.formats import decode
from quantkit.kernels import mxfp4 as kernels
from quantkit.types import QuantType

T = QuantType
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])
@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("flavor", ["ik", "mainline"])
def test_golden(shared_dir, flavor, name, use_imatrix):
    assert_golden(shared_dir, flavor, name, T.MXFP4, use_imatrix, flavors=(flavor,))


def _awkward_rows():
    """Blocks whose largest |x| sits just below and at powers of two (where log2f rounds up to the
    next integer), ties halfway between table values, tiny and huge magnitudes, -0."""
    x = fresh_input(39, n_rows=4, n=512)
    below = np.nextafter(np.float32(2.0) ** np.arange(-20, 12, dtype=np.float32), np.float32(0))
    x[3, :below.size] = below
    x[3, 32:64] = np.float32(0.25) * np.arange(-16, 16, dtype=np.float32)       # every tie of d = 1/8
    x[3, 64:96] = np.float32(3e38) * np.linspace(-1, 1, 32, dtype=np.float32)   # the largest exponent
    x[3, 96:128] = np.float32(1e-40) * np.arange(32, dtype=np.float32)          # subnormal amax
    x[3, 128] = np.float32(-0.0)
    return x


def test_gguf_py_quantizer_on_awkward_rows():
    """gguf-py's quantize_blocks for MXFP4 is a port of mainline's quantize_row_mxfp4_ref."""
    x = _awkward_rows()
    want = gguf.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    for flavor in ("ik", "mainline"):
        assert_same_bytes(quantize(x, T.MXFP4, None, flavor), want, T.MXFP4, x.shape[1], f"mxfp4 {flavor}")


def test_shared_exponent_uses_log2f_like_c():
    """Just below 2^k, float32 log2f rounds to k: C's exponent (and so ours) is one higher than the
    true floor(log2(amax)) there."""
    a = np.nextafter(np.float32(8.0), np.float32(0))
    assert np.float32(np.log2(a)) == np.float32(3.0)
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = a
    assert formats.quantize(x, T.MXFP4)[0, 0] == 3 - 2 + 127


def _random_blocks(rows, n, seed):
    return np.random.default_rng(seed).integers(0, 256, (rows, 17 * n // 32), dtype=np.uint8)


@IMPLS
def test_decoder(shared_dir, reference):
    """Golden blocks and random bytes (every exponent 0..255, so the subnormal and the overflowing
    scales too) decode as gguf-py and the wheel's C decoder do, bit for bit."""
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    rnd = _random_blocks(16, 512, 7)
    rnd.reshape(-1, 17)[:256, 0] = np.arange(256)
    cases = [(golden_bytes(shared_dir, "ik", "heavy", T.MXFP4, False).reshape(x.shape[0], -1), x.shape[1]),
             (rnd, 512)]
    for blocks, n in cases:
        got = formats.dequantize(blocks, T.MXFP4, n, reference=reference)
        want = gguf.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(got.shape)
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
        if ggml is not None:
            c = np.asarray(ggml.to_float(int(T.MXFP4), blocks.tobytes(), blocks.size // 17 * 32, n), np.float32)
            np.testing.assert_array_equal(got.view(np.uint32), c.reshape(got.shape).view(np.uint32))


def test_mxfp4_r8_decodes_as_its_rows(shared_dir):
    """The wheel does not know mxfp4_r8 (353): its golden bytes decode as the plain golden rows."""
    _, x, _ = golden_input(shared_dir, "ik", "wide")
    n = x.shape[1]
    packed = golden_bytes(shared_dir, "ik", "wide", T.MXFP4_R8, False).reshape(x.shape[0], -1)
    plain = golden_bytes(shared_dir, "ik", "wide", T.MXFP4, False).reshape(x.shape[0], -1)
    want = decode.dequantize(plain, T.MXFP4, n)
    for reference in (True, False):
        np.testing.assert_array_equal(formats.dequantize(packed, T.MXFP4_R8, n, reference=reference), want)


def test_block_codes_are_the_first_nearest_of_the_full_table():
    """The 8-magnitude search equals C's scan over all 16 entries (first index on a tie) for floats
    on and between neighbouring table values, both signs, on the subnormal scale too."""
    kv = kernels.KV
    scratch = np.empty(32, np.float32), np.empty(32, np.float32), np.empty(32, np.int32)
    for d in (np.float32(1.0), np.float32(2.0 ** -128)):
        xs = np.concatenate([np.arange(-13, 13.25, 0.25, dtype=np.float32),
                             np.random.default_rng(3).uniform(-14, 14, 2000).astype(np.float32)])
        xs = (xs[:len(xs) // 32 * 32] * d).reshape(-1, 32)
        for xb in xs:
            kernels.block_codes(xb, d, *scratch)
            want = np.argmin(np.abs(xb[:, None] - d * kv[None, :]), axis=1)      # argmin: the first minimum
            np.testing.assert_array_equal(scratch[2], want, err_msg=str(d))


def test_repack_maps_mxfp4_to_mxfp4_r8_as_ik_does():
    """ik's get_repack_info: MXFP4 -> MXFP4_R8 in groups of 8 rows (a pure regrouping of the bytes,
    both ways by test_interleave.py's golden layout test)."""
    from quantkit.formats import interleave
    from quantkit.types import REPACKED_TYPE, traits
    assert REPACKED_TYPE[T.MXFP4] == T.MXFP4_R8 and traits(T.MXFP4_R8).interleave_rows == 8
    assert interleave.supports(T.MXFP4_R8)
