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
  converter tells them apart by hashing the tokenization of a probe text (get_vocab_base_pre), which
  needs the real vocabulary; we compare the regexes of the ``pre_tokenizer`` section with the regex
  sets llama.cpp implements (quantkit.text.pretokenize's table, which also knows the tokenizer.json
  spelling of the regexes llama.cpp rewrites, as o200k's), and refuse a tokenizer that matches none:
  another split gives other tokens.  Where one regex set has several names, the architecture decides
  as the hash does for its real tokenizer (GLM-4.5 MoE: "glm4", Llama 3's split with no BOS id),
  else the converter's usual choice (``_PREFERRED``).  For the 2026 families this gives the names of
  the converter's hash table: Qwen3 / Qwen3-MoE "qwen2", GLM-4.5 "glm4", gpt-oss "gpt-4o",
  DeepSeek-V3 / V3.2 "deepseek-v3";
* special token ids, add flags and the chat template as gguf-py's SpecialVocab finds them
  (special.py), plus GLM-4.5 MoE's own (Glm4MoeModel.set_vocab: bos [gMASK], eot <|user|>, unk
  <|endoftext|>, eom <|observation|>, its template's fix).

Kimi-K2 ships ``tiktoken.model`` and no tokenizer.json: tiktoken.py builds its arrays as the
converter's Kimi branch does (which it takes for vocab_size 163840; here the files decide: a
tiktoken.model whose tokenizer_config.json names tokenization_kimi's TikTokenTokenizer), with the
pre-tokenizer "kimi-k2" (its pattern is tokenization_kimi.py's, fixed in that code).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.constants import MetaValue, ValueType
from ..text import pretokenize
from . import tiktoken
from .config import Fields, describe
from .special import FLAG_TYPES, ID_KEYS, SpecialVocab

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_LOOKS_SPECIAL = (("<|", "|>"), ("<\uff5c", "\uff5c>"), ("<start_of_", ">"), ("<end_of_", ">"), ("<unused", ">"))
# the converter's choice where several llama.cpp names share a regex set and its flags
_PREFERRED = ("llama-bpe", "smollm", "starcoder", "deepseek-v3", "deepseek-llm", "deepseek-coder", "gpt-2",
              "qwen2", "stablelm2", "falcon", "default")
# the case-insensitive contractions group HF writes, and the expanded form llama.cpp uses
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"


def _read_json(path: Path) -> Fields | None:
    if not path.exists() and not path.is_symlink():
        return None
    return Fields.load(path, "a tokenizer file")


def looks_special(text: str) -> bool:
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        text.startswith(a) and text.endswith(b) for a, b in _LOOKS_SPECIAL)


def _split_regexes(pre: Fields) -> tuple[str, ...]:
    """The regexes that split text, in order, from a tokenizer.json ``pre_tokenizer`` section."""
    if not pre.raw:
        return ()
    kind = pre.string("type", None)
    if kind == "Sequence":
        return tuple(r for p in pre.objects("pretokenizers") for r in _split_regexes(p))
    if kind == "ByteLevel":
        return (pretokenize.GPT2_REGEX,) if pre.boolean("use_regex", True) else ()
    if kind == "Digits":
        return ("\\p{N}",) if pre.boolean("individual_digits", False) else ("\\p{N}+",)
    if kind == "Split":
        pattern = pre.object("pattern")
        regex = pattern.string("Regex") if pattern.has("Regex") else re.escape(pattern.string("String", ""))
        return (regex.replace(_HF_CONTRACTIONS, pretokenize.CONTRACTIONS_REGEX),)
    raise QuantkitError(f"{pre.where}: pre-tokenizer {describe(kind)} is not supported (byte-level BPE tokenizers "
                        "only)")


def _pre_name(regexes: tuple[str, ...], clean_spaces: bool | None, where: Path, family: str | None = None) -> str:
    matching = pretokenize.pre_tokenizer_names(regexes)
    if family is not None and any(name == family for name, _ in matching):
        return family
    candidates = [name for name, flags in matching
                  if clean_spaces is None or flags.get("clean_spaces", True) == clean_spaces]
    if not candidates:
        raise QuantkitError(f"{where}: its pre-tokenizer ({' | '.join(regexes) or 'none'}) matches none of "
                            "llama.cpp's; a GGUF with another split would tokenize differently")
    for name in _PREFERRED:
        if name in candidates:
            return name
    return candidates[0]


def _merges(raw: list, where: str) -> list[str]:
    if all(isinstance(m, str) for m in raw):
        return list(raw)
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in raw):
        raise QuantkitError(f"{where}: model.merges is neither 'a b' strings nor [a, b] pairs")
    return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
            for pair in raw]


