"""Opening the files a model is read from, whatever their paths turn out to name.

A path can name a FIFO (a plain open() blocks until some writer appears, forever if none does), a
device (/dev/zero never ends; /dev/sda reports size 0), a directory or a socket. Only regular files
are read: each is opened with O_NONBLOCK, so that opening a FIFO returns at once, and checked with
fstat on the open descriptor, so nothing can swap the file between the check and the read. A
symbolic link is followed (Hugging Face's cache links every file of a model to a blob elsewhere).
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .errors import QuantkitError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path, mode: int) -> QuantkitError:
    return QuantkitError(f"{path}: is {_kind(mode)}, not a regular file")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for binary reading; a QuantkitError if it is missing, unreadable or not a
    regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise QuantkitError(f"{path}: no such file") from None
    except OSError as e:
        try:                    # a socket cannot be opened at all (ENXIO): say what it is
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode) from None
        raise QuantkitError(f"{path}: cannot open: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (``what`` names it in the error)."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise QuantkitError(f"{path}: larger than {limit >> 20} MiB, too large for {what}")
    return data
