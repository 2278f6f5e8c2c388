"""Scalar and lane helpers that every block kernel shares, and the parallel row driver.

Constants that numba freezes at compile time come from :mod:`quantkit.types` (sizes) or are the
few float32 limits that ggml's C code writes out; the fp16 encoder and decoder live only here.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
from numba import NumbaExperimentalFeatureWarning, njit, prange, types

from ..types import QK_K, traits  # QK_K re-exported: the kernels' super-block size

F = np.float32
D = np.float64
I32 = np.int32

GROUP_MAX_EPS = F(1e-15)        # ggml's "all zero" test on max|x| of a group
ZERO_EPS = F(1e-16)             # the same test in ik_llama.cpp's IQK quantizers
FLT_MAX = F(np.finfo(np.float32).max)
OVERFLOW = F(2.0 ** 31)         # from here on, C's (int)x gives INT_MIN
TWO_POW_24 = F(2.0 ** 24)
TWO_POW_M24 = F(2.0 ** -24)

_OPTS = dict(cache=True, error_model="numpy")


def type_ids(*qtypes):
    """ggml type ids as plain ints: module-level ints are what numba freezes into a kernel."""
    return tuple(int(q) for q in qtypes)


def block_bytes(*qtypes):
    """Bytes of one block of each type, from types.py (the kernels write no size of their own)."""
    return tuple(traits(q).type_size for q in qtypes)


# ---- scalar helpers ----

@njit(**_OPTS)
def nint(f):
    """ggml's nearest_int: (bits(f + 12582912.f) & 0x7fffff) - 0x400000, kept in int32."""
    i = np.float32(f + F(12582912.0)).view(np.int32)
    return I32(I32(i & I32(0x7FFFFF)) - I32(0x400000))


@njit(**_OPTS)
def clampf(v, lo, hi):
    """float32(MAX(lo, MIN(hi, v))) for int32 v."""
    return F(min(I32(hi), max(I32(lo), v)))


@njit(**_OPTS)
def fp16_bits(f):
    """GGML_FP32_TO_FP16: IEEE round-to-nearest-even float32 -> fp16 bits; NaN -> sign|0x7E00."""
    u = np.int64(np.float32(f).view(np.uint32))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:             # >= 65520 rounds to Inf
        return sign | 0x7C00
    if a < 0x38800000:              # fp16 subnormal: a multiple of 2^-24 (the scaling is exact)
        return sign | np.int64(np.rint(abs(np.float32(f)) * TWO_POW_24))
    b = a - 0x38000000              # exponent bias 127 -> 15, then drop 13 bits rounding to even
    return sign | ((b + 0x0FFF + ((b >> 13) & 1)) >> 13)


@njit(**_OPTS)
def fp16_value(h):
    """fp16 bits -> float32 (GGML_FP16_TO_FP32)."""
    s = (h >> 15) & 1
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = F(m) * TWO_POW_M24
    elif e == 31:
        v = F(np.inf) if m == 0 else F(np.nan)
    else:
        v = np.uint32(((e + 112) << 23) | (m << 13)).view(np.float32)
    return -v if s else v


