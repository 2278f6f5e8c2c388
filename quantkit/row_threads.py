"""Rows of numpy work split between threads, for the conversions that need no numba kernel.

numpy releases the GIL inside its loops, so a few threads each running the same numpy steps on
their own rows keep that many cores busy (the Python between the steps is short beside a step on
a few hundred rows).  The F16/BF16 decoders and the q8_0 quantizer run this way: a q8_0 quantize
of an F16 model then never imports numba (~0.3 s of a whole command) nor loads its kernels.

The thread count is the quantize command's (``set_threads``, beside numba's own); results never
depend on it, since every row is computed alone.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

#: rows per part at least: below this the hand-over to a thread costs more than it saves
MIN_VALUES_PER_PART = 64 * 1024
#: a thread keeps its work arrays up to this size (the quantize command's chunks are 4 MiB of float32)
KEPT_SCRATCH_BYTES = 8 * 1024 * 1024

_threads = 0                    # 0: os.cpu_count()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def set_threads(n: int | None) -> None:
    """Threads for :func:`over_rows` (None or 0: one per CPU)."""
    global _threads
    _threads = max(0, int(n or 0))


def threads() -> int:
    return _threads or os.cpu_count() or 1


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="quantkit-rows")
            _pool_size = n
        return _pool


def over_rows(fn: Callable[[int, int], None], n_rows: int, n_per_row: int) -> None:
    """``fn(start, stop)`` for consecutive row ranges covering ``n_rows``, one range per thread
    (this one runs the first), each at least MIN_VALUES_PER_PART values; returns when all are
    done, raising the first range's exception (in row order) if any raised."""
    parts = max(1, min(threads(), n_rows, n_rows * n_per_row // MIN_VALUES_PER_PART))
    if parts == 1:
        fn(0, n_rows)
        return
    bounds = [n_rows * i // parts for i in range(parts + 1)]
    pool = _executor(parts - 1)
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        fn(bounds[0], bounds[1])
    finally:
        errors = [f.exception() for f in futures]       # waits for every part
    for e in errors:
        if e is not None:
            raise e


_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A work array of this thread, reused from call to call (grown when a call needs more; one of
    more than KEPT_SCRATCH_BYTES is made for the call alone).

    A fresh array of a few MiB costs its page faults on every chunk (malloc gives such blocks back
    to the system when they are freed): several times the numpy step that fills it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes > KEPT_SCRATCH_BYTES:
        return np.empty(shape, dtype)
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[name] = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)
