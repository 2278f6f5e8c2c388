"""F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 against real references, byte for byte.

Oracles (never quantkit's own earlier output):

* ../shared/golden/{ik,mainline}: bytes of the C quantizers (ik_llama.cpp built without FMA
  contraction, mainline llama.cpp) for three inputs, with and without an imatrix;
* gguf-py's quantizers, which reproduce the C ``quantize_row_*_ref`` functions (no imatrix);
* the executable ports in ../shared/reference (each checked byte-exact against its C build) for fresh
  imatrix inputs: ik's Q4_0/Q8_0 and mainline's Q4_0/Q4_1/Q5_0/Q5_1;
* for decoding, gguf-py's dequantizers and, when the ik-llama-cpp-python wheel is installed, the C
  ``to_float`` of its libggml.so (also its ``ggml_quantize_chunk`` on awkward no-imatrix blocks).

The quantizers are the numba kernels (the only implementation); every decoding case runs twice, the
numpy decoder (``reference=True``) and the numba one.
"""
from __future__ import annotations

import json

import gguf
import numba
import numpy as np
import pytest

import peers
from quant_checks import assert_same_bytes, load_reference
from quantkit import formats
from quantkit.formats import registered
from quantkit.formats._base import ALL_PATHS
from quantkit.types import QuantType, traits, type_name

T = QuantType
FLOATS = [T.F32, T.F16, T.BF16]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
GOLDEN_TYPES = [T.BF16, *LEGACY]            # types with reference vectors in ../shared/golden
INPUTS = ("gauss", "heavy", "wide")
IMPLS = pytest.mark.parametrize("reference", [True, False], ids=["numpy", "numba"])

ggml = peers.load_ggml()
needs_wheel = pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")


# ---- helpers ----

def gguf_py_quantize(x: np.ndarray, qtype) -> np.ndarray:
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    return q.view(np.uint8).reshape(x.shape[0], -1)


def gguf_py_dequantize(blocks: np.ndarray, qtype, n_per_row: int) -> np.ndarray:
    y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(qtype)))
    return np.asarray(y, np.float32).reshape(blocks.shape[0], n_per_row)


@pytest.fixture(scope="module")
def golden(shared_dir):
    """golden(flavor, name) -> (x, imatrix); golden.bytes(flavor, name, qtype, with_imatrix) -> uint8."""
    cache = {}

    class Golden:
        def __call__(self, flavor, name):
            if (flavor, name) not in cache:
                d = shared_dir / "golden" / flavor
                shape = json.loads((d / "manifest.json").read_text())["inputs"][name]
                x = np.fromfile(d / f"{name}.f32", np.float32).reshape(shape["rows"], shape["cols"])
                cache[flavor, name] = x, np.fromfile(d / f"{name}.imatrix.f32", np.float32)
            return cache[flavor, name]

        def bytes(self, flavor, name, qtype, with_imatrix):
            suffix = "imat" if with_imatrix else "noimat"
            path = shared_dir / "golden" / flavor / f"{name}.{type_name(qtype)}.{suffix}.bin"
            if not path.is_file():
                pytest.skip(f"no reference vector {path.name} for {flavor}")
            return np.fromfile(path, np.uint8)

    return Golden()


