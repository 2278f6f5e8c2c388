"""Benchmark: `quantkit repack` beside a plain file copy (`cp`) and ik's `llama-quantize --repack`.

A synthetic llama-shaped F16 model is quantized once (by quantkit, to the type given) and then
repacked to the row-interleaved layout by each tool; `cp` of the same file is the memory/disk
bound.  Each runs as a child process (wall time and peak RSS from os.wait4); the page cache is warm
for all of them (every tool reads the same file right after the previous one), and every run starts
after a `sync` with no other output file left, so no tool pays for another's dirty pages; each
figure is the best of --repeat runs.

    python bench/repack.py [--type q4_K] [--size-mb 1000] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from quantize import REPO, llama_quantize, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="q4_K")
    ap.add_argument("--size-mb", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    lq = llama_quantize()
    qk = [sys.executable, "-m", "quantkit"]
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        gen = (f"import sys; sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO / 'bench')!r}]\n"
               f"from pathlib import Path\nfrom quantize import make_model\n"
               f"make_model(Path({str(d / 'in-f16.gguf')!r}), {args.size_mb})")
        run([sys.executable, "-c", gen])
        src = d / "in.gguf"
        run(qk + ["quantize", str(d / "in-f16.gguf"), str(src), args.type, "--pure", "--threads", str(args.threads)])
        (d / "in-f16.gguf").unlink()
        size = src.stat().st_size
        print(f"input: {size / 1e6:.0f} MB of {args.type} (token_embd is copied, everything else repacked)")
        print(f"{'tool':30} {'wall s':>8} {'GB/s':>8} {'peak RSS MB':>12}")
        rows = []

        def timed(cmd, out, keep=False):
            best = None
            for _ in range(args.repeat):
                out.unlink(missing_ok=True)
                os.sync()
                r = run(cmd)
                best = r if best is None or r[0] < best[0] else best
            if not keep:
                out.unlink()
            return best

        wall, rss, _ = timed(["cp", str(src), str(d / "copy.gguf")], d / "copy.gguf")
        rows.append(("cp", wall, rss))
        wall, rss, out = timed(qk + ["repack", str(src), str(d / "qk.gguf"), "--json"], d / "qk.gguf", keep=True)
        inner = json.loads(out[out.index("{"):])["result"]["seconds"]
        rows.append(("quantkit repack", wall, rss))
        rows.append(("quantkit repack (in-process)", inner, rss))
        wall, rss, _ = timed([lq, "--repack", str(src), str(d / "lq.gguf"), "Q8_0", str(args.threads)], d / "lq.gguf")
        rows.append(("llama-quantize --repack", wall, rss))
        wall, rss, _ = timed(qk + ["repack", str(d / "qk.gguf"), str(d / "back.gguf"), "--undo", "--json"],
                             d / "back.gguf")
        rows.append(("quantkit repack --undo", wall, rss))
        for name, wall, rss in rows:
            print(f"{name:30} {wall:8.2f} {size / wall / 1e9:8.2f} {rss / 1e6:12.0f}")


if __name__ == "__main__":
    main()
