"""The pre-tokenizer of byte-level BPE vocabularies: text split into words the way llama.cpp's
``unicode_regex_split`` splits it (unicode.cpp), for each of the regex sets that ``tokenizer.ggml.pre``
names (llama-vocab.cpp).

llama.cpp's hand-written splitters for the GPT-2, Llama-3, Qwen2 and Kimi-K2 regexes are ported as
they are (ik_llama.cpp's: its contractions are lower case only, see _contraction);
the other regexes use its "collapsed" std::regex trick (each non-ASCII codepoint replaced by one
character standing for its category), reproduced with :mod:`re`.

Unicode categories come from :mod:`unicodedata` plus the codepoints that llama.cpp's table (Unicode
15.1) assigns and Python 3.11's (14.0) does not.  With a Python whose Unicode is newer than 15.1,
codepoints assigned after 15.1 get their new category here but "undefined" in llama.cpp.

The table of pre-tokenizer names is also what the HF converter (hf/vocab.py) matches a
tokenizer.json's regexes against.
"""
from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

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


# ---- pre-tokenizer regexes (llm_tokenizer_bpe, llama-vocab.cpp) ----
_RE_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# llama.cpp's stand-in for Kimi-K2's tiktoken pattern: the name of its hand-written splitter
_RE_KIMI_K2 = "\\p{Han}+"
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CASED = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+@C@"
          "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*@C@")
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

REGEX_SETS = {
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
    "kimi-k2": (_RE_KIMI_K2,),
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
    ("kimi-k2", {"clean_spaces": False}, ("kimi-k2",)),
)
PRE_TOKENIZERS = {name: (regexes, flags) for regexes, flags, names in _PRE_GROUPS for name in names}
# the tokenizer.json regexes that llama.cpp rewrites for std::regex ("original regex from
# tokenizer.json" in llama-vocab.cpp): \p{Lu}... classes become lookaheads, (?i:...) is expanded
_CASED_HF = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+@C@"
             "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*@C@")
