"""quantize --resume: an interrupted or killed quantize continues where it stopped.

With ``--resume`` each output file (each shard) is written as its resumable partial, a file of its
own beside OUT (:func:`quantkit.outputs.resumable_names`), with a journal beside it.  An error or
a signal (SIGINT, SIGTERM, SIGHUP) keeps both; a SIGKILL, an OOM kill or a power loss leaves them
as they were.  The next run with ``--resume`` checks the journal's fingerprint, verifies every
tensor it lists by checksum, keeps those, writes the rest, and renames the partial into place: the
output's bytes are those of a run that was never interrupted.

The journal is JSON lines.  The first line is the run's fingerprint::

    {"quantkit_resume": 1, "version": "...", "input": HEX, "plan": HEX, "imatrix": HEX}

* ``version``: quantkit's version (its quantizers decide the bytes);
* ``input``: the identity of every input file (real path, size, modification time, inode); its
  content is not read (a 671B model is terabytes): a file changed in place changes its time;
* ``plan``: every shard's header bytes (metadata, recipe text, imatrix file name, tensor names,
  shapes, types and offsets), what each tensor is made from (input tensor, action, source type)
  and the flavor;
* ``imatrix``: the importance weights each tensor is quantized with, by content.

Any difference starts the run over and says why in one line.  Then one line per finished tensor,
``{"t": NAME, "o": OFFSET, "n": NBYTES, "h": SHA256}`` (offset in the file, the data's bytes
without padding).  A background thread appends them: it reads each finished tensor back from the
partial, hashes it, and at most every :data:`SYNC_SECONDS` makes the partial durable (fdatasync)
and only then appends the lines of the tensors that sync covered and syncs the journal.  A kill
loses at most the tensors of those last seconds.

Everything in a partial and its journal is untrusted: a line that is cut short, malformed, names
no tensor of this shard or another place or size, or whose bytes do not hash to its checksum is
ignored, and that tensor is written again; nothing outside the partial is ever written (a link in
its place is replaced, never written through).  The journal is read up to a bound that its valid
lines never reach.

Without ``--resume`` nothing of this runs: outputs are written and cleaned up as always, and a
resumable partial of the same OUT left by an earlier ``--resume`` run is left alone, with a
one-line note (the stale-partial sweep of other runs never removes one: it may hold hours of work).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import QuantkitError
from .gguf_io.writer import encode_header
from .outputs import AtomicOutput, OutputFile, expand_inputs, resumable_names
from .version import __version__

log = logging.getLogger("quantkit")

FORMAT = 1
SYNC_SECONDS = 2.0          # at most this much finished work is lost to a kill
READ_BYTES = 8 << 20        # read back / verified a piece at a time
_HEX = re.compile(r"^[0-9a-f]{64}$")
_FINISH, _ABANDON = object(), object()     # the journal thread's last item


@dataclass(frozen=True)
class Span:
    shard: int
    offset: int             # in the shard's file
    nbytes: int


def _sha256_of(fd: int, offset: int, nbytes: int, buf: bytearray) -> str | None:
    """sha256 of ``nbytes`` of the file at ``offset``; None where the file is shorter."""
    h = hashlib.sha256()
    view = memoryview(buf)
    while nbytes:
        n = os.preadv(fd, [view[:min(nbytes, len(buf))]], offset)
        if n <= 0:
            return None
        h.update(view[:n])
        offset, nbytes = offset + n, nbytes - n
    return h.hexdigest()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view):]


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def fingerprint(model, plan, shards, imatrix_for) -> dict:
    """The journal's first line for this run (see the module docstring)."""
    files = []
    read = expand_inputs([model.path, *(f.path for f in getattr(model, "files", ()))])
    for p in dict.fromkeys(os.path.realpath(p) for p in read):
        try:
            st = os.stat(p)
            files.append([p, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino])
        except OSError:
            files.append([p, None])
    plan_hash = hashlib.sha256(json.dumps([plan.flavor, [[t.name, t.input_name, t.action, int(t.src_type),
                                                          int(t.dst_type)] for t in plan.tensors]]).encode())
    for meta, specs in shards:
        header, _ = encode_header(meta, specs)
        plan_hash.update(len(header).to_bytes(8, "little"))
        plan_hash.update(header)
    imatrix_hash = hashlib.sha256()
    for tp in plan.tensors:
        w = imatrix_for(tp) if tp.action in ("quantize", "convert") else None
        if w is not None:
            w = np.ascontiguousarray(w)
            imatrix_hash.update(json.dumps([tp.name, str(w.dtype), list(w.shape)]).encode())
            imatrix_hash.update(w.reshape(-1).view(np.uint8))
    return {"quantkit_resume": FORMAT, "version": __version__,
            "input": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
            "plan": plan_hash.hexdigest(), "imatrix": imatrix_hash.hexdigest()}


