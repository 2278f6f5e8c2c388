"""Compile the fused Triton kernels (quantkit/runtime/triton_qmm) for a GPU without one: per type
and kernel, the registers, spills and shared memory ptxas reports for the launch geometry
qmatmul uses (triton_qmm.tiles).  This checks that the CUDA path builds on a machine with no GPU
(Triton's own ptxas, an sm_90 / H100 target by default) and what the tile sizes cost; speed needs a
GPU (bench/gpu.py).

    python bench/triton_compile.py [--types q8_0,q4_K] [--arch 90] [--tokens 16]

A table, then one JSON line.  Types: every one with a decoder by default.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)              # compile, not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def ptxas_stats(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and stack of a PTX kernel, from ``ptxas -v`` (the newest ptxas Triton
    ships: its PTX version may be newer than the older one's)."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            r = subprocess.run([str(bin_dir / name), "-v", f"-arch=sm_{arch}a", str(src), "-o", str(Path(d) / "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
        else:
            raise SystemExit(f"ptxas failed: {r.stderr[-2000:]}")
    text = r.stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0      # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated (default: every type with a decoder)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    ap.add_argument("--tokens", type=int, default=16, help="batch size whose tl.dot geometry is compiled (at most FUSED_BATCH)")
    args = ap.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantkit.runtime.triton_qmm import FEW_TOKENS, FUSED_BATCH, template, tiles
    from quantkit.runtime.triton_qmm.registry import DECODERS
    from quantkit.types import QuantType, type_name
    types = [QuantType[t.upper()] for t in args.types.split(",")] if args.types else list(DECODERS)
    target = GPUTarget("cuda", args.arch, 32)
    common = {"x_ptr": "*fp32", "w_ptr": "*u8", "out_ptr": "*fp32", "t0_ptr": "*fp32", "t1_ptr": "*fp32",
              "M": "i32", "N": "i32", "K": "i32", "row_bytes": "i32", "stride_xm": "i32", "stride_om": "i32"}
    rows = []
    print(f"sm_{args.arch}, triton {triton.__version__}; tl.dot kernel for {args.tokens} tokens")
    print(f"{'type':8} {'kernel':10} {'tile':22} {'warps':>5} {'regs':>5} {'spill B':>8} {'shared B':>9} {'compile s':>9}")
    for qtype in types:
        dec = DECODERS[qtype]
        geometry = dict(DECODE=dec.fn, QK=dec.block_values, BLOCK_BYTES=dec.block_bytes, META=dec.row_meta_bytes)
        for kern, m in ((template.qmv_kernel, 1), (template.qmm_kernel, min(max(args.tokens, FEW_TOKENS + 1), FUSED_BATCH))):
            tile = tiles(dec.block_values, m)
            warps = tile.pop("num_warps")
            sig = {a: common.get(a, "constexpr") for a in kern.arg_names}
            t = time.perf_counter()
            k = triton.compile(ASTSource(kern, sig, {**geometry, **tile}), target=target,
                               options={"num_warps": warps, "enable_fp_fusion": True})
            took = time.perf_counter() - t
            st = ptxas_stats(k.asm["ptx"], args.arch)
            row = {"type": type_name(qtype), "kernel": kern.fn.__name__, **tile, "num_warps": warps,
                   "shared": k.metadata.shared, "compile_s": round(took, 2), **st}
            rows.append(row)
            print(f"{row['type']:8} {row['kernel']:10} {str(tile):22} {warps:5} {st['registers']:5} "
                  f"{st['spill_stores']:8} {row['shared']:9} {took:9.1f}")
    print(json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
