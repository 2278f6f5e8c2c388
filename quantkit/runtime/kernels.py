"""numba kernels of the CPU runtime: the elementwise steps between the matrix products.

Each has a plain-numpy twin in tests/runtime_twins.py that the tests compare it
with.  None allocates its output: the caller passes it, so the same kernel serves a whole batch of
tokens or one token.  Rows run in parallel (``prange``); inside the matrix-product thread pool,
where numba runs single-threaded, they run one after the other, and so do the few rows of a
generation step (the ``*_few`` loops).

All arithmetic stays in float32 where ggml's does (numba keeps float32 * float32 in float32), and
the sums ggml forms in double are formed in double here too.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..cpu import half_to_float
from . import dot

F32 = np.float32


@intrinsic
def _f32_bits(typingctx, x):
    """The bit pattern of a float32 as uint32 (a register move: loops using it still vectorize)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, u):
    """The float32 whose bit pattern is the low 32 bits of the integer u."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@njit(cache=True, inline="always")
def _f16_value(x):
    """x rounded to the nearest float16 value (ties to even), as float32; branch-free, so loops
    over it vectorize.  With u the bits of x:

      normal    |x| >= 2^-14  keep 10 of the 23 mantissa bits:  u + 0x0FFF + (bit 13 of u), the low
                13 bits cleared (a carry into the exponent is the rounding up to the next binade)
                  u: s eeeeeeee mmmmmmmmmm|m mmmm mmmm mmmm
                                    kept ^ ^ bit 13      ^ cleared
      subnormal |x| <  2^-14  multiples of 2^-24:  (|x| + 0.75) - 0.75, since float32's spacing in
                [0.5, 1) is 2^-24 and 0.75 is an even multiple (ties go to even multiples); x's sign
      overflow  |x| >= 65520  x * inf: +-inf, and NaN stays NaN
    """
    u = _f32_bits(x)
    normal = _bits_f32((u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000))
    a = abs(x)
    sub = _bits_f32(_f32_bits(np.float32((a + F32(0.75)) - F32(0.75))) | (u & np.uint32(0x80000000)))
    r = normal if a >= F32(2.0 ** -14) else sub
    return r if a < F32(65520.0) else x * F32(np.inf)


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (float32): llvm.fma, as dot.py's vector ones (an FMA instruction where
    numba's target has one, libm's correctly rounded fmaf where not: the same bits on every CPU);
    a loop of them still vectorizes."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(cache=True, inline="always")
def _f16_bits(x):
    """x rounded to float16 (ties to even) as its bits, uint16: numpy's float32 -> float16 cast
    (any NaN becomes the quiet NaN 0x7e00, with x's sign).  From v = _f16_value(x), exact in
    float16, branch-free:

      normal     |v| >= 2^-14  v's bits u >> 13, less the exponent bias difference (127 - 15) << 10
      subnormal  |v| <  2^-14  |v| * 2^24, an integer below 1024
      inf, NaN   0x7c00, 0x7e00
      and v's sign bit, from bit 31 to bit 15."""
    v = _f16_value(x)
    u = _f32_bits(v)
    a = abs(v)
    normal = ((u >> np.uint32(13)) - np.uint32(112 << 10)) & np.uint32(0x7FFF)
    sub = np.uint32((a if a < F32(2.0 ** -14) else F32(0.0)) * F32(2.0 ** 24))
    r = normal if a >= F32(2.0 ** -14) else sub
    r = r if a <= F32(65504.0) else (np.uint32(0x7C00) if a == F32(np.inf) else np.uint32(0x7E00))
    return np.uint16(r | ((u >> np.uint32(16)) & np.uint32(0x8000)))


# ggml_v_expf's constants, as its hexadecimal float literals
_ROUNDER = F32(float.fromhex("0x1.8p23"))                       # adding it rounds to an integer
_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_LN2_HI, _LN2_LO = F32(float.fromhex("0x1.62e4p-1")), F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5 = (F32(float.fromhex(h)) for h in (
    "0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7"))


@njit(cache=True, inline="always")
def expf(x):
    """exp(x) in float32 as ggml's ggml_v_expf computes it (its AVX-512 form, adapted from Arm's
    optimized routines; at most 2.3 ulp from exp, measured): branch-free, so a loop over it
    vectorizes, where numba's np.exp is a call to libm's expf per value (the attention and SiLU of
    a generation step spent most of their time there).

      n = round(x / ln 2)             the 1.5 * 2^23 trick: z = x * (1 / ln 2) + 1.5 * 2^23 (fused)
      b = x - n ln 2                  ln 2 in two parts, each subtracted by a fused multiply-add
      j = 1 + b + b^2/2 + ...         a degree-5 polynomial of exp(b), Estrin's order
      exp(x) = j * 2^n                k = 2^n built from z's low bits shifted into the exponent;
                                      _mm512_scalef_ps rounds j * 2^n once, and so do the products here

    Where |n| > 126 (2^n not a normal float) 2^n is applied in two exact steps, 2^(n -+ 64) then
    2^(+-64) (one rounding, the last); where |n| > 192 the result is +inf above, +0 below (exp(-inf)
    = 0); NaN stays NaN.  (The AVX2 form, fma(j - 1, k, k), gave the SmolLM2 q4_K prompt 84% of
    ik_llama.cpp's top tokens, this one 91%: tests/test_runtime_llama.py.)
    """
    z = _fma(x, _LOG2E, _ROUNDER)
    n = z - _ROUNDER
    b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    e = _f32_bits(z) << np.uint32(23)
    k = _bits_f32(e + np.uint32(0x3F800000))                    # 2^n: e plus the bits of 1.0
    u = b * b
    j = _fma(_fma(_fma(_EXP_C5, b, _EXP_C4), u, _fma(_EXP_C3, b, _EXP_C2)), u, _fma(_EXP_C1, b, F32(1.0)))
    a = abs(n)
    big = np.uint32(64 << 23) if n > F32(0.0) else np.uint32((-64 << 23) & 0xFFFFFFFF)
    wide = (j * _bits_f32(e - big + np.uint32(0x3F800000))) * _bits_f32(big + np.uint32(0x3F800000))
    res = wide if a > F32(126.0) else j * k
    return (F32(np.inf) if n > F32(0.0) else F32(0.0)) if a > F32(192.0) else res


# Each elementwise step is a row kernel with two loops over the rows: ``*_rows`` (parallel) and
# ``*_few`` (one after the other: for the few rows of a generation step a parallel launch costs
# more than the work).

@njit(cache=True, inline="always")
def _f16_round_row(x, r, out):
    for i in range(x.shape[1]):
        out[r, i] = _f16_value(x[r, i])


@njit(cache=True, parallel=True)
def f16_round_rows(x, out):
    """out = x rounded to float16 values, x and out (n_rows, n) float32 (out may be x)."""
    for r in prange(x.shape[0]):
        _f16_round_row(x, r, out)


@njit(cache=True)
def f16_round_few(x, out):
    for r in range(x.shape[0]):
        _f16_round_row(x, r, out)


@njit(cache=True, parallel=True)
def scale_mask_max(scores, pos0, rows_per_pos, scale, row_max):
    """Softmax, first step, in place on scores (n_rows, n_kv): multiply by ``scale``, set the keys
    a row's query may not see to -inf, and row_max[r] = the row's maximum.

    Row r belongs to the query at position pos0 + r // rows_per_pos (the query heads that share a
    key head sit side by side), which sees keys 0 .. that position."""
    n_rows, n_kv = scores.shape
    for r in prange(n_rows):
        n_seen = min(n_kv, pos0 + r // rows_per_pos + 1)
        m = -np.inf
        for j in range(n_seen):
            s = scores[r, j] * scale
            scores[r, j] = s
            m = max(m, s)
        for j in range(n_seen, n_kv):
            scores[r, j] = -np.inf
        row_max[r] = m


@njit(cache=True, error_model="numpy", parallel=True)
def exp_shifted_rows(scores, row_max):
    """Softmax, middle step, in place: scores[r] <- exp(scores[r] - row_max[r]) (:func:`expf`,
    as attend_few's; a key masked with -inf gives 0)."""
    for r in prange(scores.shape[0]):
        m = row_max[r]
        for j in range(scores.shape[1]):
            scores[r, j] = expf(scores[r, j] - m)


@njit(cache=True, parallel=True)
def normalize_f16(e):
    """Softmax, last step, in place on the exponentials e (n_rows, n_kv): each row multiplied by
    1 / its sum (summed in double, the factor rounded to float32, as ggml's soft_max does) and
    rounded to f16, as ggml converts the probabilities before multiplying them with the f16 values."""
    for r in prange(e.shape[0]):
        total = 0.0
        for j in range(e.shape[1]):
            total += np.float64(e[r, j])
        inv_total = F32(1.0 / total)
        for j in range(e.shape[1]):
            e[r, j] = _f16_value(e[r, j] * inv_total)


@njit(cache=True, parallel=True)
def round_q8_0_rows(x, out):
    """out = x as its q8_0 (or q8_1: the same values) blocks of 32 decode, x (n_rows, k)."""
    for r in prange(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            amax = F32(0.0)
            for i in range(b, b + 32):
                amax = max(amax, abs(x[r, i]))
            inv = F32(127.0) / amax if amax > 0 else F32(0.0)
            d = _f16_value(amax / F32(127.0))        # stored as f16
            for i in range(b, b + 32):
                out[r, i] = np.float32(np.rint(x[r, i] * inv)) * d


@njit(cache=True, parallel=True)
def round_q8_K_rows(x, out):
    """out = x as its q8_K blocks of 256 decode, x (n_rows, k): the value of largest magnitude m
    (the first one) sets iscale = -127 / m, q = min(127, rint(iscale * x)), d = 1 / iscale."""
    for r in prange(x.shape[0]):
        for b in range(0, x.shape[1], 256):
            amax, m = F32(0.0), F32(0.0)
            for i in range(b, b + 256):
                if abs(x[r, i]) > amax:
                    amax, m = abs(x[r, i]), x[r, i]
            iscale = F32(-127.0) / m if m != 0 else F32(0.0)
            d = F32(1.0) / iscale if iscale != 0 else F32(0.0)
            for i in range(b, b + 256):
                out[r, i] = min(np.float32(np.rint(iscale * x[r, i])), F32(127.0)) * d


@njit(cache=True, error_model="numpy", inline="always")
def _silu_mul_row(gate, up, r, out):
    for i in range(gate.shape[1]):
        g = gate[r, i]
        out[r, i] = g / (F32(1.0) + expf(-g)) * up[r, i]


@njit(cache=True, error_model="numpy", parallel=True)
def silu_mul_rows(gate, up, out):
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up, all (n_rows, n) float32 (ggml's
    ggml_vec_mul_silu_f32 with its :func:`expf`).  numpy's error model: the divisor (>= 1, inf or
    NaN) needs no zero check, which would keep the loop from vectorizing (8x slower)."""
    for r in prange(gate.shape[0]):
        _silu_mul_row(gate, up, r, out)


@njit(cache=True, error_model="numpy")
def silu_mul_few(gate, up, out):
    for r in range(gate.shape[0]):
        _silu_mul_row(gate, up, r, out)


@njit(cache=True, inline="always")
def _rmsnorm_row(x, r, weight, eps, out):
    n = x.shape[1]
    ss = 0.0
    for i in range(n):
        v = np.float64(x[r, i])
        ss += v * v
    scale = F32(1.0 / np.sqrt(ss / n + eps))
    for i in range(n):
        out[r, i] = (x[r, i] * scale) * weight[i]


@njit(cache=True, parallel=True)
def rmsnorm_rows(x, weight, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight per row, the mean of squares in double."""
    for r in prange(x.shape[0]):
        _rmsnorm_row(x, r, weight, eps, out)


@njit(cache=True)
def rmsnorm_few(x, weight, eps, out):
    for r in range(x.shape[0]):
        _rmsnorm_row(x, r, weight, eps, out)


@njit(cache=True, inline="always")
def _rotate_token(x, t, cos, sin, n_rot, neox):
    half = n_rot // 2
    for h in range(x.shape[1]):
        for i in range(half):
            ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
            a, b = x[t, h, ia], x[t, h, ib]
            x[t, h, ia] = a * cos[t, i] - b * sin[t, i]
            x[t, h, ib] = a * sin[t, i] + b * cos[t, i]


@njit(cache=True, parallel=True)
def rotate_pairs(x, cos, sin, n_rot, neox):
    """The rotary embedding in place: x (n_tokens, n_heads, head_dim), the angles of token t as
    cos[t], sin[t] (n_rot / 2 each).  Pair i is (x[2i], x[2i+1]) in normal mode and
    (x[i], x[i + n_rot/2]) in neox mode; dims from n_rot on are left alone."""
    for t in prange(x.shape[0]):
        _rotate_token(x, t, cos, sin, n_rot, neox)


@njit(cache=True)
def rotate_few(x, cos, sin, n_rot, neox):
    for t in range(x.shape[0]):
        _rotate_token(x, t, cos, sin, n_rot, neox)


@njit(cache=True)
def rope_store_few(q, k, v, cos, sin, n_rot, neox, k_rows, v_rows, pos0):
    """A generation step's rotary embedding and cache write in one call: q (n_tokens, n_head, k_dim)
    and k (n_tokens, n_head_kv, k_dim) rotated in place as :func:`rotate_few` does, then k and v
    (n_tokens, n_head_kv, v_dim) written as float16 bits (:func:`_f16_bits`: numpy's cast, what
    KVCache.store writes) into k_rows / v_rows (n_ctx, n_head_kv, dim) uint16 at positions pos0.."""
    for t in range(q.shape[0]):
        _rotate_token(q, t, cos, sin, n_rot, neox)
        _rotate_token(k, t, cos, sin, n_rot, neox)
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_rows[pos0 + t, h, d] = _f16_bits(k[t, h, d])
            for d in range(v.shape[2]):
                v_rows[pos0 + t, h, d] = _f16_bits(v[t, h, d])


@njit(cache=True)
def add_rmsnorm_few(x, y, weight, eps, total, out):
    """total = x + y (float32) and out = its :func:`rmsnorm_few`, rows in turn: a residual add and
    the norm after it (the same operations in the same order as the two apart)."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            total[r, i] = x[r, i] + y[r, i]
        _rmsnorm_row(total, r, weight, eps, out)


@njit(cache=True)
def add_square_sums(x, sums):
    """sums (n_in,) float64 += Σ over the rows of x (n_rows, n_in) of x² (squared in float32, added
    in double, row after row: llama-imatrix's order)."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            v = x[r, i] * x[r, i]
            sums[i] += np.float64(v)


@njit(cache=True, inline="always")
def _row_max(row):
    m = row[0]
    for j in range(1, row.shape[0]):
        m = max(m, row[j])
    return m


@njit(cache=True, parallel=True)
def target_nll(logits, targets, out):
    """out[r] = -log softmax(logits[r])[targets[r]] as llama-perplexity forms it: exp(logit - max)
    in float, summed in double."""
    n = logits.shape[1]
    for r in prange(logits.shape[0]):
        m = _row_max(logits[r])
        total = 0.0
        for j in range(n):
            total += np.float64(np.exp(logits[r, j] - m))
        out[r] = np.log(total) - np.float64(logits[r, targets[r]] - m)


@njit(cache=True, parallel=True)
def kl_divergence_rows(logits, base_p, base_plp, out):
    """out[r] = Σ_j p_j (log p_j − log q_j): the KL divergence of q = softmax(logits[r]) (float32)
    from a base distribution p = base_p[r] (float64) whose Σ_j p_j log p_j is base_plp[r].  In
    double, as  Σ p log p − Σ p (x − max) + log Σ exp(x − max) · Σ p  (one pass after the max)."""
    n = logits.shape[1]
    for r in prange(logits.shape[0]):
        m = _row_max(logits[r])
        total = 0.0
        px = 0.0
        ps = 0.0
        for j in range(n):
            x = np.float64(logits[r, j]) - np.float64(m)
            total += np.exp(x)
            px += base_p[r, j] * x
            ps += base_p[r, j]
        out[r] = base_plp[r] - px + np.log(total) * ps


@njit(cache=True, error_model="numpy", inline="always")
def _exp_shifted(e, n, m):
    """e[:n] <- exp(e[:n] - m); returns 1 / their sum, summed in double and rounded to float (what
    both attention kernels multiply the exponentials by).  Two loops: the exponentials vectorize,
    the sum keeps its order (one value after the other).  The difference in float32, as ggml's."""
    m = F32(m)
    for j in range(n):
        e[j] = expf(e[j] - m)
    total = 0.0
    for j in range(n):
        total += np.float64(e[j])
    return F32(1.0 / total)


# rows ahead that attend_few's scores ask for: about a memory latency of their row dots.  A
# generation step's attention reads each layer's keys and values after the step's weights have
# pushed them out of the caches: one row after the other, each a miss, its time was mostly waiting.
# (Both 64-byte lines of a 128-byte row are asked for: with the first only, a cold layer of
# SmolLM2 took 25 us instead of 22 at 300 keys.)
PREFETCH_ROWS = 16


def _row_ptr(context, builder, arytype, value, r, c, elt, n):
    """Pointer to a[r, c] as <n x elt>*, a a 2-D array (strides in bytes)."""
    ary = context.make_array(arytype)(context, builder, value)
    s0, s1 = cgutils.unpack_tuple(builder, ary.strides, 2)
    i64 = ir.IntType(64)
    byte = builder.add(builder.mul(dot._as(builder, r, i64), s0), builder.mul(dot._as(builder, c, i64), s1))
    ptr = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [byte])
    return builder.bitcast(ptr, ir.VectorType(elt, n).as_pointer())


def _value_sums(n_heads, width):
    """``sums(a, hk, d, p, h0, n, y, yh)``: for each of ``n_heads`` heads h,
    y[yh + h, d:d + width] = Σ_j p[h0 + h, j] * half(a[j, hk, d:d + width]) over j < n, in key order
    from +0 (a 3-D uint16 of float16 bits, p and y 2-D float32).

    Each key's value row is widened once for all the heads sharing it, and the sums stay in
    registers over the keys (the per-head kernel before them loaded and stored y at every key).
    Per lane a product p * v (fmul) added to the sum (fadd), one key after the other from +0,
    never fused (tests/test_generic_cpu.py widens every half through them, on both targets)."""
    @intrinsic
    def sums(typingctx, a, hk, d, p, h0, n, y, yh):
        def codegen(context, builder, sig, args):
            a_v, hk_v, d_v, p_v, h0_v, n_v, y_v, yh_v = args
            i64 = ir.IntType(64)
            vt = ir.VectorType(ir.FloatType(), width)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, [0.0] * width)) for _ in range(n_heads)]
            hk64, d64, h064 = (dot._as(builder, v, i64) for v in (hk_v, d_v, h0_v))
            with cgutils.for_range(builder, dot._as(builder, n_v, i64)) as loop:
                j = loop.index
                w = half_to_float(builder, builder.load(
                    dot._half_ptr(context, builder, sig.args[0], a_v, j, hk64, d64, width), align=2))
                for h, acc in enumerate(accs):
                    pj = builder.load(_row_ptr(context, builder, sig.args[3], p_v,
                                               builder.add(h064, ir.Constant(i64, h)), j, ir.FloatType(), 1))
                    pv = dot._splat(builder, builder.extract_element(pj, ir.Constant(ir.IntType(32), 0)), width)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, pv)), acc)
            yh64 = dot._as(builder, yh_v, i64)
            for h, acc in enumerate(accs):
                yp = _row_ptr(context, builder, sig.args[6], y_v, builder.add(yh64, ir.Constant(i64, h)), d64,
                              ir.FloatType(), width)
                builder.store(builder.load(acc), yp, align=4)
            return context.get_dummy_value()
        return types.none(a, hk, d, p, h0, n, y, yh), codegen
    return sums


