"""The user's files (issue 22, items 2, 4-7 and the path cases of 16): alignments, what OUT may be,
outputs that are inputs, signals, permissions, long names and full disks.

What is written runs through the library (quantkit.quantize_model, repack_model, convert_imatrix)
in-process on a tiny model; refusals and interrupts through ``quantkit.cli.main`` in-process, since
their contract is the CLI's (exit status 1 or 128+signal, one line on stderr, nothing left behind);
a subprocess only where the exit status of a signalled process is what is tested.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

import quantkit
import quantkit.formats as formats
from quantkit import outputs
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.constants import MetaValue, ValueType
from quantkit.gguf_io.reader import GGUFFile, open_model
from quantkit.gguf_io.writer import TensorSpec, encode_header
from quantkit.imatrix import save_dat
from quantkit.types import QuantType

from hostile import Snapshot, assert_refused, without_progress
from models import write_llama

TINY = dict(n_layer=1, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, n_vocab=64)


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    c = capsys.readouterr()
    return rc, c.out, c.err


def partials(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if p.name.endswith(".partial"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Inputs every test may read but none may change: a tiny model, a text, an imatrix."""
    d = tmp_path_factory.mktemp("inputs")
    write_llama(d / "m.gguf", **TINY)
    (d / "text.txt").write_text("hello world " * 50)
    with open_model(d / "m.gguf") as m:
        weights = {t.name: np.ones(t.shape[0], np.float32) for t in m.tensors if len(t.shape) == 2}
    save_dat(d / "imatrix.dat", weights, ncall=1)
    return d


@pytest.fixture
def inputs(model_dir):
    snap = Snapshot(model_dir)
    yield model_dir
    snap.assert_unchanged()


def tensor_bytes_gguf_py(path: Path) -> dict[str, bytes]:
    r = gguf.GGUFReader(str(path))
    return {t.name: np.asarray(t.data).tobytes() for t in r.tensors}


def tensor_bytes_quantkit(path: Path) -> dict[str, bytes]:
    with open_model(path) as m:
        return {t.name: t.raw().tobytes() for t in m.tensors}


# ---------------------------------------------------------------- item 2: general.alignment
@pytest.fixture(scope="module")
def aligned32(tmp_path_factory):
    """The 32-aligned model quantized to q8_0 and repacked to q8_0_r8: the bytes every other
    alignment must give."""
    d = tmp_path_factory.mktemp("al32")
    src = write_llama(d / "m.gguf", **TINY, seed=3)
    quantkit.quantize_model(src, d / "q.gguf", "q8_0")
    quantkit.repack_model(d / "q.gguf", d / "r.gguf")
    return tensor_bytes_quantkit(d / "q.gguf"), tensor_bytes_quantkit(d / "r.gguf")


def _assert_aligned(path: Path, alignment: int) -> None:
    """The file declares ``alignment`` and its header places every tensor on it."""
    with GGUFFile(path) as f:
        assert f.get("general.alignment") == f.alignment == alignment
        assert f.data_offset % alignment == 0
        for t in f.tensors:
            assert (t.offset - f.data_offset) % alignment == 0, t.name
    assert path.stat().st_size % alignment == 0


@pytest.mark.parametrize("alignment", [16, 64, 256])
def test_input_alignment_is_honoured(tmp_path, aligned32, alignment):
    """quantize and repack of a model with general.alignment != 32 write the data at that
    alignment: gguf-py and quantkit read the same tensor bytes as from the 32-aligned output."""
    want_q, want_r = aligned32
    src = write_llama(tmp_path / "m.gguf", **TINY, seed=3, alignment=alignment)
    q, r = tmp_path / "q.gguf", tmp_path / "r.gguf"
    quantkit.quantize_model(src, q, "q8_0")
    quantkit.repack_model(q, r)
    for path, want in ((q, want_q), (r, want_r)):
        _assert_aligned(path, alignment)
        assert tensor_bytes_quantkit(path) == want
    # gguf-py does not know q8_0_r8: it reads the quantized file and the repack undone
    quantkit.repack_model(r, tmp_path / "u.gguf", undo=True)
    _assert_aligned(tmp_path / "u.gguf", alignment)
    for path in (q, tmp_path / "u.gguf"):
        assert gguf.GGUFReader(str(path)).alignment == alignment
        assert tensor_bytes_gguf_py(path) == want_q
    # split output: every shard declares the alignment and is aligned to it
    result = quantkit.quantize_model(src, tmp_path / "s.gguf", "q8_0", split_max_size="20K")
    shards = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(shards) > 1 and result.paths == shards
    got = {}
    for s in shards:
        _assert_aligned(s, alignment)
        got.update(tensor_bytes_gguf_py(s))
    assert got == want_q
    assert tensor_bytes_quantkit(shards[0]) == want_q


