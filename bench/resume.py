"""Benchmark: what ``quantize --resume`` costs and what it saves, whole commands.

On a synthetic llama-shaped F16 GGUF (tests/models.write_llama), each as a child process:

* ``plain``: ``quantkit quantize IN OUT TYPE``;
* ``resume``: the same with ``--resume`` and nothing to resume (the journal's cost: each tensor
  read back and hashed, the partial synced every few seconds);
* ``killed+resume``: a ``--resume`` run killed with SIGKILL once the journal lists about half the
  tensors (``--kill-at``), then the ``--resume`` run that finishes it (timed: verification of the
  journaled tensors included), its output compared byte for byte with ``plain``'s.

    python bench/resume.py [--size-mb 800] [--type q4_K] [--threads 2] [--repeat 3] [--kill-at 0.5]

Best of ``--repeat`` for each; a table, then JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def quantkit(*args) -> list[str]:
    return [sys.executable, "-m", "quantkit", "quantize", *map(str, args)]


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0, p.stdout


def killed_run(cmd: list[str], journal: Path, n_records: int) -> int:
    """Start ``cmd``, SIGKILL it once its journal lists ``n_records`` tensors; the number listed."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listed = 0
    while p.poll() is None:
        try:
            listed = journal.read_bytes().count(b"\n") - 1
        except OSError:
            listed = 0
        if listed >= n_records:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    p.wait()
    if p.returncode != -signal.SIGKILL:
        raise SystemExit("the run finished before it could be killed: use a larger --size-mb or a smaller --kill-at")
    return listed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=800)   # 200 MB finished before the kill on an idle 2-core machine
    ap.add_argument("--type", default="q4_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the tensors journaled when killed")
    a = ap.parse_args()
    from models import write_llama
    from quantkit.outputs import resumable_names

    with tempfile.TemporaryDirectory(prefix="qk-bench-resume-") as d:
        d = Path(d)
        n_embd, n_ff = 2048, 5632
        per_layer = 2 * (4 * n_embd * n_embd + 3 * n_embd * n_ff)
        n_layer = max(2, int(a.size_mb * 1e6 // per_layer))
        model = write_llama(d / "in.gguf", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=16, n_head_kv=16,
                            n_vocab=2048, dtype=np.float16, seed=1)
        n_tensors = 3 + 9 * n_layer
        common = [a.type, "--threads", a.threads]
        plain_out, out = d / "plain.gguf", d / "out.gguf"
        journal = resumable_names(Path(os.path.realpath(out)))[1]
        timed(quantkit(model, plain_out, *common))          # kernels compiled and cached, files in page cache
        rows = {"plain": [], "resume": [], "killed+resume": []}
        reused, listed = [], []
        for _ in range(a.repeat):
            rows["plain"].append(timed(quantkit(model, plain_out, *common))[0])
            rows["resume"].append(timed(quantkit(model, out, *common, "--resume"))[0])
            assert out.read_bytes() == plain_out.read_bytes()
            listed.append(killed_run(quantkit(model, out, *common, "--resume"), journal,
                                     max(1, int(a.kill_at * n_tensors))))
            s, stdout = timed(quantkit(model, out, *common, "--resume", "--json"))
            rows["killed+resume"].append(s)
            reused.append(json.loads(stdout)["result"]["reused"])
            if out.read_bytes() != plain_out.read_bytes():
                raise SystemExit("the resumed output differs from the plain run's")
            out.unlink()
        best = {k: min(v) for k, v in rows.items()}
        size = plain_out.stat().st_size
    print(f"{n_layer}-layer F16 llama ({a.size_mb} MB), {a.type}, {a.threads} threads, {n_tensors} tensors, "
          f"output {size / 1e6:.1f} MB; best of {a.repeat}")
    print(f"{'run':<16}{'seconds':>9}{'vs plain':>10}")
    for k, v in best.items():
        print(f"{k:<16}{v:>9.2f}{v / best['plain']:>9.2f}x")
    print(f"killed with {listed} tensors journaled; the resumed runs reused "
          f"{[r['tensors'] for r in reused]} tensors ({[r['bytes'] for r in reused]} bytes); outputs identical")
    print(json.dumps({"size_mb": a.size_mb, "type": a.type, "threads": a.threads, "tensors": n_tensors,
                      "output_bytes": size, "best_seconds": best, "runs": rows, "journaled_when_killed": listed,
                      "reused": reused}))


if __name__ == "__main__":
    main()
