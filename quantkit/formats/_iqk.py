"""Pieces every IQK quantizer of ik_llama.cpp shares (specs/ik-quants.md §0, §0.1, §2).

* The non-linear value tables.  Each has a base half and a "shifted" half (the ``extra`` bit of a
  sub-block selects the second half).
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

IQ2NL_VALUES = np.array([-31, -13, 1, 17, -26, -8, 6, 22], np.int8)
IQ3NL_VALUES = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], np.int8)
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                        -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], np.int8)
IQ5NL_VALUES = np.array([
    -126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
    -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
    -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
    1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123], np.int8)
IQ6NL_VALUES = np.array([
    -127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
    -51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5,
    -2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44,
    47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121,
    -126, -120, -114, -108, -103, -97, -92, -87, -83, -78, -73, -69, -65, -61, -57, -53,
    -50, -46, -43, -39, -36, -33, -30, -27, -24, -21, -18, -15, -12, -10, -7, -4,
    -1, 1, 4, 7, 10, 13, 15, 18, 21, 24, 28, 31, 34, 37, 41, 45,
    48, 52, 56, 60, 64, 69, 73, 78, 83, 88, 93, 99, 104, 110, 116, 122], np.int8)

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
