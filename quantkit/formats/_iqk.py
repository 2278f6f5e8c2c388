"""Pieces every IQK quantizer of ik_llama.cpp shares (specs/ik-quants.md §0, §0.1, §2).

* The non-linear value tables live in :mod:`quantkit.tables` (the kernels read them too).
* ``nearest_index``: the ``best_index_iq*nl`` helpers, "the nearest table value, an exact tie goes to
  the upper index, clamped at both ends".  ik evaluates them through a lookup on ``(int)x``; C's
  float-to-int conversion turns NaN and x >= 2^31 into INT_MIN, which lands on index 0.
* ``imatrix_cleanup``: the QHelper step.  Before quantizing a row, every block of ``block`` weights
  whose Σw², Σx² or Σw|x| is not above ``block * 1e-18`` gets the weight 1e-9 throughout, so a
  column the calibration never saw cannot zero out a block's fit.
"""
from __future__ import annotations

import numpy as np

F = np.float32

TWO_POW_31 = F(2.0 ** 31)
QHELPER_EPS = F(1e-9)


def nearest_index(values: np.ndarray, x: np.ndarray, overflow: float = TWO_POW_31) -> np.ndarray:
    """Index (int64) of the entry of the ascending table ``values`` nearest to float32 ``x``.

    Exact ties go to the upper index (C: ``x - v[a] < v[b] - x ? a : b`` in float32).  Inputs that
    are NaN or not below ``overflow`` give 0, like ik's ``(int)x`` lookup."""
    v = np.asarray(values, np.float32)
    x = np.asarray(x, np.float32)
    n = v.size
    with np.errstate(invalid="ignore"):
        hi = np.clip(np.searchsorted(v, x, side="right"), 1, n - 1)     # v[hi-1] <= x < v[hi]
        res = np.where(x - v[hi - 1] < v[hi] - x, hi - 1, hi)
        res = np.where(x <= v[0], 0, np.where(x >= v[n - 1], n - 1, res))
        res = np.where(np.isnan(x) | ~(x < F(overflow)), 0, res)
    return res.astype(np.int64)


def imatrix_cleanup(x: np.ndarray, imatrix: np.ndarray | None, block: int) -> np.ndarray | None:
    """QHelper: per-row weights (n_rows, n) from the imatrix (n,), degenerate blocks set to 1e-9.

    Sums are float32 and sequential over the block, as in C."""
    if imatrix is None:
        return None
    n_rows, n = x.shape
    w = np.broadcast_to(np.asarray(imatrix, np.float32), (n_rows, n)).reshape(n_rows, n // block, block)
    xb = np.asarray(x, np.float32).reshape(n_rows, n // block, block)
    sw2 = np.zeros(w.shape[:2], np.float32)
    sx2 = np.zeros(w.shape[:2], np.float32)
    swx = np.zeros(w.shape[:2], np.float32)
    for j in range(block):
        sw2 += w[..., j] * w[..., j]
        sx2 += xb[..., j] * xb[..., j]
        swx += w[..., j] * np.abs(xb[..., j])
    lim = F(block) * (QHELPER_EPS * QHELPER_EPS)
    keep = (sw2 > lim) & (sx2 > lim) & (swx > lim)
    out = np.where(keep[..., None], w, QHELPER_EPS).astype(np.float32)
    return out.reshape(n_rows, n)
