"""Tokenizer of the reference runtime, built from a GGUF file's ``tokenizer.ggml.*`` metadata.

A port of llama.cpp's ``llama-vocab.cpp`` and ``unicode.cpp`` (as ik_llama.cpp ships them), meant to
give the same token ids as ``llama_tokenize``:

* ``gpt2``: byte-level BPE.  Special tokens are split out first (``tokenizer_st_partition``), the
  text is pre-tokenized with the regexes that ``tokenizer.ggml.pre`` selects (llama.cpp's hand-written
  splitters for the GPT-2, Llama-3 and Qwen2 regexes, and its "collapsed" std::regex trick for the
  others, reproduced with :mod:`re`), then each word is merged pair by pair in rank order.
* ``llama``: SentencePiece-style, spaces as ``▁``, bigrams merged by score (ties: leftmost first),
  unknown characters as ``<0xXX>`` byte tokens, ``add_space_prefix``.

Unicode categories come from :mod:`unicodedata` plus the codepoints that llama.cpp's table (Unicode
15.1) assigns and Python 3.11's (14.0) does not.  With a Python whose Unicode is newer than 15.1,
codepoints assigned after 15.1 get their new category here but "undefined" in llama.cpp.
"""
from __future__ import annotations

import heapq
import logging
import re
import unicodedata
from functools import lru_cache

from ..errors import QuantkitError
from ..gguf_io.reader import open_model

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

# ---- unicode codepoint flags (unicode.h) ----
_UNDEF, _N, _L, _Z, _M, _P, _S, _C = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80
_WS = 0x100                     # is_whitespace: the White_Space property (unicode_set_whitespace)
_CATEGORY = {"N": _N, "L": _L, "Z": _Z, "M": _M, "P": _P, "S": _S, "C": _C}
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                         0x2029, 0x202F, 0x205F, 0x3000])
# codepoints assigned in Unicode 15.0/15.1 (llama.cpp's unicode-data.cpp) that are Cn in Unicode 14.0
_UCD_15_1 = (
    (0x00CF3, 0x00CF3, _M), (0x00ECE, 0x00ECE, _M), (0x02FFC, 0x02FFF, _S), (0x031EF, 0x031EF, _S),
    (0x10EFD, 0x10EFF, _M), (0x1123F, 0x11240, _L), (0x11241, 0x11241, _M), (0x11B00, 0x11B09, _P),
    (0x11F00, 0x11F01, _M), (0x11F02, 0x11F02, _L), (0x11F03, 0x11F03, _M), (0x11F04, 0x11F10, _L),
    (0x11F12, 0x11F33, _L), (0x11F34, 0x11F3A, _M), (0x11F3E, 0x11F42, _M), (0x11F43, 0x11F4F, _P),
    (0x11F50, 0x11F59, _N), (0x1342F, 0x1342F, _L), (0x13439, 0x1343F, _C), (0x13440, 0x13440, _M),
    (0x13441, 0x13446, _L), (0x13447, 0x13455, _M), (0x1B132, 0x1B132, _L), (0x1B155, 0x1B155, _L),
    (0x1D2C0, 0x1D2D3, _N), (0x1DF25, 0x1DF2A, _L), (0x1E030, 0x1E06D, _L), (0x1E08F, 0x1E08F, _M),
    (0x1E4D0, 0x1E4EB, _L), (0x1E4EC, 0x1E4EF, _M), (0x1E4F0, 0x1E4F9, _N), (0x1F6DC, 0x1F6DC, _S),
    (0x1F774, 0x1F776, _S), (0x1F77B, 0x1F77F, _S), (0x1F7D9, 0x1F7D9, _S), (0x1FA75, 0x1FA77, _S),
    (0x1FA87, 0x1FA88, _S), (0x1FAAD, 0x1FAAF, _S), (0x1FABB, 0x1FABD, _S), (0x1FABF, 0x1FABF, _S),
    (0x1FACE, 0x1FACF, _S), (0x1FADA, 0x1FADB, _S), (0x1FAE8, 0x1FAE8, _S), (0x1FAF7, 0x1FAF8, _S),
    (0x2B739, 0x2B739, _L), (0x2EBF0, 0x2EE5D, _L), (0x31350, 0x323AF, _L),
)


