"""IQ1_S, IQ1_M (both flavors) and ik's IQ1_S_R4, IQ1_M_R4 against the golden vectors.

The quantizers are the numba kernels of quantkit/kernels/iq1.py.  Oracles: ../shared/golden/ik (the
portable no-FMA C build of ik_llama.cpp) and ../shared/golden/mainline (llama.cpp's ggml), every
input, with and without imatrix where the C quantizer runs (IQ1_S only with one); the _R4 types
only in ik (one quantizer for both flavors).  Decoders (numba and the numpy reference) against the
wheel's C ``to_float``, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, golden_bytes, golden_input, iq1_finite_scales, quantize
from quantkit import formats
from quantkit.kernels import iq1 as kernels
from quantkit.types import REPACKED_TYPE, QuantType, traits, type_name

T = QuantType
TYPES = [T.IQ1_S, T.IQ1_M, T.IQ1_S_R4, T.IQ1_M_R4]
R4 = {T.IQ1_S_R4, T.IQ1_M_R4}
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
ggml = peers.load_ggml()


def _cases():
    for qtype in TYPES:
        for use_imatrix in ((True,) if qtype == T.IQ1_S else (False, True)):
            for flavor in ("ik", "mainline"):
                yield pytest.param(qtype, use_imatrix, flavor,
                                   id=f"{type_name(qtype)}-{'imat' if use_imatrix else 'noimat'}-{flavor}")


@pytest.mark.parametrize("name", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("qtype, use_imatrix, flavor", list(_cases()))
def test_golden(shared_dir, qtype, use_imatrix, flavor, name):
    golden_flavor = "ik" if qtype in R4 else flavor     # ik-only types: ik's quantizer for both
    _, x, imatrix = golden_input(shared_dir, golden_flavor, name)
    want = golden_bytes(shared_dir, golden_flavor, name, qtype, use_imatrix)
    got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
    assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name} {flavor}")


def test_iq1_s_needs_an_imatrix():
    """Its C quantizer asserts one (llama-quantize refuses); IQ1_M and the _R4 types do without."""
    assert not formats.can_quantize(T.IQ1_S, "ik") and not formats.can_quantize(T.IQ1_S, "mainline")
    assert formats.can_quantize(T.IQ1_S, "mainline", with_imatrix=True)
    assert all(formats.can_quantize(t, f) for t in (T.IQ1_M, T.IQ1_S_R4, T.IQ1_M_R4) for f in ("ik", "mainline"))
    with pytest.raises(NotImplementedError):
        formats.quantize(np.ones((1, 256), np.float32), T.IQ1_S)


def test_r4_types_are_no_repack():
    """ik quantizes iq1_s_r4 / iq1_m_r4 on their own (block of 32, row scales): no repack mapping."""
    assert T.IQ1_S not in REPACKED_TYPE and T.IQ1_M not in REPACKED_TYPE
    assert traits(T.IQ1_S_R4).block_size == 32 != traits(T.IQ1_S).block_size
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        formats.quantize(np.ones((3, 256), np.float32), T.IQ1_S_R4)


def test_carried_shift_of_zero_blocks(shared_dir):
    """ik's IQ1_M writes, for a 16-block of zeros, the shift bits the block before it left in the
    same call (a row before, for a row's first super-block): rows quantized apart would differ."""
    _, x, _ = golden_input(shared_dir, "ik", "gauss")
    want = golden_bytes(shared_dir, "ik", "gauss", T.IQ1_M, False).reshape(x.shape[0], -1)
    alone = np.concatenate([quantize(x[r:r + 1], T.IQ1_M, None, "ik") for r in range(x.shape[0])])
    assert (alone != want).any(axis=1).sum() >= 1              # row 4 starts with a zero 32-block
    np.testing.assert_array_equal(quantize(x, T.IQ1_M, None, "ik"), want)
    # IQ1_M_R4 carries its two shifts the same way from one group of rows to the next
    rng = np.random.default_rng(1)                              # group 1 leaves a shift that is not 0
    y = rng.standard_normal((8, 256)).astype(np.float32)
    y[4, :16] = 0                                                # group 2, row 0: a zero half-block
    together = quantize(y, T.IQ1_M_R4, None, "ik")
    apart = np.concatenate([quantize(y[:4], T.IQ1_M_R4, None, "ik"), quantize(y[4:], T.IQ1_M_R4, None, "ik")])
    assert not np.array_equal(together, apart)
    np.testing.assert_array_equal(together[:4], apart[:4])
    if ggml is not None:            # the wheel's C quantizer, one call over the 8 rows, agrees
        assert ggml.quantize_chunk(int(T.IQ1_M_R4), y, None) == together.tobytes()


def _random_blocks(qtype, rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return iq1_finite_scales(qtype, rng.integers(0, 256, (rows, traits(qtype).row_size(n)), dtype=np.uint8), rng)


@IMPLS
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_decoder(shared_dir, qtype, reference):
    """numba and numpy decoders equal the wheel's to_float on golden and random bytes."""
    if ggml is None:
        pytest.skip("no decoder oracle without the wheel")
    _, x, _ = golden_input(shared_dir, "ik", "heavy")
    cases = [(_random_blocks(qtype, 8, 512, int(qtype)), 512),
             (golden_bytes(shared_dir, "ik", "heavy", qtype, True).reshape(x.shape[0], -1), x.shape[1])]
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        c = np.asarray(ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * n, n), np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), c.reshape(got.shape).view(np.uint32))


def test_lattice_neighbours():
    """The neighbour lists of iq2xs_init_impl: every code of levels 0-2 off the lattice has the
    points at its 3 smallest distances, nearest first, ties by index; codes on it map to their point."""
    levels = kernels.LEVELS.astype(np.int64)
    rng = np.random.default_rng(1)
    for _ in range(50):
        lv = rng.integers(0, 3, 8)
        u = int((lv << (2 * np.arange(8))).sum())
        slot = kernels.KMAP[u]
        d2 = ((levels - lv) ** 2).sum(1)
        if slot >= 0:
            assert d2[slot] == 0
            continue
        got = kernels.NB_POINTS[kernels.NB_START[-1 - slot]:kernels.NB_START[-slot]]
        keep = d2 <= np.unique(d2)[2]
        want = np.lexsort((np.arange(len(d2)), d2))
        np.testing.assert_array_equal(got, want[keep[want]])
