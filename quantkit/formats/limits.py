"""How large the values (and importance weights) may be that each quantizer is given.

ggml's quantizers compute in float32.  Their scale searches are weighted least squares: for a
trial scale they sum ``sumqx = Σ w·x·q`` and ``sumq2 = Σ w·q²`` over ``n`` values (a sub-block of
16 or 32; for the trellis types' row scale, the whole row) with codes ``|q| <= q_max``, and keep
the trial with ``sumqx*sumqx > best*sumq2``.  Once ``sumqx²`` passes FLT_MAX (about 2^128) every
comparison sees Inf and the search keeps whatever it had: the scale collapses to zero or to a
wrong trial and the block decodes to zeros, with nothing to tell (issue 22: one 1e38 zeroed its
block in q6_K, IQ4_XS, IQ4_K, IQ4_KS, IQ2_K, IQ2_KT).  So the input must keep ``|sumqx| <= 2^64``.

The weights are ``x²`` (or ``x² + σ²/4``, σ² at most 2.25 times the block's mean x²: at most
``2·X²`` with ``X`` the row's largest |x|) without an imatrix, and ``qw·sqrt(σ² + x²)`` (at most
``2·X·qw``) with one, so

    |sumqx| <= n · q_max · 2 · X³                    without an imatrix
    |sumqx| <= n · q_max · 2 · X · max_j(qw_j·|x_j|)   with one

and a row is quantized only if both stay at most 2^64 (the first bounds every type's largest
value, with or without an imatrix; the second, the imatrix weight times |x| of each column: the
products like w·x² the sums are made of), and if its weights stay below 2^60, because the QHelper
clean-up and the trellis types also sum the squared weights of 32 values (``X·max(qw) <= 2^60``).

Which sums each type compares (:data:`SEARCHES`) and the largest |x| that gives:

* the sub-block searches, n = 16 or 32: 1.3e5 (IQ4_NL, IQ4_XS, IQ4_KS: q_max = 127) to 5.8e5
  (Q2_K: q_max = 3);
* with an imatrix the k-quants also search the 16 (8) sub-block scales of a super-block, each
  weighted by its sub-block's summed weights, with q_max = 15 (Q2_K), 32 (Q3_K), 63 (Q4_K, Q5_K):
  1.3e5, 1.0e5, 8.3e4;
* IQ2_K searches its sub-block scales per super-block (q_max = 8: 1.65e5), IQ2_KS per row (q_max
  = 16: 5.2e4 for rows of 4096, 3.2e4 for 18432);
* the trellis types' row scale is searched over the whole row with q_max = 127 * 123 (the IQ4_K
  scale table times the largest trellis value): 1.3e4 for rows of 256, 5.2e3 for 4096, 3.2e3 for
  18432.

So every value an f16 model can hold (65504) passes, except in IQ2_KS rows longer than 2048 and
in the trellis types (real weights are orders of magnitude smaller).  These are upper bounds on the sums: near them the real sums are smaller (rows of ±X at the bound quantize
as rows of ±1 do, tests/test_hostile_numerics.py), and refinement steps that compare larger
products (make_qp_quants' coordinate descent) only stop early when those overflow, as in C.

Types without a search (Q8_0, and Q4_0/Q4_1/Q5_0/Q5_1 without an imatrix: the scale is the
block's largest value over a constant) have no such limit: their only failure is a scale beyond
fp16, which the output check (:func:`quantkit.formats.non_finite_column`) finds exactly.  F32, F16
and BF16 are conversions (F16's largest value is 65504, found the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..row_threads import over_rows, scratch
from ..types import QK_K, QuantType, traits, type_name

T = QuantType
SUM_LIMIT = 2.0 ** 64               # |sumqx| at most this: sumqx² stays below FLT_MAX (~2^128)
WEIGHT_LIMIT = 2.0 ** 60            # X·max(qw): Σ of 32 squared weights (2·X·qw)² stays below 2^127
IMATRIX_LIMIT = 2.0 ** 60           # an importance weight itself (the QHelper sums 32 of their squares)


@dataclass(frozen=True)
class Search:
    """One kind of weighted least-squares sum a quantizer compares squared."""
    n: int | None               # values per sum (None: the whole row)
    q_max: int                  # largest |code| (times integer sub-scale) multiplying them
    imatrix_only: bool = False  # only the imatrix path searches (without: scale = max / constant)


_KT = (Search(32, 123), Search(None, 127 * 123))
SEARCHES: dict[QuantType, tuple[Search, ...]] = {
    T.Q4_0: (Search(32, 8, True),), T.Q4_1: (Search(32, 15, True),),
    T.Q5_0: (Search(32, 16, True),), T.Q5_1: (Search(32, 31, True),),
    T.Q6_0: (Search(32, 32),),
    # with an imatrix the k-quants also search the super-block's sub-block scales (make_qp_quants,
    # make_qx_quants), each weighted by the sum of its sub-block's weights: 256 values' worth
    T.Q2_K: (Search(16, 3), Search(QK_K, 15, True)), T.Q3_K: (Search(16, 4), Search(QK_K, 32, True)),
    T.Q4_K: (Search(32, 15), Search(QK_K, 63, True)), T.Q5_K: (Search(32, 31), Search(QK_K, 63, True)),
    T.Q6_K: (Search(16, 32),),
    T.IQ4_NL: (Search(32, 127),), T.IQ4_XS: (Search(32, 127),),
    # IQ2_K and IQ2_KS search their sub-block scales too (ik's make_qx_quants): per super-block,
    # per row for IQ2_KS
    T.IQ2_K: (Search(16, 31), Search(QK_K, 8)), T.IQ3_K: (Search(16, 63),), T.IQ4_K: (Search(16, 127),),
    T.IQ5_K: (Search(16, 126),), T.IQ6_K: (Search(16, 127),),
    T.IQ2_KS: (Search(32, 31), Search(None, 16)), T.IQ3_KS: (Search(32, 63),), T.IQ4_KS: (Search(32, 127),),
    T.IQ5_KS: (Search(32, 126),), T.IQ4_KSS: (Search(32, 127),), T.IQ2_KL: (Search(32, 63),),
    T.IQ1_KT: _KT, T.IQ2_KT: _KT, T.IQ3_KT: _KT, T.IQ4_KT: _KT,
    # the i-quants' lattice levels 2l+1 <= 15 per 32-block
    T.IQ3_XXS: (Search(32, 15),), T.IQ3_S: (Search(32, 15),),
    # IQ2_*: levels 1, 3, 5 per 32 (16) values, then the 4-bit block scales 2s+1 <= 15 searched per
    # super-block (make_qp_quants, each weighted by its block's summed weights); IQ1_*: levels
    # -1..1 shifted by 1/8, block scales 2s+1 <= 15: bounded by the same 15 per 32 and per 256
    **{t: (Search(32, 15), Search(QK_K, 15)) for t in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)},
}


def _searches(qtype, with_imatrix: bool) -> list[Search]:
    qtype = QuantType(qtype)
    base = traits(qtype).base or qtype
    return [s for s in SEARCHES.get(base, ()) if with_imatrix or not s.imatrix_only]


def sum_factor(qtype, n_per_row: int, with_imatrix: bool) -> float:
    """``max(2 · n · q_max)`` over the type's searches (0: no search)."""
    return max((2.0 * (s.n or n_per_row) * s.q_max for s in _searches(qtype, with_imatrix)), default=0.0)


