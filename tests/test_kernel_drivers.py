"""The parallel drivers of kernels/common.py, which run a family's row kernel through a function
pointer compiled for one signature."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from quantkit.kernels.common import decode_rows
from quantkit.tables import FP16_TABLE


def test_a_row_decoder_compiles_once_when_threads_decode_at_once():
    """The runtime decodes tiles from several threads: the first call compiles the family's row
    decoder, and the others, arriving meanwhile, must wait for it, not find it closed to compiling
    (numba raises 'compilation disabled')."""
    @njit(cache=False)
    def decode_row(qtype, b, y, fp16_table):       # a fresh dispatcher: nothing compiled yet
        for j in range(y.shape[0]):
            y[j] = fp16_table[b[j]] * qtype

    blocks = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
    start = threading.Barrier(8)

    def decode(_):
        out = np.empty((4, 16), np.float32)
        start.wait()
        decode_rows(decode_row, 3, blocks, FP16_TABLE, out)
        return out

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(decode, range(8)))
    want = FP16_TABLE[blocks] * np.float32(3)
    for got in results:
        np.testing.assert_array_equal(got, want)
    readonly = blocks.copy()
    readonly.flags.writeable = False              # a memory-mapped model's bytes
    np.testing.assert_array_equal(_decode_once(decode_row, readonly), want)


def _decode_once(decode_row, blocks):
    out = np.empty(blocks.shape, np.float32)
    decode_rows(decode_row, 3, blocks, FP16_TABLE, out)
    return out
