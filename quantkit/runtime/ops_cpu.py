"""CPU operations of the runtime (numpy + numba): this module is the CPU backend of the ops interface
(``ops.Ops``) that ``model.py`` computes with; the torch backend (``ops_torch.TorchOps``) provides the
same operations with the same signatures.

ggml's CPU graph is followed where it changes numbers that a comparison with llama.cpp would see:
the KV cache holds float16, and ggml multiplies it with float16 copies of its other operand (the
query for K·Q, the softmax probabilities for V·P); a float32 cache (-ctk/-ctv f32, cache_type.py)
is multiplied with both as they are.

Quantized weights meet their activations in two ways.  By default, as ggml does in its quantized
dot products, the activations are rounded to 8 bits per 32 and multiplied with the packed rows: a
generation step's few tokens by matvec.py, a batch's (a prompt, a perplexity chunk) by matmul8.py,
which gives each token the same bits (a prompt's logits are those of its tokens one step at a
time).  The float products (``fused=False``, and a batch's products under
:data:`float_products`: ``--float-products`` of run / perplexity, ``float_products=True`` of the
library's runtime calls, collect_imatrix's included) decode tiles of
rows to float32 and multiply with BLAS: they compute what the stored weights mean with float32
activations, which tests check against ik_llama.cpp on the dequantized (F32) file to float
precision.  How ggml rounds depends on its build and on the batch size (ik_llama.cpp's
wheel gives the same position logits that differ by several percent of max |logit| between a batch
of 4 and one of 64 tokens); quantkit's generation steps stay as close to ik_llama.cpp as its
batches do (tests/test_runtime_llama.py).
"""
from __future__ import annotations

import functools
import math
import weakref

import numpy as np

from ..types import QuantType, traits
from . import kernels, matmul8, matvec
from .layer_steps import LayerSteps
from .cache_type import CACHE_TYPES
from .tiles import FEW_TOKENS, by_causal_rows, by_rows, numba_threads, pool, set_numba_threads
from .weights import Weight

F32 = np.float32
# float32 values of a decoded weight tile: small enough to stay in L2/L3 between the decoder and
# the BLAS product that reads it
TILE_VALUES = 1 << 20
# products of at most this many tokens multiply the packed rows directly (matvec.py) where a
# fused kernel exists: each row is read once per token, with no decoded float32 copy
FUSED_TOKENS = 4
# a batch's quantized products here are 8-bit ones (matmul8.py; :class:`FloatProducts`: float32)
FLOAT_BATCHES = False
# attention work items: at most this many query positions, and this many query rows (positions x
# the query heads of one key head), per item
QUERY_BLOCK = 64
QUERY_ROWS = 4096
# the DSA paths hold (query positions x heads x keys) scores of one block: at most this many
SCORE_BLOCK = 1 << 24


