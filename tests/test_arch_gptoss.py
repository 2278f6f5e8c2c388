"""gpt-oss end to end: a tiny GptOssForCausalLM saved by transformers, converted by quantkit, run in
quantkit's runtime (numba and torch backends) and in ik_llama.cpp's wheel.

The tiny model has what makes gpt-oss gpt-oss: 3 layers (sliding, full, sliding: a window of 8
under a 40-token sequence), 4 query heads over 2 KV heads with biases, per-head sinks, NEOX rope
with YaRN, 4 biased experts (2 per token) routed by softmax over the top-k logits, swiglu_oai.
Its expert weights are MXFP4 values, so the same model exists twice: float32 as transformers saved
it, and with the experts in HF's quantized layout (``*_blocks``/``*_scales``), which the
converter must keep as ggml MXFP4 bit for bit.

Its YaRN config says ``truncate: true``: ggml (ik_llama.cpp, mainline, and so our runtime; the GGUF
has no key for it) always rounds YaRN's correction range out to whole dims, which transformers does
only with truncate (gpt-oss's own config has ``truncate: false``: measured on this tiny model, the
wheel's logits and ours then differ from transformers' by 0.93 x max |logit|, agreeing with each
other to 1e-4).

References: transformers' float32 logits (the issue's bar: within 1e-3 x max |logit|, the same top
token at >= 99% of positions), the wheel's logits on the same file, the wheel's MXFP4 decoder.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_models as H  # noqa: E402
import peers  # noqa: E402
import quantkit  # noqa: E402
from models import rewrite_gguf  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.hf import open_hf  # noqa: E402
from quantkit.runtime import ops_cpu  # noqa: E402
from quantkit.runtime.model import Model  # noqa: E402
from quantkit.runtime.ops_torch import TorchOps  # noqa: E402
from quantkit.types import QuantType  # noqa: E402

needs_wheel = pytest.mark.skipif(peers.wheel_dir() is None, reason="ik-llama-cpp-python is not installed")
WINDOW, N_TOKENS = 8, 40
A = "gpt-oss."


@pytest.fixture(scope="module")
def model(tmp_path_factory, tok_meta):
    """The float and MXFP4 checkpoints, their GGUFs (f32; and as stored: MXFP4 experts, the rest
    F32), the test tokens and transformers' logits."""
    d = tmp_path_factory.mktemp("gptoss")
    float_dir, mx_dir = H.save_gptoss(d / "tiny-gpt-oss", tok_meta, window=WINDOW)
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, len(tok_meta["tokenizer.ggml.tokens"]), N_TOKENS)]
    f32, mx = d / "f32.gguf", d / "mxfp4.gguf"
    quantkit.quantize_model(float_dir, f32, "f32")
    quantkit.quantize_model(mx_dir, mx, None)          # no TYPE: every tensor as the checkpoint has it
    return dict(float_dir=float_dir, mx_dir=mx_dir, f32=f32, mx=mx, tokens=tokens,
                ref=H.hf_logits(float_dir, tokens))


def our_logits(path, tokens, ops=ops_cpu, cache_type="f16") -> np.ndarray:
    with open_model(path) as g:
        m = Model(g, ops, cache_type=cache_type)
        return ops_cpu.host(m.forward(tokens, m.new_cache(len(tokens))))


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float, argmax: float = 0.99) -> None:
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    same = (ours.argmax(axis=1) == ref.argmax(axis=1)).mean()
    assert err <= rel, f"max|Δ| = {err:.2e} x max|logit|"
    assert same >= argmax, f"same top token at {same:.0%} of positions"


# ---- the converter ----

def test_metadata_and_tensors_as_mainline_writes_them(model):
    with open_model(model["mx"]) as g:
        meta = {k: g.get(k) for k in g.metadata}
        types = {t.name: (QuantType(t.qtype), tuple(t.shape)) for t in g.tensors}
    assert meta["general.architecture"] == "gpt-oss"
    want = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 64, "expert_feed_forward_length": 64,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
            "attention.value_length": 16, "attention.sliding_window": WINDOW, "expert_count": 4,
            "expert_used_count": 2, "context_length": 256, "rope.scaling.type": "yarn",
            "rope.scaling.original_context_length": 64}
    assert {k: meta[A + k] for k in want} == want
    for key, value in (("rope.scaling.factor", 4.0), ("rope.scaling.yarn_beta_fast", 32.0),
                       ("rope.scaling.yarn_beta_slow", 1.0), ("rope.freq_base", 10000.0)):
        assert meta[A + key] == pytest.approx(value)
    F32, MX = QuantType.F32, QuantType.MXFP4
    for i in range(3):
        b = f"blk.{i}."
        assert types[b + "attn_sinks.weight"] == (F32, (4,))
        assert types[b + "post_attention_norm.weight"] == (F32, (64,))
        assert types[b + "ffn_gate_inp.weight"] == (F32, (64, 4))
        assert types[b + "ffn_gate_inp.bias"] == (F32, (4,))
        for name in ("attn_q", "attn_output"):
            assert types[b + name + ".bias"] == (F32, (64,))
        assert types[b + "attn_k.bias"] == types[b + "attn_v.bias"] == (F32, (32,))
        assert types[b + "ffn_gate_exps.weight"] == types[b + "ffn_up_exps.weight"] == (MX, (64, 64, 4))
        assert types[b + "ffn_down_exps.weight"] == (MX, (64, 64, 4))
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert types[b + name + ".bias"] == (F32, (64, 4))
        assert "ffn_norm.weight" not in types
    assert types["output.weight"] == (F32, (64, len(model["ref"][0])))


