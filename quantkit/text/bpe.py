"""Byte-level BPE (``tokenizer.ggml.model`` "gpt2"): words are spelled with one character per UTF-8
byte (GPT-2's byte <-> unicode map) and merged pair by pair in the rank order of the vocabulary's
merges, as llama.cpp's llm_tokenizer_bpe_session does.  Splitting text into words comes first
(pretokenize.py).
"""
from __future__ import annotations

import heapq


# ---- GPT-2 byte <-> unicode mapping (unicode_byte_to_utf8_map) ----
def _byte_to_char() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_CHAR = _byte_to_char()
_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHAR)}
_BYTE_ENCODE = bytes(range(256)).decode("latin-1").maketrans(
    {chr(b): c for b, c in enumerate(_BYTE_CHAR)})    # latin-1 text -> mapped chars


def byte_encode(word: str) -> str:
    """``word`` with each of its UTF-8 bytes as the character the vocabulary spells it with."""
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE)


def bytes_text(data: bytes) -> str:
    """Raw token bytes as the vocabulary spells them (a tiktoken rank file holds bytes)."""
    return data.decode("latin-1").translate(_BYTE_ENCODE)


def byte_decode(text: str) -> bytes:
    """llama_decode_text: a byte-level token's text back to its bytes; a character outside the byte
    map is written as llama.cpp writes it, "[UNK_BYTE_0x<its UTF-8 hex><the whole text>]"."""
    out = bytearray()
    for c in text:
        b = _CHAR_BYTE.get(c)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + c.encode("utf-8", "surrogatepass").hex().encode() \
                + text.encode("utf-8", "surrogatepass") + b"]"
    return bytes(out)


def merge(word: str, ranks: dict[tuple[str, str], int], token_to_id: dict[str, int],
          ignore_merges: bool = False) -> list[int]:
    """llm_tokenizer_bpe_session: the ids of one byte-encoded word (:func:`byte_encode`) merged
    pair by pair by rank (lowest first, then leftmost); ``ignore_merges``: a word that is a token
    is that token."""
    tok = token_to_id
    if not word:
        return []
    if ignore_merges and word in tok:
        parts = [word]
    else:
        syms = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None:
                heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or a + b != text:
                continue                        # outdated bigram
            syms[left], syms[right] = text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            for l, r in ((prev[left], left), (left, nxt[left])):
                if l >= 0 and r >= 0:
                    rank = ranks.get((syms[l], syms[r]))
                    if rank is not None:
                        heapq.heappush(heap, (rank, l, r, syms[l] + syms[r]))
        parts = [s for s in syms if s]
    ids = []
    for s in parts:
        t = tok.get(s)
        if t is not None:
            ids.append(t)
            continue
        for b in s.encode("utf-8"):             # llama.cpp looks up each byte as a 1-byte string
            t = tok.get(chr(b)) if b < 0x80 else None
            if t is not None:
                ids.append(t)
    return ids
