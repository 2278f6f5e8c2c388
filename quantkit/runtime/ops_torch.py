"""The runtime's torch backend: the ops interface of ``ops_cpu`` computed with torch on a CUDA GPU
(or, where there is none, on the CPU: the same code, which is how CI tests it).

Weights go to the device in their stored, quantized layout, once, on first use; every product
decodes a tile of rows there (``torch_decode``) and multiplies it, so the device holds the file's
bytes plus one decoded tile.  A weight stays on the CPU, computed by the numba backend on host
copies of the activations, when
  * its type has no torch decoder, or is row-interleaved (``_r4``/``_r8``: CPU layouts, which
    ik_llama.cpp also keeps on the CPU), or
  * its name matches a ``--override-tensor REGEX=cpu`` pattern (``exps=cpu``: the routed experts
    in RAM, everything else on the GPU, as DeepSeek users run ik_llama.cpp).
On CUDA, where Triton is installed, the products of the types it has a kernel for
(``triton_qmm.supports``) are fused instead: a Triton kernel decodes each tile of rows in registers
and multiplies it (``triton_qmm.qmatmul``), never writing the decoded rows; the others keep the
torch decode.  ``TorchOps(..., triton=True)`` forces the kernels on any device (the CPU under
Triton's interpreter, TRITON_INTERPRET=1: how the tests run them), ``triton=False`` turns them off.
Activations are float32 torch tensors on the device; the numerics follow ops_cpu (f16 KV cache,
f16 copies of the query and of the probabilities, sums of squares and of exponentials in double;
an f32 cache, cache_type.py, multiplied in float32).
"""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import torch

from ..types import QuantType, traits
from . import ops_cpu, torch_decode, triton_qmm
from .weights import Weight

F32 = torch.float32
NUMBA = "cpu (numba)"


def _f16_round(x: torch.Tensor) -> torch.Tensor:
    """Values rounded to float16 (ties to even) and back: what ggml's conversions to f16 do."""
    return x.to(torch.float16).to(F32)


