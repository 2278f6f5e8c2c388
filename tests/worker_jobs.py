"""Jobs for tests/test_workers.py: module-level functions, so that worker processes (and Ray's)
import them by name."""
from __future__ import annotations

import os
import time
from pathlib import Path

from quantkit.errors import GGUFFormatError, QuantkitError


def square(x):
    return x * x


def where(job):
    """(the job, the process that ran it, its thread settings)."""
    return job, os.getpid(), os.environ.get("NUMBA_NUM_THREADS")


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
    """Writes its pid into the folder named by the job, then sleeps: an interrupt finds it running."""
    folder, seconds = job
    Path(folder, f"{os.getpid()}.pid").write_text("")
    time.sleep(seconds)
    return os.getpid()


def unpicklable_result(job):
    return lambda: job
