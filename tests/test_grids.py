"""quantkit/grids.py: each quantizer-side KGRID table names the same lattice points, in the same
order, as its decoder grid (the two are extracted separately from the C sources; a slip in either
would make the quantizer pick codes the decoder reads as other points)."""
import numpy as np
import pytest

from quantkit import grids

# (quantizer table, decoder grid, bits per element in the kgrid, elements per point, decoded value
#  of each level: ggml-common.h's grid bytes for level l)
PAIRS = [
    ("KGRID_2BIT_256", "IQ2XXS_GRID", 2, 8, (0x08, 0x19, 0x2b)),
    ("KGRID_2BIT_512", "IQ2XS_GRID", 2, 8, (0x08, 0x19, 0x2b)),
    ("KGRID_2BIT_1024", "IQ2S_GRID", 2, 8, (0x08, 0x19, 0x2b)),
    ("KGRID_256", "IQ3XXS_GRID", 3, 4, (4, 12, 20, 28, 36, 44, 52, 62)),
    ("KGRID_512", "IQ3S_GRID", 3, 4, (1, 3, 5, 7, 9, 11, 13, 15)),
    ("KGRID_1BIT_2048", "IQ1S_GRID", 2, 8, (0xff, 0x00, 0x01)),   # int8 -1, 0, +1
]


@pytest.mark.parametrize("kgrid,grid,bits,n,values", PAIRS, ids=[p[1] for p in PAIRS])
def test_kgrid_matches_decoder_grid(kgrid, grid, bits, n, values):
    k = getattr(grids, kgrid).astype(np.int64)
    g = getattr(grids, grid)
    assert len(k) == len(g)
    dec = g.view(np.uint8).reshape(len(g), n)
    levels = (k[:, None] >> (bits * np.arange(n))) & ((1 << bits) - 1)
    assert levels.max() < len(values)
    np.testing.assert_array_equal(dec, np.asarray(values, np.uint8)[levels])
    assert len(np.unique(k)) == len(k)          # distinct points


def test_signs_have_even_parity():
    # ksigns_iq2xs[i]: the 7 low bits are i, bit 7 makes the number of minus signs even
    s = grids.KSIGNS_IQ2XS.astype(np.int64)
    assert np.array_equal(s & 127, np.arange(128))
    assert all(bin(int(v)).count("1") % 2 == 0 for v in s)
    assert list(grids.KMASK_IQ2XS) == [1 << i for i in range(8)]


# entries as ggml/src/ggml-common.h and ggml-quants.c write them (first, second, last)
ANCHORS = {
    "IQ2XXS_GRID": (0x0808080808080808, 0x080808080808082b, 0x2b2b2b1908081908),
    "IQ2XS_GRID": (0x0808080808080808, 0x080808080808082b, 0x2b2b2b2b2b2b2b2b),
    "IQ2S_GRID": (0x0808080808080808, 0x080808080808082b, 0x2b2b2b2b2b2b2b2b),
    "IQ3XXS_GRID": (0x04040404, 0x04040414, 0x3e341c04),
    "IQ3S_GRID": (0x01010101, 0x01010103, 0x0f0f0101),
    "IQ1S_GRID": (0xffffffffffffffff, 0xffffffffffffff01, 0x0101010101010101),
    "KGRID_2BIT_256": (0, 2, 43268), "KGRID_2BIT_512": (0, 2, 43690), "KGRID_2BIT_1024": (0, 2, 43690),
    "KGRID_1BIT_2048": (0, 2, 43690), "KGRID_256": (0, 2, 3992), "KGRID_512": (0, 1, 4032),
}


@pytest.mark.parametrize("name", ANCHORS)
def test_entries_as_the_c_source_writes_them(name):
    a = getattr(grids, name)
    assert (int(a[0]), int(a[1]), int(a[-1])) == ANCHORS[name]
    assert not a.flags.writeable
