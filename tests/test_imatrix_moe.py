"""`quantkit imatrix` on mixture-of-experts shapes (issue 26): per-expert data for stacked ``*_exps``
tensors and for ik_llama.cpp's fused ``ffn_gate_up_exps``, shared experts, experts that got no
token, and the file quantizing the model in quantkit and in the wheel's llama-quantize.

Every test runs on each model of MOE_MODELS: a tiny model of an MoE architecture the runtime
computes (deepseek2, qwen3moe, glm4moe, gpt-oss, DeepSeek-V3.2 with its indexer; fused gate/up
twins of deepseek2, qwen3moe and gpt-oss).  A new architecture extends them by adding its writer
there (tests/models.py); the checks read what they need from the file (which tensors are routed
experts, the router, shared experts, MTP layers, ``<arch>.expert_used_count``), and the registry
says what the architecture has (shared experts, dense lead layers, MTP layers), which a test checks
against the file: a check that does not apply to an architecture is so by its data.

* routed experts: one row of Σx² and one token count per expert, the counts of a layer's expert
  tensors equal (one routing) and summing to tokens x experts used; shared experts, the router and
  dense layers one count of every token;
* the fused ffn_gate_up_exps [n_embd, 2 n_ff, n_expert] (each expert's gate rows, then its up
  rows): one entry, its input, as ik_llama.cpp's llama-imatrix names it (computed in one product,
  so the entry of the fused file is the gate/up entries of the same model stored split);
* llama-quantize (ik_llama.cpp, the wheel) reads the .dat (the only imatrix format it reads) and
  quantizes every block tensor with it, expert k with the entry's row k, exactly as quantkit's
  loader hands it out; quantkit quantizes with the .dat and the GGUF file;
* experts without tokens: ``--partial-experts keep`` (mainline's writer: stored, weight 1) and
  ``ik`` (ik_llama.cpp's llama-imatrix: an entry is stored only if fewer than round(5%) of its
  experts lack data, else skipped), and how both tools quantize with such a file.
"""
from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

import peers
import quantkit
from models import (F16_ID, F32_ID, rewrite_gguf, write_deepseek2, write_deepseek32, write_glm4moe, write_gptoss,
                    write_qwen3moe)
from quantkit import formats
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import load_imatrix
from quantkit.imatrix_tools import RawImatrix, ik_stores
from quantkit.runtime import ops_cpu
from quantkit.runtime.collect import ActivationStats, ObservingOps
from quantkit.runtime.model import Model

# 32 experts: round(5% of 32) = 2, so ik's rule stores an entry with one expert missing, not two
DEEPSEEK2 = dict(n_layer=3, n_dense=1, n_embd=64, n_ff=128, n_ff_exp=64, n_expert=32, n_expert_used=2, n_shared=1,
                 n_head=4, q_lora_rank=64, n_vocab=512, seed=3)
# the 2026 architectures (tests/models.py's preset fixtures with data and a tokenizer): F32, 32 experts
# of 4 used, 320 tokens; a dense lead layer and a shared expert where the architecture has them
_SMALL = dict(n_embd=64, n_expert=32, n_expert_used=4, n_vocab=320, type_id=F32_ID, sparse=False, vocab=True,
              seed=3)
QWEN3MOE = dict(_SMALL, n_layer=2, n_ff=128, n_ff_exp=32, n_head=4, n_head_kv=2, head_dim=32)
GLM4MOE = dict(_SMALL, n_layer=3, n_dense=1, nextn=1, n_ff=128, n_ff_exp=32, n_shared=1, n_head=4, n_head_kv=2,
               head_dim=32)
GPTOSS = dict(_SMALL, n_layer=2, n_ff_exp=64, n_head=4, n_head_kv=2, head_dim=32, sliding_window=8)
# DeepSeek's MLA head sizes (the writer's defaults): ik's loader takes mainline MLA files only with them;
# index_topk under CTX, so the indexer chooses keys
DEEPSEEK32 = dict(_SMALL, n_layer=3, n_dense=1, n_ff=128, n_ff_exp=32, n_head=4, q_lora=64, index_n_heads=4,
                  index_head_dim=64, index_topk=8, n_group=4, n_group_used=2)


