"""Helpers shared by the format tests: byte comparison with a useful message, the reference ports of
../shared/reference, the golden vectors, and inputs with the awkward cases."""
from __future__ import annotations

import importlib.util
import json
import sys

import numba
import numpy as np
import pytest

from quantkit import formats
from quantkit.types import traits, type_name


def assert_same_bytes(got: np.ndarray, want: np.ndarray, qtype, n_per_row: int, what: str) -> None:
    """Exact equality; on failure say how many rows and blocks differ, and where first."""
    t = traits(qtype)
    got = np.asarray(got).view(np.uint8).reshape(-1, t.row_size(n_per_row))
    want = np.asarray(want).view(np.uint8).reshape(got.shape)
    if np.array_equal(got, want):
        return
    body = got[:, t.row_meta_size:]
    blocks_got = body.reshape(got.shape[0], -1, t.type_size)
    blocks_want = want[:, t.row_meta_size:].reshape(blocks_got.shape)
    bad = (blocks_got != blocks_want).any(axis=-1)                              # (rows, blocks)
    meta_bad = (got[:, :t.row_meta_size] != want[:, :t.row_meta_size]).any(axis=-1)
    rows = np.nonzero(bad.any(axis=1) | meta_bad)[0]
    first = f"row {rows[0]}" + (f" block {int(np.argmax(bad[rows[0]]))}" if bad[rows[0]].any() else " (row scale)")
    np.testing.assert_array_equal(
        got, want, err_msg=f"{what}: {len(rows)}/{got.shape[0]} rows and {int(bad.sum())}/{bad.size} "
                           f"blocks differ (rows {rows[:10].tolist()}; first: {first})")


def quantize(x, qtype, imatrix, flavor):
    with np.errstate(all="ignore"):         # C divides by zero in lanes whose result it discards
        return formats.quantize(x, qtype, imatrix, flavor=flavor)