def random_rows(seed: int, n_rows: int = 8, n_per_row: int = 512) -> np.ndarray:
    """Gaussian rows of varied scale with the usual trouble makers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 3, (n_rows, 1)).astype(np.float32)
    edits = [
        lambda r: r.fill(0),                                            # all-zero row
        lambda r: r[32:64].fill(0),                                     # a zero block
        lambda r: r.__imul__(np.exp(rng.standard_normal(r.size) * 2).astype(np.float32)),  # heavy tails
        lambda r: r[:32].fill(1e-30),                                   # tiny but not zero
        lambda r: np.abs(r, out=r),                                     # min > 0
        lambda r: r[64:96].fill(3.25),                                  # a constant block
    ]
    for row, edit in zip(x, edits):
        edit(row)
    return x


def random_imatrix(seed: int, n_per_row: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.random(n_per_row) ** 4 * 10).astype(np.float32)
    w[40:72] = 0                                        # zero importance across a block boundary
    return w


# ---- the registry ----

@pytest.mark.parametrize("qtype", FLOATS + LEGACY, ids=type_name)
def test_registered_with_every_path(qtype):
    # mainline and ik agree without an imatrix; with one, each flavor has its own algorithm (and
    # floats and Q8_0 ignore it), so all four (flavor, imatrix) paths are implemented
    fmt = registered()[qtype]
    assert fmt.quant_paths == ALL_PATHS
    for flavor, with_imatrix in ALL_PATHS:
        assert formats.can_quantize(qtype, flavor, with_imatrix)
    assert formats.can_dequantize(qtype)


# ---- 1. reference vectors of the C quantizers ----

@pytest.mark.parametrize("flavor", ["ik", "mainline"])
@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("qtype", GOLDEN_TYPES, ids=type_name)
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["noimat", "imat"])
def test_quantize_matches_golden(golden, flavor, name, qtype, with_imatrix):
    want = golden.bytes(flavor, name, qtype, with_imatrix)
    x, imatrix = golden(flavor, name)
    got = formats.quantize(x, qtype, imatrix if with_imatrix else None, flavor=flavor)
    assert got.dtype == np.uint8 and got.shape == (x.shape[0], traits(qtype).row_size(x.shape[1]))
    what = f"{flavor} {name}.{type_name(qtype)} imatrix={with_imatrix}"
    assert_same_bytes(got, want, qtype, x.shape[1], what)


def test_golden_flavors_differ_where_expected(golden):
    # guards the test above against vacuous passes: with an imatrix the flavors' bytes differ
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        assert not np.array_equal(golden.bytes("ik", "gauss", qtype, True),
                                  golden.bytes("mainline", "gauss", qtype, True))
        np.testing.assert_array_equal(golden.bytes("ik", "gauss", qtype, False),
                                      golden.bytes("mainline", "gauss", qtype, False))


def test_thread_count_does_not_change_bytes(golden):
    x, imatrix = golden("ik", "wide")
    want = golden.bytes("ik", "wide", T.Q4_1, True)
    before = numba.get_num_threads()
    try:
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            assert_same_bytes(formats.quantize(x, T.Q4_1, imatrix), want, T.Q4_1, x.shape[1], f"{n} threads")
    finally:
        numba.set_num_threads(before)


# ---- 2. fresh inputs: gguf-py, the wheel and the reference ports ----

@pytest.mark.parametrize("qtype", [T.F16, T.BF16, *LEGACY], ids=type_name)
@pytest.mark.parametrize("flavor", ["ik", "mainline"])
def test_random_rows_match_gguf_py(qtype, flavor):
    x = random_rows(1)
    got = formats.quantize(x, qtype, flavor=flavor)
    assert_same_bytes(got, gguf_py_quantize(x, qtype), qtype, x.shape[1], f"{type_name(qtype)} vs gguf-py")


def test_f32_is_the_input_bytes():
    x = random_rows(2)
    got = formats.quantize(x, T.F32, random_imatrix(2, x.shape[1]))
    np.testing.assert_array_equal(got, x.view(np.uint8))


def test_bf16_special_values_match_gguf_py():
    bits = np.array([0x7FC00001, 0xFFA00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000,
                     0x3F808000, 0x3F818000, 0x3F808001, 0x00000001, 0x80000000, 0x00008000, 0x00018000],
                    dtype=np.uint32)
    x = np.resize(bits, 32).view(np.float32).reshape(1, 32)
    got = formats.quantize(x, T.BF16)
    np.testing.assert_array_equal(got, gguf_py_quantize(x, T.BF16))


def awkward_blocks() -> np.ndarray:
    """Blocks where casts, ties and signed zeros decide the bytes (one 32-value block per row part)."""
    b = []
    b.append(np.full(32, -0.0, np.float32))                                    # max stays +0.0 in C
    b.append(np.r_[np.float32(127), np.float32(2.5), -np.float32(2.5), np.float32(0.5), -np.float32(0.5),
                   np.float32(0.49999997), -np.float32(0.49999997), np.arange(25, dtype=np.float32) - 12.5])
    b.append(np.r_[np.float32(-8), np.arange(31, dtype=np.float32) * np.float32(0.5) - 7.5])   # .5 edges
    b.append(np.r_[np.float32(-0.0), np.zeros(30, np.float32), np.float32(0.0)])
    b.append(np.r_[np.float32(3e-41), np.float32(-1e-45), np.zeros(30, np.float32)])          # subnormals
    b.append(np.r_[np.float32(1e6), np.ones(31, np.float32)])                 # scale overflows fp16
    b.append(np.r_[np.float32(65519), -np.float32(65521), np.float32(1.0), np.zeros(29, np.float32)])
    b.append(np.linspace(-1, 1, 32, dtype=np.float32))
    return np.concatenate(b).reshape(2, -1)


@needs_wheel
@pytest.mark.parametrize("qtype", [T.BF16, *LEGACY], ids=type_name)
def test_awkward_blocks_match_the_wheel(qtype):
    # the C no-imatrix paths (and Q8_0, BF16 with an imatrix) are plain casts, the same in the wheel's
    # build as in the reference build; gguf-py gets the all -0.0 block of Q4_0/Q5_0 wrong (d = +0)
    x = np.concatenate([awkward_blocks(), random_rows(3, 8, 128)[6:]], axis=1)
    for imatrix in (None, random_imatrix(3, x.shape[1])):
        if imatrix is not None and qtype not in (T.Q8_0, T.BF16):
            continue
        want = np.frombuffer(ggml.quantize_chunk(int(qtype), x, imatrix), np.uint8)
        got = formats.quantize(x, qtype, imatrix)
        assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} awkward blocks")


@needs_wheel
def test_q8_0_non_finite_blocks_match_the_wheel():
    """q8_0's max |x| is taken in lanes where a block is finite; a NaN or an infinity makes C's
    order of MAX decide (a NaN is kept or dropped by the comparison after it): those blocks match."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[0, 3], x[0, 40], x[0, 41] = np.nan, np.nan, 9.0
    x[1, 70], x[1, 100], x[1, 101] = np.inf, -np.inf, np.nan
    x[2, 160:192] = np.nan
    x[3, 5], x[3, 6] = 1e30, -np.inf
    want = np.frombuffer(ggml.quantize_chunk(int(T.Q8_0), x, None), np.uint8)
    np.testing.assert_array_equal(formats.quantize(x, T.Q8_0).reshape(-1), want)


