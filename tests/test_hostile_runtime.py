"""Hostile and careless inputs to the runtime (run, perplexity, imatrix): each must end in a one-line
QuantkitError that names what is wrong, before any numba kernel runs, never in a crash, an
``internal error`` or a silently wrong result.

* every hyperparameter the runtime reads (llama and deepseek2), rewritten to a bad value in a tiny
  model: the model is refused at load, naming the key (in-process: only ``Model()`` is built);
* every weight the forward pass uses, given a wrong shape: refused naming the tensor;
* the tokenizer metadata (token list, types, scores, merges, special ids, flags);
* a few through the real CLI, where the refusal contract itself (exit 1, one line, input
  unchanged, no output file) is what is tested: rope dims beyond the head size made the rope
  kernel write out of bounds (glibc abort, segfault, or rc 0 with corrupted numbers).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from hostile import Snapshot, assert_refused, run_cli
from models import rewrite_gguf, write_deepseek2, write_llama
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.runtime.model import Model

T = gguf.GGUFValueType
L, D = "llama.", "deepseek2."
# a tiny llama: head size 16, 2 KV heads of 4 query heads, a tokenizer (so the CLI can run it)
LLAMA = dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, vocab=True)
# a tiny DeepSeek-V3 layout: q_lora 32, kv_lora 32, heads of 16 + 8 rope dims, values of 16, 4 experts
DEEPSEEK = dict(n_layer=3, n_dense=1, n_embd=64, n_ff=128, n_ff_exp=32, n_expert=4, n_expert_used=2, n_shared=1,
                n_head=2, q_lora_rank=32, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, n_vocab=320)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile-runtime")
    return {"llama": write_llama(d / "llama.gguf", **LLAMA),
            "deepseek2": write_deepseek2(d / "deepseek2.gguf", **DEEPSEEK),
            "fused": write_deepseek2(d / "fused.gguf", fused_kv_b=True, **DEEPSEEK),
            "yarn": write_deepseek2(d / "yarn.gguf", yarn=dict(factor=4.0, original_context_length=64,
                                                                  log_multiplier=0.1), **DEEPSEEK)}


def refused(path, *needles) -> str:
    with open_model(path) as g:
        with pytest.raises(QuantkitError) as e:
            Model(g)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def rng_weights(*np_shape):
    return (np.random.default_rng(1).standard_normal(np_shape) * 0.02).astype(np.float32)


def test_the_base_models_load(base):
    """The variants below change one thing each in these, which load."""
    for path in base.values():
        with open_model(path) as g:
            Model(g)


# (key, value, words the error must hold besides the key)
LLAMA_KEYS = [
    ("rope.dimension_count", 18, "at most 16"),        # beyond the head: the rope kernel wrote out of bounds
    ("rope.dimension_count", 66, "head size"),
    ("rope.dimension_count", 15, "even"),
    ("rope.dimension_count", 0, "at least 2"),
    ("rope.dimension_count", ("16", T.STRING), "integer"),
    ("attention.head_count", 0, "at least 1"),
    ("attention.head_count", 3, "must divide"),         # head_count_kv 2 does not divide 3
    ("attention.head_count", 2, "attn_k.weight"),       # 2 heads of 32: the K matrix has the wrong rows
    ("attention.head_count", ([4, 8], T.ARRAY), "per-layer"),
    ("attention.head_count", (4.0, T.FLOAT32), "integer"),
    ("attention.head_count_kv", 3, "must divide"),
    ("attention.head_count_kv", 0, "at least 1"),
    ("attention.head_count_kv", 1, "attn_k.weight"),
    ("attention.key_length", 20, "attn_q.weight"),
    ("attention.key_length", 0, "at least 1"),
    ("attention.value_length", 8, "differs from the key length"),
    ("embedding_length", 128, "token_embd.weight"),
    ("embedding_length", 0, "at least 1"),
    ("embedding_length", 66, "does not divide"),        # 4 heads, no key_length
    ("vocab_size", 1000, "320 rows"),
    ("block_count", 3, "layers 0..1"),
    ("block_count", 1, "layers 0..1"),
    ("block_count", 0, "at least 1"),
    ("block_count", -1, "at least 1"),
    ("context_length", 0, "at least 1"),
    ("context_length", None, "missing"),
    ("attention.layer_norm_rms_epsilon", float("nan"), "finite"),
    ("attention.layer_norm_rms_epsilon", float("inf"), "finite"),
    ("attention.layer_norm_rms_epsilon", 0.0, "greater than 0"),
    ("attention.layer_norm_rms_epsilon", -1e-5, "greater than 0"),
    ("attention.layer_norm_rms_epsilon", 10.0, "less than 1"),
    ("attention.layer_norm_rms_epsilon", ("1e-5", T.STRING), "number"),
    ("attention.layer_norm_rms_epsilon", None, "missing"),
    ("rope.freq_base", 0.0, "greater than 0"),
    ("rope.freq_base", float("nan"), "finite"),
    ("rope.freq_base", -10000.0, "greater than 0"),
    ("rope.scaling.type", "yarn", "not supported"),
    ("rope.scaling.type", (3, T.UINT32), "string"),
    ("rope.scaling.factor", -2.0, "at least 0"),
    ("rope.scaling.factor", float("nan"), "finite"),
    ("rope.scaling.factor", 1e-30, "between"),
]


@pytest.mark.parametrize("key, value, words", LLAMA_KEYS, ids=[f"{k}={v!r}" for k, v, _ in LLAMA_KEYS])
def test_llama_hyperparameter(base, tmp_path, key, value, words):
    keys = {L + key: value}
    if key == "rope.scaling.factor":
        keys[L + "rope.scaling.type"] = "linear"
    path = rewrite_gguf(base["llama"], tmp_path / "bad.gguf", keys)
    msg = refused(path, words)
    assert L + key in msg or words.endswith(".weight"), msg


def test_llama_architecture_and_token_list(base, tmp_path):
    refused(rewrite_gguf(base["llama"], tmp_path / "arch.gguf", {"general.architecture": "gpt-oss"}),
            "'gpt-oss'", "not supported")
    tokens = gguf.GGUFReader(str(base["llama"])).fields["tokenizer.ggml.tokens"].contents()
    refused(rewrite_gguf(base["llama"], tmp_path / "tokens.gguf", {"tokenizer.ggml.tokens": tokens[:-1]}),
            "tokenizer.ggml.tokens", "319 tokens", "320 rows")
    refused(rewrite_gguf(base["llama"], tmp_path / "tokens2.gguf", {"tokenizer.ggml.tokens": ([1, 2], T.ARRAY)}),
            "tokenizer.ggml.tokens", "array of strings")


E, FF, V = LLAMA["n_embd"], LLAMA["n_ff"], LLAMA["n_vocab"]
# (tensor, a replacement of the wrong shape, in numpy order)
LLAMA_TENSORS = [
    ("blk.0.attn_q.weight", (E + 16, E)),           # more rows than heads * head size
    ("blk.1.attn_k.weight", (16, E)),
    ("blk.0.attn_v.weight", (32, E + 32)),          # rows longer than n_embd
    ("blk.1.attn_output.weight", (E, 32)),
    ("blk.0.ffn_up.weight", (FF + 32, E)),          # differs from ffn_gate
    ("blk.1.ffn_down.weight", (E, FF * 2)),
    ("blk.0.ffn_gate.weight", (2, FF, E)),          # 3-D where a matrix belongs
    ("blk.0.attn_norm.weight", (E - 1,)),
    ("blk.1.ffn_norm.weight", (2, E)),
    ("output_norm.weight", (E * 2,)),
    ("output.weight", (V - 1, E)),
    ("token_embd.weight", (V, E + 32)),
    ("blk.0.attn_q.bias", (10,)),                   # a bias must match its matrix's rows
    ("blk.1.ffn_down.bias", (E + 1,)),
]


@pytest.mark.parametrize("name, shape", LLAMA_TENSORS, ids=[n for n, _ in LLAMA_TENSORS])
def test_llama_weight_shape(base, tmp_path, name, shape):
    path = rewrite_gguf(base["llama"], tmp_path / "bad.gguf", tensors={name: rng_weights(*shape)})
    refused(path, f"tensor '{name}'", "expected")


def test_llama_missing_weight(base, tmp_path):
    refused(rewrite_gguf(base["llama"], tmp_path / "a.gguf", tensors={"blk.1.attn_v.weight": None}),
            "'blk.1.attn_v.weight' is missing")
    refused(rewrite_gguf(base["llama"], tmp_path / "b.gguf", tensors={"token_embd.weight": None}),
            "'token_embd.weight' is missing")


DEEPSEEK_KEYS = [
    # (variant, key, value, words)
    ("deepseek2", "rope.dimension_count", 24, "less than the head size"),    # no dims left without rope
    ("deepseek2", "rope.dimension_count", 40, "at most 23"),
    ("deepseek2", "rope.dimension_count", 7, "even"),
    ("deepseek2", "rope.dimension_count", None, "missing"),
    ("deepseek2", "attention.head_count", 4, "attn_q_b.weight"),
    ("deepseek2", "attention.head_count", 0, "at least 1"),
    ("deepseek2", "attention.head_count_kv", 3, "must be 1 or"),
    ("deepseek2", "attention.q_lora_rank", 16, "attn_q_a.weight"),
    ("deepseek2", "attention.kv_lora_rank", 16, "kv_lora_rank"),
    ("deepseek2", "attention.kv_lora_rank", 0, "at least 1"),
    ("deepseek2", "attention.key_length", 64, "latent cache"),
    ("deepseek2", "attention.value_length", 64, "latent cache"),
    ("deepseek2", "attention.key_length_mla", 28, "attn_q_b.weight"),
    ("deepseek2", "attention.value_length_mla", 8, "attn_v_b.weight"),
    ("deepseek2", "attention.value_length_mla", 0, "at least 1"),
    ("fused", "attention.key_length", 28, "attn_q_b.weight"),
    ("fused", "attention.value_length", 32, "attn_kv_b.weight"),
    ("fused", "attention.key_length", None, "missing"),
    ("deepseek2", "expert_count", 0, "at least 1"),
    ("deepseek2", "expert_count", 8, "ffn_gate_inp.weight"),
    ("deepseek2", "expert_used_count", 5, "at most 4"),
    ("deepseek2", "expert_used_count", 0, "at least 1"),
    ("deepseek2", "expert_shared_count", -1, "at least 0"),
    ("deepseek2", "leading_dense_block_count", 4, "at most 3"),
    ("deepseek2", "leading_dense_block_count", 2, "layer 1 is an expert layer"),
    ("deepseek2", "leading_dense_block_count", 0, "layer 0 is a dense layer"),
    ("deepseek2", "expert_gating_func", 3, "not supported"),
    ("deepseek2", "expert_weights_scale", float("nan"), "finite"),
    ("deepseek2", "expert_weights_scale", 0.0, "greater than 0"),
    ("deepseek2", "expert_weights_norm", (1, T.UINT32), "bool"),
    ("deepseek2", "expert_group_count", 3, "does not divide"),
    ("deepseek2", "attention.layer_norm_rms_epsilon", float("inf"), "finite"),
    ("deepseek2", "rope.freq_base", 0.0, "greater than 0"),
    ("deepseek2", "rope.scaling.type", "longrope", "not supported"),
    ("yarn", "rope.scaling.factor", 0.5, "at least 1"),
    ("yarn", "rope.scaling.factor", float("inf"), "finite"),
    ("yarn", "rope.scaling.original_context_length", 0, "at least 1"),
    ("yarn", "rope.scaling.yarn_log_multiplier", float("nan"), "finite"),
    ("yarn", "rope.scaling.attn_factor", 0.0, "greater than 0"),
    ("yarn", "rope.freq_base", 1.0, "YaRN"),
    ("deepseek2", "context_length", 0, "at least 1"),
    ("deepseek2", "vocab_size", 321, "320 rows"),
]


@pytest.mark.parametrize("variant, key, value, words", DEEPSEEK_KEYS,
                         ids=[f"{v}-{k}={x!r}" for v, k, x, _ in DEEPSEEK_KEYS])
def test_deepseek2_hyperparameter(base, tmp_path, variant, key, value, words):
    path = rewrite_gguf(base[variant], tmp_path / "bad.gguf", {D + key: value})
    msg = refused(path, words)
    assert D + key in msg or words.endswith(".weight"), msg


def test_deepseek2_expert_groups(base, tmp_path):
    """Group-limited routing: the groups must divide the experts, and the experts used must fit in
    the groups used."""
    refused(rewrite_gguf(base["deepseek2"], tmp_path / "a.gguf",
                         {D + "expert_group_count": 2, D + "expert_group_used_count": 3}),
            D + "expert_group_used_count", "at most 2")
    # 2 groups of 2 experts, 1 group used: at most 2 of the 4 experts can be chosen
    refused(rewrite_gguf(base["deepseek2"], tmp_path / "b.gguf",
                         {D + "expert_group_count": 2, D + "expert_group_used_count": 1, D + "expert_used_count": 3}),
            D + "expert_used_count", "at most 2")
    with open_model(rewrite_gguf(base["deepseek2"], tmp_path / "c.gguf",
                                 {D + "expert_group_count": 2, D + "expert_group_used_count": 1})) as g:
        assert Model(g).config.moe.n_group_used == 1


DS = DEEPSEEK
N_HEAD, LORA, QK, VH = DS["n_head"], DS["kv_lora_rank"], DS["qk_nope"] + DS["qk_rope"], DS["v_head"]
DEEPSEEK_TENSORS = [
    ("deepseek2", "blk.0.attn_q_b.weight", (N_HEAD * QK + 8, DS["q_lora_rank"])),
    ("deepseek2", "blk.1.attn_q_a_norm.weight", (16,)),
    ("deepseek2", "blk.2.attn_kv_a_mqa.weight", (LORA, DS["n_embd"])),          # no rope part
    ("deepseek2", "blk.0.attn_kv_a_norm.weight", (LORA + 8,)),
    ("deepseek2", "blk.1.attn_k_b.weight", (N_HEAD, LORA, DS["qk_nope"] + 8)),
    ("deepseek2", "blk.1.attn_v_b.weight", (N_HEAD + 1, VH, LORA)),
    ("deepseek2", "blk.2.attn_output.weight", (DS["n_embd"], N_HEAD * VH * 2)),
    ("deepseek2", "blk.1.ffn_gate_inp.weight", (DS["n_expert"] + 1, DS["n_embd"])),
    ("deepseek2", "blk.1.exp_probs_b.bias", (DS["n_expert"] - 1,)),
    ("deepseek2", "blk.2.ffn_up_exps.weight", (DS["n_expert"] - 1, DS["n_ff_exp"], DS["n_embd"])),
    ("deepseek2", "blk.2.ffn_down_exps.weight", (DS["n_expert"], DS["n_embd"], DS["n_ff_exp"] * 2)),
    ("deepseek2", "blk.1.ffn_gate_exps.weight", (DS["n_ff_exp"], DS["n_embd"])),  # 2-D: no experts
    ("deepseek2", "blk.1.ffn_down_shexp.weight", (DS["n_embd"], 8)),
    ("deepseek2", "blk.0.ffn_down.weight", (DS["n_embd"], DS["n_ff"] + 32)),
    ("fused", "blk.1.attn_kv_b.weight", (N_HEAD * (DS["qk_nope"] + VH) - 16, LORA)),
]


@pytest.mark.parametrize("variant, name, shape", DEEPSEEK_TENSORS, ids=[f"{v}-{n}" for v, n, _ in DEEPSEEK_TENSORS])
def test_deepseek2_weight_shape(base, tmp_path, variant, name, shape):
    path = rewrite_gguf(base[variant], tmp_path / "bad.gguf", tensors={name: rng_weights(*shape)})
    refused(path, f"tensor '{name}'", "expected")


# ---- through the CLI: the refusal contract ----

@pytest.fixture(scope="module")
def rope_beyond_head(base, tmp_path_factory):
    """The issue's case: rope dims beyond the head size (the rope kernel wrote past each head)."""
    return rewrite_gguf(base["llama"], tmp_path_factory.mktemp("rope") / "rope18.gguf",
                        {L + "rope.dimension_count": 18})


@pytest.mark.parametrize("command", ["run", "perplexity", "imatrix"])
def test_cli_refuses_rope_beyond_head(rope_beyond_head, tmp_path, command):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 200)
    out = tmp_path / "out.gguf"
    args = {"run": ["-p", "hello", "-n", "4"], "perplexity": ["-f", text, "-c", "16"],
            "imatrix": ["-f", text, "-c", "16", "-o", out]}[command]
    snap = Snapshot(rope_beyond_head, text)
    rc, so, se = run_cli(command, rope_beyond_head, *args, "--threads", "1")
    assert_refused(rc, so, se, "llama.rope.dimension_count = 18", "at most 16")
    snap.assert_unchanged()
    assert not out.exists() and list(tmp_path.iterdir()) == [text]
