"""Top-k KL-divergence bases (perplexity --kld-top-k K, quantkit/runtime/kld_topk.py).

* The bound: on a tiny llama whose output layer makes peaked distributions, against a perturbed
  copy, the top-k KLD (in memory, ``topk_kld``) is at most the full KLD at every position, grows with
  k and is the full KLD at k = n_vocab.
* The file: written by ``quantkit.perplexity(..., kld_top_k=K)`` (its size 8K + 8 bytes a position),
  read back by ``quantkit.kl_divergence`` by its magic: the KLD what ``topk_kld`` gives in memory,
  the other statistics those of the full base (the same positions, top tokens, perplexities).
* Hostile files: every field of a valid file broken in turn is refused naming the row and the
  rule, before any statistic is computed; the file unchanged.
* The CLI in-process: the option's misuses are one-line refusals that leave no file, the summary
  says the KLD is a top-k one.
"""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest

import quantkit
from hostile import Snapshot, assert_refused
from models import rewrite_gguf, write_llama
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
from quantkit.runtime.kld_topk import HEADER, TopkLogitsFile, TopkWriter, record_dtype, topk_kld, topk_of
from quantkit.runtime.model import Model
from quantkit.runtime.perplexity import read_base
from quantkit.runtime.scoring import log_softmax, scored_span

LLAMA = dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, vocab=True)
N_VOCAB = LLAMA["n_vocab"]
TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods " * 40
CTX, CHUNKS = 32, 3
PER_CHUNK = CTX - 1 - CTX // 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A base whose output rows are large (logits of a few units: peaked distributions, as a
    trained model's) and a "quantized" copy: its output rows with 5% noise."""
    d = tmp_path_factory.mktemp("kld-topk")
    rng = np.random.default_rng(1)
    out_w = rng.standard_normal((N_VOCAB, LLAMA["n_embd"])).astype(np.float32) * 0.6
    noisy = out_w + rng.standard_normal(out_w.shape).astype(np.float32) * 0.03
    plain = write_llama(d / "plain.gguf", **LLAMA)
    base = rewrite_gguf(plain, d / "base.gguf", tensors={"output.weight": out_w})
    quant = rewrite_gguf(plain, d / "quant.gguf", tensors={"output.weight": noisy})
    (d / "text.txt").write_text(TEXT)
    return {"dir": d, "base": base, "quant": quant, "text": d / "text.txt"}


def chunk_logits(path, tokens) -> np.ndarray:
    with open_model(path) as g:
        m = Model(g, ops_cpu)
        return m.forward(np.asarray(tokens), m.new_cache(len(tokens)))


def scored_logits(path, chunk) -> np.ndarray:
    """The logits a perplexity run scores of ``chunk`` (scored_span), computed as the run does: the
    output head over those positions alone.  Its float32 weights go through BLAS, and with some
    of OpenBLAS's kernels (Haswell's, which it picks on a Zen 5) a product's last bits depend on
    how many tokens it multiplies at once."""
    first, n = scored_span(len(chunk))
    with open_model(path) as g:
        m = Model(g, ops_cpu)
        return m.forward(np.asarray(chunk), m.new_cache(len(chunk)), logits_from=first)[:n]


@pytest.fixture(scope="module")
def logits(tiny):
    rng = np.random.default_rng(2)
    tokens = rng.integers(3, N_VOCAB, 48)
    return chunk_logits(tiny["base"], tokens), chunk_logits(tiny["quant"], tokens)


@pytest.fixture(scope="module")
def bases(tiny):
    """The full base and a top-8 base of the same chunks, written through the library."""
    d = tiny["dir"]
    full = quantkit.perplexity(tiny["base"], tiny["text"], ctx_size=CTX, chunks=CHUNKS,
                               kl_divergence_base=d / "full.kld", threads=1)
    top = quantkit.perplexity(tiny["base"], tiny["text"], ctx_size=CTX, chunks=CHUNKS,
                              kl_divergence_base=d / "top8.kld", kld_top_k=8, threads=1)
    return {"full": d / "full.kld", "top8": d / "top8.kld", "ppl": full.ppl, "ppl_top": top.ppl}


# ---- the bound ----