@pytest.fixture(scope="module")
def ik_port(shared_dir):
    return load_reference(shared_dir, "ik_quantize")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=type_name)
def test_imatrix_rows_match_the_ik_port(ik_port, qtype):
    x = random_rows(4, 4, 256)          # the port is plain Python: keep it small
    imatrix = random_imatrix(4, 256)
    port = {T.Q4_0: ik_port.quantize_q4_0, T.Q8_0: ik_port.quantize_q8_0}[qtype]
    want = np.frombuffer(port(x, imatrix), np.uint8)
    got = formats.quantize(x, qtype, imatrix, flavor="ik")
    assert_same_bytes(got, want, qtype, x.shape[1], f"ik {type_name(qtype)} imatrix vs ik_quantize.py")


@pytest.fixture(scope="module")
def mainline_port(shared_dir):
    return load_reference(shared_dir, "mainline_more")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=type_name)
def test_mainline_imatrix_rows_match_the_mainline_port(mainline_port, qtype):
    x = random_rows(5, 16, 512)
    imatrix = random_imatrix(5, 512)
    kind = {T.Q4_0: 0, T.Q4_1: 1, T.Q5_0: 2, T.Q5_1: 3}[qtype]
    want = mainline_port.py_legacy(kind, x, imatrix)
    got = formats.quantize(x, qtype, imatrix, flavor="mainline")
    what = f"mainline {type_name(qtype)} imatrix vs mainline_more.py"
    assert_same_bytes(got, want, qtype, x.shape[1], what)


# ---- 3. decoding ----