def _vocabulary(model: Fields, added: list[Fields], where: str) -> tuple[dict[str, int], dict[int, Fields]]:
    """token -> id for the BPE vocabulary and the added tokens, and id -> added token."""
    vocab = model.object("vocab").raw
    for text, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31:
            raise QuantkitError(f"{where}: model.vocab gives {describe(text)} the id {describe(i)}, expected an "
                                "integer from 0")
    vocab = dict(vocab)
    by_id = {}
    for tok in added:
        tid = tok.integer("id", high=2**31 - 1)
        by_id[tid] = tok
        vocab[tok.string("content")] = tid
    return vocab, by_id


def _architecture(config: Fields) -> str | None:
    archs = config.raw.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def vocab_metadata(directory: Path, vocab_size: int | None, config: Fields) -> dict[str, MetaValue]:
    """``tokenizer.*`` GGUF keys for the tokenizer files in ``directory`` (``config``: config.json,
    for the special token ids it may give and the architecture, which picks the converter's
    per-family extras)."""
    tj_path = directory / "tokenizer.json"
    tj = _read_json(tj_path)
    tc = _read_json(directory / "tokenizer_config.json") or Fields({}, str(directory / "tokenizer_config.json"))
    arch = _architecture(config)
    if tj is None:
        if (directory / KIMI_VOCAB).exists() or (directory / KIMI_VOCAB).is_symlink():
            return _kimi_metadata(directory, vocab_size, config, tc)
        raise QuantkitError(f"{directory}: no tokenizer.json (only byte-level BPE tokenizers are converted)")
    model = tj.object("model")
    kind, byte_fallback = model.raw.get("type"), model.raw.get("byte_fallback")
    if kind != "BPE" or byte_fallback:
        raise QuantkitError(f"{tj_path}: a {describe(kind)} tokenizer"
                            f"{' with byte fallback (SentencePiece style)' if byte_fallback else ''}"
                            " is not supported; only byte-level BPE tokenizers are converted")

    added_tokens = tj.objects("added_tokens")
    vocab, added = _vocabulary(model, added_tokens, str(tj_path))
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
            if added[i].raw.get("special") or looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace("\u2581", " ")      # pre-normalised user-defined spaces
                types.append(USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(NORMAL)

    clean = tc.raw.get("clean_up_tokenization_spaces")
    pre = _pre_name(_split_regexes(tj.object("pre_tokenizer")), clean if isinstance(clean, bool) else None, tj_path,
                    _FAMILY_PRE.get(arch))
    merges = _merges(model.array("merges", []), str(tj_path))
    content_ids = {tok.string("content"): tok.integer("id", high=2**31 - 1) for tok in added_tokens}
    meta = _arrays(pre, tokens, types, merges)
    _special_metadata(meta, n_vocab, directory, tj.raw, tc, config)
    if arch == "Glm4MoeForCausalLM":
        _glm4moe_extras(meta, content_ids, n_vocab)
    return meta


def _arrays(pre: str, tokens: list[str], types: list[int], merges: list[str]) -> dict[str, MetaValue]:
    S = ValueType.STRING
    return {
        "tokenizer.ggml.model": MetaValue(S, "gpt2"),
        "tokenizer.ggml.pre": MetaValue(S, pre),
        "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, tokens, S),
        "tokenizer.ggml.token_type": MetaValue(ValueType.ARRAY, np.array(types, "<i4"), ValueType.INT32),
        "tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, merges, S),
    }


def _special_metadata(meta: dict, n_vocab: int, directory: Path, tokenizer: dict | None, tc: Fields,
                      config: Fields) -> None:
    """special.py's keys: special token ids, add flags, the chat template."""
    found = SpecialVocab(directory, tokenizer, tc, config, n_vocab)
    for typ, tid in found.ids.items():
        if typ in ID_KEYS:
            meta[f"tokenizer.ggml.{ID_KEYS[typ]}_token_id"] = MetaValue(ValueType.UINT32, tid)
    for typ, flag in found.flags.items():
        if typ in FLAG_TYPES:
            meta[f"tokenizer.ggml.add_{typ}_token"] = MetaValue(ValueType.BOOL, flag)
    if found.template is not None:
        meta["tokenizer.chat_template"] = MetaValue(ValueType.STRING, found.template)


# ---- per-family extras of the converter ----
# architectures whose tokenizer the converter names by its hash where the regexes alone cannot
# (GLM-4.5's split is Llama 3's: "glm4" differs in its BOS handling)
_FAMILY_PRE = {"Glm4MoeForCausalLM": "glm4"}
# Glm4MoeModel.set_vocab: these special tokens, where SpecialVocab set none for the slot
_GLM4MOE_SPECIAL = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unknown", "<|endoftext|>"),
                    ("eom", "<|observation|>"))
