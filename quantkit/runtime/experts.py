"""The routed experts of one layer as ``ops.moe_ffn`` takes them, whichever way the file stores them.

Expert tensors are 3-D [n_in, n_out, n_expert].  Converters write the gate and up experts as two
tensors, ``ffn_gate_exps`` and ``ffn_up_exps``; ik_llama.cpp also loads them fused in one,
``ffn_gate_up_exps`` [n_embd, 2 n_ff, n_expert], whose expert e holds its n_ff gate rows and then
its n_ff up rows (its converter writes Gemma 4's experts so; its loader's ``-muge`` builds the same
layout in memory, and ``llama-imatrix`` then names the entry after the fused tensor).  The fused
experts are computed as ik does: one product per expert, split in halves, so an imatrix sees their
input once per token.  ``hparams.py`` checks the shapes of both layouts.
"""
from __future__ import annotations

FUSED = "ffn_gate_up_exps"


def expert_tensors(m, prefix: str) -> list[str]:
    """The routed-expert tensors of layer ``prefix`` (``blk.N.``) the file has, by their short names
    (``ffn_down_exps``: ``prefix`` + name + ``.weight`` is the tensor)."""
    fused = prefix + FUSED + ".weight" in m.w
    return ([FUSED] if fused else ["ffn_gate_exps", "ffn_up_exps"]) + ["ffn_down_exps"]


def expert_weights(m, prefix: str) -> dict:
    """``gate_exps``, ``up_exps``, ``down_exps`` and ``gate_up_exps`` for ``ops.moe_ffn``: the
    fused tensor with None for the two it replaces, or the two with None for it."""
    w = {name: m.w.need(prefix + name + ".weight") for name in expert_tensors(m, prefix)}
    return dict(gate_exps=w.get("ffn_gate_exps"), up_exps=w.get("ffn_up_exps"), down_exps=w["ffn_down_exps"],
                gate_up_exps=w.get(FUSED))
