"""A generation step of a llama-like model in one compiled job: every layer and the output head,
run by a team of threads (team.py) that meet at a barrier after each product and the attention.

The step computes what model.py's layer loop computes through ops_cpu, operation for operation,
with the same kernels inlined (kernels.py's norms, rope, SiLU and attention; matvec.py's rows
functions through the same product tables): the logits are the same bits, on any number of
threads (a thread's share changes which rows it computes, never how one is computed).  What goes
away is the ~300 kernel calls a step made from Python, with their launches and allocations.

Per layer, thread ``slot`` of ``n`` (each thread holds its own copy of the residual stream x and
of every product's rounded input, which all compute alike; products, attention and logits go to
shared buffers, each thread writing its share)::

    h = rmsnorm(x) · attn_norm; rounded           (every thread)
    qkv = h · [Wq; Wk; Wv]                        (rows split)          barrier
    attention                                     ((token, kv head, heads) split: each job ropes
                                                   its queries and writes its kv head's new keys
                                                   and values, the same bits as any other job
                                                   writing them, before reading)  barrier
    y = att · Wo                                  (rows split)          barrier
    x += y; h = rmsnorm(x) · ffn_norm; rounded    (every thread)
    gu = h · [Wgate; Wup]                         (rows split)          barrier
    act = silu(gate) · up; rounded                (every thread)
    y = act · Wdown                               (rows split)          barrier
    x += y                                        (every thread)

and at the end logits = (rmsnorm(x) · output_norm) · Wout, rows split.  A shared buffer is
written in one phase and read before the next barrier but one, so no thread overwrites what
another still reads.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from . import kernels as K
from . import matvec
from .matvec import (ROWS_PER_TASK, T_BLOCKS, T_FIRST_TASK, T_FN, T_OUT, T_ROW_SIZE, T_ROWS, _call_rows,
                     _pointer, round_q8)
from . import team as teams
from .team import barrier, job_data, job_function, new_job, participants

F32 = np.float32
_T = 6                  # matvec's product table columns

# the step's arguments (int64 words; float values as their bits)
(A_N_TOK, A_POS0, A_N_LAYER, A_N_EMBD, A_N_HEAD, A_N_HEAD_KV, A_HEAD_DIM, A_N_FF, A_N_ROT, A_NEOX,
 A_EPS, A_SCALE, A_G_PART, A_X, A_LOGITS, A_LOGITS_FROM, A_N_VOCAB, A_COS, A_SIN, A_K, A_V,
 A_KV_LAYER, A_N_CTX, A_LAYERS, A_OUT_NORM, A_HEAD, A_HEAD_N, A_HEAD_ROUNDED, A_QKV, A_Q, A_ATT,
 A_Y, A_GU, A_PRIVATE, A_PRIVATE_STRIDE, A_N_MAX, A_XQ, A_XQ_STRIDE) = range(38)
N_ARGS = 38
# a layer's row of the layer table: its norms, then per product phase (qkv, o, gate/up, down):
# table address, weights, rounded (0/1), outputs
L_ATTN_NORM, L_FFN_NORM, L_PHASES = 0, 1, 2
P_QKV, P_O, P_GU, P_DOWN = range(4)
L_COLS = L_PHASES + 4 * 4
BARRIERS_PER_LAYER = 5


# a thread's private floats, in units of n_max * n_tok: x (n_embd <= n_max), h, then the rounded
# input's scales and sums (n_max / 32 each), then one key row
_X, _H, _XD = 0, 1, 2


@intrinsic
def _bits_f64(typingctx, u):
    """The float64 whose bit pattern is the int64 u (an argument word)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(inline="always")
def _f32(addr, shape):
    return carray(_pointer(addr, np.float32), shape)


