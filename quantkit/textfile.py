"""Text files named on the command line (recipes, calibration text), read with a size bound.

Only regular files: a FIFO would block and a device such as /dev/zero never ends; a bound on the
size keeps a wrong path (a model instead of a text) from filling the memory.
"""
from __future__ import annotations

import errno
import os
import stat

from .errors import QuantkitError

_CHUNK = 1 << 20


def _why(e: Exception) -> str:
    if isinstance(e, OSError):
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "not found"
        return e.strerror or str(e)
    return str(e)           # ValueError: a NUL byte in the path


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def read_text(path, what: str, limit: int, errors: str = "strict") -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; anything else (missing,
    a directory, FIFO or device, larger, unreadable, not UTF-8 with ``errors="strict"``) is a user
    error naming ``what`` (the option) and the path."""
    try:
        # O_NONBLOCK: opening a FIFO without a writer would otherwise wait forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        raise QuantkitError(f"{what} {path}: {_why(e)}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise QuantkitError(f"{what} {path}: is a directory, not a text file")
        if not stat.S_ISREG(st.st_mode):
            raise QuantkitError(f"{what} {path}: not a regular file (a FIFO or device is not read)")
        if st.st_size > limit:
            raise QuantkitError(f"{what} {path}: {_size(st.st_size)} is more than the {_size(limit)} a text may have")
        parts, total = [], 0
        while total <= limit:               # in parts: the size may be 0 (/proc) or grow meanwhile
            part = os.read(fd, _CHUNK)
            if not part:
                break
            parts.append(part)
            total += len(part)
    except OSError as e:
        raise QuantkitError(f"{what} {path}: {_why(e)}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise QuantkitError(f"{what} {path}: more than the {_size(limit)} a text may have")
    try:
        return b"".join(parts).decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{what} {path}: not UTF-8 text (byte {e.start})") from None
