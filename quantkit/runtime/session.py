"""Open a model file for the runtime: weights, tokenizer and thread settings together.

The CLI's ``run``, ``perplexity`` (and later ``imatrix``) start here, so they agree on how a file is
opened and how many threads compute.
"""
from __future__ import annotations

import codecs
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.reader import GGUFModel, open_model
from ..tensor_regex import compile_bounded
from .cache_type import cache_types
from .model import Model
from .perplexity import chunk_tokens
from ..text.tokenizer import Tokenizer
from . import ops_cpu


def set_threads(threads: int | None) -> int:
    """Compute on ``threads`` threads (all cores when None).

    The matrix products split their rows between that many threads of their own, each decoding
    and multiplying single-threaded, so numba's and BLAS's own pools are kept at one thread for
    them (see tiles.TilePool); numba's count is what the products read."""
    import numba
    from threadpoolctl import threadpool_limits
    n = max(1, min(threads or os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    threadpool_limits(1, user_api="blas")
    return n


@dataclass
class Session:
    gguf: GGUFModel
    model: Model
    tokenizer: Tokenizer
    threads: int

    def chunks(self, text: str, n_ctx: int, n_chunks: int | None = None, skip: int = 0) -> list[np.ndarray]:
        """The text in llama-perplexity's / llama-imatrix's chunks of ``n_ctx`` tokens (BOS first
        where the vocabulary adds one), after the first ``skip`` chunks."""
        tok = self.tokenizer
        tokens = tok.encode(text, add_special=True)[skip * n_ctx:]
        bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
        return chunk_tokens(tokens, n_ctx, n_chunks, bos)


DEVICES = ("cpu", "cuda", "torch-cpu")


def make_ops(device: str = "cpu", cpu_tensors=(), threads: int = 1, triton: bool | None = None,
             float_products: bool = False):
    """The ops backend for ``device``: "cpu" the numba backend (ops_cpu); "cuda" / "cuda:N" the
    torch backend on that GPU, with tensors matching ``cpu_tensors`` (regexes) kept on the CPU;
    "torch-cpu" the torch backend on the CPU (the CUDA code path, where no GPU is).  ``triton``:
    the torch backend's fused Triton kernels (ops_torch.TorchOps; None: on CUDA where installed).
    ``float_products``: the numba backend's batches multiply in float32 (decoded tiles and BLAS)
    instead of with 8-bit activations (ops_cpu.FloatProducts); the CPU backend's option only."""
    if device == "cpu":
        return ops_cpu.float_products if float_products else ops_cpu
    if float_products:
        raise QuantkitError(f"--float-products is an option of the CPU backend (--device cpu), not of --device {device}")
    if not (device in ("cuda", "torch-cpu") or re.fullmatch(r"cuda:\d+", device)):
        raise QuantkitError(f"unknown device '{device}' (cpu, cuda, cuda:N or torch-cpu)")
    try:
        import torch
    except ImportError:
        raise QuantkitError(f"--device {device} needs torch: pip install 'quantkit-gguf[cuda]'") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantkitError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, "
                            f"CUDA build: {torch.version.cuda or 'no'})")
    from .ops_torch import TorchOps
    torch.set_num_threads(threads)
    return TorchOps("cpu" if device == "torch-cpu" else device, cpu_tensors, triton)


def parse_overrides(specs) -> list[str]:
    """``--override-tensor REGEX=cpu`` values -> the regexes (only the CPU is a target here)."""
    patterns = []
    for spec in specs:
        regex, sep, target = spec.rpartition("=")
        if not sep or not regex or target.lower() != "cpu":
            raise QuantkitError(f"--override-tensor '{spec}': expected REGEX=cpu")
        compile_bounded(regex, "--override-tensor")      # valid, and its matching work bounded
        patterns.append(regex)
    return patterns


@contextmanager
def open_session(path, threads: int | None = None, wrap_ops=None, device: str = "cpu",
                 cpu_tensors=(), cache_type="f16", float_products: bool = False) -> Iterator[Session]:
    """``device``/``cpu_tensors``/``float_products``: see :func:`make_ops`.  ``wrap_ops(gguf, ops)``: the ops backend
    the model computes with, built around the device's (an observer, a rounding wrapper).
    ``cache_type``: the KV cache's type, "f16" or "f32", or a (K, V) pair (cache_type.py)."""
    cache_types(cache_type)                 # a bad type fails before the model loads
    n = set_threads(threads)
    ops = make_ops(device, cpu_tensors, n, float_products=float_products)
    gguf = open_model(path)
    try:
        model = Model(gguf, ops=ops if wrap_ops is None else wrap_ops(gguf, ops), cache_type=cache_type)
        yield Session(gguf, model, Tokenizer.from_model(gguf), n)
    finally:
        gguf.close()


class TextStream:
    """Token ids -> text as it becomes printable: a UTF-8 character split across tokens is held back
    until its last byte arrives (invalid bytes become U+FFFD, as llama.cpp's console shows them)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self.tokenizer.token_piece(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
