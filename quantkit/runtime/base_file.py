"""What both --kl-divergence-base writers share: a header and the tokens first, then the scored
positions as they come, the file appearing under its name only when the block ends without an
error (a temporary file is renamed), so an interrupted run leaves no truncated base file behind."""
from __future__ import annotations

from pathlib import Path

import numpy as np

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
