"""A team of threads that run one compiled job side by side, meeting at spin barriers: how ggml's
CPU threads run a generation step, and what a step of quantkit's runtime needs to come near it.

A step of SmolLM2 is ~150 small operations (30 layers of norms, products, rope, attention).  Run
as ~300 kernel calls from Python, each parallel one a numba launch that wakes its threads, the
calls cost more than the arithmetic of everything but the products (1.2-1.7 ms of a 5 ms step).
Here the caller posts one job, a compiled function of (job, slot), and the team's threads run it
with the caller, every thread the whole function: they split each operation's work by their slot
and wait for each other at barriers in between (an atomic counter per barrier), never leaving
compiled code until the step is done.

    caller (slot 0)                    helper thread i (slot 1..)
    post: job, fn, seq += 1   ───────► spinning on seq: sees it, joins through the job's gate
    enter: waits for the joins,        (a compare-and-swap on the gate word: closed, no join)
           closes the gate
    fn(job, 0)            ◄─ barriers ─► fn(job, slot)
    waits until every helper left ◄─── leaves: job.left += 1; spins for the next seq

Only a helper that joined before the gate closed takes part, so every participant runs the job
from its start: a barrier counts them all, and none can race a barrier ahead of another.  A
helper that does not join in time (asleep, descheduled, holding no core) leaves the step to the
others; so does the team when another thread holds it: a job must give the same results for
any number of participants (each splits its work by (slot, participants) and nothing else).

Helpers spin for a few milliseconds after their last job (a generation's steps come every few
ms), then sleep on an Event until the next post wakes them; the spin is a ``pause`` loop on x86.
The memory orders: seq and the job's words are written before seq is published (release) and
read after it is seen (acquire); the gate, barrier and left counters are atomic read-modify-writes;
a helper going to sleep and a caller posting both store then load (seq_cst on both sides), so
either the helper sees the new seq or the caller sees it asleep and wakes it.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..cpu import target

_OPTS = dict(cache=True, nogil=True)
_I64 = ir.IntType(64)


# ---- atomics on int64 words at an address ----

def _word(builder, addr):
    return builder.inttoptr(addr, _I64.as_pointer())


def _load(order: str):
    """``load(addr)``: the int64 at ``addr``, an atomic load of LLVM memory order ``order``."""
    @intrinsic
    def load(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.load_atomic(_word(builder, args[0]), order, 8)
        return types.int64(types.int64), codegen
    return load


def _store(order: str):
    """``store(addr, value)``: an atomic store of the int64 ``value`` at ``addr``, of order ``order``."""
    @intrinsic
    def store(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            builder.store_atomic(args[1], _word(builder, args[0]), order, 8)
            return context.get_dummy_value()
        return types.none(types.int64, types.int64), codegen
    return store


def _read_modify_write(op: str):
    """``rmw(addr, value)``: atomically apply ``op`` ("add", "or") of ``value`` to the int64 at
    ``addr`` (sequentially consistent); its value before."""
    @intrinsic
    def rmw(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            return builder.atomic_rmw(op, _word(builder, args[0]), args[1], "seq_cst")
        return types.int64(types.int64, types.int64), codegen
    return rmw


# acquire: read after every write the publishing thread made before its release store
load_acquire, load_seq_cst = _load("acquire"), _load("seq_cst")
store_release, store_seq_cst = _store("release"), _store("seq_cst")
fetch_add, fetch_or = _read_modify_write("add"), _read_modify_write("or")


@intrinsic
def compare_swap(typingctx, addr, expected, value):
    """Atomically: if the int64 at ``addr`` is ``expected``, make it ``value``; whether it was."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_word(builder, args[0]), args[1], args[2], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(types.int64, types.int64, types.int64), codegen


_X86 = target().x86


