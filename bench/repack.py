"""Benchmark: `quantkit repack` beside a plain file copy (`cp`) and ik's `llama-quantize --repack`.

A synthetic llama-shaped F16 model is quantized once (by quantkit, to the type given) and then
repacked to the row-interleaved layout by each tool; `cp` of the same file is the memory/disk
bound.  Each runs as a child process (wall time and peak RSS from os.wait4); the page cache is warm
for all of them (every tool reads the same file right after the previous one).

    python bench/repack.py [--type q4_K] [--size-mb 1000] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from quantize import REPO, llama_quantize, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="q4_K")
    ap.add_argument("--size-mb", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
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
        print(f"{'tool':28} {'wall s':>8} {'GB/s':>8} {'peak RSS MB':>12}")
        rows = []
        wall, rss, _ = run(["cp", str(src), str(d / "copy.gguf")])
        rows.append(("cp", wall, rss))
        wall, rss, out = run(qk + ["repack", str(src), str(d / "qk.gguf"), "--json"])
        inner = json.loads(out[out.index("{"):])["result"]["seconds"]
        rows.append(("quantkit repack", wall, rss))
        rows.append(("quantkit repack (no start-up)", inner, rss))
        wall, rss, _ = run([lq, "--repack", str(src), str(d / "lq.gguf"), "Q8_0", str(args.threads)])
        rows.append(("llama-quantize --repack", wall, rss))
        wall, rss, _ = run(qk + ["repack", str(d / "qk.gguf"), str(d / "back.gguf"), "--undo", "--json"])
        rows.append(("quantkit repack --undo", wall, rss))
        for name, wall, rss in rows:
            print(f"{name:28} {wall:8.2f} {size / wall / 1e9:8.2f} {rss / 1e6:12.0f}")


if __name__ == "__main__":
    main()
