"""Benchmark: the 671B DeepSeek-V3 quantize, simulated by streaming (issue 28, target 5).

Nothing is stored: the input is a model object with the GGUF reader's interface (a ``ModelView``
whose tensors' ``source.read`` makes the requested rows on the fly), with DeepSeek-V3's full tensor
table and shapes (tests/models.py ``deepseek_v3_tensors``: 61 layers, 3 dense, 256 routed experts
of 7168x2048, BF16).  Rows are windows of one fixed pseudo-random N(0, 0.02) BF16 pattern at a
row-dependent place (a memcpy per row: making rows costs far less than quantizing them, and no
row is all zeros, which some quantizers would shortcut, as a sparse file's holes would be).

It goes through the user's pipeline: ``api.open_quantization`` (plan, the seeds' IQ2_K_R4 recipe
recipes/deepseek-v3-iq2_k_r4.txt with --token-embedding-type/--output-tensor-type q8_0 and an
importance matrix) then ``write`` (quantize, write), each run in a child process so that wall time
and peak RSS are measured from outside (os.wait4).  The importance matrix is a synthetic legacy
.dat file with an entry per selected tensor.

A 671B run cannot be done here (226 GiB out, 2 cores), so the script

1. plans the full model and counts weights per tensor kind (what the full run would do);
2. quantizes a chosen set of layers (``--layers``, with ``--experts`` routed experts each: 256 is
   the real size) at each of ``--threads`` and reports weights/s per tensor kind;
3. reports peak RSS per run (``--rss-layers`` runs the same thing over more layers: peak RSS must
   not grow with them);
4. extrapolates the full run's time on N cores from each kind's measured 1-thread rate and the
   serial fraction that the 1- and 2-thread runs imply (Amdahl), and prints a table plus JSON.

    python bench/deepseek671.py                          # a few minutes: 4 experts, layer 3, 1 and 2 threads
    python bench/deepseek671.py --experts 256 --layers 3 --only ffn_gate_exps --threads 2   # one full
                                                         # routed-expert tensor: 3.8 G weights, 7.5 GB BF16 in
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

RECIPE = REPO / "recipes" / "deepseek-v3-iq2_k_r4.txt"
N_LAYER = 61
PATTERN_LEN = 1 << 20           # values in the shared pattern (rows are windows of it)
SCALE = 0.02


# ---------------------------------------------------------------- the model source
def _pattern(n_per_row_max: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared pattern as BF16 bits and as float32 (row windows are slices of them)."""
    rng = np.random.default_rng(671)
    x = (rng.standard_normal(PATTERN_LEN + n_per_row_max) * SCALE).astype(np.float32)
    bits = x.view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)     # round to nearest even
    return bf16, x


class MadeRows:
    """Byte ranges of one tensor whose rows are made on read: row ``r`` is the pattern's window
    starting at a place derived from the tensor's name and ``r`` (deterministic, reads of the
    same range give the same bytes).  The interface of ``GGUFFile.read``/``view``."""

    read_ahead = True       # numpy copies only: quantize reads the next chunk beside the quantizer

    def __init__(self, name: str, qtype, n_per_row: int, pattern):
        from quantkit.types import QuantType, traits
        self.name, self.n_per_row = name, n_per_row
        self.pattern = pattern[0] if qtype == QuantType.BF16 else pattern[1]
        self.row_size = traits(qtype).row_size(n_per_row)
        self.seed = zlib.crc32(name.encode())
        self.path = Path(f"<made:{name}>")

    def _rows_into(self, first: int, out: np.ndarray) -> None:
        p, n = self.pattern, self.n_per_row
        for i in range(out.shape[0]):
            start = (self.seed + (first + i) * 7919) % PATTERN_LEN
            out[i] = p[start:start + n]

    def read(self, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8) if out is None else out.reshape(-1)[:nbytes]
        first, last = offset // self.row_size, -(-(offset + nbytes) // self.row_size)
        if offset % self.row_size == 0 and nbytes % self.row_size == 0:      # the quantize path: rows in place
            self._rows_into(first, buf.view(self.pattern.dtype).reshape(-1, self.n_per_row))
            return buf
        rows = np.empty((last - first, self.n_per_row), self.pattern.dtype)
        self._rows_into(first, rows)
        skip = offset - first * self.row_size
        buf[:] = rows.view(np.uint8).reshape(-1)[skip:skip + nbytes]
        return buf

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.read(offset, nbytes)


