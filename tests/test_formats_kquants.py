"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS against real references, byte for byte.

Oracles (never quantkit's own earlier output):

* ../shared/golden/{ik,mainline}: bytes of the C quantizers (ik_llama.cpp built without FMA
  contraction, mainline llama.cpp) for three inputs with edge-case rows, with and without an imatrix;
* the executable ports in ../shared/reference (each checked byte-exact against its C build) for fresh
  inputs: mainline's Q2_K..Q6_K/IQ4_NL/IQ4_XS, ik's Q6_K and IQ4_NL and the fork's make_qx_quants
  (ik's Q2_K-Q5_K and IQ4_XS have no port; the golden vectors are their oracle);
* for decoding, gguf-py's dequantizers and, when the ik-llama-cpp-python wheel is installed, the C
  ``to_float`` of its libggml.so (and its quantizer for ternary Q2_K input, where no FMA is involved).

The quantizers are the numba kernels (the only implementation); every decoding case runs twice, the
numpy decoder (``reference=True``) and the numba one.  The mainline ports are numba code; they run
here as plain Python (numba's DISABLE_JIT while importing them) because compiling them would take
longer than this whole file.
"""
from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest

import peers
from quant_checks import (assert_same_bytes, expert_imatrix, fresh_input, golden_input, load_reference,
                          quantize)
from quantkit import formats
from quantkit.formats import registered
from quantkit.formats._base import ALL_PATHS, FLAVORS
from quantkit.formats import iq4 as iq4_formats
from quantkit.formats import kquants as kq_formats
from quantkit.kernels import iq4 as iq4_kernels
from quantkit.kernels import kquants as kq_kernels
from quantkit.types import QuantType, traits, type_name

T = QuantType
TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
INPUTS = ("gauss", "heavy", "wide")
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])
IMAT = pytest.mark.parametrize("use_imatrix", [False, True], ids=["noimat", "imat"])

ggml = peers.load_ggml()
needs_wheel = pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")


# ---- helpers ----

def _nearest_int_as_numba(f):
    """The ports' nearest_int under numba returns an int64, whose ``& 0xFF`` then wraps through
    np.int8 (Q3_K scales); a Python int would not."""
    return np.int64(np.rint(f))


@pytest.fixture(scope="module")
def mainline_ports(shared_dir):
    kquants = load_reference(shared_dir, "mainline_kquants", jit=False)
    sys.modules["mainline_kquants"] = kquants         # mainline_more imports it by name
    try:
        more = load_reference(shared_dir, "mainline_more", jit=False)
    finally:
        del sys.modules["mainline_kquants"]
    kquants.nearest_int = more.nearest_int = _nearest_int_as_numba

    def rows(fn, bytes_per_block):
        return lambda x, qw: kquants.py_rows(fn, x, qw, x.shape[1] // 256 * bytes_per_block)

    return {
        T.Q2_K: rows(more.q2_K_row, 84), T.Q3_K: rows(more.q3_K_row, 110), T.Q4_K: rows(kquants.q4_K_row, 144),
        T.Q5_K: rows(more.q5_K_row, 176), T.Q6_K: rows(kquants.q6_K_row, 210),
        T.IQ4_NL: kquants.py_iq4_nl, T.IQ4_XS: kquants.py_iq4_xs,
    }


@pytest.fixture(scope="module")
def ik_port(shared_dir):
    return load_reference(shared_dir, "ik_quantize")


# ---- registry ----

@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_registered_paths_and_scale_fields(qtype):
    fmt = registered()[qtype]
    assert fmt.quant_paths == ALL_PATHS
    assert formats.can_quantize(qtype, "ik", True) and formats.can_dequantize(qtype)
    t = traits(qtype)
    # every listed fp16 field is found by the cheap non-finite check, and is the field the decoder
    # reads: Inf there decodes to non-finite values in that block only
    x = fresh_input(3)[[0, 2]]
    for off, dtype in fmt.scale_fields:
        assert dtype == "<f2" and 0 <= off <= t.type_size - 2
        blocks = formats.quantize(x, qtype, None, flavor="mainline")
        assert formats.find_non_finite(blocks, qtype, 512) is None
        blocks.reshape(2, -1, t.type_size)[1, 1, off:off + 2] = np.array([0x00, 0x7C], np.uint8)   # +Inf
        assert formats.find_non_finite(blocks, qtype, 512) == (1, 1)
        with np.errstate(invalid="ignore"):                    # Inf*0 in the other values
            y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(qtype))).reshape(2, -1, t.block_size)
        assert not np.isfinite(y[1, 1]).all() and np.isfinite(y[1, 0]).all()


# ---- golden vectors (real C output) ----

@IMAT
@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_golden(shared_dir, qtype, flavor, name, use_imatrix):
    folder, x, imatrix = golden_input(shared_dir, flavor, name)
    want = np.fromfile(folder / f"{name}.{type_name(qtype)}.{'imat' if use_imatrix else 'noimat'}.bin", np.uint8)
    got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
    assert_same_bytes(got, want, qtype, x.shape[1], f"{flavor} {type_name(qtype)} {name}")


# ---- fresh inputs against the executable ports ----

@IMAT
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_mainline_port(mainline_ports, qtype, use_imatrix):
    port = mainline_ports[qtype]
    x = fresh_input(int(qtype))
    ims = expert_imatrix(int(qtype) + 100, 3, x.shape[1]) if use_imatrix else [None]
    for e, im in enumerate(ims):                 # a 3-D tensor is quantized one expert slice at a time
        xe = x if e == 0 else x[::-1] * np.float32(1 + e)
        with np.errstate(over="ignore"):         # the port's fp16 helper wraps uint32 on purpose
            want = port(np.ascontiguousarray(xe), im)
        assert_same_bytes(quantize(xe, qtype, im, "mainline"), want, qtype, x.shape[1],
                          f"mainline {type_name(qtype)} expert {e}")


@IMAT
@pytest.mark.parametrize("qtype", [T.Q6_K, T.IQ4_NL], ids=type_name)
def test_ik_port(ik_port, qtype, use_imatrix):
    port = ik_port.quantize_q6_K if qtype == T.Q6_K else ik_port.quantize_iq4_nl
    x = fresh_input(int(qtype), n=256)
    ims = expert_imatrix(int(qtype) + 200, 2, x.shape[1]) if use_imatrix else [None]
    for e, im in enumerate(ims):
        xe = np.ascontiguousarray(x if e == 0 else -x[::-1])
        want = np.frombuffer(port(xe, im), np.uint8)
        assert_same_bytes(quantize(xe, qtype, im, "ik"), want, qtype, x.shape[1],
                          f"ik {type_name(qtype)} expert {e}")


@pytest.mark.parametrize("n, nmax", [(16, 4), (16, 32), (32, 8)])
def test_ik_make_qx_quants(ik_port, n, nmax):
    """The kernels' make_qx_quants in ik's flavor (ik Q3_K with imatrix, Q6_K, Q4_0/Q5_0 with
    imatrix, Q6_0), one lane per vector, on random vectors, weights and scales."""
    rng = np.random.default_rng(n + nmax)
    x = (rng.standard_normal((64, n)) * np.exp(rng.standard_normal((64, 1)))).astype(np.float32)
    x[0] = 0
    x[1, ::2] = 0
    w = (rng.random((64, n)) ** 2).astype(np.float32)
    w[2, :8] = 0
    scale = np.empty(x.shape[0], np.float32)
    L = np.empty((n, x.shape[0]), np.int32)
    kq_kernels.qx_lanes(np.ascontiguousarray(x.T), np.ascontiguousarray(w.T), nmax, True, scale, L)
    L = L.T
    for i in range(x.shape[0]):
        s_want, l_want = ik_port.make_qx_quants_ggml(n, nmax, x[i], w[i])
        assert scale[i].view(np.uint32) == np.float32(s_want).view(np.uint32), i
        assert L[i].tolist() == list(l_want), i


# ---- ternary input: ik's Q2_K TriNet path ----

@needs_wheel
def test_ik_q2_k_trinet():
    """ik stores a chunk whose values are all ~{-a, 0, a} as ternary Q2_K.  Its decision and encoding
    involve no fused multiply-add, so the wheel's C quantizer is an oracle here; llama-quantize's
    chunks (ceil(16384/n) rows) are compared chunk by chunk: only the second chunk is ternary."""
    rng = np.random.default_rng(5)
    n = 512
    rows = kq_formats.chunk_rows(n) + 3
    x = rng.standard_normal((rows, n)).astype(np.float32)
    tern = rng.integers(-1, 2, (3, n)).astype(np.float32) * np.float32(0.02)
    x[-3:] = tern + (rng.standard_normal((3, n)) * 1e-4).astype(np.float32)
    got = quantize(x, T.Q2_K, None, "ik")
    cr = kq_formats.chunk_rows(n)
    want = np.concatenate([np.frombuffer(ggml.quantize_chunk(int(T.Q2_K), x[:cr]), np.uint8).reshape(cr, -1),
                           np.frombuffer(ggml.quantize_chunk(int(T.Q2_K), x[cr:]), np.uint8).reshape(3, -1)])
    assert (want[cr:].reshape(3, -1, 84)[:, :, :16] == 0x11).all()          # it is the ternary path
    assert_same_bytes(got[cr:], want[cr:], T.Q2_K, n, "ik q2_K ternary chunk")
    assert not (got[:cr].reshape(cr, -1, 84)[:, :, :16] == 0x11).all()


# ---- decoding ----

def _gguf_dequantize(blocks, qtype, n):
    y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(qtype)))
    return np.asarray(y, np.float32).reshape(blocks.shape[0], n)


def _random_blocks(qtype, rows: int, n: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 scale fields (any other bit pattern is a valid block)."""
    rng = np.random.default_rng(seed)
    t = traits(qtype)
    b = rng.integers(0, 256, (rows, t.row_size(n)), dtype=np.uint8)
    blk = b.reshape(-1, t.type_size)
    for off, _ in registered()[qtype].scale_fields:
        v = (rng.standard_normal(blk.shape[0]) * 10.0 ** rng.uniform(-6, 2, blk.shape[0])).astype("<f2")
        v[::7] = 0
        blk[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return b


@IMPLS
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_dequantize_vs_gguf_py(shared_dir, qtype, reference):
    cases = [(_random_blocks(qtype, 5, 1024, int(qtype)), 1024)]
    for flavor in FLAVORS:
        folder, x, _ = golden_input(shared_dir, flavor, "heavy")
        for kind in ("noimat", "imat"):
            cases.append((np.fromfile(folder / f"heavy.{type_name(qtype)}.{kind}.bin", np.uint8)
                          .reshape(x.shape[0], -1), x.shape[1]))
    for blocks, n in cases:
        got = formats.dequantize(blocks, qtype, n, reference=reference)
        want = _gguf_dequantize(blocks, qtype, n)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_wheel
@IMPLS
@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_dequantize_vs_wheel(qtype, reference):
    blocks = _random_blocks(qtype, 3, 512, int(qtype) + 7)
    got = formats.dequantize(blocks, qtype, 512, reference=reference)
    want = ggml.to_float(int(qtype), blocks.tobytes(), blocks.shape[0] * 512).reshape(got.shape)
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


# ---- best_index: the kernels' thresholds against C's comparison rule ----

def test_iq4_best_index_thresholds(ik_port):
    """The kernels count float32 thresholds; the port's best_index follows C's comparison rule (the
    flavors agree off NaN and |x| >= 2^31).  Probe every threshold ± 50 ulps and random values."""
    probes = []
    for thr in iq4_kernels.THR:
        v = np.float32(thr)
        for _ in range(50):
            v = np.nextafter(v, np.float32(-np.inf))
        for _ in range(101):
            probes.append(v)
            v = np.nextafter(v, np.float32(np.inf))
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.array(probes, np.float32), iq4_formats.KV,
                         rng.uniform(-140, 130, 20_000).astype(np.float32)])
    counted = (xs[:, None] >= iq4_kernels.THR[None, :]).sum(axis=1)
    np.testing.assert_array_equal(counted, [ik_port.best_index(iq4_formats.KVALUES, v) for v in xs])