@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("qtype", GOLDEN_TYPES, ids=type_name)
@IMPLS
def test_dequantize_golden_bytes_matches_gguf_py(golden, name, qtype, reference):
    x, _ = golden("ik", name)
    for with_imatrix in (False, True):
        blocks = golden.bytes("ik", name, qtype, with_imatrix).reshape(x.shape[0], -1)
        got = formats.dequantize(blocks, qtype, x.shape[1], reference=reference)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got, gguf_py_dequantize(blocks, qtype, x.shape[1]))


def random_blocks(qtype, n_rows: int, n_per_row: int, seed: int) -> np.ndarray:
    """Random bytes as blocks; the fp16 d (and m) fields set to finite values of varied size."""
    rng = np.random.default_rng(seed)
    t = traits(qtype)
    if qtype == T.F32:
        return rng.standard_normal((n_rows, n_per_row)).astype(np.float32).view(np.uint8)
    blocks = rng.integers(0, 256, (n_rows, t.row_size(n_per_row)), dtype=np.uint8)
    if t.quantized:
        b = blocks.reshape(-1, t.type_size)
        n_scales = 2 if qtype in (T.Q4_1, T.Q5_1) else 1
        scales = rng.standard_normal((b.shape[0], n_scales)) * 10.0 ** rng.integers(-7, 4, (b.shape[0], 1))
        b[:, :2 * n_scales] = scales.astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("qtype", FLOATS + LEGACY, ids=type_name)
@IMPLS
def test_dequantize_random_blocks(qtype, reference):
    n_rows, n = 16, 256
    blocks = random_blocks(qtype, n_rows, n, seed=int(qtype))
    got = formats.dequantize(blocks, qtype, n, reference=reference)
    assert got.dtype == np.float32 and got.shape == (n_rows, n)
    np.testing.assert_array_equal(got, gguf_py_dequantize(blocks, qtype, n))
    if ggml is not None:        # the C decoder of the wheel (to_float)
        c = ggml.to_float(int(qtype), blocks, n_rows * n, n).reshape(n_rows, n)
        np.testing.assert_array_equal(got, c)