def largest_value(qtype, n_per_row: int, with_imatrix: bool = False) -> float:
    """The largest |x| a row of ``n_per_row`` values may hold for ``qtype`` (inf: no limit here)."""
    k = sum_factor(qtype, n_per_row, with_imatrix)
    if not k:
        return float("inf")
    limit = np.float32(np.cbrt(SUM_LIMIT / k))
    if float(limit) ** 3 * k > SUM_LIMIT:                # the float32 nearest may be above: step down
        limit = np.nextafter(limit, np.float32(0))
    return float(limit)


@dataclass(frozen=True)
class Excess:
    """Where a row is beyond what the quantizer can take, and why (for the error message)."""
    row: int
    column: int
    what: str


def row_extent(x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Per row of ``x`` (n_rows, n_per_row) float32: (max |x|, max |x|·imatrix) as (n_rows, 2)
    float32, max |x| = +inf for a row holding a NaN or an infinity (0 in the second column without
    an imatrix).  numpy on rows split between threads (no numba: a q8_0 quantize imports none)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], 2), np.float32)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    if x.size:
        over_rows(lambda a, b: _row_extent(x[a:b], qw, out[a:b]), x.shape[0], x.shape[1])
    return out


def _row_extent(x: np.ndarray, qw: np.ndarray | None, out: np.ndarray) -> None:
    a = np.abs(x, out=scratch("extent.a", x.shape, np.float32))
    big = a.max(axis=1)                         # NaN where the row holds one
    big[np.isnan(big)] = np.inf
    out[:, 0] = big
    if qw is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            a *= qw
        out[:, 1] = a.max(axis=1)


