"""`quantkit quantize HF_DIR OUT`: Hugging Face checkpoints converted and quantized in one pass.

The references are real: tiny models saved by transformers (their logits computed by transformers),
ik_llama.cpp's wheel loading and running our files, the shipped SmolLM2 GGUF (made by
convert_hf_to_gguf.py) for the tokenizer arrays, the tokenizers library for tokenization, and torch
for the float8 and bfloat16 conversions.  quantkit converts through the library
(quantkit.quantize_model / plan_quantize, in-process); broken checkpoints are refused in one line
(a QuantkitError), which the CLI prints.
"""
from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_models as H  # noqa: E402
import peers  # noqa: E402
import quantkit  # noqa: E402
from conftest import smollm2_file  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.hf import open_hf  # noqa: E402
from quantkit.formats.floats import fp32_to_bf16_bits  # noqa: E402
from quantkit.hf.numerics import E4M3FN  # noqa: E402

TEXTS = ["The capital of France is Paris.", "  two  spaces, digits 12345 and 3.14159\n\nnew lines\t tabs",
         "naïve café — ünïcödé 日本語 😀", "<|im_start|>user\nHi!<|im_end|>"]
# a 64-token prompt: SmolLM2 ids of a sentence, repeated
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 355, 6135, 42, 30, 216, 9, 3113] * 4
# llama-perplexity's KLD/logit tolerance the issue sets for F32: 2e-3 x max |logit|
TOL = 2e-3
MIX = "attn_.*=q8_0,ffn_down.*=q6_K,ffn_.*_exps=iq4_k,ffn_.*=q4_K,token_embd=q4_K"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tok_meta):
    return H.save_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", tok_meta)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tok_meta):
    d = H.save_deepseek_v3(tmp_path_factory.mktemp("hf") / "tiny-dsv3", tok_meta)
    # DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last block: not converted
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _convert(src, out, qtype=None, **options):
    quantkit.quantize_model(src, out, qtype, **options)
    return out


def _close(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


# ---- llama ----

def test_llama_f32_matches_transformers_in_ik(tmp_path, llama_dir):
    out = _convert(llama_dir, tmp_path / "f32.gguf", "f32")
    ref = H.hf_logits(llama_dir, PROMPT)
    ik = np.asarray(peers.ik_logits(out, PROMPT, all_positions=True)).reshape(ref.shape)
    assert _close(ik, ref) <= TOL
    assert (ik.argmax(1) == ref.argmax(1)).all()


def test_llama_tokenizer_is_the_converters(llama_dir):
    """The vocabulary arrays equal the shipped SmolLM2 GGUF's, which convert_hf_to_gguf.py wrote from
    the original tokenizer.json."""
    with open_model(smollm2_file()) as ref, open_hf(llama_dir) as ours:
        for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                    "tokenizer.chat_template"):
            assert ours.get(key) == ref.get(key), key
        assert list(ours.get("tokenizer.ggml.token_type")) == list(ref.get("tokenizer.ggml.token_type"))


def test_merges_in_pair_format(tmp_path, tok_meta):
    """tokenizer.json files from transformers >= 4.45 store merges as [a, b] pairs."""
    H.write_tokenizer(tmp_path, tok_meta, merges_as_pairs=True)
    from quantkit.hf.config import Fields
    from quantkit.hf.vocab import vocab_metadata
    meta = vocab_metadata(tmp_path, None, Fields({}, "config.json"))
    assert meta["tokenizer.ggml.merges"].value == list(tok_meta["tokenizer.ggml.merges"])


def test_llama_tokenizes_like_transformers_in_ik(tmp_path, llama_dir):
    from tokenizers import Tokenizer
    out = _convert(llama_dir, tmp_path / "f32.gguf", "f32")
    hf = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for text in TEXTS:
        assert peers.ik_tokenize(out, text, add_bos=False, special=True) == hf.encode(text).ids, text


def test_llama_tied_embeddings_write_no_output(tmp_path, tok_meta):
    d = H.save_llama(tmp_path / "tied", tok_meta, tie=True, n_layer=1)
    out = _convert(d, tmp_path / "f32.gguf", "f32")
    with open_model(out) as g:
        assert "output.weight" not in g.by_name
    ref = H.hf_logits(d, PROMPT[:16])
    ik = np.asarray(peers.ik_logits(out, PROMPT[:16], all_positions=True)).reshape(ref.shape)
    assert _close(ik, ref) <= TOL


