"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): the converter's indexer tensors and keys, and the runtime's
DSA lightning indexer, below and above ``index_topk``, against transformers and the ik wheel.

The model is a tiny DeepseekV32ForCausalLM saved by transformers (3 layers, the first dense; 4
routed experts in 2 groups of which 1 is used, a shared expert; 8 indexer heads of 16 dims, the
first 8 roped; index_topk 16), converted to F32 by the library.  A 12-token prompt is below
index_topk (every query attends to all of its keys), a 48-token one above it (queries 16.. attend
to 16 keys each).

Tolerance.  With its default f16 cache the runtime computes MLA attention with ik_llama.cpp's
numbers: the latent cache in float16, the query rounded to float16, the probabilities too.  That
rounding alone puts our logits 1.2e-3 x max|logit| from transformers' float32 ones on this model
below index_topk, 1.8e-3 above.  So the runtime is compared with transformers on an f32 cache
(-ctk/-ctv f32: nothing rounded), where they agree to float precision (measured: 1.2e-6 below,
2.4e-6 above with numba; 7.5e-7 and 1.2e-6 with torch), held to TOL, and, which is what the indexer
is about, the keys each query keeps are compared with transformers' exactly: every layer, every
query.  Exact top-k is discontinuous (two keys whose scores are within rounding of each other may
swap between two implementations, changing that query's attention entirely); float32 scores make
such near ties rare, and the selection check names the query if one ever occurs.

The wheel: ik_llama.cpp's deepseek2 loader does not create the indexer tensors, so it refuses the
V3.2 file ("wrong number of tensors"); its DSA graph is built only for the glm-dsa architecture.
It is compared on the same weights without the indexer (the DeepSeek-V3 twin of the checkpoint),
where it attends densely: equal to transformers below index_topk, to our dense run above.
"""
from __future__ import annotations

import json
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

TOL = 1e-5                  # x max |logit|, an f32 cache against transformers (see the module docstring)
F16_TOL = 2e-3              # the f16 cache against the wheel's (tests/test_hf_convert.py's bar for ik's deepseek2)
FAR = 4e-2                  # "another model's logits"
TOP_K, N_LAYER = 16, 3
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 355, 6135, 42, 30, 216, 9, 3113] * 3
SHORT, LONG = PROMPT[:12], PROMPT
D = "deepseek2."
BACKENDS = {"numba": lambda: ops_cpu, "torch": lambda: TorchOps(torch.device("cpu"))}


class Recording:
    """An ops backend that keeps what dsa_topk returns (host arrays), one entry per layer and call."""

    def __init__(self, ops):
        self.ops, self.kept = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def dsa_topk(self, *args, **kwargs):
        keep = self.ops.dsa_topk(*args, **kwargs)
        self.kept.append(None if keep is None else np.asarray(self.ops.host(keep), bool))
        return keep


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory, tok_meta):
    d = H.save_deepseek_v32(tmp_path_factory.mktemp("hf") / "tiny-dsv32", tok_meta, n_layer=N_LAYER,
                            index_topk=TOP_K)
    # V3.2 checkpoints carry a multi-token-prediction layer (with its own indexer) after the last block
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors[f"model.layers.{N_LAYER}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{N_LAYER}.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def v32_gguf(tmp_path_factory, v32_dir):
    out = tmp_path_factory.mktemp("gguf") / "dsv32-f32.gguf"
    quantkit.quantize_model(v32_dir, out, "f32")
    return out


@pytest.fixture(scope="module")
def reference(v32_dir):
    """transformers' float32 logits and indexer choices: {tokens: (logits, [per layer (n, top_k) ids])}."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(v32_dir, dtype=torch.float32).eval()
    chosen = []
    for layer in model.model.layers:
        layer.self_attn.indexer.register_forward_hook(lambda mod, inp, out: chosen.append(out[0].numpy()))
    out = {}
    for tokens in (SHORT, LONG):
        chosen.clear()
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float().numpy()
        out[len(tokens)] = (logits, list(chosen))
    return out


@pytest.fixture(scope="module")
def v3_twin(tmp_path_factory, v32_dir):
    """The same weights without the indexer, as DeepseekV3ForCausalLM, converted: what ik can load."""
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("hf") / "twin"
    shutil.copytree(v32_dir, d)
    tensors = {n: t for n, t in load_file(str(v32_dir / "model.safetensors")).items() if ".indexer." not in n}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (d / "config.json").write_text(json.dumps(cfg))
    out = d.parent / "twin-f32.gguf"
    quantkit.quantize_model(d, out, "f32")
    return out


def ours(path, tokens, ops, cache_type="f16") -> np.ndarray:
    with open_model(path) as g:
        model = Model(g, ops, cache_type=cache_type)
        return model.forward(tokens, model.new_cache(len(tokens)))


def err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def assert_close(logits: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert err(logits, ref) <= TOL, f"{what}: max|Δ| = {err(logits, ref):.2e} x max|logit|"
    same = (logits.argmax(1) == ref.argmax(1)).mean()
    assert same >= 0.99, f"{what}: same top token at {same:.0%} of positions"


# ---- the converter ----

def test_converter_keeps_the_indexer(v32_dir, v32_gguf):
    from safetensors.torch import load_file
    hf = load_file(str(v32_dir / "model.safetensors"))
    with open_model(v32_gguf) as g:
        assert g.get(D + "attention.indexer.head_count") == 8
        assert g.get(D + "attention.indexer.key_length") == 16
        assert g.get(D + "attention.indexer.top_k") == TOP_K
        assert g.get(D + "expert_gating_func") == 2                 # V3.2 routes with sigmoid scores
        assert not any(t.name.startswith(f"blk.{N_LAYER}.") for t in g.tensors)      # the MTP layer
        for i in range(N_LAYER):
            for name, hf_name, shape in (("attn_q_b", "wq_b", (32, 8 * 16)), ("attn_k", "wk", (64, 16)),
                                         ("k_norm", "k_norm", (16,)), ("proj", "weights_proj", (64, 8))):
                t = g.by_name[f"blk.{i}.indexer.{name}.weight"]
                assert tuple(t.shape) == shape, name
                # as stored: no permutation (the indexer's rope is the NEOX kind, applied as such)
                assert np.array_equal(t.raw().view(np.float32).reshape(-1),
                                      hf[f"model.layers.{i}.self_attn.indexer.{hf_name}.weight"].reshape(-1).numpy())
            assert np.array_equal(g.by_name[f"blk.{i}.indexer.k_norm.bias"].raw().view(np.float32).reshape(-1),
                                  hf[f"model.layers.{i}.self_attn.indexer.k_norm.bias"].numpy())


@pytest.mark.parametrize("change, needle", [
    ({"q_lora_rank": None}, "q_lora_rank is 0"),
    ({"index_topk": 0}, "'index_topk' is 0"),
    ({"index_head_dim": 4}, "index_head_dim 4"),
    ({"index_n_heads": 4}, "wq_b.weight' has shape [128, 32] but config.json implies [64, 32]"),
])
def test_converter_refuses_an_inconsistent_config(tmp_path, v32_dir, change, needle):
    d = tmp_path / "bad"
    d.mkdir()
    for f in v32_dir.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((v32_dir / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the runtime against transformers ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_below_index_topk_every_key_is_kept(v32_gguf, reference, backend):
    ops = Recording(BACKENDS[backend]())
    logits = ours(v32_gguf, SHORT, ops, "f32")
    assert ops.kept == [None] * N_LAYER                 # no query sees more than index_topk keys
    assert_close(logits, reference[len(SHORT)][0], f"{backend}, {len(SHORT)} tokens")


@pytest.mark.parametrize("backend", BACKENDS)
def test_above_index_topk_the_kept_keys_are_transformers(v32_gguf, reference, backend):
    ops = Recording(BACKENDS[backend]())
    logits = ours(v32_gguf, LONG, ops, "f32")
    ref_logits, ref_chosen = reference[len(LONG)]
    assert len(ops.kept) == N_LAYER
    for layer, (keep, chosen) in enumerate(zip(ops.kept, ref_chosen)):
        assert keep.shape == (len(LONG), len(LONG))
        for t in range(len(LONG)):
            theirs = sorted(int(j) for j in chosen[t] if j <= t)     # their top-k also lists masked keys early on
            assert np.flatnonzero(keep[t]).tolist() == theirs, f"layer {layer}, query {t}"
            assert keep[t].sum() == min(t + 1, TOP_K)
    assert_close(logits, ref_logits, f"{backend}, {len(LONG)} tokens")


def test_the_indexer_matters(v32_gguf, v3_twin, reference):
    """Above index_topk the dense model (the same weights without the indexer) is far from V3.2:
    the comparison above is one of the sparse attention."""
    ref = reference[len(LONG)][0]
    assert err(ours(v3_twin, LONG, ops_cpu, "f32"), ref) > FAR
    # below it the twin is V3.2 itself
    assert_close(ours(v3_twin, SHORT, ops_cpu, "f32"), reference[len(SHORT)][0], "dense twin, short prompt")


def test_generation_reads_the_cached_indexer_keys(v32_gguf):
    """A prompt then one token at a time (each new query scores every cached indexer key) gives the
    logits of the whole sequence at once."""
    whole = ours(v32_gguf, LONG, ops_cpu)
    with open_model(v32_gguf) as g:
        model = Model(g, ops_cpu)
        cache = model.new_cache(len(LONG))
        steps = [model.forward(LONG[:40], cache)[-1]]
        steps += [model.forward([t], cache)[0] for t in LONG[40:]]
    assert err(np.array(steps), whole[39:]) < 1e-4


# ---- the wheel ----

def test_wheel_on_the_same_weights(tmp_path, v32_gguf, v3_twin, reference):
    """The wheel cannot load the V3.2 file; on the same weights without the indexer and without
    group-limited routing (which ik_llama.cpp does not read for deepseek2 either: it routes among
    all experts) it computes what our runtime computes, far from V3.2 above index_topk."""
    if peers.wheel_dir() is None:
        pytest.skip("the ik_llama.cpp wheel is not installed")
    # its deepseek2 loader creates no indexer tensors: "done_getting_tensors: wrong number of tensors"
    with pytest.raises(RuntimeError, match="Failed to load model"):
        peers.ik_logits(v32_gguf, SHORT)
    flat = rewrite_gguf(v3_twin, tmp_path / "flat.gguf", {D + "expert_group_count": None,
                                                         D + "expert_group_used_count": None})
    for tokens in (SHORT, LONG):
        ik = np.asarray(peers.ik_logits(flat, tokens, all_positions=True))
        mine = ours(flat, tokens, ops_cpu)
        # both with an f16 cache, rounding at different steps (measured 1.3e-3 on 48 tokens)
        assert err(ik, mine) <= F16_TOL, f"{len(tokens)} tokens: {err(ik, mine):.2e}"
        assert (ik.argmax(1) == mine.argmax(1)).mean() >= 0.99
    assert err(ik, reference[len(LONG)][0]) > FAR


# ---- hostile metadata ----

@pytest.mark.parametrize("keys, needles", [
    ({D + "attention.indexer.top_k": None}, ("attention.indexer.head_count is set", "top_k is missing")),
    ({D + "attention.indexer.top_k": 0}, (D + "attention.indexer.top_k", "at least 1")),
    ({D + "attention.indexer.key_length": 4}, (D + "attention.indexer.key_length", "at least 8")),
    ({D + "attention.indexer.key_length": 32}, ("indexer.attn_q_b.weight", "[32, 256]")),
    ({D + "attention.indexer.head_count": 1 << 20}, (D + "attention.indexer.head_count", "at most")),
    ({D + "attention.indexer.head_count": 4}, ("indexer.attn_q_b.weight", "[32, 64]")),
    ({D + "attention.indexer.top_k": "16"}, (D + "attention.indexer.top_k", "must be an integer")),
])
def test_bad_indexer_metadata_is_refused(tmp_path, v32_gguf, keys, needles):
    path = rewrite_gguf(v32_gguf, tmp_path / "bad.gguf", keys)
    with open_model(path) as g:
        with pytest.raises(QuantkitError) as e:
            Model(g, ops_cpu)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_a_missing_indexer_tensor_is_refused(tmp_path, v32_gguf):
    path = rewrite_gguf(v32_gguf, tmp_path / "bad.gguf", tensors={"blk.1.indexer.k_norm.bias": None})
    with open_model(path) as g:
        with pytest.raises(QuantkitError, match=r"blk\.1\.indexer\.k_norm\.bias' is missing"):
            Model(g, ops_cpu)


# ---- FP8 with ue8m0 block scales ----

UE8M0 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}


def _fp8_ue8m0(src, dst, scale_dtype):
    """src's checkpoint as V3.2 ships it: each linear weight float8_e4m3fn with one power-of-two scale
    per 128 x 128 block (2^ceil(log2(amax / 448)), DeepSeek's ue8m0 rounding), stored as ``scale_dtype``;
    the embeddings, norms, router and the indexer's weights_proj in BF16."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        w = w.float()
        if w.ndim != 2 or any(k in name for k in H.FP8_KEEP + ("weights_proj", "eh_proj")):
            out[name] = w.to(torch.bfloat16)
            continue
        rows, cols = w.shape
        br, bc = -(-rows // 128), -(-cols // 128)
        padded = torch.zeros(br * 128, bc * 128)
        padded[:rows, :cols] = w
        amax = padded.view(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp(min=1e-30)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        out[name] = (w / full).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.to(scale_dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = UE8M0
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_ue8m0_fp8_checkpoint_decodes_exactly(tmp_path, v32_dir):
    """Scales stored as float32 or as F8_E8M0 give the same file, whose values are fp8 x 2^k exactly."""
    from safetensors.torch import load_file
    from quantkit.hf.numerics import E4M3FN
    as_f32 = _fp8_ue8m0(v32_dir, tmp_path / "f32" / "m", torch.float32)          # same name: general.name
    as_e8m0 = _fp8_ue8m0(v32_dir, tmp_path / "e8m0" / "m", torch.float8_e8m0fnu)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    quantkit.quantize_model(as_f32, a, "f32")
    quantkit.quantize_model(as_e8m0, b, "f32")
    assert a.read_bytes() == b.read_bytes()
    stored = load_file(str(as_e8m0 / "model.safetensors"))
    with open_model(a) as g:
        for gguf_name, hf_name in (("blk.1.indexer.attn_q_b.weight", "model.layers.1.self_attn.indexer.wq_b.weight"),
                                   ("blk.2.ffn_down_exps.weight", "model.layers.2.mlp.experts.0.down_proj.weight")):
            q = stored[hf_name].view(torch.uint8).numpy()
            exponent = int(stored[hf_name + "_scale_inv"].view(torch.uint8)[0, 0])
            want = E4M3FN[q].astype(np.float64) * 2.0 ** (exponent - 127)
            got = g.by_name[gguf_name].raw().view(np.float32).reshape(-1)[:q.size].reshape(q.shape)
            assert np.array_equal(got, want), gguf_name


def test_ue8m0_scales_that_are_not_powers_of_two_are_refused(tmp_path, v32_dir):
    from safetensors.torch import load_file, save_file
    d = _fp8_ue8m0(v32_dir, tmp_path / "bad", torch.float32)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.indexer.wk.weight_scale_inv"] *= 1.5
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=r"indexer\.wk\.weight_scale_inv' block \[0, 0\] is .* not a power of two"):
        open_hf(d).close()
    # an F8_E8M0 scale byte 0xFF is NaN
    e8 = _fp8_ue8m0(v32_dir, tmp_path / "nan", torch.float8_e8m0fnu)
    tensors = load_file(str(e8 / "model.safetensors"))
    tensors["model.layers.2.self_attn.q_b_proj.weight_scale_inv"].view(torch.uint8).fill_(0xFF)
    save_file(tensors, str(e8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=r"q_b_proj\.weight_scale_inv' block \[0, 0\] is .*nan"):
        open_hf(e8).close()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "e5m2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match=r'scale_fmt "e5m2" \(a string\) is not supported'):
        open_hf(d).close()


def test_blocks_of_queries_choose_alike(v32_gguf, monkeypatch):
    """The DSA paths score a block of query positions at a time (bounded memory for long contexts):
    small blocks keep the same keys and give the same logits."""
    whole = Recording(ops_cpu)
    ref = ours(v32_gguf, LONG, whole)
    monkeypatch.setattr(ops_cpu, "SCORE_BLOCK", 8 * len(LONG) * 5)     # 5 positions of 8 heads a block
    assert ops_cpu._dsa_block(8, len(LONG)) == 5
    blocks = Recording(ops_cpu)
    logits = ours(v32_gguf, LONG, blocks)
    assert all(np.array_equal(a, b) for a, b in zip(whole.kept, blocks.kept))
    assert err(logits, ref) < 1e-6
