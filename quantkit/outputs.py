"""The user's output files: every file quantkit writes is checked and written here.

Before any work, :func:`check_outputs` refuses an output path that

* exists and is not a regular file (a device, a FIFO, a socket, a directory): renaming over it
  would replace ``/dev/null`` (as root) or a FIFO with a regular file;
* is one of the files the command reads, compared by identity (device and inode, so hard links
  and symlinks count), including every shard of a split GGUF and the files of a model directory;
* is a file the user may not write (read-only), or lies in a directory that does not exist or
  is not writable, or has a longer name than the file system allows.

A symlink is written through: the new file replaces the link's final target, in the target's
directory, and the link stays a link (llama-quantize's fopen writes through it as well).

:class:`AtomicOutput` writes each file under a short hidden temporary name in the final directory,
``.<first 64 bytes of the name>.qk<pid>-<8 hex>.partial`` (a bounded length, so that an output
named near NAME_MAX still has a valid temporary name), and renames it over the final path only
on commit: an error, Ctrl-C, SIGTERM or SIGHUP leaves neither output nor partial file.  A new
file gets 0666 & ~umask, as fopen gives llama-quantize; a replaced file keeps its permission bits
(and its group where the user may set it).  Failed writes (full disk, quota, I/O error) become one
QuantkitError naming the output.

The writer holds an flock on its temporary file until commit or discard.  A run that is killed
(SIGKILL, a crash) leaves its preallocated partial behind with no holder: the next output written
to that directory removes it and says so.

``quantize --resume`` (:mod:`quantkit.resume`) writes instead under a name of its own that the next
run can find, ``.<first 64 bytes of the name>.qkresume-<8 hex of the whole name>.partial``, opened
with :meth:`AtomicOutput.open` ``resumable=True``: an error or a signal closes it but keeps it (and
its ``.journal``) for the next ``--resume`` run.  Stale-partial sweeps never match these names:
they are removed only by the ``--resume`` run that completes them (renamed into place) or starts
them over, or by the user; a run without ``--resume`` of the same OUT leaves them and says so.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Iterable

from .errors import QuantkitError
from .gguf_io.constants import SPLIT_NAME_RE, split_shard_name
from .inputs import file_kind

log = logging.getLogger("quantkit")

PREFIX_BYTES = 64           # of the output's name kept in its temporary name (for people who see it)
_PARTIAL_RE = re.compile(r"^\..*\.qk(\d+)-[0-9a-f]{8}\.partial$", re.S)
RESUMABLE_RE = re.compile(r"^\..*\.qkresume-[0-9a-f]{8}\.(partial|journal|journal-new)$", re.S)
_swept: set[str] = set()    # directories already cleaned of stale partials in this process


def _stat(path: Path, shown: str) -> os.stat_result | None:
    """stat following symlinks; None when nothing is there."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise QuantkitError(f"{shown}: {e.strerror}") from None


def _describe(path: Path, what: str) -> str:
    return f"{what} '{path}'" + (f" (a symlink to '{os.path.realpath(path)}')" if os.path.islink(path) else "")


