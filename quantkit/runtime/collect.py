"""Importance-matrix collection: the activations every weight multiplies, as llama-imatrix sums them.

:class:`ObservingOps` wraps an ops backend and reports the input of every matrix product to an
:class:`ActivationStats` before computing it, so the model code does not know it is observed.  What
is kept follows llama-imatrix (specs/ggml-quants.md §3.1):

* a dense product (``blk.*`` weights; ``output.weight`` only with ``process_output``; never the
  token embedding, also not when it doubles as the output matrix) adds Σ x_j² per input column and
  the number of tokens, for batches of at least 16 tokens;
* a routed expert (3-D ``*_exps`` tensors) adds, per expert, the rows of the tokens routed to it and
  their number: an expert that never fires keeps count 0 ("partial data"; what a file keeps of
  such entries is imatrix_tools' policy).  Fused gate/up experts (``ffn_gate_up_exps``, one
  product per expert: runtime/experts.py) get one entry under that name, as ik_llama.cpp's
  llama-imatrix names it, whose lookup in llama-quantize serves both halves;
* a per-head product (MLA's ``attn_k_b``/``attn_v_b``, or the value rows of a fused ``attn_kv_b``)
  keeps one row of sums per matrix the file stores and one count of tokens: a 3-D tensor
  [n_in, n_out, n_head] gets one row per head, as llama-imatrix collects it (``i02 = i12 / rk2``),
  and a tensor stored flat in 2-D (ik_llama.cpp's converter, quantkit's own: attn_k_b
  [qk_nope, n_head * kv_lora], attn_v_b and attn_kv_b [kv_lora, ...]) one row, the sum over the
  heads, since llama-quantize gives such a tensor one vector of ne[0] weights.  The key rows of a
  fused attn_kv_b are used transposed (their input runs along the tensor's rows, not the columns
  an imatrix weighs) and are not observed; llama-quantize gives attn_kv_b the weights of
  attn_v_b and vice versa when one of them is missing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import QuantkitError
from . import kernels
from .model import NonFiniteLogits
from .ops import Ops
from .perplexity import check_nll
from .scoring import scored_span, token_nll
from .warmup import warm_up

MIN_ROWS = 16                       # llama-imatrix ignores dense products of fewer rows
_EXPERT = re.compile(r"^(.*)\[(\d+)\]$")                # Weight.expert(e) is named "name[e]"


@dataclass
class Entry:
    sums: np.ndarray                # float64 (n_mat, n_in): Σ x² per matrix and input column
    counts: np.ndarray              # int64 (n_mat,) tokens per matrix; (1,) for dense and per-head


@dataclass
class ActivationStats:
    process_output: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)

    def wanted(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def _entry(self, name: str, n_mat: int, n_in: int, n_counts: int) -> Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(np.zeros((n_mat, n_in)), np.zeros(n_counts, np.int64))
        if e.sums.shape != (n_mat, n_in):
            # data loaded from a file is stored one row per count: take this product's shape
            if e.sums.size != n_mat * n_in or e.counts.size != n_counts:
                raise QuantkitError(f"imatrix entry '{name}': {e.sums.size} values and {e.counts.size} "
                                    f"counts do not fit this model's {n_mat} x {n_in} and {n_counts}")
            e.sums = e.sums.reshape(n_mat, n_in)
        return e

    @classmethod
    def from_raw(cls, raw, process_output: bool = False) -> "ActivationStats":
        """Start from earlier data (a :class:`quantkit.imatrix_tools.RawImatrix`): --in-file."""
        return cls(process_output, {n: Entry(raw.sums[n].astype(np.float64).copy(), raw.counts[n].astype(np.int64).copy())
                                    for n in raw.sums})

    def add_dense(self, name: str, x: np.ndarray) -> None:
        if self.wanted(name) and x.shape[0] >= MIN_ROWS:
            e = self._entry(name, 1, x.shape[1], 1)
            # squares in float as llama-imatrix forms them, summed in double
            kernels.add_square_sums(np.ascontiguousarray(x, np.float32), e.sums[0])
            e.counts[0] += x.shape[0]
            _check_finite(name, e.sums[0])

    def add_expert(self, name: str, expert: int, n_expert: int, x: np.ndarray) -> None:
        if self.wanted(name):
            e = self._entry(name, n_expert, x.shape[1], n_expert)
            kernels.add_square_sums(np.ascontiguousarray(x, np.float32), e.sums[expert])
            e.counts[expert] += x.shape[0]
            _check_finite(name, e.sums[expert])

    def add_heads(self, name: str, x: np.ndarray, n_mat: int) -> None:
        """x (n_tokens, n_head, d_in) through a tensor that stores n_mat matrices (n_head or 1):
        head h adds to row h * n_mat // n_head of the sums; one count of tokens."""
        n_tokens, n_head, d_in = x.shape
        if n_head % n_mat:
            raise QuantkitError(f"tensor {name}: {n_mat} matrices for {n_head} heads")
        if self.wanted(name) and n_tokens >= MIN_ROWS:
            e = self._entry(name, n_mat, d_in, 1)
            sums = np.square(x, dtype=np.float32).sum(axis=0, dtype=np.float64)       # (n_head, d_in)
            e.sums += sums.reshape(n_mat, n_head // n_mat, d_in).sum(axis=1)
            e.counts[0] += n_tokens
            _check_finite(name, e.sums)


def _check_finite(name: str, sums: np.ndarray) -> None:
    """Sums of squares that are NaN or infinite (an input beyond ~1.8e19, whose float32 square
    overflows) are no importance matrix."""
    if not np.isfinite(sums).all():
        raise QuantkitError(f"imatrix: the inputs of {name} are NaN or so large that their squares overflow: "
                            "the model's weights or activations are out of range")


class ObservingOps:
    """An ops backend that reports every product's input to ``stats`` and then computes it with
    ``ops``.  ``shapes``: tensor name -> ggml shape, to know how many experts a 3-D tensor has."""

    def __init__(self, ops: Ops, stats: ActivationStats, shapes: dict[str, tuple[int, ...]]):
        self._ops, self.stats, self._shapes = ops, stats, shapes

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def layer_steps(self, layers, head, output_norm, shape):
        """None: a step in one call would multiply past the observer (ops.Ops.layer_steps)."""
        return None

    def matmul_q(self, w, x, fused=None, **options):
        m = _EXPERT.match(w.name)           # one expert's matrix (a fused ffn_gate_up_exps' too: one input)
        seen = self._ops.host(x)
        if m is None:
            self.stats.add_dense(w.name, seen)
        else:
            base = m.group(1)
            shape = self._shapes.get(base, ())
            n_expert = int(np.prod(shape[2:])) if len(shape) > 2 else 1
            self.stats.add_expert(base, int(m.group(2)), n_expert, seen)
        return self._ops.matmul_q(w, x, fused, **options)      # options: an architecture's, as they are

    def matmul_q_many(self, ws, x):
        return [self.matmul_q(w, x) for w in ws]            # each observed

    def matmul_q_heads(self, ws, x, transposed: bool = False):
        if not transposed:                      # transposed: the input runs along the rows (see above)
            name = ws[0].name.split("[")[0]     # heads: row slices "name[r0:r1]"
            shape = self._shapes.get(name, ())
            n_mat = int(np.prod(shape[2:])) if len(shape) > 2 else 1
            self.stats.add_heads(name, self._ops.host(x), n_mat)
        return self._ops.matmul_q_heads(ws, x, transposed)

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, matmul=None, **options):
        """The backend's, every expert product through :meth:`matmul_q` (observed), or through
        the ``matmul`` of a wrapper above, which reaches it; ``options`` (a fused gate_up_exps, an
        architecture's biases or activation) go to the backend as they are."""
        return self._ops.moe_ffn(x, ids, weights, gate_exps, up_exps, down_exps, matmul=matmul or self.matmul_q,
                                 **options)

    def warm_up(self, qtypes) -> None:
        """Make the kernel that sums squares ready (runtime/warmup.py), on scratch rows: the stats
        are not touched."""
        kernels.add_square_sums(np.zeros((1, 32), np.float32), np.zeros(32))


