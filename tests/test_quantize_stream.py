"""The quantize pipeline's streaming of a tensor (quantize.convert_tensor): chunks sized for the
thread count, the next chunk read on a helper thread while one is quantized, and the bytes
written the same whatever the chunking (bench/deepseek671.py measures the speed and memory)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import quantkit
from quantkit import quantize
from models import write_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # rows of 256 (attention, gate/up) and 512 (down): llama-quantize's chunks are 64 and 32 rows
    return write_llama(tmp_path_factory.mktemp("stream") / "llama-f16.gguf", n_layer=1, dtype=np.float16, seed=3)


def test_chunks_grow_with_threads():
    """DeepSeek's 7168-wide expert rows: 144 rows a chunk by size, and at least ROWS_PER_THREAD
    rows per thread on many cores, still whole row groups and llama-quantize chunks."""
    def sizes(threads):
        return {r.stop - r.start for _, r in quantize._row_chunks(2048, 2, 7168, 4, threads)}
    assert max(sizes(1)) == 144
    big = max(sizes(64))
    assert big >= quantize.ROWS_PER_THREAD * 64 and big % 12 == 0      # lcm(4 rows, 3-row llama chunk)
    rows = [r for _, r in quantize._row_chunks(2048, 2, 7168, 4, 64)]
    assert rows[0].start == 0 and rows[-1].stop == 4096
    assert all(a.stop == b.start for a, b in zip(rows, rows[1:]))
    assert not any(r.start < 2048 < r.stop for r in rows)             # never across a matrix


@pytest.mark.parametrize("qtype", ["q2_K", "iq2_k_r4"])
def test_chunking_leaves_bytes_unchanged(llama, tmp_path, monkeypatch, qtype):
    """One chunk per tensor, a llama-quantize chunk (or row group) per chunk, and the large chunks of
    many threads write the same bytes (ik's q2_K decides per llama chunk whether rows are ternary;
    iq2_k_r4 interleaves groups of 4 rows)."""
    outs = []
    for chunk_bytes, rows_per_thread in ((quantize.CHUNK_BYTES, 1), (1, 1), (1, 64)):
        monkeypatch.setattr(quantize, "CHUNK_BYTES", chunk_bytes)
        monkeypatch.setattr(quantize, "ROWS_PER_THREAD", rows_per_thread)
        out = tmp_path / f"{chunk_bytes}-{rows_per_thread}.gguf"
        quantkit.quantize_model(llama, out, qtype)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]


def test_next_chunk_is_read_while_one_is_quantized(llama, tmp_path, monkeypatch):
    """Every chunk after a tensor's first is read by the read-ahead thread, each row once, in order."""
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 1)
    reads, real = [], quantize.read_rows
    started = threading.Event()

    def spy(info, rows):
        if started.is_set():
            reads.append((info.name, rows.start, rows.stop, threading.current_thread().name))
        return real(info, rows)

    real_warm_up = quantize.warm_up_plan

    def warm_up(*a, **k):           # its reads (a row group per kind) are not the run's
        log = real_warm_up(*a, **k)
        started.set()
        return log

    monkeypatch.setattr(quantize, "read_rows", spy)
    monkeypatch.setattr(quantize, "warm_up_plan", warm_up)
    with quantkit.open_quantization(llama, tmp_path / "q8.gguf", "q8_0") as q:
        q.write()
        converted = [(tp.name, tp.input_name) for tp in q.plan.tensors if tp.action != "copy"]
    by_tensor: dict[str, list] = {}
    for name, start, stop, thread in reads:
        by_tensor.setdefault(name, []).append((start, stop, thread))
    multi = 0
    for name, input_name in converted:
        chunks = by_tensor[input_name]
        assert chunks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), name
        assert all(t.startswith("quantkit-read") for _, _, t in chunks[1:]), (name, chunks)
        multi += len(chunks) > 1
    assert multi >= 5


def test_parallel_kernels_release_the_gil():
    """The quantizers' and decoders' parallel drivers run with the GIL released, so the pipeline's
    read-ahead and writer threads go on while a chunk is quantized (kernels/common.py)."""
    import importlib
    import pkgutil

    import quantkit.kernels as kernels
    from numba.core.registry import CPUDispatcher
    parallel = {}
    for m in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"quantkit.kernels.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.targetoptions.get("parallel"):
                parallel[f"{m.name}.{name}"] = obj.targetoptions.get("nogil", False)
    assert len(parallel) >= 20
    assert [k for k, nogil in parallel.items() if not nogil] == []