def first_excess(x: np.ndarray, qtype, imatrix: np.ndarray | None = None,
                 extent: np.ndarray | None = None) -> Excess | None:
    """The first row of ``x`` (n_rows, n_per_row) whose values (with ``imatrix``, (n_per_row,)) would
    overflow the quantizer's float32 arithmetic, or None.  ``extent``: :func:`row_extent` of the
    same rows and imatrix, where the caller has it.  The bounds are compared in float64."""
    n_rows, n = x.shape
    k = sum_factor(qtype, n, imatrix is not None)
    if not k:
        return None
    if extent is None:
        extent = row_extent(x, imatrix)
    big = extent[:, 0].astype(np.float64)               # X per row (exact)
    limit = largest_value(qtype, n, imatrix is not None)
    over = big > limit
    if imatrix is not None:
        qw = np.asarray(imatrix, np.float32)
        over_prod = k * big * extent[:, 1].astype(np.float64) > SUM_LIMIT    # an inf product is over too
        over_weight = big * float(qw.max()) > WEIGHT_LIMIT
    else:
        over_prod = over_weight = np.zeros(n_rows, bool)
    bad = over | over_prod | over_weight
    if not bad.any():
        return None
    r = int(np.argmax(bad))
    name = type_name(qtype)
    a = np.abs(x[r])
    if over[r]:
        c = int(np.argmax(a))
        return Excess(r, c, f"|x| = {x[r, c]:.6g} is beyond the largest value {name} can quantize in a row of "
                            f"{n} ({limit:.4g}: its float32 scale search would overflow)")
    if over_prod[r]:
        with np.errstate(over="ignore"):
            c = int(np.argmax(a * qw))
        return Excess(r, c, f"imatrix weight {qw[c]:.6g} times |x| = {a[c]:.6g} (the row's largest |x| "
                            f"{big[r]:.6g}) is beyond what {name}'s float32 scale search can sum "
                            f"({SUM_LIMIT / k:.4g} for |x| · weight · |x|)")
    c = int(np.argmax(qw))
    return Excess(r, c, f"imatrix weight {qw[c]:.6g} (the row's largest |x| {big[r]:.6g}) is beyond what "
                        f"{name}'s float32 weight sums can take ({WEIGHT_LIMIT:.4g} for |x| · weight)")


def imatrix_excess(values: np.ndarray) -> tuple[int, str] | None:
    """The first importance weight that is not a finite number in [0, IMATRIX_LIMIT], and why."""
    v = np.asarray(values)
    bad = ~np.isfinite(v) | (v < 0) | (v > IMATRIX_LIMIT)
    if not bad.any():
        return None
    c = int(np.argmax(bad))
    why = ("non-finite" if not np.isfinite(v[c]) else "negative (a mean of squares cannot be)" if v[c] < 0
           else f"above {IMATRIX_LIMIT:.4g} (the quantizers' float32 sums of squared weights would overflow)")
    return c, why