def test_topk_kld_is_a_lower_bound_that_reaches_the_full_kld(logits):
    p, q = logits
    lp, lq = log_softmax(p), log_softmax(q)
    full = (np.exp(lp) * (lp - lq)).sum(axis=1)
    assert full.mean() > 1e-3                          # a divergence worth bounding
    prev = np.zeros_like(full)
    means = {}
    for k in (1, 2, 8, 32, 128, N_VOCAB - 1, N_VOCAB):
        kld = topk_kld(topk_of(p, k), q)
        assert (kld <= full + 1e-12).all(), k
        assert (kld >= prev - 1e-12).all(), k          # a finer partition never loses divergence
        prev = kld
        means[k] = kld.mean()
    np.testing.assert_allclose(prev, full, rtol=1e-10, atol=1e-15)
    assert means[8] < means[32] < means[128] < means[N_VOCAB]
    assert means[8] > 0.5 * means[N_VOCAB]              # peaked distributions: a few tokens hold most of it


def test_topk_of_orders_by_probability_then_id():
    lp = log_softmax(np.array([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]]))
    top = topk_of(np.array([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]], np.float32), 3)
    assert top.ids.tolist() == [[1, 3, 2]]                 # the tie at the third place: the lower id
    np.testing.assert_allclose(np.exp(top.logp).sum() + np.exp(top.log_rest), 1.0)
    np.testing.assert_allclose(top.log_rest, np.log(np.exp(lp[0, [0, 4, 5]]).sum()))
    whole = topk_of(np.array([[0.0, 2.0, 1.0]], np.float32), 3)
    assert whole.log_rest.tolist() == [-np.inf]
    assert topk_kld(whole, np.array([[1.0, 1.0, 1.0]], np.float32))[0] > 0      # no NaN from 0 log 0
    with pytest.raises(QuantkitError, match="between 1 and the vocabulary's 3"):
        topk_of(np.zeros((1, 3), np.float32), 4)
    with pytest.raises(QuantkitError, match="the base has 1 positions, the logits 2"):
        topk_kld(whole, np.zeros((2, 3), np.float32))
    none = topk_of(np.zeros((0, 3), np.float32), 2)
    assert none.ids.shape == (0, 2) and topk_kld(none, np.zeros((0, 3), np.float32)).shape == (0,)


