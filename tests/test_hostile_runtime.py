"""Hostile and careless inputs to the runtime (run, perplexity, imatrix): each must end in a one-line
QuantkitError that names what is wrong, before any numba kernel runs, never in a crash, an
``internal error`` or a silently wrong result.

* every hyperparameter the runtime reads (llama and deepseek2), rewritten to a bad value in a tiny
  model: the model is refused at load, naming the key (in-process: only ``Model()`` is built);
* every weight the forward pass uses, given a wrong shape: refused naming the tensor;
* a few through the real CLI, where the refusal contract itself (exit 1, one line, input
  unchanged, no output file) is what is tested: rope dims beyond the head size made the rope
  kernel write out of bounds (glibc abort, segfault, or rc 0 with corrupted numbers);
* NaN / infinite results (a NaN weight, an output row of 1e38): an error naming the chunk or the
  generation step, where ``PPL = nan`` exited 0 and generation went on;
* sampling options (--temp nan, --top-p 1.5, --seed -1 accepted as random) and
  --kl-divergence-base files whose header disagrees with the file or the model;
* the tokenizer's metadata, and chat templates that would grow without bound.

Commands are run through the library (quantkit.generate, kl_divergence: a QuantkitError) but for the
refusal contract itself (the real CLI, above) and an interrupt's exit status (the CLI in-process).
"""
from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest

import quantkit
from hostile import Snapshot, assert_refused, run_cli
from models import rewrite_gguf, write_deepseek2, write_llama
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
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
            Model(g, ops_cpu)
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
            Model(g, ops_cpu)


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
    refused(rewrite_gguf(base["llama"], tmp_path / "arch.gguf", {"general.architecture": "rwkv6"}),
            "'rwkv6'", "not supported")
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
        assert Model(g, ops_cpu).config.moe.n_group_used == 1


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


# ---- non-finite results: an error naming where, never "PPL = nan" with exit 0 ----

TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods " * 40


def run_main(capsys, *args) -> tuple[int, str, str]:
    """quantkit's CLI in-process (no interpreter start, no numba load): (rc, stdout, stderr)."""
    from quantkit.cli import main
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def broken(base, tmp_path_factory):
    """The tiny llama with a NaN in one FFN weight, and with one output row of 1e38 (finite
    weights whose logits overflow)."""
    d = tmp_path_factory.mktemp("broken")
    with open_model(base["llama"]) as g:
        down = g.by_name["blk.0.ffn_down.weight"].raw().view(np.float32).copy()
        out = g.by_name["output.weight"].raw().view(np.float32).copy()
    down[3, 5] = np.nan
    out[7] = 1e38
    return {"nan": rewrite_gguf(base["llama"], d / "nan.gguf", tensors={"blk.0.ffn_down.weight": down}),
            "huge": rewrite_gguf(base["llama"], d / "huge.gguf", tensors={"output.weight": out})}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # numpy's, on the way to the NaN
@pytest.mark.parametrize("kind", ["nan", "huge"])
def test_non_finite_logits_stop_generation_perplexity_and_imatrix(broken, kind):
    from quantkit.runtime.collect import ActivationStats, ObservingOps, collect
    from quantkit.runtime.generate import Sampler, SamplerOptions, generate
    from quantkit.runtime.perplexity import perplexity
    chunks = [np.arange(10, 42, dtype=np.int64), np.arange(50, 82, dtype=np.int64)]
    with open_model(broken[kind]) as g:
        model = Model(g, ops_cpu)
        with pytest.raises(QuantkitError, match=r"^the prompt \(generation step 1\): the logits at position 4 "
                                                r"are NaN or infinite: the model's weights or activations"):
            list(generate(model, [1, 20, 30, 40, 50], 4, Sampler(SamplerOptions(seed=1))))
        with pytest.raises(QuantkitError, match=r"^chunk 1 of 2: the logits at position 16 are NaN or infinite"):
            perplexity(model, chunks)
        stats = ActivationStats()
        observed = Model(g, ops=ObservingOps(model.ops, stats, {t.name: tuple(t.shape) for t in g.tensors}))
        # a NaN reaches the next product's inputs before the logits
        match = r"^imatrix: the inputs of blk\.1\.attn_q\.weight are NaN" if kind == "nan" else r"^chunk 1 of 2: the logits"
        with pytest.raises(QuantkitError, match=match):
            collect(observed, chunks)


