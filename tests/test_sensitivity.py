"""quantkit.sensitivity: fast (imatrix-weighted, sampled) and measured (in-process KLD) group
sensitivities, their calibration and their cache (issue 27 part 4)."""
from __future__ import annotations

import json
import math
import os
import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest

import runtime_twins
from models import rewrite_gguf, write_deepseek2, write_llama

from quantkit import api, formats
from quantkit import sensitivity as S
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.groups import make_groups
from quantkit.imatrix import save_dat
from quantkit.quantize import to_float32
from quantkit.runtime.kernels import kl_divergence_rows
from quantkit.sensitivity_cache import SensitivityCache, file_fingerprint, fingerprint
from quantkit.types import QuantType as T

TYPES = [T.Q8_0, T.Q4_K, T.Q2_K]
N_CTX = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny f32 llama with a byte-level vocabulary (any text tokenizes) and a random imatrix."""
    d = tmp_path_factory.mktemp("sens")
    path = write_llama(d / "llama.gguf", n_layer=2, n_embd=256, n_ff=512, n_vocab=512, vocab=True, seed=3)
    rng = np.random.default_rng(5)
    with open_model(path) as m:
        weights = {t.name: rng.gamma(0.5, 1.0, t.shape[0]).astype(np.float32)
                   for t in m.tensors if t.n_dims == 2 and t.name != "token_embd.weight"}
    imatrix = save_dat(d / "llama.imatrix.dat", weights)
    text = d / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog; 0123456789. " * 4
                     + "Quantization keeps the weights a model needs. ") * 8)
    return SimpleNamespace(path=path, imatrix=imatrix, text=text, dir=d, weights=weights)


@pytest.fixture(scope="module")
def llama_groups(llama):
    with open_model(llama.path) as m:
        return make_groups(m, TYPES)


def fast(llama, tensors, **kw):
    return S.fast_error(S.FastJob(str(llama.path), tuple(tensors), **kw))


def measure(llama, tensors, **kw):
    return S.measured_kld(S.MeasureJob(str(llama.path), tuple(tensors), str(llama.text), n_ctx=N_CTX, **kw))


# ---------------------------------------------------------------- fast

@pytest.mark.parametrize("imatrix", [False, True])
def test_fast_error_orders_types(llama, imatrix):
    im = str(llama.imatrix) if imatrix else None
    for names in (["blk.0.ffn_down.weight"], ["blk.1.attn_q.weight", "blk.1.attn_k.weight"]):
        errors = [fast(llama, [(n, t) for n in names], imatrix=im) for t in TYPES]
        assert 0 < errors[0] < errors[1] < errors[2], errors


def test_fast_error_is_the_weighted_squared_error(llama):
    """Unsampled, the estimate is exactly Σ imat_j (w_j - q_j)² over the tensor's rows."""
    name = "blk.1.ffn_up.weight"
    with open_model(llama.path) as m:
        info = m.by_name[name]
        x = to_float32(info, slice(0, info.n_rows))
    imat = llama.weights[name]
    d = formats.dequantize(formats.quantize(x, T.Q4_K, imat), T.Q4_K, x.shape[1])
    want = float((imat * (x.astype(np.float64) - d) ** 2).sum())
    got = fast(llama, [(name, T.Q4_K)], imatrix=str(llama.imatrix), max_elements=1 << 30)
    assert got == pytest.approx(want, rel=1e-9)
    plain = float(((x.astype(np.float64) - formats.dequantize(formats.quantize(x, T.Q4_K), T.Q4_K, x.shape[1])) ** 2).sum())
    assert fast(llama, [(name, T.Q4_K)], max_elements=1 << 30) == pytest.approx(plain, rel=1e-9)


def test_imatrix_changes_the_estimate(llama):
    name = [("blk.0.ffn_gate.weight", T.Q4_K)]
    with_im = fast(llama, name, imatrix=str(llama.imatrix))
    without = fast(llama, name)
    assert with_im != pytest.approx(without, rel=0.05)
    # the flavor decides the imatrix lookup (mainline: the tensor's own entry only); here both have it
    assert fast(llama, name, imatrix=str(llama.imatrix), flavor="mainline") > 0


def test_sampled_close_to_full(llama):
    name = [("blk.0.ffn_up.weight", T.Q2_K)]       # 512 rows of 256
    full = fast(llama, name, max_elements=1 << 30)
    sampled = [fast(llama, name, max_elements=128 * 256, seed=s) for s in range(3)]
    assert sampled[0] == fast(llama, name, max_elements=128 * 256, seed=0)      # deterministic
    assert len(set(sampled)) == 3                                               # other rows, other seed
    for v in sampled:
        assert v == pytest.approx(full, rel=0.15)