def _dsa_block(n_head: int, n_kv: int) -> int:
    """Query positions per block of the DSA paths (scores of SCORE_BLOCK floats at most)."""
    return max(1, min(QUERY_BLOCK, SCORE_BLOCK // max(1, n_head * n_kv)))


# ---- values in and out of the backend (numpy arrays here; a device backend converts) ----

def host(x) -> np.ndarray:
    return np.asarray(x)


def from_host(x: np.ndarray) -> np.ndarray:
    return x


def param(v: np.ndarray) -> np.ndarray:
    """A model vector (norm weights, biases) as the backend keeps it."""
    return v


# ---- matrix products ----

def _rows2d(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def _f16_round(x: np.ndarray) -> np.ndarray:
    """x (n_tokens, ...): float32 values rounded to the nearest float16 (ties to even), kept as float32: what ggml's
    conversions to f16 do (numpy's own cast converts one value at a time: 2x slower)."""
    x = np.ascontiguousarray(x, F32)
    out = np.empty_like(x)
    x2, out2 = _rows2d(x), _rows2d(out)
    if x.shape[0] <= FUSED_TOKENS:
        kernels.f16_round_few(x2, out2)
    else:
        by_rows(lambda r0, r1: kernels.f16_round_rows(x2[r0:r1], out2[r0:r1]), x2.shape[0], x.shape[0])
    return out


def matmul_q(w: Weight, x: np.ndarray, fused: bool | None = None) -> np.ndarray:
    """x (n_tokens, n_in) @ w^T -> (n_tokens, n_out), reading w in its stored type.

    ``fused``: multiply the packed rows with 8-bit activations, as a generation step does (for up
    to FUSED_TOKENS tokens matvec.py, for more matmul8.py: per token the same bits); False: the
    float products below; None (the default): fused where w's type has a kernel for that many
    tokens (:class:`FloatProducts` makes it False for a batch).

    Otherwise rows of w are decoded a tile at a time into float32 and multiplied with BLAS, so a
    product touches each stored byte once and never holds more than one decoded tile per thread."""
    x = np.ascontiguousarray(x, F32)
    if w.qtype == QuantType.F16:
        x = _f16_round(x)           # ggml's f16 dot product converts the activations to f16
    if fused is not False and w.qtype in matvec.FUSED:
        if x.shape[0] <= FUSED_TOKENS:
            return matvec.matvec(*_kernel_rows(w, step=True), x)
        if matmul8.supports(matvec.FUSED[w.qtype][0]):
            return matmul8.matmul8(*_kernel_rows(w), x)
        if fused:
            return matvec.matvec(*_kernel_rows(w), x)
    n_out, group = w.n_out * w.n_matrices, traits(w.qtype).interleave_rows
    tile = max(group, TILE_VALUES // w.n_in // group * group)
    per_thread = -(-n_out // pool.threads(x.shape[0]))                 # every thread gets a share
    tile = min(tile, -(-per_thread // group) * group)
    out = np.empty((x.shape[0], n_out), F32)
    plain = w.plain() if w.qtype == QuantType.F32 else None

    def product(r0):
        r1 = min(n_out, r0 + tile)
        rows = plain[r0:r1] if plain is not None else w.plain_rows(r0, r1)
        if r1 - r0 == n_out:
            np.matmul(x, rows.T, out=out)       # one tile: no copy of the product into out
        else:
            out[:, r0:r1] = x @ rows.T
    pool.map(product, range(0, n_out, tile), x.shape[0])
    return out


def _kernel_rows(w: Weight, step: bool = False) -> tuple[int, np.ndarray]:
    """(kind, rows) that the fused kernels multiply for w (a type in matvec.FUSED): in a
    generation step (``step``) an interleaved type with a group kernel (matvec.STEP) on its stored
    rows, R at once; otherwise its plain kind, on its rows regrouped into plain ones where its
    layout interleaves them (made on first use)."""
    if step and w.qtype in matvec.STEP:
        return matvec.STEP[w.qtype], w.blocks
    kind, regrouped = matvec.FUSED[w.qtype]
    return kind, w.plain_layout()[1] if regrouped else w.blocks


def matmul_q_many(ws, x: np.ndarray) -> list[np.ndarray]:
    """[matmul_q(w, x) for w in ws], the same values: weights that share their input (attn_q/k/v,
    ffn_gate/up).  A generation step's (at most FUSED_TOKENS tokens) are computed in one parallel
    launch with the input rounded once (matvec.Products) where every weight has a fused kernel;
    each result is then a view of one array."""
    x = np.ascontiguousarray(x, F32)
    if x.shape[0] <= FUSED_TOKENS:
        products = _products(ws)
        if products is not None:
            return products(x)
    else:
        parts = _batch_parts(ws)
        if parts is not None:
            return matmul8.matmul8_many(parts, x)
    return [matmul_q(w, x) for w in ws]


def _batch_parts(ws):
    """[(kind, rows)] of weights whose batch products matmul8 computes from one input (as
    matmul_q would, one by one), or None."""
    parts = []
    for w in ws:
        kernel = matvec.FUSED.get(w.qtype)
        if kernel is None or not matmul8.supports(kernel[0]) or w.n_in != ws[0].n_in:
            return None
        parts.append(_kernel_rows(w))
    return parts


# id of each weight -> (weak references to them, their matvec.Products or None): made once per
# group of weights (the Products hold the addresses of their rows).  An entry is removed when one
# of its weights dies, before its id can be reused: a hit is always the same weights
_PRODUCTS: dict[tuple[int, ...], tuple] = {}


def _products(ws):
    key = tuple(map(id, ws))
    hit = _PRODUCTS.get(key)
    if hit is not None:
        return hit[1]
    parts = []
    for w in ws:
        # F16 rows take f16-rounded activations (matmul_q): not one input for all
        if w.qtype not in matvec.FUSED or w.qtype == QuantType.F16 or w.n_in != ws[0].n_in:
            parts = None
            break
        parts.append(_kernel_rows(w, step=True))
    products = None if parts is None else matvec.Products(parts)
    refs = [weakref.ref(w, lambda _, key=key: _PRODUCTS.pop(key, None)) for w in ws]
    _PRODUCTS[key] = (refs, products)
    return products


def layer_steps(layers, head: Weight, output_norm: np.ndarray, shape):
    """A generation step's layers and head in one call (layer_steps.LayerSteps: one compiled job
    that team.py's threads run together), or None where a weight has no step kernel that
    takes 8-bit activations (matvec.Products) or the shapes do not fit.

    ``layers``: per layer (attn_norm, [wq, wk, wv], attn_output, ffn_norm, [gate, up], down), a
    llama layer without biases or per-head norms; ``shape``: model.StepShape.  The result is
    called as ``steps(x, pos, cache, logits_from)`` and returns the logits of tokens
    logits_from.. of x (at most FUSED_TOKENS tokens), or None for a call it does not compute."""
    def parts(ws):
        for w in ws:
            if w.qtype not in matvec.FUSED or w.qtype == QuantType.F16:
                raise ValueError("no step kernel")
        return [_kernel_rows(w, step=True) for w in ws]
    try:
        steps = LayerSteps([(attn_norm, parts(qkv), parts([o]), ffn_norm, parts(gu), parts([down]))
                            for attn_norm, qkv, o, ffn_norm, gu, down in layers],
                           parts([head])[0], output_norm, shape.n_embd, shape.n_head, shape.n_head_kv,
                           shape.head_dim, shape.n_rot, shape.neox, shape.eps, shape.scale)
    except ValueError:
        return None

    def run(x, pos, cache, logits_from):
        n = x.shape[0]
        if (not 0 < n <= FUSED_TOKENS or type(cache) is not KVCache or cache.k.dtype != np.float16
                or cache.v.dtype != np.float16 or int(pos[0]) + n > cache.n_ctx):
            return None         # the layer loop (which reports a full context)
        return steps(x, int(pos[0]), *cache.bits, logits_from,
                     rope_angles(pos, shape.n_rot, shape.rope_base, shape.rope_scale), numba_threads())
    return run


def matmul_q_t(w: Weight, x: np.ndarray) -> np.ndarray:
    """x (n_tokens, n_out) @ w -> (n_tokens, n_in): w used transposed, rows decoded a tile at a time.

    For MLA files that only have the fused attn_kv_b: its key rows map the latent to the key, and
    the absorbed query needs the opposite direction.  ik_llama.cpp builds a transposed copy at load
    (float types kept, quantized ones requantized to q8_0); here the stored rows are used as they
    are, which differs from that copy only by its 8-bit rounding."""
    x = np.ascontiguousarray(x, F32)
    if w.qtype == QuantType.F32:
        return x @ w.plain()
    if w.qtype == QuantType.F16:
        x = _f16_round(x)
    group = traits(w.qtype).interleave_rows
    tile = max(group, TILE_VALUES // w.n_in // group * group)
    out = np.zeros((x.shape[0], w.n_in), F32)
    for r0 in range(0, w.n_out, tile):
        r1 = min(w.n_out, r0 + tile)
        out += x[:, r0:r1] @ w.plain_rows(r0, r1)
    return out


def matmul_q_heads(ws, x: np.ndarray, transposed: bool = False) -> np.ndarray:
    """Per-head products (ggml's batched mul_mat with a 3-D weight): x (n_tokens, n_head, d_in)
    with one matrix per head in ``ws`` -> (n_tokens, n_head, d_out)."""
    mm = matmul_q_t if transposed else matmul_q
    return np.stack([mm(w, x[:, h]) for h, w in enumerate(ws)], axis=1)


def embed(w: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a token embedding (n_tokens, n_embd), decoded (ggml_get_rows).  A batch's
    are decoded by the tile pool's threads, a share each (each row decoded alone: the same bits),
    not by numba's parallel decoders on the calling thread (see tiles.by_rows)."""
    ids = np.asarray(ids, np.int64)
    if pool.threads(len(ids)) <= 1:
        # a generation step's few rows on this thread alone: a numba-parallel decoder would leave
        # its OpenMP threads spinning on the cores that the step's team (team.py) needs next
        # (SmolLM2 Q4_1 on 2 cores: the helper then joined one step in three, 7.6 ms against 2.7)
        threads = numba_threads()
        set_numba_threads(1)
        try:
            return w.gather(ids)
        finally:
            set_numba_threads(threads)
    out = np.empty((len(ids), w.n_in), F32)

    def rows(r0, r1):
        out[r0:r1] = w.gather(ids[r0:r1])
    by_rows(rows, len(ids))
    return out


# ---- elementwise ----

def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, per row (ggml sums the squares in double)."""
    x, weight = np.ascontiguousarray(x, F32), np.ascontiguousarray(weight, F32)
    out = np.empty_like(x)
    if x.shape[0] <= FUSED_TOKENS:
        kernels.rmsnorm_few(x, weight, float(eps), out)
    else:
        by_rows(lambda r0, r1: kernels.rmsnorm_rows(x[r0:r1], weight, float(eps), out[r0:r1]), x.shape[0])
    return out


def add_rmsnorm(x: np.ndarray, y: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x + y, rmsnorm(x + y, weight, eps)): a residual add and the norm after it.  A generation
    step's few rows take one kernel (kernels.add_rmsnorm_few: the same float operations in the same
    order, so the same bits); a batch's are the two apart."""
    x, y = np.ascontiguousarray(x, F32), np.ascontiguousarray(y, F32)
    if x.ndim == 2 and x.shape == y.shape and x.shape[0] <= FUSED_TOKENS:
        weight = np.ascontiguousarray(weight, F32)
        total, out = np.empty_like(x), np.empty_like(x)
        kernels.add_rmsnorm_few(x, y, weight, float(eps), total, out)
        return total, out
    total = x + y
    return total, rmsnorm(total, weight, eps)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(variance + eps) * weight + bias, per row (a LayerNorm: the DSA indexer's
    k_norm); mean and variance in double."""
    xd = np.asarray(x, np.float64)
    d = xd - xd.mean(axis=-1, keepdims=True)
    y = (d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)).astype(F32)
    return y * np.asarray(weight, F32) + np.asarray(bias, F32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up."""
    gate, up = _rows2d(np.ascontiguousarray(gate, F32)), _rows2d(np.ascontiguousarray(up, F32))
    out = np.empty_like(gate)
    if gate.shape[0] <= FUSED_TOKENS:
        kernels.silu_mul_few(gate, up, out)
    else:
        by_rows(lambda r0, r1: kernels.silu_mul_rows(gate[r0:r1], up[r0:r1], out[r0:r1]), gate.shape[0])
    return out


def rope_angles(pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0):
    """cos and sin, float32 (n_tokens, n_rot/2), of the plain rotary angles pos * freq_scale * base^(-2i/n_rot)."""
    # every layer of a forward pass asks for the same angles: made once per set of positions
    return _cached_angles(np.asarray(pos, np.int64).tobytes(), n_rot, freq_base, freq_scale)


@functools.lru_cache(maxsize=64)
def _cached_angles(pos: bytes, n_rot: int, freq_base: float, freq_scale: float):
    return _rope_angles(np.frombuffer(pos, np.int64), n_rot, freq_base, freq_scale)     # shared: never written to


def _rope_angles(pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float):
    half = n_rot // 2
    theta_scale = freq_base ** (-2.0 / n_rot)
    inv = np.array([theta_scale ** i for i in range(half)], np.float64)
    theta = (np.asarray(pos, np.float64)[:, None] * freq_scale) * inv[None, :]      # (n_tokens, half)
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


def rope_ext_angles(pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
                    ext_factor: float = 0.0, mscale: float = 1.0, beta_fast: float = 32.0,
                    beta_slow: float = 1.0, n_ctx_orig: int = 0):
    """cos and sin, float32 (n_tokens, n_rot/2), of ``ggml_rope_ext``'s angles, YaRN included.

    With ``ext_factor`` 0 the angles are the linearly scaled ones (pos * freq_scale * base^(-2i/n_rot))
    and cos/sin are multiplied by ``mscale``.  Otherwise YaRN blends, per frequency, the scaled
    angle with the unscaled one: dims below the "fast" correction dim keep their original frequency
    (they turn many times within the training context), dims above the "slow" one are interpolated,
    with a linear ramp in between; and mscale grows by 1 + 0.1 ln(1 / freq_scale)."""
    half = n_rot // 2
    i = np.arange(half)
    theta_extrap = np.asarray(pos, np.float64)[:, None] * (freq_base ** (-2.0 * i / n_rot))[None, :]
    theta = freq_scale * theta_extrap                                           # (n_tokens, half)
    if ext_factor != 0.0:
        def corr_dim(n_turns):      # the dim whose wavelength fits n_turns times in n_ctx_orig
            return n_rot * math.log(n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(freq_base))
        lo = max(0.0, math.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
        mix = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor
        theta = theta * (1 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return (np.cos(theta) * mscale).astype(F32), (np.sin(theta) * mscale).astype(F32)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
         neox: bool = False) -> np.ndarray:
    """Rotary embedding of x (n_tokens, n_heads, head_dim) in place on the first n_rot dims; returns x.

    Normal mode rotates adjacent pairs (x[2i], x[2i+1]) (llama after the converter's q/k
    permutation); neox mode rotates (x[i], x[i + n_rot/2])."""
    return _rotate(x, n_rot, *rope_angles(pos, n_rot, freq_base, freq_scale), neox)


def rope_ext(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
             ext_factor: float = 0.0, mscale: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
             n_ctx_orig: int = 0, neox: bool = False) -> np.ndarray:
    """``ggml_rope_ext``: :func:`rope` with YaRN (:func:`rope_ext_angles`), in place; returns x."""
    cos, sin = rope_ext_angles(pos, n_rot, freq_base, freq_scale, ext_factor, mscale, beta_fast, beta_slow,
                               n_ctx_orig)
    return _rotate(x, n_rot, cos, sin, neox)


def rope_store(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache, layer: int, pos: np.ndarray, n_rot: int,
               freq_base: float, freq_scale: float = 1.0, neox: bool = False) -> np.ndarray:
    """:func:`rope` of q (n_tokens, n_head, k_dim) and of k (n_tokens, n_head_kv, k_dim), then
    ``cache.store(layer, pos[0], k, v)`` (the positions ``pos`` follow each other); returns q.

    A generation step's few tokens with C-contiguous q/k/v and a float16 :class:`KVCache` take one
    kernel (kernels.rope_store_few: the same rotation, and the cache's float16 bits as numpy's cast
    writes them), instead of two rotations, their angles' look-up and two casting copies."""
    n = q.shape[0]
    if n == 0:
        return q
    pos0 = int(pos[0])
    # (plain conditions, no generator: a step makes 30 of these checks)
    fused = (n <= FUSED_TOKENS and type(cache) is KVCache and cache.k.dtype == np.float16
             and cache.v.dtype == np.float16 and q.ndim == k.ndim == v.ndim == 3 and k.shape[0] == v.shape[0] == n
             and k.shape[1:] == cache.k.shape[2:] and v.shape[1:] == cache.v.shape[2:] and q.shape[2] == k.shape[2]
             and q.dtype == k.dtype == v.dtype == F32
             and q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous)
    if not fused:
        q = rope(q, pos, n_rot, freq_base, freq_scale, neox)
        k = rope(k, pos, n_rot, freq_base, freq_scale, neox)
        cache.store(layer, pos0, k, v)
        return q
    cache._check_room(pos0, n)
    cos, sin = rope_angles(pos, n_rot, freq_base, freq_scale)
    k16, v16 = cache.bits
    kernels.rope_store_few(q, k, v, cos, sin, n_rot, neox, k16[layer], v16[layer], pos0)
    return q


def _rotate(x: np.ndarray, n_rot: int, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate the dim pairs of x (n_tokens, n_heads, head_dim) in place by angles given as cos/sin
    (n_tokens, n_rot/2)."""
    y = x if x.dtype == F32 and x.flags.c_contiguous else np.ascontiguousarray(x, F32)
    if y.shape[0] <= FUSED_TOKENS:
        kernels.rotate_few(y, cos, sin, n_rot, neox)
    else:
        by_rows(lambda r0, r1: kernels.rotate_pairs(y[r0:r1], cos[r0:r1], sin[r0:r1], n_rot, neox), y.shape[0])
    if y is not x:
        x[...] = y
    return x


# ---- attention ----

class KVCache:
    """Keys and values of every layer for one sequence, stored as float16 like llama.cpp's cache
    (``k_type``/``v_type`` "f32": float32, as llama.cpp's -ctk/-ctv f32; see cache_type.py)."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, k_dim: int, v_dim: int, k_type: str = "f16",
                 v_type: str = "f16"):
        self.k = np.zeros((n_layer, n_ctx, n_head_kv, k_dim), CACHE_TYPES[k_type])   # (layer, pos, head, k_dim)
        self.v = np.zeros((n_layer, n_ctx, n_head_kv, v_dim), CACHE_TYPES[v_type])   # (layer, pos, head, v_dim)
        self.n_ctx = n_ctx
        self.n_past = 0

    @functools.cached_property
    def bits(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values as their float16 bits (uint16 views), as kernels.attend_few reads them."""
        return self.k.view(np.uint16), self.v.view(np.uint16)

    def _check_room(self, pos0: int, n: int) -> None:
        if pos0 + n > self.n_ctx:
            raise ValueError(f"context is full ({self.n_ctx} positions)")

    def store(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[0]
        self._check_room(pos0, n)
        # a value beyond float16's range becomes +-inf, as ggml's conversion makes it (the logits
        # then are not finite, which the caller reports); numpy would also print a warning
        with np.errstate(over="ignore", invalid="ignore"):
            self.k[layer, pos0:pos0 + n] = k
            self.v[layer, pos0:pos0 + n] = v

    def clear(self) -> None:
        self.n_past = 0


class MLACache(KVCache):
    """The cache of multi-head latent attention (DeepSeek-V2/V3), float16 like ik_llama.cpp's (or float32);
    :func:`attention` reads it like a KVCache with one key/value head.

    Per layer and position it keeps one row, the roped shared key part (n_rot) followed by the
    normalized compressed kv (kv_lora_rank), instead of per-head keys and values: the keys are the
    whole row and the values its last kv_lora_rank entries (``v`` is a view), the queries having
    been mapped into that latent space."""

    def __init__(self, n_layer: int, n_ctx: int, n_rot: int, kv_lora_rank: int, index_dim: int = 0,
                 cache_type: str = "f16"):
        # (layer, pos, 1, n_rot + kv_lora); ``cache_type`` "f32": float32 rows
        self.k = np.zeros((n_layer, n_ctx, 1, n_rot + kv_lora_rank), CACHE_TYPES[cache_type])
        self.v = self.k[..., n_rot:]                                               # (layer, pos, 1, kv_lora)
        # the DSA indexer's keys (DeepSeek-V3.2), float32: selection compares their scores exactly
        self.index_k = np.zeros((n_layer, n_ctx, index_dim), F32) if index_dim else None
        self.n_rot = n_rot
        self.n_ctx = n_ctx
        self.n_past = 0

    def store_index(self, layer: int, pos0: int, k: np.ndarray) -> None:
        """The indexer keys (n_tokens, index_dim) of positions pos0.."""
        self._check_room(pos0, k.shape[0])
        self.index_k[layer, pos0:pos0 + k.shape[0]] = k

    def store(self, layer: int, pos0: int, k_rope: np.ndarray, kv: np.ndarray) -> None:
        """k_rope (n_tokens, 1, n_rot), kv (n_tokens, kv_lora_rank)."""
        n = kv.shape[0]
        self._check_room(pos0, n)
        with np.errstate(over="ignore", invalid="ignore"):         # +-inf beyond float16, as KVCache.store
            self.k[layer, pos0:pos0 + n, 0, :self.n_rot] = k_rope.reshape(n, self.n_rot)
            self.k[layer, pos0:pos0 + n, 0, self.n_rot:] = kv


def attention(q: np.ndarray, cache: KVCache, layer: int, pos0: int, scale: float, sinks: np.ndarray | None = None,
              window: int = 0) -> np.ndarray:
    """Causal multi-head attention of q (n_tokens, n_head, k_dim) at positions pos0.. against the
    cache's first pos0 + n_tokens positions -> (n_tokens, n_head * v_dim).  Query head h reads
    key/value head h // (n_head / n_head_kv), as ggml's broadcast does.  ``sinks`` (n_head,) and
    ``window``: gpt-oss's attention (:func:`attention_sinks`).

    A float16 cache (the default) is read by kernels.attend_few for any number of tokens: a
    prompt's attention is its steps', bit for bit, and the same on every CPU.  (BLAS's sums are
    not: OpenBLAS picks its kernels by CPU, and a prompt's scores through them changed the README's
    perplexity from 19.1584 on a Zen 4 to 19.1916 on a Zen 5.)

    A float32 or mixed cache goes through BLAS, split by key head and by blocks of query
    positions: a block multiplies only with the keys its last query sees (a prompt's first block
    skips most of them), and the query heads of one key head together, each query position's g
    heads side by side."""
    if sinks is not None or window:
        return attention_sinks(q, cache, layer, pos0, scale, sinks, window)
    n_tok, n_head, k_dim = q.shape
    n_kv = pos0 + n_tok
    n_head_kv, v_dim = cache.k.shape[2], cache.v.shape[3]
    k_f16, v_f16 = cache.k.dtype == np.float16, cache.v.dtype == np.float16
    if k_f16 and v_f16:
        out = np.empty((n_tok, n_head, v_dim), F32)
        k16, v16 = cache.bits
        q = np.ascontiguousarray(q, F32)
        # each (token, head) computed alone: a batch's tokens split between the pool's threads
        # (by_causal_rows) give the bits of one call
        by_causal_rows(lambda t0, t1: kernels.attend_few(q[t0:t1], k16[layer], v16[layer], pos0 + t0, F32(scale),
                                                         out[t0:t1]), n_tok, pos0)
        return out.reshape(n_tok, n_head * v_dim)
    if n_tok <= FUSED_TOKENS and not (k_f16 or v_f16):
        return _attend_few_f32(q, cache, layer, pos0, scale).reshape(n_tok, n_head * v_dim)
    g = n_head // n_head_kv
    keys = np.ascontiguousarray(cache.k[layer, :n_kv].astype(F32).transpose(1, 2, 0))   # (hkv, k_dim, n_kv)
    values = np.ascontiguousarray(cache.v[layer, :n_kv].astype(F32).transpose(1, 0, 2))  # (hkv, n_kv, v_dim)
    # ggml multiplies f16 keys with an f16 copy of q (f32 keys with q itself)
    q16 = _f16_round(q) if k_f16 else np.ascontiguousarray(q, F32)
    out = np.empty((n_tok, n_head, v_dim), F32)
    block = max(1, min(QUERY_BLOCK, QUERY_ROWS // g))

    def head_block(job):
        h, t0 = job
        t1 = min(n_tok, t0 + block)
        heads = slice(h * g, (h + 1) * g)
        n_seen = pos0 + t1                          # keys the block's last query sees
        scores = q16[t0:t1, heads].reshape((t1 - t0) * g, k_dim) @ keys[h, :, :n_seen]
        causal_softmax_f16(scores, pos0 + t0, g, scale, to_f16=v_f16)
        out[t0:t1, heads] = (scores @ values[h, :n_seen]).reshape(t1 - t0, g, v_dim)
    pool.map(head_block, [(h, t0) for h in range(n_head_kv) for t0 in range(0, n_tok, block)], n_tok)
    return out.reshape(n_tok, n_head * v_dim)


def attention_sinks(q: np.ndarray, cache: KVCache, layer: int, pos0: int, scale: float,
                    sinks: np.ndarray | None, window: int) -> np.ndarray:
    """:func:`attention` with gpt-oss's two additions, as ggml's soft_max_ext computes them.

    ``window`` > 0: the query at position p sees only the keys at p - window < j <= p (llama.cpp's
    standard sliding window: masked where p - j >= window).  ``sinks``: one logit per query head
    that joins the softmax without a value: the row maximum includes it and the sum adds
    exp(sink - max), so the probabilities of the real keys sum to less than 1.

    Unlike llama's graph, ik_llama.cpp's gpt-oss graph multiplies the f16 cache with float32
    queries and probabilities (measured: with them rounded to f16, as :func:`attention` does, the
    logits of a tiny gpt-oss differ from the wheel's by 1e-3 x max |logit|; without, by 1e-5)."""
    n_tok, n_head, k_dim = q.shape
    n_head_kv, v_dim = cache.k.shape[2], cache.v.shape[3]
    g = n_head // n_head_kv
    q = np.asarray(q, F32)
    out = np.empty((n_tok, n_head, v_dim), F32)
    sink = None if sinks is None else np.asarray(sinks, F32).reshape(n_head_kv, g)
    block = max(1, min(QUERY_BLOCK, QUERY_ROWS // g))

    def head_block(job):
        # the queries t0:t1 of key head h, against the keys any of them sees
        h, t0 = job
        t1 = min(n_tok, t0 + block)
        q_pos = pos0 + np.arange(t0, t1)
        first = max(0, pos0 + t0 - window + 1) if window else 0
        k_pos = np.arange(first, pos0 + t1)
        seen = k_pos[None, :] <= q_pos[:, None]                                 # (t, n_seen)
        if window:
            seen &= q_pos[:, None] - k_pos[None, :] < window
        keys = cache.k[layer, first:pos0 + t1, h].astype(F32)                  # (n_seen, k_dim)
        values = cache.v[layer, first:pos0 + t1, h].astype(F32)
        heads = slice(h * g, (h + 1) * g)
        s = (q[t0:t1, heads] @ keys.T) * F32(scale)                             # (t, g, n_seen)
        s = np.where(seen[:, None, :], s, F32(-np.inf))
        m = s.max(axis=-1)
        if sink is not None:
            m = np.maximum(m, sink[h][None, :])
        e = np.exp(s - m[..., None])
        total = e.sum(axis=-1, dtype=np.float64)
        if sink is not None:
            total += np.exp(sink[h][None, :] - m)
        out[t0:t1, heads] = (e * (1.0 / total).astype(F32)[..., None]) @ values
    pool.map(head_block, [(h, t0) for h in range(n_head_kv) for t0 in range(0, n_tok, block)], n_tok)
    return out.reshape(n_tok, n_head * v_dim)


def causal_softmax_f16(scores: np.ndarray, pos0: int, rows_per_pos: int, scale: float, to_f16: bool = True) -> None:
    """In place: each row of ``scores`` (n_rows, n_kv) becomes the f16-rounded softmax of ``scale *
    scores`` over the keys its query may see (row r's query is at position pos0 + r // rows_per_pos
    and sees keys 0 .. that position), zeros after them.  The exponentials are kernels.expf's, as
    a generation step's (kernels.attend_few).
    ``to_f16`` False: the probabilities stay float32 (what ggml multiplies an f32 V cache with)."""
    row_max = np.empty(scores.shape[0], F32)
    kernels.scale_mask_max(scores, pos0, rows_per_pos, F32(scale), row_max)
    kernels.exp_shifted_rows(scores, row_max)
    if to_f16:
        kernels.normalize_f16(scores)
    else:
        kernels.normalize_f32(scores)


def _attend_few_f32(q: np.ndarray, cache: KVCache, layer: int, pos0: int, scale: float) -> np.ndarray:
    """A generation step's attention over a float32 cache (kernels.attend_few_f32) -> (n_tokens,
    n_head, v_dim).  The values are read from the array they live in, at their column offset (an
    MLA cache's are the last kv_lora_rank entries of its key rows): the kernel has one signature."""
    v_rows, v0 = (cache.k, cache.n_rot) if isinstance(cache, MLACache) else (cache.v, 0)
    out = np.empty((q.shape[0], q.shape[1], cache.v.shape[3]), F32)
    kernels.attend_few_f32(np.ascontiguousarray(q, F32), cache.k[layer], v_rows[layer], v0, pos0, F32(scale), out)
    return out


def attention_mla(q_rope: np.ndarray, q_lat: np.ndarray, cache: MLACache, layer: int, pos0: int,
                  scale: float, keep: np.ndarray | None = None) -> np.ndarray:
    """Attention in the latent space of an :class:`MLACache`: queries q_rope (n_tokens, n_head, n_rot)
    and q_lat (n_tokens, n_head, kv_lora_rank), laid out like the cache rows -> (n_tokens, n_head,
    kv_lora_rank), still to be mapped to each head's values.  ``keep`` (n_tokens, n_kv) bool, from
    :func:`dsa_topk`: each query attends to those of its keys only."""
    q = np.concatenate([q_rope, q_lat], axis=-1)
    if keep is None:
        return attention(q, cache, layer, pos0, scale).reshape(q.shape[0], q.shape[1], -1)
    return _attention_kept(q, cache, layer, pos0, scale, keep)


def _attention_kept(q: np.ndarray, cache: MLACache, layer: int, pos0: int, scale: float,
                    keep: np.ndarray) -> np.ndarray:
    """:func:`attention`'s numbers (f16 query and probabilities with an f16 cache, the exponentials summed in double)
    over the keys ``keep`` marks (and the query may see), a block of query positions at a time."""
    n_tok, n_head, k_dim = q.shape
    n_kv = pos0 + n_tok
    keys = cache.k[layer, :n_kv, 0].astype(F32)                 # (n_kv, k_dim)
    values = cache.v[layer, :n_kv, 0].astype(F32)               # (n_kv, kv_lora)
    f16 = cache.k.dtype == np.float16                           # an f32 cache: nothing rounded
    q16 = _f16_round(q) if f16 else np.ascontiguousarray(q, F32)
    out = np.empty((n_tok, n_head, values.shape[1]), F32)
    causal = np.arange(n_kv)[None, :] <= (pos0 + np.arange(n_tok))[:, None]
    block = _dsa_block(n_head, n_kv)
    for t0 in range(0, n_tok, block):
        t1 = min(n_tok, t0 + block)
        allowed = (keep[t0:t1] & causal[t0:t1])[:, None, :]
        scores = np.where(allowed, (q16[t0:t1] @ keys.T) * F32(scale), F32(-np.inf))   # (tb, n_head, n_kv)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        inv_total = (1.0 / scores.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)
        p = scores * inv_total
        out[t0:t1] = (_f16_round(p) if f16 else p) @ values
    return out


def dsa_topk(q: np.ndarray, weights: np.ndarray, cache: MLACache, layer: int, pos0: int,
             top_k: int) -> np.ndarray | None:
    """DeepSeek Sparse Attention's key selection: the keys (n_tokens, n_kv) bool each query keeps, or
    None when no query sees more than ``top_k`` keys (all are kept: plain causal attention).

    Query t (at position pos0 + t) scores each key j it sees as Σ_h weights[t, h] · relu(q[t, h] ·
    index_k[j]) (q (n_tokens, n_head, head_dim) roped, weights (n_tokens, n_head) with the 1 /
    sqrt(n_head · head_dim) scale in them) and keeps the ``top_k`` best, exactly (float32 scores of
    the float32 cached keys; ties go to the earlier key)."""
    n_tok = q.shape[0]
    n_kv = pos0 + n_tok
    if n_kv <= top_k:
        return None
    keys_t = np.ascontiguousarray(cache.index_k[layer, :n_kv].T)   # (head_dim, n_kv)
    q, weights = np.asarray(q, F32), np.asarray(weights, F32)
    keep = np.zeros((n_tok, n_kv), bool)
    block = _dsa_block(q.shape[1], n_kv)
    for t0 in range(0, n_tok, block):
        t1 = min(n_tok, t0 + block)
        s = q[t0:t1] @ keys_t                                       # (tb, n_head, n_kv)
        np.maximum(s, F32(0), out=s)
        score = np.einsum("th,thk->tk", weights[t0:t1], s)
        for t in range(t0, t1):
            n_seen = pos0 + t + 1
            if n_seen <= top_k:
                keep[t, :n_seen] = True
            else:
                keep[t, np.argsort(-score[t - t0, :n_seen], kind="stable")[:top_k]] = True
    return keep


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_scale(k_dim: int) -> float:
    return 1.0 / math.sqrt(k_dim)


# ---- mixture of experts ----

def sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1) / (F32(1) + np.exp(-x))


def moe_route(logits: np.ndarray, n_used: int, gating: str, bias: np.ndarray | None = None,
              norm: bool = False, scale: float = 1.0, n_group: int = 1, n_group_used: int = 1):
    """Router: expert ids (n_tokens, n_used) and their weights (n_tokens, n_used) from the router
    logits (n_tokens, n_expert), as ggml's build_moe_ffn chooses them.

    ``gating`` "softmax" or "sigmoid" turns logits into probabilities; ``bias`` (DeepSeek-V3's
    exp_probs_b) is added for the choice only, the weights are the unbiased probabilities;
    ``norm`` makes the weights of a token sum to 1, then ``scale`` multiplies them.  With
    ``n_group_used < n_group`` experts are first restricted to the best groups (DeepSeek's
    group-limited routing; ik_llama.cpp does not do this for deepseek2).  "softmax_weight"
    (gpt-oss): the n_used largest logits, their softmax the weights."""
    if gating == "softmax_weight":
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :n_used]
        return ids, softmax(np.take_along_axis(np.asarray(logits, F32), ids, axis=-1)).astype(F32)
    probs = softmax(logits) if gating == "softmax" else sigmoid(logits)
    choice = probs if bias is None else probs + bias
    if 0 < n_group_used < n_group:
        choice = _best_groups(choice, n_group, n_group_used, top2=gating != "softmax")
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :n_used]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if abs(scale - 1.0) > 1e-5:
        weights = weights * F32(scale)
    return ids, weights.astype(F32)


def _best_groups(choice: np.ndarray, n_group: int, n_group_used: int, top2: bool) -> np.ndarray:
    """choice with the experts outside each token's n_group_used best groups set to -inf.

    Groups are ranked as DeepSeek's reference does: V3 (sigmoid, ``top2``) by the sum of the two
    best biased scores of the group, V2 (softmax) by its best probability."""
    n_tok, n_expert = choice.shape
    g = choice.reshape(n_tok, n_group, n_expert // n_group)
    best = np.sort(g, axis=-1)[..., ::-1]
    score = best[..., :2].sum(axis=-1) if top2 else best[..., 0]                # (n_tokens, n_group)
    keep = np.argsort(-score, axis=-1, kind="stable")[:, :n_group_used]
    mask = np.zeros((n_tok, n_group), bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    return np.where(mask[..., None], g, -np.inf).reshape(n_tok, n_expert)


def moe_ffn(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate_exps: Weight | None, up_exps: Weight | None,
            down_exps: Weight, matmul=None, gate_up_exps: Weight | None = None, biases=None,
            activation: str = "silu") -> np.ndarray:
    """Routed SwiGLU experts: sum_k weights[:, k] * expert_{ids[:, k]}(x) -> (n_tokens, n_embd).

    Only the tokens routed to an expert go through it: per expert, one product with its matrix of
    each 3-D tensor.  The weighted outputs are summed in slot order, as ggml does.  ``matmul``:
    the product to use (an observer's, for imatrix collection); matmul_q by default.
    ``gate_up_exps``: the gate and up experts fused in one tensor [n_in, 2 n_ff, n_expert], each
    expert's gate rows then its up rows (ik_llama.cpp's ffn_gate_up_exps), used instead of
    gate_exps and up_exps (None then): one product per expert, split in halves (:func:`gate_up`).
    gpt-oss: ``biases`` (gate, up, down), each (n_expert, n_out), added to each product, and
    ``activation`` "swiglu_oai" (:func:`swiglu_oai`) instead of silu(gate) * up."""
    mm = matmul or matmul_q
    n_tok, n_used = ids.shape
    # a generation step's; in a batch even an expert's few tokens take the batch's kind of product
    fused = True if n_tok <= FUSED_TOKENS else None
    out = np.zeros((n_tok, n_used, down_exps.n_out), F32)                      # (n_tokens, n_used, n_embd)
    act = swiglu_oai if activation == "swiglu_oai" else silu_mul
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        h = x[tok]
        if gate_up_exps is not None:
            gate, up = gate_up(mm(gate_up_exps.expert(e), h, fused=fused))
        else:
            gate, up = mm(gate_exps.expert(e), h, fused=fused), mm(up_exps.expert(e), h, fused=fused)
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[1][e]
        y = mm(down_exps.expert(e), act(gate, up), fused=fused)
        if biases is not None:
            y = y + biases[2][e]
        out[tok, slot] = y * weights[tok, slot][:, None]
    return out.sum(axis=1)


def gate_up(y):
    """The gate and up halves of a fused gate/up product's output (n_tokens, 2 n_ff): its first n_ff
    columns are the gate's (ggml's MOE_FUSED_UP_GATE reads an expert's gate rows first)."""
    n_ff = y.shape[1] // 2
    return y[:, :n_ff], y[:, n_ff:]


# ggml's swiglu_oai constants, as llama.cpp's gpt-oss graph passes them
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = F32(1.702), F32(7.0)


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's gated activation as ggml computes it: x = min(gate, 7), y = clamp(up, -7, 7),
    x * sigmoid(1.702 x) * (y + 1)."""
    x = np.minimum(np.asarray(gate, F32), SWIGLU_OAI_LIMIT)
    y = np.clip(np.asarray(up, F32), -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (x / (F32(1) + np.exp(-SWIGLU_OAI_ALPHA * x)) * (y + F32(1))).astype(F32)


class FloatProducts:
    """The CPU backend with a batch's quantized products in float32: products of more than
    FUSED_TOKENS tokens decode tiles of rows and multiply with BLAS (``matmul_q(fused=False)``),
    computing what the stored weights mean with float32 activations (the tests that compare with
    ik_llama.cpp on dequantized files use it); a generation step's products stay 8-bit ones.
    Everything else is the module's (:data:`float_products` is the one instance)."""
    FLOAT_BATCHES = True

    def __getattr__(self, name):
        try:
            return globals()[name]
        except KeyError:
            raise AttributeError(name) from None

    def matmul_q(self, w: Weight, x: np.ndarray, fused: bool | None = None) -> np.ndarray:
        if fused is None and x.shape[0] > FUSED_TOKENS:
            fused = False
        return matmul_q(w, x, fused)

    def matmul_q_many(self, ws, x: np.ndarray) -> list[np.ndarray]:
        if x.shape[0] > FUSED_TOKENS:
            return [self.matmul_q(w, x) for w in ws]
        return matmul_q_many(ws, x)

    def matmul_q_heads(self, ws, x: np.ndarray, transposed: bool = False) -> np.ndarray:
        if transposed:
            return matmul_q_heads(ws, x, transposed)
        return np.stack([self.matmul_q(w, x[:, h]) for h, w in enumerate(ws)], axis=1)

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, matmul=None, **options):
        """The module's, a batch's expert products (even of an expert's few tokens) in float32."""
        mm = matmul or self.matmul_q
        if ids.shape[0] > FUSED_TOKENS:
            def batch_mm(w, h, fused=None):
                return mm(w, h, False)
        return moe_ffn(x, ids, weights, gate_exps, up_exps, down_exps,
                       matmul=batch_mm if ids.shape[0] > FUSED_TOKENS else mm, **options)


float_products = FloatProducts()
