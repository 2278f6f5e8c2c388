"""The threads that run the CPU's row-parallel work (a product's tiles, a kernel's rows) side by side.

``ops_cpu`` splits its products and elementwise kernels here; the host-side work beside the backend
(rounding activations the way mainline does, scoring logits) splits its rows the same way.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba

from . import team as teams


def _thread_count_functions():
    """(get, set) of numba's thread count for the calling thread, without the process-wide lock
    numba.get_num_threads / set_num_threads take on every call (a multiprocessing lock: on a busy
    machine a holder that lost its core kept the pool's threads waiting, 2.2 s of an imatrix run
    of 6.8 s); numba's own functions where its internals differ."""
    numba.get_num_threads()                         # launches numba's threads: the raw functions exist
    from numba.np.ufunc import parallel
    get, put = getattr(parallel, "_get_num_threads", None), getattr(parallel, "_set_num_threads", None)
    if callable(get) and callable(put) and get() == numba.get_num_threads():
        return get, put
    return numba.get_num_threads, numba.set_num_threads


_get_threads = _set_threads = None


def numba_threads() -> int:
    """numba's thread count on the calling thread (numba.get_num_threads, lock-free)."""
    global _get_threads, _set_threads
    if _get_threads is None:
        _get_threads, _set_threads = _thread_count_functions()
    return int(_get_threads())


def set_numba_threads(n: int) -> None:
    """numba.set_num_threads(n) on the calling thread, lock-free; n a count numba_threads gave, or 1."""
    if _set_threads is None:
        numba_threads()
    _set_threads(n)


# below this many tokens a product's tiles run one after the other (generation: 10.0 -> 12.9
# tokens/s for SmolLM2 Q4_K on 2 threads), from it on side by side (a 128-token prompt: 190 -> 256)
FEW_TOKENS = 8


class TilePool:
    """Threads that decode and multiply the tiles of one product side by side.

    Each tile is decoded and multiplied by one thread, with numba and BLAS both single-threaded
    there: the threads are ours alone.  Letting numba's parallel decoders and a multi-threaded
    BLAS take turns instead made each wait for the other's spinning threads: 20x slower per token
    on 2 cores (1.3 s against 0.07 s for SmolLM2)."""

    def __init__(self):
        self._pool, self._n = None, 0

    @staticmethod
    def threads(n_tokens: int) -> int:
        """Threads a product of ``n_tokens`` rows runs its tiles on.  A few tokens: one, since the
        product is cheap beside the decoding, which numba's parallel decoders spread over the
        threads without the pool's per-tile hand-offs."""
        return numba_threads() if n_tokens >= FEW_TOKENS else 1

    def map(self, fn, items, n_tokens: int):
        """[fn(item) for item in items], the items taken in turn by the calling thread and n - 1
        pool threads.  The caller works instead of waiting (a hand-off to two pool threads cost
        ~100 us on a busy 2-core machine, and a prompt pass of SmolLM2 makes ~400); while it does
        numba runs its kernels on one thread there, as on the pool's threads (parallel ones would
        leave numba's threads spinning on the cores the pool's threads need: see by_rows)."""
        n = self.threads(n_tokens)
        items = list(items)
        if n <= 1 or len(items) <= 1:
            return [fn(i) for i in items]
        teams.team.park()           # a generation step's spinning helpers (team.py) leave the cores
        if self._pool is None or self._n != n:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(n - 1, thread_name_prefix="quantkit-matmul",
                                            initializer=set_numba_threads, initargs=(1,))
            self._n = n
        results = [None] * len(items)
        order = iter(range(len(items)))         # shared: each next() under the GIL, one taker per item

        def work():
            for i in order:
                results[i] = fn(items[i])
        helpers = [self._pool.submit(work) for _ in range(min(n - 1, len(items) - 1))]
        caller_threads = numba_threads()
        set_numba_threads(1)
        try:
            work()
        finally:
            set_numba_threads(caller_threads)
            for h in helpers:
                h.result()          # every helper done before returning (or raising)
        return results


pool = TilePool()


def by_rows(fn, n_rows: int, n_tokens: int | None = None) -> None:
    """``fn(r0, r1)`` over all rows (of ``n_tokens`` tokens, one row each by default): for a batch split between the tile pool's threads, where
    numba kernels run single-threaded; for a few rows in one call (numba's own parallel rows).

    Between the products of a batch a numba-parallel kernel must not run on the calling thread:
    after each parallel region numba's OpenMP threads spin for a while, on the cores the pool's
    threads need next (a prompt of SmolLM2 Q8_0: 191 -> 289 tokens/s without them)."""
    n_tokens = n_rows if n_tokens is None else n_tokens
    n = pool.threads(n_tokens)
    if n <= 1 or n_rows < 2 * n:
        fn(0, n_rows)
        return
    step = -(-n_rows // n)
    pool.map(lambda r0: fn(r0, min(n_rows, r0 + step)), range(0, n_rows, step), n_tokens)


def by_causal_rows(fn, n_rows: int, pos0: int) -> None:
    """``fn(r0, r1)`` over the query rows of a causal attention (row r at position pos0 + r sees
    pos0 + r + 1 keys, its work growing with r): for a batch one contiguous run of rows per pool
    thread, the runs cut where the keys they read are equal, each run's kernel single-threaded on
    its thread; for a few rows one call (numba's own parallel jobs).

    A prompt's attention called on the calling thread as one numba-parallel kernel left numba's
    threads spinning on the cores the next product's pool threads need (by_rows): SmolLM2 Q8_0's
    128-token pass on a busy 2-core machine spent 160-450 ms in attention against 25 ms here."""
    n = pool.threads(n_rows)
    if n <= 1 or n_rows < 2 * n:
        fn(0, n_rows)
        return
    # keys read by rows 0..r-1: r pos0 + r (r + 1) / 2; cut at multiples of the total / n
    total = n_rows * pos0 + n_rows * (n_rows + 1) // 2
    cuts, r = [0], 0
    for i in range(1, n):
        while r < n_rows and r * pos0 + r * (r + 1) // 2 < total * i // n:
            r += 1
        if r > cuts[-1]:
            cuts.append(r)
    cuts.append(n_rows)
    spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]
    pool.map(lambda span: fn(*span), spans, n_rows)
