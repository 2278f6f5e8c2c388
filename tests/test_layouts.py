"""The block layouts (quantkit/layouts.py) and the reference decoder built on them
(formats/decode.py), on any bytes: numpy and torch decode them alike, and as the numba kernels do.

The quantizer tests decode what quantizers write; here every code, packed scale, grid bit and min
takes random values, with the float scales random but finite.
"""
from __future__ import annotations

import numpy as np
import pytest

from quant_checks import random_rows
from quantkit import formats
from quantkit.formats import decode
from quantkit.layouts import LAYOUTS
from quantkit.types import QuantType, traits, type_name

DECODED = [q for q in QuantType if decode.can_decode(q)]
N_PER_ROW = 512


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=type_name)
def test_layout_runs_tile_the_block_inside_its_bytes(qtype):
    lay = LAYOUTS[qtype]
    t = traits(qtype)
    assert (lay.block_bytes, lay.block_values, lay.row_scale_bytes) == (t.type_size, t.block_size, t.row_meta_size)
    values = sorted(v for r in lay.runs for v in range(r.xoff, r.xoff + r.n))
    assert values == list(range(t.block_size))
    for r in lay.runs:
        low_bytes = r.n // 2 if r.split else r.n
        reads = [r.off + low_bytes - 1, *(at + 1 for at in (r.d_at, r.m_at) if at is not None)]
        if r.hoff is not None:
            reads.append(r.hoff + r.n - 1)
        if r.hword is not None:
            reads.append(r.hword + 3)
        assert max(reads) < t.type_size, r
    if lay.sup is not None:
        assert len(lay.sup.scales) == len(lay.runs)
        assert all(sp.at < t.type_size for sp in (*lay.sup.scales, *lay.sup.mins, *lay.sup.run_mins))


def _n_rows(qtype) -> int:
    """3 rows, or a group of rows of an interleaved type decoded here (iq1_s_r4, iq1_m_r4)."""
    return max(3, traits(qtype).interleave_rows)


@pytest.mark.parametrize("qtype", DECODED, ids=type_name)
def test_reference_decoder_equals_numba_on_random_bytes(qtype):
    b = random_rows(qtype, _n_rows(qtype), int(qtype))
    ref = formats.dequantize(b, qtype, N_PER_ROW, reference=True)
    assert ref.dtype == np.float32 and ref.shape == (b.shape[0], N_PER_ROW) and np.isfinite(ref).all()
    np.testing.assert_array_equal(ref, formats.dequantize(b, qtype, N_PER_ROW))


@pytest.mark.parametrize("qtype", DECODED, ids=type_name)
def test_numpy_and_torch_decode_alike_on_random_bytes(qtype):
    torch = pytest.importorskip("torch")
    from quantkit.runtime import torch_decode
    b = random_rows(qtype, _n_rows(qtype), 1000 + int(qtype))
    got = torch_decode.decode(torch.from_numpy(b), qtype, N_PER_ROW).numpy()
    np.testing.assert_array_equal(got, decode.dequantize(b, qtype, N_PER_ROW))


def test_iq6_k_decodes_by_its_cubic_and_multiplies_by_its_grid():
    """IQ6_K's to_float (the reference decoder) is a cubic in the code; its matrix products (and so
    runtime/matvec.py) read the grid its layout names, which is not the same."""
    b = random_rows(QuantType.IQ6_K, 2, 6)
    cubic = decode.dequantize(b, QuantType.IQ6_K, N_PER_ROW)
    grid = decode.dequantize(b, QuantType.IQ6_K, N_PER_ROW, products=True)
    assert np.isfinite(cubic).all() and np.isfinite(grid).all()
    assert not np.array_equal(cubic, grid)