def _repacked(blocks: np.ndarray, scales: np.ndarray, rows: slice) -> bytes:
    """ggml block_mxfp4 rows made from HF's blocks/scales of one tensor, written out weight by
    weight: block = [e8m0] + qs[16] with weight j in qs[j]'s low nibble and j + 16 in its high one;
    HF's byte k holds weights 2k (low) and 2k + 1 (high)."""
    out = bytearray()
    for e in range(blocks.shape[0]):
        for r in range(blocks.shape[1])[rows]:
            for b in range(blocks.shape[2]):
                hf = blocks[e, r, b]
                w = [(int(hf[i // 2]) >> (4 * (i % 2))) & 15 for i in range(32)]
                out.append(int(scales[e, r, b]))
                out.extend(w[j] | (w[j + 16] << 4) for j in range(16))
    return bytes(out)


def test_mxfp4_experts_are_kept_bit_for_bit(model):
    from safetensors.numpy import load_file
    hf = load_file(str(model["mx_dir"] / "model.safetensors"))
    with open_model(model["mx"]) as g, open_model(model["f32"]) as f:
        for i in range(3):
            ex = f"model.layers.{i}.mlp.experts."
            for name, src, rows in (("ffn_gate_exps", "gate_up_proj", slice(0, None, 2)),
                                    ("ffn_up_exps", "gate_up_proj", slice(1, None, 2)),
                                    ("ffn_down_exps", "down_proj", slice(None))):
                t = g.by_name[f"blk.{i}.{name}.weight"]
                raw = np.asarray(t.raw()).tobytes()
                assert raw == _repacked(hf[ex + src + "_blocks"], hf[ex + src + "_scales"], rows), t.name
                # what those bytes mean to ggml (the wheel's own decoder) is what transformers computes
                # with: the float checkpoint's weights, converted to the f32 file
                if peers.wheel_dir() is not None:
                    decoded = peers.to_float(int(QuantType.MXFP4), raw, t.n_elements, t.n_per_row)
                    want = np.asarray(f.by_name[t.name].raw()).view(np.float32).reshape(-1)
                    assert np.array_equal(decoded, want), t.name


def test_float_and_mxfp4_checkpoints_give_the_same_model(model):
    """The float checkpoint's converted tensors (experts transposed and de-interleaved) hold the same
    values as the MXFP4 one's, tensor by tensor."""
    from quantkit import formats
    with open_model(model["mx"]) as g, open_model(model["f32"]) as f:
        assert [t.name for t in g.tensors] == [t.name for t in f.tensors]
        for t in g.tensors:
            ours = formats.dequantize(np.asarray(t.raw()).view(np.uint8).reshape(-1), QuantType(t.qtype), t.n_per_row)
            assert np.array_equal(ours.reshape(-1), np.asarray(f.by_name[t.name].raw()).view(np.float32).reshape(-1))


# ---- our runtime against transformers and the wheel ----

@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("file", ["f32", "mx"])
def test_logits_match_transformers(model, backend, file):
    """With an f32 KV cache (-ctk/-ctv f32) nothing is rounded to f16: transformers' float32 logits
    to float precision (measured 1.2e-6 x max |logit|, numba and torch), far inside the issue's 1e-3
    bar.  The default f16 cache's rounding of keys and values alone costs 1.3e-3 on this model (as
    in the wheel: test_logits_match_the_wheel).  The numba backend's batches with float products:
    the MXFP4 experts' decoded values times float32 activations, as transformers computes."""
    ops = ops_cpu.float_products if backend == "cpu" else TorchOps("cpu")
    assert_close(our_logits(model[file], model["tokens"], ops, cache_type="f32"), model["ref"], 1e-5, argmax=1.0)


@needs_wheel
def test_logits_match_the_wheel(model):
    """ik_llama.cpp loads the file and computes what our runtime computes with the same f16 KV cache
    (measured: 1.0e-4 x max |logit| on this model, 7e-6 with heads of 64).  That cache's rounding
    puts both 1.3e-3 from transformers' float32 here (our f32 cache: 1.2e-6): the wheel is held
    to transformers at the f16 cache's level."""
    tokens = model["tokens"]
    ik = np.asarray(peers.ik_logits(model["f32"], tokens, all_positions=True)).reshape(model["ref"].shape)
    assert_close(our_logits(model["f32"], tokens), ik, 2e-4, argmax=1.0)
    assert_close(ik, model["ref"], 2e-3)


@needs_wheel
def test_the_wheel_runs_the_mxfp4_file(model):
    """The wheel loads the MXFP4 file and runs it.  It multiplies MXFP4 with activations rounded to
    8 bits (Q8_0_R8 for a batch, Q8_2_X4 on AVX2): its logits stay near transformers' only at the
    level that rounding allows on this tiny random model (measured 3e-2 x max |logit|, the same
    top token at 88% of positions), where the float32 products of our runtime are within 1e-3."""
    ik = np.asarray(peers.ik_logits(model["mx"], model["tokens"], all_positions=True)).reshape(model["ref"].shape)
    assert_close(ik, model["ref"], 6e-2, argmax=0.8)


def test_incremental_decoding_matches_the_full_forward(model):
    """A prompt of 5 then one token at a time through the cache, past the window of 8: the same
    logits (windowed layers must drop the keys that slide out, also when the cache holds them).
    Steps of one token take the fused products and norms (another order of additions): measured
    4.7e-5."""
    tokens = model["tokens"][:2 * WINDOW]
    with open_model(model["f32"]) as g:
        m = Model(g, ops_cpu)
        cache = m.new_cache(len(tokens))
        steps = np.concatenate([m.forward(tokens[:5], cache)] + [m.forward([t], cache) for t in tokens[5:]])
    assert_close(steps, our_logits(model["f32"], model["tokens"])[:len(tokens)], 1e-4, argmax=1.0)


def test_the_window_matters(small, tmp_path, model):
    """A window that covers the whole sequence gives other logits from the first position past the
    window of 8 on, the same before it up to the order of float32 additions (the sliding layers are
    exercised; the test sequence is longer than the window)."""
    wide = rewrite_gguf(small, tmp_path / "wide.gguf", keys={A + "attention.sliding_window": 1000})
    tokens = [t % 64 for t in model["tokens"]]
    narrow, wide = our_logits(small, tokens), our_logits(wide, tokens)
    diff = np.abs(narrow - wide).max(axis=1) / np.abs(narrow).max()
    assert diff[:WINDOW].max() <= 1e-6 and diff[WINDOW:].min() > 1e-3, diff


# ---- the gpt-oss pieces against transformers' own modules ----

def test_router_and_activation_match_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
    cfg = GptOssConfig(hidden_size=32, intermediate_size=32, num_local_experts=6, num_experts_per_tok=3)
    g = torch.Generator().manual_seed(3)
    router = GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(router.bias.shape, generator=g))
        x = torch.randn(50, 32, generator=g)
        logits, scores, ids = router(x)
    for ops in (ops_cpu, TorchOps("cpu")):
        our_ids, our_w = ops.moe_route(ops.from_host(logits.numpy()), 3, "softmax_weight")
        assert np.array_equal(np.sort(our_ids, axis=1), np.sort(ids.numpy(), axis=1))
        order = np.argsort(our_ids, axis=1), np.argsort(ids.numpy(), axis=1)
        np.testing.assert_allclose(np.take_along_axis(our_w, order[0], 1),
                                   np.take_along_axis(scores.numpy(), order[1], 1), rtol=1e-6, atol=1e-7)
    # gate and up interleaved in transformers' gate_up; large values to reach the clamps at +-7
    gate_up = 6 * torch.randn(40, 64, generator=g)
    want = GptOssExperts(cfg)._apply_gate(gate_up).numpy()
    gate, up = gate_up[:, ::2].numpy(), gate_up[:, 1::2].numpy()
    assert (np.abs(gate) > 7).any() and (np.abs(up) > 7).any()
    np.testing.assert_allclose(ops_cpu.swiglu_oai(gate, up), want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(TorchOps._swiglu_oai(torch.from_numpy(gate), torch.from_numpy(up)).numpy(), want,
                               rtol=2e-6, atol=1e-6)


# ---- bad input ----

def _checkpoint_copy(src, dst, config_edit=None, tensors_edit=None):
    """A copy of a checkpoint directory (links to its files) with config.json or the weights changed."""
    dst.mkdir()
    for p in src.iterdir():
        os.symlink(p, dst / p.name)
    if config_edit:
        doc = json.loads((src / "config.json").read_text())
        config_edit(doc)
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps(doc))
    if tensors_edit:
        from safetensors.numpy import load_file, save_file
        tensors = load_file(str(src / "model.safetensors"))
        tensors_edit(tensors)
        (dst / "model.safetensors").unlink()
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _drop(name):
    return lambda t: t.pop(name)


def _retype(name, dtype):
    return lambda t: t.__setitem__(name, t[name].astype(dtype))


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


BLOCKS = "model.layers.1.mlp.experts.gate_up_proj_blocks"
BAD_CHECKPOINTS = [
    ("float", _set("layer_types", ["full_attention"] * 3), None, "layer_types"),
    ("float", _set("swiglu_limit", 5.0), None, "swiglu_limit 5"),
    ("float", _set("num_experts_per_tok", 9), None, "num_experts_per_tok 9"),
    ("float", None, _drop("model.layers.0.self_attn.sinks"), "model.layers.0.self_attn.sinks"),
    ("float", None, _drop("model.layers.2.mlp.experts.down_proj_bias"), "down_proj_bias"),
    ("mx", None, _drop("model.layers.1.mlp.experts.gate_up_proj_scales"), "gate_up_proj_scales"),
    ("mx", None, _retype(BLOCKS, np.int8), "I8"),
    ("mx", None, lambda t: t.__setitem__(BLOCKS, t[BLOCKS][:, :, :1]), BLOCKS),
    ("mx", _set("quantization_config", {"quant_method": "awq"}), None, "quantization_config"),
]


@pytest.mark.parametrize("which,config_edit,tensors_edit,needle", BAD_CHECKPOINTS)
def test_bad_checkpoints_are_refused(model, tmp_path, which, config_edit, tensors_edit, needle):
    src = model["float_dir" if which == "float" else "mx_dir"]
    d = _checkpoint_copy(src, tmp_path / "bad", config_edit, tensors_edit)
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def small(model, tmp_path_factory):
    """The f32 file with a 64-token vocabulary and no tokenizer: cheap to rewrite per case."""
    with open_model(model["f32"]) as g:
        drop = {k: None for k in g.metadata if k.startswith("tokenizer.")}
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gptoss-hostile") / "small.gguf"
    rewrite_gguf(model["f32"], path, keys={**drop, A + "vocab_size": 64},
                 tensors={"token_embd.weight": rng.standard_normal((64, 64)).astype(np.float32),
                          "output.weight": rng.standard_normal((64, 64)).astype(np.float32)})
    with open_model(path) as g:
        Model(g, ops_cpu)
    return path


BAD_FILES = [
    ({A + "attention.sliding_window": 0}, None, "attention.sliding_window", "at least 1"),
    ({A + "attention.sliding_window": None}, None, "attention.sliding_window", "missing"),
    ({A + "expert_used_count": 5}, None, "expert_used_count", "at most 4"),
    ({A + "expert_feed_forward_length": 32}, None, "expert_feed_forward_length", "64 rows"),
    ({A + "rope.dimension_count": 8}, None, "rope.dimension_count", "head size 16"),
    ({A + "rope.scaling.type": "longrope"}, None, "rope.scaling.type", "not supported"),
    ({A + "rope.scaling.yarn_beta_fast": float("nan")}, None, "yarn_beta_fast", "finite"),
    ({A + "rope.scaling.original_context_length": 0}, None, "original_context_length", "at least 1"),
    ({A + "attention.value_length": 8}, None, "attention.value_length", "differs"),
    ({}, {"blk.1.attn_sinks.weight": None}, "blk.1.attn_sinks.weight", "missing"),
    ({}, {"blk.1.attn_sinks.weight": np.zeros(2, np.float32)}, "blk.1.attn_sinks.weight", "one sink per head"),
    ({}, {"blk.0.ffn_down_exps.bias": np.zeros((4, 32), np.float32)}, "blk.0.ffn_down_exps.bias", "[64, 4]"),
    ({}, {"blk.2.ffn_up_exps.bias": None}, "blk.2.ffn_up_exps.bias", "missing"),
    ({}, {"blk.0.post_attention_norm.weight": None}, "post_attention_norm", "missing"),
    ({}, {"blk.0.ffn_gate_inp.bias": np.zeros(3, np.float32)}, "ffn_gate_inp.bias", "[4]"),
]


@pytest.mark.parametrize("keys,tensors,name,words", BAD_FILES)
def test_bad_files_are_refused_at_load(small, tmp_path, keys, tensors, name, words):
    path = rewrite_gguf(small, tmp_path / "bad.gguf", keys=keys, tensors=tensors)
    with open_model(path) as g:
        with pytest.raises(QuantkitError) as e:
            Model(g, ops_cpu)
    msg = str(e.value)
    assert name in msg and words in msg and "\n" not in msg, msg
