"""Static check of the fused Triton kernels (quantkit/runtime/triton_qmm) where there is no GPU: compile
each type's kernels for an NVIDIA target (Triton's own ptxas; no device, no driver) and report the
registers per thread and the bytes spilled to the stack, from the cubin's resource usage.

The interpreter tests (tests/test_triton_qmm*.py) check the numbers but run none of Triton's
compiler; this catches what only compiling finds (a construct the interpreter accepts and the
compiler does not), and the register pressure that decides a kernel's occupancy: a generation
kernel (qmv, memory-bound) that spills or needs 255 registers a thread keeps few warps in flight
and cannot reach the memory bandwidth.  Compare --bn (rows per tile) and --warps settings side by
side; the kernels' own launch settings are in triton_qmm/__init__.py.  A table, then one JSON line.

    python bench/triton_compile.py [--kernels qmv,qmm,decode] [--types q4_K,iq4_k] [--bn 16,8]
                                   [--warps 4] [--arch 90]

Each (type, kernel, bn, warps) compiles in a few seconds (qmm, the tl.dot kernel: up to ~20 s), once:
Triton keeps the result in its cache (~/.triton/cache); the defaults (every type with a decoder, qmv,
BN 16 and 8) take a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# the tensors' argument types of each kernel (template.py), in order; the rest are constexprs
SIGNATURES = {
    "decode": dict(w_ptr="*u8", out_ptr="*fp32", t0_ptr="*fp32", t1_ptr="*fp32", N="i32", row_bytes="i32",
                   n_per_row="i32"),
    "qmv": dict(x_ptr="*fp32", w_ptr="*u8", out_ptr="*fp32", t0_ptr="*fp32", t1_ptr="*fp32", N="i32", K="i32",
                row_bytes="i32", stride_xm="i32", stride_om="i32"),
    "qmm": dict(x_ptr="*fp32", w_ptr="*u8", out_ptr="*fp32", t0_ptr="*fp32", t1_ptr="*fp32", M="i32", N="i32",
                K="i32", row_bytes="i32", stride_xm="i32", stride_om="i32"),
}
KERNELS = {"decode": "decode_kernel", "qmv": "qmv_kernel", "qmm": "qmm_kernel"}


def compile_one(kernel_name: str, dec, bn: int, warps: int, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantkit.runtime.triton_qmm import template
    kernel = getattr(template, KERNELS[kernel_name])
    consts = dict(DECODE=dec.fn, QK=dec.block_values, BLOCK_BYTES=dec.block_bytes, META=dec.row_meta_bytes, BN=bn)
    if kernel_name == "qmm":
        consts["BM"] = 16
    sig = {**SIGNATURES[kernel_name], **{n: "constexpr" for n in consts}}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return dict(registers=int(m.group(1)), stack_bytes=int(m.group(2)), ptx_lines=ck.asm["ptx"].count("\n"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="qmv", help="decode,qmv,qmm")
    ap.add_argument("--types", help="comma-separated type names (default: every type with a Triton decoder)")
    ap.add_argument("--bn", default="16,8", help="rows per tile, comma-separated")
    ap.add_argument("--warps", default="4", help="warps per program, comma-separated")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)          # compile, do not interpret
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    from quantkit.runtime.triton_qmm.decoders import DECODERS
    from quantkit.types import type_name
    wanted = None if not args.types else {t.strip().lower() for t in args.types.split(",")}
    types = [q for q in DECODERS if wanted is None or type_name(q).lower() in wanted]
    if wanted is not None and len(types) != len(wanted):
        sys.exit(f"no Triton decoder for: {', '.join(sorted(wanted - {type_name(q).lower() for q in types}))}")
    rows = []
    print(f"{'type':8} {'kernel':6} {'BN':>3} {'warps':>5} {'regs':>5} {'spill B':>7} {'PTX lines':>9}")
    for q in types:
        for kernel_name in args.kernels.split(","):
            for bn in (int(v) for v in args.bn.split(",")):
                for warps in (int(v) for v in args.warps.split(",")):
                    r = dict(type=type_name(q), kernel=kernel_name, bn=bn, warps=warps,
                             **compile_one(kernel_name, DECODERS[q], bn, warps, args.arch))
                    rows.append(r)
                    print(f"{r['type']:8} {kernel_name:6} {bn:3} {warps:5} {r['registers']:5} {r['stack_bytes']:7} "
                          f"{r['ptx_lines']:9}", flush=True)
    print(json.dumps({"arch": args.arch, "results": rows}))


if __name__ == "__main__":
    main()
