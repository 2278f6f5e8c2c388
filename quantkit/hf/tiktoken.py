"""Kimi-K2's tokenizer: ``tiktoken.model`` (one "<base64 token> <rank>" line per token) and the
special tokens of ``tokenizer_config.json``, as GGUF vocabulary arrays, the way the converter's
Kimi-K2 branch (DeepseekV2Model.set_vocab) builds them from tokenization_kimi.py's TikTokenTokenizer,
without running that code (no trust_remote_code):

* ids 0 .. n-1 are the ranks of the n tokens, each spelled with GPT-2's byte characters;
* the 256 ids after them are the special tokens (tokenization_kimi.py's num_reserved_special_tokens):
  the content that ``added_tokens_decoder`` gives the id, else ``<|reserved_token_<id>|>``; CONTROL;
* merges: each token of two or more bytes split by BPE over the ranks below its own (QwenModel.bpe);
  when that ends in two parts, they are a merge, in the file's order;
* ids up to config.json's vocab_size that are neither are ``[PAD<id>]`` of type UNUSED.
"""
from __future__ import annotations

import base64
import binascii
from pathlib import Path

from ..errors import QuantkitError
from ..inputs import read_bounded
from ..text.bpe import bytes_text
from .config import MAX_JSON_BYTES, Fields, describe

N_RESERVED_SPECIAL = 256        # tokenization_kimi.py: TikTokenTokenizer.num_reserved_special_tokens
NORMAL, CONTROL, UNUSED = 1, 3, 5


def read_ranks(path: Path) -> dict[bytes, int]:
    """The token -> rank table of a tiktoken file (tiktoken's load_tiktoken_bpe), checked: ranks are
    the ids 0 .. n-1, each once, and every single byte is a token (BPE starts from bytes)."""
    data = read_bounded(path, MAX_JSON_BYTES, "a tiktoken vocabulary")
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2 or not parts[1].isdigit():
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise QuantkitError(f"{path}: line {n} is not '<base64 token> <rank>'") from None
        if not token:
            raise QuantkitError(f"{path}: line {n} holds an empty token")
        if token in ranks:
            raise QuantkitError(f"{path}: line {n} repeats the token of rank {ranks[token]}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise QuantkitError(f"{path}: the ranks are not 0 to {len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise QuantkitError(f"{path}: {len(missing)} single bytes are not tokens (first: 0x{missing[0]:02x}); "
                            "byte-level BPE needs all 256")
    return ranks


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """QwenModel.bpe: ``token`` merged from its bytes, lowest rank first (leftmost among equal),
    with ranks below ``max_rank`` only.  The ranks of the adjacent pairs are kept, and only the two
    next to a merge looked up again."""
    parts = [token[i:i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(parts[i] + parts[i + 1]) for i in range(len(parts) - 1)]
    while True:
        best, at = None, -1
        for i, rank in enumerate(pair_ranks):
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None or best >= max_rank:
            return parts
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
        del pair_ranks[at]
        if at > 0:
            pair_ranks[at - 1] = ranks.get(parts[at - 1] + parts[at])
        if at < len(pair_ranks):
            pair_ranks[at] = ranks.get(parts[at] + parts[at + 1])


def special_tokens(tc: Fields, n_base: int) -> dict[str, int]:
    """tokenization_kimi.py's special tokens: content -> id for the ids after the ranks."""
    decoder = tc.object("added_tokens_decoder")
    contents = {}
    for key in decoder.raw:
        if not key.isdigit():
            raise QuantkitError(f"{tc.where}: added_tokens_decoder has the key {describe(key)}, expected a token id")
        contents[int(key)] = decoder.object(key).string("content")
    return {contents.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + N_RESERVED_SPECIAL)}


def vocabulary(path: Path, tc: Fields, vocab_size: int | None) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges for the GGUF (the converter's arrays)."""
    ranks = read_ranks(path)
    vocab: dict[str, int] = {}
    merges: list[str] = []
    for token, rank in ranks.items():
        vocab[bytes_text(token)] = rank
        if len(token) > 1:
            parts = _bpe(ranks, token, rank)
            if len(parts) == 2:
                merges.append(f"{bytes_text(parts[0])} {bytes_text(parts[1])}")
    special = special_tokens(tc, len(ranks))
    n_vocab = vocab_size if vocab_size is not None else len(ranks) + N_RESERVED_SPECIAL
    if len(ranks) + N_RESERVED_SPECIAL > n_vocab:
        raise QuantkitError(f"{path}: {len(ranks)} tokens and {N_RESERVED_SPECIAL} special tokens do not fit "
                            f"config.json's vocab_size {n_vocab}")
    by_id = {i: text for text, i in {**vocab, **special}.items()}
    special_ids = set(special.values())
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        tokens.append(f"[PAD{i}]" if text is None else text)
        types.append(UNUSED if text is None else CONTROL if i in special_ids else NORMAL)
    return tokens, types, merges