def test_topk_of_breaks_every_tie_by_id():
    """Logits of four values (ties everywhere): the top k are those of a sort by probability then
    id, whatever argpartition kept at the k-th place."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(20, 200))
        x = rng.integers(0, 4, (3, n)).astype(np.float32)
        k = int(rng.integers(1, n + 1))
        top = topk_of(x, k)
        for r in range(3):
            assert top.ids[r].tolist() == np.lexsort((np.arange(n), -x[r]))[:k].tolist(), (n, k)
        assert (top.ids[:, 0] == np.argmax(x, axis=1)).all()


def test_rest_mass_is_summed_not_subtracted():
    """A rest of 1e-20 (1 - sum of the top-k is 0 in float64) keeps its value: the KLD term of a
    model that gives the rest 1e-10 is not lost, nor made infinite."""
    p = np.array([[0.0, -46.0, -46.0]], np.float32)
    q = np.array([[0.0, -23.0, -23.0]], np.float32)
    top = topk_of(p, 1)
    assert np.isfinite(top.log_rest[0]) and abs(top.log_rest[0] - (np.log(2) - 46)) < 1e-6
    kld = topk_kld(top, q)[0]
    lp, lq = log_softmax(p), log_softmax(q)
    full = (np.exp(lp) * (lp - lq)).sum()
    assert 0 < kld <= full and kld == pytest.approx(full, rel=1e-6)


# ---- the file ----

def test_topk_base_file_round_trip(tiny, bases, logits, monkeypatch):
    from quantkit.runtime import kld_topk
    monkeypatch.setattr(kld_topk, "BLOCK_ROWS", 4)      # positions in blocks, a short one last
    path = bases["top8"]
    n_pos = CHUNKS * PER_CHUNK
    assert path.stat().st_size == HEADER.size + 4 * CTX * CHUNKS + (8 * 8 + 8) * n_pos
    assert bases["ppl_top"] == bases["ppl"]           # writing a base changes no result
    f = read_base(path)
    assert isinstance(f, TopkLogitsFile) and (f.n_ctx, f.n_vocab, f.k, len(f.chunks)) == (CTX, N_VOCAB, 8, CHUNKS)
    # the rows are the base model's top 8 of those chunks, in float32
    chunk = f.chunks[1]
    p = scored_logits(tiny["base"], chunk)
    want = topk_of(p, 8)
    top, target_lp = f.rows(PER_CHUNK, 2 * PER_CHUNK)
    assert (top.ids == want.ids).all()
    np.testing.assert_array_equal(top.logp, want.logp.astype(np.float32))
    np.testing.assert_array_equal(target_lp, log_softmax(p)[np.arange(PER_CHUNK), chunk[CTX // 2 + 1:]]
                                  .astype(np.float32))
    # --kl-divergence on it: the KLD is topk_kld's, the rest as from the full base
    stats = quantkit.kl_divergence(tiny["quant"], path, threads=1)
    q = scored_logits(tiny["quant"], chunk)
    np.testing.assert_allclose(stats.kld[PER_CHUNK:2 * PER_CHUNK], topk_kld((top.ids, top.logp, top.log_rest), q),
                               rtol=1e-6, atol=1e-9)
    doc = stats.summary()
    ref = quantkit.kl_divergence(tiny["quant"], bases["full"], threads=1).summary()
    assert doc["kld_top_k"] == 8 and "kld_top_k" not in ref
    assert doc["positions"] == ref["positions"] == n_pos
    assert doc["ppl"] == ref["ppl"] and doc["same_top_p"] == ref["same_top_p"]
    # the base's perplexity exact (float32 log-probs); the full base's is not here: it stores log-probs
    # more than 16 below the top one as that floor, and this random model's text tokens are such
    assert doc["ppl_base"][0] == pytest.approx(bases["ppl"], rel=1e-6)
    assert ref["ppl_base"][0] < 0.5 * bases["ppl"]
    assert doc["delta_p"]["rms"][0] == pytest.approx(ref["delta_p"]["rms"][0], rel=1e-2, abs=1e-3)
    assert 0 < doc["kld"]["mean"][0] <= ref["kld"]["mean"][0] * 1.01
    assert doc["kld"]["mean"][0] > 0.3 * ref["kld"]["mean"][0]
    same = quantkit.kl_divergence(tiny["base"], path, threads=1).summary()
    assert abs(same["kld"]["mean"][0]) < 1e-6 and same["same_top_p"][0] == 100.0


# ---- hostile files ----

def write_topk(path, n_ctx=8, n_vocab=40, n_chunk=2, k=4, tokens=None, edit=None, head=None, tail=b"",
               stored_tokens=None):
    """A top-k base written by TopkWriter from random logits of ``tokens``, then ``edit(records)``
    applied, the header replaced by ``head`` (a dict of its fields), the tokens by ``stored_tokens``
    and ``tail`` appended where given."""
    rng = np.random.default_rng(3)                  # the logits: the same whatever the tokens
    tokens = np.random.default_rng(4).integers(0, n_vocab, n_ctx * n_chunk) if tokens is None else np.asarray(tokens)
    chunks = [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)]
    with TopkWriter(path, n_ctx, n_vocab, chunks, k) as w:
        for c in chunks:
            w.add(rng.standard_normal((n_ctx - 1 - n_ctx // 2, n_vocab)).astype(np.float32) * 2,
                  c[n_ctx // 2 + 1:])
    raw = bytearray(path.read_bytes())
    off = HEADER.size + 4 * len(tokens)
    rec = np.frombuffer(bytes(raw[off:]), record_dtype(k)).copy()
    if edit is not None:
        edit(rec)
    fields = {**dict(magic=b"_kldtopk", n_ctx=n_ctx, n_vocab=n_vocab, n_chunk=n_chunk, k=k), **(head or {})}
    stored = raw[HEADER.size:off] if stored_tokens is None else np.asarray(stored_tokens, "<i4").tobytes()
    path.write_bytes(HEADER.pack(*fields.values()) + bytes(stored) + rec.tobytes() + tail)
    return path


def _set(field, row, value, col=None):
    def edit(rec):
        if col is None:
            rec[field][row] = value
        else:
            rec[field][row, col] = value
    return edit


def _swap_top_two(rec):
    rec["logp"][3, [0, 1]] = rec["logp"][3, [1, 0]]


def _move_mass(rec):
    rec["log_rest"][2] = np.log(0.5 * np.exp(rec["log_rest"][2]))


def _target_outside_claims_more(rec):
    rec["logp_target"][1] = rec["logp"][1, -1] + 0.5 if rec["logp"][1, -1] + 0.5 <= 0 else 0.0


HOSTILE = [
    (dict(head=dict(n_ctx=2)), "n_ctx must be at least 3"),
    (dict(head=dict(k=0)), "k between 1 and n_vocab"),
    (dict(head=dict(k=41)), "k between 1 and n_vocab"),
    (dict(head=dict(n_vocab=0)), "n_vocab and n_chunk at least 1"),
    (dict(head=dict(n_chunk=-1)), "n_vocab and n_chunk at least 1"),
    (dict(head=dict(n_chunk=1 << 30)), "truncated or inconsistent top-k logits file"),
    (dict(head=dict(k=5)), "truncated or inconsistent"),
    (dict(tail=b"\0"), "means 328 bytes, the file has 329"),
    (dict(stored_tokens=np.r_[np.arange(15), 40]), "token 40 (chunk 2) is outside the file's vocabulary of 40"),
    (dict(stored_tokens=np.r_[-7, np.arange(15)]), "token -7 (chunk 1)"),
    (dict(edit=_set("ids", 4, 40, 2)), "row 4 (chunk 2): a token id is outside the vocabulary of 40"),
    (dict(edit=_set("ids", 0, -1, 0)), "row 0 (chunk 1): a token id is outside"),
    (dict(edit=lambda r: r["ids"].__setitem__((5, 3), r["ids"][5, 0])), "row 5 (chunk 2): a token id appears twice"),
    (dict(edit=_set("logp", 1, np.nan, 2)), "row 1 (chunk 1): log-probabilities must be finite and <= 0"),
    (dict(edit=_set("logp", 2, -np.inf, 3)), "row 2 (chunk 1): log-probabilities must be finite"),
    (dict(edit=_set("logp", 0, 0.5, 0)), "row 0 (chunk 1): log-probabilities must be finite and <= 0"),
    (dict(edit=_set("logp_target", 3, np.inf)), "row 3 (chunk 2): log-probabilities must be finite"),
    (dict(edit=_set("log_rest", 4, np.nan)), "row 4 (chunk 2): the rest's log-probability must be <= 0"),
    (dict(edit=_set("log_rest", 4, 0.1)), "the rest's log-probability must be <= 0"),
    (dict(edit=_swap_top_two), "row 3 (chunk 2): the top-k log-probabilities are not in decreasing order"),
    (dict(edit=_move_mass), "row 2 (chunk 1): its probabilities do not sum to 1"),
    (dict(edit=_target_outside_claims_more), "row 1 (chunk 1): the next token's log-probability disagrees"),
]


@pytest.mark.parametrize("kw, words", HOSTILE, ids=[w for _, w in HOSTILE])
def test_hostile_topk_base_is_refused(tmp_path, kw, words):
    path = write_topk(tmp_path / "bad.kld", **kw)
    with pytest.raises(QuantkitError, match=re.escape(words)):
        read_base(path)


def test_a_next_token_in_the_top_k_must_have_its_log_probability(tmp_path):
    ok = read_base(write_topk(tmp_path / "ok.kld"))
    assert isinstance(ok, TopkLogitsFile) and ok.data.shape == (6,) and ok.k == 4
    tokens = np.concatenate(ok.chunks)
    tokens[5] = ok.rows(0, 1)[0].ids[0, 1]          # row 0 predicts token 5: now its second most probable
    hit = read_base(write_topk(tmp_path / "hit.kld", tokens=tokens))
    top, target_lp = hit.rows(0, 1)
    assert target_lp[0] == top.logp[0, 1]
    path = write_topk(tmp_path / "miss.kld", tokens=tokens, edit=_set("logp_target", 0, target_lp[0] - 0.25))
    with pytest.raises(QuantkitError, match=r"row 0 \(chunk 1\): the next token's log-probability disagrees"):
        read_base(path)


def test_unknown_magic_and_special_files(tmp_path):
    junk = tmp_path / "junk.kld"
    junk.write_bytes(b"_kldtop" + bytes(40))
    with pytest.raises(QuantkitError, match="no '_logits_' magic.* nor a top-k one"):
        read_base(junk)
    short = tmp_path / "short.kld"
    short.write_bytes(b"_kldtopk" + bytes(4))
    with pytest.raises(QuantkitError, match="not a top-k logits file"):
        read_base(short)
    fifo = tmp_path / "fifo.kld"
    os.mkfifo(fifo)
    with pytest.raises(QuantkitError, match="not a regular file"):
        read_base(fifo)


def test_kld_refuses_a_topk_base_of_another_vocabulary(tiny, tmp_path):
    path = write_topk(tmp_path / "v40.kld", n_ctx=CTX, n_vocab=40)
    snap = Snapshot(path, tiny["quant"])
    with pytest.raises(QuantkitError, match="vocabulary of 40, the model 320"):
        quantkit.kl_divergence(tiny["quant"], path, threads=1)
    snap.assert_unchanged()


# ---- the CLI ----

def run_main(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_writes_and_reads_a_topk_base(tiny, tmp_path, capsys):
    base = tmp_path / "top.kld"
    rc, out, err = run_main(capsys, "perplexity", tiny["base"], "-f", tiny["text"], "-c", CTX, "--chunks", 2,
                            "--kl-divergence-base", base, "--kld-top-k", 16, "--threads", 1)
    assert rc == 0, err
    assert struct.unpack("<8siiii", base.read_bytes()[:HEADER.size]) == (b"_kldtopk", CTX, N_VOCAB, 2, 16)
    rc, out, err = run_main(capsys, "perplexity", tiny["quant"], "--kl-divergence-base", base, "--kl-divergence",
                            "--threads", 1)
    assert rc == 0, err
    assert "(from a top-16 base: the KLD over its 16 most probable tokens and the rest, a lower bound of the " \
           "full KLD)" in out.splitlines()
    assert "Mean    KLD:" in out and "Same top p:" in out
    rc, out, err = run_main(capsys, "perplexity", tiny["quant"], "--kl-divergence-base", base, "--kl-divergence",
                            "--threads", 1, "--json")
    assert rc == 0, err
    assert json.loads(out)["kld_top_k"] == 16


@pytest.mark.parametrize("extra, words", [
    (["--kl-divergence-base", "{out}", "--kld-top-k", "321"], "--kld-top-k 321: it must be between 1 and the "
                                                              "model's vocabulary of 320"),
    (["--kld-top-k", "8"], "--kld-top-k K needs --kl-divergence-base FILE"),
    (["--kl-divergence-base", "{out}", "--kld-top-k", "0"], "0 is not in the range x>=1"),
])
def test_cli_refuses_bad_kld_top_k(tiny, tmp_path, capsys, extra, words):
    snap = Snapshot(tmp_path, tiny["base"], tiny["text"])
    rc, out, err = run_main(capsys, "perplexity", tiny["base"], "-f", tiny["text"], "-c", CTX, "--chunks", 1,
                            "--threads", 1, *[a.format(out=tmp_path / "out.kld") for a in extra])
    if "range" in words:                        # click's own usage error: exit 2, as every option's
        assert rc == 2 and words in err
    else:
        assert_refused(rc, out, err, words)
    snap.assert_unchanged()                     # no base file, no temporary left behind


@pytest.mark.parametrize("k", [0, -3, 2.5, "8", True])
def test_library_refuses_bad_kld_top_k(tiny, tmp_path, k):
    snap = Snapshot(tmp_path)
    with pytest.raises(QuantkitError, match=re.escape(f"--kld-top-k: {k!r} is not a whole number >= 1")):
        quantkit.perplexity(tiny["base"], tiny["text"], ctx_size=CTX, chunks=1, kl_divergence_base=tmp_path / "b.kld",
                            kld_top_k=k, threads=1)
    snap.assert_unchanged()


def test_cli_refuses_kld_top_k_when_reading(tiny, bases, capsys):
    rc, out, err = run_main(capsys, "perplexity", tiny["quant"], "--kl-divergence-base", bases["top8"],
                            "--kl-divergence", "--kld-top-k", 8)
    assert_refused(rc, out, err, "--kld-top-k is for writing a base")


def test_cli_refuses_a_corrupt_topk_base(tiny, tmp_path, capsys):
    """The refusal contract through the CLI: exit 1, one line naming the row, nothing changed."""
    path = write_topk(tmp_path / "bad.kld", n_ctx=CTX, n_vocab=N_VOCAB, k=8, edit=_set("ids", 20, N_VOCAB + 7, 1))
    snap = Snapshot(tmp_path, tiny["quant"])
    rc, out, err = run_main(capsys, "perplexity", tiny["quant"], "--kl-divergence-base", path, "--kl-divergence",
                            "--threads", 1)
    assert_refused(rc, out, err, "bad.kld", "corrupt top-k logits row 20 (chunk 2)", "outside the vocabulary of 320")
    snap.assert_unchanged()
