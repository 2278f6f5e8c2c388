"""team.py: the threads that run one compiled job together (a generation step in one call).

Every participant runs the whole job from its start and learns how many they are only once the
caller has closed the gate; barriers hold them all; the caller runs a job alone when the team is
held by another thread or its helpers do not come; parked helpers sleep and the next job wakes them.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from numba import carray, njit

from quantkit.runtime import team as T
from quantkit.runtime.matvec import _pointer

ROUNDS = 200


@njit(cache=True, nogil=True)
def _rounds(job, slot):
    """Each round every participant adds its slot's share of 0..63 into the round's word, then
    waits at the round's barrier; after it the word must hold the whole sum (2016) in every
    participant's eyes: a participant that ran ahead, or counted the participants wrong, leaves a
    round short or breaks the check."""
    n = T.participants(job)
    data = carray(_pointer(T.job_data(job), np.int64), (ROUNDS + 8,))
    for k in range(ROUNDS):
        for i in range(slot, 64, n):
            T.fetch_add(data.ctypes.data + 8 * k, i)
        T.barrier(job, k, n)
        if data[k] != 2016:
            T.fetch_add(data.ctypes.data + 8 * ROUNDS, 1)           # errors
    T.fetch_add(data.ctypes.data + 8 * (ROUNDS + 1), n)             # the participants each saw
    T.fetch_add(data.ctypes.data + 8 * (ROUNDS + 2), 1)             # how many ran


def _run(team, threads):
    data = np.zeros(ROUNDS + 8, np.int64)
    job = T.new_job(data.ctypes.data, ROUNDS)
    n = team.run(T.job_function(_rounds), job, threads)
    return n, data


@pytest.fixture
def team(monkeypatch):
    """A team of its own, whose caller waits long enough for helpers on busy cores."""
    t = T.Team()
    t.JOIN_AWAKE_S = t.JOIN_ASLEEP_S = 0.5
    yield t
    t.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_participant_meets_every_barrier(team, threads):
    counts = set()
    for _ in range(6):
        n, data = _run(team, threads)
        counts.add(n)
        assert data[ROUNDS] == 0, "a participant passed a barrier before the others arrived"
        assert data[ROUNDS + 2] == n and data[ROUNDS + 1] == n * n      # each saw all n
        assert (data[:ROUNDS] == 2016).all()
    assert threads in counts            # the helpers came (at least once) on any machine


def test_a_job_runs_alone_while_another_thread_holds_the_team(team):
    assert _run(team, 2)[0] == 2
    with team._lock:
        n, data = _run(team, 2)
    assert n == 1 and (data[:ROUNDS] == 2016).all()
    done = []
    holder = threading.Thread(target=lambda: done.append(_run(team, 2)))
    holder.start()
    holder.join()
    assert done[0][0] in (1, 2) and (done[0][1][:ROUNDS] == 2016).all()


def test_parked_helpers_sleep_and_the_next_job_wakes_them(team):
    assert _run(team, 2)[0] == 2
    assert team._spinning
    team.park()
    assert not team._spinning
    deadline = time.monotonic() + 5
    while team.ctrl[T.C_STATES] != T.ASLEEP and time.monotonic() < deadline:
        time.sleep(0.001)
    assert team.ctrl[T.C_STATES] == T.ASLEEP
    assert _run(team, 2)[0] == 2            # woken, joined
    team.park()
    team.park()                             # nothing to park: no post



_FORK_SCRIPT = """
import os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_team import ROUNDS, _run
from quantkit.runtime import team as T
parent = T.team
parent.JOIN_AWAKE_S = 0.05
assert _run(parent, 2)[1][ROUNDS + 2] >= 1          # the parent's helper exists now
pid = os.fork()
if pid == 0:                                        # the child: exit 0 only if all is well
    try:
        n, data = _run(T.team, 2)
        os._exit(0 if T.team is not parent and (data[:ROUNDS] == 2016).all() else 1)
    except BaseException:
        os._exit(2)
deadline = time.monotonic() + 60
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        sys.exit("the forked child's job never finished")
    time.sleep(0.01)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_a_team_of_its_own(tmp_path):
    """fork copies only the calling thread: the child's team must not wait for the parent's
    helpers.  Forked in a fresh interpreter of its own (a test worker's other threads could hold
    locks a forked child then waits for)."""
    import subprocess
    import sys
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    p = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


def test_numba_thread_count_without_its_lock():
    """tiles.numba_threads / set_numba_threads are numba's per-thread count, on any thread."""
    import numba
    from quantkit.runtime.tiles import numba_threads, set_numba_threads
    seen = []

    def on_a_new_thread():
        seen.append((numba_threads(), numba.get_num_threads()))
        set_numba_threads(1)
        seen.append((numba_threads(), numba.get_num_threads()))
    t = threading.Thread(target=on_a_new_thread)
    t.start()
    t.join()
    assert seen[0][0] == seen[0][1] >= 1 and seen[1] == (1, 1)
    assert numba_threads() == numba.get_num_threads()       # this thread's count untouched
