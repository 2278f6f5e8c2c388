"""Benchmark: the fused generation chunk dots (runtime/dot.py chunk_dot) alone, on the instruction
tiers numba's target allows, side by side in one process: ns per chunk (8 legacy blocks or one
super-block of 256 values) and GB/s of weight bytes, one thread.

The chunks stream through --mb megabytes of random blocks (more than the L3 cache by default: the
weights of a generation step come from memory), 8 x --rows x 32 activations; each tier's chunk dot
is compiled here from the same layout with dot.py's feature switches set as a target without those
features would have them (the integers and float results are the same bits: tests/test_generic_cpu.py),
and the tiers are timed in alternation, best of --rounds, CPU time (the machine may be shared).

    python bench/dots.py [--types q5_0,iq4_nl,q4_0,q8_0,...] [--mb 64] [--rounds 5]

Prints a table, then the same as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import njit

from quantkit.runtime import dot, matvec
from quantkit.types import QuantType, type_name

# tier -> dot.py switches (applied while the chunk dot compiles); "target" leaves them as they are
TIERS = {"target": {},
         "avx2": {"_VNNI": False, "_AVX512BW": False},
         "ssse3": {"_VNNI": False, "_AVX512BW": False, "_AVX2": False}}
DEFAULT_TYPES = "q5_0,iq4_nl,q4_0,q8_0,mxfp4,q5_K,q6_K,iq4_xs,iq3_k,iq2_k"


def _chunk(qtype):
    """(chunk dot, bytes per chunk, values per chunk, table) of qtype's widest chunk."""
    if qtype in matvec.LEGACY:
        lay = matvec.LEGACY[qtype]
        return matvec._legacy_chunk(lay, 8), 8 * lay.block_bytes, 256, matvec.TABLES[qtype]
    lay = matvec.SUPER[qtype]
    return dot.chunk_dot(lay.runs, table=lay.grid is not None, sup=lay.sup), lay.block_bytes, 256, matvec.TABLES[qtype]


def _timed(qtype, switches, n_bytes):
    saved = {k: getattr(dot, k) for k in switches}
    for k, v in switches.items():
        setattr(dot, k, v)
    try:
        chunk, cb, nv, tab = _chunk(qtype)

        @njit(nogil=True)
        def stream(a, tab, xq, xd, xsum, n):
            s = np.float32(0)
            for i in range(n):
                s += chunk(a, i * cb, tab, xq, xd, xsum, (i % 8) * nv)
            return s
        n = max(1, n_bytes // cb)
        rng = np.random.default_rng(0)
        a = rng.integers(0, 256, n * cb, dtype=np.uint8)
        xq = rng.integers(-127, 128, 8 * nv).astype(np.int8)
        xd = np.full(8 * nv // 32, 0.01, np.float32)
        xsum = xd * xq.reshape(-1, 32).sum(-1).astype(np.float32)
        stream(a[:cb], tab, xq, xd, xsum, 1)             # compiled with the tier's switches
    finally:
        for k, v in saved.items():
            setattr(dot, k, v)
    return lambda: stream(a, tab, xq, xd, xsum, n), n, n * cb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    t = dot.target()
    tiers = {"target": {}, "avx2": TIERS["avx2"]} if t.avx2 else {"target": {}}
    if t.ssse3:
        tiers["ssse3"] = TIERS["ssse3"]
    qtypes = [QuantType[name.upper()] if name.upper() in QuantType.__members__ else QuantType[name]
              for name in args.types.split(",")]
    runs = {(q, tier): _timed(q, sw, int(args.mb * 1e6)) for q in qtypes for tier, sw in tiers.items()}
    best = {key: float("inf") for key in runs}
    for _ in range(args.rounds):
        for key, (fn, _n, _b) in runs.items():
            c = time.process_time()
            fn()
            best[key] = min(best[key], time.process_time() - c)
    print(f"chunk dots streaming {args.mb:.0f} MB, 1 thread, best of {args.rounds} (CPU time); target "
          f"{t.cpu}: avx2={t.avx2} avx512bw={t.avx512bw} vnni={t.vnni}")
    print(f"{'type':8} " + " ".join(f"{tier + ' ns':>11} {'GB/s':>6}" for tier in tiers))
    results = []
    for q in qtypes:
        row = {"type": type_name(q)}
        cells = []
        for tier in tiers:
            _fn, n, nb = runs[(q, tier)]
            s = best[(q, tier)]
            row[tier] = {"ns_per_chunk": s / n * 1e9, "gbs": nb / s / 1e9}
            cells.append(f"{s / n * 1e9:11.2f} {nb / s / 1e9:6.1f}")
        print(f"{type_name(q):8} " + " ".join(cells))
        results.append(row)
    print(json.dumps({"cpu": t.cpu, "mb": args.mb, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