def test_perplexity_cli_refuses_nan_model(broken, tmp_path):
    """The issue's case through the real CLI: PPL = nan exited 0."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    snap = Snapshot(broken["nan"], text)
    rc, out, err = run_cli("perplexity", broken["nan"], "-f", text, "-c", "32", "--chunks", "2", "--threads", "1")
    assert_refused(rc, out, err, "chunk 1 of 2", "NaN or infinite")
    assert "PPL" not in out
    snap.assert_unchanged()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_generation_steps_check_their_logits(base):
    """A step after the prompt whose logits are not finite stops generation, naming the step."""
    from quantkit.runtime.generate import Sampler, SamplerOptions, generate

    class NanInThirdForward:
        """ops_cpu, but the embedding of the third forward pass (generation step 3) is NaN."""
        calls = 0

        def __getattr__(self, name):
            return getattr(ops_cpu, name)

        def embed(self, w, ids):
            if self.calls or list(ids) == [1, 20, 30, 40, 50]:     # from the prompt on, not the warm-up's passes
                self.calls += 1
            x = ops_cpu.embed(w, ids)
            return x * np.nan if self.calls == 3 else x

    with open_model(base["llama"]) as g:
        model = Model(g, ops=NanInThirdForward())
        got = []
        with pytest.raises(QuantkitError, match=r"^generation step 3: the logits at position 6 are NaN"):
            for t in generate(model, [1, 20, 30, 40, 50], 8, Sampler(SamplerOptions(temp=0))):
                got.append(t)
        assert len(got) == 2


# ---- sampling options ----

@pytest.mark.parametrize("option, value, words", [
    ("temp", float("nan"), "--temp nan"), ("temp", float("inf"), "--temp inf"), ("temp", -0.5, "--temp -0.5"),
    ("top_p", 1.5, "--top-p 1.5"), ("top_p", -0.1, "--top-p -0.1"), ("top_p", float("nan"), "--top-p nan"),
    ("top_k", -3, "--top-k -3"), ("seed", -2, "--seed -2"),
])
def test_run_refuses_bad_sampling_options(base, option, value, words):
    with pytest.raises(QuantkitError) as e:
        quantkit.generate(base["llama"], "hi", n_predict=2, threads=1, **{option: value})
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_run_seed_minus_one_is_random(base):
    """llama.cpp's -1 ("random", llama-cli's default) is accepted."""
    assert len(quantkit.generate(base["llama"], "hi", n_predict=3, seed=-1, threads=1).stats.tokens) <= 3


def test_generation_stops_at_an_interrupt_lost_in_a_callback(base, capsys, monkeypatch):
    """A SIGTERM whose handler ran inside a ctypes callback (numba compiling: its exception is
    dropped) still ends `run` at the next forward pass, with one line and exit status 143."""
    import ctypes
    import os
    import signal

    from quantkit.runtime import generate as gen
    real = gen.Sampler.__call__

    def sample(self, logits):
        def callback():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10000):          # the handler runs among these bytecodes
                pass
        ctypes.CFUNCTYPE(None)(callback)()
        return real(self, logits)
    monkeypatch.setattr(gen.Sampler, "__call__", sample)
    rc, out, err = run_main(capsys, "run", base["llama"], "-p", "hi", "-n", "8", "--temp", "0", "--threads", "1")
    assert rc == 143 and "SIGTERM" in err and len(err.strip().splitlines()) == 1, err


# ---- --kl-divergence-base files ----

def write_base(path, n_ctx=8, n_vocab=320, n_chunk=2, tokens=None, rows=None, tail=b""):
    """A llama-perplexity logits file (see quantkit.runtime.perplexity), its header as given."""
    import struct

    from quantkit.runtime.perplexity import quantize_log_probs
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, max(n_vocab, 1), max(n_ctx * n_chunk, 0)) if tokens is None else np.asarray(tokens)
    n_pos = max(n_chunk * (n_ctx - 1 - n_ctx // 2), 0)
    if rows is None:
        rows = np.stack([quantize_log_probs(rng.standard_normal(n_vocab).astype(np.float32)) for _ in range(n_pos)]) \
            if n_pos and n_vocab > 0 else np.zeros((0,), np.uint16)
    path.write_bytes(b"_logits_" + struct.pack("<iii", n_ctx, n_vocab, n_chunk) + tokens.astype("<i4").tobytes()
                     + rows.astype("<u2").tobytes() + tail)
    return path


def test_kld_base_header_is_checked_against_the_file(tmp_path):
    from quantkit.runtime.perplexity import LogitsFile
    ok = LogitsFile.read(write_base(tmp_path / "ok.kld"))
    assert (ok.n_ctx, ok.n_vocab, len(ok.chunks), ok.data.shape) == (8, 320, 2, (6, 324))
    rows = np.stack([ok.data[i] for i in range(6)])
    cases = [
        (dict(n_ctx=1), "n_ctx must be at least 3"),            # no scored position: a ZeroDivisionError
        (dict(n_ctx=2), "n_ctx must be at least 3"),
        (dict(n_chunk=0), "n_chunk at least 1"),
        (dict(n_vocab=0), "n_vocab and n_chunk at least 1"),
        (dict(n_vocab=-5), "n_vocab and n_chunk at least 1"),
        (dict(tail=b"\0\0"), "means 3972 bytes, the file has 3974"),        # sizes that do not match the file's
        (dict(rows=rows[:5]), "the file has 3324"),
        (dict(tokens=np.r_[np.arange(15), 320]), "token 320 (chunk 2)"),
        (dict(tokens=np.r_[-1, np.arange(15)]), "token -1 (chunk 1)"),
    ]
    nan_row = rows.copy()
    nan_row[4, :2] = np.array([np.nan], np.float32).view(np.uint16)
    neg_row = rows.copy()
    neg_row[1, :2] = np.array([-1.0], np.float32).view(np.uint16)
    cases += [(dict(rows=nan_row), "corrupt logits row 4 (chunk 2)"), (dict(rows=neg_row), "corrupt logits row 1")]
    for i, (kw, words) in enumerate(cases):
        path = write_base(tmp_path / f"bad{i}.kld", **kw)
        with pytest.raises(QuantkitError, match=re.escape(words)):
            LogitsFile.read(path)
    fifo = tmp_path / "fifo.kld"
    os.mkfifo(fifo)
    with pytest.raises(QuantkitError, match="not a regular file"):
        LogitsFile.read(fifo)


def test_kld_refuses_inconsistent_base(base, tmp_path):
    """A base with n_ctx 1 (an internal error before), and one from a model of another vocabulary:
    refused before anything is computed, the base file unchanged."""
    for name, kw, words in (("ctx1.kld", dict(n_ctx=1), "n_ctx must be at least 3"),
                            ("vocab.kld", dict(n_vocab=100), "vocabulary of 100, the model 320")):
        path = write_base(tmp_path / name, **kw)
        snap = Snapshot(path, base["llama"])
        with pytest.raises(QuantkitError, match=re.escape(words)):
            quantkit.kl_divergence(base["llama"], path, threads=1)
        snap.assert_unchanged()


def test_kld_runs_on_a_consistent_base(base, tmp_path):
    path = write_base(tmp_path / "ok.kld", n_ctx=16, n_chunk=2)
    assert quantkit.kl_divergence(base["llama"], path, threads=1).summary()["positions"] == 14


# ---- the tokenizer's metadata ----

SPM = {"tokenizer.ggml.model": "llama",
       "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581a", "a"]}


@pytest.mark.parametrize("change, words", [
    ({"tokenizer.ggml.tokens": ["a", 1, "b"]}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.scores": ["0.5"] * 261}, "tokenizer.ggml.scores must be an array of numbers"),
    ({"tokenizer.ggml.token_type": [1.5] * 261}, "tokenizer.ggml.token_type must be an array of integers"),
    ({"tokenizer.ggml.token_type": [1] * 260}, "tokenizer.ggml.token_type has 260 entries for 261 tokens"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "tokenizer.ggml.bos_token_id = '1' must be a token id"),
    ({"tokenizer.ggml.eos_token_id": 2.0}, "tokenizer.ggml.eos_token_id = 2.0 must be a token id"),
    ({"tokenizer.ggml.add_bos_token": "false"}, "tokenizer.ggml.add_bos_token = 'false' must be a bool"),
    ({"tokenizer.ggml.add_space_prefix": 1}, "tokenizer.ggml.add_space_prefix = 1 must be a bool"),
    ({"tokenizer.ggml.pre": 7}, "tokenizer.ggml.pre = 7 must be a string"),
    ({"tokenizer.chat_template": ["{{ x }}"]}, "tokenizer.chat_template = ['{{ x }}'] must be a string"),
    ({"tokenizer.ggml.model": ["llama"]}, "tokenizer model ['llama'] is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.merges": [1, 2]},
     "tokenizer.ggml.merges must be an array of strings"),
])
def test_tokenizer_metadata_is_checked(change, words):
    from quantkit.text.tokenizer import Tokenizer
    with pytest.raises(QuantkitError, match=re.escape(words)):
        Tokenizer.from_metadata({**SPM, **change})


def test_tokenizer_default_special_ids_beyond_a_small_vocabulary():
    """gpt2's default BOS/EOS id 11 in a vocabulary of 5: no such token (an IndexError before)."""
    from quantkit.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                                   "tokenizer.ggml.tokens": ["a", "b", "c", "d", "e"], "tokenizer.ggml.merges": []})
    assert tok.bos_id is None and tok.eos_id is None and not tok.eog_ids
    assert tok.encode("abc") == [0, 1, 2]


