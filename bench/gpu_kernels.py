"""Benchmark: the fused Triton kernels alone on a GPU (issue 28, target 4), beside cuBLAS on the
same shape, and a check of their results against the numba decoders.

bench/gpu.py times whole models, where a token's Python dispatch (a few hundred launches) hides
what a kernel reaches; this times one product of a large weight (--shape N x K, default 28672 x
8192, a 70B model's FFN) per type:

* generation (1 token): ``qmatmul``'s per-token kernel; GB/s = the weight's bytes / kernel time,
  and that as a fraction of the device's copy bandwidth (read + written, bench/gpu.py's
  measure).  The peer: cuBLAS's F16 product of the same shape (torch.matmul).
* a small batch (16 tokens, ``triton_qmm.FUSED_BATCH``): the ``tl.dot`` kernel; µs per product.
* prompt (--prompt tokens, default 512): ``qmatmul`` above FUSED_BATCH (decoded tiles, then a
  float32 matmul); TFLOP/s = 2 M N K / time.  Peers: cuBLAS F16 (its own precision, not float32)
  and the torch fallback (the torch decode, then the same matmul).
* --sweep: the per-token kernel at other tile geometries (rows per program, blocks per step,
  warps), so that ``triton_qmm.tiles`` is chosen from measured times.

Weights for the speed runs are random bytes (a kernel's time does not depend on its values).
The check needs real blocks with the numba decoders' values, which need no GPU: --make-weights
FILE quantizes rows of every --types entry with quantkit (numba) and stores them with their
decoded values; --weights FILE on the GPU machine compares ``qdecode`` with them bit for bit and
``qmatmul`` with a float64 product of them.

    python bench/gpu_kernels.py --make-weights rows.npz [--types ...]          # any machine
    python bench/gpu_kernels.py [--weights rows.npz] [--types ...] [--sweep q4_K,q8_0] [--shape 28672x8192]

Timing: ``triton.testing.do_bench`` (CUDA events, the L2 cache flushed before each run; mean).
A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TYPES = ("q8_0,q4_0,q4_K,q5_K,q6_K,iq4_xs,iq4_nl,iq2_k,iq3_k,iq4_k,iq5_k,iq4_ks,iq5_ks,iq4_kss,iq2_ks,"
         "mxfp4,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,iq1_s,iq1_m,f16")
# the per-token tile geometries --sweep tries: (BN rows, NB blocks per step, warps)
SWEEP_FEW = {32: [(16, 1, 4), (32, 1, 4), (16, 8, 4), (16, 4, 4), (32, 4, 4), (8, 8, 4), (16, 8, 8), (32, 8, 8)],
             256: [(8, 1, 4), (8, 2, 4), (4, 4, 4), (8, 4, 4), (16, 2, 4), (4, 2, 4), (8, 2, 8)]}


def qtype_of(name: str):
    from quantkit.types import QuantType
    return QuantType[name.upper()]


def make_weights(path: Path, types: list[str], rows: int, k: int) -> None:
    """Quantize ``rows`` x ``k`` random rows to each type (an imatrix of ones: the i-quants need
    one) and store bytes and numba-decoded values: ``NAME.bytes``, ``NAME.values``."""
    from quantkit import formats
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.2, 3.0, (rows, 1))).astype(np.float32)
    ones = np.ones(k, np.float32)
    out = {}
    for name in types:
        qt = qtype_of(name)
        try:
            b = formats.quantize(x, qt, imatrix=ones)
        except NotImplementedError:
            b = formats.quantize(x, qt)
        out[f"{name}.bytes"] = b
        out[f"{name}.values"] = formats.dequantize(b, qt, k)
    np.savez(path, **out)
    print(f"{path}: {len(types)} types, {rows} rows of {k}")


def check(stored, name: str, device) -> dict:
    """qdecode against the numba decoders' values (bit for bit, NaN where they have NaN), the torch
    fallback decode likewise, and qmatmul of 1, 16 and 64 tokens (its three paths) against a
    float64 product."""
    import torch
    from quantkit.runtime import torch_decode, triton_qmm
    qt = qtype_of(name)
    b = torch.from_numpy(stored[f"{name}.bytes"]).to(device)
    ref = stored[f"{name}.values"]
    k = ref.shape[1]
    dec = triton_qmm.qdecode(b, qt, k).cpu().numpy()
    same = bool(np.array_equal(dec.view(np.uint32), ref.view(np.uint32)) or
                np.array_equal(dec, ref, equal_nan=True))
    td = torch_decode.decode(b, qt, k).cpu().numpy()
    torch_same = bool(np.array_equal(td, ref, equal_nan=True))
    rng = np.random.default_rng(3)
    worst = 0.0
    for m in (1, 16, 64):          # the per-token kernel, tl.dot, decoded tiles
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = triton_qmm.qmatmul(torch.from_numpy(x).to(device), b, qt).cpu().numpy().astype(np.float64)
        want = x.astype(np.float64) @ ref.astype(np.float64).T
        scale = np.abs(x.astype(np.float64)) @ np.abs(ref.astype(np.float64)).T
        worst = max(worst, float(np.max(np.abs(got - want) / np.maximum(scale, 1e-30))))
    return {"decode_bit_exact": same, "torch_decode_bit_exact": torch_same, "matmul_rel_err": worst}


def bench_ms(fn) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=40))


def launch(x, w, out, dec, tables, tile: dict):
    """One per-token kernel launch at an explicit tile geometry (what triton_qmm.qmatmul does with
    its own)."""
    import triton
    from quantkit.runtime.triton_qmm.template import qmv_kernel
    m, k = x.shape
    n = w.shape[0]
    geometry = dict(DECODE=dec.fn, QK=dec.block_values, BLOCK_BYTES=dec.block_bytes, META=dec.row_meta_bytes,
                    enable_fp_fusion=True)
    t0, t1 = tables
    qmv_kernel[(triton.cdiv(n, tile["BN"]), m)](x, w, out, t0, t1, n, k, w.shape[1], x.stride(0),
                                                out.stride(0), **tile, **geometry)


def speed(name: str, n: int, k: int, prompt: int, device, sweep: bool) -> dict:
    import torch
    from quantkit.runtime import torch_decode, triton_qmm
    from quantkit.runtime.triton_qmm import _decoder, _tables
    qt = qtype_of(name)
    dec = _decoder(qt)
    row_bytes = dec.row_bytes(k)
    w = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, device=device)
    if name == "f16":       # finite halves: random bits would hold NaNs, slow on no GPU path but odd to read
        w = (torch.randn(n, k, device=device) * 0.05).half().view(torch.uint8).reshape(n, row_bytes)
    nbytes = w.numel()
    x1 = torch.randn(1, k, device=device)
    x16 = torch.randn(triton_qmm.FUSED_BATCH, k, device=device)
    xm = torch.randn(prompt, k, device=device)
    r = {"type": name, "weight_mb": nbytes / 1e6}
    r["tg_ms"] = bench_ms(lambda: triton_qmm.qmatmul(x1, w, qt))
    r["b16_ms"] = bench_ms(lambda: triton_qmm.qmatmul(x16, w, qt))
    r["pp_ms"] = bench_ms(lambda: triton_qmm.qmatmul(xm, w, qt))
    # the torch fallback: decode every row, then a float32 product (what TorchOps does without triton)
    if name != "f16" and torch_decode.can_decode(qt):
        r["pp_torch_ms"] = bench_ms(lambda: xm @ torch_decode.decode(w, qt, k).T)
    # host time of one qmatmul call (Python, checks, launch): what a step pays per product
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        triton_qmm.qmatmul(x1, w, qt)
    r["host_us"] = (time.perf_counter() - t) / 50 * 1e6
    torch.cuda.synchronize()
    if sweep:
        tables = _tables(qt, dec, w.device)
        out1 = torch.empty((1, n), device=device)
        few = {}
        for bn, nb, warps in SWEEP_FEW[dec.block_values]:
            tile = dict(BN=bn, NB=nb, num_warps=warps)
            try:
                few[f"BN{bn}NB{nb}w{warps}"] = bench_ms(lambda: launch(x1, w, out1, dec, tables, tile))
            except Exception as e:                                      # noqa: BLE001 (a geometry that fails)
                few[f"BN{bn}NB{nb}w{warps}"] = f"{type(e).__name__}"
        r["sweep_tg_ms"] = few
    del w
    torch.cuda.empty_cache()
    return r


def cublas(n: int, k: int, prompt: int, device) -> dict:
    import torch
    w = (torch.randn(n, k, device=device) * 0.05).half()
    x1 = torch.randn(1, k, device=device).half()
    xm = torch.randn(prompt, k, device=device).half()
    return {"tg_ms": bench_ms(lambda: x1 @ w.T), "pp_ms": bench_ms(lambda: xm @ w.T), "weight_mb": w.numel() * 2 / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--make-weights", help="write check rows (numba) to this .npz and exit")
    ap.add_argument("--weights", help="check rows from --make-weights: compare the kernels with them")
    ap.add_argument("--shape", default="28672x8192", help="N x K of the timed weight")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--sweep", default="", help="types whose tile geometries are swept")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    if args.make_weights:
        make_weights(Path(args.make_weights), types, 16, 4096)
        return
    import torch
    import triton
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu import copy_bandwidth
    n, k = (int(v) for v in args.shape.lower().split("x"))
    bw = copy_bandwidth(args.device)
    name = torch.cuda.get_device_name()
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s "
          f"(read + write); weight {n} x {k}; prompt {args.prompt} tokens", flush=True)
    peer = cublas(n, k, args.prompt, args.device)
    flops = 2 * args.prompt * n * k
    print(f"cuBLAS F16: 1 token {peer['tg_ms'] * 1e3:.1f} us = {peer['weight_mb'] / peer['tg_ms']:.0f} GB/s "
          f"({100 * peer['weight_mb'] * 1e6 / (peer['tg_ms'] / 1e3) / bw:.0f}%); "
          f"{args.prompt} tokens {flops / peer['pp_ms'] / 1e9:.1f} TFLOP/s", flush=True)
    stored = np.load(args.weights) if args.weights else None
    sweep = set(args.sweep.split(",")) if args.sweep else set()
    print(f"{'type':8} {'MB':>7} {'1 tok us':>9} {'GB/s':>6} {'of bw':>6} {'16 tok us':>9} {'pp TFLOP/s':>10} "
          f"{'torch pp':>9} {'host us':>8}  check", flush=True)
    rows = []
    for t in types:
        try:
            r = speed(t, n, k, args.prompt, args.device, t in sweep)
            if stored is not None and f"{t}.bytes" in stored:
                r["check"] = check(stored, t, args.device)
        except Exception as e:                                          # noqa: BLE001 (report, go on)
            print(f"{t:8} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"type": t, "error": f"{type(e).__name__}: {str(e)[:1000]}"})
            continue
        gbs = r["weight_mb"] / r["tg_ms"]             # MB per ms
        r["tg_gbs"], r["tg_fraction"] = gbs, gbs * 1e9 / bw
        r["pp_tflops"] = flops / r["pp_ms"] / 1e9
        torch_pp = f"{flops / r['pp_torch_ms'] / 1e9:9.1f}" if "pp_torch_ms" in r else f"{'-':>9}"
        c = r.get("check")
        how = (f"decode {'=' if c['decode_bit_exact'] else '!='} numba, torch {'=' if c['torch_decode_bit_exact'] else '!='}, "
               f"matmul err {c['matmul_rel_err']:.1e}") if c else ""
        print(f"{t:8} {r['weight_mb']:7.1f} {r['tg_ms'] * 1e3:9.1f} {gbs:6.0f} {100 * r['tg_fraction']:5.0f}% "
              f"{r['b16_ms'] * 1e3:9.1f} {r['pp_tflops']:10.1f} {torch_pp} {r['host_us']:8.1f}  {how}", flush=True)
        if "sweep_tg_ms" in r:
            timed = {g: v for g, v in r["sweep_tg_ms"].items() if isinstance(v, float)}
            cells = "  ".join(f"{g} {r['weight_mb'] / v:.0f}" for g, v in timed.items())
            print(f"{'':8} sweep, 1 token, GB/s: {cells}", flush=True)
        rows.append(r)
    print(json.dumps({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                      "bandwidth_gbs": bw / 1e9, "shape": [n, k], "prompt": args.prompt, "cublas_f16": peer,
                      "rows": rows}))


if __name__ == "__main__":
    main()
