"""Activations rounded the way mainline ggml's CPU backend rounds them before a quantized product.

ggml converts a product's float32 input to the weight type's ``vec_dot_type`` first: 8 bits per
value, one scale per block.  quantkit's products use the float32 input as it is (what the stored
weights mean), which is what the runtime's logit tests check.  llama-imatrix's numbers, though,
come from a model whose every layer saw rounded inputs, and on SmolLM2 Q4_1 that is the whole
residual between quantkit's imatrix and the reference file (96% of values within 2% exact, 99%
rounded).  :class:`MainlineRounding` reproduces the rounding for mainline's types:

  q8_0 / q8_1  blocks of 32: d = max|x| / 127 (stored f16), q = round(x * 127 / max|x|)
  q8_K         blocks of 256: the value of largest magnitude m, iscale = -127 / m,
               q = min(127, round(iscale * x)), d = 1 / iscale (stored f32)

ik_llama.cpp rounds differently, and per batch size (see ops_cpu), so no rounding imitates it.
"""
from __future__ import annotations

import numpy as np

from ..types import QuantType

F32 = np.float32
T = QuantType

# mainline ggml-cpu's type_traits_cpu[type].vec_dot_type, for the types quantkit writes
VEC_DOT_TYPE = {
    T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0, T.IQ4_NL: T.Q8_0,
    T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1,
    T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K, T.IQ4_XS: T.Q8_K,
}


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


def round_for(qtype, x: np.ndarray) -> np.ndarray:
    """x as mainline's product with a ``qtype`` weight sees it (unchanged for other types)."""
    vt = VEC_DOT_TYPE.get(QuantType(qtype))
    if vt is None:
        return x
    x = np.ascontiguousarray(x, F32)
    return round_q8_K(x) if vt == T.Q8_K else round_q8_0(x)


class MainlineRounding:
    """An ops backend whose quantized products first round their input as mainline ggml does."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def matmul_q(self, w, x):
        return self._ops.matmul_q(w, round_for(w.qtype, x))

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, matmul=None):
        return self._ops.moe_ffn(x, ids, weights, gate_exps, up_exps, down_exps, matmul=matmul or self.matmul_q)