_sums32 = tuple(_value_sums(g, 32) for g in (1, 2, 3, 4))
_sums8 = tuple(_value_sums(g, 8) for g in (1, 2, 3, 4))
_sums32_1, _sums32_2, _sums32_3, _sums32_4 = _sums32
_sums8_1, _sums8_2, _sums8_3, _sums8_4 = _sums8


@njit(cache=True, error_model="numpy", inline="always")
def _value_rows(values, hk, p, n, y, yh, g):
    """y[yh + h] = Σ_j p[h, j] * half(values[j, hk]) over j < n for each of the g heads h of key
    head hk, up to four heads per pass over the keys: 32 lanes per step, then 8, then one (the
    last v_dim % 8, the same operations one lane at a time)."""
    v_dim = values.shape[2]
    n32 = v_dim // 32 * 32
    n8 = v_dim // 8 * 8
    for h0 in range(0, g, 4):
        gg = min(4, g - h0)
        for d in range(0, n32, 32):
            if gg == 4:
                _sums32_4(values, hk, d, p, h0, n, y, yh + h0)
            elif gg == 3:
                _sums32_3(values, hk, d, p, h0, n, y, yh + h0)
            elif gg == 2:
                _sums32_2(values, hk, d, p, h0, n, y, yh + h0)
            else:
                _sums32_1(values, hk, d, p, h0, n, y, yh + h0)
        for d in range(n32, n8, 8):
            if gg == 4:
                _sums8_4(values, hk, d, p, h0, n, y, yh + h0)
            elif gg == 3:
                _sums8_3(values, hk, d, p, h0, n, y, yh + h0)
            elif gg == 2:
                _sums8_2(values, hk, d, p, h0, n, y, yh + h0)
            else:
                _sums8_1(values, hk, d, p, h0, n, y, yh + h0)
    for h in range(g):
        for d in range(n8, v_dim):
            y[yh + h, d] = 0
        for j in range(n):
            for d in range(n8, v_dim):
                y[yh + h, d] += p[h, j] * dot.half_bits(values[j, hk, d])


