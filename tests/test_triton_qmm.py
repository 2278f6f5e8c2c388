"""The fused Triton kernels (quantkit.runtime.triton_qmm) of the legacy, k-quant and float types,
under Triton's CPU interpreter (tests/triton_checks.py turns it on): qdecode equals the numba
decoders bit for bit on awkward rows, qmatmul agrees with the decoded rows' product; bad
arguments are refused.  Skipped where triton is not installed."""
from __future__ import annotations

import numpy as np
import pytest

from triton_checks import check_type, triton_torch
from quantkit.types import QuantType as T
from quantkit.types import type_name

torch = triton_torch()

LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q6_0, T.IQ4_NL, T.MXFP4, T.F16, T.BF16]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS, ids=type_name)
def test_kernels_equal_numba_decoders(qtype):
    check_type(qtype)


def test_refuses_mismatched_rows():
    from quantkit.runtime import triton_qmm
    w = torch.zeros((2, 34 * 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes per row"):
        triton_qmm.qdecode(w, T.Q8_0, 512)
    with pytest.raises(ValueError, match="uint8"):
        triton_qmm.qmatmul(torch.zeros((1, 256)), w.float(), T.Q8_0)
    assert not triton_qmm.supports(T.Q4_0_R8)          # interleaved: a CPU layout