def made_model(n_expert: int = 256, keep=lambda name: True):
    """DeepSeek-V3 (671B) as a ``ModelView`` whose rows are made on read: the full tensor table
    with ``n_expert`` routed experts per layer, only the tensors ``keep(name)`` accepts."""
    from models import deepseek_v3_tensors
    from quantkit.gguf_io.constants import MetaValue, ValueType
    from quantkit.gguf_io.reader import ModelView, TensorInfo
    from quantkit.types import QuantType, tensor_nbytes

    table = [t for t in deepseek_v3_tensors(n_expert=n_expert) if keep(t[0])]
    pattern = _pattern(max(s[0] for _, s, _ in table))
    u32 = lambda v: MetaValue(ValueType.UINT32, v)      # noqa: E731
    meta = {"general.architecture": MetaValue(ValueType.STRING, "deepseek2"),
            "general.name": MetaValue(ValueType.STRING, "DeepSeek-V3 (made on read)"),
            "deepseek2.block_count": u32(N_LAYER), "deepseek2.expert_count": u32(n_expert),
            "deepseek2.expert_used_count": u32(8), "deepseek2.embedding_length": u32(7168),
            "deepseek2.attention.head_count": u32(128), "deepseek2.attention.head_count_kv": u32(128),
            "deepseek2.leading_dense_block_count": u32(3), "deepseek2.vocab_size": u32(129280)}

    class Made(ModelView):
        def __init__(self):
            self.path = Path("<deepseek-v3 made on read>")
            self.metadata = meta
            self.tensors = []
            for name, shape, type_id in table:
                qtype = QuantType(type_id)
                self.tensors.append(TensorInfo(name, tuple(shape), qtype, 0, tensor_nbytes(qtype, shape),
                                               MadeRows(name, qtype, shape[0], pattern)))
            self.by_name = {t.name: t for t in self.tensors}

        def close(self):
            pass

    return Made()


def kind_of(name: str) -> str:
    """The tensor kinds the report groups by."""
    m = re.search(r"ffn_(gate|up|down)_exps", name)
    if m:
        return "exps_down" if m[1] == "down" else "exps_gate_up"
    if "_shexp" in name:
        return "shexp"
    if re.search(r"ffn_(gate|up|down)\.weight", name):
        return "dense_ffn"
    if ".attn_" in name and name.endswith(".weight") and "norm" not in name:
        return "attn"
    if name in ("token_embd.weight", "output.weight"):
        return "embd_output"
    return "small"          # norms, router, bias


def write_imatrix(path: Path, n_expert: int) -> Path:
    """A legacy .dat imatrix for the whole model (every layer, whatever the run quantizes: a real
    run loads all of it, ~1 GB at 256 experts), a positive weight per column of every matrix."""
    from quantkit.imatrix import save_dat
    model = made_model(n_expert)
    rng = np.random.default_rng(28)
    weights = {}
    for t in model.tensors:
        if len(t.shape) >= 2 and t.name != "token_embd.weight":
            n_mat = t.shape[2] if len(t.shape) == 3 else 1
            weights[t.name] = rng.random(t.shape[0] * n_mat, dtype=np.float32) + 0.05
    return save_dat(path, weights, 1, chunk_count=1, dataset="made")


def quantization_options(imatrix: Path | None, threads: int | None) -> dict:
    opts = dict(custom_q=[str(RECIPE)], token_embedding_type="q8_0", output_tensor_type="q8_0", threads=threads)
    if imatrix is not None:
        opts["imatrix"] = str(imatrix)
    return opts