def _key_scores(n_heads):
    """``scores(a, v, hk, x, h0, n, k_dim, scale, e)``: for each of ``n_heads`` heads h and key
    j < n, e[h0 + h, j] = (Σ_d half(a[j, hk, d]) * x[h0 + h, d]) * scale over d < k_dim, the sum
    in the order of the per-head kernel before it (32-wide chains of fused multiply-adds
    (llvm.fma) folded to 8, 8-wide steps, folded to one, then the last k_dim % 8 values one by one, multiplied then added), each
    key row widened once for the heads sharing it (a: the keys, 3-D uint16 of float16 bits; x, e:
    2-D float32, x's rows contiguous; scale float32).  Per key it asks for the first and last
    value of key row min(j + PREFETCH_ROWS, n - 1) and of value row j (v: the values, 3-D uint16,
    only prefetched: llvm.prefetch, a hint that changes no value and never faults)."""
    @intrinsic
    def scores(typingctx, a, v, hk, x, h0, n, k_dim, scale, e):
        if scale != types.float32:
            return None

        def codegen(context, builder, sig, args):
            a_v, v_v, hk_v, x_v, h0_v, n_v, kd_v, sc_v, e_v = args
            i64, f32 = ir.IntType(64), ir.FloatType()
            zero, i32_0 = ir.Constant(i64, 0), ir.Constant(ir.IntType(32), 0)
            hk64, h064, n64, kd = (dot._as(builder, w, i64) for w in (hk_v, h0_v, n_v, kd_v))
            n32 = builder.udiv(kd, ir.Constant(i64, 32))
            n8 = builder.udiv(kd, ir.Constant(i64, 8))
            acc32 = [cgutils.alloca_once(builder, ir.VectorType(f32, 32)) for _ in range(n_heads)]
            acc8 = [cgutils.alloca_once(builder, ir.VectorType(f32, 8)) for _ in range(n_heads)]
            acc1 = [cgutils.alloca_once(builder, f32) for _ in range(n_heads)]
            xrows = [builder.bitcast(_row_ptr(context, builder, sig.args[3], x_v, builder.add(h064, ir.Constant(i64, h)),
                                              zero, f32, 1), f32.as_pointer()) for h in range(n_heads)]
            i8p = ir.IntType(8).as_pointer()
            c32 = ir.IntType(32)
            pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, c32, c32, c32]),
                                                "llvm.prefetch.p0i8")
            k_last, v_last = (builder.sub(cgutils.unpack_tuple(builder, context.make_array(t)(context, builder, w).shape, 3)[2],
                                          ir.Constant(i64, 1)) for t, w in ((sig.args[0], a_v), (sig.args[1], v_v)))
            with cgutils.for_range(builder, n64) as loop:
                j = loop.index
                ahead = builder.add(j, ir.Constant(i64, PREFETCH_ROWS))
                last = builder.sub(n64, ir.Constant(i64, 1))
                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)
                for arr_t, arr_v, row, last_d in ((sig.args[0], a_v, ahead, k_last), (sig.args[1], v_v, j, v_last)):
                    for d_pf in (zero, last_d):     # both cache lines of a 128-byte row
                        p = builder.bitcast(dot._half_ptr(context, builder, arr_t, arr_v, row, hk64, d_pf, 1), i8p)
                        builder.call(pf, [p, ir.Constant(c32, 0), ir.Constant(c32, 3), ir.Constant(c32, 1)])
                row = builder.bitcast(dot._half_ptr(context, builder, sig.args[0], a_v, j, hk64, zero, 1),
                                      ir.HalfType().as_pointer())

                def fma_steps(accs, width, first, end):
                    """accs[h] = fma(half(row[d:d + width]), x_h[d:d + width], accs[h]) for the
                    width-wide steps first..end of the row, in order."""
                    with cgutils.for_range(builder, end, start=first) as dl:
                        d = builder.mul(dl.index, ir.Constant(i64, width))
                        w = half_to_float(builder, dot._load(builder, row, d, width, ir.HalfType()))
                        for h in range(n_heads):
                            builder.store(dot._fma(builder, w, dot._load(builder, xrows[h], d, width, f32),
                                                   builder.load(accs[h])), accs[h])
                for h in range(n_heads):
                    builder.store(ir.Constant(ir.VectorType(f32, 32), [0.0] * 32), acc32[h])
                fma_steps(acc32, 32, zero, n32)
                for h in range(n_heads):
                    builder.store(dot._fold(builder, builder.load(acc32[h]), 32, 8), acc8[h])
                fma_steps(acc8, 8, builder.mul(n32, ir.Constant(i64, 4)), n8)
                for h in range(n_heads):
                    builder.store(builder.extract_element(dot._fold(builder, builder.load(acc8[h]), 8, 1), i32_0), acc1[h])
                with cgutils.for_range(builder, kd, start=builder.mul(n8, ir.Constant(i64, 8))) as dl:
                    d = dl.index
                    w = half_to_float(builder, builder.load(builder.gep(row, [d])))
                    for h in range(n_heads):
                        xd = builder.load(builder.gep(xrows[h], [d]))
                        builder.store(builder.fadd(builder.load(acc1[h]), builder.fmul(w, xd)), acc1[h])
                for h in range(n_heads):
                    ep = _row_ptr(context, builder, sig.args[8], e_v, builder.add(h064, ir.Constant(i64, h)), j, f32, 1)
                    s = builder.fmul(builder.load(acc1[h]), sc_v)
                    builder.store(builder.insert_element(ir.Constant(ir.VectorType(f32, 1), ir.Undefined), s, i32_0), ep)
            return context.get_dummy_value()
        return types.none(a, v, hk, x, h0, n, k_dim, scale, e), codegen
    return scores


