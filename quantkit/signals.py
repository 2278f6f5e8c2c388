"""SIGTERM and SIGHUP end a run the way Ctrl-C does, and no interrupt is lost.

Python turns SIGINT into KeyboardInterrupt, and every cleanup (temporary outputs removed, files
closed) runs on the way out.  SIGTERM (kill, systemd, a batch scheduler) and SIGHUP (a closed
terminal or SSH session) would otherwise end the process at once and leave a preallocated
full-size partial output behind.  Signals the process was started with ignored (nohup) stay ignored.

A handler's exception can be lost: Python runs signal handlers between bytecodes of the main
thread, and when that is inside a ctypes callback (llvmlite calls back into Python while numba
compiles or loads a cached kernel) the exception is printed as "Exception ignored" and dropped, and
the run would go on to write its output.  So the handler also records the signal, and the long
loops call :func:`check` at their progress points (each tensor, chunk and forward pass), which
raises it again; the lost exception is not printed.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_pending: list[int] = []        # the signal that arrived inside terminate_on_signals, if any
_deferring: list[bool] = []     # inside deferred(): the handler records the signal, raises nothing


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: a KeyboardInterrupt, so whatever cleans up after Ctrl-C cleans up
    after these too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _interrupt(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def check() -> None:
    """At a progress point of a long loop: raise the interrupt of a signal that arrived before, in
    case its handler's exception was lost (see the module docstring).  Not for cleanup code."""
    if _pending:
        raise _interrupt(_pending[0])


@contextmanager
def terminate_on_signals(signums=HANDLED):
    """Within the block, SIGINT raises KeyboardInterrupt and SIGTERM / SIGHUP raise
    :class:`Terminated` in the main thread, and :func:`check` raises them again where they were
    lost.  After the first SIGTERM or SIGHUP later ones are ignored, so that they cannot interrupt
    the cleanup of the first (Ctrl-C interrupts each time, as Python's own handler does)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if signum != signal.SIGINT and _pending:
            return              # a second SIGTERM / SIGHUP: the first one's cleanup is running
        if not _pending:
            _pending.append(signum)
        if _deferring:
            return              # raised by check() at the end of the deferred() block
        raise _interrupt(signum)

    def unraisable(info):
        if not isinstance(info.exc_value, KeyboardInterrupt):   # ours, raised again by check()
            previous_hook(info)

    previous = {}
    for s in signums:
        current = signal.getsignal(s)
        if current is signal.SIG_IGN:
            continue
        previous[s] = current
        signal.signal(s, handler)
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = previous_hook
        _pending.clear()


@contextmanager
def deferred():
    """Within the block an interrupt waits, and is raised at its end: for a few statements that
    must happen together or not at all, such as a save and the count of what it saved, which an
    interrupt between them would make disagree.  (Blocking the signal would not do: the kernel
    hands a process's signal to any thread that does not block it, numba's included.)"""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if not _deferring:
        check()