# ---- chat templates: bounded work ----

@pytest.mark.parametrize("template, words", [
    ("{{ 'x' * 10**10 }}", "a repetition of 10000000000"),               # the issue's case: 10 GB
    ("{{ ([0] * 100000) * 100000 }}", "a repetition of 10000000000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a ~ concatenation of 33554432"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a concatenation of 33554432"),
    ("{{ 2 ** 100000000 }}", "the power 2 ** 100000000"),
    ("{{ 'x'|center(10**10) }}", "the filter center of 10000000000"),
    ("{{ 'a\nb'|indent(10**9) }}", "the filter indent"),
    ("{% set s = 'x' * 10**6 %}{{ s|replace('', s) }}", "the filter replace"),
    ("{% set s = 'x' * 10**6 %}{{ s.replace('', s) }}", "str.replace"),
    ("{{ 'x'.ljust(10**10) }}", "str.ljust of 10000000000"),
    ("{{ '%10000000000d' % 1 }}", "a % formatting"),
    ("{{ '%*d' % (10**10, 1) }}", "a % formatting"),
    ("{{ '{:>10000000000}'.format(1) }}", "str.format"),
    ("{{ '{:{}}'.format(1, 10**10) }}", "str.format"),
    ("{{ [1]|batch(10**10, 'x')|list }}", "the filter batch"),
    ("{{ messages|tojson(indent=10**8) }}", "JSON indent"),
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "output is longer than"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ lipsum(10**8) }}", "'lipsum' is undefined"),
    ("{% include 'x' %}", "chat template"),
    ("{% for %}", "chat template"),
])
def test_chat_template_is_bounded(template, words):
    from quantkit.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata({**SPM, "tokenizer.chat_template": template})
    with pytest.raises(QuantkitError, match=re.escape(words)):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_loops_and_time_are_bounded(monkeypatch):
    """Empty nested loops make nothing but take hours: loop lengths count as work, and rendering
    has a deadline (both lowered here to keep the test quick)."""
    from quantkit.text import chat as chat_template
    from quantkit.text.tokenizer import Tokenizer
    monkeypatch.setattr(chat_template, "MAX_WORK", 1 << 20)
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(QuantkitError, match="characters or items in all"):
        Tokenizer.from_metadata({**SPM, "tokenizer.chat_template": nested}).apply_chat_template([])
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.2)
    calls = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    with pytest.raises(QuantkitError, match="longer than 0.2 s"):
        Tokenizer.from_metadata({**SPM, "tokenizer.chat_template": calls}).apply_chat_template([])