def load_reference(shared_dir, module: str, jit: bool = True):
    """Import ../shared/reference/<module>.py (its sibling imports need the folder on sys.path);
    ``jit=False`` turns its @njit functions into plain Python (numba reads DISABLE_JIT when a
    function is decorated)."""
    ref_dir = str(shared_dir / "reference")
    spec = importlib.util.spec_from_file_location(f"_ref_{module}_{jit}", shared_dir / "reference" / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    saved = numba.config.DISABLE_JIT
    numba.config.DISABLE_JIT = not jit
    sys.path.insert(0, ref_dir)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(ref_dir)
        numba.config.DISABLE_JIT = saved
    return mod


def golden_input(shared_dir, flavor: str, name: str):
    """(folder, x (rows, cols) float32, imatrix (cols,) float32) of a golden input."""
    folder = shared_dir / "golden" / flavor
    shape = json.loads((folder / "manifest.json").read_text())["inputs"][name]
    x = np.fromfile(folder / f"{name}.f32", np.float32).reshape(shape["rows"], shape["cols"])
    imatrix = np.fromfile(folder / f"{name}.imatrix.f32", np.float32)
    return folder, x, imatrix


def golden_bytes(shared_dir, flavor: str, name: str, qtype, with_imatrix: bool) -> np.ndarray:
    suffix = "imat" if with_imatrix else "noimat"
    path = shared_dir / "golden" / flavor / f"{name}.{type_name(qtype)}.{suffix}.bin"
    if not path.is_file():
        pytest.skip(f"no reference vector {path.name} for {flavor}")
    return np.fromfile(path, np.uint8)


def fresh_input(seed: int, n_rows: int = 3, n: int = 512) -> np.ndarray:
    """Small random rows with the awkward cases: an all-zero row, a zero super-block, a zero
    16-block, a block of 1e-30, heavy tails, ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    x[1] = 0                                                          # all-zero row
    x[0, 32:48] = 0                                                   # zero 16-block
    x[0, 96:128] = np.float32(1e-30)                                  # tiny 32-block
    x[2, :256] = 0                                                    # zero super-block
    x[2, 256:] = (rng.standard_t(2, n - 256) * 3).astype(np.float32)  # heavy tails
    x[2, 300:316] = np.float32(0.5)                                   # equal values
    return x


def expert_imatrix(seed: int, n_expert: int, n: int) -> np.ndarray:
    """Per-expert slices of a 3-D imatrix: one expert never routed (llama-quantize uses 1.0), one with
    a zero column block, the others positive with outliers."""
    rng = np.random.default_rng(seed)
    im = (rng.random((n_expert, n)) ** 3 * 10).astype(np.float32)
    im[0, 64:80] = 0
    im[0, 7] = 5000
    im[1] = 1.0
    return im


def random_blocks(qtype, rows: int, n: int, seed: int, d_at: int = 0) -> np.ndarray:
    """Random row bytes of ``qtype`` with finite, signed scales of any size: the row scale of a
    row-scaled type (float32 or fp16), else each block's fp16 d at byte ``d_at`` (negative: from
    the block's end)."""
    rng = np.random.default_rng(seed)
    t = traits(qtype)
    b = rng.integers(0, 256, (rows, t.row_size(n)), dtype=np.uint8)
    if t.row_meta_size:
        scale = rng.standard_normal(rows) * 10.0 ** rng.uniform(-6, 2, rows)
        b[:, :t.row_meta_size] = scale.astype("<f4" if t.row_meta_size == 4 else "<f2").view(np.uint8) \
            .reshape(rows, t.row_meta_size)
    else:
        blk = b.reshape(-1, t.type_size)
        at = d_at % t.type_size
        blk[:, at:at + 2] = (rng.standard_normal(blk.shape[0]) * 10.0 ** rng.uniform(-6, 2, blk.shape[0])) \
            .astype("<f2").view(np.uint8).reshape(-1, 2)
    return b


def assert_golden(shared_dir, golden_flavor: str, name: str, qtype, use_imatrix: bool, flavors=("ik",)) -> None:
    """Quantize golden input ``name`` of ``golden_flavor`` as each of ``flavors`` and compare with
    that folder's bytes (a type only ik has runs one algorithm for both flavors)."""
    _, x, imatrix = golden_input(shared_dir, golden_flavor, name)
    want = golden_bytes(shared_dir, golden_flavor, name, qtype, use_imatrix)
    for flavor in flavors:
        got = quantize(x, qtype, imatrix if use_imatrix else None, flavor)
        assert_same_bytes(got, want, qtype, x.shape[1], f"{type_name(qtype)} {name} {flavor}")


def iq1_finite_scales(qtype, b: np.ndarray, rng) -> np.ndarray:
    """Random bytes ``b`` (rows of IQ1_S, IQ1_M, IQ1_S_R4 or IQ1_M_R4; other types are left alone)
    with every float16 scale a finite value of moderate size: IQ1_S's d at each block's byte 0,
    IQ1_M's d spread over the top nibbles of its four scale words, the _R4 groups' four row scales
    in front of the group."""
    from quantkit.types import QuantType as T
    name = traits(qtype).name
    if name not in ("iq1_s", "iq1_m", "iq1_s_r4", "iq1_m_r4"):
        return b

    def halves(n):
        return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype("<f2")

    if qtype == T.IQ1_S:
        blk = b.reshape(-1, 50)
        blk[:, :2] = halves(blk.shape[0]).view(np.uint8).reshape(-1, 2)
    elif qtype == T.IQ1_M:
        blk = b.reshape(-1, 56)
        bits = halves(blk.shape[0]).view("<u2").astype(np.int64)
        sc = blk[:, 48:56].copy().view("<u2").astype(np.int64) & 0x0FFF
        for i in range(4):
            sc[:, i] |= ((bits >> (4 * i)) & 0xF) << 12
        blk[:, 48:56] = sc.astype("<u2").view(np.uint8)
    else:
        g = b.reshape(b.shape[0] // 4, -1)
        g[:, :8] = halves(4 * g.shape[0]).view(np.uint8).reshape(-1, 8)
    return b


# the grid i-quants: a float16 d at byte 0 of every block
_BLOCK_D_AT_0 = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s")


def random_rows(qtype, n_rows: int, seed: int, n_per_row: int = 512) -> np.ndarray:
    """Random bytes for n_rows rows of qtype, each float16 / float32 scale a random finite value
    (tests/test_layouts.py, tests/test_triton_qmm_iq.py): every code, packed scale, grid bit, sign
    and min takes random values."""
    from quantkit.layouts import LAYOUTS
    from quantkit.types import QuantType
    t = traits(qtype)
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n_rows, t.row_size(n_per_row)), dtype=np.uint8)
    if t.row_meta_size in (4, 8):          # a float32 scale (q8_KV: then the int32 sum of its codes)
        b[:, :4] = rng.uniform(-2, 2, (n_rows, 1)).astype("<f4").view(np.uint8)
    elif t.row_meta_size == 2:
        b[:, :2] = rng.uniform(-2, 2, (n_rows, 1)).astype("<f2").view(np.uint8)
    if qtype == QuantType.MXFP4:        # an E8M0 exponent byte: 253 and up make d * 12 overflow
        blocks = b.reshape(n_rows, -1, t.type_size)
        blocks[:, :, 0] = rng.integers(0, 253, blocks.shape[:2])
    lay = LAYOUTS.get(qtype)
    halves = set()
    if lay is not None:
        halves = {at for r in lay.runs for at in (r.d_at, r.m_at) if at is not None}
        if lay.sup is not None:
            halves |= {at for at in (lay.sup.d_at, lay.sup.dmin_at) if at is not None}
    elif t.name in _BLOCK_D_AT_0:
        halves = {0}
    if halves:
        blocks = b[:, t.row_meta_size:].reshape(n_rows, -1, t.type_size)
    for at in halves:
        blocks[:, :, at:at + 2] = rng.uniform(-2, 2, blocks.shape[:2] + (1,)).astype("<f2").view(np.uint8)
    return iq1_finite_scales(qtype, b, rng)
