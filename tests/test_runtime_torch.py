"""The torch backend (--device cuda / torch-cpu) against the numba backend.

* Every torch block decoder equals the numba decoder bit for bit, on rows with zeros, tiny and huge
  values.
* The tiny DeepSeek-V3 model (MLA + MoE) quantized to each type the torch backend decodes (every
  non-interleaved type quantkit writes, the trellis ones included): the
  logits of 32 positions on torch (the CPU here; CUDA where a GPU is) equal the numba backend's
  within 1e-3 x max |logit|, and the quantized weights are really computed by torch.
* A split run (routed experts kept on the CPU with --override-tensor exps=cpu) gives the all-CPU
  logits.
* quantkit.generate (the library beneath `run`): device torch-cpu generates what cpu does; a bad
  device or override is a one-line error (QuantkitError).
The same comparisons on SmolLM2 live in test_runtime_llama.py (they reuse its quantized files).
"""
from __future__ import annotations

import numpy as np
import pytest

import quantkit
from models import write_deepseek2
from quantkit import formats
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.runtime.model import Model
from quantkit.runtime.session import make_ops
from quantkit.types import QuantType as T
from quantkit.types import type_name

torch = pytest.importorskip("torch")
from quantkit.runtime import torch_decode  # noqa: E402  (needs torch)
from quantkit.runtime.ops_torch import NUMBA  # noqa: E402

DEVICES = ["torch-cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOATS = [T.F32, T.F16, T.BF16]
N_TOKENS = 32


def awkward_rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    x[0] = 0                                                  # an all-zero row
    x[1] *= np.float32(1e-7)                                  # tiny
    x[2] *= np.float32(3e3)                                   # huge (still finite in f16 scales)
    x[3, ::7] = 0
    return x


@pytest.mark.parametrize("qtype", [*torch_decode.DECODERS, *FLOATS], ids=type_name)
def test_torch_decoder_equals_numba_decoder(qtype):
    x = awkward_rows(8, 512, int(qtype))           # 8 rows: whole groups of the _r4 types
    if qtype in FLOATS:
        blocks = _float_blocks(x, qtype)
    else:
        # a mainline-only type (tq1_0) in its flavor; iq1_s / iq2_xxs / iq2_xs only with an imatrix
        flavor = "ik" if formats.can_quantize(qtype, "ik", False) or formats.can_quantize(qtype, "ik", True) \
            else "mainline"
        imatrix = None if formats.can_quantize(qtype, flavor, False) else np.linspace(0.1, 4, 512, dtype=np.float32)
        blocks = formats.quantize(x, qtype, imatrix, flavor)
    expect = formats.dequantize(blocks, qtype, 512)
    got = torch_decode.decode(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, 512).numpy()
    np.testing.assert_array_equal(got, expect)


def _float_blocks(x, qtype):
    if qtype == T.F32:
        return x.view(np.uint8)
    if qtype == T.F16:
        return x.astype(np.float16).view(np.uint8)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)     # truncated bf16 is fine here


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_deepseek2(tmp_path_factory.mktemp("ds-torch") / "v3-f32.gguf")


def logits(path, device="cpu", cpu_tensors=()) -> tuple[np.ndarray, object]:
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, 512, N_TOKENS)]
    with open_model(path) as g:
        # the numba backend's batches as the torch backend's: float32 products
        ops = make_ops(device, cpu_tensors, 2, float_products=device == "cpu")
        model = Model(g, ops=ops)
        return model.forward(tokens, model.new_cache(N_TOKENS)), ops


def assert_close(ours, ref, rel=1e-3):
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= rel, f"max|Δ| = {err:.2e} x max|logit|"


TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "q2_K", "q3_K", "q4_K", "q5_K",
         "q6_K", "iq4_nl", "iq4_xs", "iq2_k", "iq2_ks", "iq2_kl", "iq3_k", "iq3_ks", "iq4_k", "iq4_ks", "iq4_kss",
         "iq5_k", "iq5_ks", "iq6_k", "iq1_kt", "iq2_kt", "iq3_kt", "iq4_kt"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", TYPES)
def test_deepseek2_logits_equal_numba_backend(v3, tmp_path, target, device):
    path = v3
    if target != "f32":
        path = tmp_path / f"v3-{target}.gguf"
        # the trellis types want an imatrix by llama-quantize's rules (the logits do not), and their
        # presets put iq3_s (not written by quantkit) on token_embd: --pure
        extra = dict(ignore_imatrix_rules=True, pure=True) if target.endswith("_kt") else {}
        quantkit.quantize_model(v3, path, target, **extra)
    with open_model(path) as g:
        # the expert tensors carry the target type (some others take llama-quantize's fallbacks)
        assert type_name(g.by_name["blk.1.ffn_up_exps.weight"].qtype).lower() == target.lower()
    ref, _ = logits(path)
    got, ops = logits(path, device)
    assert_close(got, ref)
    with open_model(path) as g:
        model = Model(g, ops=ops)
        placed = ops.placement([model.w.need(t.name) for t in g.tensors if t.n_dims >= 2])
    assert placed["blk.1.ffn_up_exps.weight"] != NUMBA and placed["blk.0.attn_kv_a_mqa.weight"] != NUMBA


@pytest.mark.parametrize("device", DEVICES)
def test_split_run_equals_all_cpu(v3, tmp_path, device):
    q = tmp_path / "v3-q4_K.gguf"
    quantkit.quantize_model(v3, q, "q4_K")
    ref, _ = logits(q)
    got, ops = logits(q, device, ["exps"])
    assert_close(got, ref)
    with open_model(q) as g:
        model = Model(g, ops=ops)
        placed = ops.placement([model.w.need(t.name) for t in g.tensors if t.n_dims >= 2])
    assert {v for k, v in placed.items() if "exps" in k} == {NUMBA}
    # on CUDA with triton installed the fused kernels compute the types they support
    assert {v for k, v in placed.items() if "exps" not in k} <= {f"{ops.device} (torch)", f"{ops.device} (triton)"}


def test_torch_cpu_generates_what_cpu_does(v3):
    runs = {}
    for device in ("cpu", "torch-cpu"):
        g = quantkit.generate(v3, "abc", n_predict=8, temp=0, device=device, override_tensor="ffn_down_exps=cpu")
        runs[device] = g.stats.tokens
        if device == "torch-cpu":       # the one routed-expert tensor per MoE layer kept on the CPU
            assert g.placement[NUMBA]["tensors"] == 3 and g.placement["cpu (torch)"]["tensors"] > 20, g.placement
        else:
            assert g.placement is None
    assert runs["cpu"] == runs["torch-cpu"] and len(runs["cpu"]) == 8


@pytest.mark.parametrize("options, message", [
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"override_tensor": "exps"}, "expected REGEX=cpu"),
    ({"override_tensor": "exps=cuda"}, "expected REGEX=cpu"),
    ({"override_tensor": "(=cpu"}, "invalid regex"),
] + ([] if torch.cuda.is_available() else [({"device": "cuda"}, "torch sees no CUDA device")]))
def test_device_errors_are_one_line(v3, options, message):
    with pytest.raises(QuantkitError) as e:
        quantkit.generate(v3, "abc", n_predict=2, **options)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
