"""A Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) as GGUF metadata.

Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM, DeepSeek-V3, Qwen …), written the way
convert_hf_to_gguf.py writes them, so llama.cpp's tokenizer gives the same ids as the HF one:

* ``tokenizer.ggml.tokens``: id -> text for ids 0 .. vocab_size - 1 (config.json's vocab_size);
  ids the tokenizer lacks are ``[PAD<id>]`` of type UNUSED;
* ``tokenizer.ggml.token_type``: NORMAL for the BPE vocabulary; an added token is CONTROL when it is
  special or looks special (``<|...|>``, ``<｜...｜>``, ``<pad>`` …), USER_DEFINED otherwise;
* ``tokenizer.ggml.merges``: "left right" strings; the newer [left, right] pair format writes a space
  inside a token as U+0120 + 256 offset, i.e. ``chr(ord(" ") + 256)``, as gguf-py does;
* ``tokenizer.ggml.pre``: which of llama.cpp's pre-tokenizers splits text like this one. The
  converter tells them apart by hashing the tokenization of a probe text; we compare the regexes of
  the ``pre_tokenizer`` section with the regex sets llama.cpp implements (the runtime's table), and
  refuse a tokenizer that matches none: another split gives other tokens;
* bos/eos/unk/pad ids from tokenizer_config.json's ``*_token`` (or config.json's ``*_token_id``),
  ``add_bos_token``/``add_eos_token``, and the chat template (tokenizer_config.json or
  ``chat_template.jinja``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.constants import MetaValue, ValueType
from ..runtime import tokenizer as rt

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# special token -> its GGUF key (gguf-py spells the separator "seperator")
_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding", "cls": "cls",
                 "mask": "mask"}
_LOOKS_SPECIAL = (("<|", "|>"), ("<\uff5c", "\uff5c>"), ("<start_of_", ">"), ("<end_of_", ">"), ("<unused", ">"))
# the converter's choice where several llama.cpp names share a regex set and its flags
_PREFERRED = ("llama-bpe", "smollm", "starcoder", "deepseek-v3", "deepseek-llm", "deepseek-coder", "gpt-2",
              "qwen2", "stablelm2", "falcon", "default")
# the case-insensitive contractions group HF writes, and the expanded form llama.cpp uses
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise QuantkitError(f"{path}: cannot read it as JSON ({e})") from None


def looks_special(text: str) -> bool:
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        text.startswith(a) and text.endswith(b) for a, b in _LOOKS_SPECIAL)


def _split_regexes(pre: dict | None, where: Path) -> tuple[str, ...]:
    """The regexes that split text, in order, from a tokenizer.json ``pre_tokenizer`` section."""
    if pre is None:
        return ()
    kind = pre.get("type")
    if kind == "Sequence":
        return tuple(r for p in pre.get("pretokenizers", []) for r in _split_regexes(p, where))
    if kind == "ByteLevel":
        return (rt.GPT2_REGEX,) if pre.get("use_regex", True) else ()
    if kind == "Digits":
        return ("\\p{N}",) if pre.get("individual_digits") else ("\\p{N}+",)
    if kind == "Split":
        pattern = pre.get("pattern", {})
        regex = pattern.get("Regex")
        if regex is None:
            regex = re.escape(pattern.get("String", ""))
        return (regex.replace(_HF_CONTRACTIONS, rt.CONTRACTIONS_REGEX),)
    raise QuantkitError(f"{where}: pre-tokenizer '{kind}' is not supported (byte-level BPE tokenizers only)")


def _pre_name(regexes: tuple[str, ...], clean_spaces: bool | None, where: Path) -> str:
    candidates = [name for name, flags in rt.pre_tokenizer_names(regexes)
                  if clean_spaces is None or flags.get("clean_spaces", True) == clean_spaces]
    if not candidates:
        raise QuantkitError(f"{where}: its pre-tokenizer ({' | '.join(regexes) or 'none'}) matches none of "
                            "llama.cpp's; a GGUF with another split would tokenize differently")
    for name in _PREFERRED:
        if name in candidates:
            return name
    return candidates[0]


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _merges(raw: list, where: Path) -> list[str]:
    if not raw or isinstance(raw[0], str):
        return list(raw)
    if not (isinstance(raw[0], list) and len(raw[0]) == 2):
        raise QuantkitError(f"{where}: model.merges is neither 'a b' strings nor [a, b] pairs")
    return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
            for pair in raw]


def _add_special(post: dict | None, meta: dict, tokens: list[str]) -> dict[str, bool | None]:
    """Whether the tokenizer adds bos/eos around a single sequence, from tokenizer.json's
    ``post_processor`` (a TemplateProcessing whose template starts with bos / ends with eos)."""
    flags: dict[str, bool | None] = {"bos": None, "eos": None}
    if not isinstance(post, dict):
        return flags
    if post.get("type") == "Sequence":
        for p in post.get("processors", []):
            flags.update({k: v for k, v in _add_special(p, meta, tokens).items() if v is not None})
        return flags
    if post.get("type") == "TemplateProcessing":
        single = [step.get("SpecialToken", {}).get("id") if "SpecialToken" in step else None
                  for step in post.get("single", [])]
        for slot, at in (("bos", 0), ("eos", -1)):
            key = f"tokenizer.ggml.{slot}_token_id"
            if single and key in meta:
                flags[slot] = single[at] == tokens[meta[key].value]
    return flags


def vocab_metadata(directory: Path, vocab_size: int | None, config: dict) -> dict[str, MetaValue]:
    """``tokenizer.*`` GGUF keys for the tokenizer files in ``directory``."""
    tj_path = directory / "tokenizer.json"
    tj = _read_json(tj_path)
    if tj is None:
        raise QuantkitError(f"{directory}: no tokenizer.json (only byte-level BPE tokenizers are converted)")
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise QuantkitError(f"{tj_path}: a {model.get('type')} tokenizer"
                            f"{' with byte fallback (SentencePiece style)' if model.get('byte_fallback') else ''}"
                            " is not supported; only byte-level BPE tokenizers are converted")
    tc = _read_json(directory / "tokenizer_config.json") or {}

    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {}
    for tok in tj.get("added_tokens") or []:
        added[int(tok["id"])] = tok
        vocab[tok["content"]] = int(tok["id"])
    if not vocab:
        raise QuantkitError(f"{tj_path}: empty vocabulary")
    n_vocab = vocab_size if vocab_size is not None else max(vocab.values()) + 1
    if max(vocab.values()) >= n_vocab:
        raise QuantkitError(f"{tj_path}: token id {max(vocab.values())} is past config.json's vocab_size {n_vocab}")
    by_id = {i: t for t, i in vocab.items()}

    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            if added[i].get("special") or looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace("\u2581", " ")      # pre-normalised user-defined spaces
                types.append(USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(NORMAL)

    clean = tc.get("clean_up_tokenization_spaces")
    pre = _pre_name(_split_regexes(tj.get("pre_tokenizer"), tj_path), clean if isinstance(clean, bool) else None,
                    tj_path)
    S, U32, B = ValueType.STRING, ValueType.UINT32, ValueType.BOOL
    meta = {
        "tokenizer.ggml.model": MetaValue(S, "gpt2"),
        "tokenizer.ggml.pre": MetaValue(S, pre),
        "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, tokens, S),
        "tokenizer.ggml.token_type": MetaValue(ValueType.ARRAY, np.array(types, "<i4"),
                                               ValueType.INT32),
        "tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, _merges(model.get("merges") or [], tj_path), S),
    }
    content_ids = {tok["content"]: int(tok["id"]) for tok in tj.get("added_tokens") or []}
    for slot, key in _SPECIAL_KEYS.items():
        text = _token_text(tc.get(f"{slot}_token"))
        tid = content_ids.get(text) if text is not None else None
        if tid is None:
            tid = config.get(f"{slot}_token_id")
            if isinstance(tid, list):
                tid = tid[0] if tid else None
        if isinstance(tid, int) and 0 <= tid < n_vocab:
            meta[f"tokenizer.ggml.{key}_token_id"] = MetaValue(U32, tid)
    for slot, flag in _add_special(tj.get("post_processor"), meta, tokens).items():
        if isinstance(tc.get(f"add_{slot}_token"), bool):
            flag = tc[f"add_{slot}_token"]
        if flag is not None:
            meta[f"tokenizer.ggml.add_{slot}_token"] = MetaValue(B, flag)
    template = tc.get("chat_template")
    if isinstance(template, list):         # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = MetaValue(S, template)
    return meta
