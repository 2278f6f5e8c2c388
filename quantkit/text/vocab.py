"""A GGUF file's vocabulary (``tokenizer.ggml.*``, ``tokenizer.chat_template``), read and checked
the way llama.cpp's llama_vocab::impl::load reads it: tokens, scores and attributes, the merges of a
byte-level BPE vocabulary and its pre-tokenizer, the special tokens (from the metadata, then by
their text), the flags.  Every value is checked against its type and the vocabulary's size: the
file is untrusted.  Encoding and decoding with it: tokenizer.py.
"""
from __future__ import annotations

import logging

from ..errors import QuantkitError
from ..gguf_io.reader import open_model
from . import pretokenize

log = logging.getLogger(__name__)

# ---- token attributes (llama.h: enum llama_token_attr) ----
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# tokenizer.ggml.token_type (LLAMA_TOKEN_TYPE_*) -> attributes; other values are UNDEFINED
_TYPE_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
              6: ATTR_BYTE}

# ---- end-of-generation and other special tokens found by their text (llama_vocab::impl::load) ----
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>"))
# metadata key suffix -> special token slot, in llama.cpp's order (the deprecated keys come last)
_SPECIAL_KEYS = (("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("eom", "eom"), ("unknown", "unk"),
                 ("seperator", "sep"), ("padding", "pad"), ("mask", "mask"), ("fim_pre", "fim_pre"),
                 ("fim_suf", "fim_suf"), ("fim_mid", "fim_mid"), ("fim_pad", "fim_pad"), ("fim_rep", "fim_rep"),
                 ("fim_sep", "fim_sep"), ("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid"))


def _py(value):
    """A metadata value as plain python (accepts quantkit's MetaValue and numpy arrays)."""
    if hasattr(value, "to_python"):
        value = value.to_python()
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def _array(meta: dict, key: str, kinds: tuple, what: str) -> list | None:
    """The array ``key`` of the metadata whose items are all of ``kinds``, or None when absent."""
    v = _py(meta.get(key))
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, kinds) and not (isinstance(x, bool) and bool not in kinds)
                                          for x in v):
        raise QuantkitError(f"metadata key {key} must be an array of {what}")
    return v


def _scalar(meta: dict, key: str, kinds: tuple, what: str, default=None):
    """The value of ``key`` (of one of ``kinds``), or ``default`` when absent."""
    v = _py(meta.get(key))
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise QuantkitError(f"metadata key {key} = {_short(v)} must be {what}")
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _cstr(text: str) -> str:
    """``text`` as the C string llama.cpp makes of a GGUF string: up to the first NUL."""
    i = text.find("\0")
    return text if i < 0 else text[:i]