@intrinsic
def pause(typingctx):
    """A spin-wait hint (x86 ``pause``: lets the sibling hyperthread run, and leaves the loop
    without a memory-order flush); nothing on other CPUs."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


def _yield_address() -> int:
    """The address of the C function that gives the calling thread's core to another runnable
    thread (POSIX sched_yield; Windows SwitchToThread)."""
    import ctypes
    fn = ctypes.windll.kernel32.SwitchToThread if os.name == "nt" else ctypes.CDLL(None).sched_yield
    return ctypes.cast(fn, ctypes.c_void_p).value


# registered under a name of ours before any kernel using it is compiled or loaded from numba's
# cache (whose code refers to the name, resolved when it is linked)
llb.add_symbol("quantkit_yield_thread", _yield_address())


@intrinsic
def yield_thread(typingctx):
    """Let another runnable thread have this core (the OS call: ~0.3 us; a spinning partner that
    was descheduled, with more threads than cores, gets its turn instead of waiting for the end
    of this thread's time slice)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "quantkit_yield_thread")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


# spins of a wait that pause before it yields the core instead (~50-150 us: a barrier's partner
# arrives within microseconds unless it has no core)
PAUSES = 4096


@njit(inline="always")
def relax(n):
    """One turn of a wait's n-th spin: a pause, or from PAUSES spins on a yield of the core."""
    if n < PAUSES:
        pause()
    else:
        yield_thread()


@intrinsic
def _call_job(typingctx, fn, job, slot):
    """Call the C function at address ``fn`` (a :func:`job_function`) with (job, slot)."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I64, _I64])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1], args[2]])
        return context.get_dummy_value()
    return types.none(types.int64, types.int64, types.int64), codegen


def job_function(dispatcher) -> int:
    """The address of the C wrapper of ``dispatcher`` (an njit function of (job: int64, slot:
    int64) -> None) compiled for int64 arguments: what :meth:`Team.run` calls on every thread."""
    sig = (types.int64, types.int64)
    dispatcher.compile(sig)
    cres = dispatcher.overloads[sig]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)


# ---- a job's record: int64 words, each counter on a cache line of its own ----
#
#   word 0   gate: participants that joined (helpers) | CLOSED
#   word 8   left: helpers done with the job
#   word 16  the job's own data (an address, usually)
#   word 24 + 8 k   barrier k's arrivals (k < n_barriers)
J_GATE, J_LEFT, J_DATA, J_BARRIERS = 0, 8, 16, 24
CLOSED = 1 << 40
LINE = 8            # int64 words per cache line


def new_job(data: int, n_barriers: int) -> np.ndarray:
    """A job record for :meth:`Team.run`: ``data`` (the job's own word: what the job function
    reads, usually an address) and ``n_barriers`` barrier counters, all zero."""
    job = np.zeros(J_BARRIERS + LINE * max(1, n_barriers), np.int64)
    job[J_DATA] = data
    return job


@njit(inline="always")
def job_data(job):
    """The job's own word (:func:`new_job`'s ``data``)."""
    return load_acquire(job + 8 * J_DATA)


@njit(inline="always")
def participants(job):
    """The threads that run the job (the caller and the helpers that joined): a job splits its
    work by (slot, participants).  Known once the caller has closed the gate: a helper that
    joined early waits for it (counting the joins so far, it took 2 for 3 when a third came)."""
    gate = job + 8 * J_GATE
    g = load_acquire(gate)
    spin = 0
    while not g & CLOSED:
        relax(spin)
        spin += 1
        g = load_acquire(gate)
    return (g & (CLOSED - 1)) + 1


@njit(inline="always")
def barrier(job, k, n):
    """Wait until the job's ``n`` participants have all reached barrier ``k`` (each barrier of a
    job its own k: the counters are never reset within one)."""
    if n > 1:
        addr = job + 8 * (J_BARRIERS + LINE * k)
        fetch_add(addr, 1)
        spin = 0
        while load_acquire(addr) < n:
            relax(spin)
            spin += 1


# ---- the control block the caller posts jobs through ----
#
#   word 0   seq       (the caller's line: seq, job, fn, helpers wanted, exit)
#   word 8 + 8 i       helper i's state: AWAKE / ASLEEP
C_SEQ, C_JOB, C_FN, C_WANTED, C_EXIT, C_STATES = 0, 1, 2, 3, 4, 8
AWAKE, ASLEEP = 0, 1


@njit(**_OPTS)
def _serve(ctrl, me, seen, spins, yield_units):
    """Helper ``me``'s loop (released from the GIL): run each job posted after ``seq`` ``seen``
    that wants it; after ``spins`` spins without one (pauses; a yield of the core counts as
    ``yield_units`` of them), mark itself asleep and return the last seq seen (the caller then
    sleeps on its Event), or -1 on exit."""
    state = ctrl + 8 * (C_STATES + LINE * me)
    idle = 0
    while True:
        if load_acquire(ctrl + 8 * C_EXIT):
            return -1
        seq = load_acquire(ctrl + 8 * C_SEQ)
        if seq != seen:
            seen, idle = seq, 0
            job = load_acquire(ctrl + 8 * C_JOB)
            if job != 0 and me < load_acquire(ctrl + 8 * C_WANTED):
                fn = load_acquire(ctrl + 8 * C_FN)
                gate = job + 8 * J_GATE
                while True:
                    g = load_acquire(gate)
                    if g & CLOSED:
                        break
                    if compare_swap(gate, g, g + 1):
                        _call_job(fn, job, g + 1)
                        fetch_add(job + 8 * J_LEFT, 1)
                        break
            elif job == 0:
                idle = spins            # parked: sleep now
            continue
        idle += 1 if idle < PAUSES else yield_units
        if idle > spins:
            store_seq_cst(state, ASLEEP)
            if load_seq_cst(ctrl + 8 * C_SEQ) == seen:
                return seen
            store_seq_cst(state, AWAKE)
            idle = 0
            continue
        relax(idle)


@njit(**_OPTS)
def _post(ctrl, job, fn, wanted, n_helpers):
    """Publish a job (``job`` 0: park the helpers) to helpers 0..wanted-1; a bit mask of the
    helpers (of ``n_helpers``) that were asleep when it was published, to be woken."""
    store_release(ctrl + 8 * C_JOB, job)
    store_release(ctrl + 8 * C_FN, fn)
    store_release(ctrl + 8 * C_WANTED, wanted)
    seq = load_acquire(ctrl + 8 * C_SEQ)
    store_seq_cst(ctrl + 8 * C_SEQ, seq + 1)
    asleep = 0
    for i in range(n_helpers):
        if load_seq_cst(ctrl + 8 * (C_STATES + LINE * i)) == ASLEEP:
            asleep |= 1 << i
    return asleep


@njit(**_OPTS)
def _enter(fn, job, wanted, spins, yield_units):
    """The caller's part of a job: wait (at most ``spins`` pauses, a yield of the core counting
    ``yield_units``) for ``wanted`` helpers to join, close the gate, run the job as slot 0, then
    wait until every helper that joined has left.  The yields matter for a helper just woken: the
    OS tends to queue it on the waking thread's core, where it runs only when that thread lets it."""
    gate = job + 8 * J_GATE
    n = 0
    while load_acquire(gate) < wanted and n < spins:
        relax(n)
        n += 1 if n < PAUSES else yield_units
    joined = fetch_or(gate, CLOSED) & (CLOSED - 1)
    _call_job(fn, job, 0)
    n = 0
    while load_acquire(job + 8 * J_LEFT) < joined:
        relax(n)
        n += 1
    return joined


