"""Q8_0's quantizer in numpy: ggml's ``quantize_row_q8_0_ref`` byte for byte, without numba.

Per block of 32 values (specs/ggml-quants.md §1.2)::

    amax = MAX(amax, fabsf(x[j])) from 0, in order     d = amax / 127     id = d ? 1/d : 0
    block = fp16(d)[0:2]  int8(roundf(x[j] * id))[2:34]     (roundf: halves away from zero)

numba's kernel (kernels/legacy.py ``_q8_0_quantize_row``) computes the same bytes; this one exists
because a q8_0 quantize of an F16/BF16/F32 model needs no other kernel, and importing numba and
loading its cached kernels is ~0.3-0.5 s of such a command.  Rows are split between threads
(row_threads.py: numpy releases the GIL in its loops), each step writing into the thread's
reused work arrays.

Where every block is plain (no NaN or infinity, ``d`` a normal float32 or 0) each step is one numpy
operation over all blocks; a block holding a NaN, or whose scale is subnormal, takes the exact path
below with C's order of MAX (a NaN is kept or dropped by the comparison after it) and x86's int8
cast (a NaN, an infinity or a value beyond int32 is code 0), as numba's kernel does.

An F16 model's rows are quantized from their half bits (``quantize_f16_rows``), never widened to
float32 arrays first: numpy's float16 -> float32 cast is a scalar loop (~0.8 G values/s, slower
than all of the quantizer's other steps together), and every finite half is a plain block.
"""
from __future__ import annotations

import numpy as np

from ..row_threads import over_rows, scratch

QK = 32
BLOCK_BYTES = 2 + QK
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)
_SIGN_BIT = np.uint32(0x80000000)
_BELOW_HALF_BITS = np.float32(0.5 - 2.0 ** -25).view(np.uint32)     # nextafter(0.5, 0)


#: blocks quantized per step (a thread's share of a 4 MiB chunk on 2 threads): each step is ~15
#: numpy calls, whose overhead fewer and larger steps amortize (8192 blocks, 1 MiB of float32 per
#: work array, was ~7% slower on a Zen 5 with 1 MiB of L2 per core)
STEP_BLOCKS = 16384