class Vocabulary:
    """The vocabulary of a GGUF file's metadata (a ``{key: value}`` dict), checked.

    Build it with :meth:`from_metadata`, :meth:`from_model` or :meth:`from_file`.
    """

    def __init__(self, meta: dict):
        meta = {k: v for k, v in meta.items() if k.startswith(("tokenizer.", "general."))}
        model = _py(meta.get("tokenizer.ggml.model"))
        if model is None:
            raise QuantkitError("the model has no tokenizer (no tokenizer.ggml.model metadata)")
        if model not in ("gpt2", "llama"):
            raise QuantkitError(f"tokenizer model {_short(model)} is not supported (supported: gpt2, llama)")
        self.model = model
        self.is_spm = model == "llama"
        # every value is checked for its type: the file's metadata is untrusted
        tokens = _array(meta, "tokenizer.ggml.tokens", (str,), "strings")
        if not tokens:
            raise QuantkitError("the model has no vocabulary (tokenizer.ggml.tokens)")
        n = len(tokens)
        scores = _array(meta, "tokenizer.ggml.scores", (int, float), "numbers")
        types = _array(meta, "tokenizer.ggml.token_type", (int,), "integers")
        for key, arr in (("scores", scores), ("token_type", types)):
            if arr is not None and len(arr) < n:
                raise QuantkitError(f"tokenizer.ggml.{key} has {len(arr)} entries for {n} tokens")
        # llama.cpp reads each token as a C string (gguf_get_arr_str), so a NUL ends it
        tokens = [_cstr(t) for t in tokens]
        self.texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.scores: list[float] = list(scores[:n]) if scores is not None else [0.0] * n
        self.attrs: list[int] = ([_TYPE_ATTR.get(int(t), ATTR_UNDEFINED) for t in types[:n]]
                                 if types is not None else [ATTR_NORMAL] * n)
        self.token_to_id: dict[str, int] = {t: i for i, t in enumerate(self.texts)}
        if len(self.token_to_id) != n:     # llama.cpp asserts (aborts) on these
            raise QuantkitError(f"tokenizer.ggml.tokens holds {n - len(self.token_to_id)} duplicate token(s)")

        # ---- tokenizer type, pre-tokenizer and flags ----
        special = {"bos": 1, "eos": 2, "unk": 0}        # llama.cpp's defaults (SPM)
        self.add_space_prefix = self.add_bos = self.add_eos = False
        self.clean_spaces = self.ignore_merges = False
        self.pre = _cstr(_scalar(meta, "tokenizer.ggml.pre", (str,), "a string", ""))
        self.regexes: tuple[str, ...] = ()
        if self.is_spm:
            self.add_space_prefix = self.add_bos = True
        else:
            special = {"bos": 11, "eos": 11}
            merges = _array(meta, "tokenizer.ggml.merges", (str,), "strings")
            if merges is None:
                if self.pre != "kimi-k2":      # llama.cpp loads Kimi-K2's without (no word then merges)
                    raise QuantkitError("gpt2 tokenizer without merges (tokenizer.ggml.merges)")
                merges = []
            self.ranks: dict[tuple[str, str], int] = {}
            for i, m in enumerate(merges):
                m = _cstr(m)
                pos = m.find(" ", 1)
                pair = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
                self.ranks.setdefault(pair, i)          # the first of duplicate merges wins
            self.clean_spaces = True
            if self.pre in pretokenize.UNSUPPORTED:
                raise QuantkitError(f"pre-tokenizer '{self.pre}' is not supported")
            if not self.pre:
                log.warning("missing pre-tokenizer type (tokenizer.ggml.pre), using 'default'")
            elif self.pre not in pretokenize.PRE_TOKENIZERS:
                # llama.cpp refuses the model rather than guess: another regex gives other tokens
                raise QuantkitError(f"unknown pre-tokenizer type '{self.pre}' (tokenizer.ggml.pre)")
            name, pflags = pretokenize.PRE_TOKENIZERS[self.pre or "default"]
            self.regexes = pretokenize.REGEX_SETS[name]
            self.clean_spaces = pflags.get("clean_spaces", True)
            self.ignore_merges = pflags.get("ignore_merges", False)
            self.add_bos = pflags.get("add_bos", False)
            if pflags.get("no_bos_id"):
                del special["bos"]
        self.add_space_prefix = _scalar(meta, "tokenizer.ggml.add_space_prefix", (bool,), "a bool",
                                        self.add_space_prefix)

        # ---- special token ids: metadata, then the texts llama.cpp looks for ----
        for key, slot in _SPECIAL_KEYS:
            v = _scalar(meta, f"tokenizer.ggml.{key}_token_id", (int,), "a token id")
            if v is None:
                continue
            if 0 <= v < n:
                special[slot] = v
            else:
                log.warning("bad special token: tokenizer.ggml.%s_token_id = %s, using default id %s", key, v,
                            special.get(slot))
        # a default id beyond a small vocabulary is no token: the model has none for that slot
        special = {slot: i for slot, i in special.items() if 0 <= i < n}
        self.add_bos = _scalar(meta, "tokenizer.ggml.add_bos_token", (bool,), "a bool", self.add_bos)
        self.add_eos = _scalar(meta, "tokenizer.ggml.add_eos_token", (bool,), "a bool", self.add_eos)
        attrs = self.attrs
        # llama.cpp keeps the first candidate of its hash-map walk; we take the lowest id
        for slot, texts in (("eot", _EOT_TEXTS), ("eom", ("<|eom_id|>",)), *_FIM_TEXTS.items()):
            if slot in special:
                continue
            found = [self.token_to_id[t] for t in texts if t in self.token_to_id]
            if found:
                special[slot] = min(found)
                attrs[special[slot]] |= ATTR_CONTROL
        for i, t in enumerate(self.texts):
            if attrs[i] & ATTR_CONTROL and "unused" in t:
                attrs[i] |= ATTR_UNUSED
        eog = {special[s] for s in ("fim_pad", "fim_rep", "fim_sep") if s in special}
        for t in _EOG_TEXTS:
            i = self.token_to_id.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):     # gpt-oss
            if t in self.token_to_id:
                attrs[self.token_to_id[t]] = ATTR_USER_DEFINED
        eog.update(special[s] for s in ("eos", "eot", "eom") if s in special)
        eog_texts = {self.texts[i]: i for i in eog}
        has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
        if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
            eog.discard(eog_texts["<|end|>"])
            attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            eog.discard(eog_texts["</s>"])
            attrs[eog_texts["</s>"]] = ATTR_NORMAL
        self.special = special
        self.eog_ids: frozenset[int] = frozenset(eog)

        # ---- special tokens split out before tokenizing, longest first ----
        self._special_ids = sorted((i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED
                                                                        | ATTR_UNKNOWN)),
                                   key=lambda i: -len(self.texts[i].encode("utf-8", "surrogatepass")))
        name = str(_py(meta.get("general.name", "")) or "").lower()
        arch = str(_py(meta.get("general.architecture", "")) or "")
        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) \
                or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in self.token_to_id:
                attrs[self.token_to_id["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in self._special_ids:
                attrs[i] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if t not in self.token_to_id:       # llama.cpp looks these up with .at() and fails
                    raise QuantkitError(f"a phi-3 vocabulary (general.name) without the token '{t}'")
                i = self.token_to_id[t]
                attrs[i] = attrs[i] | ATTR_RSTRIP if on else attrs[i] & ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in self.token_to_id:
            attrs[self.token_to_id["[MASK]"]] |= ATTR_LSTRIP

        self.chat_template: str | None = _scalar(meta, "tokenizer.chat_template", (str,), "a string")

    @classmethod
    def from_metadata(cls, meta: dict) -> "Vocabulary":
        """Build from GGUF metadata: ``{key: value}`` with python values (or quantkit MetaValues)."""
        return cls(meta)

    @classmethod
    def from_model(cls, model) -> "Vocabulary":
        """Build from an open :class:`quantkit.gguf_io.reader.GGUFModel` (or GGUFFile)."""
        return cls(model.metadata)

    @classmethod
    def from_file(cls, path) -> "Vocabulary":
        with open_model(path) as model:
            return cls(model.metadata)

    # ---- properties ----
    @property
    def n_vocab(self) -> int:
        return len(self.texts)

    @property
    def bos_id(self) -> int | None:
        return self.special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.special.get("eos")

    def token_text(self, token: int) -> str:
        return self.texts[self._check(token)]

    def _check(self, token: int) -> int:
        if not 0 <= token < len(self.texts):
            raise ValueError(f"token id {token} is outside the vocabulary ({len(self.texts)} tokens)")
        return token

    def _need(self, slot: str) -> int:
        if slot not in self.special:
            raise QuantkitError(f"the model asks for a {slot.upper()} token but has none")
        return self.special[slot]
