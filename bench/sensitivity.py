"""Seconds per sensitivity job on SmolLM2-135M, and how well the calibrated fast estimate predicts
the measured KLD (issue 27 part 4).

    python bench/sensitivity.py [--threads N] [--samples N] [--n-ctx 512] [--chunks 1]

Fast jobs: every (group, type) of SmolLM2 (fallbacks as the planner writes them), with the
calibration imatrix of tests' golden data.  Measured jobs: ``--samples`` pairs picked by
measure_sample, each a mean KLD over the calibration text's scored tokens, timed one by one
after the base pass (reported apart: a worker pays it once).  Then the calibration is fitted on
every other measured sample of each kind and its predictions compared with the others.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import SHARED, smollm2_file  # noqa: E402

from quantkit import sensitivity as S  # noqa: E402
from quantkit.gguf_io.reader import open_model  # noqa: E402
from quantkit.groups import make_groups  # noqa: E402
from quantkit.runtime.session import set_threads  # noqa: E402
from quantkit.types import type_from_name  # noqa: E402

TYPES = "q8_0 q6_K q5_K q4_K iq4_k iq4_ks iq3_k iq2_k q5_0 q4_0".split()


def timed(fn, job):
    t, c = time.perf_counter(), time.process_time()
    value = fn(job)
    return value, time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=1)
    args = ap.parse_args()
    model = smollm2_file()
    imatrix = SHARED / "golden" / "imatrix" / "smollm2-q4_1-gpl3.gguf"
    text = SHARED / "golden" / "imatrix" / "calib-gpl3.txt"
    set_threads(args.threads)
    with open_model(model) as m:
        gs = make_groups(m, [type_from_name(t) for t in TYPES], has_imatrix=True)
    n_options = sum(len(g.options) for g in gs.groups)
    print(f"SmolLM2-135M: {len(gs.groups)} groups, {n_options} (group, type) options; {args.threads} thread(s)")

    fast_jobs = S.fast_jobs(gs, model, imatrix=imatrix)
    S.fast_error(fast_jobs[0][1])                       # kernels compiled, model opened
    fast, wall, cpu = {}, 0.0, 0.0
    for key, job in fast_jobs:
        fast[key], w, c = timed(S.fast_error, job)
        wall, cpu = wall + w, cpu + c
    print(f"fast:     {len(fast_jobs)} jobs, {wall / len(fast_jobs):.3f} s each (cpu {cpu / len(fast_jobs):.3f} s)")

    picks = S.measure_sample(gs, args.samples)
    jobs = S.measure_jobs(gs, picks, model, text, imatrix=imatrix, n_ctx=args.n_ctx, chunks=args.chunks,
                          threads=args.threads)
    _, w, c = timed(S.measured_kld, jobs[0][1])
    print(f"measured: base pass + first job {w:.2f} s (cpu {c:.2f} s), n_ctx {args.n_ctx} x {args.chunks} chunk(s)")
    measured, times = {}, []
    for key, job in jobs:
        measured[key], w, c = timed(S.measured_kld, job)
        times.append((w, c))
        print(f"  {key[0]:>20} {key[1]:>7}  fast {fast[key]:10.4g}  KLD {measured[key]:10.4g}  {w:5.2f} s (cpu {c:5.2f})")
    w = np.mean([t[0] for t in times])
    c = np.mean([t[1] for t in times])
    print(f"measured: {len(jobs)} jobs, {w:.2f} s each (cpu {c:.2f} s)")

    # every other sample of each kind fits the calibration, the rest are held out
    nth: dict[str, int] = {}
    fit_keys, test_keys = [], []
    for k in picks:
        kind = gs.group(k[0]).kind
        (fit_keys if nth.get(kind, 0) % 2 == 0 else test_keys).append(k)
        nth[kind] = nth.get(kind, 0) + 1
    p = S.calibrate(gs, fast, {k: measured[k] for k in fit_keys})
    ratios = []
    for k in test_keys:
        g = gs.group(k[0])
        predicted = p.factor(g.kind, float(np.mean(g.layers)) if g.layers else None) * fast[k]
        if measured[k] > 0 and predicted > 0:
            ratios.append(predicted / measured[k])
            print(f"  held out {k[0]:>20} {k[1]:>7}: predicted {predicted:.4g}  measured {measured[k]:.4g}")
    logs = np.log(ratios)
    print(f"calibration: factors {({k: f'{v:.3g}' for k, v in p.factors.items()})}; held-out predicted/measured: "
          f"geometric mean {math.exp(logs.mean()):.2f}, within 2x {np.mean(np.abs(logs) < math.log(2)):.0%}")


if __name__ == "__main__":
    main()
