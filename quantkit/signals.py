"""SIGTERM and SIGHUP end a run the way Ctrl-C does.

Python turns SIGINT into KeyboardInterrupt, and every cleanup (temporary outputs removed, files
closed) runs on the way out.  SIGTERM (kill, systemd, a batch scheduler) and SIGHUP (a closed
terminal or SSH session) would otherwise end the process at once and leave a preallocated
full-size partial output behind.  Signals the process was started with ignored (nohup) stay ignored.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: a KeyboardInterrupt, so whatever cleans up after Ctrl-C cleans up
    after these too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextmanager
def terminate_on_signals(signums=HANDLED):
    """Within the block, the first of ``signums`` to arrive raises :class:`Terminated` in the main
    thread; later ones are ignored so that they cannot interrupt the cleanup of the first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    previous = {}
    for s in signums:
        current = signal.getsignal(s)
        if current is signal.SIG_IGN:
            continue
        previous[s] = current
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
