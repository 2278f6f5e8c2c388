"""Plain-numpy twins of the runtime's numba kernels (:mod:`quantkit.runtime.kernels`) and of the
fused products' chunk dots (:func:`quantkit.runtime.dot.chunk_dot`).

They compute the same numbers with whole-array numpy operations (the chunk dot value by value, in
float64): slower, easier to read, and what the tests hold the kernels to.  The runtime itself calls
only the kernels, so the twins live here, with the tests.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


def f16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest float16 (ties to even), kept as float32: what ggml's
    conversions to f16 do (see kernels._f16_round_at for the bit layout)."""
    x = np.ascontiguousarray(x, F32)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)).view(F32)
    a = np.abs(x)
    r = np.where(a < F32(2.0 ** -14), np.rint(x * F32(2.0 ** 24)) * F32(2.0 ** -24), r)
    with np.errstate(over="ignore"):
        return np.where(a < F32(65520.0), r, x.astype(np.float16).astype(F32)).astype(F32)


def causal_softmax_f16(scores: np.ndarray, pos0: int, rows_per_pos: int, scale: float) -> np.ndarray:
    """kernels.causal_softmax_f16, returning a new array."""
    n_rows, n_kv = scores.shape
    s = scores * F32(scale)
    seen = np.arange(n_kv)[None, :] <= (pos0 + np.arange(n_rows) // rows_per_pos)[:, None]
    s = np.where(seen, s, -np.inf)
    s = expf(s - s.max(axis=-1, keepdims=True))
    inv_total = (1.0 / s.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)
    return f16_round(s * inv_total)


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """x (n, k) with k a multiple of 32, as its q8_0/q8_1 blocks decode."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    d = (amax / F32(127)).astype(np.float16).astype(F32)
    return (np.rint(b * inv) * d).reshape(n, k)


def round_q8_K(x: np.ndarray) -> np.ndarray:
    """x (n, k) with k a multiple of 256, as its q8_K blocks decode."""
    n, k = x.shape
    b = x.reshape(n, k // 256, 256)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(m != 0, F32(-127) / m, F32(0)).astype(F32)
        d = np.where(iscale != 0, F32(1) / iscale, F32(0)).astype(F32)
    return (np.minimum(np.rint(b * iscale), F32(127)) * d).reshape(n, k)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (F32(1) + expf(-gate)) * up


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, per row (ggml sums the squares in double)."""
    ms = np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64)) / x.shape[1]
    scale = (1.0 / np.sqrt(ms + eps)).astype(F32)
    return (x * scale[:, None]) * weight


def _low(a, off, shift, mask, n):
    return (np.asarray(a[off:off + n], np.int64) >> shift) & mask


def chunk_twin(dot, a, o, tab, xq, xd, xo):
    """A chunk dot (``dot``: what chunk_dot made), value by value (float64 sums of value * xq * xd)."""
    runs, table, sup = dot.runs, dot.table, dot.sup
    a = np.asarray(a)

    def half(at):
        return float(a[o + at:o + at + 2].view(np.float16)[0])

    def scale(at):
        # an E8M0 exponent byte (MXFP4): 2^(e - 128), or a float16
        return 2.0 ** (int(a[o + at]) - 128) if dot.e8m0 else half(at)
    total = 0.0
    for k, r in enumerate(runs):
        n = r.n
        if r.shift is None:
            code = a[o + r.off:o + r.off + n].view(np.int8).astype(np.int64)
        else:
            if r.split:
                raw = np.asarray(a[o + r.off:o + r.off + n // 2], np.int64)
                code = np.concatenate([raw & 15, raw >> 4])
            else:
                code = _low(a, o + r.off, r.shift, r.mask, n)
            if r.hoff is not None:
                code = code | (_low(a, o + r.hoff, r.hshift, r.hmask, n) << r.hpos)
            if r.hword is not None:
                word = int(a[o + r.hword:o + r.hword + 4].view(np.uint32)[0])
                code = code | (((word >> (r.hbase + np.arange(n))) & 1) << r.hpos)
            if table:
                window = 0
                if sup is not None and sup.grid:
                    at, b = sup.grid[k]
                    window = ((int(a[o + at]) >> b) & 1) * sup.grid_step
                code = np.asarray(tab, np.int64)[window + code]
            else:
                code = code - r.bias
        if sup is None:
            value = scale(r.d_at) * code + (0.0 if r.m_at is None else half(r.m_at))
        else:
            value = (1.0 if sup.d_at is None else half(sup.d_at)) * sup.scales[k].value(a, o) * code
            if sup.mins:
                value = value - half(sup.dmin_at) * sup.mins[r.xoff // 32].value(a, o)
            if sup.run_mins:
                value = value - half(sup.dmin_at) * sup.run_mins[k].value(a, o)
        i = xo + r.xoff
        xv = np.asarray(xq[i:i + n], np.float64) * float(xd[i // 32])
        total += float(value @ xv)
    return total


def kl_divergence_rows(logits, base_p, base_plp):
    """Per row, Σ p (log p − log softmax(logits)) of the base probabilities ``base_p`` (whose
    Σ p log p is ``base_plp``)."""
    x = logits.astype(np.float64)
    lq = x - x.max(axis=1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
    return base_plp - (base_p * lq).sum(axis=1)


def _fma32(a, b, c):
    """float32 a * b + c rounded once, through float64 (the product is exact there; the sum's two
    roundings agree with one except in ties that the tests' values do not reach)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def expf(x: np.ndarray) -> np.ndarray:
    """kernels.expf (ggml's ggml_v_expf, AVX-512 form), written with whole arrays."""
    x = np.asarray(x, F32)
    h = lambda s: F32(float.fromhex(s))                                    # noqa: E731
    with np.errstate(all="ignore"):
        z = _fma32(x, h("0x1.715476p+0"), h("0x1.8p23"))
        n = z - h("0x1.8p23")
        b = _fma32(-n, h("0x1.7f7d1cp-20"), _fma32(-n, h("0x1.62e4p-1"), x))
        u = b * b
        j = _fma32(_fma32(_fma32(h("0x1.0e4020p-7"), b, h("0x1.573e2ep-5")), u,
                          _fma32(h("0x1.555e66p-3"), b, h("0x1.fffdb6p-2"))), u,
                   _fma32(h("0x1.ffffecp-1"), b, F32(1)))
        # scalef(j, n): j * 2^n rounded once (exact in float64, then one rounding to float32)
        res = (j.astype(np.float64) * np.exp2(np.where(np.abs(n) > 192, 0, n).astype(np.float64))).astype(F32)
        return np.where(np.abs(n) > 192, np.where(n > 0, F32(np.inf), F32(0)), res).astype(F32)
