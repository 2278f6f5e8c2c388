"""Benchmark: `quantkit imatrix` collection speed beside ik_llama.cpp evaluating the same chunks.

The wheel ships no llama-imatrix, so the peer figure is what llama-imatrix costs at least: ik_llama.cpp
(the wheel's Python API) evaluating the same chunks with logits for every position, without the
collection callback.  quantkit runs the whole `quantkit imatrix` command (start-up included, and
in-process: the collection alone).  Model: SmolLM2-135M-Instruct Q4_1 as shipped; text: the GPL.

    python bench/imatrix.py [--threads 2] [-c 256] [--chunks 8]
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


def ik_chunks_seconds(path: Path, chunks: list[list[int]], threads: int) -> float:
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel
    from peers import _silence_llama
    _silence_llama(C)
    model = IkModel(str(path), use_mmap=True, n_gpu_layers=0)
    n_ctx = len(chunks[0])
    ctx = IkContext(model, n_ctx=n_ctx, n_threads=threads, flash_attn=False)
    batch = C.llama_batch_init(n_ctx, 0, 1)
    try:
        def run(chunk):
            ctx.kv_cache_clear()
            batch.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
                batch.seq_id[i][0] = 0
            if ctx.decode(batch) != 0:
                raise RuntimeError("llama_decode failed")
        run(chunks[0])                                          # warm-up
        t0 = time.perf_counter()
        for c in chunks:
            run(c)
        return time.perf_counter() - t0
    finally:
        C.llama_batch_free(batch)
        ctx.close()
        model.close()


def quantkit_chunks_seconds(path: Path, chunks: list[list[int]], threads: int) -> float:
    """The collection alone, in this process, measured like ik's figure: the model opened and one
    chunk run first (numba's cached kernels loaded), then every chunk timed."""
    import numpy as np

    from quantkit.runtime.activations import MainlineRounding
    from quantkit.runtime.collect import ActivationStats, ObservingOps, collect
    from quantkit.runtime.session import open_session
    stats = ActivationStats()

    def observing(gguf, ops):
        return ObservingOps(MainlineRounding(ops), stats, {t.name: tuple(t.shape) for t in gguf.tensors})
    with open_session(path, threads, wrap_ops=observing) as s:
        arrays = [np.asarray(c) for c in chunks]
        collect(s.model, arrays[:1])                           # warm-up
        t0 = time.perf_counter()
        collect(s.model, arrays)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    from run import smollm2
    from quantkit.runtime import perplexity as ppl
    from quantkit.text.tokenizer import Tokenizer
    model = smollm2()
    tok = Tokenizer.from_file(model)
    chunks = [c.tolist() for c in ppl.chunk_tokens(tok.encode(TEXT.read_text()), args.ctx_size, args.chunks,
                                                    tok.bos_id)]
    n_tokens = sum(len(c) for c in chunks)
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "quantkit", "imatrix", str(model), "-f", str(TEXT), "-o", f"{d}/x.dat",
               "-c", str(args.ctx_size), "--chunks", str(args.chunks), "--threads", str(args.threads), "--json"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        json.loads(p.stdout)
    ik = ik_chunks_seconds(model, chunks, args.threads)
    inproc = quantkit_chunks_seconds(model, chunks, args.threads)
    print(f"SmolLM2-135M Q4_1, {len(chunks)} chunks of {args.ctx_size} ({n_tokens} tokens), {args.threads} threads")
    print(f"{'tool':44} {'s':>7} {'tokens/s':>9}")
    print(f"{'quantkit imatrix (whole command)':44} {wall:7.2f} {n_tokens / wall:9.1f}")
    print(f"{'quantkit collection alone (in-process, warm)':44} {inproc:7.2f} {n_tokens / inproc:9.1f}")
    print(f"{'ik_llama.cpp forward of the same chunks':44} {ik:7.2f} {n_tokens / ik:9.1f}")
    print(f"ratio (quantkit / ik): whole command {ik / wall:.2f}, collection alone {ik / inproc:.2f}")


if __name__ == "__main__":
    main()