@pytest.mark.parametrize("qtype", FLOATS + LEGACY, ids=type_name)
def test_non_finite_check_agrees_with_decoding(qtype):
    # formats.find_non_finite reads only the scale fields a format declares; a value too large for
    # the fp16 scale must be found at the same row and block as decoding would find it
    x = random_rows(6, 4, 128)
    x[2, 70] = np.float32(3e9)
    blocks = formats.quantize(x, qtype)
    y = formats.dequantize(blocks, qtype, x.shape[1])
    bad = np.argwhere(~np.isfinite(y))
    found = formats.find_non_finite(blocks, qtype, x.shape[1])
    if qtype in (T.F32, T.BF16):
        assert bad.size == 0 and found is None
        return
    block = traits(qtype).block_size
    assert found == (int(bad[0][0]), int(bad[0][1]) // block)


# ---- 4. the numpy paths that spare a q8_0 quantize numba: against numba's kernels and tables ----

def q8_0_trouble_rows() -> np.ndarray:
    """Rows where q8_0's every rule decides: NaNs before, between and after the max (C's MAX keeps
    or drops them), infinities, scales that are subnormal or whose inverse overflows, fp16 overflow,
    exact halves and their float32 neighbours (roundf), signed zeros; 4096 wide, so that a row
    spans several of the quantizer's steps and threads."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((24, 4096)).astype(np.float32)
    x[0, 3], x[0, 40], x[0, 41] = np.nan, np.nan, 9.0
    x[1, 64:96] = np.nan
    x[1, 127] = np.nan                                        # a NaN last in its block
    x[2, 70], x[2, 100], x[2, 101] = np.inf, -np.inf, np.nan
    x[3, :32] = np.float32(1e-40) * rng.standard_normal(32).astype(np.float32)     # subnormal values
    x[3, 32:64] = np.float32(3e-37) * rng.standard_normal(32).astype(np.float32)   # 1/d overflows
    x[3, 64:96] = np.float32(127 * 2.0 ** -126) * rng.standard_normal(32).astype(np.float32)
    x[4, :32] = np.float32(1e6)
    x[4, 40] = np.float32(65519 * 127)                         # d just below / above fp16's max
    x[4, 80] = np.float32(65521 * 127)
    halves = np.arange(-126, 127, dtype=np.float32) + np.float32(0.5)
    near = np.concatenate([halves, np.nextafter(halves, np.float32(0)), np.nextafter(halves, np.float32(200)),
                           np.nextafter(halves, -np.float32(200))])
    for r in range(5, 5 + 8):                                  # amax 127: id 1, v = x exactly
        x[r] = rng.choice(near, 4096).astype(np.float32)
        x[r, ::32] = np.float32(127)
    x[13] = -0.0
    x[14, ::7] = -0.0
    x[15] *= np.float32(1e-3)
    x[16] *= np.float32(3e4)
    return x


def test_q8_0_numpy_quantizer_is_numba_kernel_twin():
    from quantkit.formats import q8_0_numpy
    from quantkit.kernels import legacy
    x = np.concatenate([q8_0_trouble_rows(), random_rows(12, 8, 4096)])
    want = np.zeros((x.shape[0], traits(T.Q8_0).row_size(x.shape[1])), np.uint8)
    legacy.quantize_rows_plain(int(T.Q8_0), x, want)

    def check(n):
        got = np.zeros_like(want)
        q8_0_numpy.quantize_rows(x, got)
        np.testing.assert_array_equal(got, want, err_msg=f"{n} threads")
    _on_row_threads(check)
    np.testing.assert_array_equal(formats.quantize(x, T.Q8_0), want)


def _on_row_threads(check, counts=(1, 3)):
    """check(n) with the numpy quantizers' rows split between n threads (row_threads), for each n."""
    from quantkit import row_threads
    before = row_threads.threads()
    try:
        for n in counts:
            row_threads.set_threads(n)
            check(n)
    finally:
        row_threads.set_threads(before)


def test_q8_0_of_half_bits_is_numba_kernel_twin():
    """quantize_f16_rows (an F16 model's rows, quantized from their bits) against numba's kernel on
    the widened values: every finite half in shuffled blocks (so under many block maxima), blocks of
    subnormals and signed zeros only, and Gaussian rows, on 1 and 3 threads; a NaN or an infinity
    anywhere raises NonFinite."""
    from quantkit.formats import q8_0_numpy
    from quantkit.kernels import legacy
    rng = np.random.default_rng(28)
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = h[(h & 0x7FFF) < 0x7C00]
    tiny = h[(h & 0x7FFF) < 0x0400]
    rows = [rng.permutation(finite)[:finite.size // 2048 * 2048].reshape(-1, 2048) for _ in range(2)]
    rows += [rng.choice(tiny, (8, 2048)), np.full((1, 2048), 0x8000, np.uint16), np.zeros((1, 2048), np.uint16),
             (rng.standard_normal((16, 2048)) * 0.02).astype(np.float16).view(np.uint16)]
    bits = np.ascontiguousarray(np.concatenate(rows))
    x = bits.view(np.float16).astype(np.float32)
    want = np.zeros((x.shape[0], traits(T.Q8_0).row_size(x.shape[1])), np.uint8)
    legacy.quantize_rows_plain(int(T.Q8_0), x, want)

    def check(n):
        got = np.zeros_like(want)
        q8_0_numpy.quantize_f16_rows(bits, got)
        np.testing.assert_array_equal(got, want, err_msg=f"{n} threads")
        for bad in (0x7C00, 0xFC00, 0x7E00, 0xFFFF):
            b = bits.copy()
            b[-3, 77] = bad
            with pytest.raises(q8_0_numpy.NonFinite):
                q8_0_numpy.quantize_f16_rows(b, np.zeros_like(want))
    _on_row_threads(check)


def test_f16_and_bf16_decoders_give_every_bit_pattern_exactly():
    """The numpy decoders against numba's table (F16, NaN payloads included) and the plain shift
    (BF16), bit for bit over all 65536 patterns."""
    from quantkit.tables import FP16_TABLE
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    blocks = h.view(np.uint8).reshape(64, -1)
    got = formats.dequantize(blocks, T.F16, 1024)
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint32), FP16_TABLE[h].view(np.uint32))
    got = formats.dequantize(blocks, T.BF16, 1024)
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint32), h.astype(np.uint32) << 16)