def test_llama3_rope_scaling_writes_rope_freqs(tmp_path, tok_meta):
    """Llama 3.1's rope scaling becomes the converter's rope_freqs tensor: per frequency, the divisor
    transformers applies (its inv_freq against the unscaled one).  The logits are not compared: the
    ik_llama.cpp 0.1.5 wheel loads rope_freqs for llama but does not apply it (its logits equal the
    unscaled model's)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 100000.0}
    d = H.save_llama(tmp_path / "l3", tok_meta, n_layer=1, rope_scaling=rope)
    out = _convert(d, tmp_path / "f32.gguf", "f32")
    from transformers import AutoModelForCausalLM
    inv_freq = AutoModelForCausalLM.from_pretrained(d).model.rotary_emb.inv_freq.float()
    plain = 1.0 / (100000.0 ** (torch.arange(0, 16, 2).float() / 16))
    with open_model(out) as g:
        ours = g.by_name["rope_freqs.weight"].raw().view(np.float32).reshape(-1)
    np.testing.assert_allclose(ours, (plain / inv_freq).numpy(), rtol=1e-6)
    assert len(set(np.round(ours, 4))) > 2          # 1, the blend and the factor all occur
    assert np.isfinite(np.asarray(peers.ik_logits(out, PROMPT[:8]))).all()


def test_one_step_equals_convert_then_quantize(tmp_path, llama_dir):
    """HF -> mixed quant in one pass gives the bytes of HF -> F32 GGUF -> mixed quant."""
    one = _convert(llama_dir, tmp_path / "one.gguf", "q4_0", custom_q=MIX)
    f32 = _convert(llama_dir, tmp_path / "f32.gguf", "f32")
    two = _convert(f32, tmp_path / "two.gguf", "q4_0", custom_q=MIX)
    assert filecmp.cmp(one, two, shallow=False)
    logits = np.asarray(peers.ik_logits(one, PROMPT[:16]))
    assert np.isfinite(logits).all()


def test_bf16_checkpoint_streams_as_bf16(tmp_path, tok_meta):
    d = H.save_llama(tmp_path / "bf", tok_meta, n_layer=1, dtype="bfloat16")
    with open_hf(d) as m:
        assert m.by_name["blk.0.attn_q.weight"].qtype.name == "BF16"
        assert m.by_name["blk.0.attn_norm.weight"].qtype.name == "F32"      # 1-D: F32, as the converter
    one = _convert(d, tmp_path / "one.gguf", "q8_0")
    bf16 = _convert(d, tmp_path / "bf16.gguf", "bf16")
    two = _convert(bf16, tmp_path / "two.gguf", "q8_0")
    assert filecmp.cmp(one, two, shallow=False)


# ---- DeepSeek-V3 ----

def test_deepseek_v3_f32_matches_transformers_in_ik(tmp_path, deepseek_dir):
    out = _convert(deepseek_dir, tmp_path / "f32.gguf", "f32")
    with open_model(out) as g:
        names = set(g.by_name)
        assert {"blk.0.attn_kv_b.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight",
                "blk.1.ffn_gate_exps.weight", "blk.1.exp_probs_b.bias"} <= names
        assert not any(n.startswith("blk.3.") for n in names)          # the MTP layer
        assert g.by_name["blk.1.ffn_down_exps.weight"].shape == (32, 64, 4)
        assert g.by_name["blk.0.attn_k_b.weight"].shape == (16, 4 * 16)
        assert g.get("deepseek2.expert_gating_func") == 2
        # the split halves, as ik's converter makes them with torch: kv_b viewed per head, the key band
        # transposed to (n_head * kv_lora, qk_nope), the value band (n_head * v_head, kv_lora)
        from safetensors.torch import load_file
        kv_b = load_file(str(deepseek_dir / "model.safetensors"))["model.layers.0.self_attn.kv_b_proj.weight"]
        k_b, v_b = torch.split(kv_b.view(4, 16 + 16, 16), [16, 16], dim=1)
        assert (g.by_name["blk.0.attn_k_b.weight"].raw().view(np.float32).reshape(-1)
                == k_b.transpose(1, 2).reshape(-1).numpy()).all()
        assert (g.by_name["blk.0.attn_v_b.weight"].raw().view(np.float32).reshape(-1)
                == v_b.reshape(-1).numpy()).all()
    # ik's contexts compute MLA attention from attn_k_b/attn_v_b
    ref = H.hf_logits(deepseek_dir, PROMPT)
    ik = np.asarray(peers.ik_logits(out, PROMPT, all_positions=True)).reshape(ref.shape)
    assert _close(ik, ref) <= TOL
    assert (ik.argmax(1) == ref.argmax(1)).all()


def test_deepseek_v3_yarn_matches_transformers_in_ik(tmp_path, tok_meta):
    """DeepSeek-V3 ships YaRN rope scaling (mscale_all_dim -> yarn_log_multiplier); a 64-token prompt
    on a 16-token original context exercises it."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    d = H.save_deepseek_v3(tmp_path / "yarn", tok_meta, n_layer=2, rope_scaling=rope, n_ctx=64)
    out = _convert(d, tmp_path / "f32.gguf", "f32")
    with open_model(out) as g:
        assert g.get("deepseek2.rope.scaling.type") == "yarn"
        assert g.get("deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    ref = H.hf_logits(d, PROMPT)
    ik = np.asarray(peers.ik_logits(out, PROMPT, all_positions=True)).reshape(ref.shape)
    assert _close(ik, ref) <= TOL


def test_deepseek_v2_lite_matches_transformers_in_ik(tmp_path, tok_meta):
    d = H.save_deepseek_v2_lite(tmp_path / "v2", tok_meta)
    out = _convert(d, tmp_path / "f32.gguf", "f32")
    with open_model(out) as g:
        assert "blk.0.attn_q.weight" in g.by_name and "blk.0.attn_q_a.weight" not in g.by_name
        assert g.get("deepseek2.expert_gating_func") == 1 and g.get("deepseek2.expert_weights_norm") is False
    ref = H.hf_logits(d, PROMPT[:32])
    ik = np.asarray(peers.ik_logits(out, PROMPT[:32], all_positions=True)).reshape(ref.shape)
    assert _close(ik, ref) <= TOL


def test_deepseek_v3_recipe_loads_and_computes(tmp_path, deepseek_dir):
    recipe = (H.Path(__file__).parent.parent / "recipes" / "deepseek-v3-iq2_k_r4.txt")
    one = _convert(deepseek_dir, tmp_path / "one.gguf", custom_q=recipe)
    f32 = _convert(deepseek_dir, tmp_path / "f32.gguf", "f32")
    two = _convert(f32, tmp_path / "two.gguf", custom_q=recipe)
    assert filecmp.cmp(one, two, shallow=False)
    with open_model(one) as g:
        assert g.by_name["blk.1.ffn_up_exps.weight"].qtype.name != "F32"
    logits = np.asarray(peers.ik_logits(one, PROMPT[:16]))
    assert np.isfinite(logits).all()


def test_fp8_checkpoint_equals_its_bf16_twin(tmp_path, tok_meta):
    """DeepSeek's FP8 checkpoint (128x128 block scales; sizes that leave partial blocks) gives the GGUF
    of the BF16 checkpoint fp8_cast_bf16.py makes from it, in F32 and quantized."""
    src = H.save_deepseek_v3(tmp_path / "src", tok_meta, n_layer=2, n_embd=192, n_ff=320, n_ff_exp=136,
                             q_lora=160, kv_lora=144, qk_nope=32, qk_rope=16, v_head=32)
    H.save_fp8_pair(src, tmp_path / "fp8" / "m", tmp_path / "bf16" / "m")
    with open_hf(tmp_path / "fp8" / "m") as m:
        assert m.by_name["blk.1.ffn_gate_exps.weight"].qtype.name == "BF16"
    for qtype, options in (("f32", {}), ("q4_0", {"custom_q": MIX})):
        a = _convert(tmp_path / "fp8" / "m", tmp_path / "a.gguf", qtype, **options)
        b = _convert(tmp_path / "bf16" / "m", tmp_path / "b.gguf", qtype, **options)
        assert filecmp.cmp(a, b, shallow=False), qtype


# ---- element conversions against torch ----

def test_e4m3fn_table_matches_torch():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(ref)
    assert (np.isnan(E4M3FN) == nan).all()
    assert (E4M3FN[~nan].view(np.uint32) == ref[~nan].view(np.uint32)).all()


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
                        np.array([0.0, -0.0, 1e-45, 3.4e38, -3.4e38, np.inf, -np.inf], np.float32)]).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (fp32_to_bf16_bits(x) == ref).all()


