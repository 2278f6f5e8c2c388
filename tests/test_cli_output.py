"""What the commands print, where it goes: output that survives a pipe (issue 23, items 3, 4, 8).

In-process through ``quantkit.cli.main`` with pytest's capture, whose streams are no terminal:
that is the piped case (tee, a log, nohup).  The terminal case is forced where it is tested.

* tables keep every tensor name, rule and note whole off a terminal (they were cut at 80 columns:
  ``blk\\…``, ``toke…``), also with COLUMNS=80 exported (readline does that to child processes);
  on a narrow terminal they fold rather than cut;
* progress off a terminal is a plain line per tensor (quantize, repack) or chunk (imatrix), with
  the share done, elapsed time and ETA; on a terminal it stays a bar;
* perplexity prints llama-perplexity's lines as it goes: ``[1]41.4754,[2]...`` then ``Final
  estimate: PPL = ... +/- ...``, and with --kl-divergence its per-chunk rows and summary;
* a dry run says so (and --json stays pure JSON, with "dry_run": true);
* an interrupted imatrix says how many chunks it saved and the command that resumes it, which
  does (it is run here).
"""
from __future__ import annotations

import io
import json
import re
import shlex

import numpy as np
import pytest

from models import deepseek_v3_tensors, write_llama, write_sparse
from quantkit.cli import main
from quantkit.imatrix import load_imatrix, save_gguf
from quantkit.progress import LINE

# the tiny llama of test_hostile_runtime: a tokenizer, so the runtime commands run it
LLAMA = dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, vocab=True)
TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods " * 40
PER_CHUNK_PRODUCTS = 2 * 7 + 1          # matrix products of one forward pass of the tiny llama


def run_main(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-output")
    (d / "text.txt").write_text(TEXT)
    return {"dir": d, "model": write_llama(d / "llama.gguf", **LLAMA), "text": d / "text.txt"}


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """A full-size (sparse) DeepSeek-V3 tensor table for the shipped IQ2_K_R4 recipe."""
    d = tmp_path_factory.mktemp("dsv3")
    return write_sparse(d / "dsv3.gguf", "deepseek2", {"deepseek2.block_count": 61}, deepseek_v3_tensors())


def plan_args(dsv3, repo_root, tmp_path):
    return ["quantize", dsv3, tmp_path / "out.gguf", "IQ2_K_R4", "--custom-q",
            repo_root / "recipes/deepseek-v3-iq2_k_r4.txt", "--dry-run"]


# ---- tables ----

@pytest.mark.parametrize("columns", [None, "80"])
def test_piped_plan_keeps_every_name_and_rule_whole(dsv3, repo_root, tmp_path, capsys, monkeypatch, columns):
    if columns:
        monkeypatch.setenv("COLUMNS", columns)
    rc, out, err = run_main(capsys, *plan_args(dsv3, repo_root, tmp_path))
    assert rc == 0, err
    assert "…" not in out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 8:                     # a row of the plan: tensor, shape, source, target, size, rule
            rows[cells[1]] = cells[6]
    names = [t[0] for t in deepseek_v3_tensors()]
    assert list(rows) == names                  # every tensor, its whole name on its own row
    assert rows["blk.60.ffn_down_exps.weight"] == r"blk\.60\.ffn_down_exps\.weight=iq3_k_r4"
    assert rows["token_embd.weight"] == r"token_embd\.weight=q8_0"
    assert rows["blk.3.ffn_gate_inp.weight"] == "kept: 'ffn_gate_inp.weight' tensors are never quantized"
    assert r"│ blk\.[1-5][0-9]\.ffn_(gate|up)_exps\.weight=iq2_k_r4 " in out      # the by-rule table
    assert out.rstrip("\n").splitlines()[-1] == "dry run: nothing written"
    assert not (tmp_path / "out.gguf").exists()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_narrow_terminal_folds_names_not_cuts(dsv3, repo_root, tmp_path, monkeypatch):
    """On an 80-column terminal the plan's long names and rules wrap onto the next line, whole."""
    import quantkit.cli as cli
    from quantkit.console import Console
    screen = _Terminal()
    monkeypatch.setattr(cli, "out", Console(file=screen, width=80, color_system=None, highlight=False, markup=False,
                                            emoji=False))
    assert main([str(a) for a in plan_args(dsv3, repo_root, tmp_path)]) == 0
    text = screen.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    first_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.count("│") == 7)
    for name, _, _ in deepseek_v3_tensors()[-12:]:
        assert name in first_column


