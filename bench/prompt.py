"""Benchmark: prompt processing (one batch of --prompt tokens, logits of the last) of quantkit's runtime
beside ik_llama.cpp (the ik-llama-cpp-python wheel), on the same files, tokens and threads.

SmolLM2-135M-Instruct is written by quantkit as F32 and each --types target (SmolLM2's 576-wide rows
take the targets' fallback types: see the "types" column).  Both tools run in this one process, each
pass from an empty cache, the tools taking turns (one pass each, --repeat times) so that a busy
machine slows both alike; the figure is the best pass.  quantkit runs twice: as it does by default
(a batch's products with 8-bit activations, runtime/matmul8.py) and with --float-products
(decoded tiles times float32 activations: the "float" columns).  Besides wall-clock tokens/s the table gives,
with one thread, tokens per CPU-second (process time): on a machine shared with other work that
ratio is the steadier one.

    python bench/prompt.py [--threads 2] [--prompt 128] [--repeat 5] [--types q8_0,q4_K,...] [--all-types]
                           [--workdir DIR (keeps the quantized files for the next run)] [--json FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

# the types of issue 28's table (generation's fused kernels), as quantize targets; --all-types: bench/run.py's
TARGETS = {"f32": "f32", "q8_0": "q8_0", "q4_K": "q4_K", "iq4_k": "IQ4_K", "iq4_ks": "IQ4_KS", "iq3_k": "IQ3_K",
           "iq2_k_r4": "IQ2_K_R4", "q4_0_r8": "Q4_0_R8"}


def _all_targets() -> dict[str, str]:
    from run import TARGETS as RUN_TARGETS
    return {**TARGETS, **RUN_TARGETS}


def write_files(workdir: Path, names: list[str]) -> dict[str, Path]:
    import quantkit
    from run import smollm2
    f32 = workdir / "f32.gguf"
    if not f32.exists():
        quantkit.quantize_model(smollm2(), f32, "f32", allow_requantize=True)
    paths = {}
    for name in names:
        path = f32 if name == "f32" else workdir / f"{name}.gguf"
        if not path.exists():
            # the very-low-bit i-quants need an imatrix: SmolLM2's golden one, as bench/run.py gives them
            from run import IMATRIX
            imatrix = IMATRIX if name.lower().startswith(("iq1", "iq2_x", "iq2_s")) else None
            quantkit.quantize_model(f32, path, _all_targets()[name], threads=2, imatrix=imatrix)
        paths[name] = path
    return paths


def matrix_types(path: Path) -> str:
    """The types of the file's layer matrices, by share of their weights."""
    from quantkit.gguf_io.reader import open_model
    from quantkit.types import type_name
    count = collections.Counter()
    with open_model(path) as g:
        for t in g.tensors:
            if t.n_dims >= 2 and t.name.startswith("blk."):
                count[type_name(t.qtype)] += t.n_elements
    total = sum(count.values())
    return " ".join(f"{t}:{100 * n / total:.0f}%" for t, n in count.most_common())


def quantkit_pass(path: Path, tokens: list[int], float_products: bool = False):
    """A function running one prompt pass of quantkit's runtime (kernels loaded, warmed up)."""
    from quantkit.gguf_io.reader import open_model
    from quantkit.runtime import ops_cpu
    from quantkit.runtime.model import Model
    from quantkit.runtime.warmup import warm_up
    g = open_model(path).__enter__()
    model = Model(g, ops_cpu.float_products if float_products else ops_cpu)
    warm_up(model, [len(tokens)])
    n = len(tokens)
    return lambda: model.forward(tokens, model.new_cache(n), logits_from=n - 1), g.__exit__


def ik_pass(path: Path, tokens: list[int], threads: int):
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel
    from peers import _silence_llama
    _silence_llama(C)
    model = IkModel(str(path), use_mmap=True, n_gpu_layers=0)
    n = len(tokens)
    ctx = IkContext(model, n_ctx=(n + 63) // 64 * 64, n_threads=threads, flash_attn=False)
    batch = C.llama_batch_init(n, 0, 1)

    def run():
        ctx.kv_cache_clear()
        batch.n_tokens = n
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, int(i == n - 1)
            batch.seq_id[i][0] = 0
        if ctx.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")

    def close(*_):
        C.llama_batch_free(batch)
        ctx.close()
        model.close()
    return run, close


def measure(name: str, path: Path, tokens: list[int], threads: int, repeat: int) -> dict:
    runs = {"quantkit": quantkit_pass(path, tokens), "float": quantkit_pass(path, tokens, float_products=True),
            "ik": ik_pass(path, tokens, threads)}
    wall = {tool: [] for tool in runs}
    cpu = {tool: [] for tool in runs}
    try:
        for tool, (run, _) in runs.items():
            run()                                               # warm-up (ik: its first pass)
        for _ in range(repeat):
            for tool, (run, _) in runs.items():
                w, c = time.perf_counter(), time.process_time()
                run()
                cpu[tool].append(time.process_time() - c)
                wall[tool].append(time.perf_counter() - w)
    finally:
        for _, close in runs.values():
            close(None, None, None)
    n = len(tokens)
    row = {"type": name, "types": matrix_types(path), "tokens": n, "threads": threads}
    for tool in runs:
        row[f"{tool}_pp"] = n / min(wall[tool])
        row[f"{tool}_pp_cpu"] = n / min(cpu[tool])
    row["ratio"] = row["quantkit_pp"] / row["ik_pp"]
    row["ratio_cpu"] = row["quantkit_pp_cpu"] / row["ik_pp_cpu"]
    row["float_ratio"] = row["float_pp"] / row["ik_pp"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--types", default=",".join(TARGETS))
    ap.add_argument("--all-types", action="store_true", help="bench/run.py's types (q5_K, q6_K, iq4_xs, ... too)")
    ap.add_argument("--workdir", type=Path, help="where the quantized files are kept (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    from quantkit.runtime.session import set_threads
    from run import prompt_tokens
    set_threads(args.threads)
    names = list(_all_targets()) if args.all_types else args.types.split(",")
    unknown = [n for n in names if n not in _all_targets()]
    if unknown:
        ap.error(f"unknown types {unknown}: {', '.join(_all_targets())}")
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        paths = write_files(workdir, names)
        tokens = prompt_tokens(paths[names[0]], args.prompt)
        print(f"SmolLM2-135M, prompt of {len(tokens)} tokens, {args.threads} threads, best of {args.repeat}"
              f" (tools taking turns); tokens/s, and tokens per CPU-second")
        print(f"{'file':9} {'quantkit':>9} {'ik':>8} {'ratio':>6} | {'qk /cpu-s':>9} {'ik /cpu-s':>9} {'ratio':>6} | "
              f"{'float':>7} {'ratio':>6} | layer matrices")
        rows = []
        for name in names:
            r = measure(name, paths[name], tokens, args.threads, args.repeat)
            rows.append(r)
            print(f"{name:9} {r['quantkit_pp']:9.1f} {r['ik_pp']:8.1f} {r['ratio']:6.2f} | {r['quantkit_pp_cpu']:9.1f} "
                  f"{r['ik_pp_cpu']:9.1f} {r['ratio_cpu']:6.2f} | {r['float_pp']:7.1f} {r['float_ratio']:6.2f} | "
                  f"{r['types']}", flush=True)
    print(json.dumps(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
