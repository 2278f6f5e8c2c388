"""Independent jobs run in parallel: local worker processes, this process, or a Ray cluster.

``run_jobs(fn, jobs)`` calls ``fn(job)`` for every job and returns the results in job order, calling
``on_result(index, result)`` in this process as each one finishes (so whatever the caller records
there, a cache of results, survives an interrupt or a failed job).

Local workers are fresh interpreters (multiprocessing's "spawn"), never forks: the parent may hold
numba's OpenMP threads, which a forked child inherits broken.  Each worker computes on its share of
the cores (numba, OpenMP and BLAS thread counts are set before the job's code is imported), ignores
Ctrl-C (the terminal sends it to the whole process group: the parent alone reacts, and stops the
workers), and dies with the parent even when the parent is killed outright (Linux: the kernel's
parent-death signal; elsewhere a thread watching the parent).

Errors: a job's QuantkitError comes back as that error, one line; any other exception comes back as
itself with the worker's traceback as its cause (a bug: the CLI says "internal error"); a worker that
dies (a crash signal, the out-of-memory killer) is a QuantkitError naming the job and the signal.
The first failure stops the other workers; results already passed to ``on_result`` stay.

Ray (an optional extra, ``pip install -e '.[ray]'`` in the clone) is imported only when asked for.  Every
node imports ``fn``'s module and this one by name, so each needs quantkit installed, the same
version (Ray also puts the driver's working directory first on its workers' path).  A local instance
("local") lives in a temporary folder of its own, removed with it; Ray's notices are kept quiet and
its usage statistics off unless RAY_USAGE_STATS_ENABLED says otherwise.  What no code can clean up:
a driver killed outright (SIGKILL) leaves its local instance's folder behind, and Ray's dashboard
and runtime-env agents linger about a minute before they notice (measured with Ray 2.60).
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from multiprocessing import get_context
from multiprocessing.connection import wait

from . import signals
from .errors import QuantkitError

POLL_S = 0.5            # how often the parent looks up from waiting (a lost interrupt is raised then)
STOP_GRACE_S = 5.0      # a worker told to stop that is still alive after this is killed
# The thread pools a worker's job may start, each sized to the worker's share of the cores.
THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
RAY_INSTALL = "pip install -e '.[ray]' in quantkit's clone, or pip install 'ray>=2.9'"
RAY_LOCAL_OBJECT_STORE = 1 << 28    # jobs and results are small: specs and numbers
# A local Ray instance's sockets are <temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store:
# 64 characters after the folder, and a socket's path holds 107 at most.
RAY_SOCKET_TAIL = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
SOCKET_PATH_MAX = 107
RAY_CONNECT_TIMEOUT_S = 10.0


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as its ``__cause__``."""

    def __str__(self):
        return self.args[0]


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def run_jobs(fn, jobs, *, workers: int | None = None, ray_address: str | None = None, on_result=None,
             threads_per_job: int | None = None, describe=None) -> list:
    """``[fn(job) for job in jobs]``, computed in parallel.

    ``fn`` is a module-level function and every job picklable.  ``workers``: how many local worker
    processes (None: one per available core; 1: everything runs in this process, as also when there
    is at most one job).  ``ray_address``: submit the jobs to that Ray cluster instead ("auto", an
    address, "ray://..."), or "local" to start a Ray instance on this machine for the run (with
    ``workers`` CPUs, all by default), shut down after.  A Ray connection this process already has is
    used as it is.  ``threads_per_job``: the threads each job computes on (local workers: the cores
    divided between them; Ray: 1, and each task asks Ray for that many CPUs).  ``on_result(index,
    result)`` runs here, in this process, as each job finishes.  ``describe(job)``: what the errors call
    a job whose worker died ("job 3" by default)."""
    jobs = list(jobs)
    for name, value in (("workers", workers), ("threads per job", threads_per_job)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise QuantkitError(f"{name} must be a whole number of at least 1, not {value!r}")
    def label(index: int) -> str:
        return f"job {index}" if describe is None else str(describe(jobs[index]))
    if ray_address is not None:
        return _run_ray(fn, jobs, ray_address, workers, threads_per_job or 1, on_result, label)
    n = min(workers or available_cpus(), len(jobs))
    if n <= 1:
        return _run_here(fn, jobs, on_result)
    threads = threads_per_job or max(1, available_cpus() // n)
    return _run_processes(fn, jobs, n, threads, on_result, label)


def _run_here(fn, jobs, on_result) -> list:
    results = []
    for index, job in enumerate(jobs):
        signals.check()
        results.append(fn(job))
        if on_result is not None:
            on_result(index, results[-1])
    return results


# ---- what a worker sends back: ("ok", result) or ("error", exception, traceback text) ----

def _outcome(fn, job) -> tuple:
    try:
        return ("ok", fn(job))
    except BaseException as e:          # SystemExit, a stray KeyboardInterrupt: still the job's failure
        return _failure(e)


def _failure(e: BaseException) -> tuple:
    text = "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))   # an exception whose __init__ takes other arguments than its
    except Exception:                   # args (GGUFFormatError) does not unpickle: rebuilt, same text
        e = QuantkitError(str(e)) if isinstance(e, QuantkitError) else RuntimeError(f"{type(e).__name__}: {e}")
    return ("error", e, text)


def _raise_failure(outcome: tuple, label: str):
    _, e, text = outcome
    if isinstance(e, QuantkitError):
        raise e from None               # the user's problem, said in one line
    e.__cause__ = RemoteTraceback(f"\n{label}, in the worker:\n{text}")
    raise e


# ---- local worker processes ----

def _die_with_parent(parent_pid: int) -> None:
    """End this worker when the parent ends, even by SIGKILL (no orphans computing on)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent_pid:      # the parent was gone before the call
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent_pid:
            threading.Event().wait(POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="quantkit-parent-watch", daemon=True).start()


def _limit_threads(threads: int) -> None:
    """Size the job's thread pools, before its modules (numba) are imported where that is still to come."""
    for var in THREAD_VARS:
        given = os.environ.get(var, "")
        os.environ[var] = str(min(threads, int(given)) if given.isdigit() and int(given) > 0 else threads)
    if "numba" in sys.modules:      # imported already (by the parent's main module, by an earlier task)
        numba = sys.modules["numba"]
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def _worker_main(conn, fn_bytes: bytes, parent_pid: int, threads: int) -> None:
    """A worker's life: jobs in, outcomes out, until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _limit_threads(threads)         # fn and the jobs are unpickled after this
    fn = None
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            if fn is None:
                fn = pickle.loads(fn_bytes)
            outcome = _outcome(fn, pickle.loads(data))
        except BaseException as e:  # fn or the job does not unpickle here
            outcome = _failure(e)
        try:
            payload = pickle.dumps(outcome)
        except BaseException as e:  # a result that does not pickle
            payload = pickle.dumps(_failure(e))
        conn.send_bytes(payload)


class _Worker:
    def __init__(self, ctx, fn_bytes: bytes, threads: int, number: int):
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_end, fn_bytes, os.getpid(), threads),
                                   name=f"quantkit-worker-{number}")
        self.process.start()
        child_end.close()
        self.index: int | None = None       # the job it is running
        self.label = ""

    def give(self, index: int, job, label: str) -> None:
        self.conn.send_bytes(pickle.dumps(job))
        self.index, self.label = index, label

    def outcome(self) -> tuple:
        """The finished job's outcome; a QuantkitError when the worker died instead."""
        if self.conn.poll():
            try:
                return pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                pass
        self.process.join(STOP_GRACE_S)
        code = self.process.exitcode
        how = (f"with {signal.Signals(-code).name}" if code is not None and code < 0 and -code in signal.valid_signals()
               else f"with exit status {code}")
        hint = " (out of memory? fewer workers need less)" if code == -signal.SIGKILL else ""
        raise QuantkitError(f"a worker process died {how} while running {self.label}{hint}")

    def stop(self) -> None:
        """Ask it to end: an idle worker ends on the closed pipe, a busy one is terminated."""
        self.conn.close()
        if self.index is not None and self.process.is_alive():
            self.process.terminate()


def _run_processes(fn, jobs: list, n: int, threads: int, on_result, label) -> list:
    ctx = get_context("spawn")
    fn_bytes = pickle.dumps(fn)
    results: list = [None] * len(jobs)
    queue = iter(range(len(jobs)))
    pool: list[_Worker] = []
    done = 0
    try:
        for number in range(n):
            pool.append(_Worker(ctx, fn_bytes, threads, number))
        for w in pool:
            if (index := next(queue, None)) is not None:
                w.give(index, jobs[index], label(index))
        while done < len(jobs):
            busy = [w for w in pool if w.index is not None]
            ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy], POLL_S))
            signals.check()
            for w in busy:
                if w.conn not in ready and w.process.sentinel not in ready:
                    continue
                index, outcome = w.index, w.outcome()
                if outcome[0] == "error":
                    _raise_failure(outcome, w.label)
                w.index = None
                if (following := next(queue, None)) is not None:
                    w.give(following, jobs[following], label(following))      # before on_result: the worker computes meanwhile
                results[index] = outcome[1]
                done += 1
                if on_result is not None:
                    on_result(index, outcome[1])
    finally:
        with signals.deferred():    # under the CLI, a second Ctrl-C waits for the workers to be stopped
            _stop(pool)
    return results


