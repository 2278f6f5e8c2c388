"""Pieces the IQK kernels share: table lookups and the QHelper imatrix clean-up (formats._iqk).

``nearest_index`` needs no search: for each pair of neighbours (v[t-1], v[t]) of an ascending table
the float32 threshold from which C's comparison ``x - v[t-1] < v[t] - x`` picks the upper one is
found once at import (``thresholds``), and the index is the number of thresholds <= x.  The loop
has a fixed trip count, so LLVM vectorises it across lanes.
"""
from __future__ import annotations

import numpy as np
from numba import njit

F = np.float32
I32 = np.int32
QHELPER_EPS = F(1e-9)


def thresholds(values) -> np.ndarray:
    """thr[t-1] = the smallest float32 x with not(x - v[t-1] < v[t] - x) in float32 arithmetic.

    The predicate is monotone in x, so scanning a few ulps around the exact midpoint finds it."""
    v = np.asarray(values, np.float32)
    out = np.empty(v.size - 1, np.float32)
    for t in range(1, v.size):
        a, b = v[t - 1], v[t]
        x = np.float32((float(a) + float(b)) / 2)
        for _ in range(8):
            x = np.nextafter(x, np.float32(-np.inf))
        while (x - a) < (b - x):
            x = np.nextafter(x, np.float32(np.inf))
        out[t - 1] = x
    return out


@njit(cache=True, error_model="numpy")
def nearest_index(thr, a, overflow):
    """Index of the table value nearest to float32 ``a`` (ties to the upper one); NaN and
    ``a >= overflow`` give 0 (ik's ``(int)x`` lookup overflows to INT_MIN there)."""
    idx = I32(0)
    for t in range(thr.shape[0]):
        idx += I32(a >= thr[t])
    if not (a < overflow):
        idx = I32(0)
    return idx


@njit(cache=True, error_model="numpy")
def imatrix_cleanup_row(xr, qw, block, w):
    """QHelper for one row: w = qw, but blocks whose Σw², Σx² or Σw|x| is not above block*1e-18
    get 1e-9 throughout."""
    n = xr.shape[0]
    lim = F(block) * (QHELPER_EPS * QHELPER_EPS)
    for b0 in range(0, n, block):
        sw2 = F(0)
        sx2 = F(0)
        swx = F(0)
        for j in range(b0, b0 + block):
            sw2 += qw[j] * qw[j]
            sx2 += xr[j] * xr[j]
            swx += qw[j] * abs(xr[j])
        keep = sw2 > lim and sx2 > lim and swx > lim
        for j in range(b0, b0 + block):
            w[j] = qw[j] if keep else QHELPER_EPS