# ---------------------------------------------------------------- child: one run
def child(args) -> None:
    from quantkit import api, formats, quantize
    layers = {int(x) for x in args.layers.split(",")} if args.layers else set()
    only = re.compile(args.only) if args.only else None

    def keep(name: str) -> bool:
        m = re.match(r"blk\.(\d+)\.", name)
        if m is None:
            return args.ends
        return int(m[1]) in layers and (only is None or only.search(name) is not None)

    model = made_model(args.experts, keep)
    imatrix = Path(args.imatrix)
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        # time in the quantizer and the steps around it that run on all threads (decoding the
        # input, its extent, checking the output), against the whole run: the rest (making rows,
        # Python per chunk) runs on one thread, the serial part of the run
        kernel = [0.0]

        def timed(fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    kernel[0] += time.perf_counter() - t0
            return run

        formats.quantize = timed(formats.quantize)
        formats.dequantize = timed(formats.dequantize)
        formats.find_non_finite = timed(formats.find_non_finite)
        quantize.row_extent = timed(quantize.row_extent)
        real_warm_up = quantize.warm_up_plan

        def warm_up_untimed(*a, **k):       # its kernel calls are compile time, not the run's
            log = real_warm_up(*a, **k)
            kernel[0] = 0.0
            return log

        quantize.warm_up_plan = warm_up_untimed
        with api.open_quantization(model, Path(d) / "out.gguf", "IQ2_K_R4",
                                   **quantization_options(imatrix, int(args.threads))) as q:
            q.check()
            kinds = {tp.name: kind_of(tp.name) for tp in q.plan.tensors}
            types = {tp.name: tp.dst_type.name.lower() for tp in q.plan.tensors}
            n_el = {tp.name: tp.n_elements for tp in q.plan.tensors}
            cpu, last = {}, [resource.getrusage(resource.RUSAGE_SELF)]

            def on_tensor(name, done, total):       # CPU seconds of every thread per tensor
                now = resource.getrusage(resource.RUSAGE_SELF)
                cpu[name] = now.ru_utime + now.ru_stime - last[0].ru_utime - last[0].ru_stime
                last[0] = now

            result = q.write(progress=on_tensor)
        out_bytes = result.bytes_written
    per_kind: dict[str, dict] = {}
    for name, sec in result.tensor_seconds.items():
        k = per_kind.setdefault(kinds[name], {"tensors": 0, "weights": 0, "seconds": 0.0, "cpu_seconds": 0.0,
                                              "types": set()})
        k["tensors"] += 1
        k["weights"] += n_el[name]
        k["seconds"] += sec
        k["cpu_seconds"] += cpu.get(name, 0.0)
        k["types"].add(types[name])
    print(json.dumps({"seconds": result.seconds, "compile_seconds": result.compile_seconds,
                      "kernel_seconds": kernel[0], "weights": result.n_weights, "bytes_out": out_bytes,
                      "per_kind": {k: {**v, "types": sorted(v["types"])} for k, v in per_kind.items()}}))


def run_child(argv: list[str]) -> dict:
    """One child run: its JSON line plus wall seconds and peak RSS."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, __file__, "--child", *argv], stdout=subprocess.PIPE, stderr=err,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            raise SystemExit(f"child failed ({p.returncode}): {' '.join(argv)}\n"
                             f"{err.read().decode(errors='replace')[-3000:]}")
    doc = json.loads(out.decode().strip().splitlines()[-1])
    doc["wall_seconds"] = time.perf_counter() - t0
    doc["peak_rss_bytes"] = usage.ru_maxrss * 1024
    doc["cpu_seconds"] = usage.ru_utime + usage.ru_stime      # the whole child, start-up included
    return doc


# ---------------------------------------------------------------- the full plan
def full_plan() -> dict:
    """The full 671B plan: weights, bytes in and out per kind and the types each kind gets."""
    from quantkit import api
    model = made_model(256)
    with api.open_quantization(model, None, "IQ2_K_R4", **quantization_options(None, None)) as q:
        plan = q.plan
        kinds: dict[str, dict] = {}
        for tp in plan.tensors:
            k = kinds.setdefault(kind_of(tp.name), {"tensors": 0, "weights": 0, "bytes_in": 0, "types": set()})
            k["tensors"] += 1
            k["weights"] += tp.n_elements
            k["bytes_in"] += tp.nbytes_in
            k["types"].add(tp.dst_type.name.lower())
        return {"bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
                "kinds": {k: {**v, "types": sorted(v["types"])} for k, v in kinds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ends", action="store_true", help="with the layers, token_embd/output/output_norm too")
    ap.add_argument("--layers", default="3", help="layers quantized (comma list; 0-2 dense, 3-60 MoE)")
    ap.add_argument("--experts", type=int, default=4, help="routed experts per layer (256: full size)")
    ap.add_argument("--only", default=None, help="only the selected layers' tensors matching this regex")
    ap.add_argument("--threads", default="1,2", help="thread counts to run (comma list)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per thread count (best of)")
    ap.add_argument("--rss-layers", default="3,4",
                    help="a second run over these layers (at the largest thread count): peak RSS must stay flat")
    ap.add_argument("--cores", default="16,32,64,128", help="core counts the full run is extrapolated to")
    ap.add_argument("--workdir", default=None, help="where the output is written (removed after)")
    ap.add_argument("--json", default=None, help="also write the JSON report here")
    ap.add_argument("--imatrix", default=None, help=argparse.SUPPRESS)     # the child's, made by the parent
    args = ap.parse_args()
    if args.child:
        return child(args)
    threads_list = [int(t) for t in args.threads.split(",")]
    work = tempfile.TemporaryDirectory(dir=args.workdir)
    imatrix = write_imatrix(Path(work.name) / "made.imatrix", args.experts)

    def argv(layers, threads):
        a = ["--layers", layers, "--experts", str(args.experts), "--threads", str(threads), "--imatrix", str(imatrix)]
        a += ["--only", args.only] if args.only else []
        a += ["--workdir", args.workdir] if args.workdir else []
        return a + (["--ends"] if args.ends else [])

    plan = full_plan()
    runs = {}
    for th in threads_list:
        best = None
        for _ in range(args.repeat):
            r = run_child(argv(args.layers, th))
            print(f"  layers {args.layers}, {args.experts} experts, {th} thread(s): {r['seconds']:.1f} s, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
            if best is None or r["seconds"] < best["seconds"]:
                best = r
        runs[th] = best
    rss_run = None
    if args.rss_layers and args.rss_layers != args.layers:
        rss_run = run_child(argv(args.rss_layers, max(threads_list)))

    work.cleanup()

    # per kind: weights/s at each thread count, the serial fraction two counts imply, the full run
    kinds = sorted({k for r in runs.values() for k in r["per_kind"]})
    rate = {th: {k: r["per_kind"][k]["weights"] / r["per_kind"][k]["seconds"]
                 for k in kinds if r["per_kind"].get(k, {}).get("seconds")} for th, r in runs.items()}
    # weights per CPU second (all the child's threads) at the fewest threads: what an idle core
    # gives, whatever else runs on the machine (wall-clock rates are the machine's share)
    lo, hi = min(threads_list), max(threads_list)
    cpu_rate = {k: v["weights"] / v["cpu_seconds"] for k, v in runs[lo]["per_kind"].items() if v["cpu_seconds"] > 0}
    serial = {}
    for k in kinds:
        if hi > lo and k in rate[lo] and k in rate[hi]:
            ratio = rate[lo][k] / rate[hi][k]           # t_hi / t_lo
            # t(n) = t1 * (s + (1 - s) / n): from two counts, s = (ratio - lo/hi) / (1 - lo/hi) for lo = 1
            s = (ratio * (1 / lo) - 1 / hi) / (1 - 1 / hi) if lo == 1 else None
            serial[k] = None if s is None else min(1.0, max(0.0, s))
    # the serial part of the run as the 1-thread run shows it: everything outside the parallel
    # kernels (an upper bound: some of it overlaps them), whatever the machine's load
    s_1 = 1 - runs[lo]["kernel_seconds"] / runs[lo]["seconds"]
    cores = [int(c) for c in args.cores.split(",")]
    full, ideal, outside, unmeasured = {}, {}, {}, set()
    for n in cores:
        total = total_ideal = total_outside = 0.0
        for k, v in plan["kinds"].items():
            # a kind the run did not quantize (the ends, dense layers) at the rate of a measured kind
            # of the same types (q8_0 from BF16: shexp's); none: left out, and said so
            like = k if k in rate.get(lo, {}) else next(
                (o for o in rate.get(lo, {}) if plan["kinds"][o]["types"] == v["types"]), None)
            if like is None:
                unmeasured.add(k)
                continue
            r1 = rate.get(lo, {}).get(like)
            c1 = cpu_rate.get(like) if lo == 1 else None
            if r1 is None:
                continue
            s = serial.get(like) if serial.get(like) is not None else 0.0
            total += v["weights"] / r1 * lo * (s + (1 - s) / n)
            one_core = v["weights"] / (c1 or r1 / lo)
            if k == "small":        # norms, router, biases: a fixed cost per tensor, not per weight
                measured = runs[lo]["per_kind"][k]
                one_core = v["tensors"] * (measured["cpu_seconds"] or measured["seconds"] * lo) / measured["tensors"]
            total_ideal += one_core / n
            total_outside += one_core * (s_1 + (1 - s_1) / n)
        full[n], ideal[n], outside[n] = total, total_ideal, total_outside

    # table
    print(f"\nDeepSeek-V3 671B, IQ2_K_R4 recipe: {plan['bytes_in'] / 2**30:.1f} GiB in, "
          f"{plan['bytes_out'] / 2**30:.1f} GiB out")
    print(f"{'kind':<14}{'types':<22}{'weights (full)':>16}" + "".join(f"{f'Mw/s @{t}':>12}" for t in threads_list)
          + f"{'serial':>9}{f'Mw/CPU-s @{lo}':>15}")
    for k in sorted(plan["kinds"]):
        v = plan["kinds"][k]
        cols = "".join(f"{rate[t][k] / 1e6:>12.2f}" if k in rate[t] else f"{'-':>12}" for t in threads_list)
        s = serial.get(k)
        c = f"{cpu_rate[k] / 1e6:>15.2f}" if k in cpu_rate else f"{'-':>15}"
        print(f"{k:<14}{','.join(v['types']):<22}{v['weights'] / 1e9:>14.2f} G{cols}{'' if s is None else f'{s:>9.2f}':>9}{c}")
    for th, r in runs.items():
        print(f"run @{th} thread(s): {r['weights'] / 1e6:.1f} M weights in {r['seconds']:.1f} s "
              f"(kernels {r['kernel_seconds'] / r['seconds']:.0%} of it; the child used {r['cpu_seconds']:.0f} CPU s "
              f"in {r['wall_seconds']:.0f} s), peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    if rss_run:
        print(f"layers {args.rss_layers} @{max(threads_list)}: peak RSS {rss_run['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"(layers {args.layers}: {runs[max(threads_list)]['peak_rss_bytes'] / 2**30:.2f} GiB)")
    print(f"full run on one core: {ideal[cores[0]] * cores[0] / 3600:.1f} h; on N cores (h):")
    print(f"{'cores':<40}" + "".join(f"{n:>8}" for n in cores))
    print(f"{'linear (CPU-s rates @1)':<40}" + "".join(f"{ideal[n] / 3600:>8.2f}" for n in cores))
    print(f"{f'serial = outside kernels @1 ({s_1:.1%})':<40}" + "".join(f"{outside[n] / 3600:>8.2f}" for n in cores))
    if hi > lo:
        print(f"{f'Amdahl from @{lo}/@{hi} per kind':<40}" + "".join(f"{full[n] / 3600:>8.2f}" for n in cores))
    if unmeasured:
        print(f"note: left out of the full run's time (no kind of their types was run): {', '.join(sorted(unmeasured))}")
    load = os.getloadavg()[0]
    if load > 1.5 * (os.cpu_count() or 1) or any(v is not None and v > 0.5 for v in serial.values()):
        print(f"note: load average {load:.1f} on {os.cpu_count()} cores: the thread scaling measured here is "
              "the machine's share, not quantkit's; rerun on an idle machine")
    report = {"plan": plan, "layers": args.layers, "experts": args.experts, "only": args.only,
              "runs": {str(k): v for k, v in runs.items()}, "rss_run": rss_run,
              "rates": {str(t): v for t, v in rate.items()}, "cpu_rates": cpu_rate, "serial_fraction": serial,
              "serial_outside_kernels_1": s_1, "load_average": os.getloadavg(),
              "full_run_seconds": {"linear": ideal, "outside_kernels": outside, "amdahl": full}}
    print(json.dumps(report, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