def _cpt_flags(cp: int) -> int:
    cat = unicodedata.category(chr(cp))
    flags = _CATEGORY[cat[0]] if cat != "Cn" else _UNDEF
    if flags == _UNDEF:
        for lo, hi, f in _UCD_15_1:
            if lo <= cp <= hi:
                flags = f
                break
    return flags | (_WS if cp in _WHITESPACE else 0)


_FLAGS: dict[str, int] = {chr(c): _cpt_flags(c) for c in range(128)}


def _text_flags(text: str) -> list[int]:
    cache = _FLAGS
    out = []
    for ch in text:
        f = cache.get(ch)
        if f is None:
            f = cache[ch] = _cpt_flags(ord(ch))
        out.append(f)
    return out


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


def _byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE)


# ---- pre-tokenizer regexes (llm_tokenizer_bpe, llama-vocab.cpp) ----
_RE_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CASED = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+@C@"
          "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*@C@")
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_REGEXES = {
    "default": ("[\\p{P}\\$\\+<=>\\^~\\|]+", _RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (_RE_LLAMA3,),
    "jais2": (_RE_LLAMA3.replace("|\\s+(?!\\S)|\\s+", "".join(
        f"|\\s{{{n}}}(?!\\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + "|\\s{1,2}(?!\\S)|\\s{1}"),),
    # non-ASCII characters as escapes: editors may NFC-normalize literals (U+1F7D would become U+03CE)
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
        "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
        "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
        "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
        "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
        "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
        "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _CJK_DEEPSEEK,
        "\\p{N}+",
    ),
    "deepseek-v3": (
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
        "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        + _CONTRACTIONS + "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
        "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" + _CONTRACTIONS
        + "?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK_DEEPSEEK, "\\p{N}"),
    "falcon": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", _RE_GPT2, "[0-9][0-9][0-9]"),
    "smollm": ("\\p{N}", _RE_GPT2),
    "gpt2": (_RE_GPT2,),
    "qwen2": (_RE_QWEN2,),
    "qwen35": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "poro": (_PORO,),
    "viking": (_PORO, "\\p{N}"),
    "tekken": (_CASED.replace("@C@", "") + "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "chameleon": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
                  "[\\p{P}!-/:-@\\[-`{-~]", _RE_GPT2),
    "gpt4o": (_CASED.replace("@C@", _CONTRACTIONS + "?")
              + "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "bailingmoe": ("'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "seed-coder": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
                   "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "exaone-moe": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
}

# tokenizer.ggml.pre -> (regex set, flags); flags as set in llama_vocab::impl::load.  "laguna",
# "mellum2", "cohere2_moe" and "openpangu" come from ik_llama.cpp sources newer than the
# ik-llama-cpp-python 0.1.5 wheel the tests compare with (that wheel refuses those files).
_PRE_GROUPS = (
    ("default", {}, ("default",)),
    ("llama3", {"ignore_merges": True, "add_bos": True},
     ("llama3", "llama-v3", "llama-bpe", "laguna", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano")),
    ("deepseek-llm", {"clean_spaces": False}, ("deepseek-llm",)),
    ("deepseek-coder", {"clean_spaces": False}, ("deepseek-coder",)),
    ("deepseek-v3", {"clean_spaces": False}, ("deepseek-v3", "hunyuan-dense", "joyai-llm")),
    ("youtu", {"clean_spaces": False, "ignore_merges": True}, ("youtu",)),
    ("falcon", {}, ("falcon",)),
    ("gpt2", {}, ("mpt", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                  "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "olmo",
                  "jais", "exaone4")),
    ("gpt2", {"clean_spaces": False}, ("trillion", "granite-docling")),
    ("smollm", {}, ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2")),
    ("smollm", {"clean_spaces": False}, ("command-r", "cohere2_moe", "smollm")),
    ("jais2", {}, ("jais-2",)),
    ("qwen2", {"clean_spaces": False}, ("qwen2", "deepseek-r1-qwen", "kormo", "openpangu", "f2llmv2", "hunyuan",
                                            "solar-open")),
    ("qwen2", {}, ("stablelm2", "megrez")),
    ("qwen35", {"clean_spaces": False}, ("qwen35",)),
    ("llama3", {}, ("dbrx", "smaug-bpe")),
    ("llama3", {"no_bos_id": True}, ("glm4", "chatglm-bpe")),
    ("poro", {"clean_spaces": False}, ("poro-chat",)),
    ("poro", {}, ("bloom", "gpt3-finnish")),
    ("viking", {"clean_spaces": False}, ("viking",)),
    ("tekken", {"clean_spaces": False, "ignore_merges": True, "add_bos": True}, ("tekken",)),
    ("chameleon", {"clean_spaces": False, "add_bos": True}, ("chameleon",)),
    ("gpt4o", {"clean_spaces": False}, ("gpt-4o", "llama4", "kanana2", "minimax-m2")),
    ("bailingmoe", {"clean_spaces": False}, ("bailingmoe", "bailingmoe2", "llada-moe")),
    ("seed-coder", {"clean_spaces": False}, ("seed-coder",)),
    ("qwen2", {"clean_spaces": False}, ("grok-2",)),
    ("exaone-moe", {}, ("exaone-moe",)),
)
_PRE = {name: (regexes, flags) for regexes, flags, names in _PRE_GROUPS for name in names}
# the GPT-2 split (also what a byte-level pre-tokenizer with use_regex applies) and the expanded
# contractions group, for readers of other tokenizer formats
GPT2_REGEX, CONTRACTIONS_REGEX = _RE_GPT2, _CONTRACTIONS


def pre_tokenizer_names(regexes: tuple[str, ...]) -> list[tuple[str, dict]]:
    """llama.cpp's pre-tokenizer names that split text with exactly these regexes, and their flags."""
    return [(name, flags) for regex_set, flags, names in _PRE_GROUPS if _REGEXES[regex_set] == regexes
            for name in names]


# pre-tokenizers that llama.cpp implements with hand-written code we do not port
_PRE_UNSUPPORTED = ("kimi-k2", "afmoe", "tiny_aya", "superbpe", "gemma4")


# ---- regex split (unicode_regex_split, unicode.cpp) ----
_UCAT = {"\\p{N}": _N, "\\p{L}": _L, "\\p{P}": _P, "\\p{M}": _M, "\\p{S}": _S,
         "\\p{Lu}": _L, "\\p{Ll}": _L, "\\p{Lt}": _L, "\\p{Lm}": _L, "\\p{Lo}": _L}
# category -> its one-char stand-in in the collapsed text, and the ASCII members of the category
_UCAT_CPT = {_N: "\xd1", _L: "\xd2", _P: "\xd3", _M: "\xd4", _S: "\xd5"}
_UCAT_MAP = {_N: "0-9", _L: "A-Za-z", _P: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}", _M: "", _S: "\\$\\+<->^`\\|"}


def _collapse_char(f: int) -> str:
    if f & _WS:
        return "\x0b"           # llama.cpp: <vertical tab> stands for non-ASCII whitespace
    return _UCAT_CPT.get(f & 0xFF, "\xd0")


def _collapse_regex(expr: str) -> str:
    """The regex rewritten for the collapsed text, as llama.cpp rewrites it for std::regex."""
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
        elif inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
        elif expr.startswith("\\p{", i) and i + 3 < len(expr) and 0 <= expr.find("}", i + 3) <= i + 10 \
                and expr[i:expr.find("}", i + 3) + 1] in _UCAT:
            close = expr.find("}", i + 3)
            cat = _UCAT[expr[i:close + 1]]
            body = _UCAT_CPT[cat] + _UCAT_MAP[cat]
            out.append(body if inside else "[" + body + "]")
            i = close
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _ecma_to_python(expr: str) -> str:
    """ECMAScript (std::regex) to Python :mod:`re`: ``$`` is the end of the input only."""
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c == "$" and not inside:
            c = "\\Z"
        out.append(c)
        i += 1
    return "".join(out)


def _emit(out: list[int], n: int) -> None:
    if n > 0:
        out.append(n)


def _spans(chunks: list[int]):
    """(start, end) of each chunk of a text cut into pieces of the given lengths."""
    start = 0
    for n in chunks:
        yield start, start + n
        start += n


def _contraction(text: str, pos: int, end: int, fold: bool) -> int:
    """Length of the contraction 's 't 'm 'd (2) or 're 've 'll (3) at ``pos`` (0 if none);
    ``fold``: ASCII letters match either case (llama3's (?i:...))."""
    def at(i):
        c = text[i]
        return c.lower() if fold and c < "\x80" else c
    if text[pos] != "'" or pos + 1 >= end:
        return 0
    c1 = at(pos + 1)
    if c1 in ("s", "t", "m", "d"):
        return 2
    if pos + 2 < end and c1 + at(pos + 2) in ("re", "ve", "ll"):
        return 3
    return 0


def _after_spaces(pos: int, n_ws: int, end: int) -> int:
    r"""Where a token starting at ``pos`` with ``n_ws`` whitespace characters ends: \s+(?!\S) leaves
    the last space to the next word, \s+ at the end of the chunk takes them all, and a character
    no other rule took stands alone."""
    if n_ws > 1 and pos + n_ws < end:
        return pos + n_ws - 1
    return pos + max(n_ws, 1)


def _split_gpt2(text: str, flags: list[int], chunks: list[int]) -> list[int]:
    """unicode_regex_split_custom_gpt2: 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"""
    out: list[int] = []
    for pos, end in _spans(chunks):
        while pos < end:
            cpt, fl = text[pos], flags[pos]
            n_contraction = _contraction(text, pos, end, fold=False)
            if n_contraction:
                _emit(out, n_contraction)
                pos += n_contraction
                continue
            f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else fl
            tok = pos
            if f2 & (_L | _N):
                cls = _L if f2 & _L else _N
                pos += cpt == " "
                while f2 & cls:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                _emit(out, pos - tok)
                continue
            if not f2 & (_WS | _L | _N) and f2:
                pos += cpt == " "
                while not f2 & (_WS | _L | _N) and f2:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                _emit(out, pos - tok)
                continue
            n_ws = 0
            while pos + n_ws < end and flags[pos + n_ws] & _WS:
                n_ws += 1
            pos = _after_spaces(pos, n_ws, end)
            _emit(out, pos - tok)
    return out


def _split_llama3(text: str, flags: list[int], chunks: list[int], max_digits: int = 3) -> list[int]:
    """unicode_regex_split_custom_llama3 (``max_digits`` 3) and ..._qwen2 (``max_digits`` 1)."""
    out: list[int] = []
    for pos, end in _spans(chunks):
        while pos < end:
            cpt, fl = text[pos], flags[pos]
            tok = pos
            # (?i:'s|'t|'re|'ve|'m|'ll|'d)
            n_contraction = _contraction(text, pos, end, fold=True)
            if n_contraction:
                _emit(out, n_contraction)
                pos += n_contraction
                continue
            # [^\r\n\p{L}\p{N}]?\p{L}+
            if not (cpt == "\r" or cpt == "\n" or fl & _N):
                if fl & _L or (pos + 1 < end and flags[pos + 1] & _L):
                    pos += 1
                    while pos < end and flags[pos] & _L:
                        pos += 1
                    _emit(out, pos - tok)
                    continue
            # \p{N}{1,3} (llama3) or \p{N} (qwen2)
            if fl & _N:
                while pos < end and flags[pos] & _N:
                    pos += 1
                    if pos - tok >= max_digits:
                        _emit(out, pos - tok)
                        tok = pos
                _emit(out, pos - tok)
                continue
            # <space>?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp tests the flags of the first codepoint)
            f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else fl
            if not f2 & (_WS | _L | _N) and fl:
                pos += cpt == " "
                while not f2 & (_WS | _L | _N) and f2:
                    pos += 1
                    f2 = flags[pos] if pos < end else 0
                while pos < end and text[pos] in ("\r", "\n"):
                    pos += 1
                _emit(out, pos - tok)
                continue
            n_ws, last_rn = 0, 0
            while pos + n_ws < end and flags[pos + n_ws] & _WS:
                if text[pos + n_ws] in ("\r", "\n"):
                    last_rn = pos + n_ws + 1
                n_ws += 1
            pos = last_rn if last_rn > 0 else _after_spaces(pos, n_ws, end)    # \s*[\r\n]+ first
            _emit(out, pos - tok)
    return out


def _split_regex(pattern: re.Pattern, subject: str, chunks: list[int]) -> list[int]:
    """unicode_regex_split_stl: matches and the text between them, chunk by chunk."""
    out: list[int] = []
    for start, end in _spans(chunks):
        seg, n = subject[start:end], end - start
        prev = 0
        for m in pattern.finditer(seg):
            a, b = m.span()
            if a > prev:
                out.append(a - prev)
            out.append(b - a)
            prev = b
        if prev < n:
            out.append(n - prev)
    return out


_CUSTOM = {_RE_GPT2: _split_gpt2, _RE_LLAMA3: _split_llama3,
           _RE_QWEN2: lambda text, flags, chunks: _split_llama3(text, flags, chunks, 1)}


@lru_cache(maxsize=None)
def _compile_steps(regexes: tuple[str, ...]):
    """Each regex as (custom splitter, None, False) or (None, compiled pattern, uses collapsed text)."""
    steps = []
    for expr in regexes:
        if expr in _CUSTOM:
            steps.append((_CUSTOM[expr], None, False))
            continue
        collapsed = any(k in expr for k in _UCAT)
        py = _ecma_to_python(_collapse_regex(expr) if collapsed else expr)
        steps.append((None, re.compile(py, re.ASCII), collapsed))
    return tuple(steps)


def regex_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """Pre-tokenize ``text`` into words as llama.cpp's unicode_regex_split (before byte encoding)."""
    steps = _compile_steps(regexes)
    flags = _text_flags(text)
    collapsed = wide = None
    chunks = [len(text)] if text else []
    for custom, pattern, use_collapsed in steps:
        if custom is not None:
            chunks = custom(text, flags, chunks)
        elif use_collapsed:
            if collapsed is None:
                collapsed = "".join(c if c < "\x80" else _collapse_char(f) for c, f in zip(text, flags))
            chunks = _split_regex(pattern, collapsed, chunks)
        else:
            if wide is None:        # std::wregex \s does not match non-ASCII whitespace
                wide = "".join("\x0b" if c >= "\x80" and f & _WS else c for c, f in zip(text, flags))
            chunks = _split_regex(pattern, wide, chunks)
    return [text[start:end] for start, end in _spans(chunks)]


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
_C_SPACE = " \t\n\v\f\r"        # isspace() in the C locale


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


def _hex_byte(text: str) -> int:
    """strtol(text.substr(3, 2), NULL, 16) of llama.cpp's token_to_byte."""
    digits = ""
    for c in text[3:5]:
        if c not in "0123456789abcdefABCDEF":
            break
        digits += c
    return int(digits, 16) if digits else 0


class Tokenizer:
    """Encode and decode text with a GGUF model's vocabulary, as llama.cpp does.

    Build it with :meth:`from_metadata` (a ``{key: value}`` dict) or :meth:`from_model`.
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
                raise QuantkitError("gpt2 tokenizer without merges (tokenizer.ggml.merges)")
            self.ranks: dict[tuple[str, str], int] = {}
            for i, m in enumerate(merges):
                m = _cstr(m)
                pos = m.find(" ", 1)
                pair = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
                self.ranks.setdefault(pair, i)          # the first of duplicate merges wins
            self.clean_spaces = True
            if self.pre in _PRE_UNSUPPORTED:
                raise QuantkitError(f"pre-tokenizer '{self.pre}' is not supported")
            if not self.pre:
                log.warning("missing pre-tokenizer type (tokenizer.ggml.pre), using 'default'")
            elif self.pre not in _PRE:
                # llama.cpp refuses the model rather than guess: another regex gives other tokens
                raise QuantkitError(f"unknown pre-tokenizer type '{self.pre}' (tokenizer.ggml.pre)")
            name, pflags = _PRE[self.pre or "default"]
            self.regexes = _REGEXES[name]
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
        self._bpe_cache: dict[str, list[int]] = {}
        self._pieces: dict[int, bytes] = {}
        self._template = None

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata: ``{key: value}`` with python values (or quantkit MetaValues)."""
        return cls(meta)

    @classmethod
    def from_model(cls, model) -> "Tokenizer":
        """Build from an open :class:`quantkit.gguf_io.reader.GGUFModel` (or GGUFFile)."""
        return cls(model.metadata)

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
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
                self._spm(frag.replace(" ", "\u2581"), out)
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
                out.extend(self._bpe(_byte_encode(word)))
        if add_special and self.add_eos:
            out.append(self._need("eos"))
        return out

    def _need(self, slot: str) -> int:
        if slot not in self.special:
            raise QuantkitError(f"the model asks for a {slot.upper()} token but has none")
        return self.special[slot]

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
        """llm_tokenizer_bpe_session: one byte-encoded word merged by rank (lowest first, then leftmost)."""
        ids = self._bpe_cache.get(word)
        if ids is not None:
            return ids
        tok = self.token_to_id
        if not word:
            return []
        if self.ignore_merges and word in tok:
            parts = [word]
        else:
            syms = list(word)
            n = len(syms)
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prev = list(range(-1, n - 1))
            ranks = self.ranks
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
        if len(self._bpe_cache) >= 1 << 16:
            self._bpe_cache.clear()
        self._bpe_cache[word] = ids
        return ids

    def _spm(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session: bigrams merged by token score (highest first, then leftmost)."""
        syms = list(text)
        n = len(syms)
        if not n:
            return
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        tok, scores = self.token_to_id, self.scores
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
                    out.append(self._byte_token(b))
                return
            resegment(syms[p[0]])
            resegment(syms[p[1]])

        i = 0
        while i != -1:
            resegment(syms[i])
            i = nxt[i]

    def _byte_token(self, b: int) -> int:
        t = self.token_to_id.get(f"<0x{b:02X}>")
        if t is None and b < 0x80:
            t = self.token_to_id.get(chr(b))
        if t is None:
            raise QuantkitError(f"the vocabulary has no token for byte 0x{b:02X}")
        return t

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
            out = bytearray()
            for c in text:                          # llama_decode_text
                b = _CHAR_BYTE.get(c)
                if b is not None:
                    out.append(b)
                else:
                    out += b"[UNK_BYTE_0x" + c.encode("utf-8", "surrogatepass").hex().encode() \
                        + text.encode("utf-8", "surrogatepass") + b"]"
            return bytes(out)
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
        chat_template.py) for ``messages``, with ``bos_token``/``eos_token`` and
        ``raise_exception`` available as in transformers."""
        if not self.chat_template:
            raise QuantkitError("the model has no chat template (tokenizer.chat_template)")
        try:
            import jinja2  # noqa: F401 (chat_template.py is built on it)

            from .chat_template import BoundedEnvironment
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
