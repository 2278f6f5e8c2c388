"""`quantkit quantize --imatrix` on SmolLM2 with the imatrix llama-imatrix made for it, through the
library (quantkit.quantize_model, in-process).

The bytes are checked against the executable reference port of ik_llama.cpp's Q4_0 imatrix
quantizer (../shared/reference/ik_quantize.py, itself checked against the C build), fed with the
weights as llama-quantize derives them from the file (in_sum2 / count, in float32).
"""
from __future__ import annotations

import importlib.util
import sys

import gguf
import numpy as np
import pytest

import quantkit


def _reference(shared_dir):
    spec = importlib.util.spec_from_file_location("ik_quantize_ref", shared_dir / "reference" / "ik_quantize.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(shared_dir / "reference"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod


def _gguf_imatrix_weights(path, name):
    r = gguf.GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    sums = np.asarray(t[name + ".in_sum2"].data, dtype=np.float32).reshape(-1)
    count = np.float32(np.asarray(t[name + ".counts"].data, dtype=np.float32).reshape(-1)[0])
    return sums / count


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, smollm2_path, shared_dir):
    d = tmp_path_factory.mktemp("imat")
    f32 = d / "f32.gguf"
    out = d / "q4_0-imat.gguf"
    imat = shared_dir / "golden" / "imatrix" / "smollm2-q4_1-gpl3.gguf"
    quantkit.quantize_model(smollm2_path, f32, "f32", allow_requantize=True)
    with quantkit.open_quantization(f32, out, "q4_0", imatrix=imat, token_embedding_type="q8_0") as q:
        result = q.write()
    return f32, out, imat, q.plan.warnings, result


def test_imatrix_rows_equal_reference_port(quantized, shared_dir):
    f32, out, imat, *_ = quantized
    ref = _reference(shared_dir)
    src = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    dst = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for name in ("blk.0.attn_q.weight", "blk.17.ffn_down.weight"):
        n_per_row = int(dst[name].shape[0])
        x = np.asarray(src[name].data, dtype=np.float32).reshape(-1, n_per_row)[:3]
        w = _gguf_imatrix_weights(imat, name)
        expect = np.frombuffer(ref.quantize_q4_0(x, w), np.uint8)
        got = np.asarray(dst[name].data).view(np.uint8).reshape(-1)[:expect.size]
        np.testing.assert_array_equal(got, expect, err_msg=name)
        # and the imatrix changed something: without it the rows quantize differently
        assert not np.array_equal(got, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0).view(np.uint8).reshape(-1))


def test_imatrix_metadata_and_missing_entries(quantized):
    _, out, imat, warnings, result = quantized
    r = gguf.GGUFReader(str(out))
    f = r.fields
    assert f["quantize.imatrix.file"].contents() == str(imat)
    assert f["quantize.imatrix.entries_count"].types[0] == gguf.GGUFValueType.UINT32
    assert f["quantize.imatrix.entries_count"].contents() == 30 * 7      # every linear layer of 30 blocks
    assert f["quantize.imatrix.chunks_count"].contents() == 8
    assert "calib" in f["quantize.imatrix.dataset"].contents()
    # token_embd is never in an imatrix: the plan says so (a warning the CLI prints) and the result lists it
    warning = [w for w in warnings if w.startswith("no imatrix data for")]
    assert len(warning) == 1 and "token_embd.weight" in warning[0], warnings
    assert result.missing_imatrix == ["token_embd.weight"]


def test_k_quant_with_imatrix(quantized, shared_dir, tmp_path):
    """The numba k-quant kernels get the imatrix as the loader hands it over (read-only views)."""
    f32, _, imat, *_ = quantized
    out = tmp_path / "q6_k-imat.gguf"
    quantkit.quantize_model(f32, out, "q6_K", pure=True, imatrix=imat)
    ref = _reference(shared_dir)
    src = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    dst = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    name = "blk.17.ffn_down.weight"             # rows of 1536: q6_K without a fallback
    assert dst[name].tensor_type == gguf.GGMLQuantizationType.Q6_K
    x = np.asarray(src[name].data, dtype=np.float32).reshape(-1, 1536)[:2]
    expect = np.frombuffer(ref.quantize_q6_K(x, _gguf_imatrix_weights(imat, name)), np.uint8)
    got = np.asarray(dst[name].data).view(np.uint8).reshape(-1)[:expect.size]
    np.testing.assert_array_equal(got, expect)