_scores_1, _scores_2, _scores_3, _scores_4 = (_key_scores(g) for g in (1, 2, 3, 4))


@njit(cache=True, error_model="numpy", inline="always")
def _probabilities3(e, n, ha, hb, hc):
    """Rows ha, hb, hc of e (scores; ha <= hb <= hc, a repeated one done once) -> each row's
    softmax rounded to f16: _exp_shifted's maximum, exponentials and sum in double, then the
    products rounded (a loop that vectorizes).  The maximum and the sum are chains of dependent
    operations, one value after the other: three rows side by side run three chains at once
    (each row's operations and their order are its own alone)."""
    ma = mb = mc = -np.inf
    for j in range(n):
        ma = max(ma, e[ha, j])
        mb = max(mb, e[hb, j])
        mc = max(mc, e[hc, j])
    ma, mb, mc = F32(ma), F32(mb), F32(mc)
    for j in range(n):
        e[ha, j] = expf(e[ha, j] - ma)
    if hb != ha:
        for j in range(n):
            e[hb, j] = expf(e[hb, j] - mb)
    if hc != hb:
        for j in range(n):
            e[hc, j] = expf(e[hc, j] - mc)
    ta = tb = tc = 0.0
    for j in range(n):
        ta += np.float64(e[ha, j])
        tb += np.float64(e[hb, j])
        tc += np.float64(e[hc, j])
    ia, ib, ic = F32(1.0 / ta), F32(1.0 / tb), F32(1.0 / tc)
    for j in range(n):
        e[ha, j] = _f16_value(e[ha, j] * ia)
    if hb != ha:
        for j in range(n):
            e[hb, j] = _f16_value(e[hb, j] * ib)
    if hc != hb:
        for j in range(n):
            e[hc, j] = _f16_value(e[hc, j] * ic)