# ---- progress ----

@pytest.fixture(scope="module")
def q8(tiny):
    return tiny["dir"] / "llama-q8_0.gguf"


def test_piped_quantize_and_repack_print_a_line_per_tensor(tiny, q8, tmp_path, capsys):
    rc, out, err = run_main(capsys, "quantize", tiny["model"], q8, "q8_0", "--threads", "1")
    assert rc == 0, err
    lines = err.splitlines()
    assert len(lines) == 21 and all(LINE.match(x) for x in lines), err       # 21 tensors, nothing else
    assert lines[0].startswith("quantize: [ 1/21] token_embd.weight f32 -> q8_0: ")
    assert lines[-1].startswith("quantize: [21/21] blk.1.ffn_down.weight f32 -> q8_0: 100.0% done, ")
    assert all(re.search(r": \d+\.\d% done, \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d$", x) for x in lines)

    rc, out, err = run_main(capsys, "repack", q8, tmp_path / "r.gguf", "--dry-run")
    assert rc == 0, err
    assert out.rstrip("\n").splitlines()[-1] == "dry run: nothing written" and err == ""
    assert not (tmp_path / "r.gguf").exists()
    rc, out, err = run_main(capsys, "repack", q8, tmp_path / "r.gguf")
    assert rc == 0, err
    lines = err.splitlines()
    assert len(lines) == 21 and all(x.startswith("repack: [") for x in lines), err
    assert "blk.1.ffn_down.weight q8_0 -> q8_0_r8: 100.0% done" in lines[-1]


def test_dry_run_json_stays_json(tiny, tmp_path, capsys):
    for cmd in (["quantize", tiny["model"], tmp_path / "x.gguf", "q8_0"],):
        rc, out, err = run_main(capsys, *cmd, "--dry-run", "--json")
        assert rc == 0, err
        assert json.loads(out)["dry_run"] is True and "nothing written" not in out


def test_terminal_keeps_the_bar(tiny, tmp_path, capsys, monkeypatch):
    """On a terminal no progress lines: rich's bar (drawn, then removed)."""
    import quantkit.progress as progress
    monkeypatch.setattr(progress, "interactive", lambda console: True)
    rc, out, err = run_main(capsys, "quantize", tiny["model"], tmp_path / "t.gguf", "q8_0", "--threads", "1")
    assert rc == 0, err
    assert not any(LINE.match(x) for x in err.splitlines()), err


def test_piped_imatrix_prints_a_line_per_chunk_and_its_saves(tiny, tmp_path, capsys):
    out_path = tmp_path / "im.gguf"
    rc, out, err = run_main(capsys, "imatrix", tiny["model"], "-f", tiny["text"], "-o", out_path, "-c", "32",
                            "--chunks", "5", "--output-frequency", "2", "--threads", "1")
    assert rc == 0, err
    lines = err.splitlines()
    steps = [x for x in lines if LINE.match(x)]
    assert [x[:len("imatrix: [1/5]")] for x in steps] == [f"imatrix: [{i}/5]" for i in range(1, 6)]
    assert re.match(r"imatrix: \[5/5\] PPL \d+\.\d{4}: 100\.0% done, \d+:\d\d:\d\d elapsed, ETA 0:00:00$", steps[-1])
    assert [x for x in lines if not LINE.match(x)] == [f"imatrix: saved {out_path} after chunk 2",
                                                      f"imatrix: saved {out_path} after chunk 4"]
    assert lines.index(f"imatrix: saved {out_path} after chunk 2") == 2        # right after chunk 2's line
    # imatrix stats piped: every entry whole (it showed "en…")
    rc, out, err = run_main(capsys, "imatrix", "stats", out_path)
    assert rc == 0, err
    assert "…" not in out
    for i in range(2):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            assert f"│ blk.{i}.{name}.weight " in out



