"""The parallel drivers of kernels/common.py, which run a family's row kernel through a function
pointer compiled for one signature."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from numba import njit

from quantkit.kernels import kquants
from quantkit.kernels.common import decode_rows
from quantkit.tables import FP16_TABLE
from quantkit.types import QuantType

Q8_0 = int(QuantType.Q8_0)       # a row of 32 values is 34 bytes


def test_a_row_decoder_compiles_once_when_threads_decode_at_once():
    """The runtime decodes tiles from several threads: the first call compiles the family's row
    decoder, and the others, arriving meanwhile, must wait for it, not find it closed to compiling
    (numba raises 'compilation disabled')."""
    @njit(cache=False)
    def decode_row(qtype, b, y, fp16_table):       # a fresh dispatcher: nothing compiled yet
        for j in range(y.shape[0]):
            y[j] = fp16_table[b[j]] * qtype

    blocks = np.arange(4 * 34, dtype=np.uint8).reshape(4, 34)
    start = threading.Barrier(8)

    def decode(_):
        out = np.empty((4, 32), np.float32)
        start.wait()
        decode_rows(decode_row, Q8_0, blocks, FP16_TABLE, out)
        return out

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(decode, range(8)))
    want = FP16_TABLE[blocks[:, :32]] * np.float32(Q8_0)
    for got in results:
        np.testing.assert_array_equal(got, want)
    readonly = blocks.copy()
    readonly.flags.writeable = False              # a memory-mapped model's bytes
    np.testing.assert_array_equal(_decode_once(decode_row, readonly), want)


def _decode_once(decode_row, blocks):
    out = np.empty((blocks.shape[0], 32), np.float32)
    decode_rows(decode_row, Q8_0, blocks, FP16_TABLE, out)
    return out


def test_blocks_that_do_not_hold_the_rows_are_refused_before_the_kernel():
    """The row decoders read without bounds checks: bytes short of the rows' values never reach one."""
    out = np.empty((2, 256), np.float32)
    for blocks in (np.zeros((2, 143), np.uint8), np.zeros((1, 144), np.uint8), np.zeros(288, np.uint8)):
        with pytest.raises(ValueError, match="do not hold 2 rows of 256 values"):
            kquants.dequantize_rows(int(QuantType.Q4_K), blocks, FP16_TABLE, out)


def test_decoding_calls_the_compiled_driver_directly():
    """decode_rows reaches the driver's compiled code without its dispatcher (which types the
    function tuple on every call, ~80 us, a few hundred times per prompt): the signature it looks
    up is the one the driver is compiled for, and an output it cannot take goes to the dispatcher."""
    from quantkit.kernels import common
    blocks = np.zeros((2, 210), np.uint8)                          # two Q6_K rows of 256 values
    out = np.empty((2, 256), np.float32)
    decode_rows(kquants.decode_row, int(QuantType.Q6_K), blocks, FP16_TABLE, out)
    assert common._DRIVER_SIG in common.decode_rows_with.overloads
    assert common._decode_driver(blocks, FP16_TABLE, out) is not common.decode_rows_with
    assert common._decode_driver(blocks, FP16_TABLE, np.empty((256, 2), np.float32).T) is common.decode_rows_with
