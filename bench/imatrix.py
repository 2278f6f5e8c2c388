"""Benchmark: `quantkit imatrix` collection speed beside ik_llama.cpp evaluating the same chunks.

The wheel ships no llama-imatrix, so the peer figure is what llama-imatrix costs at least (the proxy):
ik_llama.cpp (the wheel's Python API) evaluating the same chunks with the same threads, logits for
every position, without the collection callback.  quantkit runs the whole `quantkit imatrix` command
once (start-up included) and, in this process, the collection alone; the collection and ik's pass
take turns --repeat times (a busy machine slows both alike) and the best of each counts, in
wall-clock tokens/s and per CPU-second (the steadier figure with one thread on a shared machine).
Model: SmolLM2-135M-Instruct Q4_1 as shipped; text: the GPL.

    python bench/imatrix.py [--threads 2] [-c 256] [--chunks 8] [--repeat 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "imatrix" / "calib-gpl3.txt"
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]


def ik_chunks(path: Path, chunks: list[list[int]], threads: int):
    """(run, close): ``run()`` evaluates every chunk with ik_llama.cpp from an empty cache, logits for
    every position (as llama-imatrix asks for them), without a collection callback."""
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel
    from peers import _silence_llama
    _silence_llama(C)
    model = IkModel(str(path), use_mmap=True, n_gpu_layers=0)
    n_ctx = len(chunks[0])
    ctx = IkContext(model, n_ctx=n_ctx, n_threads=threads, flash_attn=False)
    batch = C.llama_batch_init(n_ctx, 0, 1)

    def run_chunk(chunk):
        ctx.kv_cache_clear()
        batch.n_tokens = len(chunk)
        for i, t in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        if ctx.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")

    def run():
        for c in chunks:
            run_chunk(c)

    def close():
        C.llama_batch_free(batch)
        ctx.close()
        model.close()
    run_chunk(chunks[0])                                        # warm-up
    return run, close


def quantkit_chunks(path: Path, chunks: list[list[int]], threads: int):
    """(run, close): ``run()`` is the collection alone, in this process, as `quantkit imatrix` runs it
    (mainline's activation rounding, the observer summing squares), the model opened and its
    kernels warmed up first."""
    import numpy as np

    from quantkit.runtime.activations import MainlineRounding
    from quantkit.runtime.collect import ActivationStats, ObservingOps, collect
    from quantkit.runtime.session import open_session
    stats = ActivationStats()

    def observing(gguf, ops):
        return ObservingOps(MainlineRounding(ops), stats, {t.name: tuple(t.shape) for t in gguf.tensors})
    session = open_session(path, threads, wrap_ops=observing)
    s = session.__enter__()
    arrays = [np.asarray(c) for c in chunks]
    collect(s.model, arrays[:1])                                # warm-up
    return (lambda: collect(s.model, arrays)), (lambda: session.__exit__(None, None, None))


def whole_command_seconds(model: Path, args) -> float:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "quantkit", "imatrix", str(model), "-f", str(TEXT), "-o", f"{d}/x.dat",
               "-c", str(args.ctx_size), "--chunks", str(args.chunks), "--threads", str(args.threads), "--json"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        json.loads(p.stdout)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="passes over the chunks per tool, taking turns (best counts)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from run import smollm2
    from quantkit.runtime import perplexity as ppl
    from quantkit.text.tokenizer import Tokenizer
    model = smollm2()
    tok = Tokenizer.from_file(model)
    chunks = [c.tolist() for c in ppl.chunk_tokens(tok.encode(TEXT.read_text()), args.ctx_size, args.chunks,
                                                    tok.bos_id)]
    n_tokens = sum(len(c) for c in chunks)
    wall = whole_command_seconds(model, args)
    tools = {"quantkit": quantkit_chunks(model, chunks, args.threads), "ik": ik_chunks(model, chunks, args.threads)}
    best = {t: float("inf") for t in tools}
    best_cpu = dict(best)
    try:
        for _ in range(args.repeat):
            for t, (run, _) in tools.items():
                w, c = time.perf_counter(), time.process_time()
                run()
                best_cpu[t] = min(best_cpu[t], time.process_time() - c)
                best[t] = min(best[t], time.perf_counter() - w)
    finally:
        for _, close in tools.values():
            close()
    qk, ik = best["quantkit"], best["ik"]
    print(f"SmolLM2-135M Q4_1, {len(chunks)} chunks of {args.ctx_size} ({n_tokens} tokens), {args.threads} threads, "
          f"best of {args.repeat} (tools taking turns)")
    print("ik_llama.cpp: the wheel's forward pass over the same chunks (no llama-imatrix in the wheel: the proxy)")
    print(f"{'tool':46} {'s':>7} {'tokens/s':>9} {'tokens/cpu-s':>12}")
    print(f"{'quantkit imatrix (whole command, once)':46} {wall:7.2f} {n_tokens / wall:9.1f}")
    print(f"{'quantkit collection alone (in-process, warm)':46} {qk:7.2f} {n_tokens / qk:9.1f} "
          f"{n_tokens / best_cpu['quantkit']:12.1f}")
    print(f"{'ik_llama.cpp forward of the same chunks':46} {ik:7.2f} {n_tokens / ik:9.1f} {n_tokens / best_cpu['ik']:12.1f}")
    ratios = {"whole_command": ik / wall, "collection": ik / qk, "collection_cpu": best_cpu["ik"] / best_cpu["quantkit"]}
    print(f"ratio (quantkit / ik tokens/s): whole command {ratios['whole_command']:.2f}, collection alone "
          f"{ratios['collection']:.2f} (per CPU-second {ratios['collection_cpu']:.2f})")
    figures = {"model": "SmolLM2-135M-Instruct Q4_1", "tokens": n_tokens, "ctx": args.ctx_size, "threads": args.threads,
               "repeat": args.repeat, "whole_command_s": wall, "quantkit_s": qk, "ik_s": ik,
               "quantkit_cpu_s": best_cpu["quantkit"], "ik_cpu_s": best_cpu["ik"], "ratios": ratios}
    print(json.dumps(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
