"""Tokenizer built from a GGUF file's vocabulary (vocab.py).

A port of llama.cpp's ``llama-vocab.cpp`` and ``unicode.cpp`` (as ik_llama.cpp ships them), meant to
give the same token ids as ``llama_tokenize``:

* ``gpt2``: byte-level BPE.  Special tokens are split out first (``tokenizer_st_partition``), the
  text is pre-tokenized with the regexes that ``tokenizer.ggml.pre`` selects (pretokenize.py), then
  each word is merged pair by pair in rank order (bpe.py).
* ``llama``: SentencePiece-style, spaces as ``▁``, bigrams merged by score (ties: leftmost first),
  unknown characters as ``<0xXX>`` byte tokens, ``add_space_prefix`` (spm.py).

Decoding is llama_token_to_piece / llama_detokenize; chat templates render with chat.py.
"""
from __future__ import annotations

from ..errors import QuantkitError
from . import bpe, spm
from .pretokenize import regex_split
from .vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP, ATTR_UNKNOWN, \
    ATTR_USER_DEFINED, Vocabulary

_C_SPACE = " \t\n\v\f\r"        # isspace() in the C locale


def _hex_byte(text: str) -> int:
    """strtol(text.substr(3, 2), NULL, 16) of llama.cpp's token_to_byte."""
    digits = ""
    for c in text[3:5]:
        if c not in "0123456789abcdefABCDEF":
            break
        digits += c
    return int(digits, 16) if digits else 0


class Tokenizer(Vocabulary):
    """Encode and decode text with a GGUF model's vocabulary, as llama.cpp does.

    Build it with :meth:`from_metadata` (a ``{key: value}`` dict), :meth:`from_model` or :meth:`from_file`.
    """

    def __init__(self, meta: dict):
        super().__init__(meta)
        self._bpe_cache: dict[str, list[int]] = {}
        self._pieces: dict[int, bytes] = {}
        self._template = None

    # ---- encoding ----
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama_tokenize).

        ``add_special`` adds BOS/EOS where the model asks for them (``tokenizer.ggml.add_bos_token``,
        ``add_eos_token``); ``parse_special`` turns control-token texts such as ``<|im_start|>`` into
        their ids (user-defined tokens are always split out).
        """
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.is_spm:
            if add_special and self.add_bos:
                out.append(self._need("bos"))
            prev_special = True
            for frag in frags:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                spm.merge(frag.replace(" ", "\u2581"), self.token_to_id, self.scores, out)
                prev_special = False
            if add_special and self.add_eos:
                out.append(self._need("eos"))
            return out
        if add_special and self.add_bos:
            out.append(self._need("bos"))
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
                continue
            for word in regex_split(frag, self.regexes):
                out.extend(self._bpe(bpe.byte_encode(word)))
        if add_special and self.add_eos:
            out.append(self._need("eos"))
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """tokenizer_st_partition: ``text`` as raw-text pieces (str) and special token ids (int)."""
        frags: list = [text]
        for tid in self._special_ids:
            attr = self.attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            s = self.texts[tid]
            # every fragment is a substring of text: one search there rules most tokens out
            # (vocabularies with thousands of special tokens made short inputs slow)
            if s not in text or not any(isinstance(f, str) and s in f for f in frags):
                continue
            new: list = []
            for frag in frags:
                if isinstance(frag, int) or s not in frag:
                    new.append(frag)
                    continue
                pos = 0
                while True:
                    i = frag.find(s, pos)
                    if i < 0:
                        if pos < len(frag):
                            new.append(frag[pos:])
                        break
                    left = frag[pos:i]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        new.append(left)
                    new.append(tid)
                    pos = i + len(s)
                    if attr & ATTR_RSTRIP:
                        while pos < len(frag) and frag[pos] in _C_SPACE:
                            pos += 1
            frags = new
        return frags

    def _bpe(self, word: str) -> list[int]:
        """The ids of one byte-encoded word (bpe.merge), cached."""
        ids = self._bpe_cache.get(word)
        if ids is None:
            ids = bpe.merge(word, self.ranks, self.token_to_id, self.ignore_merges)
            if len(self._bpe_cache) >= 1 << 16:
                self._bpe_cache.clear()
            self._bpe_cache[word] = ids
        return ids

    # ---- decoding ----
    def token_piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (llama_token_to_piece); control tokens give b"" unless
        ``special``.  A piece can end inside a UTF-8 sequence: stream by accumulating bytes."""
        # check first: with special=True a negative id would otherwise index from the end
        if self.attrs[self._check(token)] & (ATTR_UNKNOWN | ATTR_CONTROL) and not special:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._make_piece(token)
        return piece

    def _make_piece(self, token: int) -> bytes:
        text, attr = self.texts[token], self.attrs[token]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogatepass")
        if attr & ATTR_NORMAL:
            if self.is_spm:
                return text.replace("\u2581", " ").encode("utf-8", "surrogatepass")
            return bpe.byte_decode(text)
        if attr & ATTR_BYTE:
            return bytes([_hex_byte(text)])
        return b""

    def decode_bytes(self, ids, special: bool = False, remove_special: bool = False) -> bytes:
        """llama_detokenize(ids, remove_special, unparse_special=special) as raw bytes."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.special.get("bos"):
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.special.get("eos"):
            ids = ids[:-1]
        out = bytearray()
        for tid in ids:
            piece = self.token_piece(tid, special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            out += piece
        if self.clean_spaces:
            out = _clean_spaces(out)
        return bytes(out)

    def decode(self, ids, special: bool = False, remove_special: bool = False) -> str:
        """Text of ``ids`` (llama_detokenize); control tokens are left out unless ``special``."""
        return self.decode_bytes(ids, special, remove_special).decode("utf-8", "replace")

    # ---- chat ----
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the model's ``tokenizer.chat_template`` (Jinja, sandboxed, its work bounded:
        chat.py) for ``messages``, with ``bos_token``/``eos_token`` and
        ``raise_exception`` available as in transformers."""
        if not self.chat_template:
            raise QuantkitError("the model has no chat template (tokenizer.chat_template)")
        try:
            import jinja2  # noqa: F401 (chat.py is built on it; 50 ms to import, for chat only)

            from .chat import BoundedEnvironment
        except ImportError:
            raise QuantkitError("chat templates need Jinja2 (pip install jinja2)") from None
        if self._template is None:
            env = BoundedEnvironment()
            self._template = (env, env.compile_template(self.chat_template))
        env, template = self._template
        bos, eos = self.special.get("bos"), self.special.get("eos")
        return env.render(template, messages=messages, add_generation_prompt=add_generation_prompt,
                          bos_token=self.texts[bos] if bos is not None else "",
                          eos_token=self.texts[eos] if eos is not None else "", **kwargs)


def _clean_spaces(text: bytearray) -> bytearray:
    """The three clean_spaces passes of llama_vocab::impl::detokenize."""
    # " ?", " !", " .", " ,": drop the space
    out = text[:1]
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    # " ' ": drop both spaces (llama.cpp zeroes the second one in place, which later tests see)
    text, out, i = out, out[:1], 1
    while i < len(text):
        x = text[i]
        if x == 0x27 and i + 1 < len(text) and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            out.pop()
            i += 1
            text[i] = 0
        out.append(x)
        i += 1
    # " 's", " 'm", " 're", " 've": drop the space
    text, out = out, out[:1]
    for i in range(1, len(text)):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < len(text):
            x1 = text[i + 1]
            if x1 in b"sm" or (i + 2 < len(text) and bytes(text[i + 1:i + 3]) in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return out