# ---- pre-tokenizer detection ----

def _pre_for(tmp_path, tok_meta, pre_tokenizer, ignore_merges=False):
    H.write_tokenizer(tmp_path, tok_meta)
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    doc["pre_tokenizer"] = pre_tokenizer
    doc["model"]["ignore_merges"] = ignore_merges
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("clean_up_tokenization_spaces")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))


LLAMA3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
                                  "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
DEEPSEEK_V3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, "behavior": "Isolated",
     "invert": False},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}"
                                  "\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.mark.parametrize("pre, name, ignore_merges", [(LLAMA3_PRE, "llama-bpe", True),
                                                      (DEEPSEEK_V3_PRE, "deepseek-v3", False)])
def test_pre_tokenizer_detected_and_tokenizes_alike(tmp_path, tok_meta, llama_dir, pre, name, ignore_merges):
    """Llama 3's and DeepSeek-V3's pre-tokenizers (their tokenizer.json sections) get llama.cpp's
    names, and ik_llama.cpp then splits text as the tokenizers library does."""
    from tokenizers import Tokenizer
    d = tmp_path / "m"
    d.mkdir()
    for f in llama_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (d / f.name).symlink_to(f)
    _pre_for(d, tok_meta, pre, ignore_merges)
    with open_hf(d) as m:
        assert m.get("tokenizer.ggml.pre") == name
    out = _convert(d, tmp_path / "f32.gguf", "f32")
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS:
        assert peers.ik_tokenize(out, text, add_bos=False, special=True) == hf.encode(text).ids, text