def test_header_alignment_must_agree_with_the_metadata():
    meta = {"general.alignment": MetaValue(ValueType.UINT32, 64)}
    specs = [TensorSpec("a", (32,), QuantType.F32), TensorSpec("b", (8,), QuantType.F32)]
    header, offsets = encode_header(meta, specs)
    assert len(header) % 64 == 0 and offsets == [0, 128]
    with pytest.raises(ValueError, match="declares"):
        encode_header(meta, specs, alignment=32)
    with pytest.raises(QuantkitError, match="power of two"):
        encode_header({"general.alignment": MetaValue(ValueType.UINT32, 48)}, specs)


# ---------------------------------------------------------------- item 4: what OUT may be
def _every_writer(d: Path, out: Path) -> list[list]:
    """Every command that writes a file, writing ``out``."""
    m, text, imat = d / "m.gguf", d / "text.txt", d / "imatrix.dat"
    return [["quantize", m, out, "q8_0"], ["repack", m, out],
            ["imatrix", m, "-f", text, "-o", out], ["imatrix", "convert", imat, out],
            ["imatrix", "merge", imat, imat, "-o", out],
            ["perplexity", m, "-f", text, "--kl-divergence-base", out]]


def _no_work(monkeypatch):
    """Refusals must come before a model is opened."""
    def never(*a, **k):
        raise AssertionError("the model was opened before OUT was checked")
    import quantkit.gguf_io.reader as reader
    import quantkit.imatrix_tools as tools
    import quantkit.runtime.session as session
    monkeypatch.setattr(reader, "open_model", never)
    monkeypatch.setattr(session, "open_session", never)
    monkeypatch.setattr(tools.RawImatrix, "from_file", never)


