"""The kernels on any x86 (quantkit.cpu): what numba compiles for decides which instructions the
LLVM-IR kernels emit, and the plain path, for a CPU without SSSE3, AVX2, F16C or FMA, gives the
fast path's results.

numba compiles for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES where they are set; ``generic`` is x86-64's
baseline (SSE2), the lowest target there is: there the byte products are plain vector IR instead
of pshufb / pmaddubsw / pmaddwd / psignb, and float16 is widened in integer steps instead of
vcvtph2ps (before quantkit.cpu: SIGABRT "Cannot select" or "Symbol not found: __extendhfsf2").

CI's CPU runs that path in a subprocess with NUMBA_CPU_NAME=generic and a numba cache of its own
(numba keys cached kernels by target, but the two builds would share index files), on the fast
path's own references:
  * the fused products of every kernel (one type each, and an interleaved type), as
    test_runtime_matvec checks them: decoded rows times the rounded activations; the matrices are
    quantized here, on the host, so that the child compiles no quantizer;
  * the attention of a few tokens against the batched path (test_runtime_matvec);
  * a generation step in one call (layer_steps.py on team.py's threads: atomics, pause, yield)
    against the layer loop, bit for bit (test_layer_steps, on a float32 model);
  * the trellis quantizers against ik's bytes, byte-exact (test_formats_kt);
  * the float16 widening of all 65536 halves (here, on both targets);
  * ``quantkit run`` of a tiny model: exit 0 and the same greedy tokens as on the host (the plain
    path computes the same bits: exact integer products, the same float operations in the same
    order, multiply-adds fused on both: llvm.fma, libm's fmaf on the generic target).
Compiling those kernels for the generic target is most of the child's time: 90-110 s on 2 busy
cores, and 7-9 s for the run.  The tiers between (SSSE3 on 128-bit halves, plain IR without SSE2)
are compiled in-process for a few chunk dots (test_byte_products_of_every_instruction_tier).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir
from numba import njit
from numba.core import types as nbt
from numba.extending import intrinsic

import quantkit
from hostile import run_cli
from models import write_llama
from quantkit import cpu
from quantkit.runtime import dot, group_dot, kernels, matvec
from quantkit.types import QuantType, type_name
from test_runtime_matvec import (FUSED, STEP_TYPES, _chunks, check_batch_product, check_chunk, check_fused_product,
                                 check_step_product, product_cases, rows_of)

REPO = Path(__file__).resolve().parent.parent
ROWS = "QUANTKIT_TEST_GENERIC_ROWS"             # the child's matrices (.npz), quantized by the parent
IN_CHILD = ROWS in os.environ
FEATURES = ("sse2", "ssse3", "avx2", "f16c", "fma", "avx512", "avx512bw", "vnni", "gfni")
# one type per fused kernel whose type quantkit writes (code_dots' types once their formats are
# registered), and an interleaved one (regrouped into plain rows first)
KERNEL_TYPES = [*(q for q in matvec.KIND if q in FUSED), QuantType.IQ4_K_R4]
# the fast path's checks, run again on the generic target
CHILD_CHECKS = [
    "tests/test_generic_cpu.py::test_the_child_compiles_for_the_generic_cpu",
    "tests/test_generic_cpu.py::test_half_widening_is_exact_for_every_half",
    "tests/test_generic_cpu.py::test_fused_products_of_every_kernel",
    "tests/test_generic_cpu.py::test_batch_products_token_for_token",
    "tests/test_generic_cpu.py::test_interleaved_step_products",
    "tests/test_runtime_matvec.py::test_attention_of_a_batch_is_its_steps_and_ggmls_numbers",
    "tests/test_runtime_matvec.py::test_latent_attention_reads_the_value_view",
    "tests/test_layer_steps.py::test_a_step_in_one_call_equals_the_layer_loop[f32]",
    "tests/test_formats_kt.py::test_golden",
    "tests/test_formats_kt.py::test_fma32_is_exact",
    "tests/test_formats_kt.py::test_search_breaks_ties_as_ik",
]
# the child takes 90-110 s on 2 busy cores (numba compiling for the generic target)
CHILD_TIMEOUT_S = 900
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in test_generic_cpu_target's subprocess")


def _on(t: cpu.Target) -> set[str]:
    return {f for f in FEATURES if getattr(t, f)}


@pytest.mark.skipif(not cpu.target().x86, reason="x86 CPU models")
@pytest.mark.parametrize("name,features,want", [
    ("generic", "", {"sse2"}),
    ("x86-64", "", {"sse2"}),
    ("nehalem", "", {"sse2", "ssse3"}),
    ("sandybridge", "", {"sse2", "ssse3"}),                 # AVX, but neither AVX2 nor F16C
    ("haswell", "", {"sse2", "ssse3", "avx2", "f16c", "fma"}),
    ("skylake-avx512", "", {"sse2", "ssse3", "avx2", "f16c", "fma", "avx512", "avx512bw"}),
    ("icelake-server", "", {"sse2", "ssse3", "avx2", "f16c", "fma", "avx512", "avx512bw", "vnni", "gfni"}),
    ("alderlake", "", {"sse2", "ssse3", "avx2", "f16c", "fma", "vnni", "gfni"}),        # AVX-VNNI, no AVX-512
    ("znver4", "-avx512vnni", {"sse2", "ssse3", "avx2", "f16c", "fma", "avx512", "avx512bw", "gfni"}),
    ("x86-64", "+avx2,-f16c", {"sse2", "ssse3", "avx2"}),   # explicit features over the model's
    ("haswell", "-avx", {"sse2", "ssse3"}),                 # and what they imply (-avx: no AVX2)
])
def test_features_are_what_llvm_selects_for_the_cpu(name, features, want):
    assert _on(cpu._features(cpu.target().triple, name, features)) == want


@child_only
def test_the_child_compiles_for_the_generic_cpu():
    """quantkit.cpu reads numba's target (NUMBA_CPU_NAME here), not the host's CPU."""
    t = cpu.target()
    assert t.cpu == "generic"
    assert not (t.ssse3 or t.avx2 or dot._AVX2 or dot._SSSE3 or dot._VNNI or dot._AVX512BW or dot._GFNI)
    if t.x86:
        assert _on(t) == {"sse2"}


@njit(cache=True)
def _widen_scalars(bits, out):
    for i in range(bits.shape[0]):
        out[i] = dot.half_bits(bits[i])


@njit(cache=True)
def _widen_rows(bits, out):
    """out[i] = +0 + 1 * half(bits[i, 0, :]): the attention's value sums (kernels._value_rows: its
    32-wide, 8-wide and one-value steps) over the single key row i with probability 1."""
    one = np.ones((1, 1), np.float32)
    for i in range(bits.shape[0]):
        kernels._value_rows(bits[i:i + 1], 0, one, 1, out[i:i + 1], 0, 1)


def _every_half():
    """All 65536 float16 bit patterns, and the float32 bits they widen to: numpy's, except that a
    signalling NaN comes out quiet (bit 22 set), as x86's vcvtph2ps makes it."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    return bits, np.where(np.isnan(bits.view(np.float16)), want | np.uint32(1 << 22), want)


