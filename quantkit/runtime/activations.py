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

ik_llama.cpp rounds differently, and per batch size (see ops_cpu.py), so no rounding imitates it.
"""
from __future__ import annotations

import numpy as np

from ..types import TYPE_TRAITS, QuantType
from . import kernels
from .ops import Ops
from .tiles import by_rows

F32 = np.float32
T = QuantType

# mainline ggml-cpu's type_traits_cpu[type].vec_dot_type, for the types quantkit writes (types.py)
VEC_DOT_TYPE = {q: t.vec_dot_type for q, t in TYPE_TRAITS.items() if t.vec_dot_type is not None}


def round_for(qtype, x: np.ndarray) -> np.ndarray:
    """x as mainline's product with a ``qtype`` weight sees it (unchanged for other types)."""
    vt = VEC_DOT_TYPE.get(QuantType(qtype))
    if vt is None:
        return x
    x = np.ascontiguousarray(x, F32)
    out = np.empty_like(x)
    kernel = kernels.round_q8_K_rows if vt == T.Q8_K else kernels.round_q8_0_rows
    by_rows(lambda r0, r1: kernel(x[r0:r1], out[r0:r1]), x.shape[0])
    return out


class MainlineRounding:
    """An ops backend whose quantized products first round their input as mainline ggml does."""

    def __init__(self, ops: Ops):
        self._ops = ops
        # (input, block size, rounded input) of the last product: attn_q/k/v (and ffn_gate/up)
        # share one input, which is rounded once for them (the input is held, so `is` is safe)
        self._last = (None, 0, None)

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def layer_steps(self, layers, head, output_norm, shape):
        """None: a step in one call would round the backend's way (ops.Ops.layer_steps)."""
        return None

    def matmul_q(self, w, x, fused=None):
        vt = VEC_DOT_TYPE.get(QuantType(w.qtype))
        if vt is None:
            return self._ops.matmul_q(w, x, fused)
        block = 256 if vt == T.Q8_K else 32
        last_x, last_block, rounded = self._last
        if last_x is not x or last_block != block:
            rounded = self._ops.from_host(round_for(w.qtype, self._ops.host(x)))
            self._last = (x, block, rounded)
        return self._ops.matmul_q(w, rounded, False)     # rounded here, mainline's way

    def matmul_q_many(self, ws, x):
        return [self.matmul_q(w, x) for w in ws]            # each rounded its type's way

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, matmul=None, **options):
        """The backend's, every expert product rounded first; ``options`` (a fused gate_up_exps,
        an architecture's biases or activation) go to the backend as they are."""
        return self._ops.moe_ffn(x, ids, weights, gate_exps, up_exps, down_exps, matmul=matmul or self.matmul_q,
                                 **options)

    def warm_up(self, qtypes) -> None:
        """Make the rounding kernels of ``qtypes`` ready (runtime/warmup.py), on a scratch row."""
        for qtype in {QuantType(t) for t in qtypes}:
            round_for(qtype, np.zeros((1, 256), F32))
