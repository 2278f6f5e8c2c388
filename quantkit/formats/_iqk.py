"""ik_llama.cpp's QHelper imatrix clean-up (specs/ik-quants.md §0.1), as numpy.

The IQK quantizer kernels run it themselves (kernels/_iqk.py); the interleaved types' wrappers
(formats/repacked.py) run it here before handing the cleaned weights to the plain quantizer.  Before
quantizing a row, every block of ``block`` weights whose Σw², Σx² or Σw|x| is not above
``block * 1e-18`` gets the weight 1e-9 throughout, so a column the calibration never saw cannot zero
out a block's fit.
"""
from __future__ import annotations

import numpy as np

F = np.float32

QHELPER_EPS = F(1e-9)


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
