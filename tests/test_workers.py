"""quantkit.workers.run_jobs: local worker processes, in-process, errors, interrupts, and Ray.

The jobs are in tests/worker_jobs.py (worker processes import them by name).  Worker processes are
fresh interpreters that import only quantkit.errors for these jobs: a local run costs a fraction of
a second (numba_threads's import of numba: a few).  The Ray tests start two small local instances
(9-20 s each, measured on two cores shared with other busy sessions), under a short directory of
their own, and check that nothing of them is left: no process, no file.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import worker_jobs as wj
from quantkit.errors import QuantkitError
from quantkit.workers import STOP_GRACE_S, RemoteTraceback, available_cpus, run_jobs

TESTS = Path(__file__).resolve().parent
# Ray's token authentication: one token for this test process (Ray's loader keeps the first it reads)
RAY_TOKEN = os.urandom(16).hex()


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie is dead: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def noted_pids(folder: Path) -> list[int]:
    return [int(p.stem) for p in folder.glob("*.pid")]


def wait_for(predicate, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---- local worker processes and in-process ----

def test_local_workers_results_in_job_order_and_on_result_in_the_parent():
    seen = []
    results = run_jobs(wj.where, range(7), workers=2, on_result=lambda i, r: seen.append((i, r, os.getpid())))
    assert [r[0] for r in results] == list(range(7))
    pids = {r[1] for r in results}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2          # two workers, not this process
    assert sorted(i for i, _, _ in seen) == list(range(7))          # each job once
    assert all(r == results[i] and pid == os.getpid() for i, r, pid in seen)
    # each worker computes on its share of the cores (numba / OpenMP / BLAS thread counts)
    assert {r[2] for r in results} == {str(max(1, available_cpus() // 2))}
    # a terminal's Ctrl-C goes to the whole process group: the parent alone acts on it
    assert {r[3] for r in results} == {True}
    assert {r[2] for r in run_jobs(wj.where, range(3), workers=2, threads_per_job=3)} == {"3"}
    # numba, imported by the job, takes it (its thread count is read once, on import)
    assert run_jobs(wj.numba_threads, range(2), workers=2, threads_per_job=1) == [(1, 1), (1, 1)]


def test_one_worker_or_one_job_runs_in_this_process():
    seen = []
    results = run_jobs(wj.where, range(3), workers=1, on_result=lambda i, r: seen.append(i))
    assert [r[0] for r in results] == [0, 1, 2] and {r[1] for r in results} == {os.getpid()}
    assert seen == [0, 1, 2]
    assert run_jobs(wj.where, [5], workers=4)[0][1] == os.getpid()
    assert run_jobs(wj.square, []) == []


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_bad_worker_counts_are_refused(workers):
    with pytest.raises(QuantkitError, match="workers must be a whole number of at least 1"):
        run_jobs(wj.square, range(3), workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_jobs_quantkit_error_comes_back_as_one_line(workers):
    done = []
    # GGUFFormatError takes (path, offset, msg): pickling alone could not bring it back
    with pytest.raises(QuantkitError) as e:
        run_jobs(wj.refuse, range(3), workers=workers, on_result=lambda i, r: done.append(i))
    assert str(e.value) == "model.gguf @ offset 24: tensor count 9999999 exceeds the file"
    assert "\n" not in str(e.value)
    assert 2 not in done
    with pytest.raises(QuantkitError, match=r"^budget 1G is below the smallest recipe$"):
        run_jobs(wj.refuse_plain, range(3), workers=workers)


def test_a_bug_in_a_job_comes_back_as_itself_with_the_workers_traceback():
    with pytest.raises(KeyError) as e:
        run_jobs(wj.bug, range(3), workers=2)
    assert isinstance(e.value.__cause__, RemoteTraceback)
    assert "job 1, in the worker" in str(e.value.__cause__) and "in bug" in str(e.value.__cause__)
    with pytest.raises(Exception, match="pickle"):       # a result that cannot come back
        run_jobs(wj.unpicklable_result, range(2), workers=2)


def test_a_worker_that_dies_is_a_quantkit_error_naming_the_job_and_signal():
    with pytest.raises(QuantkitError, match=r"worker process died with SIGKILL while running job 1 \(out of memory"):
        run_jobs(wj.die, range(3), workers=2)
    with pytest.raises(QuantkitError, match=r"died with SIGKILL while running blk\.1\.attn as q4_K \(out of memory"):
        run_jobs(wj.die, range(3), workers=2, describe=lambda job: f"blk.{job}.attn as q4_K")


def test_an_interrupt_in_the_parent_stops_the_workers(tmp_path):
    """KeyboardInterrupt raised in the parent's loop (here by on_result, as a Ctrl-C would arrive
    there): it propagates at once and the workers running 60-second jobs are gone."""
    raised = []

    def interrupt(index, result):
        wait_for(lambda: len(noted_pids(tmp_path)) == 2)     # the other worker is in its 60 s job
        raised.append(time.monotonic())
        raise KeyboardInterrupt
    jobs = [(str(tmp_path), 0), (str(tmp_path), 60), (str(tmp_path), 60)]
    with pytest.raises(KeyboardInterrupt):
        run_jobs(wj.sleep_and_note, jobs, workers=2, on_result=interrupt)
    # the busy workers were terminated, not waited for until the grace period ran out
    assert time.monotonic() - raised[0] < STOP_GRACE_S
    pids = noted_pids(tmp_path)
    assert len(pids) >= 2 and not any(alive(p) for p in pids)


# ---- real signals, to a command running jobs (tests/worker_jobs.py main) ----

def start_command(folder: Path, n_jobs: int = 4):
    proc = subprocess.Popen([sys.executable, str(TESTS / "worker_jobs.py"), str(folder), str(n_jobs), "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert wait_for(lambda: len(noted_pids(folder)) == 2 or proc.poll() is not None), "the workers never started"
    assert proc.poll() is None, proc.communicate()
    return proc, noted_pids(folder)


@pytest.mark.parametrize("how, rc, said", [
    ("ctrl-c", 130, "interrupted"),             # SIGINT to the whole process group, as a terminal sends it
    ("sigterm", 128 + signal.SIGTERM, "terminated by SIGTERM"),     # to the parent alone (kill, a scheduler)
])
def test_signals_stop_the_run_and_its_workers(tmp_path, how, rc, said):
    proc, workers = start_command(tmp_path)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == rc, err
    assert err.strip() == said          # the workers print nothing: no traceback from them
    assert not any(alive(p) for p in workers)
    assert not list(tmp_path.glob("*.interrupted")), "Ctrl-C reached the workers, not the parent alone"


def test_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL leaves the parent no chance to stop them: they end by themselves (no orphan goes on
    computing)."""
    proc, workers = start_command(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert wait_for(lambda: not any(alive(p) for p in workers), timeout=10)


# ---- Ray ----

@pytest.fixture
def ray_env(monkeypatch, tmp_path_factory):
    """What Ray's local processes inherit: the jobs' module on the path, a token of their own (Ray
    would write one under ~/.ray), Ray's files in a folder of the test.  That folder is reached
    through a short link in the system's temporary folder, removed after: its own path (under
    xdist /tmp/pytest-of-USER/pytest-N/popen-gwK/...) is too long for the sockets Ray makes in it."""
    ray = pytest.importorskip("ray")
    folder = tmp_path_factory.mktemp("ray")
    link = Path(tempfile.gettempdir(), f"qk-{os.getpid()}-{os.urandom(3).hex()}")
    link.symlink_to(folder, target_is_directory=True)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("RAY_AUTH_TOKEN", RAY_TOKEN)
    monkeypatch.setenv("RAY_TMPDIR", str(link))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # ray.init sets RAY_AUTH_MODE in os.environ for good (setting it here first would not do: Ray reads
    # it into its configuration on import), and its own SIGTERM handler (sys.exit)
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        yield ray, link
    finally:
        if ray.is_initialized():
            ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode
        link.unlink()


def our_descendants() -> set[int]:
    """The live processes this one started, and theirs (Linux /proc)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def test_ray_local_instance_runs_the_jobs_and_leaves_nothing(ray_env):
    """ray_address="local": an instance of two CPUs is started, runs the jobs, and is shut down,
    its processes gone and its folder removed."""
    ray, folder = ray_env
    if not Path("/proc/self/stat").exists():
        pytest.skip("counts processes in /proc")
    before = our_descendants()
    sigterm = signal.getsignal(signal.SIGTERM)
    seen = []
    results = run_jobs(wj.where, range(5), ray_address="local", workers=2,
                       on_result=lambda i, r: seen.append((i, os.getpid())))
    assert [r[0] for r in results] == list(range(5))
    assert os.getpid() not in {r[1] for r in results}
    assert {r[2] for r in results} == {"1"}                 # one thread per task by default
    assert sorted(seen) == [(i, os.getpid()) for i in range(5)]
    assert not ray.is_initialized()
    assert signal.getsignal(signal.SIGTERM) is sigterm     # ray.init's handler is not left in place
    assert our_descendants() <= before, "Ray processes survive the run"
    assert list(folder.iterdir()) == [], "Ray's session folder was left behind"


def test_ray_errors_and_interrupt(ray_env, tmp_path):
    """On an instance this process is connected to already (used as it is, left running): a job's
    QuantkitError is one line, a bug comes back as itself, too many threads per job is refused
    instead of waiting for ever, and an interrupt cancels the running tasks."""
    ray, folder = ray_env
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(folder), object_store_memory=1 << 27)
    with pytest.raises(QuantkitError) as e:
        run_jobs(wj.refuse, range(3), ray_address="auto")
    assert str(e.value) == "model.gguf @ offset 24: tensor count 9999999 exceeds the file"
    with pytest.raises(KeyError) as e:
        run_jobs(wj.bug, range(3), ray_address="auto")
    assert "in bug" in str(e.value.__cause__)
    with pytest.raises(QuantkitError, match="the Ray cluster has 2 CPUs, fewer than the 3 threads"):
        run_jobs(wj.square, range(3), ray_address="auto", threads_per_job=3)
    assert run_jobs(wj.square, range(4), ray_address="auto") == [0, 1, 4, 9]

    def interrupt(index, result):
        raise KeyboardInterrupt
    jobs = [(str(tmp_path), 0)] + [(str(tmp_path), 60)] * 3
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_jobs(wj.sleep_and_note, jobs, ray_address="auto", on_result=interrupt)
    assert time.monotonic() - start < 30 and noted_pids(tmp_path)
    assert ray.is_initialized()                 # not ours to shut down
    # the sleeping tasks were cancelled: both CPUs are free again at once, not in a minute
    start = time.monotonic()
    assert run_jobs(wj.square, range(4), ray_address="auto") == [0, 1, 4, 9]
    assert time.monotonic() - start < 30


def test_without_ray_the_option_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)       # import ray raises ImportError
    with pytest.raises(QuantkitError, match=r"--ray needs Ray, an optional extra of quantkit: "
                       r"pip install -e '\.\[ray\]' in quantkit's clone, or pip install 'ray>=2\.9'$"):
        run_jobs(wj.square, range(3), ray_address="local")


def test_a_ray_folder_too_long_for_its_sockets_is_refused(ray_env, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / ("x" * 40)))
    (tmp_path / ("x" * 40)).mkdir()
    with pytest.raises(QuantkitError, match="would be longer than 107 characters: set RAY_TMPDIR to a shorter folder"):
        run_jobs(wj.square, range(3), ray_address="local")
    assert list((tmp_path / ("x" * 40)).iterdir()) == []


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_unreachable_ray_cluster_is_a_one_line_error_at_once(ray_env, address):
    """Nothing listens on the port: refused in a moment (ray.init itself retries for minutes)."""
    with socket.socket() as s:          # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = address.format(port=port)
    start = time.monotonic()
    with pytest.raises(QuantkitError, match=f"cannot reach the Ray cluster at {address}: ") as e:
        run_jobs(wj.square, range(3), ray_address=address)
    assert "\n" not in str(e.value) and time.monotonic() - start < 5


def test_a_recipe_search_on_a_local_ray_instance_finds_what_this_process_finds(ray_env, tmp_path):
    """`quantkit recipe --ray local`: the sensitivity jobs of a real search (quantizing in Ray's
    workers, which import quantkit themselves) give the same errors and the same recipe as the
    search in this process."""
    from models import write_llama
    from quantkit.recipe_search import search_recipe

    model = write_llama(tmp_path / "llama.gguf", n_layer=2)
    common = dict(budget="5bpw", types="q8_0,q4_K,q2_K", bandwidth="cpu=50G")
    here = search_recipe(model, workers=1, cache_dir=tmp_path / "c1", **common)
    on_ray = search_recipe(model, workers=2, ray_address="local", cache_dir=tmp_path / "c2", **common)
    assert on_ray.jobs["fast"]["run"] == here.jobs["fast"]["run"] > 0
    assert on_ray.kld == here.kld and on_ray.choice == here.choice
    assert on_ray.recipe_text == here.recipe_text
    assert not ray_env[0].is_initialized()