def test_unchanged_type_costs_nothing(llama):
    """The type the input already has is a copy in the plan: no new error, no new KLD."""
    assert fast(llama, [("blk.0.attn_v.weight", T.F32)]) == 0.0
    assert measure(llama, [("blk.0.attn_v.weight", T.F32)]) == 0.0


def test_fast_error_experts_sampled_with_per_expert_imatrix(tmp_path):
    path = write_deepseek2(tmp_path / "ds.gguf", n_layer=2, n_dense=1, n_expert=8, n_ff_exp=256)
    name = "blk.1.ffn_down_exps.weight"
    with open_model(path) as m:
        shape = m.by_name[name].shape                    # (256, 256, 8): 8 experts of 256 rows
    rng = np.random.default_rng(0)
    per_expert = rng.gamma(0.5, 1.0, (shape[2], shape[0])).astype(np.float32)
    per_expert[3] *= 100                                # one expert's columns matter far more
    imatrix = save_dat(tmp_path / "ds.dat", {name: per_expert.reshape(-1)})
    job = dict(imatrix=str(imatrix))
    full = S.fast_error(S.FastJob(str(path), ((name, T.Q4_K),), max_elements=1 << 30, **job))
    sampled = S.fast_error(S.FastJob(str(path), ((name, T.Q4_K),), max_elements=shape[0] * 512, **job))
    assert sampled == pytest.approx(full, rel=0.35)
    flat = S.fast_error(S.FastJob(str(path), ((name, T.Q4_K),), max_elements=1 << 30))
    assert full > 3 * flat                               # expert 3 counts 100 times (the others ~0.5)


def test_bad_type_or_tensor_is_one_line(llama, tmp_path):
    small = write_llama(tmp_path / "small.gguf", n_layer=1, n_embd=128, n_ff=128, n_vocab=300, vocab=True)
    for run in (S.fast_error, S.measured_kld):
        with pytest.raises(QuantkitError, match="not a multiple of q4_K's block of 256"):
            run(S.FastJob(str(small), (("blk.0.ffn_down.weight", T.Q4_K),)) if run is S.fast_error else
                S.MeasureJob(str(small), (("blk.0.ffn_down.weight", T.Q4_K),), str(llama.text), n_ctx=N_CTX))
    with pytest.raises(QuantkitError, match="'blk.9.ffn_down.weight' is missing"):
        fast(llama, [("blk.9.ffn_down.weight", T.Q4_K)])


def test_fast_error_on_an_hf_checkpoint_is_the_gguf_one(tmp_path):
    """Fast mode reads HF checkpoints as the quantize pipeline does (the converter's rows)."""
    from hf_models import write_tiny_llama
    hf = write_tiny_llama(tmp_path / "hf", n_layer=1, n_embd=64, n_ff=128, n_head=2)
    gguf_path = tmp_path / "hf.gguf"
    api.quantize_model(hf, gguf_path, "f32")
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        job = dict(tensors=((name, T.Q4_0),), max_elements=1 << 30)
        on_hf = S.fast_error(S.FastJob(str(hf), **job))
        assert on_hf > 0 and on_hf == S.fast_error(S.FastJob(str(gguf_path), **job))
    S.release()


def test_jobs_pickle(llama, llama_groups):
    jobs = S.fast_jobs(llama_groups, llama.path, imatrix=llama.imatrix)
    assert len(jobs) == sum(len(g.options) for g in llama_groups.groups)
    key, job = jobs[0]
    again = pickle.loads(pickle.dumps(job))
    assert again == job and again.settings() == job.settings()
    assert job.settings()["imatrix"] == file_fingerprint(llama.imatrix)


# ---------------------------------------------------------------- measured

def test_measured_kld_positive_and_ordered(llama):
    klds = [measure(llama, [("blk.0.ffn_down.weight", t)]) for t in TYPES]
    assert 0 < klds[0] < klds[1] < klds[2], klds