def check_output(path: str | os.PathLike, what: str = "OUT") -> Path:
    """The file ``path`` will replace (a symlink's final target), after checking that it can be
    written: absent or a regular file, in an existing writable directory, with a valid name."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    shown = _describe(path, what)
    parent = target.parent
    pst = _stat(parent, shown)
    if pst is None or not stat.S_ISDIR(pst.st_mode):
        raise QuantkitError(f"{shown}: directory '{parent}' does not exist")
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    n = len(os.fsencode(target.name))
    if n > name_max:
        raise QuantkitError(f"{shown}: the file name is {n} bytes long, the file system allows {name_max}")
    st = _stat(target, shown)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise QuantkitError(f"{shown} is {file_kind(st.st_mode)}: quantkit writes only regular files")
    if st is not None and not os.access(target, os.W_OK):
        raise QuantkitError(f"{shown} is read-only")     # as fopen would refuse it to llama-quantize
    if not os.access(parent, os.W_OK | os.X_OK):
        raise QuantkitError(f"{shown}: directory '{parent}' is not writable")
    return target


def expand_inputs(inputs: Iterable[str | os.PathLike | None]) -> list[Path]:
    """Every file the given inputs stand for: all shards of a split GGUF named by its first
    shard, the files of a model directory (not its GGUF files: the Hugging Face reader never reads
    them, they are earlier outputs; nor the partial and journal of a quantize --resume writing
    there), and plain files as they are.  ``None`` entries are skipped."""
    out: list[Path] = []
    for p in inputs:
        if p is None:
            continue
        p = Path(p)
        if os.path.isdir(p):
            try:
                out += [e for e in p.iterdir() if e.suffix != ".gguf" and not RESUMABLE_RE.match(e.name)
                        and os.path.isfile(e)]
            except OSError:
                pass
            continue
        out.append(p)
        m = SPLIT_NAME_RE.match(p.name)
        if m:
            count = int(m["count"])
            out += [p.with_name(split_shard_name(m["prefix"], i, count)) for i in range(min(count, 99999))]
    return out


def unused_name(path: Path, tag: str) -> Path:
    """``<stem>-<tag><suffix>`` next to ``path``, or ``<stem>-<tag>-2<suffix>``, … : the first name
    nothing (not even a dangling link) stands at, for a new output that must not replace one."""
    path = Path(path)
    candidate, n = path.with_name(f"{path.stem}-{tag}{path.suffix}"), 2
    while os.path.lexists(candidate):
        candidate = path.with_name(f"{path.stem}-{tag}-{n}{path.suffix}")
        n += 1
    return candidate


def check_outputs(outputs: Iterable[str | os.PathLike], inputs: Iterable[str | os.PathLike | None],
                  what: str = "OUT") -> list[Path]:
    """Check every path a command writes against every path it reads; the files each output
    replaces.  Call it with all of them before any work."""
    outputs = [Path(p) for p in outputs]
    read: dict[tuple[int, int], Path] = {}
    for p in expand_inputs(inputs):
        try:
            st = os.stat(p)
        except OSError:
            continue                # a missing input is the reader's error to report
        read.setdefault((st.st_dev, st.st_ino), p)
    written: dict[Path, Path] = {}
    for path in outputs:
        target = Path(os.path.realpath(path))
        try:
            st = os.stat(target)
        except OSError:
            st = None               # nothing there (or unreachable: check_output says why)
        if st is not None and (st.st_dev, st.st_ino) in read:
            src = read[(st.st_dev, st.st_ino)]
            same = "" if Path(os.path.realpath(src)) == target else f" '{src}'"
            raise QuantkitError(f"{_describe(path, what)} is the input file{same}; choose another output path")
        if target in written:
            raise QuantkitError(f"{what} '{path}' and '{written[target]}' are the same file")
        written[target] = path
    return [check_output(p, what) for p in outputs]


# ---------------------------------------------------------------- writing
def _lock(fd: int) -> bool | None:
    """Take the file's exclusive lock without waiting: True, False (another process holds it), or
    None where the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _temp_name(name: str) -> str:
    prefix = os.fsencode(name)[:PREFIX_BYTES].decode("utf-8", "ignore")
    return f".{prefix}.qk{os.getpid()}-{secrets.token_hex(4)}.partial"


def resumable_names(final: Path) -> tuple[Path, Path]:
    """The resumable partial file of output ``final`` (a symlink's target, a shard) and its journal:
    fixed names beside it, so that the next ``--resume`` run finds them."""
    final = Path(final)
    raw = os.fsencode(final.name)
    stem = f".{raw[:PREFIX_BYTES].decode('utf-8', 'ignore')}.qkresume-{hashlib.sha256(raw).hexdigest()[:8]}"
    return final.parent / f"{stem}.partial", final.parent / f"{stem}.journal"