def _stop(pool: list[_Worker]) -> None:
    for w in pool:
        w.stop()
    for w in pool:
        w.process.join(STOP_GRACE_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.process.close()


# ---- Ray ----

def _import_ray():
    try:
        import ray
    except ImportError:
        raise QuantkitError(f"--ray needs Ray, an optional extra of quantkit: {RAY_INSTALL}") from None
    return ray


def _connect_ray(ray, address: str, workers: int | None):
    """Connect (or start the local instance); returns what to remove after ray.shutdown() (the
    local instance's temporary directory), or None when there is no connection of ours to end."""
    if ray.is_initialized():
        return None
    temp_dir = None
    # Ray's own notices (token authentication, usage statistics) would interleave with quantkit's
    # output; its errors still show
    options = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    if address == "local":
        # A directory of our own, removed after: Ray leaves its session (logs, sockets) behind
        # otherwise, under /tmp/ray.  Ray's RAY_TMPDIR still says where (sockets need a short path).
        temp_dir = tempfile.mkdtemp(prefix="qk-ray-", dir=os.environ.get("RAY_TMPDIR") or None)
        if len(temp_dir) + RAY_SOCKET_TAIL > SOCKET_PATH_MAX:
            os.rmdir(temp_dir)
            raise QuantkitError(f"the local Ray instance's sockets under {temp_dir} would be longer than "
                                f"{SOCKET_PATH_MAX} characters: set RAY_TMPDIR to a shorter folder")
        options.update(num_cpus=workers, object_store_memory=RAY_LOCAL_OBJECT_STORE, _temp_dir=temp_dir)
    else:
        _check_reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")     # no telemetry that the user did not ask for
    try:
        ray.init(address=address, **options)
    except Exception as e:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QuantkitError(f"cannot start or reach the Ray cluster {address!r}: {first}") from None
    return temp_dir or ""


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT that nothing listens on: ray.init retries such an address for
    minutes (14 measured).  "auto" and addresses without a port are left to Ray."""
    where = address.split("://", 1)[-1]
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise QuantkitError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def _ray_task(fn_bytes: bytes, job_bytes: bytes, threads: int) -> tuple:
    """A job on a Ray worker: fn and the job travel pickled, so that the thread counts are set before
    their modules are imported (a runtime_env with the variables would do it too, at the cost of
    starting a worker process set up for it: seconds)."""
    _limit_threads(threads)
    try:
        fn, job = pickle.loads(fn_bytes), pickle.loads(job_bytes)
    except BaseException as e:
        return _failure(e)
    return _outcome(fn, job)


def _ray_failure(e: Exception, label: str) -> QuantkitError:
    cause = getattr(e, "cause", None)
    what = type(cause or e).__name__
    first = next((line for line in str(cause or e).splitlines() if line.strip()), "")
    return QuantkitError(f"{label} failed on the Ray cluster: {what}: {first.strip()}")


def _run_ray(fn, jobs: list, address: str, workers: int | None, threads: int, on_result, label) -> list:
    ray = _import_ray()
    saved = {s: signal.getsignal(s) for s in signals.HANDLED} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        ours = _connect_ray(ray, address, workers)
    finally:
        for s, h in saved.items():          # ray.init sets SIGTERM to sys.exit: ours (Terminated) stays
            if h is not None:
                signal.signal(s, h)
    pending: dict = {}
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < threads:      # Ray would wait for ever for a node with that many CPUs
            raise QuantkitError(f"the Ray cluster has {cpus:g} CPUs, fewer than the {threads} threads asked for per job")
        task = ray.remote(_ray_task).options(num_cpus=threads, name="quantkit-job")
        dumps = ray.cloudpickle.dumps      # as Ray pickles: a function of the driver's __main__ too
        fn_ref = ray.put(dumps(fn))
        pending = {task.remote(fn_ref, dumps(job), threads): index for index, job in enumerate(jobs)}
        results: list = [None] * len(jobs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            if ready:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            signals.check()
            for ref in ready:
                index = pending.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise _ray_failure(e, label(index)) from None
                if outcome[0] == "error":
                    _raise_failure(outcome, label(index))
                results[index] = outcome[1]
                if on_result is not None:
                    on_result(index, outcome[1])
        return results
    finally:
        with signals.deferred():
            for ref in pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:   # finished meanwhile, or the cluster is gone
                    pass
            if ours is not None:
                try:
                    ray.shutdown(wait_for_processes=True)   # a local instance's processes are gone when we return
                except TypeError:                           # an older Ray has no such argument
                    ray.shutdown()
                if ours:
                    shutil.rmtree(ours, ignore_errors=True)
            for s, h in saved.items():
                if h is not None:
                    signal.signal(s, h)