def _file_kld(llama, tmp_path, rules: str) -> float:
    """The KLD `quantkit perplexity --kl-divergence` reports for a file quantized with ``rules``."""
    base = tmp_path / "base.kld"
    if not base.exists():
        api.perplexity(llama.path, llama.text, ctx_size=N_CTX, chunks=1, kl_divergence_base=base)
    recipe = tmp_path / "recipe.txt"
    recipe.write_text(rules)
    out = tmp_path / "q.gguf"
    api.quantize_model(llama.path, out, "f32", custom_q=[str(recipe)], imatrix=llama.imatrix and str(llama.imatrix))
    return api.kl_divergence(out, base).summary()["kld"]["mean"][0]


@pytest.mark.parametrize("tensors", [
    [("blk.1.ffn_down.weight", T.Q2_K)],                                     # starts at layer 1
    [("blk.0.attn_v.weight", T.Q2_K), ("blk.0.attn_output.weight", T.Q2_K)],
    [("output.weight", T.Q2_K)],                                              # the head alone
    [("token_embd.weight", T.Q2_K)],                                          # from the embedding
])
def test_measured_kld_is_the_quantized_files_kld(llama, tmp_path, tensors):
    """In memory, from the first changed layer, the KLD is the one of the file quantize writes
    (the file's base stores log-probs in 16 bits and drops those below e^-16: close, not equal)."""
    got = measure(llama, tensors, imatrix=str(llama.imatrix))
    rules = "".join(f"^{re.escape(name)}$={t.name.lower()}\n" for name, t in tensors)
    want = _file_kld(llama, tmp_path, rules)
    assert got == pytest.approx(want, rel=0.03), (got, want)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, llama):
    """A tiny DeepSeek-V3-shaped model (MLA, routed and shared experts) with the byte vocabulary."""
    d = tmp_path_factory.mktemp("ds")
    src = write_deepseek2(d / "plain.gguf", n_layer=3, n_dense=1, n_vocab=512)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(512 - len(tokens))]
    keys = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 512,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 253, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    return SimpleNamespace(path=rewrite_gguf(src, d / "ds.gguf", keys), text=llama.text, imatrix=None, dir=d)


@pytest.mark.parametrize("tensors", [
    [("blk.2.ffn_down_exps.weight", T.Q2_K)],
    [("blk.1.attn_kv_a_mqa.weight", T.Q4_K), ("blk.1.attn_q_b.weight", T.Q4_K)],
])
def test_measured_kld_deepseek_is_the_quantized_files_kld(deepseek, tmp_path, tensors):
    got = S.measured_kld(S.MeasureJob(str(deepseek.path), tuple(tensors), str(deepseek.text), n_ctx=N_CTX))
    want = _file_kld(deepseek, tmp_path, "".join(f"^{re.escape(n)}$={t.name.lower()}\n" for n, t in tensors))
    assert got > 0 and got == pytest.approx(want, rel=0.03), (got, want)


