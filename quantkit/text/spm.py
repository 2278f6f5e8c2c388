"""SentencePiece-style tokenization (``tokenizer.ggml.model`` "llama"): spaces as U+2581, bigrams
merged by token score, what no token covers as ``<0xXX>`` byte tokens (llm_tokenizer_spm_session).
"""
from __future__ import annotations

import heapq

from ..errors import QuantkitError


def byte_token(token_to_id: dict[str, int], b: int) -> int:
    """The token of byte ``b``: ``<0xXX>``, or for ASCII the character itself."""
    t = token_to_id.get(f"<0x{b:02X}>")
    if t is None and b < 0x80:
        t = token_to_id.get(chr(b))
    if t is None:
        raise QuantkitError(f"the vocabulary has no token for byte 0x{b:02X}")
    return t


def merge(text: str, token_to_id: dict[str, int], scores: list[float], out: list[int]) -> None:
    """Append the ids of ``text`` (spaces already U+2581) to ``out``: bigrams merged by token score
    (highest first, then leftmost), then each symbol resegmented into tokens."""
    syms = list(text)
    n = len(syms)
    if not n:
        return
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prev = list(range(-1, n - 1))
    tok = token_to_id
    heap: list = []
    rev_merge: dict[str, tuple[int, int]] = {}

    def try_add(l: int, r: int) -> None:
        if l < 0 or r < 0:
            return
        t = syms[l] + syms[r]
        tid = tok.get(t)
        if tid is None:
            return
        heapq.heappush(heap, (-scores[tid], l, r, len(t)))
        rev_merge[t] = (l, r)

    for i in range(1, n):
        try_add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = syms[left], syms[right]
        if not a or not b or len(a) + len(b) != size:
            continue                            # one side already merged
        syms[left], syms[right] = a + b, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])

    def resegment(s: str) -> None:
        tid = tok.get(s)
        if tid is not None:
            out.append(tid)
            return
        p = rev_merge.get(s)
        if p is None:
            for b in s.encode("utf-8", "surrogatepass"):
                out.append(byte_token(token_to_id, b))
            return
        resegment(syms[p[0]])
        resegment(syms[p[1]])

    i = 0
    while i != -1:
        resegment(syms[i])
        i = nxt[i]