def quantize_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 blocks of float32 rows ``x`` (n_rows, n_per_row), C-contiguous, into ``out`` (n_rows,
    n_per_row // 32 * 34) uint8."""
    n_rows, n = x.shape
    over_rows(lambda a, b: _quantize_steps(x[a:b].reshape(-1, QK), out[a:b].reshape(-1, BLOCK_BYTES)), n_rows, n)


def _quantize_steps(xb: np.ndarray, ob: np.ndarray) -> None:
    for s in range(0, xb.shape[0], STEP_BLOCKS):
        _quantize(xb[s:s + STEP_BLOCKS], ob[s:s + STEP_BLOCKS])


class NonFinite(ValueError):
    """An F16 row holds a NaN or an infinity: ``quantize_f16_rows`` leaves such rows to the float32
    path, which names the value (the quantize command refuses it)."""


#: (bits & 0x7fff) << 13 is |x| * 2^-112 as float32 bits for every finite half x (subnormals too:
#: their mantissa lands in float32's subnormal range), so a multiply by 2^112 gives |x| exactly
_HALF_TO_FLOAT_SCALE = np.float32(2.0 ** 112)
_HALF_INF_BITS = 0x7C00         # |x|'s bits at or above it: infinity or NaN


def quantize_f16_rows(bits: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 blocks of F16 rows given as their little-endian half bits ``bits`` (n_rows, n_per_row)
    uint16, C-contiguous, into ``out`` (n_rows, n_per_row // 32 * 34) uint8: the bytes
    ``quantize_rows`` gives for the same values widened to float32.  Raises NonFinite (``out`` then
    partly written) where a row holds a NaN or an infinity."""
    n_rows, n = bits.shape
    over_rows(lambda a, b: _f16_steps(bits[a:b].reshape(-1, QK), out[a:b].reshape(-1, BLOCK_BYTES)), n_rows, n)


def _f16_steps(hb: np.ndarray, ob: np.ndarray) -> None:
    for s in range(0, hb.shape[0], STEP_BLOCKS):
        _quantize_f16(hb[s:s + STEP_BLOCKS], ob[s:s + STEP_BLOCKS])


def _block_max(u: np.ndarray) -> np.ndarray:
    """max over each row of ``u`` (n, 32), by maxima of neighbouring pairs over the whole array (a
    reduction along the rows, or a maximum of two halves of each row, runs numpy's loop once per
    row: 3x slower)."""
    m = u.reshape(-1)
    while m.size > u.shape[0]:
        pairs = m.reshape(-1, 2)
        per_row = pairs.shape[0] // u.shape[0]          # 16, 8, 4, 2, 1: one work array per level
        out = scratch(f"q8_0.max{u.dtype.char}{per_row}", (pairs.shape[0],), u.dtype)
        m = np.maximum(pairs[:, 0], pairs[:, 1], out=out)
    return m


def _quantize_f16(hb: np.ndarray, ob: np.ndarray) -> None:
    """Blocks of half bits ``hb`` (n, 32) uint16 into ``ob`` (n, 34) uint8.

    ggml's arithmetic on |x| (roundf and x * id are odd functions: the sign is put back on the
    int8 code), with every step one numpy operation over all blocks of the step:

        u = bits & 0x7fff        amax = max u (as halves and as integers: the same order)
        d = amax / 127    id = d ? 1/d : 0    (d is 0 or a normal float32: amax >= 2^-24)
        |q| = trunc(|x| * id + (0.5 - 2^-25))        (roundf, as _quantize explains)
        q = (|q| ^ m) - m with m = 0xff for a negative x (bit 15 set), else 0
    """
    nb = hb.shape[0]
    u = np.bitwise_and(hb, np.uint16(0x7FFF), out=scratch("q8_0.u", (nb, QK), np.uint16))
    amax_bits = _block_max(u)
    if nb and int(amax_bits.max()) >= _HALF_INF_BITS:
        raise NonFinite
    # amax as float32 from its half bits as |x| below (numpy's float16 cast is a slower scalar loop)
    amax = np.left_shift(amax_bits, 13, dtype=np.uint32).view(np.float32)
    amax *= _HALF_TO_FLOAT_SCALE
    d = amax / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    v = np.left_shift(u, 13, out=scratch("q8_0.v", (nb, QK), np.uint32), dtype=np.uint32).view(np.float32)
    v *= _HALF_TO_FLOAT_SCALE                           # |x|
    v *= inv[:, None]
    v += np.float32(0.5 - 2.0 ** -25)
    mag = scratch("q8_0.mag", (nb, QK), np.uint8)
    np.copyto(mag, v, casting="unsafe")                 # |q| <= 127: the cast truncates
    neg = np.right_shift(hb.view(np.int16), 15, out=u.view(np.int16))      # -1 where x < 0, else 0
    m = scratch("q8_0.neg", (nb, QK), np.uint8)
    np.copyto(m, neg, casting="unsafe")
    mag ^= m
    np.subtract(mag, m, out=ob[:, 2:])
    _put_scales(ob, d.astype("<f2"))


def _put_scales(ob: np.ndarray, d16: np.ndarray) -> None:
    """The fp16 scales ``d16`` into bytes 0-1 of each block of ``ob`` (n, 34), as one column of
    little-endian 16-bit words (blocks are 34 bytes: every scale is 2-byte aligned): a single strided
    copy, where ``ob[:, :2]`` would run numpy's loop once per block over 2 bytes (~3x slower)."""
    ob.view("<u2")[:, 0] = d16.view("<u2")


def _c_order_max(a: np.ndarray) -> np.ndarray:
    """``amax = amax > a[j] ? amax : a[j]`` from 0 over j, per row of ``a`` (n, 32), as C's MAX."""
    amax = np.zeros(a.shape[0], np.float32)
    for j in range(QK):
        amax = np.where(amax > a[:, j], amax, a[:, j])
    return amax


def _quantize(xb: np.ndarray, ob: np.ndarray) -> None:
    """Blocks ``xb`` (n, 32) float32 into ``ob`` (n, 34) uint8."""
    nb = xb.shape[0]
    a = np.abs(xb, out=scratch("q8_0.a", (nb, QK), np.float32))
    # max |x| of each block (_block_max); a NaN anywhere in a block makes its max NaN
    amax = _block_max(a)
    nan = np.isnan(amax)
    if nan.any():
        amax[nan] = _c_order_max(a[nan])
    with np.errstate(all="ignore"):
        d = amax / np.float32(127)
        inv = np.zeros_like(d)
        np.divide(np.float32(1), d, out=inv, where=d != 0)          # a NaN d gives a NaN inverse, as in C
        v = np.multiply(xb, inv[:, None], out=scratch("q8_0.v", (nb, QK), np.float32))
        # roundf(v) = trunc(v + copysign(0.5 - 2^-25, v)) for every finite float32 v: a half gets
        # within half an ulp of the next integer and rounds up to it (to even where it is exactly
        # halfway: 1 - 2^-25 -> 1), while below a half the sum stays more than half an ulp short
        # of it; v has the sign of x (inv >= 0), so the constant takes x's sign bit
        half = np.bitwise_and(xb.view(np.uint32), _SIGN_BIT, out=scratch("q8_0.half", (nb, QK), np.uint32))
        half |= _BELOW_HALF_BITS
        np.add(v, half.view(np.float32), out=v)
        d16 = d.astype("<f2")
    codes = ob[:, 2:].view(np.int8)
    plain = np.isfinite(amax) & ((d >= _FLT_MIN) | (d == 0))
    if plain.all():
        np.copyto(codes, v, casting="unsafe")       # the cast truncates; |v| < 128 here
    else:
        # C's (int8_t)roundf(v) on x86: a NaN, an infinity or a value beyond int32 truncates to
        # INT32_MIN (low byte 0); other values keep their low byte
        with np.errstate(invalid="ignore"):
            q = np.trunc(v)
            inside = np.abs(q) < np.float32(2.0 ** 31)          # False for NaN
        codes[:] = (np.where(inside, q, 0).astype(np.int64) & 0xFF).astype(np.uint8).view(np.int8)
        bits, nan_d = d.view(np.uint32), np.isnan(d)
        d16 = d16.view(np.uint16)
        d16[nan_d] = ((bits[nan_d] >> 16) & 0x8000) | 0x7E00          # GGML_FP32_TO_FP16's NaN
    _put_scales(ob, d16)
