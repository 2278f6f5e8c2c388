"""How numba's OpenMP worker threads wait between parallel regions, for the batch commands.

libgomp's default lets a worker spin for a while at every barrier before it sleeps.  A quantize
or repack launches a parallel kernel per chunk from the main thread and another from the writer
thread, so two thread teams share the cores: spinning workers of one team take the cores the
other needs, and on a loaded machine every barrier waits for descheduled spinners.  Measured on
2 shared cores (86 M weights F16 -> q8_0 with an imatrix, bench/quantize.py's model): 2.5-3.6 s
of quantizing with the default, 0.8-1.1 s with ``OMP_WAIT_POLICY=passive``, same bytes.  A
chunk is milliseconds of work, so a sleeping worker's wake-up (microseconds) costs nothing there;
the runtime's per-token kernels, where it would, are left as they are.

OpenBLAS (numpy's BLAS) is kept to one thread in these commands too (``OPENBLAS_NUM_THREADS=1``):
they call no BLAS routine whose speed matters (numpy's elementwise loops and numba's kernels do the
work), yet OpenBLAS starts a thread per extra core when numpy is imported: ``import numpy`` took
~30 ms more CPU that way on 2 shared cores (0.09 s vs 0.055 s), a sixth of a q8_0 quantize of an
F16 model (~0.2 s in all).  OpenBLAS reads the variable when numpy loads it, so quantize and
repack call :func:`passive_for_batch_jobs` before anything imports numpy.  Results never depend on
it (the only BLAS call on these paths, kernels/iq1.py's lattice distances, is exact).

libgomp reads the variable once, when numba loads its OpenMP layer (the first parallel kernel of
the process): :func:`passive_for_batch_jobs` is called by the CLI's quantize and repack before any
kernel runs.  A value the user set is kept.  A leaf module: it imports nothing of quantkit.
"""
from __future__ import annotations

import os

ENV = "OMP_WAIT_POLICY"
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def passive_for_batch_jobs() -> None:
    """``OMP_WAIT_POLICY=passive`` and ``OPENBLAS_NUM_THREADS=1``, each unless the environment sets
    it already."""
    os.environ.setdefault(ENV, "passive")
    os.environ.setdefault(BLAS_THREADS_ENV, "1")