def test_imatrix_stats_table_lists_experts_without_data(tmp_path, capsys):
    """Under the table, a line per entry whose experts got no token (api.imatrix_stats has them)."""
    path = tmp_path / "moe.gguf"
    counts = np.array([3, 0, 2, 0], np.float32)
    save_gguf(path, {"blk.1.ffn_up_exps.weight": np.ones((4, 32), np.float32) * counts[:, None]},
              {"blk.1.ffn_up_exps.weight": counts}, datasets=["x"], chunk_count=1,
              chunk_size=16)
    rc, out, err = run_main(capsys, "imatrix", "stats", path)
    assert rc == 0, err
    assert "blk.1.ffn_up_exps.weight: experts without data: 1, 3" in out


# ---- perplexity: llama-perplexity's lines ----

def test_perplexity_prints_llama_perplexity_lines_as_it_goes(tiny, capsys, monkeypatch):
    from quantkit.runtime import perplexity as ppl
    args = ("perplexity", tiny["model"], "-f", tiny["text"], "-c", "32", "--chunks", "4", "--threads", "1")
    rc, out, err = run_main(capsys, *args, "--json")
    assert rc == 0, err
    doc = json.loads(out)

    seen, seen_err = [], []                     # stdout as each chunk starts: written chunk by chunk
    real = ppl.chunk_logits

    def watching(model, chunk, where=""):
        cap = capsys.readouterr()
        seen.append(cap.out)
        seen_err.append(cap.err)
        return real(model, chunk, where)
    monkeypatch.setattr(ppl, "chunk_logits", watching)
    rc, out, err = run_main(capsys, *args)
    assert rc == 0, err
    out, err = "".join(seen) + out, "".join(seen_err) + err
    expected = "".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(doc["chunk_ppl"]))
    assert out == f"{expected}\nFinal estimate: PPL = {doc['ppl']:.4f} +/- {doc['ppl_error']:.5f}\n"
    assert seen[1] == expected[:expected.index("[2]")]       # chunk 1's value before chunk 2 ran
    assert re.findall(r"\[\d+\][0-9.]+", out) == expected.rstrip(",").split(",")      # a log parser's view
    err_lines = err.splitlines()
    assert err_lines[0] == "perplexity: calculating perplexity over 4 chunks, n_ctx=32, batch_size=32, n_seq=1"
    assert re.fullmatch(r"perplexity: \d+\.\d\d seconds per pass - ETA \d+\.\d\d minutes", err_lines[1])
    assert len(err_lines) == 2


