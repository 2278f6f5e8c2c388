"""The formats API for every registered quantizer: what callers may pass (read-only arrays, e.g.
memory-mapped tensors and imatrix views) and what they get back."""
from __future__ import annotations

import numpy as np
import pytest

from quantkit import formats
from quantkit.formats import registered
from quantkit.types import traits, type_name

QUANTIZERS = sorted(q for q, f in registered().items() if f.quant_paths)


@pytest.mark.parametrize("qtype", QUANTIZERS, ids=type_name)
def test_read_only_inputs(qtype):
    t = traits(qtype)
    n = 256 * max(1, t.block_size // 256)
    rows = max(2, t.interleave_rows)
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((rows, n)).astype(np.float32)
    im = rng.random(n).astype(np.float32)
    flavor = "ik" if ("ik", True) in registered()[qtype].quant_paths else "mainline"     # tq*_0: mainline only
    want = formats.quantize(x, qtype, im, flavor)
    x.flags.writeable = False
    im.flags.writeable = False
    got = formats.quantize(x, qtype, im, flavor)
    assert got.dtype == np.uint8 and got.shape == (rows, t.row_size(n))
    np.testing.assert_array_equal(got, want)
    got.flags.writeable = False
    y = formats.dequantize(got, qtype, n)
    assert y.shape == x.shape and y.dtype == np.float32


def test_format_modules_match_the_registration():
    """formats.FORMAT_MODULES (which module a type's format is imported from on first use) names
    every plain type's module and nothing else; an interleaved type comes from its plain type's."""
    from quantkit.formats import FORMAT_MODULES
    listed = {q: m for m, types in FORMAT_MODULES.items() for q in types}
    plain = {q: f.__module__.rsplit(".", 1)[1] for q, f in registered().items()
             if f.__module__ != "quantkit.formats.repacked"}
    assert listed == plain
    for q, f in registered().items():
        if f.__module__ == "quantkit.formats.repacked":
            assert traits(q).base in listed, type_name(q)