@dataclass(frozen=True)
class MoEModel:
    write: Callable[[Path], Path]
    shared_experts: bool                # ffn_*_shexp in every MoE layer
    dense_layers: int                   # dense lead layers (ffn_gate/up/down)
    mtp_layers: int = 0                 # NextN/MTP layers after them (not computed, no imatrix entry)
    split_twin: str | None = None       # fused gate/up experts: the same model with them split
    wheel_cannot_run: str | None = None     # why the wheel's loader refuses the file (checked that it does)


# name -> its tiny model.  A writer gives a model with a tokenizer (the runtime tokenizes the
# calibration text), several MoE layers and at least 30 experts (round(5%) >= 2, and a 16-token run
# leaves experts idle); shared experts and dense lead layers where the architecture has them.
MOE_MODELS = {
    "deepseek2": MoEModel(partial(write_deepseek2, **DEEPSEEK2), shared_experts=True, dense_layers=1),
    "deepseek2-fused": MoEModel(partial(write_deepseek2, fused_gate_up=True, **DEEPSEEK2), shared_experts=True,
                                dense_layers=1, split_twin="deepseek2"),
    "qwen3moe": MoEModel(partial(write_qwen3moe, **QWEN3MOE), shared_experts=False, dense_layers=0),
    "qwen3moe-fused": MoEModel(partial(write_qwen3moe, fused_gate_up=True, **QWEN3MOE), shared_experts=False,
                               dense_layers=0, split_twin="qwen3moe"),
    "glm4moe": MoEModel(partial(write_glm4moe, **GLM4MOE), shared_experts=True, dense_layers=1, mtp_layers=1),
    # biased experts and router, swiglu_oai, attention sinks; the experts MXFP4 as gpt-oss ships them
    "gpt-oss": MoEModel(partial(write_gptoss, **GPTOSS), shared_experts=False, dense_layers=0),
    # ffn_gate_up_exps with its ffn_gate_up_exps.bias (each expert's gate biases, then its up biases)
    "gpt-oss-fused": MoEModel(partial(write_gptoss, fused_gate_up=True, **GPTOSS), shared_experts=False,
                              dense_layers=0, split_twin="gpt-oss",
                              wheel_cannot_run="the wheel's loader wants gpt-oss's ffn_gate_exps.bias (ik_llama.cpp "
                                               "loads ffn_gate_up_exps.bias since)"),
    # the DSA indexer's matrices (indexer.attn_q_b, attn_k, proj) are block tensors with entries too
    "deepseek32": MoEModel(partial(write_deepseek32, **DEEPSEEK32), shared_experts=True, dense_layers=1),
}
FUSED = [name for name, m in MOE_MODELS.items() if m.split_twin]

CTX, CHUNKS = 32, 3                     # the full run; the short one: 1 chunk of 16 tokens (experts miss)
SHORT = 16


@dataclass
class Made:
    model: Path
    gguf: Path                          # quantkit imatrix -o x.gguf over CHUNKS chunks of CTX
    dat: Path                           # the same, quantkit imatrix convert x.gguf x.dat
    short: Path                         # GGUF over one chunk of SHORT tokens: many experts without a token
    tensors: dict[str, tuple[int, ...]]     # of the layers the forward pass computes, and the ends
    mtp: set[str]                           # of the layers it does not (GLM's NextN/MTP layer)
    n_expert_used: int
    spec: MoEModel
    requantize: bool                    # some weights are stored quantized (gpt-oss's MXFP4 experts)

    def no_imatrix(self, quantized) -> set[str]:
        """Which of the ``quantized`` tensors both tools quantize without an imatrix: the output and
        embedding (never collected), and the MTP layers' (never computed, by ik's llama-imatrix either)."""
        return {"output.weight", "token_embd.weight"} | (self.mtp & set(quantized))

    def quantize_options(self) -> dict:
        return {"allow_requantize": True} if self.requantize else {}

    def llama_quantize_options(self) -> list[str]:
        return ["--allow-requantize"] if self.requantize else []