@njit(cache=True, error_model="numpy", inline="always")
def fp16_at(b, o, fp16_table):
    """The little-endian float16 at byte o of b, as float32 (through the decoders' table)."""
    return fp16_table[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


@njit(**_OPTS)
def store_fp16(y, off, f):
    """Store fp16(f) little-endian at y[off]; return the stored value as float32."""
    h = fp16_bits(f)
    y[off] = h & 0xFF
    y[off + 1] = h >> 8
    return fp16_value(h)


@njit(cache=True, error_model="numpy", inline="always")
def store_u16(y, off, v):
    """y[off:off+2] = the little-endian bytes of the 16-bit v."""
    y[off] = v & 0xFF
    y[off + 1] = v >> 8


@njit(**_OPTS)
def store_f32(y, off, v):
    """y[off:off+4] = the little-endian bytes of float32 v."""
    bits = np.empty(1, np.float32)
    bits[0] = v
    b4 = bits.view(np.uint8)
    for k in range(4):
        y[off + k] = b4[k]


@njit(cache=True, error_model="numpy", inline="always")
def first_absmax(v):
    """(max |v|, the signed value where it first occurs), both from +0: C's
    ``if (amax < fabsf(v[i])) { amax = fabsf(v[i]); max = v[i]; }``."""
    amax = F(0)
    mx = F(0)
    for i in range(v.shape[0]):
        a = abs(v[i])
        if a > amax:
            amax = a
            mx = v[i]
    return amax, mx


@njit(cache=True, error_model="numpy", inline="always")
def positive_max(v):
    """max(0, v...) as C's ``if (v[i] > max) max = v[i];`` from 0 finds it (a NaN never wins)."""
    mx = F(0)
    for i in range(v.shape[0]):
        mx = v[i] if v[i] > mx else mx
    return mx


@njit(cache=True, error_model="numpy", inline="always")
def weighted_sums(x, w, q, sumqx, sumq2):
    """One value's terms of the least-squares sums, in C's order: (sumqx + (w*q)*x, sumq2 + (w*q)*q)."""
    wq = w * q
    return sumqx + wq * x, sumq2 + wq * q


@njit(cache=True, error_model="numpy", inline="always")
def take_trial(sumqx, sumq2, d, best):
    """C's test of a trial scale: if sumq2 > 0 and sumqx²/sumq2 beats ``best``, the trial's scale
    sumqx/sumq2 and its score replace (d, best).  Returns (taken, d, best); scalars only, so that
    the callers' loops keep their values in registers."""
    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
        d = sumqx / sumq2
        return True, d, d * sumqx
    return False, d, best


# ---- lanes: value i of sub-block k is xt[i, k] ----

@njit(**_OPTS)
def to_lanes(xr, size, xt):
    nl = xr.shape[0] // size
    for k in range(nl):
        for i in range(size):
            xt[i, k] = xr[k * size + i]


@njit(**_OPTS)
def row_lanes(xr, size, n_scratch):
    """A row as lanes of ``size`` values: (xt the values, wt for their weights, Lt int32 for their
    codes, all (size, n_lanes); ``n_scratch`` float32 rows of one value per lane)."""
    nl = xr.shape[0] // size
    xt = np.empty((size, nl), np.float32)
    to_lanes(xr, size, xt)
    return xt, np.empty((size, nl), np.float32), np.empty((size, nl), np.int32), np.empty((n_scratch, nl), np.float32)


@njit(cache=True, error_model="numpy")
def superblock_sum_sq(xr, xo):
    """Σ x² over the QK_K values of ``xr`` from ``xo``, sequential from +0 (the i-quants' sumx2)."""
    s = F(0)
    for i in range(QK_K):
        s += xr[xo + i] * xr[xo + i]
    return s


@njit(**_OPTS)
def lane_sumsq(xt, s):
    """s[k] = Σ x² over lane k, sequential from +0."""
    for k in range(xt.shape[1]):
        s[k] = F(0)
    for i in range(xt.shape[0]):
        for k in range(xt.shape[1]):
            s[k] += xt[i, k] * xt[i, k]


@njit(cache=True, error_model="numpy", inline="always")
def lanes_first_absmax(xt, amax, mx):
    """For every lane k (column of xt): the largest |x| and the signed value where it first occurs
    (C: ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }``, both starting at +0).  Selects, not
    branches, so that the loop over lanes vectorises."""
    for k in range(xt.shape[1]):
        amax[k] = F(0)
        mx[k] = F(0)
    for i in range(xt.shape[0]):
        for k in range(xt.shape[1]):
            v = xt[i, k]
            a = abs(v)
            upd = a > amax[k]
            amax[k] = a if upd else amax[k]
            mx[k] = v if upd else mx[k]


# ---- the parallel driver ----
# A row kernel is handed to the prange loop as a first-class function (a pointer): numba re-links
# and re-optimises, at every level, the whole call tree of a callee it sees statically, and a
# parallel loop adds several levels, which made compiling the kernels several times slower.  All row
# kernels share one signature, so one compiled driver serves every type.

ROW_SIG = (types.Array(types.float32, 1, "C"), types.Array(types.float32, 1, "C"), types.boolean,
           types.boolean, types.Array(types.uint8, 1, "C"))


_COMPILING = threading.Lock()


def _compile_once(kernel, signature):
    """Compile ``kernel`` for its one signature and close it to others.  Under a lock: the runtime
    decodes tiles from several threads, and a second thread must not find the dispatcher half done
    (compiling after ``disable_compile`` raises)."""
    with _COMPILING:
        if kernel._can_compile:
            kernel.compile(signature)
            kernel.disable_compile()


def as_row_function(kernel):
    """Compile ``kernel`` for ROW_SIG (once) and return it as a 1-tuple, which numba passes to the
    driver as a function pointer (this needs a dispatcher that can no longer compile)."""
    _compile_once(kernel, ROW_SIG)
    return (kernel,)


# Every parallel driver in quantkit.kernels releases the GIL (nogil=True): while one quantizes a chunk,
# the quantize pipeline's writer and read-ahead threads (quantize.ReadAhead, gguf_io.writer) run their
# Python between system calls instead of waiting for the whole kernel.
@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def quantize_rows_with(row_fn, x, qw, has_qw, ik, out):
    """out[r] = row_fn[0](x[r], ...) for every row, rows in parallel."""
    for r in prange(x.shape[0]):
        row_fn[0](x[r], qw, has_qw, ik, out[r])


def run_rows(kernel, x, qw, has_qw, ik, out):
    """Run a row kernel over all rows in parallel (numba warns that first-class functions are
    experimental; they have been stable since numba 0.49)."""
    row_fn = as_row_function(kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
        quantize_rows_with(row_fn, x, qw, has_qw, ik, out)


# The decoders run the same way: a family's ``decode_row(type_id, block_bytes, values, fp16_table)``
# decodes one row, and one compiled parallel driver runs it over all rows.
# The bytes are typed read-only: a memory-mapped model's are, and one signature serves both (the
# driver hands the row decoder a read-only view of writable blocks).
DECODE_SIG = (types.int64, types.Array(types.uint8, 1, "C", readonly=True), types.Array(types.float32, 1, "C"),
              types.Array(types.float32, 1, "C"))


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def decode_rows_with(row_fn, qtype, blocks, fp16_table, out):
    """row_fn[0](qtype, blocks[r], out[r], fp16_table) for every row, rows in parallel."""
    for r in prange(out.shape[0]):
        row_fn[0](qtype, blocks[r], out[r], fp16_table)


def decode_rows(decode_row, qtype, blocks, fp16_table, out, interleave=1):
    """Decode blocks (n_rows, row_size) uint8 into out (n_rows, n_per_row) float32 with a family's
    row decoder (compiled once for DECODE_SIG and passed as a function pointer, as run_rows does).
    ``interleave``: the row decoder takes groups of that many rows (bytes and values of the group
    one after another), for layouts whose rows are stored together (iq1_s_r4's)."""
    # the row decoders read the bytes of n_per_row values without bounds checks: the shapes must agree
    if (blocks.ndim != 2 or blocks.shape != (out.shape[0], traits(qtype).row_size(out.shape[1]))
            or out.shape[0] % interleave):
        raise ValueError(f"{traits(qtype).name} blocks of shape {blocks.shape} do not hold {out.shape[0]} rows "
                         f"of {out.shape[1]} values")
    if interleave > 1:
        blocks = blocks.reshape(out.shape[0] // interleave, -1)
        out = out.reshape(out.shape[0] // interleave, -1)
    _compile_once(decode_row, DECODE_SIG)
    if blocks.flags.writeable:
        blocks = blocks.view()
        blocks.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
        _decode_driver(blocks, fp16_table, out)((decode_row,), np.int64(qtype), blocks, fp16_table, out)


# decode_rows_with's arguments as decode_rows passes them (every row decoder has DECODE_SIG)
_DRIVER_SIG = (types.UniTuple(types.FunctionType(types.none(*DECODE_SIG)), 1), types.int64,
               types.Array(types.uint8, 2, "C", readonly=True), types.Array(types.float32, 1, "C"),
               types.Array(types.float32, 2, "C"))


def _decode_driver(blocks, fp16_table, out):
    """The driver's compiled code itself where the arguments have _DRIVER_SIG's types, else its
    dispatcher: the dispatcher types the function tuple on every call (~80 us), and a prompt's
    products decode one tile of rows at a time, a few hundred tiles per forward pass."""
    if (blocks.dtype == np.uint8 and blocks.flags.c_contiguous and out.dtype == np.float32 and out.flags.c_contiguous
            and out.flags.aligned and fp16_table.dtype == np.float32 and fp16_table.ndim == 1
            and fp16_table.flags.c_contiguous and fp16_table.flags.aligned):
        compiled = decode_rows_with.overloads.get(_DRIVER_SIG)
        if compiled is not None:
            return compiled.entry_point
    return decode_rows_with