# ... and the fix of GLM-4.5's template (visible_text called twice), as the converter patches it
_GLM4MOE_TEMPLATE_FIX = (
    "{{ visible_text(m.content) }}\n{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not "
    "visible_text(m.content).endswith(\"/nothink\")) else '' -}}",
    "{% set content = visible_text(m.content) %}{{ content }}\n{{- '/nothink' if (enable_thinking is defined and "
    "not enable_thinking and not content.endswith(\"/nothink\")) else '' -}}")


def _glm4moe_extras(meta: dict, content_ids: dict[str, int], n_vocab: int) -> None:
    for slot, text in _GLM4MOE_SPECIAL:
        key = f"tokenizer.ggml.{slot}_token_id"
        tid = content_ids.get(text)
        if key not in meta and tid is not None and 0 <= tid < n_vocab:
            meta[key] = MetaValue(ValueType.UINT32, tid)
    template = meta.get("tokenizer.chat_template")
    if template is not None and "visible_text(m.content).endswith" in template.value:
        meta["tokenizer.chat_template"] = MetaValue(ValueType.STRING, template.value.replace(*_GLM4MOE_TEMPLATE_FIX))


KIMI_VOCAB = "tiktoken.model"
_KIMI_CLASSES = ("TikTokenTokenizer", "tokenization_kimi.TikTokenTokenizer")


def _kimi_metadata(directory: Path, vocab_size: int | None, config: Fields, tc: Fields) -> dict[str, MetaValue]:
    """Kimi-K2's tiktoken vocabulary (hf/tiktoken.py), pre-tokenizer "kimi-k2": the converter names it
    by its hash; its split is tokenization_kimi.py's fixed pattern, so the files name it here."""
    auto = tc.raw.get("auto_map")
    auto = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    classes = [tc.raw.get("tokenizer_class"), *(auto if isinstance(auto, list) else [auto])]
    if not any(c in _KIMI_CLASSES for c in classes):
        raise QuantkitError(f"{directory / KIMI_VOCAB}: a tiktoken vocabulary whose tokenizer_config.json does not "
                            "name Kimi's TikTokenTokenizer: its split of text is unknown")
    tokens, types, merges = tiktoken.vocabulary(directory / KIMI_VOCAB, tc, vocab_size)
    meta = _arrays("kimi-k2", tokens, types, merges)
    # SpecialVocab finds tokenizer_config.json's token texts among tokenizer.json's added tokens:
    # without that file only config.json's ids count
    _special_metadata(meta, len(tokens), directory, None, tc, config)
    return meta
