"""Open a model file for the runtime: weights, tokenizer and thread settings together.

The CLI's ``run``, ``perplexity`` (and later ``imatrix``) start here, so they agree on how a file is
opened and how many threads compute.
"""
from __future__ import annotations

import codecs
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..gguf_io.reader import GGUFModel, open_model
from .model import Model
from .perplexity import chunk_tokens
from .tokenizer import Tokenizer


def set_threads(threads: int | None) -> int:
    """Compute on ``threads`` threads (all cores when None).

    The matrix products split their rows between that many threads of their own, each decoding
    and multiplying single-threaded, so numba's and BLAS's own pools are kept at one thread for
    them (see ops_cpu._TilePool); numba's count is what the products read."""
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


@contextmanager
def open_session(path, threads: int | None = None, wrap_ops=None) -> Iterator[Session]:
    """``wrap_ops(gguf)``: the ops backend the model computes with (an observer, a rounding
    wrapper); ops_cpu when None."""
    n = set_threads(threads)
    gguf = open_model(path)
    try:
        model = Model(gguf) if wrap_ops is None else Model(gguf, ops=wrap_ops(gguf))
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