class TorchOps:
    """An ops backend (``ops.Ops``, what ``Model`` calls) on ``device``; ``cpu_tensors``: regexes of
    tensor names to keep on the CPU (searched, as ggml's --override-tensor patterns are)."""

    # the numba backend's: tensors kept on the CPU are computed by it
    FUSED_TOKENS = ops_cpu.FUSED_TOKENS
    FEW_TOKENS = ops_cpu.FEW_TOKENS
    # a batch's products are float32 ones, on the device and (ops_cpu.float_products) on the CPU
    FLOAT_BATCHES = True

    def __init__(self, device: str = "cuda", cpu_tensors=(), triton: bool | None = None):
        self.device = torch.device(device)
        self.cpu_tensors = [re.compile(p) for p in cpu_tensors]
        if triton is None:      # on CUDA where Triton is installed (compiled: not the tests' interpreter)
            triton = self.device.type == "cuda" and triton_qmm.available() and not triton_qmm.interpreting()
        elif triton and not triton_qmm.available():
            raise ValueError("the Triton kernels need triton, and CUDA or TRITON_INTERPRET=1")
        self.triton = triton
        self._bytes: dict[tuple, torch.Tensor] = {}
        self._params: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        self._angle_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- placement and transfers ----

    def on_device(self, w: Weight) -> bool:
        """Whether ``w`` is computed on the device (else by the numba backend on the CPU)."""
        base = w.name.split("[")[0]                     # experts and head slices: "name[e]"
        if any(p.search(base) for p in self.cpu_tensors):
            return False
        return torch_decode.can_decode(w.qtype) and traits(w.qtype).interleave_rows == 1

    def where(self, w: Weight) -> str:
        """Where ``w`` is computed: "cuda:0 (torch)" (the device), "cuda:0 (triton)" (the device,
        by a fused kernel), or "cpu (numba)"."""
        if not self.on_device(w):
            return NUMBA
        return f"{self.device} (triton)" if self.fused(w) else f"{self.device} (torch)"

    def fused(self, w: Weight) -> bool:
        """Whether w's products on the device run the fused Triton kernel (else the torch decode)."""
        return self.triton and triton_qmm.supports(w.qtype)

    def placement(self, weights) -> dict[str, str]:
        """Tensor name -> :meth:`where` it is computed."""
        return {w.name: self.where(w) for w in weights}

    def placement_summary(self, weights) -> dict[str, dict[str, float]]:
        """Where -> {"tensors": count, "MB": stored size}: what a run tells before it computes."""
        count: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        for w in weights:
            where = self.where(w)
            count[where] = count.get(where, 0) + 1
            nbytes[where] = nbytes.get(where, 0) + w.nbytes
        return {where: {"tensors": n, "MB": round(nbytes[where] / 1e6, 1)} for where, n in count.items()}

    def _device_bytes(self, w: Weight) -> torch.Tensor:
        key = (w.blocks.__array_interface__["data"][0], w.blocks.shape)
        b = self._bytes.get(key)
        if b is None:
            with warnings.catch_warnings():         # the file's map is read-only: copied below
                warnings.simplefilter("ignore", UserWarning)
                b = torch.from_numpy(w.blocks).to(self.device, copy=True)
            self._bytes[key] = b
        return b

    def host(self, x) -> np.ndarray:
        """A backend value as a numpy array (logits, observed activations)."""
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    def from_host(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(self.device)

    def param(self, v: np.ndarray) -> torch.Tensor:
        """A model vector (norm weights, biases) on the device, uploaded once."""
        hit = self._params.get(id(v))
        if hit is None or hit[0] is not v:
            hit = self._params[id(v)] = (v, self.from_host(v))
        return hit[1]

    # ---- matrix products ----

    def _decoded(self, w: Weight, r0: int, r1: int) -> torch.Tensor:
        return torch_decode.decode(self._device_bytes(w)[r0:r1], w.qtype, w.n_in)

    def _tile(self, w: Weight) -> int:
        return max(1, ops_cpu.TILE_VALUES // w.n_in)

    def layer_steps(self, layers, head: Weight, output_norm, shape):
        """None: a step here is the model's layer loop (ops.Ops.layer_steps)."""
        return None

    def matmul_q(self, w: Weight, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """x (n_tokens, n_in) @ w^T -> (n_tokens, n_out), decoding w a tile of rows at a time
        (``fused``: see ops_cpu.matmul_q, for the tensors computed on the host: a batch's in float32,
        as the device's, ops_cpu.float_products)."""
        if not self.on_device(w):
            return self.from_host(ops_cpu.float_products.matmul_q(w, self.host(x), fused))
        x = x.to(F32)
        if w.qtype == QuantType.F16:
            x = _f16_round(x)           # ggml's f16 dot product converts the activations to f16
        if self.fused(w):
            return triton_qmm.qmatmul(x, self._device_bytes(w), w.qtype)
        n_out, tile = w.n_out * w.n_matrices, self._tile(w)
        if n_out <= tile:
            return x @ self._decoded(w, 0, n_out).T
        out = torch.empty((x.shape[0], n_out), dtype=F32, device=self.device)
        for r0 in range(0, n_out, tile):
            r1 = min(n_out, r0 + tile)
            out[:, r0:r1] = x @ self._decoded(w, r0, r1).T
        return out

    def matmul_q_t(self, w: Weight, x: torch.Tensor) -> torch.Tensor:
        """x (n_tokens, n_out) @ w -> (n_tokens, n_in) (see ops_cpu.matmul_q_t)."""
        if not self.on_device(w):
            return self.from_host(ops_cpu.matmul_q_t(w, self.host(x)))
        x = x.to(F32)
        if w.qtype == QuantType.F16:
            x = _f16_round(x)
        out = torch.zeros((x.shape[0], w.n_in), dtype=F32, device=self.device)
        tile = self._tile(w)
        for r0 in range(0, w.n_out, tile):
            r1 = min(w.n_out, r0 + tile)
            out += x[:, r0:r1] @ self._decoded(w, r0, r1)
        return out

    def matmul_q_many(self, ws, x: torch.Tensor) -> list:
        return [self.matmul_q(w, x) for w in ws]

    def matmul_q_heads(self, ws, x: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        mm = self.matmul_q_t if transposed else self.matmul_q
        return torch.stack([mm(w, x[:, h]) for h, w in enumerate(ws)], dim=1)

    def embed(self, w: Weight, ids: np.ndarray) -> torch.Tensor:
        """Rows ``ids`` of the token embedding, decoded on the device (ggml_get_rows)."""
        if not self.on_device(w):
            return self.from_host(ops_cpu.embed(w, ids))
        idx = torch.from_numpy(np.asarray(ids, np.int64)).to(self.device)
        if self.fused(w):
            return triton_qmm.qdecode(self._device_bytes(w)[idx], w.qtype, w.n_in)
        return torch_decode.decode(self._device_bytes(w)[idx], w.qtype, w.n_in)

    # ---- elementwise ----

    def rmsnorm(self, x: torch.Tensor, weight, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * weight, the mean of squares in double as ggml forms it."""
        xd = x.to(torch.float64)
        scale = (1.0 / torch.sqrt((xd * xd).sum(dim=-1) / x.shape[-1] + eps)).to(F32)
        return (x * scale[:, None]) * self._vec(weight)

    def add_rmsnorm(self, x: torch.Tensor, y: torch.Tensor, weight, eps: float):
        """(x + y, rmsnorm(x + y)), as ops_cpu.add_rmsnorm."""
        x = x + y
        return x, self.rmsnorm(x, weight, eps)

    def layer_norm(self, x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
        """ops_cpu.layer_norm: mean and variance in double."""
        xd = x.to(torch.float64)
        d = xd - xd.mean(dim=-1, keepdim=True)
        y = (d / torch.sqrt((d * d).mean(dim=-1, keepdim=True) + eps)).to(F32)
        return y * self._vec(weight) + self._vec(bias)

    def _vec(self, v) -> torch.Tensor:
        return v if isinstance(v, torch.Tensor) else self.param(v)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gate / (1 + torch.exp(-gate)) * up

    def rope(self, x, pos, n_rot, freq_base, freq_scale=1.0, neox=False):
        """ops_cpu.rope: the same angles (computed on the host), the rotation on the device."""
        return self._rotate(x, self._angles(ops_cpu.rope_angles, pos, n_rot, freq_base, freq_scale), n_rot, neox)

    def rope_ext(self, x, pos, n_rot, freq_base, freq_scale=1.0, ext_factor=0.0, mscale=1.0,
                 beta_fast=32.0, beta_slow=1.0, n_ctx_orig=0, neox=False):
        """ops_cpu.rope_ext (YaRN): the same angles, rotated on the device."""
        angles = self._angles(ops_cpu.rope_ext_angles, pos, n_rot, freq_base, freq_scale, ext_factor, mscale,
                              beta_fast, beta_slow, n_ctx_orig)
        return self._rotate(x, angles, n_rot, neox)

    def rope_store(self, q, k, v, cache, layer, pos, n_rot, freq_base, freq_scale=1.0, neox=False):
        """ops_cpu.rope_store: rope of q and k, then k and v stored at positions pos; the roped q."""
        q = self.rope(q, pos, n_rot, freq_base, freq_scale, neox)
        k = self.rope(k, pos, n_rot, freq_base, freq_scale, neox)
        if len(pos):
            cache.store(layer, int(pos[0]), k, v)
        return q

    def _angles(self, make, pos, *params):
        """(cos, sin) of ``make(pos, *params)`` on the device, (n_tokens, 1, n_rot / 2).  A pass asks
        for the same positions' angles in every layer, for q and k: they are uploaded once.  An
        upload from the host waits for the device's queue to empty, so one per layer and tensor
        kept the host from running ahead of the device (on an H200, bench/gpu.py: 1333 waits in
        18 passes)."""
        pos = np.asarray(pos)
        key = (make, pos.dtype.str, pos.shape, pos.tobytes(), params)
        hit = self._angle_cache.get(key)
        if hit is None:
            if len(self._angle_cache) >= 8:
                self._angle_cache.clear()
            cos, sin = make(pos, *params)
            hit = self._angle_cache[key] = (self.from_host(cos)[:, None, :], self.from_host(sin)[:, None, :])
        return hit

    def _rotate(self, x, angles, n_rot, neox):
        half = n_rot // 2
        c, s = angles
        x = x.clone()
        ia, ib = (slice(0, half), slice(half, n_rot)) if neox else (slice(0, n_rot, 2), slice(1, n_rot, 2))
        a, b = x[..., ia].clone(), x[..., ib].clone()
        x[..., ia] = a * c - b * s
        x[..., ib] = a * s + b * c
        return x

    # ---- attention ----

    def KVCache(self, n_layer, n_ctx, n_head_kv, k_dim, v_dim, k_type="f16", v_type="f16"):
        return _TorchKVCache(self.device, n_layer, n_ctx, n_head_kv, k_dim, v_dim, k_type, v_type)

    def MLACache(self, n_layer, n_ctx, n_rot, kv_lora_rank, index_dim=0, cache_type="f16"):
        return _TorchMLACache(self.device, n_layer, n_ctx, n_rot, kv_lora_rank, index_dim, cache_type)

    def attention(self, q: torch.Tensor, cache, layer: int, pos0: int, scale: float, sinks=None,
                  window: int = 0) -> torch.Tensor:
        """ops_cpu.attention: causal, grouped-query, f16 query and probabilities, the exponentials
        summed in double and multiplied by 1 / sum; gpt-oss's ``sinks`` and sliding ``window`` as
        ops_cpu.attention_sinks has them (with float32 queries and probabilities)."""
        return self._attend(q, cache, layer, pos0, scale, sinks=sinks, window=window)

    def _attend(self, q: torch.Tensor, cache, layer: int, pos0: int, scale: float, keep=None, sinks=None,
                window: int = 0) -> torch.Tensor:
        """:meth:`attention`, over the keys ``keep`` (n_tokens, n_kv) bool marks where given."""
        gpt = sinks is not None or window > 0
        same = (lambda t: t)
        # an f32 cache (K, V apart) is multiplied with float32 queries / probabilities
        q_rounded = same if gpt or cache.k.dtype != torch.float16 else _f16_round
        rounded = same if gpt or cache.v.dtype != torch.float16 else _f16_round
        n_tok, n_head, k_dim = q.shape
        n_kv = pos0 + n_tok
        k = cache.k[layer, :n_kv].to(F32)                       # (n_kv, hkv, k_dim)
        v = cache.v[layer, :n_kv].to(F32)
        n_head_kv, v_dim = k.shape[1], v.shape[2]
        g = n_head // n_head_kv
        qh = q_rounded(q).reshape(n_tok, n_head_kv, g, k_dim).permute(1, 2, 0, 3)        # (hkv, g, t, d)
        scores = (qh @ k.permute(1, 2, 0)[:, None]) * scale                          # (hkv, g, t, n_kv)
        k_pos = torch.arange(n_kv, device=self.device)[None, :]
        q_pos = (pos0 + torch.arange(n_tok, device=self.device))[:, None]
        hidden = k_pos > q_pos
        if window:
            hidden |= q_pos - k_pos >= window
        if keep is not None:
            hidden = hidden | ~keep
        scores = scores.masked_fill(hidden, -math.inf)
        row_max = scores.amax(dim=-1, keepdim=True)
        if sinks is not None:
            sink = self._vec(sinks).reshape(n_head_kv, g, 1, 1)
            row_max = torch.maximum(row_max, sink)
        e = torch.exp(scores - row_max)
        total = e.sum(dim=-1, keepdim=True, dtype=torch.float64)
        if sinks is not None:
            total = total + torch.exp(sink - row_max).to(torch.float64)
        inv_total = (1.0 / total).to(F32)
        out = rounded(e * inv_total) @ v.permute(1, 0, 2)[:, None]                     # (hkv, g, t, v_dim)
        return out.permute(2, 0, 1, 3).reshape(n_tok, n_head * v_dim)

    def attention_mla(self, q_rope, q_lat, cache, layer, pos0, scale, keep=None):
        q = torch.cat([q_rope, q_lat], dim=-1)
        return self._attend(q, cache, layer, pos0, scale, keep).reshape(q.shape[0], q.shape[1], -1)

    def dsa_topk(self, q, weights, cache, layer, pos0, top_k):
        """ops_cpu.dsa_topk on the device: the same float32 scores, the top_k by a stable sort (ties
        to the earlier key)."""
        n_tok = q.shape[0]
        n_kv = pos0 + n_tok
        if n_kv <= top_k:
            return None
        keys_t = cache.index_k[layer, :n_kv].T
        block = ops_cpu._dsa_block(q.shape[1], n_kv)
        score = torch.cat([torch.einsum("th,thk->tk", weights[t0:t0 + block], torch.relu(q[t0:t0 + block] @ keys_t))
                           for t0 in range(0, n_tok, block)])                   # (n_tokens, n_kv)
        causal = (torch.arange(n_kv, device=self.device)[None, :]
                  <= (pos0 + torch.arange(n_tok, device=self.device))[:, None])
        order = torch.sort(score.masked_fill(~causal, -math.inf), dim=-1, descending=True, stable=True).indices
        keep = torch.zeros((n_tok, n_kv), dtype=torch.bool, device=self.device)
        keep.scatter_(1, order[:, :top_k], True)
        # a query that sees top_k keys or fewer keeps them all (the sort put its unseen ones after them)
        return keep & causal

    attention_scale = staticmethod(ops_cpu.attention_scale)

    # ---- mixture of experts ----

    def moe_route(self, logits, n_used, gating, bias=None, norm=False, scale=1.0, n_group=1, n_group_used=1):
        """The router's choice is made on the host (a few numbers per token), as ops_cpu makes it."""
        bias = None if bias is None else self.host(bias)
        return ops_cpu.moe_route(self.host(logits), n_used, gating, bias=bias, norm=norm, scale=scale,
                                 n_group=n_group, n_group_used=n_group_used)

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, matmul=None, gate_up_exps=None, biases=None,
                activation="silu"):
        """ops_cpu.moe_ffn: per expert, the tokens routed to it through its three matrices (or its
        fused gate/up matrix and its down matrix; plus gpt-oss's ``biases``, with its ``activation``);
        the weighted outputs summed in slot order."""
        mm = matmul or self.matmul_q
        n_tok, n_used = ids.shape
        fused = n_tok <= self.FUSED_TOKENS
        out = torch.zeros((n_tok, n_used, down_exps.n_out), dtype=F32, device=self.device)
        w = self.from_host(weights)
        act = self._swiglu_oai if activation == "swiglu_oai" else self.silu_mul
        b = None if biases is None else [self._vec(v) for v in biases]
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)
            t, s = torch.from_numpy(tok).to(self.device), torch.from_numpy(slot).to(self.device)
            h = x[t]
            if gate_up_exps is not None:
                gate, up = ops_cpu.gate_up(mm(gate_up_exps.expert(e), h, fused=fused))
            else:
                gate, up = mm(gate_exps.expert(e), h, fused=fused), mm(up_exps.expert(e), h, fused=fused)
            if b is not None:
                gate, up = gate + b[0][e], up + b[1][e]
            y = mm(down_exps.expert(e), act(gate, up), fused=fused)
            if b is not None:
                y = y + b[2][e]
            out[t, s] = y * w[t, s][:, None]
        return out.sum(dim=1)

    @staticmethod
    def _swiglu_oai(gate, up):
        """ops_cpu.swiglu_oai."""
        x = gate.clamp(max=float(ops_cpu.SWIGLU_OAI_LIMIT))
        y = up.clamp(-float(ops_cpu.SWIGLU_OAI_LIMIT), float(ops_cpu.SWIGLU_OAI_LIMIT))
        return x / (1 + torch.exp(-float(ops_cpu.SWIGLU_OAI_ALPHA) * x)) * (y + 1)


_DTYPES = {"f16": torch.float16, "f32": torch.float32}       # cache_type.CACHE_TYPES's


class _TorchKVCache:
    """ops_cpu.KVCache on the device: float16 (or float32) keys and values per layer and position."""

    def __init__(self, device, n_layer, n_ctx, n_head_kv, k_dim, v_dim, k_type="f16", v_type="f16"):
        self.k = torch.zeros((n_layer, n_ctx, n_head_kv, k_dim), dtype=_DTYPES[k_type], device=device)
        self.v = torch.zeros((n_layer, n_ctx, n_head_kv, v_dim), dtype=_DTYPES[v_type], device=device)
        self.n_ctx, self.n_past = n_ctx, 0

    def _check_room(self, pos0, n):
        if pos0 + n > self.n_ctx:
            raise ValueError(f"context is full ({self.n_ctx} positions)")

    def store(self, layer, pos0, k, v):
        n = k.shape[0]
        self._check_room(pos0, n)
        self.k[layer, pos0:pos0 + n] = k.to(self.k.dtype)
        self.v[layer, pos0:pos0 + n] = v.to(self.v.dtype)

    def clear(self):
        self.n_past = 0


class _TorchMLACache(_TorchKVCache):
    """ops_cpu.MLACache on the device: one row per position, roped key part then the latent."""

    def __init__(self, device, n_layer, n_ctx, n_rot, kv_lora_rank, index_dim=0, cache_type="f16"):
        self.k = torch.zeros((n_layer, n_ctx, 1, n_rot + kv_lora_rank), dtype=_DTYPES[cache_type], device=device)
        self.v = self.k[..., n_rot:]
        self.index_k = (torch.zeros((n_layer, n_ctx, index_dim), dtype=F32, device=device)
                        if index_dim else None)
        self.n_rot, self.n_ctx, self.n_past = n_rot, n_ctx, 0

    def store_index(self, layer, pos0, k):
        self._check_room(pos0, k.shape[0])
        self.index_k[layer, pos0:pos0 + k.shape[0]] = k

    def store(self, layer, pos0, k_rope, kv):
        n = kv.shape[0]
        self._check_room(pos0, n)
        self.k[layer, pos0:pos0 + n, 0, :self.n_rot] = k_rope.reshape(n, self.n_rot).to(self.k.dtype)
        self.k[layer, pos0:pos0 + n, 0, self.n_rot:] = kv.to(self.k.dtype)