def _open_resumable(path: Path, shown: str) -> int:
    """An fd (read-write, locked) of the resumable partial at ``path``, made if absent.  What is in
    the way (a symlink, a hard link: a name another file also has, a FIFO) is never written
    through: a link is unlinked (its target untouched) and a new file made; anything else that is
    not a regular file is an error."""
    for _ in range(4):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(path):
                os.unlink(path)                 # a symlink in the way: never written through
                continue
            if e.errno in (errno.EISDIR, errno.ENXIO):
                raise QuantkitError(f"{shown}: '{path}' (where --resume keeps its partial output) is not a regular "
                                    "file; remove it") from None
            raise QuantkitError(f"{shown}: cannot open '{path}': {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise QuantkitError(f"{shown}: '{path}' (where --resume keeps its partial output) is "
                                f"{file_kind(st.st_mode)}; remove it")
        if st.st_nlink > 1:                     # a hard link to another file (an input?): never written
            os.close(fd)
            os.unlink(path)
            continue
        if _lock(fd) is False:
            os.close(fd)
            raise QuantkitError(f"{shown}: another quantkit run is writing it with --resume (it holds '{path}')")
        os.set_blocking(fd, True)
        return fd
    raise QuantkitError(f"{shown}: cannot open '{path}': it keeps changing")


def sweep_stale_partials(directory: Path) -> None:
    """Remove the partial files of quantkit runs that died in ``directory`` (nobody holds their
    lock); once per directory and process."""
    key = os.path.realpath(directory)
    if key in _swept:
        return
    _swept.add(key)
    try:
        names = [n for n in os.listdir(directory) if _PARTIAL_RE.match(n)]
    except OSError:
        return
    removed, unknown = [], []
    for name in names:
        p = Path(directory) / name
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            held = _lock(fd)
            if held is None:
                unknown.append(name)
            elif held and os.path.samestat(os.lstat(p), st):
                os.unlink(p)        # under the lock: a live writer never loses its file (see AtomicOutput.open)
                removed.append((name, st.st_size))
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        size = sum(s for _, s in removed)
        log.warning(f"removed {len(removed)} partial file(s) of interrupted quantkit runs from "
                    f"'{directory}' ({size / 1e9:.2f} GB): {', '.join(n for n, _ in removed)}")
    for name in unknown:
        log.warning(f"'{Path(directory) / name}' looks like the partial file of an interrupted quantkit run "
                    f"(pid {_PARTIAL_RE.match(name)[1]}); remove it if no quantkit run is writing there")


