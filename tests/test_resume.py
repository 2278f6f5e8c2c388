"""quantize --resume (quantkit/resume.py): an interrupted or killed quantize goes on where it
stopped, and its output is byte for byte the one of a run never interrupted."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from quantkit import outputs
from quantkit.api import quantize_model
from quantkit.outputs import resumable_names
from quantkit.signals import Terminated

from hostile import Snapshot
from models import write_llama

TYPE = "q4_K"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (21 tensors), its clean q4_K output and that output split in shards."""
    d = tmp_path_factory.mktemp("resume")
    model = write_llama(d / "in.gguf", n_layer=2)
    clean = d / "clean.gguf"
    quantize_model(model, clean, TYPE, threads=1)
    split = d / "split" / "clean.gguf"
    split.parent.mkdir()
    res = quantize_model(model, split, TYPE, threads=1, split_max_size="200K")
    assert len(res.paths) >= 3
    return {"model": model, "clean": clean.read_bytes(), "split": [p.read_bytes() for p in res.paths]}


def run_main(capsys, *args) -> tuple[int, str, str]:
    from quantkit.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def interrupted(model, out, after: int, exc: BaseException, type_=TYPE, **options):
    """quantize_model with --resume, stopped by ``exc`` once ``after`` tensors are written."""
    seen = []

    def progress(name, done, total):
        seen.append(name)
        if len(seen) == after:
            raise exc
    with pytest.raises(type(exc)) as e:
        quantize_model(model, out, type_, threads=1, resume=True, progress=progress, **options)
    return e.value


def journal_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in resumable_names(out)[1].read_text().splitlines()]


def test_interrupted_run_resumes_to_the_same_bytes(tiny, tmp_path, capsys):
    """Ctrl-C here; SIGHUP (a Terminated, as SIGTERM) in the CLI test below."""
    out = tmp_path / "out.gguf"
    e = interrupted(tiny["model"], out, 5, KeyboardInterrupt())
    partial, journal = resumable_names(out)
    assert not out.exists() and partial.exists()
    assert "run the same command with --resume" in e.__notes__[0]
    assert len(journal_lines(out)) == 1 + 5          # the fingerprint, then every finished tensor

    # a run without --resume leaves the resumable partial where it is, and says so
    other = tmp_path / "other.gguf"
    rc, _, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--threads", "1", "--dry-run")
    assert rc == 0 and partial.exists()
    rc, _, err = run_main(capsys, "quantize", tiny["model"], other, TYPE, "--threads", "1")
    assert rc == 0 and partial.exists() and journal.exists()
    outputs._swept.discard(os.path.realpath(tmp_path))       # the sweep of dead runs' partials spares it
    outputs.sweep_stale_partials(tmp_path)
    assert partial.exists() and journal.exists()

    rc, stdout, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--threads", "1", "--resume", "--json")
    assert rc == 0, err
    reused = json.loads(stdout)["result"]["reused"]
    assert reused["tensors"] == 5 and reused["bytes"] > 0 and reused["started_over"] is None
    assert out.read_bytes() == tiny["clean"]
    assert sorted(os.listdir(tmp_path)) == ["other.gguf", "out.gguf"]      # no partial, no journal left