def calibration_text(path: Path) -> Path:
    """Words of random letters: many different tokens, so the router spreads them."""
    rng = np.random.default_rng(7)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(3000)]
    path.write_text(" ".join(words))
    return path


_made: dict[str, Made] = {}


def made_for(name: str, tmp_path_factory) -> Made:
    if name not in _made:
        d = tmp_path_factory.mktemp(name)
        text = calibration_text(d / "text.txt")
        model = MOE_MODELS[name].write(d / "model.gguf")
        with open_model(model) as g:
            arch = g.get("general.architecture")
            computed = int(g.get(f"{arch}.block_count")) - int(g.get(f"{arch}.nextn_predict_layers") or 0)
            tensors = {t.name: tuple(t.shape) for t in g.tensors}
            n_used = int(g.get(f"{arch}.expert_used_count"))
            requantize = any(int(t.qtype) not in (F32_ID, F16_ID) for t in g.tensors)
        mtp = {n for n in tensors if n.startswith("blk.") and layer_of(n) >= computed}
        out = Made(model, d / "imatrix.gguf", d / "imatrix.dat", d / "short.gguf",
                   {n: s for n, s in tensors.items() if n not in mtp}, mtp, n_used, MOE_MODELS[name], requantize)
        quantkit.collect_imatrix(model, text, out.gguf, ctx_size=CTX, chunks=CHUNKS, threads=1)
        quantkit.convert_imatrix(out.gguf, out.dat)
        quantkit.collect_imatrix(model, text, out.short, ctx_size=SHORT, chunks=1, threads=1)
        _made[name] = out
    return _made[name]


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def made(request, tmp_path_factory) -> Made:
    return made_for(request.param, tmp_path_factory)


def routed(tensors) -> list[str]:
    return [n for n, s in tensors.items() if n.startswith("blk.") and n.endswith("_exps.weight") and len(s) == 3]


def layer_of(name: str) -> int:
    return int(name.split(".")[1])


needs_wheel = pytest.mark.skipif(not peers.llama_quantize_runs() or peers.load_ggml() is None,
                                 reason="ik-llama-cpp-python's llama-quantize not available")