TOKENIZER_JSON_FORMS = {
    "gpt4o": ((_CASED_HF.replace("@C@", _CONTRACTIONS + "?")
               + "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),),
    "tekken": ((_CASED_HF.replace("@C@", "") + "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),),
}
# the GPT-2 split (also what a byte-level pre-tokenizer with use_regex applies) and the expanded
# contractions group, for readers of other tokenizer formats
GPT2_REGEX, CONTRACTIONS_REGEX = _RE_GPT2, _CONTRACTIONS


def pre_tokenizer_names(regexes: tuple[str, ...]) -> list[tuple[str, dict]]:
    """llama.cpp's pre-tokenizer names that split text with exactly these regexes, and their flags."""
    return [(name, flags) for regex_set, flags, names in _PRE_GROUPS
            if REGEX_SETS[regex_set] == regexes or regexes in TOKENIZER_JSON_FORMS.get(regex_set, ())
            for name in names]


# pre-tokenizers that llama.cpp implements with hand-written code we do not port
UNSUPPORTED = ("afmoe", "tiny_aya", "superbpe", "gemma4")


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


def _contraction(text: str, pos: int, end: int) -> int:
    """Length of the contraction 's 't 'm 'd (2) or 're 've 'll (3) at ``pos`` (0 if none).

    The regexes say (?i:'s|...) and llama.cpp's splitters lower-case the letters with
    unicode_tolower, but ik_llama.cpp's unicode_tolower binary-searches (std::lower_bound) a
    std::unordered_map, whose order is not sorted: it finds no ASCII capital (measured on the wheel:
    it maps 30 codepoints, all outside ASCII).  So in ik the contractions are lower case only: "'S"
    is no contraction and "'Sd" stays one word (mainline llama.cpp, with a sorted table, folds)."""
    if text[pos] != "'" or pos + 1 >= end:
        return 0
    c1 = text[pos + 1]
    if c1 in ("s", "t", "m", "d"):
        return 2
    if pos + 2 < end and c1 + text[pos + 2] in ("re", "ve", "ll"):
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
            n_contraction = _contraction(text, pos, end)
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
            # (?i:'s|'t|'re|'ve|'m|'ll|'d), lower case only in ik (see _contraction)
            n_contraction = _contraction(text, pos, end)
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
            # \p{N}{1,3} (llama3) or \p{N} (qwen2), then punctuation, then whitespace
            pos = _digits_symbols_spaces(text, flags, pos, end, out, max_digits, fl)
    return out


def _digits_symbols_spaces(text: str, flags: list[int], pos: int, end: int, out: list[int], max_digits: int,
                           symbol_flags: int) -> int:
    r"""The tail the llama3-style splitters share once no word started at ``pos``: a run of digits
    (\p{N}{1,max_digits}), else <space>?[^\s\p{L}\p{N}]+[\r\n]*, else whitespace (\s*[\r\n]+ first,
    then \s+(?!\S), \s+).  The token is emitted; returns where the next one starts.

    ``symbol_flags``: the flags llama.cpp's code tests before it takes the symbol run — the first
    codepoint's in llama3/qwen2's splitter, the one after an optional space in Kimi-K2's (each C
    splitter has its own, ported as it is)."""
    tok, cpt, fl = pos, text[pos], flags[pos]
    if fl & _N:
        while pos < end and flags[pos] & _N:
            pos += 1
            if pos - tok >= max_digits:
                _emit(out, pos - tok)
                tok = pos
        _emit(out, pos - tok)
        return pos
    f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else fl
    if not f2 & (_WS | _L | _N) and symbol_flags:
        pos += cpt == " "
        while not f2 & (_WS | _L | _N) and f2:
            pos += 1
            f2 = flags[pos] if pos < end else 0
        while pos < end and text[pos] in ("\r", "\n"):
            pos += 1
        _emit(out, pos - tok)
        return pos
    n_ws, last_rn = 0, 0
    while pos + n_ws < end and flags[pos + n_ws] & _WS:
        if text[pos + n_ws] in ("\r", "\n"):
            last_rn = pos + n_ws + 1
        n_ws += 1
    pos = last_rn if last_rn > 0 else _after_spaces(pos, n_ws, end)    # \s*[\r\n]+ first
    _emit(out, pos - tok)
    return pos


_HAN = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_han(ch: str) -> bool:
    """unicode_cpt_is_han: the CJK ideograph blocks llama.cpp lists (not Unicode's Han script)."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _HAN)


def _split_kimi_k2(text: str, flags: list[int], chunks: list[int]) -> list[int]:
    r"""unicode_regex_split_custom_kimi_k2: Kimi-K2's tiktoken pattern as llama.cpp hand-codes it,
    [\p{Han}]+ | [^\r\n\p{L}\p{N}]?<letters but Han>+<contraction>? | \p{N}{1,3} | ...

    llama.cpp's code takes every letter and mark-less run alike: it does not split a word where the
    pattern's upper/lower-case classes would (``camelCase`` stays one word; tiktoken makes two) nor
    count \p{M} as part of a word.  Ported as it is: the GGUF is tokenized by that code."""
    out: list[int] = []
    for pos, end in _spans(chunks):
        def letter(i):                 # \p{L} and not Han, inside the chunk
            return i < end and flags[i] & _L and not _is_han(text[i])
        while pos < end:
            cpt, fl = text[pos], flags[pos]
            tok = pos
            if _is_han(cpt):
                while pos < end and _is_han(text[pos]):
                    pos += 1
                _emit(out, pos - tok)
                continue
            leading = not (cpt == "\r" or cpt == "\n" or fl & (_L | _N))
            if letter(pos) or (leading and letter(pos + 1)):
                pos += leading
                while letter(pos):
                    pos += 1
                pos += _contraction(text, pos, end) if pos < end else 0
                _emit(out, pos - tok)
                continue
            f2 = (flags[pos + 1] if pos + 1 < end else 0) if cpt == " " else fl
            pos = _digits_symbols_spaces(text, flags, pos, end, out, 3, f2)
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
           _RE_QWEN2: lambda text, flags, chunks: _split_llama3(text, flags, chunks, 1),
           _RE_KIMI_K2: _split_kimi_k2}


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