@intrinsic
def _integer_widen8(typingctx, bits, i, out):
    """out[i:i + 8] = bits[i:i + 8] widened by quantkit.cpu's integer path, the one a target
    without F16C compiles (bits uint16, out float32)."""
    def codegen(context, builder, sig, args):
        bits_v, i_v, out_v = args
        src = context.make_array(sig.args[0])(context, builder, bits_v).data
        dst = context.make_array(sig.args[2])(context, builder, out_v).data
        v8, f8 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.FloatType(), 8)
        vec = builder.load(builder.bitcast(builder.gep(src, [i_v]), v8.as_pointer()), align=2)
        builder.store(cpu.half_to_float(builder, vec, hardware=False),
                      builder.bitcast(builder.gep(dst, [i_v]), f8.as_pointer()), align=4)
        return context.get_dummy_value()
    return nbt.none(bits, i, out), codegen


@intrinsic
def _integer_widen1(typingctx, u):
    """The uint16 u widened by the integer path, as a scalar."""
    def codegen(context, builder, sig, args):
        return cpu.half_to_float(builder, builder.trunc(args[0], ir.IntType(16)) if u.bitwidth > 16 else args[0],
                                 hardware=False)
    return nbt.float32(u), codegen


@njit(cache=True)
def _widen_integer_path(bits, vectors, scalars):
    for i in range(0, bits.shape[0], 8):
        _integer_widen8(bits, i, vectors)
    for i in range(bits.shape[0]):
        scalars[i] = _integer_widen1(bits[i])


