"""What both --kl-divergence-base forms share.  The writers put a header and the tokens first, then
the scored positions as they come; the file appears under its name only when the block ends
without an error (a temporary file is renamed), so an interrupted run leaves no truncated base
file behind.  The readers check the tokens after the header the same way."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import QuantkitError
from ..outputs import AtomicOutput


class BaseFileWriter:
    """A context manager; subclasses give the header and write positions with ``self._fh``."""

    def __init__(self, path: Path, head: bytes, chunks: list[np.ndarray], n_vocab: int):
        self.path, self.n_vocab = Path(path), n_vocab
        self._head = head
        self._tokens = np.concatenate(chunks).astype("<i4")
        self._out = AtomicOutput()
        self._fh = None

    def __enter__(self):
        self._out.__enter__()
        try:
            self._fh = self._out.open(self.path)
            self._fh.write(self._head)
            self._fh.write(self._tokens)
        except BaseException:
            self._out.discard()
            raise
        return self

    def __exit__(self, *exc):
        return self._out.__exit__(*exc)


def read_tokens_and_rows(path: Path, offset: int, n_tok: int, n_ctx: int, n_vocab: int, dtype, shape):
    """A base file's tokens (at ``offset``, each checked against the vocabulary) and the rows that
    follow them, memory-mapped as ``dtype`` in ``shape`` (the header was checked against the size)."""
    try:
        tokens = np.fromfile(path, "<i4", count=n_tok, offset=offset).astype(np.int64)
        data = np.memmap(path, dtype, mode="r", offset=offset + 4 * n_tok, shape=shape)
    except OSError as e:
        raise QuantkitError(f"{path}: {e.strerror}") from None
    bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
    if bad.size:
        raise QuantkitError(f"{path}: token {int(tokens[bad[0]])} (chunk {bad[0] // n_ctx + 1}) is outside "
                            f"the file's vocabulary of {n_vocab}")
    return tokens, data