@njit(**_OPTS)
def _spin(n, yields):
    for _ in range(n):
        if yields:
            yield_thread()
        else:
            pause()


class Team:
    """Helper threads (spawned on first use, daemons) that run posted jobs with the caller
    (:meth:`run`).  One job at a time: a caller that finds the team busy runs its job alone."""

    # how long helpers spin for the next job, and how long the caller waits for helpers to join
    # (awake ones join within a microsecond; a woken one first needs its thread scheduled)
    IDLE_S, JOIN_AWAKE_S, JOIN_ASLEEP_S = 0.004, 0.00005, 0.002

    MAX_HELPERS = 63        # helper i's state word is in ctrl, and bit i of _post's mask

    def __init__(self):
        self.ctrl = np.zeros(C_STATES + LINE * (self.MAX_HELPERS + 1), np.int64)
        self._threads: list[threading.Thread] = []
        self._events: list[threading.Event] = []
        self._lock = threading.Lock()
        self._spins_per_s = 0.0
        self._yield_units = 1
        self._spinning = False          # helpers may be spinning: a job ran since the last park

    def _calibrate(self) -> None:
        """How many pauses take a second here, and how many pauses a yield of the core takes."""
        _spin(100, False)
        _spin(100, True)
        t0 = time.perf_counter()
        _spin(20000, False)
        t1 = time.perf_counter()
        _spin(2000, True)
        t2 = time.perf_counter()
        pause_s = max(1e-10, (t1 - t0) / 20000)
        self._spins_per_s = 1 / pause_s
        self._yield_units = max(1, int((t2 - t1) / 2000 / pause_s))

    def _spins(self, seconds: float) -> int:
        return max(1, int(seconds * self._spins_per_s))

    def _start(self, n_helpers: int) -> None:
        if not self._spins_per_s:
            self._calibrate()
            atexit.register(self.close)
        while len(self._threads) < n_helpers:
            i = len(self._threads)
            event = threading.Event()
            t = threading.Thread(target=self._helper, args=(i, event), name=f"quantkit-step-{i}", daemon=True)
            self._events.append(event)
            self._threads.append(t)
            t.start()

    def _helper(self, me: int, event: threading.Event) -> None:
        ctrl = self.ctrl.ctypes.data
        seen = int(self.ctrl[C_SEQ])
        spins = self._spins(self.IDLE_S)
        while True:
            seen = _serve(ctrl, me, seen, spins, self._yield_units)
            if seen < 0:
                return
            event.wait()
            event.clear()
            self.ctrl[C_STATES + LINE * me] = AWAKE

    def run(self, fn: int, job: np.ndarray, n_threads: int) -> int:
        """Run the job function at address ``fn`` (:func:`job_function`) on the job record ``job``
        (:func:`new_job`, fresh) with up to ``n_threads`` threads, the caller's included; the
        number of threads that ran it."""
        if n_threads <= 1 or not self._lock.acquire(blocking=False):
            job[J_GATE] = CLOSED
            _call_job_solo(fn, job.ctypes.data)
            return 1
        try:
            wanted = min(n_threads - 1, self.MAX_HELPERS)
            self._start(wanted)
            self._spinning = True
            asleep = _post(self.ctrl.ctypes.data, job.ctypes.data, fn, wanted, len(self._threads))
            for i, event in enumerate(self._events):
                if asleep >> i & 1:
                    event.set()
            spins = self._spins(self.JOIN_ASLEEP_S if asleep & ((1 << wanted) - 1) else self.JOIN_AWAKE_S)
            return _enter(fn, job.ctypes.data, wanted, spins, self._yield_units) + 1
        finally:
            self._lock.release()

    def park(self) -> None:
        """Send the helpers to sleep now, not at the end of their spinning: other threads (the
        tile pool's, a batch's) are about to need the cores.  Nearly free when none may spin."""
        if self._spinning and self._lock.acquire(blocking=False):
            try:
                _post(self.ctrl.ctypes.data, 0, 0, 0, len(self._threads))
                self._spinning = False
            finally:
                self._lock.release()

    def close(self) -> None:
        self.ctrl[C_EXIT] = 1
        for e in self._events:
            e.set()
        for t in self._threads:
            t.join(timeout=1.0)


@njit(**_OPTS)
def _call_job_solo(fn, job):
    _call_job(fn, job, 0)


team = Team()


def _forget_helpers() -> None:
    """In a forked child: the parent's helper threads do not exist here (fork copies only the
    calling thread), nor may its lock be left held; start afresh."""
    global team
    team = Team()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)