# ---- errors: one line, non-zero exit, no output ----

def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _bad_unmapped(d):
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(t, str(d / "model.safetensors"))


def _bad_missing_shard(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _bad_fp8_without_scale(d):
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize("breakage, needle", [
    (lambda d: _edit_config(d, architectures=["GPTNeoXForCausalLM"]), "architecture 'GPTNeoXForCausalLM'"),
    (lambda d: _edit_config(d, hidden_size=96), "implies"),
    (lambda d: _edit_config(d, num_hidden_layers=3), "missing from the checkpoint"),
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    (_bad_unmapped, "cannot map tensor 'model.layers.0.self_attn.q_norm.weight'"),
    (_bad_missing_shard, "missing shard model-00002-of-00002.safetensors"),
    (_bad_fp8_without_scale, "no model.layers.0.mlp.up_proj.weight_scale_inv"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}"),
     "not valid JSON"),
    (lambda d: _edit_config(d, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
     "weight_block_size"),
])
def test_bad_checkpoints_fail_cleanly(tmp_path, llama_dir, breakage, needle):
    d = _copy(llama_dir, tmp_path / "m")
    breakage(d)
    out = tmp_path / "out.gguf"
    with pytest.raises(QuantkitError) as e:
        quantkit.quantize_model(d, out, "q8_0")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]       # no temporary file left behind


def test_lazy_source_serves_any_byte_range(deepseek_dir):
    """The quantize pipeline reads copies in 1 MiB parts that need not fall on row boundaries."""
    rng = np.random.default_rng(0)
    with open_hf(deepseek_dir) as m:
        for name in ("blk.1.ffn_down_exps.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"):
            info = m.by_name[name]
            whole = info.source.read(0, info.nbytes)
            for _ in range(20):
                a = int(rng.integers(0, info.nbytes))
                n = int(rng.integers(0, info.nbytes - a + 1))
                assert (info.source.read(a, n) == whole[a:a + n]).all()


def test_dry_run_plans_the_converted_tensors(tmp_path, deepseek_dir):
    plan = quantkit.plan_quantize(deepseek_dir, custom_q="exps=iq4_k").to_json()
    by_name = {t["name"]: t for t in plan["tensors"]}
    assert by_name["blk.1.ffn_up_exps.weight"]["requested"] == "iq4_k"     # rows of 64: a fallback type
    assert by_name["blk.1.ffn_up_exps.weight"]["shape"] == [64, 32, 4]
    assert by_name["blk.0.attn_q_b.weight"]["target"] == "f32"        # no rule: kept as stored
    assert len(by_name) == 3 + 14 + 2 * 19                            # DeepSeek's layout: 3 + 14/dense + 19/MoE
    assert not (tmp_path / "x.gguf").exists()


def test_fp8_kernel_equals_its_numpy_twin():
    from quantkit.hf.numerics import fp8_block_rows
    from quantkit.kernels.floats import fp8_blocks_to_bf16_rows
    rng = np.random.default_rng(3)
    q = rng.integers(0, 256, (300, 260), dtype=np.uint8)          # every code, NaNs included
    scale = (rng.random((3, 3)) * 1e-2).astype(np.float32)
    rows = np.arange(300)[::-1].copy()
    got = np.empty(q.shape, np.uint16)
    fp8_blocks_to_bf16_rows(q, scale, rows, E4M3FN, got)
    want = fp8_block_rows(q, scale, rows)
    assert (got == want).all()