_DIFFERS = {"version": "by another quantkit version", "input": "from another input (or it changed since)",
            "plan": "with another TYPE, recipe or option", "imatrix": "with another importance matrix"}


def _read_journal(path: Path, limit: int) -> list[bytes] | None:
    """The complete lines of a journal (at most ``limit`` bytes of it); None where there is no
    readable regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            data.append(b)
            left -= len(b)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(data).split(b"\n")[:-1]     # the last piece has no newline: cut short


def _record(line: bytes) -> tuple[str, int, int, str] | None:
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(r, dict):
        return None
    t, o, n, h = r.get("t"), r.get("o"), r.get("n"), r.get("h")
    if not (isinstance(t, str) and type(o) is int and type(n) is int and isinstance(h, str) and _HEX.match(h)):
        return None
    return t, o, n, h


class ResumableRun:
    """The journals and verified tensors of one ``--resume`` run; see the module docstring."""

    def __init__(self, model, plan, paths: list[Path], shards, imatrix_for, workers: int = 1, inputs=()):
        self.paths = [Path(p) for p in paths]
        self.inputs = list(inputs)         # every file the run reads: never its partial or journal
        self.shards = shards
        self.workers = max(1, workers)
        self.fingerprint = fingerprint(model, plan, shards, imatrix_for)
        self.spans: dict[str, Span] = {}
        self.sizes: list[int] = []
        for i, (meta, specs) in enumerate(shards):
            header, offsets = encode_header(meta, specs)
            for spec, off in zip(specs, offsets):
                self.spans[spec.name] = Span(i, len(header) + off, spec.nbytes)
            self.sizes.append(len(header) + (offsets[-1] + specs[-1].nbytes if specs else 0))
        self.verified: set[str] = set()
        self.reused_bytes = 0
        self.started_over: str | None = None
        self._files: list[OutputFile] = []
        self._fds: list[int] = []           # our own dups of the partials: for reading back and syncing
        self._journals: list[Path] = []
        self._journal_fds: list[int] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # names written, then _FINISH or _ABANDON
        self._journaled = 0
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ opening
    def open(self, output: AtomicOutput) -> None:
        """Open every shard's partial in ``output`` (locked), verify what its journal lists, and
        start a new journal holding the fingerprint and the verified tensors."""
        reasons = []
        read = set()
        for p in expand_inputs(self.inputs):
            try:
                st = os.stat(p)
                read.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        for i, path in enumerate(self.paths):
            f = output.open(path, resumable=True)
            journal = resumable_names(f.final)[1]
            for p, st in ((f.tmp, os.fstat(f.fd)), (journal, _stat_or_none(journal))):
                if st is not None and (st.st_dev, st.st_ino) in read:    # checked before anything is written
                    raise QuantkitError(f"'{p}' (where --resume keeps the partial output of '{f.shown}') is a file "
                                        "this run reads; choose another output path")
            self._files.append(f)
            self._fds.append(os.dup(f.fd))
            self._journals.append(journal)
            try:
                if os.fstat(f.fd).st_size > self.sizes[i]:
                    os.ftruncate(f.fd, self.sizes[i])   # never a byte past the output
                size = os.fstat(f.fd).st_size
            except OSError as e:
                raise QuantkitError(f"{f.shown}: cannot use '{f.tmp}': {e.strerror}") from None
            good, why = self._verify_shard(i, journal, size)
            if why:
                reasons.append(why)
            self._start_journal(i, journal, good)
        if reasons:
            self.started_over = reasons[0]
            log.warning(f"--resume: writing '{self.paths[0]}' from the start: {reasons[0]}")
        self._thread = threading.Thread(target=self._journal_loop, name="quantkit-resume-journal", daemon=True)
        self._thread.start()

    def _verify_shard(self, i: int, journal: Path, size: int) -> tuple[list[tuple], str | None]:
        """The journaled tensors of shard ``i`` whose bytes check out, and why none are used (None:
        it matched, or there was nothing to resume)."""
        names = [s.name for s in self.shards[i][1]]
        limit = 65536 + sum(256 + 8 * len(n.encode()) for n in names)
        lines = _read_journal(journal, limit)
        if not lines:
            return [], ("its journal is missing or unreadable" if size else None)
        try:
            head = json.loads(lines[0])
        except (ValueError, RecursionError):
            head = None
        if not isinstance(head, dict) or head.get("quantkit_resume") != FORMAT:
            return [], "its journal is damaged or of another format"
        for key, why in _DIFFERS.items():
            if head.get(key) != self.fingerprint[key]:
                return [], f"the partial was written {why}"
        records = {}
        for line in lines[1:]:
            r = _record(line)
            if r is None:
                continue
            span = self.spans.get(r[0])
            if span is not None and span.shard == i and (span.offset, span.nbytes) == r[1:3] \
                    and span.offset + span.nbytes <= size:
                records[r[0]] = r
        fd = self._fds[i]

        def check(r):
            return _sha256_of(fd, r[1], r[2], bytearray(min(READ_BYTES, r[2]) or 1)) == r[3]
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="quantkit-resume-verify")
        try:
            ok = list(pool.map(check, records.values()))
        except OSError:
            return [], "its partial could not be read"
        finally:                # an interrupt waits for the tensors being hashed, not for all of them
            pool.shutdown(wait=True, cancel_futures=True)
        good = [r for r, k in zip(records.values(), ok) if k]
        for r in good:
            self.verified.add(r[0])
            self.reused_bytes += r[2]
        return good, None

    def _start_journal(self, i: int, journal: Path, good: list[tuple]) -> None:
        """A new journal: the fingerprint, then the tensors verified, renamed over the old one
        (an interrupt keeps one or the other whole)."""
        new = journal.with_name(journal.name + "-new")
        text = "".join(json.dumps(x) + "\n" for x in
                       [self.fingerprint, *({"t": t, "o": o, "n": n, "h": h} for t, o, n, h in good)])
        try:
            try:
                os.unlink(new)          # left by a run killed here: ours to replace (a link: not followed)
            except FileNotFoundError:
                pass
            fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            self._journal_fds.append(fd)
            _write_all(fd, text.encode())
            os.fdatasync(fd)
            os.replace(new, journal)
        except OSError as e:
            raise QuantkitError(f"{self._files[i].shown}: cannot write the --resume journal '{journal}': "
                                f"{e.strerror}") from None

    # ------------------------------------------------------------ the run
    def reused(self, name: str) -> bool:
        """Whether tensor ``name`` is already in place (verified): the run skips it."""
        return name in self.verified

    def record(self, name: str) -> None:
        """Tensor ``name`` is written: journal it (in the background)."""
        self._queue.put(name)       # no lock: an interrupt here cannot leave one held

    def _journal_loop(self) -> None:
        """Batches of written tensors: hashed, the partial synced, then their lines appended;
        a batch is what was written until SYNC_SECONDS after the last sync."""
        last = -SYNC_SECONDS
        buf = bytearray(READ_BYTES)
        while True:
            batch, finish = [], False
            item = self._queue.get()
            while True:
                if item is _ABANDON:
                    return
                if item is _FINISH:
                    finish = True
                    break
                batch.append(item)
                wait = last + SYNC_SECONDS - time.monotonic()
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
            try:
                lines: dict[int, list[str]] = {}
                for name in batch:
                    s = self.spans[name]
                    h = _sha256_of(self._fds[s.shard], s.offset, s.nbytes, buf)
                    if h is not None:
                        lines.setdefault(s.shard, []).append(
                            json.dumps({"t": name, "o": s.offset, "n": s.nbytes, "h": h}))
                for i in lines:
                    os.fdatasync(self._fds[i])      # the tensors' bytes are durable before their lines
                for i, ls in lines.items():
                    _write_all(self._journal_fds[i], ("\n".join(ls) + "\n").encode())
                    os.fdatasync(self._journal_fds[i])
                    self._journaled += len(ls)
            except OSError as e:
                self._failed = e.strerror or str(e)
                log.warning(f"--resume: cannot keep the journal of '{self.paths[0]}' ({self._failed}): "
                            "an interrupted run will redo the tensors written from here on")
                return
            last = time.monotonic()
            if finish:
                return

    def _stop_thread(self, abandon: bool) -> None:
        """Stop the journal thread: at once (``abandon``), or once every tensor written is journaled."""
        if self._thread is not None:
            self._queue.put(_ABANDON if abandon else _FINISH)
            self._thread.join()
            self._thread = None

    def _close(self) -> None:
        for fd in self._fds + self._journal_fds:
            os.close(fd)
        self._fds, self._journal_fds = [], []

    def finish(self) -> None:
        """The output is complete and in place: the journals go."""
        self._stop_thread(abandon=True)
        self._close()
        for j in self._journals:
            try:
                os.unlink(j)
            except OSError:
                pass

    def keep(self, exc: BaseException) -> None:
        """The run stopped on ``exc``: journal what was written, and keep the partials for the
        next ``--resume`` run (or remove them where they hold nothing yet), saying so."""
        self._stop_thread(abandon=False)
        held = len(self.verified) + self._journaled
        if held == 0:
            for f, j in zip(self._files, self._journals):
                for p in (f.tmp, j):
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
            self._close()
            return
        self._close()
        total = len(self.spans)
        size = 0
        for f in self._files:
            try:
                size += os.stat(f.tmp).st_size
            except OSError:
                pass
        files = ", ".join(f"'{f.tmp}'" for f in self._files)
        shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
        note = (f"quantize: kept the partial output {files} ({shown}, {held} of {total} tensors done and "
                f"journaled); run the same command with --resume to go on from there")
        if isinstance(exc, KeyboardInterrupt):
            exc.add_note(note)
            exc.partial_kept = True
        else:
            log.warning(note)

    def abandon(self) -> None:
        """Opening failed: close what was opened (the files stay as they were; an empty partial
        made here goes)."""
        self._stop_thread(abandon=True)
        for f, fd in zip(self._files, self._fds):
            try:
                if os.fstat(fd).st_size == 0:
                    os.unlink(f.tmp)
            except OSError:
                pass
        self._close()


def note_leftovers(paths: list[Path]) -> None:
    """A run without --resume: say where an earlier --resume run left a partial of the same output."""
    for p in paths:
        partial = resumable_names(Path(os.path.realpath(p)))[0]
        if os.path.lexists(partial):
            log.warning(f"'{partial}' holds the partial output of an interrupted 'quantize --resume' run of "
                        f"'{p}': this run leaves it there; run with --resume to go on from it, or remove it")


@contextmanager
def resumable_output(enabled: bool, output: AtomicOutput, model, plan, paths, shards, imatrix_for,
                     workers: int = 1, inputs=()):
    """Around a run's GGUFWriter: with ``enabled``, a :class:`ResumableRun` whose partials are
    opened in ``output`` (the writer's), kept when the block raises, whose journals go when it
    completes; else None (and a note about partials an earlier --resume run left).  ``inputs``:
    every file the run reads (never a partial or journal)."""
    if not enabled:
        note_leftovers(paths)
        yield None
        return
    run = ResumableRun(model, plan, paths, shards, imatrix_for, workers, inputs)
    try:
        run.open(output)
    except BaseException:
        run.abandon()
        output.discard()        # closes the partials, keeps them
        raise
    try:
        yield run
    except BaseException as e:
        run.keep(e)
        raise
    run.finish()