def collect(model, chunks: list[np.ndarray], on_chunk=None, all_logits: bool = False) -> list[float]:
    """Run every chunk from an empty cache, as llama-imatrix does (its products see the whole
    chunk); ``model`` computes with an :class:`ObservingOps`.  Returns the negative log-likelihoods
    of each chunk's second half, llama-imatrix's running perplexity; ``on_chunk(i, nll)`` after each
    chunk.  The output matrix is applied to the scored half only, unless ``all_logits`` (it is
    observed then: --process-output)."""
    warm_up(model, {len(c) for c in chunks})      # not observed: it adds nothing to the imatrix
    nll: list[float] = []
    for i, chunk in enumerate(chunks):
        n_ctx = len(chunk)
        first, _ = scored_span(n_ctx)
        start = 0 if all_logits else first
        where = f"chunk {i + 1} of {len(chunks)}"
        try:
            logits = model.forward(chunk, model.new_cache(n_ctx), logits_from=start)
        except NonFiniteLogits as e:
            raise e.at(where) from None
        chunk_nll = token_nll(logits[first - start:n_ctx - 1 - start], chunk[first + 1:])
        nll.extend(chunk_nll.tolist())
        check_nll(chunk_nll, nll, where)
        if on_chunk is not None:
            on_chunk(i, nll)
    return nll
