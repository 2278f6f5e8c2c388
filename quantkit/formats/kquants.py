"""The k-quants: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value super-blocks).

A super-block of 256 values is cut into sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
Every sub-block gets its own small integer scale (and for Q2_K/Q4_K/Q5_K a min), quantized against
one fp16 super-scale ``d`` (and ``dmin``); specs/ggml-quants.md §1.2-1.6 give layouts and decoding::

    Q2_K  y = d*(sc&0xF)*q - dmin*(sc>>4)         q in 0..3      scales[16] qs[64] d dmin
    Q3_K  y = d*(sc6-32)*(q-4)                     q in 0..7      hmask[32] qs[64] scales[12] d
    Q4_K  y = d*sc6*q - dmin*m6                    q in 0..15     d dmin scales[12] qs[128]
    Q5_K  y = d*sc6*q - dmin*m6                    q in 0..31     d dmin scales[12] qh[32] qs[128]
    Q6_K  y = d*sc8*(q-32)                         q in 0..63     ql[128] qh[64] scales[16] d

Quantizers.  ``ggml_quantize_chunk`` runs the ``quantize_row_*_ref`` function when no imatrix is
given and the ``*_impl`` function with one.  Both end the same way: the super-scales are stored as
fp16 and every code is re-derived from the *rounded* scales.  The scale searches are helpers shared
with the legacy types, and ik_llama.cpp changed several of them:

* ``make_qkx2_quants`` (Q2_K/Q4_K/Q5_K without imatrix): a sub-block is "flat" (all codes 0) when
  ``max == min`` in mainline, ``max - min < 1e-10`` in ik;
* ``make_qkx3_quants`` (Q2_K/Q4_K/Q5_K with imatrix): mainline is make_qkx2 in float32; ik keeps the
  sums in double, evaluates each trial's error from the sums and ends with a greedy refinement;
* ``make_qx_quants`` (Q3_K with imatrix, Q6_K): ik tries two scales per step (also ``is = 0``) and
  ends with a greedy refinement;
* ``make_q3_quants`` / ``make_qp_quants`` (ik): no guard against ``0/0`` in the returned scale, and
  ``make_qp_quants`` treats a maximum below 1e-16 (not 1e-15) as zero;
* ik's Q2_K: without imatrix a "TriNet" test on the whole chunk of rows handed to
  ``ggml_quantize_chunk`` may store a ternary encoding.  quantkit applies it to llama-quantize's
  chunks, ``chunk_rows(n_per_row)`` rows counted from the first row of the array given to
  ``quantize`` (so callers that quantize a tensor in slabs should cut them at multiples of that, and
  3-D tensors one expert at a time, as llama-quantize does).  With an imatrix ``sigma2`` is
  ``0.75*Σx²/256`` (mainline ``Σx²/256``) and the codes are re-derived from the unrounded float scales.

The quantizers are the numba kernels of :mod:`quantkit.kernels.kquants`, which keep the C
evaluation order of every float32 (or double) expression; the reference decoder is formats/decode.py's.
"""
from __future__ import annotations

from ..kernels import kquants as kernels
from ..types import QuantType
from ._base import ALL_PATHS, FamilyKernelFormat, reference_decoder

#: llama-quantize hands ggml_quantize_chunk chunks of ceil(16384 / n_per_row) rows (at least one
#: row); ik's Q2_K TriNet test looks at one chunk at a time (llama-quantize.cpp, min_chunk_size)
MIN_CHUNK_ELEMENTS = 32 * 512


def chunk_rows(n_per_row: int) -> int:
    """Rows per llama-quantize chunk (the unit of ik's Q2_K TriNet test)."""
    if n_per_row >= MIN_CHUNK_ELEMENTS:
        return 1
    return (MIN_CHUNK_ELEMENTS + n_per_row - 1) // n_per_row


# ---- the formats ----


class _KQuant(FamilyKernelFormat):
    """The row kernels of kernels/kquants.py; the reference decoder of formats/decode.py."""
    kernel_module = kernels
    kernel_takes_flavor = True
    quant_paths = ALL_PATHS
    dequantize_ref = reference_decoder


class Q2_K(_KQuant, qtype=QuantType.Q2_K):
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; fp16 d @80; fp16 dmin @82 }
    scale_fields = ((80, "<f2"), (82, "<f2"))

    @classmethod
    def _kernel_quantize(cls, x, qw, has_qw, ik, out):
        super()._kernel_quantize(x, qw, has_qw, ik, out)
        if ik and not has_qw:           # ik's TriNet test, one llama-quantize chunk at a time
            kernels.q2_k_trinet(x, chunk_rows(x.shape[1]), out)


class Q3_K(_KQuant, qtype=QuantType.Q3_K):
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d @108 }
    scale_fields = ((108, "<f2"),)


class Q4_K(_KQuant, qtype=QuantType.Q4_K):
    # block_q4_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))


class Q5_K(_KQuant, qtype=QuantType.Q5_K):
    # block_q5_K { fp16 d @0; fp16 dmin @2; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] }
    scale_fields = ((0, "<f2"), (2, "<f2"))


class Q6_K(_KQuant, qtype=QuantType.Q6_K):
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d @208 }
    scale_fields = ((208, "<f2"),)
