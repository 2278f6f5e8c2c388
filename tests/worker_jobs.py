"""Jobs for tests/test_workers.py: module-level functions, so that worker processes (and Ray's)
import them by name."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from quantkit.errors import GGUFFormatError, QuantkitError


def square(x):
    return x * x


def where(job):
    """(the job, the process that ran it, its thread settings, whether it ignores Ctrl-C)."""
    return job, os.getpid(), os.environ.get("NUMBA_NUM_THREADS"), signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def numba_threads(job):
    """The threads numba computes on in this process, and the most it may use."""
    import numba
    return numba.get_num_threads(), numba.config.NUMBA_NUM_THREADS


def refuse(job):
    """A user error on job 2 (GGUFFormatError: its __init__ takes (path, offset, msg), which
    plain pickling cannot rebuild); the others succeed."""
    if job == 2:
        raise GGUFFormatError("model.gguf", 24, "tensor count 9999999 exceeds the file")
    return job


def refuse_plain(job):
    if job == 1:
        raise QuantkitError("budget 1G is below the smallest recipe")
    return job


def bug(job):
    if job == 1:
        return {"a": 1}["b"]
    return job


def die(job):
    if job == 1:
        os.kill(os.getpid(), 9)
    return job


def sleep_and_note(job):
    """Writes its pid into the folder named by the job, then sleeps: an interrupt finds it running.
    A KeyboardInterrupt in the sleep leaves a note."""
    folder, seconds = job
    Path(folder, f"{os.getpid()}.pid").write_text("")
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:       # a Ctrl-C reached the worker (it should reach the parent alone)
        Path(folder, f"{os.getpid()}.interrupted").write_text("")
        raise
    return os.getpid()


def unpicklable_result(job):
    return lambda: job


def main(folder: str, n_jobs: int, seconds: float, ray_address: str | None = None) -> int:
    """A command that runs sleeping jobs on two workers (local processes, or a Ray cluster), for the
    signal tests: exits as quantkit's CLI does (130 on Ctrl-C, 128 + the signal on SIGTERM / SIGHUP)."""
    import sys
    from quantkit.signals import Terminated, terminate_on_signals
    from quantkit.workers import run_jobs
    import worker_jobs      # this file is __main__ here: the workers import the jobs by the module's name
    try:
        with terminate_on_signals():
            run_jobs(worker_jobs.sleep_and_note, [(folder, seconds)] * n_jobs, workers=2, ray_address=ray_address)
    except Terminated as e:
        print(f"terminated by {e.name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5]))
