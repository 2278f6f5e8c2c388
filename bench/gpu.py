"""Benchmark: the runtime's torch backend on a GPU (issue 8): generation speed and the fraction of the
device's memory bandwidth it reaches.

A llama-shaped F16 model with random weights of --size-mb (bench/quantize.py's make_model: 2048
wide, 5632 FFN, 32000 vocabulary; 2200 MB by default, TinyLlama-1.1B's size) is quantized by
quantkit to each --types entry.  Each file runs in
a child process on --device: a --prompt token batch, then --gen tokens one at a time (greedy).

    bandwidth fraction = bytes of weights read per generated token x tokens/s / device bandwidth

The bytes per token are every matrix the token multiplies (all 2-D weights but token_embd, of
which one row is read).  The device bandwidth is measured in the same run by a device-to-device
copy of 2 GiB (bytes read + bytes written per second), so the figure needs no spec sheet; pass
--bandwidth-gbs to use a nominal figure instead.  On a machine without a GPU, --device torch-cpu
runs the same code on the CPU (and compares with the CPU's copy bandwidth).

Each file runs once per --backends entry, side by side: "triton" the fused Triton kernels
(quantkit/runtime/triton_qmm: tiles decoded in registers, types without a kernel on the torch
decode), "torch" the torch decode of every type (a decoded tile in memory, then a matmul).  On
CUDA both run by default (triton where installed); on torch-cpu only torch (Triton's CPU
interpreter is a correctness check, far too slow for a benchmark).  A table, then one JSON line.

    python bench/gpu.py [--device cuda] [--types f16,q8_0,q4_K] [--backends triton,torch]
                        [--size-mb 2200] [--gen 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))            # models.py, which make_model writes with
from quantize import make_model  # noqa: E402      # bench/quantize.py (this folder is on sys.path)


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB (best of 5)."""
    import torch
    dev = torch.device("cpu" if device == "torch-cpu" else device)
    a = torch.empty(1 << 29, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / best


def child(path: Path, device: str, n_prompt: int, n_gen: int, threads: int, backend: str) -> dict:
    import torch
    from quantkit.gguf_io.reader import open_model
    from quantkit.runtime.model import Model
    from quantkit.runtime.session import make_ops, set_threads
    set_threads(threads)
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with open_model(path) as g:
        ops = make_ops(device, (), threads, triton=backend == "triton")
        model = Model(g, ops=ops)
        weights = [model.w.need(t.name) for t in g.tensors if t.n_dims >= 2]
        per_token = sum(w.nbytes for w in weights if not w.name.startswith("token_embd"))
        on_device = ops.placement_summary(weights) if hasattr(ops, "placement_summary") else {}
        tokens = [int(t) for t in np.random.default_rng(1).integers(1, 1000, n_prompt)]
        # upload the weights and compile every kernel the timed runs use: a step's (per-token) and
        # the prompt's (above triton_qmm.FUSED_BATCH: the decode kernel).  Without the prompt-sized
        # warm-up the prompt's figure included Triton's compiles (the H200 run of session 4)
        model.forward(tokens[:4], model.new_cache(8))
        model.forward(tokens, model.new_cache(n_prompt))
        sync()
        cache = model.new_cache(n_prompt + n_gen)
        t0 = time.perf_counter()
        logits = model.forward(tokens, cache, logits_from=n_prompt - 1)[-1]
        sync()
        t1 = time.perf_counter()
        for _ in range(n_gen):
            logits = model.forward([int(np.argmax(logits))], cache)[-1]
        sync()
        t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    return {"pp": n_prompt / (t1 - t0), "tg": n_gen / (t2 - t1), "bytes_per_token": per_token,
            "placement": on_device, "device_peak_gb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--types", default="f16,q8_0,q4_K,q5_K,q6_K,iq4_xs,mxfp4")
    ap.add_argument("--backends", help="triton,torch (default: both on CUDA where triton is installed, else torch)")
    ap.add_argument("--size-mb", type=int, default=2200)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bandwidth-gbs", type=float, help="nominal device bandwidth instead of the measured copy")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child), args.device, args.prompt, args.gen, args.threads, args.backends)))
        return
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device torch-cpu to exercise the same code on the CPU")
    from quantkit.runtime import triton_qmm
    if args.backends:
        backends = args.backends.split(",")
        if not set(backends) <= {"triton", "torch"}:
            raise SystemExit(f"--backends: triton and/or torch, not {args.backends}")
    else:
        backends = ["triton", "torch"] if args.device.startswith("cuda") and triton_qmm.available() else ["torch"]
    if "triton" in backends and not triton_qmm.available():
        raise SystemExit("--backends triton: needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU (torch)"
    bw = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else copy_bandwidth(args.device)
    bw_how = "nominal" if args.bandwidth_gbs else "measured device copy, read + write"
    qk = [sys.executable, "-m", "quantkit"]
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        f16 = d / "f16.gguf"
        make_model(f16, args.size_mb)
        print(f"llama of {f16.stat().st_size / 1e9:.2f} GB in F16; {name}; "
              f"bandwidth {bw / 1e9:.0f} GB/s ({bw_how}); prompt {args.prompt}, {args.gen} generated")
        print(f"{'type':6} {'backend':7} {'file GB':>8} {'GB/token':>9} {'pp tok/s':>9} {'tg tok/s':>9} "
              f"{'GB/s read':>10} {'of bandwidth':>13}  placement")
        rows = []
        for t in args.types.split(","):
            path = f16 if t.lower() == "f16" else d / f"{t}.gguf"
            if path != f16:
                subprocess.run(qk + ["quantize", str(f16), str(path), t, "--pure"], check=True, capture_output=True)
            for backend in backends:
                p = subprocess.run([sys.executable, __file__, "--child", str(path), "--device", args.device,
                                    "--prompt", str(args.prompt), "--gen", str(args.gen),
                                    "--threads", str(args.threads), "--backends", backend],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(f"{t} ({backend}): {p.stderr[-3000:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                read = r["bytes_per_token"] * r["tg"]
                where = ", ".join(f"{k}: {v['tensors']} tensors" for k, v in r["placement"].items())
                print(f"{t:6} {backend:7} {path.stat().st_size / 1e9:8.2f} {r['bytes_per_token'] / 1e9:9.3f} "
                      f"{r['pp']:9.1f} {r['tg']:9.2f} {read / 1e9:10.1f} {100 * read / bw:12.1f}%  {where}")
                rows.append({"type": t, "backend": backend, "file_gb": path.stat().st_size / 1e9,
                             "bandwidth_fraction": read / bw, **r})
    print(json.dumps({"device": name, "bandwidth_gbs": bw / 1e9, "bandwidth": bw_how, "prompt": args.prompt,
                      "gen": args.gen, "rows": rows}))


if __name__ == "__main__":
    main()