class OutputFile:
    """A temporary file on its way to ``final``.  Writes that fail raise QuantkitError naming the
    output; ``close`` only ends writing (the file stays open and locked until commit/discard)."""

    def __init__(self, fd: int, tmp: Path, final: Path, shown: Path):
        self.fd, self.tmp, self.final, self.shown = fd, tmp, final, shown
        self.pos = 0                # where write() appends
        self.closed = False
        self.resumable = False      # kept (closed, not removed) by discard: quantize --resume

    def fileno(self) -> int:
        return self.fd

    def _failed(self, e: OSError):
        return QuantkitError(f"{self.shown}: cannot write: {e.strerror or e}")

    def pwrite(self, buf, pos: int) -> None:
        """Write all of ``buf`` (bytes-like, contiguous) at ``pos``; threads may call it side by side."""
        view = memoryview(buf).cast("B")
        try:
            while view.nbytes:
                n = os.pwrite(self.fd, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            raise self._failed(e) from None

    def write(self, buf) -> None:
        n = memoryview(buf).nbytes
        self.pwrite(buf, self.pos)
        self.pos += n

    def reserve(self, size: int) -> None:
        """Allocate the whole file before writing it.  A full disk is then an error before the
        first byte of data, not after hours of quantizing, and the writes land in allocated blocks:
        on ext4, writing into a fresh file without this ran at 0.5-3 GB/s (erratic), with it at
        4-5 GB/s."""
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise QuantkitError(f"{self.shown}: not enough disk space for {size / 1e9:.2f} GB") from None
            if e.errno == errno.EFBIG:
                raise QuantkitError(f"{self.shown}: {size / 1e9:.2f} GB is more than a file may hold here "
                                    f"({e.strerror})") from None
            # file systems without fallocate (EOPNOTSUPP, EINVAL): the writes allocate as they go

    def close(self) -> None:
        self.closed = True


def _keep_mode(fd: int, old: os.stat_result | None) -> None:
    """A file replacing ``old`` gets its permission bits (and its group where the user may set it)."""
    if old is not None:
        try:
            os.fchmod(fd, stat.S_IMODE(old.st_mode) & 0o777)
            os.fchown(fd, -1, old.st_gid)
        except OSError:
            pass            # another user's group: the directory's default stays


class AtomicOutput:
    """Temporary files renamed to their final paths on commit, deleted otherwise.  Also a context
    manager: leaving the block without an exception commits."""

    def __init__(self):
        self._pending: list[OutputFile] = []

    def open(self, path: str | os.PathLike, what: str = "OUT", resumable: bool = False) -> OutputFile:
        """A new temporary file for ``path``; with ``resumable``, the resumable partial of ``path``
        (made, or opened as an earlier run left it: its bytes are the caller's to check), opened
        once: asked again, the same file."""
        shown = Path(path)
        final = check_output(shown, what)
        sweep_stale_partials(final.parent)
        old = _stat(final, str(shown))
        if resumable:
            for f in self._pending:
                if f.final == final:
                    return f
            tmp = resumable_names(final)[0]
            f = OutputFile(_open_resumable(tmp, _describe(shown, what)), tmp, final, shown)
            f.resumable = True
            self._pending.append(f)
            _keep_mode(f.fd, old)
            return f
        for _ in range(16):
            tmp = final.parent / _temp_name(final.name)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except FileExistsError:
                continue
            except OSError as e:
                raise QuantkitError(f"{_describe(shown, what)}: cannot create a file in '{final.parent}': "
                                    f"{e.strerror}") from None
            f = OutputFile(fd, tmp, final, shown)
            self._pending.append(f)
            # a sweeping run may have taken the new file's lock first (then it removes the file) or
            # removed it just before we locked: take another name
            if _lock(fd) is False or os.fstat(fd).st_nlink == 0:
                self._pending.remove(f)
                os.close(fd)
                continue
            _keep_mode(fd, old)
            return f
        raise QuantkitError(f"{_describe(shown, what)}: cannot create a temporary file in '{final.parent}'")

    def commit(self) -> None:
        done: list[OutputFile] = []
        try:
            for f in self._pending:
                st = _stat(f.final, str(f.shown))
                if st is not None and not stat.S_ISREG(st.st_mode):   # made since the check
                    raise QuantkitError(f"OUT '{f.shown}' is {file_kind(st.st_mode)} now: quantkit writes only "
                                        "regular files")
            for f in self._pending:
                try:
                    os.replace(f.tmp, f.final)
                except OSError as e:
                    raise QuantkitError(f"{f.shown}: cannot rename the finished file into place: "
                                        f"{e.strerror}") from None
                done.append(f)
        except BaseException:
            for f in done:          # never a part of a split set under the final names
                try:
                    os.unlink(f.final)
                except OSError:
                    pass
            self._pending = [f for f in self._pending if f not in done]
            for f in done:
                os.close(f.fd)
            raise
        for f in self._pending:
            os.close(f.fd)
        self._pending.clear()

    def discard(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                if not f.resumable:
                    os.unlink(f.tmp)
            except FileNotFoundError:
                pass
            finally:
                os.close(f.fd)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()
        return False