def test_fifo_out_is_refused_by_every_writer(tmp_path, inputs, monkeypatch, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    _no_work(monkeypatch)
    snap = Snapshot(tmp_path)
    for args in _every_writer(inputs, fifo):
        assert_refused(*cli(capsys, *args), str(fifo), "FIFO")
        snap.assert_unchanged()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_symlink_to_a_fifo_or_a_directory_is_refused(tmp_path, inputs, monkeypatch, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "to_fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "to_dir").symlink_to(tmp_path / "dir")
    _no_work(monkeypatch)
    snap = Snapshot(tmp_path)
    for link, kind in (("to_fifo", "FIFO"), ("to_dir", "directory"), ("dir", "directory")):
        for args in _every_writer(inputs, tmp_path / link):
            assert_refused(*cli(capsys, *args), link, kind)
    snap.assert_unchanged()


def test_symlink_out_is_written_through(tmp_path, inputs):
    """The link's target is replaced by the new file in the target's directory; the link stays."""
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "model.gguf"
    target.write_bytes(b"old")
    link = tmp_path / "current.gguf"
    link.symlink_to(Path("real") / "model.gguf")
    quantkit.quantize_model(inputs / "m.gguf", link, "q8_0")
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "model.gguf")
    assert tensor_bytes_quantkit(target).keys() == tensor_bytes_quantkit(inputs / "m.gguf").keys()
    assert partials(tmp_path) == partials(tmp_path / "real") == []
    # a dangling link: its target is created
    dangling = tmp_path / "next.gguf"
    dangling.symlink_to(tmp_path / "real" / "new.imatrix.dat")
    quantkit.convert_imatrix(inputs / "imatrix.dat", dangling)
    assert (tmp_path / "real" / "new.imatrix.dat").is_file() and dangling.is_symlink()


# ---------------------------------------------------------------- item 5: no output is an input
@pytest.fixture(scope="module")
def split_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    src = write_llama(d / "src.gguf", **TINY, seed=5)
    quantkit.quantize_model(src, d / "A.gguf", "q8_0", split_max_size="20K")
    src.unlink()
    shards = sorted(d.glob("A-*-of-*.gguf"))
    assert len(shards) > 2
    return d, shards


@pytest.mark.parametrize("extra", [["quantize", "q8_0", "--keep-split"],
                                   ["quantize", "q8_0", "--split-max-size", "20K", "--allow-requantize"],
                                   ["repack", "--keep-split"]])
def test_split_output_over_the_input_set_is_refused(split_set, extra, capsys):
    d, shards = split_set
    snap = Snapshot(d)
    cmd, *rest = extra
    assert_refused(*cli(capsys, cmd, shards[0], d / "A.gguf", *rest), "input file")
    snap.assert_unchanged()


def test_out_equal_to_another_input_is_refused(tmp_path, inputs, monkeypatch, capsys):
    m, text, imat = inputs / "m.gguf", inputs / "text.txt", inputs / "imatrix.dat"
    recipe = tmp_path / "recipe.txt"
    recipe.write_text("attn=q8_0\n")
    os.link(imat, tmp_path / "hardlink.dat")
    (tmp_path / "sym.gguf").symlink_to(m)
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (hf / name).write_text("{}")
    _no_work(monkeypatch)
    snap = Snapshot(tmp_path)
    cases = [
        ["quantize", m, imat, "q8_0", "--imatrix", imat],
        ["quantize", m, tmp_path / "hardlink.dat", "q8_0", "--imatrix", imat],
        ["quantize", m, recipe, "q8_0", "--custom-q", recipe],
        ["quantize", m, tmp_path / "sym.gguf", "q8_0"],
        ["quantize", hf, hf / "model.safetensors", "q8_0"],
        ["quantize", hf, hf / "config.json", "q8_0"],
        ["repack", m, m],
        ["imatrix", m, "-f", text, "-o", text],
        ["imatrix", m, "-f", text, "-o", tmp_path / "hardlink.dat", "--in-file", imat],
        ["imatrix", "convert", imat, tmp_path / "hardlink.dat"],
        ["imatrix", "merge", m, imat, "-o", tmp_path / "hardlink.dat"],
        ["perplexity", m, "-f", text, "--kl-divergence-base", text],
        ["perplexity", m, "-f", text, "--kl-divergence-base", tmp_path / "sym.gguf"],
    ]
    for args in cases:
        assert_refused(*cli(capsys, *args), "is the input file")
    snap.assert_unchanged()


def test_check_outputs_compares_identity_not_names(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"x")
    os.link(a, tmp_path / "b.bin")
    with pytest.raises(QuantkitError, match="is the input file '.*a.bin'"):
        outputs.check_outputs([tmp_path / "b.bin"], [a])
    a.chmod(0o444)                                  # the identity is what the user learns first
    with pytest.raises(QuantkitError, match="is the input file; choose another"):
        outputs.check_outputs([a], [a])
    with pytest.raises(QuantkitError, match="same file"):
        outputs.check_outputs([tmp_path / "new", tmp_path / "." / "new"], [a])
    # a new file beside the inputs, and a GGUF written into a model directory, are fine
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.gguf").write_bytes(b"an earlier output")
    assert outputs.check_outputs([tmp_path / "hf" / "old.gguf", tmp_path / "c"], [a, tmp_path / "hf"])


# ---------------------------------------------------------------- item 6: signals and stale partials
def _interrupt_with(sig, monkeypatch):
    real, calls = formats.quantize, {"n": 0}

    def quantize(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), sig)
            time.sleep(30)                  # the handler raises long before this ends
        return real(*a, **k)

    monkeypatch.setattr(formats, "quantize", quantize)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(tmp_path, inputs, sig, monkeypatch, capsys):
    _interrupt_with(sig, monkeypatch)
    before = signal.getsignal(sig)
    t0 = time.perf_counter()
    rc, out, err = cli(capsys, "quantize", inputs / "m.gguf", tmp_path / "o.gguf", "q8_0")
    assert time.perf_counter() - t0 < 20
    assert rc == 128 + sig
    lines = [line for line in without_progress(err).splitlines() if line.strip()]
    assert len(lines) == 1 and signal.Signals(sig).name in lines[0], err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(sig) == before         # main() puts the previous handler back