def test_integer_half_widening_is_exact():
    """The widening a target without F16C compiles, checked here on any CPU: every half, in
    vectors of 8 and as scalars, to the hardware's float32 bits."""
    bits, want = _every_half()
    vectors, scalars = np.empty(bits.shape, np.float32), np.empty(bits.shape, np.float32)
    _widen_integer_path(bits, vectors, scalars)
    np.testing.assert_array_equal(vectors.view(np.uint32), want)
    np.testing.assert_array_equal(scalars.view(np.uint32), want)


def test_half_widening_is_exact_for_every_half():
    """The kernels' own widening (the target's path): all 65536 float16 bit patterns, in scalars
    and in vectors."""
    bits, want = _every_half()
    scalars = np.empty(bits.shape, np.float32)
    _widen_scalars(bits, scalars)
    np.testing.assert_array_equal(scalars.view(np.uint32), want)
    width = 41                                      # one 32-wide step, one 8-wide, one value
    n_rows = -(-bits.size // width)
    rows = np.zeros(n_rows * width, np.uint16)
    rows[:bits.size] = bits
    out = np.empty((n_rows, width), np.float32)
    _widen_rows(rows.reshape(n_rows, 1, width), out)
    # sums start from +0, and +0 + -0.0 is +0; every other value v gives v's bits
    np.testing.assert_array_equal(out.reshape(-1)[:bits.size].view(np.uint32),
                                  np.where(want == np.uint32(0x80000000), np.uint32(0), want))


# chunks that take every path of the byte products: a legacy block's 32-lane grid lookup and folded
# bias (IQ4_NL), a word of high bits (Q5_0), signed codes in a legacy block (Q8_0), a paired grid
# lookup (IQ4_K), signed codes (Q6_K), a run's mins (Q2_K), a 64-entry grid (IQ6_K)
TIER_CHUNKS = ("iq4_nlx8", "q5_0x8", "q6_0x8", "q8_0x2", "iq4_k", "q5_K", "q6_K", "q2_K", "iq6_k")


def _tier(name):
    """A tier's instructions can only be compiled where numba's target has them (LLVM aborts)."""
    return pytest.param(name, marks=pytest.mark.skipif(not getattr(cpu.target(), name), reason=f"no {name} in the target"))


@pytest.mark.parametrize("tier", [_tier("avx2"), _tier("ssse3"), _tier("sse2"), "plain"])
def test_byte_products_of_every_instruction_tier(tier, monkeypatch):
    """The chunk dots built for the tiers below the target's, compiled and run here: AVX2 without
    VNNI or AVX-512BW (Haswell to Zen 3), SSSE3 (128-bit halves: Nehalem, Sandybridge), SSE2
    (x86-64's baseline: the generic target, also run whole in test_generic_cpu_target) and plain IR
    (no x86 instruction at all: other architectures), each against its numpy twin on random bytes,
    and bit for bit against the target's own chunk dot on the same bytes."""
    monkeypatch.setattr(dot, "_VNNI", False)
    monkeypatch.setattr(dot, "_AVX512BW", False)
    monkeypatch.setattr(dot, "_GFNI", False)
    monkeypatch.setattr(dot, "_AVX2", tier == "avx2")
    monkeypatch.setattr(dot, "_SSSE3", tier in ("avx2", "ssse3"))
    monkeypatch.setattr(dot, "_SSE2", tier in ("avx2", "ssse3", "sse2"))
    chunks = {name: (chunk, n_bytes, tab) for name, chunk, n_bytes, tab in _chunks()}
    for name in TIER_CHUNKS:
        chunk, n_bytes, tab = chunks[name]
        fresh = dot.chunk_dot(chunk.runs, table=chunk.table, sup=chunk.sup, e8m0=chunk.e8m0)   # the tier's IR
        got = check_chunk(name, fresh, n_bytes, tab)
        assert np.float32(got).view(np.uint32) == np.float32(check_chunk(name, chunk, n_bytes, tab)).view(np.uint32), name


def _key(qtype, n, seed) -> str:
    return f"{type_name(qtype)}-{n}-{seed}"


def _stored_rows():
    """``rows(qtype, n_rows, n, seed)``: the matrix the parent quantized (test_generic_cpu_target),
    as test_runtime_matvec.rows_of makes it, read from the parent's file instead of quantized here."""
    with np.load(os.environ[ROWS]) as stored:
        matrices = dict(stored)
    return lambda q, n_rows, n, seed: matrices[_key(q, n, seed)]


@child_only
def test_fused_products_of_every_kernel():
    rows = _stored_rows()
    for qtype in KERNEL_TYPES:
        check_fused_product(qtype, rows)


@child_only
def test_interleaved_step_products():
    """The group kernels of interleaved types (group_dot) the bits of the plain kernel, here too."""
    with np.load(os.environ[ROWS]) as stored:
        matrices = dict(stored)
    for qtype in STEP_TYPES:
        check_step_product(qtype, lambda q, n_rows, n, seed: matrices[_key(q, n, seed)])


# the group kernels' chunks checked per tier: (type, chunk factory, values: one chunk's)
GROUP_CHUNKS = ((QuantType.Q4_0_R8, lambda: group_dot.q4_0_r8_chunk(8), 256),
                (QuantType.Q4_0_R8, lambda: group_dot.q4_0_r8_chunk(2), 64),
                (QuantType.IQ2_K_R4, group_dot.iq2_k_r4_chunk_dot, 256))


@pytest.mark.parametrize("tier", [_tier("avx2"), _tier("ssse3"), _tier("sse2"), "plain"])
def test_group_products_of_every_instruction_tier(tier, monkeypatch):
    """The group kernels' chunks (group_dot: R interleaved rows at once) built for the tiers below
    the target's, compiled and run here, bit for bit the target's kernel on the same rows (which
    test_runtime_matvec holds to the plain kernel's bits): a product of one chunk's values is
    that chunk."""
    cases = []
    for qtype, make, n in GROUP_CHUNKS:          # the target's results first: compiled unpatched
        group = QuantType(qtype)
        blocks = rows_of(group, 2 * matvec._GROUP_ROWS[matvec.STEP[group]], n, n)
        x = np.random.default_rng(n).standard_normal((1, n)).astype(np.float32) * 3
        xq, xd, xs = np.empty((1, n), np.int8), np.empty((1, n // 32), np.float32), np.empty((1, n // 32), np.float32)
        matvec.round_q8(x, xq, xd, xs)
        cases.append((make, blocks, xq.reshape(-1), xd.reshape(-1), xs.reshape(-1),
                      matvec.matvec(matvec.STEP[group], blocks, x).reshape(-1)))
    monkeypatch.setattr(dot, "_VNNI", False)
    monkeypatch.setattr(dot, "_AVX512BW", False)
    monkeypatch.setattr(dot, "_GFNI", False)
    monkeypatch.setattr(dot, "_AVX2", tier == "avx2")
    monkeypatch.setattr(dot, "_SSSE3", tier in ("avx2", "ssse3"))
    monkeypatch.setattr(dot, "_SSE2", tier in ("avx2", "ssse3", "sse2"))
    for make, blocks, xq, xd, xs, want in cases:
        chunk = make()                                 # the tier's IR

        @njit
        def run(b, xq, xd, xs, out, rows, row_size):
            for r in range(0, out.shape[0], rows):
                chunk(b, r * row_size, xq, xd, xs, 0, out, r)
        got = np.zeros(blocks.shape[0], np.float32)
        run(blocks.reshape(-1), xq, xd, xs, got, blocks.shape[0] // 2, blocks.shape[1])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# a batch's kernels (matmul8) of one type per path of the byte products: signed codes, a folded
# bias, a min, high bits, a legacy grid, E8M0 scales, mins, run mins, a paired grid, a row scale;
# grid i-quants (grid_tiles.row_dots) with sign bits and scales per 32, per 16, a signed grid
BATCH_TYPES = [QuantType[n] for n in ("Q8_0", "Q4_1", "Q5_0", "IQ4_NL", "MXFP4", "Q4_K", "Q2_K", "Q6_K", "IQ4_K",
                                      "IQ4_KS", "IQ2_XXS", "IQ2_S", "IQ1_M")]


@child_only
def test_batch_products_token_for_token():
    """A batch's products the bits of the generation step's, token for token, on this target too."""
    rows = _stored_rows()
    for qtype in BATCH_TYPES:
        check_batch_product(qtype, rows)


def _generic_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path / "numba-generic"),
           ROWS: str(tmp_path / "rows.npz")}
    env.pop("NUMBA_CPU_FEATURES", None)             # generic: the model's features, none besides
    return env


@pytest.mark.skipif(IN_CHILD, reason="the child runs the checks themselves")
def test_generic_cpu_target(tmp_path, shared_dir):
    """The checks above (CHILD_CHECKS) in a child that compiles for NUMBA_CPU_NAME=generic, and a
    `quantkit run` there that gives the host's greedy tokens."""
    matrices = {_key(q, n, seed): rows_of(q, n_rows, n, seed)
                for q in {*KERNEL_TYPES, *BATCH_TYPES, *STEP_TYPES} for n, n_rows, seed in product_cases(q)}
    np.savez(tmp_path / "rows.npz", **matrices)
    env = _generic_env(tmp_path)
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                        str(tmp_path / "child"), *CHILD_CHECKS], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT_S)
    took = time.perf_counter() - start
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-8000:]}\n{p.stderr[-3000:]}"
    assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
    print(f"\n  generic target: {summary} ({took:.0f} s)")

    src = write_llama(tmp_path / "tiny-f32.gguf", n_layer=2, vocab=True)
    model = tmp_path / "tiny-q4_k_m.gguf"
    quantkit.quantize_model(src, model, "Q4_K_M")
    # a prompt of more than FUSED_TOKENS tokens: a batch's products (matmul8) as well as the steps'
    args = ("run", model, "-p", "hello world, the quick brown fox jumps", "-n", "6", "--temp", "0", "--json")
    start = time.perf_counter()
    rc, out, err = run_cli(*args, env=env)
    assert rc == 0, (rc, err[-3000:])
    generic = json.loads(out)
    print(f"  generic target: quantkit run ({time.perf_counter() - start:.0f} s)")
    rc, out, err = run_cli(*args)
    assert rc == 0, (rc, err[-3000:])
    host = json.loads(out)
    assert len(generic["tokens"]) == 6 and generic["tokens"] == host["tokens"], (generic["tokens"], host["tokens"])
    assert len(host["prompt_tokens"]) > 4, host["prompt_tokens"]           # ops_cpu.FUSED_TOKENS