def test_kl_divergence_rows_kernel_matches_its_twin():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((5, 300)) * 4).astype(np.float32)
    base = logits + rng.standard_normal(logits.shape).astype(np.float32) * 0.1
    base_lp = base.astype(np.float64) - base.max(axis=1, keepdims=True)
    base_lp -= np.log(np.exp(base_lp).sum(axis=1, keepdims=True))
    p, plp = np.exp(base_lp), (np.exp(base_lp) * base_lp).sum(axis=1)
    out = np.empty(5)
    kl_divergence_rows(logits, p, plp, out)
    direct = (p * (base_lp - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True) ** -1
                                    * np.exp(logits.astype(np.float64))))).sum(axis=1)
    np.testing.assert_allclose(out, runtime_twins.kl_divergence_rows(logits, p, plp), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(out, direct, rtol=1e-7)
    assert (out > 0).all()
    kl_divergence_rows(base.astype(np.float32), p, plp, out)
    assert np.abs(out).max() < 1e-9                    # a model's divergence from itself


def test_first_layer():
    assert S.first_layer(["blk.3.attn_q.weight", "blk.2.ffn_up.weight"], 30) == 2
    assert S.first_layer(["output.weight"], 30) == 30
    assert S.first_layer(["blk.61.ffn_down.weight"], 61) == 61          # an MTP block: the head alone
    assert S.first_layer(["blk.5.attn_q.weight", "token_embd.weight"], 30) == -1


def test_measured_needs_gguf(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    with pytest.raises(QuantkitError, match="needs a GGUF"):
        S.measured_kld(S.MeasureJob(str(d), (("x", T.Q4_K),), str(tmp_path / "t.txt")))


def test_measure_jobs_and_sample(llama, llama_groups):
    picks = S.measure_sample(llama_groups, 5)
    assert len(picks) == len(set(picks)) == 5
    kinds = {llama_groups.group(k).kind for k, _ in picks}
    assert len(kinds) >= min(5, len({g.kind for g in llama_groups.groups}))
    jobs = S.measure_jobs(llama_groups, picks, llama.path, llama.text, n_ctx=N_CTX)
    assert [k for k, _ in jobs] == picks
    with pytest.raises(QuantkitError, match="no group"):
        S.measure_jobs(llama_groups, [("blk.7.attn", "q4_K")], llama.path, llama.text)


# ---------------------------------------------------------------- calibration

def _groupset(*groups):
    def option(q):
        return SimpleNamespace(qtype=q, types={}, nbytes={"cpu": 1}, bytes_per_token={"cpu": 1})

    def layers(key):
        return (int(key.split(".")[1]),) if key.startswith("blk.") else ()
    return SimpleNamespace(groups=[SimpleNamespace(key=k, kind=kind, layers=layers(k), options=[option(q) for q in TYPES])
                                   for k, kind in groups], flavor="ik")


def test_calibrate_fits_a_factor_per_kind():
    gs = _groupset(("blk.0.attn", "attn"), ("blk.1.attn", "attn"), ("blk.0.ffn_down", "ffn_down"),
                   ("output", "output"))
    fast = {(g.key, t): e for g in gs.groups for t, e in (("q8_0", 1.0), ("q4_K", 10.0), ("q2_K", 100.0))}
    measured = {("blk.0.attn", "q2_K"): 2.0, ("blk.1.attn", "q4_K"): 0.5,          # attn: 0.02 and 0.05
                ("blk.0.ffn_down", "q4_K"): 3.0,                                  # ffn_down: 0.3
                ("output", "q8_0"): 0.0}                                          # says nothing
    p = S.calibrate(gs, fast, measured)
    assert p.factor("attn") == pytest.approx(math.sqrt(0.02 * 0.05))
    assert p.factor("ffn_down") == pytest.approx(0.3)
    assert p.samples == {"attn": 2, "ffn_down": 1}
    overall = (0.02 * 0.05 * 0.3) ** (1 / 3)
    assert p.factor("output") == pytest.approx(overall)                             # no sample: all kinds
    g = {x.key: x for x in gs.groups}
    q2, q8 = g["output"].options[2], g["output"].options[0]
    assert p.kld(g["output"], q2) == pytest.approx(overall * 100)
    assert p.kld(g["output"], q8) == 0.0                                             # measured wins
    assert p.kld(g["blk.0.attn"], g["blk.0.attn"].options[2]) == 2.0
    # attn has samples at two depths: its factor follows them (0.02 at layer 0, 0.05 at layer 1)
    assert p.kld(g["blk.1.attn"], g["blk.1.attn"].options[0]) == pytest.approx(0.05)
    assert p.kld(g["blk.0.attn"], g["blk.0.attn"].options[1]) == pytest.approx(0.02 * 10)
    assert p.factor("attn", 0.5) == pytest.approx(math.sqrt(0.02 * 0.05))      # between: log-linear
    assert p.factor("attn", 7) == pytest.approx(0.05)                            # beyond: the end value
    assert p.spread["attn"] == pytest.approx(0.0, abs=1e-12) and p.spread["ffn_down"] == 0.0
    assert S.calibrate(gs, fast, {}).factor("attn") == 1.0                          # nothing measured
    json.dumps(p.to_json())
    with pytest.raises(QuantkitError, match="no sensitivity"):
        S.calibrate(gs, {}, {}).kld(g["output"], q2)


def test_calibration_on_the_model_predicts_measured(llama, llama_groups):
    """A factor fitted on measured samples of a kind predicts that kind's other samples within 2x."""
    keys = [("blk.0.ffn_down", "q2_K"), ("blk.1.ffn_down", "q4_K"), ("blk.1.ffn_down", "q2_K")]
    fast = S.cached_run(S.fast_error, [kj for kj in S.fast_jobs(llama_groups, llama.path) if kj[0] in keys])
    measured = S.cached_run(S.measured_kld, S.measure_jobs(llama_groups, keys, llama.path, llama.text, n_ctx=N_CTX))
    p = S.calibrate(llama_groups, fast, {k: measured[k] for k in keys[:2]})
    g = llama_groups.group("blk.1.ffn_down")
    predicted = p.factor("ffn_down", 1.0) * fast[keys[2]]         # layer 1's factor (from its q4_K sample)
    assert measured[keys[2]] / 2 < predicted < measured[keys[2]] * 2
    assert p.kld(g, g.option(T.Q2_K)) == predicted


# ---------------------------------------------------------------- cache

def test_cache_resumes_and_skips_corrupt_lines(tmp_path, llama):
    path = tmp_path / "c" / "sens.jsonl"
    settings = {"flavor": "ik", "seed": 0}
    with SensitivityCache(path) as c:
        assert len(c) == 0 and not path.exists()
        c.put("fp1", "fast", settings, "blk.0.attn", {"blk.0.attn_q.weight": T.Q4_K}, 1.5)
        c.put("fp1", "fast", settings, "blk.0.attn", {"blk.0.attn_q.weight": "q2_K"}, 7.0)
    with open(path, "a") as f:
        f.write('{"fp": "fp1", "mode": "fast", "settings": {}, "key": "x", "types": {}, "value": NaN}\n')
        f.write("not json\n[1, 2]\n")
        f.write('{"fp": "fp1", "mode": "fast", "settings": {"flavor": "ik", "seed": 0}, "key": "cut')  # cut short
    c = SensitivityCache(path)
    assert c.skipped == 4 and len(c) == 2
    assert c.get("fp1", "fast", settings, "blk.0.attn", {"blk.0.attn_q.weight": "q4_K"}) == 1.5
    assert c.get("fp1", "fast", settings, "blk.0.attn", {"blk.0.attn_q.weight": T.Q2_K}) == 7.0
    assert c.get("fp2", "fast", settings, "blk.0.attn", {"blk.0.attn_q.weight": T.Q2_K}) is None
    assert c.get("fp1", "measured", settings, "blk.0.attn", {"blk.0.attn_q.weight": T.Q2_K}) is None
    assert c.get("fp1", "fast", {"flavor": "ik", "seed": 1}, "blk.0.attn", {"blk.0.attn_q.weight": T.Q2_K}) is None
    c.put("fp1", "fast", settings, "blk.1.attn", {"blk.1.attn_q.weight": T.Q2_K}, 3.0)   # after the cut line
    c.close()
    assert SensitivityCache(path).get("fp1", "fast", settings, "blk.1.attn", {"blk.1.attn_q.weight": "q2_K"}) == 3.0
    assert oct(os.stat(path).st_mode & 0o777) != oct(0o600)


def test_cached_run_computes_only_what_is_missing(tmp_path, llama, llama_groups):
    jobs = [kj for kj in S.fast_jobs(llama_groups, llama.path) if kj[0][0] == "blk.0.attn"]
    calls = []

    def counting(job):
        calls.append(job)
        return S.fast_error(job)

    def interrupted(fn, jobs, on_result=None):     # a run stopped after its first result
        on_result(0, fn(jobs[0]))
        raise KeyboardInterrupt

    path = tmp_path / "sens.jsonl"
    with SensitivityCache(path) as c, pytest.raises(KeyboardInterrupt):
        S.cached_run(counting, jobs, cache=c, model_fp="fp", run=interrupted)
    assert len(calls) == 1
    seen = []
    with SensitivityCache(path) as c:
        out = S.cached_run(counting, jobs, cache=c, model_fp="fp", on_result=lambda k, v, cached: seen.append(cached))
    assert len(calls) == len(jobs) and seen.count(True) == 1             # the first came from the cache
    assert list(out) == [k for k, _ in jobs]
    with SensitivityCache(path) as c:
        again = S.cached_run(counting, jobs, cache=c, model_fp="fp")
    assert again == out and len(calls) == len(jobs)


def test_cache_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(QuantkitError, match="not a regular file"):
        SensitivityCache(fifo)


def test_fingerprint_follows_content(tmp_path):
    a = write_llama(tmp_path / "a.gguf", n_layer=1, seed=1)
    b = write_llama(tmp_path / "b.gguf", n_layer=1, seed=1)
    c = write_llama(tmp_path / "c.gguf", n_layer=1, seed=2)
    with open_model(a) as ma, open_model(b) as mb, open_model(c) as mc:
        fa = fingerprint(ma)
        assert fa == fingerprint(mb) and fa != fingerprint(mc)
        info = ma.by_name["blk.0.ffn_down.weight"]
        offset = info.offset
    data = bytearray(b.read_bytes())
    data[offset] ^= 1                                   # one bit of one tensor's first bytes
    b.write_bytes(bytes(data))
    with open_model(b) as mb:
        assert fingerprint(mb) != fa
    assert file_fingerprint(a) != file_fingerprint(b)
