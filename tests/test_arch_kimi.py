"""Kimi-K2: DeepSeek-V3's shapes (DeepseekV3ForCausalLM, ``deepseek2`` in GGUF) with Kimi's config
values and its routed experts int4-quantized in compressed-tensors' ``pack-quantized`` format.

The checkpoint is made here: a tiny DeepseekV3ForCausalLM saved by transformers, whose routed
experts the test quantizes (int4 codes in [-8, 7], one bfloat16 scale per 32 columns) and stores
as llm-compressor does (``weight_packed`` int32, ``weight_scale``, ``weight_shape``), with Kimi's
quantization_config. Its "dequantized twin" holds q * scale as plain float32 weights: transformers
computes the reference logits from it (transformers cannot load the packed experts without the
compressed-tensors package, and that would round q * scale to bfloat16).
"""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_models as H  # noqa: E402
from hostile import Snapshot, assert_refused, run_cli  # noqa: E402
import peers  # noqa: E402
import quantkit  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.hf import open_hf  # noqa: E402
from quantkit.runtime import ops_cpu  # noqa: E402
from quantkit.runtime.model import Model  # noqa: E402
from quantkit.runtime.ops_torch import TorchOps  # noqa: E402
from quantkit.types import QuantType  # noqa: E402

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 355, 6135, 42, 30, 216, 9, 3113] * 4
TOL = 1e-3          # x max |logit|, the bar
N_EXPERT, N_LAYER = 8, 3
ATTN_SHARE = 4.0
EXPERT = r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"
# Kimi-K2-Thinking's quantization_config (llm-compressor), as its config.json has it
KIMI_QUANT = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def int4_quantize(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Codes q in [-8, 7] and bfloat16 scales (as float32) per group of 32 columns: Kimi's symmetric
    amax / 7 in most groups (codes -7..7, as Moonshot's QAT uses them), amax / 7.5 in a quarter of
    them so that -8 occurs too."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32).astype(np.float32)
    amax = np.abs(g).max(-1)
    div = np.where(rng.random(amax.shape) < 0.25, 7.5, 7.0)
    scale = torch.from_numpy((amax / div).astype(np.float32)).to(torch.bfloat16).float().numpy()
    q = np.clip(np.rint(g / scale[..., None]), -8, 7).astype(np.int8).reshape(rows, cols)
    return q, scale


def pack_int32(q: np.ndarray) -> np.ndarray:
    """compressed-tensors' pack_to_int32 along columns: column c in bits 4 * (c % 8) of word c // 8,
    as q + 8."""
    u = (q.astype(np.int32) + 8).astype(np.uint32)
    rows, cols = q.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for i in range(8):
        words |= u[:, i::8] << np.uint32(4 * i)
    return words.view(np.int32)


def dequant(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = q.shape
    return (q.reshape(rows, cols // 32, 32).astype(np.float32) * scale[..., None]).reshape(rows, cols)


def save_kimi(directory, tok_meta):
    """(packed checkpoint, dequantized twin, {HF expert name: (codes, scales)})."""
    import re

    from safetensors.torch import load_file, save_file
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 50000.0}
    src = H.save_deepseek_v3(directory / "src", tok_meta, n_layer=N_LAYER, n_dense=1, n_expert=N_EXPERT, n_used=3,
                             n_shared=1, n_ff_exp=64, rope_scaling=rope, n_ctx=64, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    # Kimi-K2's routing: sigmoid scores with a correction bias, one group, normalised top-k weights
    # scaled by 2.827
    cfg.update(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid")
    tensors = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(11)
    twin, packed, codes = {}, {}, {}
    for name, t in tensors.items():
        if name.endswith("self_attn.o_proj.weight"):
            # attention's output 4x larger: for the wheel, which rounds activations to q8_0 in its
            # q4_0 products and keeps an f16 cache.  With the weights as they are, measured: its q4_0
            # logits 1e-2 x max|logit| from transformers at most positions and 0.38 at one (a routing
            # flip), top token 94%; its F32 ones 7e-4 but the top token at 98%.  (Our runtime with an
            # f32 cache is 1.7e-6 from transformers either way; with the f16 cache 1.3e-3 unscaled.)
            t = t * ATTN_SHARE
        if not re.match(EXPERT, name):
            twin[name] = packed[name] = t
            continue
        q, scale = int4_quantize(t.float().numpy(), rng)
        codes[name] = (q, scale)
        twin[name] = torch.from_numpy(dequant(q, scale))
        base = name[:-len(".weight")]
        packed[base + ".weight_packed"] = torch.from_numpy(pack_int32(q))
        packed[base + ".weight_scale"] = torch.from_numpy(scale).to(torch.bfloat16)
        packed[base + ".weight_shape"] = torch.tensor(list(t.shape))        # int64, as compress_weight writes
    out = {}
    for kind, data, extra in (("twin", twin, {}), ("kimi", packed, {"quantization_config": KIMI_QUANT})):
        d = directory / kind
        shutil.copytree(src, d)
        save_file(data, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, **extra}, indent=1))
        out[kind] = d
    return out["kimi"], out["twin"], codes


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tok_meta):
    return save_kimi(tmp_path_factory.mktemp("kimi"), tok_meta)


@pytest.fixture(scope="module")
def reference(kimi):
    _, twin, _ = kimi
    return H.hf_logits(twin, PROMPT)


def our_logits(path, ops, cache_type="f16") -> np.ndarray:
    with open_model(path) as g:
        model = Model(g, ops, cache_type=cache_type)
        return model.forward(PROMPT, model.new_cache(len(PROMPT)))


def ik_logits(path) -> np.ndarray:
    from test_runtime_deepseek2 import ik_mla_model
    with ik_mla_model():
        return np.asarray(peers.ik_logits(path, PROMPT, all_positions=True))


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str, tol: float = TOL, argmax: float = 0.99) -> None:
    ours = ours.reshape(ref.shape)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    same = (ours.argmax(1) == ref.argmax(1)).mean()
    assert err <= tol, f"{what}: max|Δ| = {err:.2e} x max|logit|"
    assert same >= argmax, f"{what}: same top token at {same:.0%} of positions"


def expert_layout(codes, layer: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """The codes and scales of one stacked ffn_*_exps tensor, in its row order (expert by expert)."""
    parts = [codes[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(N_EXPERT)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# ---- decoding ----

def test_int4_experts_decode_exactly_and_match_transformers(tmp_path, kimi, reference):
    """The F32 GGUF holds q * scale bit for bit; its logits, in our runtime (numba and torch) and in
    the wheel, are transformers' on the dequantized model.  Our runtime with an f32 MLA cache
    (-ctk/-ctv f32) to float precision (measured 8.5e-7 x max|logit| numba, 8.3e-7 torch); with the
    default f16 cache it computes what the wheel (whose cache is f16 too) computes (4.8e-4 apart),
    both about 5e-4 from transformers: the f16 rounding of the cache, the query and the probabilities."""
    src, _, codes = kimi
    with open_hf(src) as m:
        assert m.get("deepseek2.expert_gating_func") == 2 and m.get("deepseek2.expert_weights_norm") is True
        assert m.by_name["blk.1.ffn_up_exps.weight"].qtype == QuantType.F32
    out = tmp_path / "f32.gguf"
    quantkit.quantize_model(src, out, "f32")
    with open_model(out) as g:
        for layer in range(1, N_LAYER):
            for proj in ("gate", "up", "down"):
                q, scale = expert_layout(codes, layer, proj)
                got = g.by_name[f"blk.{layer}.ffn_{proj}_exps.weight"].raw().view(np.float32).reshape(q.shape)
                assert np.array_equal(got, dequant(q, scale))
        assert {int(v) for v in np.unique(q)} == set(range(-8, 8))       # every code, -8 included
    assert_close(our_logits(out, ops_cpu, "f32"), reference, "numba, f32 cache", tol=1e-5)
    assert_close(our_logits(out, TorchOps("cpu"), "f32"), reference, "torch, f32 cache", tol=1e-5)
    if peers.llama_quantize_bin() is not None:
        ik = ik_logits(out).reshape(reference.shape)
        assert_close(our_logits(out, ops_cpu), ik, "numba, f16 cache, vs the wheel", tol=1e-3, argmax=1.0)
        assert_close(ik, reference, "ik wheel")


def test_unpacking_follows_compressed_tensors():
    """Our unpacking against compressed-tensors' packing order (pack_to_int32 above), every code at
    every nibble position, and the decode against float64."""
    from quantkit.hf.compressed_tensors import decode, unpack_codes
    rng = np.random.default_rng(5)
    q = rng.integers(-8, 8, (16, 64)).astype(np.int8)
    assert np.array_equal(unpack_codes(pack_int32(q)).astype(np.int16) - 8, q)
    scale = torch.from_numpy(rng.random((16, 2), dtype=np.float32)).to(torch.bfloat16).float().numpy()
    exact = q.reshape(16, 2, 32).astype(np.float64) * scale[..., None].astype(np.float64)
    assert np.array_equal(decode(unpack_codes(pack_int32(q)), scale).astype(np.float64), exact.reshape(16, 64))


# ---- q4_0 without a loss (Q4_X) ----

@pytest.fixture(scope="module")
def q4x_file(tmp_path_factory, kimi):
    """Routed experts q4_0, copied from the int4 groups; everything else F32 (so the logits can be
    held to transformers')."""
    out = tmp_path_factory.mktemp("q4x") / "q4x.gguf"
    quantkit.quantize_model(kimi[0], out, "f32", custom_q=r"ffn_(gate|up|down)_exps\.weight=q4_0")
    return out


def test_q4_0_copies_codes_and_scales(q4x_file, kimi):
    """Each q4_0 block is the group: d the bfloat16 scale as fp16 (same value), nibble q + 8 (elements j
    and j + 16 share byte j); the wheel's to_float decodes it to exactly q * scale."""
    _, _, codes = kimi
    with open_model(q4x_file) as g:
        for layer in range(1, N_LAYER):
            for proj in ("gate", "up", "down"):
                t = g.by_name[f"blk.{layer}.ffn_{proj}_exps.weight"]
                assert t.qtype == QuantType.Q4_0
                q, scale = expert_layout(codes, layer, proj)
                blocks = t.raw().reshape(-1, 18)
                d = blocks[:, :2].copy().view("<f2").reshape(-1)
                assert np.array_equal(d, scale.reshape(-1).astype(np.float16))
                nib = (q.reshape(-1, 32).astype(np.int16) + 8).astype(np.uint8)
                assert np.array_equal(blocks[:, 2:], nib[:, :16] | (nib[:, 16:] << 4))
                if peers.llama_quantize_bin() is not None:
                    decoded = peers.to_float(int(QuantType.Q4_0), t.raw(), q.size, q.shape[1])
                    assert np.array_equal(decoded.reshape(q.shape), dequant(q, scale))


def test_q4_0_r8_is_the_copy_interleaved(tmp_path, kimi, q4x_file):
    """ik's row-interleaved q4_0_r8 of the experts is the lossless q4_0, shuffled as repack does it."""
    from quantkit.formats import interleave
    out = tmp_path / "r8.gguf"
    quantkit.quantize_model(kimi[0], out, "f32", custom_q=r"ffn_(gate|up|down)_exps\.weight=q4_0_r8")
    with open_model(out) as g, open_model(q4x_file) as plain:
        for name in ("blk.1.ffn_up_exps.weight", "blk.2.ffn_down_exps.weight"):
            t, p = g.by_name[name], plain.by_name[name]
            assert t.qtype == QuantType.Q4_0_R8
            assert np.array_equal(t.raw(), interleave.interleave(p.raw().copy(), QuantType.Q4_0_R8, p.shape[0]))


def test_q4_0_file_runs_like_transformers(q4x_file, reference):
    """The lossless q4_0 experts compute transformers' logits: in our runtime (with float products, its
    batch products decode the blocks to float32; an f32 cache) to float precision (measured 8.5e-7);
    in the wheel, whose q4_0 products round the activations to q8_0 first (ggml's vec_dot_type), as
    our default products do, within that rounding (measured 6.0e-3), same top tokens."""
    assert_close(our_logits(q4x_file, ops_cpu.float_products, "f32"), reference, "numba, f32 cache", tol=1e-5)
    if peers.llama_quantize_bin() is not None:
        assert_close(ik_logits(q4x_file), reference, "ik wheel", tol=1e-2)


def _edit(src, dst, config=None, tensors=None):
    import os

    from safetensors.torch import load_file, save_file
    # hard links where the weights stay as they are (nothing here writes an input)
    shutil.copytree(src, dst, copy_function=shutil.copy2 if tensors is not None else os.link)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").unlink()             # a hard link to the fixture's
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_scale_not_exact_in_fp16_refuses_q4_0(tmp_path, kimi):
    """A group scale float16 cannot hold (2^-30: below its subnormals) is decoded exactly to F32, but
    refused for q4_0 in one line naming the tensor, the row and the scale, leaving no output."""
    name = "model.layers.2.mlp.experts.5.down_proj.weight_scale"

    def tiny_scale(t):
        s = t[name].clone()
        s[3, 1] = 2.0 ** -30
        t[name] = s
    d = _edit(kimi[0], tmp_path / "m", tensors=tiny_scale)
    out = tmp_path / "out.gguf"
    snap = Snapshot(d)
    rc, stdout, stderr = run_cli("quantize", d, out, "f32", "--custom-q", "exps=q4_0")
    assert_refused(rc, stdout, stderr, "blk.2.ffn_down_exps.weight", f"row {5 * 64 + 3}", "not exactly a float16")
    snap.assert_unchanged()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]        # no output, no temporary file
    with open_hf(d) as m:
        rows = m.by_name["blk.2.ffn_down_exps.weight"].source.lazy.rows(5 * 64 + 3, 5 * 64 + 4)
    q, _ = kimi[2]["model.layers.2.mlp.experts.5.down_proj.weight"]
    assert np.array_equal(rows[0, 32:64], q[3, 32:64].astype(np.float32) * np.float32(2.0 ** -30))


# ---- what is refused ----

def _group(cfg):
    return cfg["quantization_config"]["config_groups"]["group_0"]


SCHEMES = [
    (lambda c: _group(c)["weights"].update(num_bits=8), "weights.num_bits 8"),
    (lambda c: _group(c)["weights"].update(group_size=128), "weights.group_size 128"),
    (lambda c: _group(c)["weights"].update(symmetric=False), "weights.symmetric false"),
    (lambda c: _group(c)["weights"].update(strategy="channel"), 'weights.strategy "channel"'),
    (lambda c: _group(c)["weights"].update(type="float"), 'weights.type "float"'),
    (lambda c: _group(c)["weights"].update(actorder="group"), 'weights.actorder "group"'),
    (lambda c: _group(c)["weights"].update(dynamic=True), "weights.dynamic true"),
    (lambda c: _group(c).update(input_activations={"num_bits": 8}), "input_activations"),
    (lambda c: c["quantization_config"].update(format="int-quantized"), 'format "int-quantized"'),
    (lambda c: c["quantization_config"].update(quantization_status="frozen"), 'quantization_status "frozen"'),
    (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (lambda c: c["quantization_config"]["config_groups"].update(group_1=copy.deepcopy(_group(c))), "2 groups"),
    (lambda c: c["quantization_config"].update(config_groups={}), "0 groups"),
]


@pytest.mark.parametrize("edit, needle", SCHEMES, ids=[n for _, n in SCHEMES])
def test_other_schemes_are_refused(tmp_path, kimi, edit, needle):
    d = _edit(kimi[0], tmp_path / "m", config=edit)
    with pytest.raises(QuantkitError) as e:
        open_hf(d)
    assert needle in str(e.value) and "not supported" in str(e.value) and "\n" not in str(e.value), str(e.value)


P = "model.layers.1.mlp.experts.0.up_proj.weight"


def _set(name, value):
    def edit(t):
        t[name] = value
    return edit


TENSORS = [
    (_set(P + "_shape", torch.tensor([64, 32])), "says [64, 32] but config.json implies [64, 64]"),
    (_set(P + "_shape", torch.tensor([64, 64, 1])), "I64 [3]"),
    (_set(P + "_packed", torch.zeros(64, 4, dtype=torch.int32)), "I32 [64, 4]"),
    (_set(P + "_packed", torch.zeros(64, 8, dtype=torch.int64)), "I64 [64, 8]"),
    (_set(P + "_scale", torch.ones(64, 1, dtype=torch.bfloat16)), "BF16 [64, 1]"),
    (_set(P + "_scale", torch.ones(64, 2, dtype=torch.int32)), "I32 [64, 2]"),
    (lambda t: t.pop(P + "_scale"), f"has no {P}_scale"),
    (lambda t: t.pop(P + "_packed"), f"tensor '{P}' is missing"),
    (_set(P + "_zero_point", torch.zeros(8, 2, dtype=torch.int32)), f"cannot map tensor '{P}_zero_point'"),
]


@pytest.mark.parametrize("edit, needle", TENSORS, ids=[n for _, n in TENSORS])
def test_bad_packed_tensors_are_refused(tmp_path, kimi, edit, needle):
    d = _edit(kimi[0], tmp_path / "m", tensors=edit)
    with pytest.raises(QuantkitError) as e:
        open_hf(d)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_packed_tensors_without_the_config_are_refused(tmp_path, kimi):
    """Without Kimi's quantization_config the packed tensors are not read as weights."""
    d = _edit(kimi[0], tmp_path / "m", config=lambda c: c.pop("quantization_config"))
    with pytest.raises(QuantkitError) as e:
        open_hf(d)
    assert "missing from the checkpoint" in str(e.value)


def test_q4_x(tmp_path, kimi, q4x_file, reference):
    """TYPE Q4_X, the published Kimi quant (= TYPE Q8_0 with recipes/kimi-k2-q4_x.txt): the routed
    experts are the same lossless q4_0 blocks, attention, shared experts, the dense layer and the
    embeddings q8_0; the wheel loads and runs it, computing what our runtime computes from it."""
    from quantkit.mixes import Q4_X
    from quantkit.presets import type_label
    from quantkit.recipes import load_recipe
    recipe = H.Path(__file__).parent.parent / "recipes" / "kimi-k2-q4_x.txt"
    assert [(r.pattern, r.qtype) for r in load_recipe([str(recipe)]).rules] == \
        [(r.pattern, r.qtype) for r in load_recipe([Q4_X.rules]).rules]
    assert type_label("q4_x", "ik") == "Q4_X"         # `quantize IN Q4_X` writes ggml-model-Q4_X.gguf
    plan = {t["name"]: t for t in quantkit.plan_quantize(kimi[0], "Q4_X").to_json()["tensors"]}
    assert "int4 groups copied (lossless)" in " ".join(plan["blk.1.ffn_down_exps.weight"]["notes"])
    out, by_recipe = tmp_path / "Q4_X.gguf", tmp_path / "recipe.gguf"
    quantkit.quantize_model(kimi[0], out, "Q4_X")
    quantkit.quantize_model(kimi[0], by_recipe, "Q8_0", custom_q=recipe)
    with open_model(out) as g, open_model(q4x_file) as lossless, open_model(by_recipe) as r:
        assert [(t.name, t.qtype) for t in g.tensors] == [(t.name, t.qtype) for t in r.tensors]
        assert all(np.array_equal(t.raw(), r.by_name[t.name].raw()) for t in g.tensors)
        types = {t.name: t.qtype for t in g.tensors}
        for name, t in g.by_name.items():
            if "_exps." in name:
                assert t.qtype == QuantType.Q4_0 and np.array_equal(t.raw(), lossless.by_name[name].raw())
        for name in ("token_embd.weight", "output.weight", "blk.0.ffn_down.weight", "blk.1.ffn_up_shexp.weight",
                     "blk.1.attn_q_b.weight", "blk.2.attn_output.weight"):
            assert types[name] == QuantType.Q8_0, name
        assert types["blk.1.ffn_gate_inp.weight"] == QuantType.F32
    if peers.llama_quantize_bin() is not None:
        ik, ours = ik_logits(out).reshape(reference.shape), our_logits(out, ops_cpu)
        # q8_0 attention moves this tiny random model's logits by 8e-2 x max|logit| from transformers'
        # (ours); the wheel also rounds activations to q8_0: most positions stay within 0.1 of ours,
        # 3 of 64 move by up to 0.9 (measured; top-k routing near ties, presumably), same top token 97%
        assert np.isfinite(ik).all() and (ik.argmax(1) == ours.argmax(1)).mean() >= 0.9
        assert np.median(np.abs(ik - ours).max(1)) <= 0.05 * np.abs(ours).max()


def test_q4_x_from_a_gguf_says_it_quantizes(tmp_path, kimi, caplog):
    """From an input that does not hold the int4 groups (here a GGUF) Q4_X's experts are quantized by
    llama.cpp's q4_0 quantizer, and the run says so."""
    f32 = tmp_path / "f32.gguf"
    quantkit.quantize_model(kimi[0], f32, "f32")
    with caplog.at_level("WARNING", logger="quantkit"):
        plan = quantkit.plan_quantize(f32, "Q4_X")
    assert "blk.1.ffn_gate_exps.weight and 5 more are f32 in the input, not compressed-tensors int4" in caplog.text
    assert not any(t["notes"] for t in plan.to_json()["tensors"] if "_exps" in t["name"])