def llama_quantize(*args) -> tuple[int, str]:
    p = subprocess.run([str(peers.llama_quantize_bin()), *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


def not_found(log: str) -> set[str]:
    return {line.split()[-1] for line in log.splitlines() if "did not find weights for" in line}


# ---- what is collected ----

def test_routed_experts_have_a_row_and_a_count_per_expert(made):
    raw = RawImatrix.from_file(made.gguf, CTX)
    n_tokens = CTX * CHUNKS
    experts = routed(made.tensors)
    assert experts
    by_layer: dict[int, np.ndarray] = {}
    for name in experts:
        n_in, _, n_expert = made.tensors[name]
        counts, sums = raw.counts[name], raw.sums[name].reshape(raw.counts[name].size, -1)
        assert counts.shape == (n_expert,) and sums.shape == (n_expert, n_in), name
        assert counts.sum() == n_tokens * made.n_expert_used, name        # each token: n_used distinct experts
        assert ((sums > 0).all(axis=1) == (counts > 0)).all() and not sums[counts == 0].any(), name
        np.testing.assert_array_equal(counts, by_layer.setdefault(layer_of(name), counts), err_msg=name)
    assert all((c > 0).sum() > made.n_expert_used for c in by_layer.values())    # not one choice for all
    # one count of every token: shared experts, the router, dense layers
    dense = [n for n in made.tensors if n.startswith("blk.") and n.endswith(".weight") and n not in experts
             and ("_shexp" in n or "ffn_gate_inp" in n or n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down"))]
    assert any("ffn_gate_inp" in n for n in dense)
    for name in dense:
        assert raw.counts[name].tolist() == [n_tokens], name
    # an entry for exactly the block matrices the model has (no split entry for a fused tensor; the
    # attention's, V3.2's indexer's), every one but the routed experts with one count of every token
    matrices = {n for n, s in made.tensors.items() if n.startswith("blk.") and n.endswith(".weight") and len(s) > 1}
    assert set(raw.sums) == matrices
    for name in matrices - set(experts):
        assert raw.counts[name].tolist() == [n_tokens], name


def test_the_model_has_what_its_entry_says(made):
    """Shared experts and dense lead layers are checked (above: one count of every token) where the
    architecture has them: the registry says which, and the file agrees, so a check that does not
    apply is so by the model's data, not skipped."""
    names = set(made.tensors)
    moe_layers = sorted({layer_of(n) for n in routed(made.tensors)})
    shared = {layer_of(n) for n in names if "_shexp." in n}
    assert shared == (set(moe_layers) if made.spec.shared_experts else set())
    dense = {layer_of(n) for n in names if n.startswith("blk.") and n.split(".")[2] == "ffn_down"}
    assert dense == set(range(made.spec.dense_layers)) and len(moe_layers) >= 2
    mtp = {layer_of(n) for n in made.mtp}
    assert len(mtp) == made.spec.mtp_layers and all(any(f"blk.{i}.nextn." in n for n in made.mtp) for i in mtp)
    assert all(made.tensors[n][2] >= 30 for n in routed(made.tensors))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_backend_collects_the_same(made, tmp_path):
    """The torch backend (on the CPU here) routes and observes as the numba one does."""
    text = calibration_text(tmp_path / "t.txt")
    quantkit.collect_imatrix(made.model, text, tmp_path / "torch.gguf", ctx_size=CTX, chunks=CHUNKS, threads=1,
                             device="torch-cpu")
    ours, theirs = RawImatrix.from_file(made.gguf, CTX), RawImatrix.from_file(tmp_path / "torch.gguf", CTX)
    assert set(ours.sums) == set(theirs.sums)
    # DeepSeek-V3.2's sparse attention keeps each query's top keys by index scores that the two
    # backends sum in different orders (BLAS's, torch's): a near tie can keep another key, which
    # moves the following layers' activations of that position by more than rounding (seen with
    # OpenBLAS's Haswell kernels: 6 of 2048 sums 0.5% apart; its SkylakeX ones: within 1e-3)
    rtol = 1e-2 if made.spec is MOE_MODELS["deepseek32"] else 1e-3
    for name in ours.sums:
        np.testing.assert_array_equal(ours.counts[name], theirs.counts[name], err_msg=name)
        np.testing.assert_allclose(ours.sums[name], theirs.sums[name], rtol=rtol, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", FUSED)
def test_fused_gate_up_entry_is_the_split_models_gate_and_up_input(name, tmp_path_factory):
    """The fused file computes the same model in one product per expert: its ffn_gate_up_exps entry
    is the ffn_gate_exps (and ffn_up_exps) entry of the split file, counts and sums."""
    fused = made_for(name, tmp_path_factory)
    split = made_for(MOE_MODELS[name].split_twin, tmp_path_factory)
    a, b = RawImatrix.from_file(fused.gguf, CTX), RawImatrix.from_file(split.gguf, CTX)
    names = [n for n in routed(fused.tensors) if "ffn_gate_up_exps" in n]
    assert names
    for n in names:
        assert n not in b.sums and n.replace("gate_up", "gate") not in a.sums
        for half in ("gate", "up"):
            other = n.replace("gate_up", half)
            np.testing.assert_array_equal(a.counts[n], b.counts[other])
            np.testing.assert_allclose(a.sums[n], b.sums[other], rtol=1e-4)
    for n in routed(fused.tensors):        # and the down experts are the same entries
        if "ffn_down_exps" in n:
            np.testing.assert_array_equal(a.counts[n], b.counts[n])


@pytest.mark.parametrize("name", FUSED)
def test_fused_gate_up_computes_the_split_model(name, tmp_path_factory):
    """Our runtime (both backends where torch is there) and the wheel give the fused file the split
    file's logits (where the wheel's loader takes the fused file: MoEModel.wheel_cannot_run)."""
    fused, split = made_for(name, tmp_path_factory), made_for(MOE_MODELS[name].split_twin, tmp_path_factory)
    tokens = np.random.default_rng(1).integers(0, fused.tensors["token_embd.weight"][1], 24)
    backends = [ops_cpu]
    try:
        from quantkit.runtime.ops_torch import TorchOps
        backends.append(TorchOps("cpu"))
    except ImportError:
        pass
    for ops in backends:
        logits = []
        for path in (fused.model, split.model):
            with open_model(path) as g:
                m = Model(g, ops)
                logits.append(m.forward(tokens, m.new_cache(len(tokens))))
        np.testing.assert_allclose(logits[0], logits[1], atol=1e-5 * np.abs(logits[1]).max())
    if peers.llama_quantize_bin() is None:
        return
    if fused.spec.wheel_cannot_run:         # llama-quantize still quantizes it (the checks below)
        with pytest.raises(RuntimeError, match="Failed to load model"):
            peers.ik_logits(fused.model, tokens.tolist())
        return
    theirs = [peers.ik_logits(p, tokens.tolist(), all_positions=True) for p in (fused.model, split.model)]
    np.testing.assert_array_equal(theirs[0], theirs[1])


@pytest.mark.parametrize("name", FUSED)
def test_an_imatrix_of_one_layout_quantizes_the_other(name, tmp_path_factory):
    """ik_llama.cpp's lookup (quantkit.imatrix.fallback_names): a fused tensor takes the split file's
    ffn_up_exps entry, split gate/up tensors the fused file's ffn_gate_up_exps entry; quantkit plans
    every block tensor with an entry, and the wheel's llama-quantize finds one for each too."""
    fused, split = made_for(name, tmp_path_factory), made_for(MOE_MODELS[name].split_twin, tmp_path_factory)
    for model, other in ((fused, split), (split, fused)):
        imat = load_imatrix(other.dat)
        entry_of = {"ffn_gate_up_exps": "ffn_up_exps", "ffn_gate_exps": "ffn_gate_up_exps",
                    "ffn_up_exps": "ffn_gate_up_exps", "ffn_down_exps": "ffn_down_exps"}
        for t in routed(model.tensors):
            kind = t.split(".")[2]
            assert imat.lookup_name(t) == t.replace(kind, entry_of[kind]), t
        with quantkit.open_quantization(model.model, None, "q4_0", imatrix=other.dat, **model.quantize_options()) as q:
            without = [t.name for t in q.plan.tensors if t.action == "quantize" and not t.imatrix]
        assert set(without) == model.no_imatrix(without)
        if peers.llama_quantize_runs():
            out = tmp_path_factory.mktemp("cross") / "q.gguf"
            rc, log = llama_quantize(*model.llama_quantize_options(), "--imatrix", other.dat, model.model, out,
                                     "Q4_0", 2)
            assert rc == 0 and not_found(log) == set(without), log[-3000:]


def test_observer_forwards_moe_options():
    """ObservingOps passes moe_ffn's keyword arguments (the fused tensor; an architecture's biases
    or activation) to the backend, and every expert product it is given still reaches the stats."""
    seen = {}

    class Backend:
        FUSED_TOKENS = 4

        @staticmethod
        def host(x):
            return x

        @staticmethod
        def matmul_q(w, x, fused=None):
            return x

        @staticmethod
        def moe_ffn(x, ids, weights, gate_exps, up_exps, down_exps, matmul=None, **options):
            seen.update(options)
            for e in np.unique(ids):
                matmul(SimpleNamespace(name=f"blk.1.ffn_gate_up_exps.weight[{e}]"), x[(ids == e).any(axis=1)])
            return x

    stats = ActivationStats()
    obs = ObservingOps(Backend(), stats, {"blk.1.ffn_gate_up_exps.weight": (8, 16, 4)})
    x, ids = np.ones((5, 8), np.float32), np.array([[0, 1]] * 3 + [[1, 3]] * 2)
    obs.moe_ffn(x, ids, np.ones((5, 2), np.float32), None, None, "down", gate_up_exps="gu", bias="b", act="swiglu_oai")
    assert seen == {"gate_up_exps": "gu", "bias": "b", "act": "swiglu_oai"}
    assert stats.entries["blk.1.ffn_gate_up_exps.weight"].counts.tolist() == [3, 5, 0, 2]


# ---- quantizing with it ----

@pytest.mark.parametrize("fmt", ["dat", "gguf"])
def test_quantkit_quantizes_every_tensor_with_it(made, fmt, tmp_path):
    out = tmp_path / "q.gguf"
    with quantkit.open_quantization(made.model, out, "q4_0", imatrix=getattr(made, fmt), threads=1,
                                    **made.quantize_options()) as q:
        q.write()
    used = {t.name: t.imatrix for t in q.plan.tensors if t.action == "quantize"}
    assert set(routed(made.tensors)) <= set(used)
    assert {n for n, u in used.items() if not u} == made.no_imatrix(used)


@needs_wheel
def test_llama_quantize_reads_it_as_quantkit_does(made, tmp_path):
    """The wheel's llama-quantize finds an entry for every block tensor of our .dat and quantizes
    expert k of each 3-D tensor with row k of it: its bytes are the wheel's own quantize_chunk of
    each matrix with the weights quantkit's loader gives (weights_for), and differ without them."""
    out = tmp_path / "theirs.gguf"
    rc, log = llama_quantize(*made.llama_quantize_options(), "--imatrix", made.dat, made.model, out, "Q4_0", 2)
    assert rc == 0, log[-3000:]
    assert "imatrix size" not in log and not_found(log) == made.no_imatrix(quantized_by_quantkit(made)), log[-3000:]
    check_bytes_use_weights(made, out, load_imatrix(made.dat), routed(made.tensors))


def quantized_by_quantkit(made: Made) -> set[str]:
    with quantkit.open_quantization(made.model, None, "q4_0", **made.quantize_options()) as q:
        return {t.name for t in q.plan.tensors if t.action == "quantize"}


def check_bytes_use_weights(made: Made, out: Path, imat, names: list[str]) -> None:
    ggml = peers.load_ggml()
    with open_model(made.model) as src, open_model(out) as q:
        for name in names:
            t, s = q.by_name[name], src.by_name[name]
            n_in, _, n_mat = s.shape
            # llama-quantize dequantizes a quantized source (--allow-requantize) to floats first
            rows = s.raw()
            x = (rows.view(np.float32) if int(s.qtype) == F32_ID else
                 formats.dequantize(rows, s.qtype, n_in)).reshape(n_mat, -1, n_in)
            w = imat.weights_for(name, n_in, n_mat)
            assert w is not None, name
            theirs = bytes(t.source.view(t.offset, t.nbytes))
            assert theirs == b"".join(ggml.quantize_chunk(int(t.qtype), x[k], w[k]) for k in range(n_mat)), name
            assert theirs != b"".join(ggml.quantize_chunk(int(t.qtype), x[k]) for k in range(n_mat)), name


# ---- experts that got no token ----

def test_ik_rule_stores_an_entry_with_fewer_than_round_5_percent_of_experts_missing():
    """ik_llama.cpp's save_imatrix: bad_experts.size() < round(n_as * 0.05), C's round (halves
    away from zero); never an entry without data or a one-matrix entry with a zero count."""
    def counts(n, missing):
        c = np.full(n, 7)
        c[:missing] = 0
        return c
    cases = {(8, 0): True, (8, 1): False,           # round(0.4) = 0
             (10, 1): False,                        # round(0.5) = 1: only none missing
             (30, 1): True, (30, 2): False,         # round(1.5) = 2
             (32, 1): True, (32, 2): False,
             (256, 12): True, (256, 13): False,     # round(12.8) = 13
             (256, 256): False, (1, 1): False, (1, 0): True}
    for (n, missing), stored in cases.items():
        assert ik_stores(counts(n, missing)) == stored, (n, missing)


def test_partial_policies_write_what_the_c_tools_write(made, tmp_path):
    """The short run leaves experts without a token.  keep: every entry stored, weight 1.0 for those
    experts (GGUF: their count 0 and zero sums kept; .dat: 1 x ncall); ik: exactly the entries ik's
    rule stores, the others not in the file."""
    raw = RawImatrix.from_file(made.short, SHORT)
    missing = raw.never_fired()
    assert missing, "the short run must leave experts without a token"
    skipped = raw.skipped("ik")
    assert skipped and skipped == sorted(n for n in raw.sums if not ik_stores(raw.counts[n]))
    for policy in ("keep", "ik"):
        dat = tmp_path / f"{policy}.dat"
        r = quantkit.convert_imatrix(made.short, dat, chunk_size=SHORT, partial_experts=policy)
        imat = load_imatrix(dat)
        want = set(raw.sums) - (set(skipped) if policy == "ik" else set())
        assert set(imat.weights) == want and r.entries == len(want)
        for name in set(missing) & want:
            w = imat.weights[name].reshape(raw.counts[name].size, -1)
            assert (w[missing[name]] == 1.0).all() and (w[raw.counts[name] > 0] != 1.0).any()
    g = load_imatrix(made.short)
    assert sorted(g.partial) == sorted(missing)
    for name, experts in missing.items():
        assert (g.counts[name][experts] == 0).all()


@needs_wheel
def test_both_tools_quantize_with_the_ik_file_alike(made, tmp_path):
    """With the ik-policy .dat, quantkit and llama-quantize find no imatrix for the same tensors
    (the skipped entries, and their fallbacks none either), and quantize the rest with it."""
    dat = tmp_path / "ik.dat"
    quantkit.convert_imatrix(made.short, dat, chunk_size=SHORT, partial_experts="ik")
    skipped = set(RawImatrix.from_file(made.short, SHORT).skipped("ik"))
    ours = tmp_path / "ours.gguf"
    with quantkit.open_quantization(made.model, ours, "q4_0", imatrix=dat, threads=1,
                                    **made.quantize_options()) as q:
        q.write()
    without = {t.name for t in q.plan.tensors if t.action == "quantize" and not t.imatrix}
    assert skipped <= without and without - skipped == made.no_imatrix(without)
    rc, log = llama_quantize(*made.llama_quantize_options(), "--imatrix", dat, made.model, tmp_path / "theirs.gguf",
                             "Q4_0", 2)
    assert rc == 0, log[-3000:]
    assert not_found(log) == without, log[-3000:]


@needs_wheel
def test_an_expert_without_data_gets_weight_one_in_both_tools(made, tmp_path):
    """One expert of one routed entry without tokens (fewer than round(5%): ik stores it): both
    tools read weight 1.0 for it from the .dat and quantize that expert with it."""
    raw = RawImatrix.from_file(made.gguf, CTX)
    name = routed(made.tensors)[0]
    counts, sums = raw.counts[name], raw.sums[name].reshape(raw.counts[name].size, -1)
    # the tiny model's router leaves many experts without a token: give them made-up data, but one
    fill = counts == 0
    counts[fill], sums[fill] = 20, np.random.default_rng(2).random((int(fill.sum()), sums.shape[1])) * 20
    counts[5], sums[5] = 0, 0.0
    assert name not in raw.skipped("ik")
    dat = raw.save(tmp_path / "one-missing.dat", "ik")
    imat = load_imatrix(dat)
    n_in, _, n_mat = made.tensors[name]
    assert (imat.weights_for(name, n_in, n_mat)[5] == 1.0).all()
    out = tmp_path / "theirs.gguf"
    rc, log = llama_quantize(*made.llama_quantize_options(), "--imatrix", dat, made.model, out, "Q4_0", 2)
    assert rc == 0 and name not in not_found(log), log[-3000:]
    check_bytes_use_weights(made, out, imat, [name])


def test_collect_says_which_experts_got_no_token_and_what_was_stored(made, tmp_path):
    text = calibration_text(tmp_path / "t.txt")
    r = quantkit.collect_imatrix(made.model, text, tmp_path / "ik.gguf", ctx_size=SHORT, chunks=1, threads=1,
                                 partial_experts="ik")
    raw = RawImatrix.from_file(made.short, SHORT)
    skipped = raw.skipped("ik")
    assert r.partial == raw.never_fired() and r.entries == len(raw.sums) - len(skipped)
    assert set(RawImatrix.from_file(tmp_path / "ik.gguf", SHORT).sums) == set(raw.sums) - set(skipped)
    lines = {w.split(":")[0]: w for w in r.warnings}
    for name, experts in r.partial.items():
        assert f"{len(experts)} of {raw.counts[name].size} experts got no token" in lines[name]
        assert ("not stored" if name in skipped else "stored: quantize gives them weight 1") in lines[name]
    assert any(w.startswith(f"stored {r.entries} of {len(raw.sums)} entries") for w in r.warnings)
    with pytest.raises(QuantkitError, match="partial_experts"):
        quantkit.collect_imatrix(made.model, text, tmp_path / "x.gguf", ctx_size=SHORT, chunks=1,
                                 partial_experts="drop")


def test_cli_writes_with_the_ik_policy(made, tmp_path, capsys):
    """`quantkit imatrix convert --partial-experts ik` (and merge, collect: the same option) leaves
    out what ik's llama-imatrix leaves out; an unknown policy is a usage error."""
    from quantkit.cli import main
    out = tmp_path / "ik.dat"
    assert main(["imatrix", "convert", str(made.short), str(out), "-c", str(SHORT), "--partial-experts", "ik"]) == 0
    raw = RawImatrix.from_file(made.short, SHORT)
    assert set(load_imatrix(out).weights) == set(raw.sums) - set(raw.skipped("ik"))
    assert main(["imatrix", "merge", str(made.short), str(made.short), "-o", str(tmp_path / "m.gguf"),
                 "--partial-experts", "ik"]) == 0
    assert set(RawImatrix.from_file(tmp_path / "m.gguf", SHORT).sums) == set(load_imatrix(out).weights)
    assert main(["imatrix", "convert", str(made.short), str(tmp_path / "x.dat"), "--partial-experts", "drop"]) == 2
    assert "drop" in capsys.readouterr().err and not (tmp_path / "x.dat").exists()


# ---- hostile fused files ----

def test_fused_gate_up_shapes_are_checked(tmp_path):
    """A fused tensor whose rows are not two halves of the down experts' n_ff, or a layer with both
    the fused and a split tensor, is refused at load, naming the tensor."""
    small = dict(DEEPSEEK2, n_expert=4, n_layer=2)
    path = write_deepseek2(tmp_path / "fused.gguf", fused_gate_up=True, **small)
    rng = np.random.default_rng(0)
    n_e, n_ff, n_embd = small["n_expert"], small["n_ff_exp"], small["n_embd"]
    bad = {"odd": {"blk.1.ffn_gate_up_exps.weight": rng.standard_normal((n_e, 2 * n_ff + 1, n_embd))},
           "short": {"blk.1.ffn_gate_up_exps.weight": rng.standard_normal((n_e, n_ff, n_embd))},
           "both": {"blk.1.ffn_up_exps.weight": rng.standard_normal((n_e, n_ff, n_embd))}}
    words = {"odd": ("tensor 'blk.1.ffn_gate_up_exps.weight'", "expected"),
             "short": ("tensor 'blk.1.ffn_down_exps.weight'", "n_ff from ffn_gate_up_exps"),
             "both": ("blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_up_exps.weight", "twice")}
    for case, tensors in bad.items():
        with open_model(rewrite_gguf(path, tmp_path / f"{case}.gguf", tensors=tensors)) as g:
            with pytest.raises(QuantkitError) as e:
                Model(g, ops_cpu)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words[case]), (case, str(e.value))


def test_fused_gpt_oss_biases_are_checked(tmp_path):
    """gpt-oss's fused experts need ffn_gate_up_exps.bias of (2 n_ff, n_expert): one of the split
    length, or none, is refused at load, naming it."""
    small = dict(GPTOSS, n_expert=4, n_layer=1, expert_type_id=F32_ID)
    path = write_gptoss(tmp_path / "fused.gguf", fused_gate_up=True, **small)
    with open_model(path) as g:
        Model(g, ops_cpu)
    name = "blk.0.ffn_gate_up_exps.bias"
    for case, bias in {"short": np.zeros((small["n_expert"], small["n_ff_exp"]), np.float32), "none": None}.items():
        with open_model(rewrite_gguf(path, tmp_path / f"{case}.gguf", tensors={name: bias})) as g:
            with pytest.raises(QuantkitError) as e:
                Model(g, ops_cpu)
        assert "\n" not in str(e.value) and name in str(e.value), (case, str(e.value))