def test_kl_divergence_prints_its_rows_and_summary(tiny, capsys):
    base = tiny["dir"] / "base.kld"
    rc, out, err = run_main(capsys, "perplexity", tiny["model"], "-f", tiny["text"], "-c", "32", "--chunks", "3",
                            "--kl-divergence-base", base, "--threads", "1")
    assert rc == 0, err
    rc, out, err = run_main(capsys, "perplexity", tiny["model"], "--kl-divergence-base", base, "--kl-divergence",
                            "--threads", "1")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["", "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                             "              Δp RMS            Same top p"]
    row = r"\s+\d+\.\d{4} ± \s*\d+\.\d{4}" + r"\s+-?\d+\.\d{5} ± \s*\d+\.\d{5}" * 2 + r"\s+\d+\.\d{3} ± \s*\d+\.\d{3} %" * 2
    for i in range(3):
        assert re.fullmatch(rf"\s+{i + 1}{row}", lines[2 + i]), lines[2 + i]
    assert lines[5:7] == ["", "====== Perplexity statistics ======"]
    for label in ("Mean    KLD:", "Maximum KLD:", "99.9%   KLD:", "Median  KLD:", " 5.0%   KLD:", "Minimum KLD:",
                  "Maximum Δp:", "75.0%   Δp:", "RMS Δp    :", "Same top p:"):
        assert any(x.startswith(label) for x in lines), label
    assert re.fullmatch(r"kl_divergence: \d+\.\d\d seconds per pass - ETA \d+\.\d\d minutes", err.strip())


# ---- an interrupted imatrix: what it saved, and the command that resumes it ----

def interrupt_in_chunk(monkeypatch, chunk: int, exc):
    from quantkit.runtime import collect as collect_mod
    real = collect_mod.ObservingOps.matmul_q
    calls = {"n": 0}

    def interrupting(self, w, x, fused=None):
        calls["n"] += 1
        if calls["n"] > (chunk - 1) * PER_CHUNK_PRODUCTS + 3:
            raise exc
        return real(self, w, x, fused)
    monkeypatch.setattr(collect_mod.ObservingOps, "matmul_q", interrupting)
    return lambda: monkeypatch.setattr(collect_mod.ObservingOps, "matmul_q", real)


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_interrupted_imatrix_says_how_to_resume_and_that_resumes(tiny, tmp_path, capsys, monkeypatch, signal_name):
    import signal

    from quantkit.signals import Terminated
    common = ["-f", tiny["text"], "-c", "32", "--threads", "1", "--output-frequency", "2"]
    whole = tmp_path / "whole.gguf"
    rc, _, err = run_main(capsys, "imatrix", tiny["model"], "-o", whole, "--chunks", "5", *common)
    assert rc == 0, err

    out_path = tmp_path / "run.gguf"
    exc = KeyboardInterrupt() if signal_name == "SIGINT" else Terminated(signal.SIGTERM)
    restore = interrupt_in_chunk(monkeypatch, 4, exc)           # saved after chunk 2, stopped in chunk 4
    rc, _, err = run_main(capsys, "imatrix", tiny["model"], "-o", out_path, "--chunks", "5", *common)
    restore()
    assert rc == (130 if signal_name == "SIGINT" else 143), err
    tail = err.strip().splitlines()[-3:]
    assert tail[0] == ("quantkit: interrupted" if signal_name == "SIGINT" else
                       "quantkit: terminated by SIGTERM; no partial output file was left behind")
    assert tail[1] == (f"imatrix: {out_path} holds chunks 1-2 of the text (2 of this run's 5, saved every 2); "
                       "to resume from there:")
    resume = shlex.split(tail[2])
    assert resume[:3] == ["quantkit", "imatrix", "collect"]
    assert "--in-file" in resume and resume[resume.index("--chunk") + 1] == "2"
    assert resume[resume.index("--chunks") + 1] == "3"
    assert load_imatrix(out_path).chunk_count == 2

    rc, _, err = run_main(capsys, *resume[1:])                  # the printed command, as printed
    assert rc == 0, err
    resumed = tmp_path / "run-resumed.gguf"
    assert resume[resume.index("-o") + 1] == str(resumed)
    a, b = load_imatrix(whole), load_imatrix(resumed)
    assert a.chunk_count == b.chunk_count == 5
    assert set(a.weights) == set(b.weights)
    for n in a.weights:
        np.testing.assert_array_equal(b.counts[n], a.counts[n], err_msg=n)
        np.testing.assert_allclose(b.weights[n], a.weights[n], rtol=1e-5, err_msg=n)


def test_imatrix_interrupted_before_its_first_save_says_so(tiny, tmp_path, capsys, monkeypatch):
    out_path = tmp_path / "run.gguf"
    restore = interrupt_in_chunk(monkeypatch, 1, KeyboardInterrupt())
    rc, _, err = run_main(capsys, "imatrix", tiny["model"], "-o", out_path, "-f", tiny["text"], "-c", "32",
                          "--chunks", "5", "--threads", "1")
    restore()
    assert rc == 130
    assert err.strip().splitlines()[-1] == ("imatrix: interrupted before the first save (every 10 chunks): no chunk "
                                            "saved, nothing to resume; run the command again")
    assert not out_path.exists()


def test_a_save_and_its_count_are_not_split_by_a_signal():
    """imatrix saves OUT and counts the chunks it holds under signals.deferred: a Ctrl-C between
    the two would print a resume command that skips the wrong number of chunks."""
    import os
    import signal

    from quantkit import signals
    done = []
    with signals.terminate_on_signals():
        with pytest.raises(KeyboardInterrupt):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("save")
                done.append("count")
            done.append("after the block")
    assert done == ["save", "count"]