@njit(cache=True, error_model="numpy", inline="always")
def _attend_group(q, keys, values, pos0, scale, out, t, hk, h_lo, g):
    """Token t's attention for g query heads of key head hk, from its query head h_lo on (the body
    of attend_few's jobs).  Each key row is read once for the g heads (from memory, after a step's
    weights pushed it out of the caches), and so is each value row; per head the float
    operations are those of one head alone, in the same order."""
    k_dim = q.shape[2]
    n_seen = pos0 + t + 1
    h_first = hk * (q.shape[1] // keys.shape[1]) + h_lo
    scratch = np.empty(g * (n_seen + k_dim), F32)
    e = scratch[:g * n_seen].reshape((g, n_seen))
    qv = scratch[g * n_seen:].reshape((g, k_dim))   # the queries rounded to f16
    for h in range(g):
        for d in range(k_dim):
            qv[h, d] = _f16_value(q[t, h_first + h, d])
    for h0 in range(0, g, 4):              # the scores, up to four heads per pass over the keys
        gg = min(4, g - h0)
        if gg == 4:
            _scores_4(keys, values, hk, qv, h0, n_seen, k_dim, scale, e)
        elif gg == 3:
            _scores_3(keys, values, hk, qv, h0, n_seen, k_dim, scale, e)
        elif gg == 2:
            _scores_2(keys, values, hk, qv, h0, n_seen, k_dim, scale, e)
        else:
            _scores_1(keys, values, hk, qv, h0, n_seen, k_dim, scale, e)
    for h0 in range(0, g, 3):
        _probabilities3(e, n_seen, h0, min(h0 + 1, g - 1), min(h0 + 2, g - 1))
    _value_rows(values, hk, e, n_seen, out[t], h_first, g)


@njit(cache=True, error_model="numpy", parallel=True)
def attend_few(q, keys, values, pos0, scale, out):
    """Causal grouped-query attention of a few tokens, straight from the float16 cache:
    q (n_tokens, n_head, k_dim) float32 queries (rounded to f16 here, as ggml's copy for K·Q); keys (n_ctx, n_head_kv,
    k_dim) and values (n_ctx, n_head_kv, v_dim) uint16 (float16 bits, rows contiguous); token t
    sits at position pos0 + t and sees keys 0 .. pos0 + t -> out (n_tokens, n_head, v_dim).

    ggml's numbers: scores q·k in float, times ``scale``, the exponentials of (score - max) summed
    in double, the probabilities rounded to f16, then Σ p v; each (token, head) in a fixed order,
    whatever the CPU and the number of tokens (a prompt's attention is its steps').

    A job is one token's g query heads sharing a key head (:func:`_attend_group`).  Token t's work
    grows with t, and prange gives each thread a contiguous run of jobs: the jobs visit the tokens
    0, n-1, 1, n-2, ... so that every run holds early and late ones alike."""
    n_tok = q.shape[0]
    n_head_kv = keys.shape[1]
    g = q.shape[1] // n_head_kv
    for job in prange(n_tok * n_head_kv):
        jt, hk = job // n_head_kv, job % n_head_kv
        t = jt // 2 if jt % 2 == 0 else n_tok - 1 - jt // 2
        _attend_group(q, keys, values, pos0, scale, out, t, hk, 0, g)


# ---- a float32 cache (llama.cpp's -ctk/-ctv f32): ggml multiplies it in float32, rounding nothing ----

@njit(cache=True, parallel=True)
def normalize_f32(e):
    """:func:`normalize_f16` without the rounding to f16: the probabilities ggml multiplies f32 values with."""
    for r in prange(e.shape[0]):
        total = 0.0
        for j in range(e.shape[1]):
            total += np.float64(e[r, j])
        inv_total = F32(1.0 / total)
        for j in range(e.shape[1]):
            e[r, j] = e[r, j] * inv_total


@njit(cache=True, error_model="numpy", parallel=True)
def attend_few_f32(q, keys, values, v0, pos0, scale, out):
    """:func:`attend_few` over a float32 cache: q (n_tokens, n_head, k_dim) float32 as it is, keys
    (n_ctx, n_head_kv, k_dim) float32; the values are values[j, hk, v0:v0 + v_dim] (an MLA cache
    passes its key rows with v0 = n_rot, a KV cache its values with v0 = 0: one signature for
    both).  Scores, the exponentials summed in double, the probabilities and Σ p v all float32."""
    n_tok, n_head, k_dim = q.shape
    g = n_head // keys.shape[1]
    v_dim = out.shape[2]
    for job in prange(n_tok * n_head):
        t, h = job // n_head, job % n_head
        hk = h // g
        n_seen = pos0 + t + 1
        e = np.empty(n_seen, F32)
        m = -np.inf
        for j in range(n_seen):
            s = F32(0.0)
            for d in range(k_dim):
                s += keys[j, hk, d] * q[t, h, d]
            s = s * scale
            e[j] = s
            m = max(m, s)
        inv_total = _exp_shifted(e, n_seen, m)
        for d in range(v_dim):
            out[t, h, d] = 0
        for j in range(n_seen):
            p = e[j] * inv_total
            for d in range(v_dim):
                out[t, h, d] += p * values[j, hk, v0 + d]