def test_cli_says_the_partial_is_kept_and_a_plain_run_notes_it(tiny, tmp_path, capsys, monkeypatch, caplog):
    """The CLI's interrupt line tells how to go on (not "no partial output file was left behind"),
    and a run of the same OUT without --resume leaves the partial and says so in one line."""
    import quantkit.quantize as quantize_mod
    out = tmp_path / "out.gguf"
    real = quantize_mod.convert_tensor
    calls = []

    def stopping(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise Terminated(signal.SIGHUP)
        return real(*a, **k)
    monkeypatch.setattr(quantize_mod, "convert_tensor", stopping)
    rc, _, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--threads", "1", "--resume")
    monkeypatch.setattr(quantize_mod, "convert_tensor", real)
    assert rc == 128 + signal.SIGHUP
    lines = err.strip().splitlines()
    assert lines[-2] == "quantkit: terminated by SIGHUP"
    assert "kept the partial output" in lines[-1] and "--resume" in lines[-1]
    partial = resumable_names(out)[0]
    rc, _, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--threads", "1")
    assert rc == 0 and out.read_bytes() == tiny["clean"]
    notes = [r.getMessage() for r in caplog.records if "leaves it there" in r.getMessage()]
    assert partial.exists() and len(notes) == 1 and str(partial) in notes[0]


def test_another_input_type_or_version_starts_over_saying_why(tiny, tmp_path, caplog):
    out = tmp_path / "out.gguf"
    model = tmp_path / "in.gguf"
    model.write_bytes(tiny["model"].read_bytes())
    interrupted(model, out, 4, KeyboardInterrupt())
    os.utime(model, ns=(1, 1))                      # the input changed (its time says so)
    res = quantize_model(model, out, TYPE, threads=1, resume=True)
    assert res.reused_tensors == 0 and "another input" in res.started_over
    assert out.read_bytes() == tiny["clean"]

    interrupted(model, out, 4, KeyboardInterrupt())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("quantkit.resume.__version__", "0.0.0-other")
        interrupted(model, out, 3, KeyboardInterrupt())
    assert "another quantkit version" in caplog.text

    interrupted(model, out, 4, KeyboardInterrupt())
    res = quantize_model(model, out, TYPE, threads=1, resume=True, pure=True, output_tensor_type="q8_0")
    assert res.reused_tensors == 0 and "another TYPE, recipe or option" in res.started_over
    clean = tmp_path / "clean.gguf"
    quantize_model(model, clean, TYPE, threads=1, pure=True, output_tensor_type="q8_0")
    assert out.read_bytes() == clean.read_bytes()


def test_corrupted_partial_and_journal_are_rewritten_not_trusted(tiny, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    interrupted(tiny["model"], out, 6, KeyboardInterrupt())
    partial, journal = resumable_names(out)
    records = journal_lines(out)[1:]
    bad = records[2]
    with open(partial, "r+b") as f:                 # a flipped byte in a journaled tensor
        f.seek(bad["o"] + bad["n"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(journal, "ab") as f:
        f.write(b"not json\n" + b"[" * 100000 + b"\n" + b'{"t": 1}\n' + b"\xff\xfe\n")
        r = records[0]
        f.write(json.dumps({**records[3], "o": r["o"]}).encode() + b"\n")       # another tensor's place
        f.write(json.dumps({**r, "t": records[4]["t"]}).encode() + b"\n")
        f.write(json.dumps({**r, "n": 10 ** 30}).encode() + b"\n")
        f.write(b'{"t": "cut short')                                             # no newline: cut short
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    assert res.reused_tensors == 5                  # all but the corrupted one
    assert out.read_bytes() == tiny["clean"]

    # a partial cut short (in the middle of the last journaled tensor): the rest is kept
    interrupted(tiny["model"], out, 4, KeyboardInterrupt())
    last = journal_lines(out)[-1]
    os.truncate(partial, last["o"] + last["n"] // 2)
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    assert res.reused_tensors == 3
    assert out.read_bytes() == tiny["clean"]

    # a journal cut anywhere, even in its fingerprint line: never a crash, written again
    interrupted(tiny["model"], out, 3, KeyboardInterrupt())
    data = journal.read_bytes()
    journal.write_bytes(data[:len(data) // 3])
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    assert res.reused_tensors == 0 and res.started_over
    assert out.read_bytes() == tiny["clean"]


def test_links_in_the_partials_place_are_never_written_through(tiny, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim, victim2 = outside / "victim", outside / "victim2"
    victim.write_bytes(b"x" * 1000)
    victim2.write_bytes(b"y" * 1000)
    out = tmp_path / "out.gguf"
    partial, journal = resumable_names(out)
    partial.symlink_to(victim)
    os.link(victim2, journal)
    snap = Snapshot(outside, tiny["model"])
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    assert out.read_bytes() == tiny["clean"]
    assert res.reused_tensors == 0
    snap.assert_unchanged()

    # a hard link to the input in the partial's place: the input is never written
    os.link(tiny["model"], partial)
    snap = Snapshot(tiny["model"])
    quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    snap.assert_unchanged()
    assert out.read_bytes() == tiny["clean"]

    # another run holding the partial: refused in one line, nothing touched
    interrupted(tiny["model"], out, 2, KeyboardInterrupt())
    fd = os.open(partial, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        snap = Snapshot(tmp_path)
        rc, _, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--resume")
        assert rc == 1 and "another quantkit run is writing it with --resume" in err, err
        snap.assert_unchanged()
    finally:
        os.close(fd)
    rc, _, err = run_main(capsys, "quantize", tiny["model"], out, TYPE, "--resume", "--partial-requant")
    assert rc == 1 and "cannot be used together" in err


def test_split_output_resumes_per_shard(tiny, tmp_path):
    out = tmp_path / "out.gguf"
    n_shards = len(tiny["split"])
    interrupted(tiny["model"], out, 12, KeyboardInterrupt(), split_max_size="200K")
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True, split_max_size="200K")
    assert res.reused_tensors == 11 or res.reused_tensors == 12
    assert [p.read_bytes() for p in res.paths] == tiny["split"]
    assert len(res.paths) == n_shards
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in res.paths)


KILLER = textwrap.dedent("""
    import os, signal, sys, time
    from quantkit.api import quantize_model
    from quantkit.outputs import resumable_names
    model, out, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    journal = resumable_names(os.path.realpath(out))[1]
    seen = []
    def progress(name, done, total):
        seen.append(name)
        if len(seen) == after:
            # once some tensors are journaled (the journal syncs in the background), a real kill -9
            for _ in range(600):
                if os.path.exists(journal) and open(journal).read().count(chr(10)) >= 2:
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
    quantize_model(model, out, sys.argv[4], threads=1, resume=True, progress=progress)
    """)


def test_killed_run_resumes_with_fewer_tensors_quantized(tiny, tmp_path):
    """A real SIGKILL in the middle of a run (no cleanup at all), then --resume."""
    out = tmp_path / "out.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", KILLER, str(tiny["model"]), str(out), "8", TYPE],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not out.exists() and resumable_names(out)[0].exists()
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True)
    assert 1 <= res.reused_tensors <= 8
    assert len(res.tensor_seconds) == 21 - res.reused_tensors        # only the others were quantized
    assert out.read_bytes() == tiny["clean"]


def test_output_inside_a_model_directory_resumes(tmp_path):
    """A Hugging Face model directory is an input by its files: the partial and journal written
    into it are not, so they do not change the run's fingerprint."""
    from hf_models import write_tiny_llama
    hf = write_tiny_llama(tmp_path / "hf", n_layer=2)
    clean = tmp_path / "clean.gguf"
    quantize_model(hf, clean, "q8_0", threads=1)
    out = hf / "out.gguf"
    interrupted(hf, out, 3, KeyboardInterrupt(), type_="q8_0")
    res = quantize_model(hf, out, "q8_0", threads=1, resume=True)
    assert res.reused_tensors == 3 and res.started_over is None
    assert out.read_bytes() == clean.read_bytes()


def test_an_input_in_the_partials_place_is_refused_untouched(tiny, tmp_path, capsys):
    """IN (or the imatrix, a recipe) named as OUT's partial or journal: refused before any write."""
    out = tmp_path / "out.gguf"
    partial, journal = resumable_names(out)
    partial.write_bytes(tiny["model"].read_bytes())
    recipe = journal
    recipe.write_text("output=q8_0\n")
    snap = Snapshot(tmp_path)
    for model, extra in ((partial, ()), (tiny["model"], ("--custom-q", recipe))):
        rc, _, err = run_main(capsys, "quantize", model, out, TYPE, "--resume", *extra)
        assert rc == 1 and "is a file this run reads" in err, err
        snap.assert_unchanged()


def test_another_imatrix_of_the_same_name_starts_over(tiny, tmp_path):
    """The header holds the imatrix's file name and entry count only: its content is fingerprinted."""
    from quantkit.gguf_io.reader import open_model
    from quantkit.imatrix import save_dat
    with open_model(tiny["model"]) as m:
        shapes = {t.name: t.shape[0] for t in m.tensors if len(t.shape) == 2}
    imatrix, out = tmp_path / "imatrix.dat", tmp_path / "out.gguf"
    rng = np.random.default_rng(0)
    save_dat(imatrix, {n: rng.uniform(0.5, 2, k).astype(np.float32) for n, k in shapes.items()})
    interrupted(tiny["model"], out, 4, KeyboardInterrupt(), imatrix=imatrix)
    save_dat(imatrix, {n: rng.uniform(0.5, 2, k).astype(np.float32) for n, k in shapes.items()})
    res = quantize_model(tiny["model"], out, TYPE, threads=1, resume=True, imatrix=imatrix)
    assert res.reused_tensors == 0 and "another importance matrix" in res.started_over
    clean = tmp_path / "clean.gguf"
    quantize_model(tiny["model"], clean, TYPE, threads=1, imatrix=imatrix)
    assert out.read_bytes() == clean.read_bytes()
