"""Sizes written by people: '500M', '2G' (powers of 1000, as gguf-split and llama.cpp print them) or
'1GiB' (powers of 1024), for --split-max-size, --bandwidth and the recipe budgets."""
from __future__ import annotations

import re

from .errors import QuantkitError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str, what: str = "--split-max-size") -> int:
    """'500M', '2G' (powers of 1000) or '1GiB' (powers of 1024) to bytes; ``what`` names the
    option in the one-line error."""
    m = _SIZE_RE.match(text)
    if not m:
        raise QuantkitError(f"{what}: cannot read size '{text}' (examples: 500M, 4G, 2GiB)")
    num, unit, binary = float(m[1]), m[2].lower(), m[3].lower().startswith("i")
    base = 1024 if binary else 1000
    n = int(num * base ** "_kmgt".index(unit)) if unit else int(num)
    if n <= 0:
        raise QuantkitError(f"{what} must be positive")
    return n