@njit(inline="always")
def _rows_share(tab, n_w, slot, n, n_in, n_tok, xa, qa, da, sa, out, stride):
    """Thread ``slot`` of ``n``'s share of a product table's tasks (matvec._products' tasks of
    ROWS_PER_TASK rows, cut into n runs in order), one rows call per weight it touches."""
    table = carray(_pointer(tab, np.int64), ((n_w + 1) * _T,))
    total = table[n_w * _T + T_FIRST_TASK]
    t0, t1 = total * slot // n, total * (slot + 1) // n
    for w in range(n_w):
        f0, f1 = table[w * _T + T_FIRST_TASK], table[(w + 1) * _T + T_FIRST_TASK]
        a, b = max(t0, f0), min(t1, f1)
        if a < b:
            r1 = min(table[w * _T + T_ROWS], (b - f0) * ROWS_PER_TASK)
            _call_rows(table[w * _T + T_FN], table[w * _T + T_BLOCKS], table[w * _T + T_ROW_SIZE],
                       (a - f0) * ROWS_PER_TASK, r1, n_in, n_tok, xa, qa, da, sa, out + 4 * table[w * _T + T_OUT],
                       stride)


@njit(inline="always")
def _product(args, slot, n, tab, n_w, rounded, x, n_tok, n_in, out, stride):
    """out (n_tok, stride) = x (n_tok, n_in float32 at address x) · the weights of table ``tab``,
    this thread's share; x rounded to 8 bits first (into the thread's own buffers) where
    ``rounded``, as matvec.Products does."""
    # the thread's buffers, laid out for the step's whole n_tok (the head's call has fewer
    # tokens, and its input lies in h past the first logits_from rows)
    xq = args[A_XQ] + slot * args[A_XQ_STRIDE]
    xd = args[A_PRIVATE] + slot * args[A_PRIVATE_STRIDE] + 4 * _XD * args[A_N_MAX] * args[A_N_TOK]
    xs = xd + 4 * (args[A_N_MAX] // 32) * args[A_N_TOK]
    if rounded:
        round_q8(_f32(x, (n_tok, n_in)), carray(_pointer(xq, np.int8), (n_tok, n_in)),
                 _f32(xd, (n_tok, n_in // 32)), _f32(xs, (n_tok, n_in // 32)))
    _rows_share(tab, n_w, slot, n, n_in, n_tok, x, xq, xd, xs, out, stride)


@njit(inline="always")
def _rope_into(src, dst, t, cos, sin, n_rot, neox, head_dim):
    """kernels._rotate_token's rotation of one head (``src`` -> ``dst``, head_dim each), token t's
    angles: the same float operations."""
    half = n_rot // 2
    for i in range(half):
        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = src[ia], src[ib]
        dst[ia] = a * cos[t, i] - b * sin[t, i]
        dst[ib] = a * sin[t, i] + b * cos[t, i]
    for d in range(n_rot, head_dim):
        dst[d] = src[d]


@njit(inline="always")
def _attention(args, slot, n, layer, key_row):
    """This thread's share of the attention jobs (token, kv head, g_part of its query heads), as
    kernels.attend_few computes each; a job first writes the new keys and values of its kv head
    up to its token into the cache (rotated keys, float16 bits: rope_store_few's) and ropes its
    query heads into the shared q."""
    n_tok, pos0 = args[A_N_TOK], args[A_POS0]
    n_head, n_head_kv, hd = args[A_N_HEAD], args[A_N_HEAD_KV], args[A_HEAD_DIM]
    n_rot, neox, g_part = args[A_N_ROT], args[A_NEOX] != 0, args[A_G_PART]
    g = n_head // n_head_kv
    n_ctx = args[A_N_CTX]
    half = n_rot // 2
    cos, sin = _f32(args[A_COS], (n_tok, half)), _f32(args[A_SIN], (n_tok, half))
    width = (n_head + 2 * n_head_kv) * hd
    qkv = _f32(args[A_QKV], (n_tok, width))
    q = _f32(args[A_Q], (n_tok, n_head, hd))
    att = _f32(args[A_ATT], (n_tok, n_head, hd))
    keys = carray(_pointer(args[A_K] + 2 * layer * args[A_KV_LAYER], np.uint16), (n_ctx, n_head_kv, hd))
    values = carray(_pointer(args[A_V] + 2 * layer * args[A_KV_LAYER], np.uint16), (n_ctx, n_head_kv, hd))
    scale = K._bits_f32(args[A_SCALE])
    parts = (g + g_part - 1) // g_part
    jobs = n_tok * n_head_kv * parts
    for job in range(jobs * slot // n, jobs * (slot + 1) // n):
        jt, rest = job // (n_head_kv * parts), job % (n_head_kv * parts)
        hk, part = rest // parts, rest % parts
        t = jt // 2 if jt % 2 == 0 else n_tok - 1 - jt // 2
        for tt in range(t + 1):
            k0 = (n_head + hk) * hd
            v0 = (n_head + n_head_kv + hk) * hd
            _rope_into(qkv[tt, k0:k0 + hd], key_row, tt, cos, sin, n_rot, neox, hd)
            for d in range(hd):
                keys[pos0 + tt, hk, d] = K._f16_bits(key_row[d])
                values[pos0 + tt, hk, d] = K._f16_bits(qkv[tt, v0 + d])
        h_lo = part * g_part
        gg = min(g_part, g - h_lo)
        for h in range(hk * g + h_lo, hk * g + h_lo + gg):
            _rope_into(qkv[t, h * hd:(h + 1) * hd], q[t, h], t, cos, sin, n_rot, neox, hd)
        K._attend_group(q, keys, values, pos0, scale, att, t, hk, h_lo, gg)


@njit(cache=True, error_model="numpy", nogil=True)
def _step(job, slot):
    """Thread ``slot``'s part of a step (the job's data: the address of its arguments, A_*)."""
    n = participants(job)
    args = carray(_pointer(job_data(job), np.int64), (N_ARGS,))
    n_tok, n_layer, n_embd, n_ff = args[A_N_TOK], args[A_N_LAYER], args[A_N_EMBD], args[A_N_FF]
    n_att = args[A_N_HEAD] * args[A_HEAD_DIM]
    eps = _bits_f64(args[A_EPS])
    n_max = args[A_N_MAX]
    private = args[A_PRIVATE] + slot * args[A_PRIVATE_STRIDE]
    xa, ha = private + 4 * _X * n_max * n_tok, private + 4 * _H * n_max * n_tok
    key_row = _f32(private + 4 * (_XD * n_max * n_tok + 2 * (n_max // 32) * n_tok), (args[A_HEAD_DIM],))
    x = _f32(xa, (n_tok, n_embd))
    h = _f32(ha, (n_tok, n_embd))
    x[:] = _f32(args[A_X], (n_tok, n_embd))
    y = _f32(args[A_Y], (n_tok, n_embd))
    width = (args[A_N_HEAD] + 2 * args[A_N_HEAD_KV]) * args[A_HEAD_DIM]
    layers = carray(_pointer(args[A_LAYERS], np.int64), (n_layer, L_COLS))
    k = 0
    for layer in range(n_layer):
        row = layers[layer]
        norm = _f32(row[L_ATTN_NORM], (n_embd,))
        for r in range(n_tok):
            K._rmsnorm_row(x, r, norm, eps, h)
        p = L_PHASES + 4 * P_QKV
        _product(args, slot, n, row[p], row[p + 1], row[p + 2], ha, n_tok, n_embd, args[A_QKV], width)
        barrier(job, k, n)
        _attention(args, slot, n, layer, key_row)
        barrier(job, k + 1, n)
        p = L_PHASES + 4 * P_O
        _product(args, slot, n, row[p], row[p + 1], row[p + 2], args[A_ATT], n_tok, n_att, args[A_Y], n_embd)
        barrier(job, k + 2, n)
        norm = _f32(row[L_FFN_NORM], (n_embd,))
        for r in range(n_tok):                      # kernels.add_rmsnorm_few
            for i in range(n_embd):
                x[r, i] = x[r, i] + y[r, i]
            K._rmsnorm_row(x, r, norm, eps, h)
        p = L_PHASES + 4 * P_GU
        _product(args, slot, n, row[p], row[p + 1], row[p + 2], ha, n_tok, n_embd, args[A_GU], 2 * n_ff)
        barrier(job, k + 3, n)
        act = _f32(ha, (n_tok, n_ff))
        for t in range(n_tok):                      # kernels.silu_mul_few of token t's halves
            gate = _f32(args[A_GU] + 4 * 2 * n_ff * t, (1, n_ff))
            up = _f32(args[A_GU] + 4 * (2 * n_ff * t + n_ff), (1, n_ff))
            K._silu_mul_row(gate, up, 0, act[t:t + 1])
        p = L_PHASES + 4 * P_DOWN
        _product(args, slot, n, row[p], row[p + 1], row[p + 2], ha, n_tok, n_ff, args[A_Y], n_embd)
        barrier(job, k + 4, n)
        for r in range(n_tok):
            for i in range(n_embd):
                x[r, i] = x[r, i] + y[r, i]
        k += BARRIERS_PER_LAYER
    first = args[A_LOGITS_FROM]
    norm = _f32(args[A_OUT_NORM], (n_embd,))
    for r in range(first, n_tok):
        K._rmsnorm_row(x, r, norm, eps, h)
    _product(args, slot, n, args[A_HEAD], args[A_HEAD_N], args[A_HEAD_ROUNDED], ha + 4 * first * n_embd,
             n_tok - first, n_embd, args[A_LOGITS], args[A_N_VOCAB])


_STEP_FN = 0


def _step_fn() -> int:
    global _STEP_FN
    if not _STEP_FN:
        _STEP_FN = job_function(_step)
    return _STEP_FN


class LayerSteps:
    """The generation steps of one llama-like model (weights of kernel kinds matvec.Products
    multiplies, no biases or per-head norms, a float16 KV cache): ``steps(x, pos0, keys, values,
    logits_from, angles, n_threads)`` runs every layer and the head on x (n_tokens <= FUSED_TOKENS,
    n_embd) at positions pos0.. and returns the logits of tokens logits_from.. (their rows), or
    None when this call is not one it computes (the caller then takes the layer-by-layer path)."""

    def __init__(self, layers, head, output_norm, n_embd, n_head, n_head_kv, head_dim, n_rot, neox, eps, scale):
        """``layers``: per layer (attn_norm, [wq, wk, wv], attn_output, ffn_norm, [gate, up], down) as
        (kind, rows) parts (ops_cpu._kernel_rows); ``head``: the output's part.  ValueError where
        the shapes do not fit together (the kernels read without bounds checks)."""
        self.n_embd, self.n_head, self.n_head_kv, self.head_dim = n_embd, n_head, n_head_kv, head_dim
        self.n_rot, self.neox = n_rot, neox
        self.eps, self.scale = eps, scale
        if n_head_kv < 1 or n_head % n_head_kv or n_rot % 2 or not 0 < n_rot <= head_dim or n_embd % 32:
            raise ValueError("LayerSteps: heads or rotary dims do not fit")
        self._keep = []
        table = np.zeros((len(layers), L_COLS), np.int64)
        n_ff = None
        n_att = n_head * head_dim
        for i, (attn_norm, qkv, o, ffn_norm, gu, down) in enumerate(layers):
            table[i, L_ATTN_NORM] = self._vector(attn_norm, n_embd)
            table[i, L_FFN_NORM] = self._vector(ffn_norm, n_embd)
            gu_products = matvec.Products(gu)
            n_ff = gu_products.n_out // 2 if n_ff is None else n_ff
            wanted = ((qkv, n_embd, [n_att, n_head_kv * head_dim, n_head_kv * head_dim]), (o, n_att, [n_embd]),
                      (gu, n_embd, [n_ff, n_ff]), (down, n_ff, [n_embd]))
            for phase, (parts, n_in, outs) in enumerate(wanted):
                products = gu_products if phase == P_GU else matvec.Products(parts)
                rows = [b.shape[0] for b in products.blocks]
                if products.n_in != n_in or rows != outs:
                    raise ValueError(f"LayerSteps: layer {i}'s products do not fit its shapes")
                self._keep.append(products)
                c = L_PHASES + 4 * phase
                table[i, c:c + 4] = (products.table.ctypes.data, len(parts), products.rounded, products.n_out)
        self.n_ff = n_ff
        if n_ff is None or n_ff % 32 or n_att % 32:
            raise ValueError("LayerSteps: rows are not whole blocks of 32")
        self.layers = table
        self.head = matvec.Products([head])
        if self.head.n_in != n_embd:
            raise ValueError("LayerSteps: the output's rows are not n_embd long")
        self.n_vocab = self.head.n_out
        self.output_norm = self._vector(output_norm, n_embd)

    def _vector(self, v, n: int) -> int:
        v = np.ascontiguousarray(v, F32)
        if v.shape != (n,):
            raise ValueError("LayerSteps: a norm's length is not n_embd")
        self._keep.append(v)
        return v.ctypes.data

    def __call__(self, x, pos0: int, keys, values, logits_from: int, angles, n_threads: int):
        """x (n_tokens, n_embd) at positions pos0.. ; ``keys``, ``values``: the float16 cache as
        its bits (n_layer, n_ctx, n_head_kv, head_dim) uint16, the new tokens' written at their
        positions; ``angles``: (cos, sin) of the positions (n_tokens, n_rot / 2) float32."""
        n_tok = x.shape[0]
        k16, v16 = keys, values
        if (k16.dtype != np.uint16 or v16.dtype != np.uint16 or k16.shape != v16.shape
                or k16.shape[0] != self.layers.shape[0] or k16.shape[2:] != (self.n_head_kv, self.head_dim)
                or not (k16.flags.c_contiguous and v16.flags.c_contiguous)
                or not 0 < n_tok <= 4 or x.shape[1:] != (self.n_embd,) or not 0 <= logits_from < n_tok
                or not 0 <= pos0 <= k16.shape[1] - n_tok):
            return None
        x = np.ascontiguousarray(x, F32)
        cos, sin = (np.ascontiguousarray(a, F32) for a in angles)
        if cos.shape != (n_tok, self.n_rot // 2) or sin.shape != cos.shape:
            return None
        n_att = self.n_head * self.head_dim
        n_max = max(self.n_embd, self.n_ff, n_att)
        n_threads = max(1, n_threads)
        # per thread: x, h (n_max * n_tok each), the rounded input's scales and sums, a key row
        stride = 16 * (-(-(2 * n_max * n_tok + 2 * (n_max // 32) * n_tok + self.head_dim) // 16))
        private = np.empty((n_threads, stride), F32)
        xq = np.empty((n_threads, 64 * (-(-n_max * n_tok // 64))), np.int8)
        qkv = np.empty((n_tok, n_att + 2 * self.n_head_kv * self.head_dim), F32)
        q, att = np.empty((n_tok, n_att), F32), np.empty((n_tok, n_att), F32)
        y, gu = np.empty((n_tok, self.n_embd), F32), np.empty((n_tok, 2 * self.n_ff), F32)
        logits = np.empty((n_tok - logits_from, self.n_vocab), F32)
        g = self.n_head // self.n_head_kv
        # attention jobs: whole groups of query heads where they split evenly, else halves
        g_part = g if (n_tok * self.n_head_kv) % n_threads == 0 else (g + 1) // 2
        args = np.zeros(N_ARGS, np.int64)
        args[[A_N_TOK, A_POS0, A_N_LAYER, A_N_EMBD, A_N_HEAD, A_N_HEAD_KV, A_HEAD_DIM, A_N_FF, A_N_ROT, A_NEOX]] = (
            n_tok, pos0, self.layers.shape[0], self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff,
            self.n_rot, int(self.neox))
        args[A_EPS] = np.float64(self.eps).view(np.int64)
        args[A_SCALE] = int(np.float32(self.scale).view(np.uint32))
        args[A_G_PART] = g_part
        args[[A_X, A_LOGITS, A_LOGITS_FROM, A_N_VOCAB, A_COS, A_SIN, A_K, A_V, A_KV_LAYER, A_N_CTX]] = (
            x.ctypes.data, logits.ctypes.data, logits_from, self.n_vocab, cos.ctypes.data, sin.ctypes.data,
            k16.ctypes.data, v16.ctypes.data, k16[0].size, k16.shape[1])
        args[[A_LAYERS, A_OUT_NORM, A_HEAD, A_HEAD_N, A_HEAD_ROUNDED]] = (
            self.layers.ctypes.data, self.output_norm, self.head.table.ctypes.data, 1, self.head.rounded)
        args[[A_QKV, A_Q, A_ATT, A_Y, A_GU, A_PRIVATE, A_PRIVATE_STRIDE, A_N_MAX, A_XQ, A_XQ_STRIDE]] = (
            qkv.ctypes.data, q.ctypes.data, att.ctypes.data, y.ctypes.data, gu.ctypes.data, private.ctypes.data,
            4 * stride, n_max, xq.ctypes.data, xq.shape[1])
        job = new_job(args.ctypes.data, BARRIERS_PER_LAYER * self.layers.shape[0])
        teams.team.run(_step_fn(), job, n_threads)
        return logits
