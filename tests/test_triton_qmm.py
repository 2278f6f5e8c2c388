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


@pytest.mark.parametrize("qtype, n_per_row", [(T.Q8_0, 96), (T.MXFP4, 352), (T.Q4_K, 768)], ids=str)
def test_rows_whose_block_count_a_step_does_not_divide(qtype, n_per_row):
    """The per-token kernel reads NB blocks of a row per step (triton_qmm.tiles): a row of 3 or 11
    blocks ends inside a step, whose blocks past the row's end must add nothing."""
    from quantkit.runtime import triton_qmm
    assert (n_per_row // 32 if qtype != T.Q4_K else 3) % triton_qmm.tiles(256 if qtype == T.Q4_K else 32, 1)["NB"]
    check_type(qtype, n_per_row=n_per_row)


def test_refuses_mismatched_rows():
    from quantkit.runtime import triton_qmm
    w = torch.zeros((2, 34 * 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes per row"):
        triton_qmm.qdecode(w, T.Q8_0, 512)
    with pytest.raises(ValueError, match="uint8"):
        triton_qmm.qmatmul(torch.zeros((1, 256)), w.float(), T.Q8_0)
    assert not triton_qmm.supports(T.Q4_0_R8)          # interleaved: a CPU layout


@pytest.fixture(scope="module")
def q4_k_llama(tmp_path_factory):
    """A tiny llama quantized with the q4_K mix (q4_K, q5_K and q6_K tensors)."""
    import quantkit
    from models import write_llama
    d = tmp_path_factory.mktemp("triton-llama")
    path = d / "llama-q4_K.gguf"
    quantkit.quantize_model(write_llama(d / "llama-f32.gguf", n_layer=1, n_vocab=256), path, "q4_K")
    return path


def _logits(path, ops):
    from quantkit.gguf_io.reader import open_model
    from quantkit.runtime.model import Model
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, 256, 8)]
    with open_model(path) as g:
        model = Model(g, ops=ops)
        placed = set(ops.placement([model.w.need(t.name) for t in g.tensors if t.n_dims >= 2]).values()) \
            if ops is not None and hasattr(ops, "placement") else None
        return model.forward(tokens, model.new_cache(8)), placed


def test_torch_backend_runs_the_kernels(q4_k_llama):
    """TorchOps(triton=True) (forced on the CPU under the interpreter) computes every matrix of the
    model with the fused kernels and gives the numba backend's logits."""
    from quantkit.runtime import ops_cpu
    from quantkit.runtime.ops_torch import TorchOps
    ref, _ = _logits(q4_k_llama, ops_cpu.float_products)      # a batch in float32, as the torch backend's
    got, placed = _logits(q4_k_llama, TorchOps("cpu", triton=True))
    assert placed == {"cpu (triton)"}
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-3, f"max|Δ| = {err:.2e} x max|logit|"
    assert not TorchOps("cpu").triton                   # off by default where there is no GPU