def _signal_in_a_ctypes_callback(sig):
    """Send ``sig`` to this process from inside a ctypes callback, where Python runs its handler
    and drops the handler's exception ("Exception ignored on calling ctypes callback function"):
    what happens when a signal arrives while llvmlite calls back into Python, as numba does
    whenever it compiles or loads a cached kernel."""
    def callback():
        os.kill(os.getpid(), sig)
        for _ in range(10000):              # bytecodes: the handler runs among them
            pass
    ctypes.CFUNCTYPE(None)(callback)()


def test_an_interrupt_lost_in_a_callback_is_raised_at_the_next_progress_point(capsys):
    from quantkit import signals
    reached = []
    with pytest.raises(signals.Terminated):
        with signals.terminate_on_signals():
            _signal_in_a_ctypes_callback(signal.SIGTERM)
            reached.append("after the callback")        # the handler's exception was dropped
            signals.check()
    assert reached and signals._pending == []
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_quantize_whose_interrupt_was_lost_still_stops_and_cleans_up(tmp_path, inputs, sig, monkeypatch,
                                                                        capsys):
    """The run stops at its next chunk, exits as interrupted with one line, and leaves no file (it
    used to finish and write its output with exit status 0)."""
    real, calls = formats.quantize, {"n": 0}

    def quantize(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            _signal_in_a_ctypes_callback(sig)
        return real(*a, **k)
    monkeypatch.setattr(formats, "quantize", quantize)
    rc, out, err = cli(capsys, "quantize", inputs / "m.gguf", tmp_path / "o.gguf", "q8_0")
    assert rc == 128 + sig
    assert len([line for line in without_progress(err).splitlines() if line.strip()]) == 1 and "Exception" not in err, err
    assert calls["n"] == 2 and list(tmp_path.iterdir()) == []


_SLOW_QUANTKIT = """
import sys, time
import quantkit.formats as formats
real = formats.quantize
def slow(*a, **k):
    time.sleep(0.5)
    return real(*a, **k)
formats.quantize = slow
from quantkit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start_slow_quantize(src: Path, out: Path) -> subprocess.Popen:
    """A real quantkit process that is mid-write (its partial exists) when this returns."""
    p = subprocess.Popen([sys.executable, "-c", _SLOW_QUANTKIT, "quantize", str(src), str(out), "q8_0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not partials(out.parent):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no partial file appeared"
        time.sleep(0.05)
    return p


def test_killed_process_leaves_nothing_and_stale_partials_are_removed(tmp_path, inputs, monkeypatch, capsys,
                                                                      caplog):
    out = tmp_path / "o.gguf"
    p = _start_slow_quantize(inputs / "m.gguf", out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    lines = [line for line in without_progress(err).splitlines() if line.strip()]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
    # SIGKILL cannot be handled: the preallocated partial stays, and the next run removes it
    p = _start_slow_quantize(inputs / "m.gguf", out)
    p.kill()
    p.communicate(timeout=60)
    left = partials(tmp_path)
    assert len(left) == 1 and f".qk{p.pid}-" in left[0]
    monkeypatch.setattr(outputs, "_swept", set())
    rc, _, err = cli(capsys, "quantize", inputs / "m.gguf", out, "q8_0")
    assert rc == 0 and "removed 1 partial file" in caplog.text and left[0] in caplog.text
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.gguf"]


def test_a_live_partial_is_never_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "_swept", set())
    writing = outputs.AtomicOutput()
    f = writing.open(tmp_path / "a.gguf")
    f.write(b"data")
    monkeypatch.setattr(outputs, "_swept", set())
    outputs.sweep_stale_partials(tmp_path)          # another run, same directory: the file is locked
    assert f.tmp.exists()
    writing.commit()
    assert (tmp_path / "a.gguf").read_bytes() == b"data" and partials(tmp_path) == []


# ---------------------------------------------------------------- item 7: modes
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_outputs_honour_the_umask(tmp_path, inputs, umask, mode):
    old = os.umask(umask)
    try:
        quantkit.quantize_model(inputs / "m.gguf", tmp_path / "o.gguf", "q8_0")
        quantkit.convert_imatrix(inputs / "imatrix.dat", tmp_path / "o.dat")
        quantkit.convert_imatrix(inputs / "imatrix.dat", tmp_path / "o.imatrix.gguf")
        for name in ("o.gguf", "o.dat", "o.imatrix.gguf"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name
        # a replaced file keeps its permission bits
        (tmp_path / "o.gguf").chmod(0o640)
        quantkit.quantize_model(inputs / "m.gguf", tmp_path / "o.gguf", "q8_0")
        assert stat.S_IMODE(os.stat(tmp_path / "o.gguf").st_mode) == 0o640
    finally:
        os.umask(old)


# ---------------------------------------------------------------- item 16: directories, names, full disks
@pytest.mark.parametrize("what", ["directory", "file"])
def test_unwritable_directory_or_file_is_refused_before_work(tmp_path, inputs, what, monkeypatch, capsys):
    d = tmp_path / "ro"
    d.mkdir()
    out = d / "out.gguf"
    if what == "file":
        out.write_bytes(b"the user's read-only file")
        out.chmod(0o444)
    denied = os.path.realpath(d if what == "directory" else out)
    real_access = os.access
    # root may write anywhere, so the answer is simulated for root too
    monkeypatch.setattr(os, "access", lambda p, m, **k: (not (m & os.W_OK and os.path.realpath(p) == denied)
                                                         and real_access(p, m, **k)))
    _no_work(monkeypatch)
    snap = Snapshot(tmp_path)
    for args in _every_writer(inputs, out):
        assert_refused(*cli(capsys, *args), "not writable" if what == "directory" else "read-only")
    snap.assert_unchanged()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused(tmp_path, inputs, capsys):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        assert_refused(*cli(capsys, "quantize", inputs / "m.gguf", d / "o.gguf", "q8_0"), "not writable")
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o755)


def test_temporary_file_that_cannot_be_created_is_one_line(tmp_path, inputs, monkeypatch, capsys):
    real_open = os.open

    def denied(path, flags, *a, **k):
        if str(path).endswith(".partial"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", denied)
    snap = Snapshot(tmp_path)
    assert_refused(*cli(capsys, "quantize", inputs / "m.gguf", tmp_path / "o.gguf", "q8_0"), "Permission denied")
    assert_refused(*cli(capsys, "imatrix", "convert", inputs / "imatrix.dat", tmp_path / "o.dat"),
                   "Permission denied")
    snap.assert_unchanged()


def test_out_names_near_name_max(tmp_path, inputs, capsys):
    """A 255-byte name is written (its temporary name is short); a longer one, or shard names
    that grow past the limit, are refused before any work."""
    name = "m" * 250 + ".gguf"
    quantkit.quantize_model(inputs / "m.gguf", tmp_path / name, "q8_0")
    quantkit.convert_imatrix(inputs / "imatrix.dat", tmp_path / ("d" * 251 + ".dat"))
    assert sorted(len(p.name) for p in tmp_path.iterdir()) == [255, 255]
    snap = Snapshot(tmp_path)
    assert_refused(*cli(capsys, "quantize", inputs / "m.gguf", tmp_path / ("x" + name), "q8_0"), "256 bytes long")
    assert_refused(*cli(capsys, "quantize", inputs / "m.gguf", tmp_path / ("s" * 240 + ".gguf"), "q8_0",
                        "--split-max-size", "20K"), "bytes long")
    snap.assert_unchanged()


@pytest.mark.parametrize("out_name, fail_at", [("o.gguf", 2), ("o.dat", 1), ("o.imatrix.gguf", 2)])
def test_full_disk_while_writing_is_one_line_and_no_partial(tmp_path, inputs, out_name, fail_at, monkeypatch,
                                                            capsys):
    """ENOSPC in the middle of the data (after the header; the whole of a .dat), where no
    reservation caught it first: one line, the old file untouched, no partial."""
    real_pwrite, calls = os.pwrite, {"n": 0}

    def pwrite(fd, data, pos):
        calls["n"] += 1
        if calls["n"] >= fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, pos)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: None)
    out = tmp_path / out_name
    out.write_bytes(b"the user's old file")
    snap = Snapshot(tmp_path)
    if out_name == "o.gguf":
        args = ["quantize", inputs / "m.gguf", out, "q8_0"]
    else:
        args = ["imatrix", "convert", inputs / "imatrix.dat", out]
    assert_refused(*cli(capsys, *args), str(out), "No space left on device")
    snap.assert_unchanged()


def test_a_device_is_refused_by_the_check_alone():
    """check_output only stats (nothing here can write to /dev/null): a character device is refused,
    as root too, where renaming over it used to replace /dev/null with a regular file."""
    with pytest.raises(QuantkitError, match="character device"):
        outputs.check_output(os.devnull)
