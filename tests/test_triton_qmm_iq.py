"""The fused Triton kernels (quantkit.runtime.triton_qmm) of the IQK types, the trellis types and the
i-quants (iqk.py, iquants.py), under Triton's CPU interpreter (tests/triton_checks.py turns it on).

Rows are random bytes with finite random scales (quant_checks.random_rows), so every code, sign,
packed-scale and shifted-half bit takes both values: qdecode equals formats' reference decoder bit
for bit, which tests/test_layouts.py holds to the numba decoders on rows made the same way (no
quantizer and no numba kernel runs here: loading them costs ~20 s a type family on 2 busy cores);
qmatmul agrees with the decoded rows' product on 3 tokens (per-token kernel) and on 20 (tl.dot).
Skipped where triton is not installed."""
from __future__ import annotations

import numpy as np
import pytest

from quant_checks import random_rows
from triton_checks import check_rows, triton_torch
from quantkit.types import QuantType as T
from quantkit.types import type_name

triton_torch()          # the module is skipped where triton or torch is missing

IQK = [T.IQ2_K, T.IQ3_K, T.IQ4_K, T.IQ5_K, T.IQ6_K, T.IQ2_KS, T.IQ3_KS, T.IQ4_KS, T.IQ5_KS, T.IQ4_KSS, T.IQ2_KL]
TRELLIS = [T.IQ1_KT, T.IQ2_KT, T.IQ3_KT, T.IQ4_KT]
IQUANTS = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]
N_PER_ROW = 512


@pytest.mark.parametrize("qtype", IQK + TRELLIS + IQUANTS, ids=type_name)
def test_kernels_equal_reference_decoder(qtype):
    w = random_rows(qtype, 5, int(qtype), N_PER_ROW)         # 5 rows: the row tile's clamped tail too
    expect = check_rows(qtype, w, N_PER_ROW, seed=int(qtype), reference=True)
    assert np.isfinite(expect).all()
