"""Opening the files quantkit reads, whatever their paths turn out to name.

A path can name a FIFO (a plain open() blocks until some writer appears, forever if none does), a
device (/dev/zero never ends; /dev/sda reports size 0), a directory or a socket. Only regular files
are read: each is opened with O_NONBLOCK, so that opening a FIFO returns at once, and checked with
fstat on the open descriptor, so nothing can swap the file between the check and the read. A
symbolic link is followed (Hugging Face's cache links every file of a model to a blob elsewhere).
Texts and JSON files are read whole, so they are read with a bound on their size: a wrong path (a
model instead of a text) must not fill the memory.
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .errors import QuantkitError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages ("a directory", "a FIFO (named pipe)", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _shown(path, what: str | None) -> str:
    return f"{what} {path}" if what else f"{path}"


def open_regular(path: str | os.PathLike, what: str | None = None) -> BinaryIO:
    """``path`` opened for binary reading; a QuantkitError if it is missing, unreadable or not a
    regular file (``what``, such as "-f", names the option in the message)."""
    shown = _shown(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise QuantkitError(f"{shown}: no such file") from None
    except ValueError:          # a NUL byte in the path
        raise QuantkitError(f"{shown}: not a valid path") from None
    except OSError as e:
        try:                    # a socket cannot be opened at all (ENXIO): say what it is
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise QuantkitError(f"{shown}: is {file_kind(mode)}, not a regular file") from None
        raise QuantkitError(f"{shown}: cannot open: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise QuantkitError(f"{shown}: is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def read_bounded(path: str | os.PathLike, limit: int, what: str, option: str | None = None) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (``what`` says what the file is, as
    "a chat template"; ``option`` names the option that gave the path).  Read to its end, not to
    its stated size: a size may be 0 (/proc) or grow meanwhile."""
    shown = _shown(path, option)
    with open_regular(path, option) as f:
        size = os.fstat(f.fileno()).st_size
        if size <= limit:
            try:
                data = f.read(limit + 1)
            except OSError as e:
                raise QuantkitError(f"{shown}: cannot read: {e.strerror}") from None
            size = len(data)
    if size > limit:
        raise QuantkitError(f"{shown}: more than the {_size(limit)} {what} may have")
    return data


def read_text(path: str | os.PathLike, option: str, limit: int, errors: str = "strict") -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; anything else (missing,
    a directory, FIFO or device, larger, unreadable, not UTF-8 with ``errors="strict"``) is a user
    error naming ``option`` and the path."""
    data = read_bounded(path, limit, "a text", option)
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{option} {path}: not UTF-8 text (byte {e.start})") from None
