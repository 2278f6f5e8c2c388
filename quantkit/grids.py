"""The lattice grids of ggml's i-quants (IQ1_S … IQ3_S), as ggml-common.h and ggml-quants.c declare them.

Extracted verbatim from ik_llama.cpp @ 8337e4cd into ``grids.npz`` beside this module (data, not
code): the decoder grids ``*_GRID`` of ggml/src/ggml-common.h, and the quantizer's compressed
``KGRID_*`` of ggml/src/ggml-quants.c (``iq2xs_init_impl``, ``iq3xs_init_impl``); both forks and
mainline share them.  Entry k of a ``KGRID_*`` table is the same lattice point as entry k of its
decoder grid; tests/test_grids.py checks that, and entries against the C source.

    IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID   uint64 [256/512/1024]: 8 magnitudes in {8, 25, 43}, a byte each
    IQ3XXS_GRID, IQ3S_GRID               uint32 [256/512]: 4 magnitudes (4..62 / 1..15)
    IQ1S_GRID                            uint64 [2048]: 8 values in {-1, 0, 1} (int8 bytes)
    IQ1S_VALUES                          float32 [2048, 8]: the same values
    KSIGNS_IQ2XS                         uint8 [128]: 7 sign bits + the parity bit (even minus signs)
    KMASK_IQ2XS                          uint8 [8]: 1 << i
    KGRID_2BIT_256/512/1024, KGRID_1BIT_2048, KGRID_256, KGRID_512
                                         uint16: the same points, 2 (3 for iq3) bits a level

A leaf module, like tables.py: it imports nothing of quantkit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _load() -> dict[str, np.ndarray]:
    with np.load(Path(__file__).with_name("grids.npz")) as data:
        tables = {name: data[name] for name in data.files}
    for a in tables.values():
        a.setflags(write=False)
    return tables


_T = _load()
KMASK_IQ2XS = _T["KMASK_IQ2XS"]
KSIGNS_IQ2XS = _T["KSIGNS_IQ2XS"]
IQ2XXS_GRID = _T["IQ2XXS_GRID"]
IQ2XS_GRID = _T["IQ2XS_GRID"]
IQ2S_GRID = _T["IQ2S_GRID"]
IQ3XXS_GRID = _T["IQ3XXS_GRID"]
IQ3S_GRID = _T["IQ3S_GRID"]
IQ1S_GRID = _T["IQ1S_GRID"]
KGRID_2BIT_256 = _T["KGRID_2BIT_256"]
KGRID_2BIT_512 = _T["KGRID_2BIT_512"]
KGRID_2BIT_1024 = _T["KGRID_2BIT_1024"]
KGRID_1BIT_2048 = _T["KGRID_1BIT_2048"]
KGRID_256 = _T["KGRID_256"]
KGRID_512 = _T["KGRID_512"]
del _T
#: the decoders' IQ1S_GRID: 8 levels -1/0/+1 per point, as float32 (kernels.iq1 and the reference
#: decoder formats/decode.py share it; here, so that decoding needs no import of the iq1 kernels,
#: whose lattice tables take a fraction of a second to build)
IQ1S_VALUES = IQ1S_GRID.view(np.int8).reshape(-1, 8).astype(np.float32)
IQ1S_VALUES.setflags(write=False)