def test_chat_template_ordinary_work_renders():
    from quantkit.text.tokenizer import Tokenizer
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content ~ '\n' }}{% endfor %}{{ '=' * 3 }}"
                "{{ '%s|%5.2f' % ('a', 1.5) }}{{ '{}-{:>4}'.format('b', 7) }}{{ messages|tojson }}"
                "{{ 'a\nb'|indent(2) }}{{ ['x', 'y']|join(', ') }}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = Tokenizer.from_metadata({**SPM, "tokenizer.chat_template": template})
    long = "word " * 200000                                                  # a 1 MB prompt
    out = tok.apply_chat_template([{"role": "user", "content": long}])
    assert out.startswith("<|user|>word word") and out.endswith(
        '===a| 1.50b-   7[{"role": "user", "content": "' + long + '"}]a\n  b' + "x, y<|assistant|>")


def test_run_chat_refuses_a_huge_template(base, tmp_path):
    path = rewrite_gguf(base["llama"], tmp_path / "template.gguf", {"tokenizer.chat_template": "{{ 'x' * 10**10 }}"})
    with pytest.raises(QuantkitError, match="chat template.*10000000000"):
        quantkit.generate(path, "hi", n_predict=2, chat=True, threads=1)


def test_huge_counts_are_refused_quickly(base, tmp_path):
    """Counts near 2**64 (u64 keys) are compared, never iterated or allocated."""
    for key in ("block_count", "embedding_length", "attention.head_count", "context_length"):
        path = rewrite_gguf(base["llama"], tmp_path / "huge.gguf", {L + key: (2**64 - 1, T.UINT64)})
        if key == "context_length":     # a context length is only an upper bound
            with open_model(path) as g:
                assert Model(g, ops_cpu).config.n_ctx_train == 2**64 - 1
        else:
            refused(path, L + key)
