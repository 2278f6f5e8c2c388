"""The tokenizers of the 2026 families: Qwen3 ("qwen2"), GLM-4.5 MoE ("glm4"), gpt-oss's o200k
("gpt-4o"), DeepSeek-V3 ("deepseek-v3") and Kimi-K2's tiktoken one ("kimi-k2").

The real tokenizer files are not available offline, so each family's tokenizer is synthesized: a
small byte-level BPE trained with the ``tokenizers`` library behind the family's real pre-tokenizer
(its tokenizer.json regexes; Kimi's tiktoken pattern from tokenization_kimi.py), the family's special
tokens and tokenizer_config.json.  Kimi-K2 ships no tokenizer.json: its ``tiktoken.model`` is written
from the trained ranks, and the reference tokenizer is rebuilt from that file the way transformers'
TikTokenConverter does (every split of a token into two tokens is a merge, by rank).

References: the GGUF keys are those that the converter's own logic gives (transformers'
AutoTokenizer for the token list as get_vocab_base reads it, gguf-py's SpecialVocab for merges,
special ids, add flags and template, plus the family's extras of convert_hf_to_gguf.py); the token ids
are the ``tokenizers`` library's on a mixed text, and ik_llama.cpp's (the wheel) on the converted
vocabulary; the chat templates (tests/chat_templates, copied from ik_llama.cpp's models/templates)
render as transformers renders them.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import peers  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402
from quantkit.gguf_io.constants import MetaValue, ValueType  # noqa: E402
from quantkit.hf.config import Fields  # noqa: E402
from quantkit.hf.vocab import vocab_metadata  # noqa: E402
from quantkit.text import pretokenize  # noqa: E402
from quantkit.text.tokenizer import Tokenizer  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"

# ---- the families' pre-tokenizers, as their tokenizer.json (or tokenization_kimi.py) writes them ----
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
QWEN2_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GLM4_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
O200K_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
               + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
               + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_V3_REGEXES = ("\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                       "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                       "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
KIMI_REGEX = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    + _CONTRACTIONS + "?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    + _CONTRACTIONS + "?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])

# the mixed text: code, digits, CJK, emoji, whitespace runs, contractions
MIXED = ("def quick_sort(arr: list[int]) -> list[int]:\n    if len(arr) <= 1:\n        return arr  # base case\n"
         "\tpivot = arr[len(arr) // 2]\r\n\n\n    x = {'a': [1, 2], \"b\": None}; y->z != w && !q\n"
         "Numbers: 7 42 1234567 3.14159 0x1F 1e-9 12,345,678 $19.99 100% \u0663\u0664\u0665\n"
         "CJK: 我想在apple工作1314151天～ 日本語のテキスト。中文，汉字！한국어 텍스트입니다\n"
         "Emoji: 🚀 (normal) 😶\u200d🌫️ ✅ 🦙🦙 👍🏽 🇫🇷 ❤️\n"
         "Whitespace:   three   spaces,\t\ttabs,  \n  \n\n trailing   \n     \n"
         "Contractions: I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like "
         "some tea? We'Ve a'lL DON'T it's they'd\n"
         "naïve café Привет мир Γειά σου hello world ------======= ''''''```````\"\"\"\"......!!!!!!??????")
# a corpus to train the small BPEs on
CORPUS = [MIXED, "the quick brown fox jumps over the lazy dog " * 3, "return self.value + 1\n" * 3,
          "机器学习是人工智能的一个分支。" * 2, "東京は日本の首都です。" * 2, "Hello, World! HELLO world. " * 3,
          "    for (int i = 0; i < n; ++i) {\n        sum += a[i];\n    }\n" * 2, "0123456789 " * 4]


def _pre_tokenizer(*regexes):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), "isolated") for r in regexes),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _train(regexes, vocab_size=700):
    """A byte-level BPE trained on CORPUS behind ``regexes``."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(*regexes)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _added_token(content):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


# family -> how its files look: regexes, added tokens (content, special), tokenizer_config.json,
# config.json, the pre-tokenizer name the converter gives, the template file
FAMILIES = {
    "qwen3": dict(
        regexes=(QWEN2_REGEX,), arch="Qwen3ForCausalLM", pre="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        added=[("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
               ("</tool_call>", False), ("<think>", False), ("</think>", False)],
        tc=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                clean_up_tokenization_spaces=False, add_bos_token=False, tokenizer_class="Qwen2Tokenizer"),
        config=dict(bos_token_id="<|endoftext|>", eos_token_id="<|im_end|>")),
    "glm4moe": dict(
        regexes=(GLM4_REGEX,), arch="Glm4MoeForCausalLM", pre="glm4", template="GLM-4.6.jinja",
        added=[("<|endoftext|>", True), ("[MASK]", True), ("[gMASK]", True), ("[sMASK]", True), ("<sop>", True),
               ("<eop>", True), ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True),
               ("<|observation|>", True), ("<think>", False), ("</think>", False)],
        tc=dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
                do_lower_case=False, tokenizer_class="PreTrainedTokenizerFast"),
        config=dict(eos_token_id=["<|endoftext|>", "<|user|>", "<|observation|>"], pad_token_id="<|endoftext|>")),
    "gpt-oss": dict(
        regexes=(O200K_REGEX,), arch="GptOssForCausalLM", pre="gpt-4o", template="openai-gpt-oss-120b.jinja",
        template_file=True,
        added=[("<|startoftext|>", True), ("<|endoftext|>", True), ("<|return|>", True), ("<|constrain|>", True),
               ("<|channel|>", True), ("<|start|>", True), ("<|end|>", True), ("<|message|>", True),
               ("<|call|>", True)],
        tc=dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
                clean_up_tokenization_spaces=False, tokenizer_class="PreTrainedTokenizerFast"),
        config=dict(eos_token_id="<|return|>", pad_token_id="<|endoftext|>")),
    "deepseek-v3": dict(
        regexes=DEEPSEEK_V3_REGEXES, arch="DeepseekV3ForCausalLM", pre="deepseek-v3",
        template="deepseek-ai-DeepSeek-V3.1.jinja", bos_template=True,
        added=[("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜▁pad▁｜>", True),
               ("<｜User｜>", False), ("<｜Assistant｜>", False), ("<think>", False), ("</think>", False)],
        # DeepSeek-V3's tokenizer_config.json gives bos and eos as AddedToken objects
        tc=dict(bos_token=_added_token("<｜begin▁of▁sentence｜>"), eos_token=_added_token("<｜end▁of▁sentence｜>"),
                pad_token=_added_token("<｜▁pad▁｜>"),
                add_bos_token=True, add_eos_token=False, clean_up_tokenization_spaces=False,
                tokenizer_class="LlamaTokenizerFast"),
        config=dict(bos_token_id="<｜begin▁of▁sentence｜>", eos_token_id="<｜end▁of▁sentence｜>")),
}
VOCAB_PAD = 16      # config.json's vocab_size is past the tokenizer's: [PAD<id>] tokens


def _write_family(d, family):
    """tokenizer.json, tokenizer_config.json (with the chat template) and config.json of ``family``."""
    from tokenizers import AddedToken, processors
    spec = FAMILIES[family]
    tok = _train(spec["regexes"])
    for content, special in spec["added"]:
        if special:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(content, special=False, normalized=False)])
    ids = {c: tok.token_to_id(c) for c, _ in spec["added"]}
    if spec.get("bos_template"):
        bos = spec["tc"]["bos_token"]["content"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, ids[bos])])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    template = (TEMPLATES / spec["template"]).read_text()
    tc = dict(spec["tc"], added_tokens_decoder={str(ids[c]): {"content": c, "special": s} for c, s in spec["added"]})
    if spec.get("template_file"):
        (d / "chat_template.jinja").write_text(template)
    else:
        tc["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False))
    config = {"architectures": [spec["arch"]], "vocab_size": tok.get_vocab_size() + VOCAB_PAD}
    for key, value in spec["config"].items():
        config[key] = [ids[v] for v in value] if isinstance(value, list) else ids[value]
    (d / "config.json").write_text(json.dumps(config))
    return d


# ---- Kimi-K2: tiktoken.model + tokenizer_config.json ----
KIMI_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 15: "<|im_middle|>",
                255: "[PAD]"}       # offsets after the ranks (Kimi-K2's ids 163584 + offset)
N_RESERVED = 256


def _byte_decoder():
    from quantkit.text import bpe
    return {c: b for b, c in enumerate(bpe._BYTE_CHAR)}


def _write_kimi(d):
    """tiktoken.model (the trained ranks: id = rank), tokenizer_config.json and config.json."""
    tok = _train((KIMI_REGEX,))
    dec = _byte_decoder()
    ranks = {bytes(dec[c] for c in text): i for text, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])}
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    tc = {"added_tokens_decoder": {str(n + k): {"content": c, "special": True} for k, c in KIMI_SPECIAL.items()},
          "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
          "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                 None]},
          "chat_template": (TEMPLATES / "moonshotai-Kimi-K2.jinja").read_text(), "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": n + N_RESERVED + VOCAB_PAD,
              "bos_token_id": n, "eos_token_id": n + 1, "pad_token_id": n + 255}
    (d / "config.json").write_text(json.dumps(config))
    return d, ranks


def _kimi_reference(ranks: dict[bytes, int], n_vocab: int):
    """Kimi's tiktoken tokenizer as the ``tokenizers`` library runs it: transformers'
    TikTokenConverter merges (every split of a token into two tokens, ordered by the token's rank),
    the pattern of tokenization_kimi.py and the special tokens."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models
    from quantkit.text.bpe import bytes_text
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(local, key=lambda m: (ranks[m[0]], ranks[m[1]])))
    merges.sort(key=lambda m: m[2])
    tok = HFTokenizer(models.BPE({bytes_text(t): r for t, r in ranks.items()},
                                 [(bytes_text(a), bytes_text(b)) for a, b, _ in merges]))
    tok.pre_tokenizer = _pre_tokenizer(KIMI_REGEX)
    tok.decoder = decoders.ByteLevel()
    n = len(ranks)
    specials = [KIMI_SPECIAL.get(k, f"<|reserved_token_{n + k}|>") for k in range(N_RESERVED)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.token_to_id(specials[-1]) == n + N_RESERVED - 1 < n_vocab
    return tok


# ---- the converter's keys ----

def _converter_keys(d, pre: str, arch: str) -> dict:
    """What convert_hf_to_gguf.py writes (get_vocab_base + SpecialVocab, and Glm4MoeModel.set_vocab's
    extras), with the real transformers and gguf-py; the pre-tokenizer name is the one its hash table
    gives the real tokenizer of the family."""
    from transformers import AutoTokenizer
    config = json.loads((d / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(d)
    vocab_size = config["vocab_size"]
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if tokenizer.added_tokens_decoder[i].special or (token.startswith(("<|", "<｜"))
                                                             and token.endswith(("|>", "｜>"))):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    w = gguf.GGUFWriter(None, arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    sv = gguf.SpecialVocab(d, load_merges=True)
    if arch == "Glm4MoeForCausalLM":
        sv._set_special_token("bos", added["[gMASK]"])
        sv._set_special_token("eot", added["<|user|>"])
        sv._set_special_token("unk", added["<|endoftext|>"])
        sv._set_special_token("eom", added["<|observation|>"])
        if isinstance(sv.chat_template, str) and "visible_text(m.content).endswith" in sv.chat_template:
            sv.chat_template = sv.chat_template.replace(
                """{{ visible_text(m.content) }}\n{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}""",  # noqa: E501
                """{% set content = visible_text(m.content) %}{{ content }}\n{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not content.endswith("/nothink")) else '' -}}""")  # noqa: E501
    sv.add_to_gguf(w, quiet=True)
    return {k: v.value for k, v in w.kv_data[0].items() if k.startswith("tokenizer.")}


def _plain(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        value = v.value
        out[k] = [int(x) for x in value] if isinstance(value, np.ndarray) else value
    return out


def _write_gguf(path, meta: dict):
    """A vocabulary-only GGUF (llama hyper-parameters, no tensors) holding ``meta``'s tokenizer keys."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                       ("feed_forward_length", 64), ("head_count", 1), ("head_count_kv", 1)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in _plain(meta).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF directory, our tokenizer.* metadata, the vocabulary-only GGUF of it)."""
    d = _write_family(tmp_path_factory.mktemp("tok") / request.param, request.param)
    config = Fields(json.loads((d / "config.json").read_text()), str(d / "config.json"))
    meta = vocab_metadata(d, config.dim("vocab_size"), config)
    return request.param, d, meta, _write_gguf(d / "vocab.gguf", meta)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(HF directory, ranks, our metadata, the GGUF)."""
    d, ranks = _write_kimi(tmp_path_factory.mktemp("tok") / "kimi-k2")
    config = Fields(json.loads((d / "config.json").read_text()), str(d / "config.json"))
    meta = vocab_metadata(d, config.dim("vocab_size"), config)
    return d, ranks, meta, _write_gguf(d / "vocab.gguf", meta)


# ---- the GGUF keys ----

def test_keys_are_the_converters(family):
    name, d, meta, _ = family
    spec = FAMILIES[name]
    ours = _plain(meta)
    assert ours["tokenizer.ggml.pre"] == spec["pre"]
    assert ours == _converter_keys(d, spec["pre"], spec["arch"])


@pytest.mark.parametrize("family", ["glm4moe"], indirect=True)
def test_glm4moe_special_tokens_and_template_fix(family):
    """GLM-4.5 MoE: bos [gMASK], eot <|user|>, eom <|observation|>, unk <|endoftext|> (Glm4MoeModel),
    and the chat template's double visible_text call rewritten."""
    name, d, meta, _ = family
    tokens = meta["tokenizer.ggml.tokens"].value
    got = {slot: tokens[meta[f"tokenizer.ggml.{slot}_token_id"].value] for slot in ("bos", "eos", "eot", "eom",
                                                                                   "unknown", "padding")}
    assert got == {"bos": "[gMASK]", "eos": "<|endoftext|>", "eot": "<|user|>", "eom": "<|observation|>",
                   "unknown": "<|endoftext|>", "padding": "<|endoftext|>"}
    template = meta["tokenizer.chat_template"].value
    assert "visible_text(m.content).endswith" not in template and "{% set content = visible_text(m.content) %}" in template


def test_kimi_keys_are_the_converters(kimi):
    """The converter's Kimi-K2 branch: ranks as ids, the 256 specials after them (named by
    added_tokens_decoder, else <|reserved_token_N|>) as CONTROL, [PAD<id>] after, merges from
    QwenModel.bpe; special ids from config.json only (there is no tokenizer.json for SpecialVocab to
    find tokenizer_config.json's texts in)."""
    from quantkit.text.bpe import bytes_text
    d, ranks, meta, _ = kimi
    ours = _plain(meta)
    n = len(ranks)
    by_rank = {r: bytes_text(t) for t, r in ranks.items()}
    specials = [KIMI_SPECIAL.get(k, f"<|reserved_token_{n + k}|>") for k in range(N_RESERVED)]
    assert ours["tokenizer.ggml.tokens"] == ([by_rank[i] for i in range(n)] + specials
                                             + [f"[PAD{i}]" for i in range(n + N_RESERVED, n + N_RESERVED + VOCAB_PAD)])
    assert ours["tokenizer.ggml.token_type"] == [1] * n + [3] * N_RESERVED + [5] * VOCAB_PAD
    assert ours["tokenizer.ggml.model"] == "gpt2" and ours["tokenizer.ggml.pre"] == "kimi-k2"
    assert ours["tokenizer.ggml.bos_token_id"] == n and ours["tokenizer.ggml.eos_token_id"] == n + 1
    assert ours["tokenizer.ggml.padding_token_id"] == n + 255
    assert "tokenizer.ggml.unknown_token_id" not in ours
    assert ours["tokenizer.chat_template"] == (TEMPLATES / "moonshotai-Kimi-K2.jinja").read_text()

    def bpe(token, max_rank):            # convert_hf_to_gguf.py's QwenModel.bpe, as written there
        parts = [bytes([b]) for b in token]
        while True:
            min_idx = min_rank = None
            for i, pair in enumerate(zip(parts[:-1], parts[1:])):
                rank = ranks.get(pair[0] + pair[1])
                if rank is not None and (min_rank is None or rank < min_rank):
                    min_idx, min_rank = i, rank
            if min_rank is None or (max_rank is not None and min_rank >= max_rank):
                break
            parts = parts[:min_idx] + [parts[min_idx] + parts[min_idx + 1]] + parts[min_idx + 2:]
        return parts
    merges = []
    for token, rank in ranks.items():
        if len(token) > 1 and len(merged := bpe(token, rank)) == 2:
            merges.append(" ".join(map(bytes_text, merged)))
    assert ours["tokenizer.ggml.merges"] == merges and len(merges) > 300


def test_tokenizer_json_spellings_of_rewritten_regexes_are_recognised():
    """llama.cpp rewrites o200k's and tekken's \\p{Lu}... classes for std::regex; the tokenizer.json
    spelling still names them (hf/vocab.py expands (?i:...) first, as here)."""
    expand = lambda r: r.replace(_CONTRACTIONS, pretokenize.CONTRACTIONS_REGEX)  # noqa: E731
    assert "gpt-4o" in [n for n, _ in pretokenize.pre_tokenizer_names((expand(O200K_REGEX),))]
    tekken = O200K_REGEX.replace(_CONTRACTIONS + "?", "").replace(r"\p{N}{1,3}", r"\p{N}")
    assert [n for n, _ in pretokenize.pre_tokenizer_names((tekken,))] == ["tekken"]


# ---- token ids: ours, the tokenizers library's and ik_llama.cpp's ----

def _lines(text):
    return [text, *text.split("\n")]


def test_ids_match_hf_and_ik(family):
    from tokenizers import Tokenizer as HFTokenizer
    name, d, meta, path = family
    ours = Tokenizer.from_metadata(meta)
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    specials = " ".join(c for c, _ in FAMILIES[name]["added"])
    with peers.IkVocab(path) as ik:
        for text in _lines(MIXED) + [f"{specials} x{specials}y"]:
            ids = ours.encode(text, add_special=False, parse_special=True)
            assert ids == hf.encode(text, add_special_tokens=False).ids, text
            assert ids == ik.tokenize(text, add_bos=False, special=True), text
            assert ours.encode(text, add_special=True) == ik.tokenize(text, add_bos=True), text
        ids = ours.encode(MIXED, add_special=False)
        assert ours.decode_bytes(ids) == ik.detokenize(ids)
        # glm4 is llama.cpp's only one of these with clean_spaces: " !" decodes as "!"
        assert (ours.decode(ids) == MIXED) == (name != "glm4moe")


def _assert_vocab_as_ik(ours: Tokenizer, ik: peers.IkVocab) -> None:
    """Attributes, end-of-generation flags and pieces of every token, and the special ids."""
    bad = [(t, ours.token_text(t)) for t in range(ours.n_vocab)
           if ours.attrs[t] != ik.attr(t) or (t in ours.eog_ids) != ik.is_eog(t)
           or ours.token_piece(t, True) != ik.piece(t, special=True)]
    assert ours.n_vocab == ik.n_vocab and not bad, bad[:5]


def test_token_attributes_and_eog_match_ik(family, kimi):
    """CONTROL / USER_DEFINED tokens and the end-of-generation set (gpt-oss: <|return|> and <|call|>
    without <|end|>, GLM's eot/eom) as ik_llama.cpp derives them from our keys."""
    for path, meta in ((family[3], family[2]), (kimi[3], kimi[2])):
        ours = Tokenizer.from_metadata(meta)
        with peers.IkVocab(path) as ik:
            _assert_vocab_as_ik(ours, ik)
    name, _, meta, _ = family
    ours = Tokenizer.from_metadata(meta)
    eog = sorted(ours.token_text(t) for t in ours.eog_ids)
    assert eog == {"qwen3": ["<|endoftext|>", "<|im_end|>"],
                   "glm4moe": ["<|endoftext|>", "<|observation|>", "<|user|>"],
                   "gpt-oss": ["<|call|>", "<|endoftext|>", "<|return|>"],
                   "deepseek-v3": ["<｜end▁of▁sentence｜>"]}[name]


def test_kimi_ids_match_tiktoken_semantics_and_ik(kimi):
    d, ranks, meta, path = kimi
    ours = Tokenizer.from_metadata(meta)
    ref = _kimi_reference(ranks, len(meta["tokenizer.ggml.tokens"].value))
    specials = " ".join(KIMI_SPECIAL.values())
    with peers.IkVocab(path) as ik:
        for text in _lines(KIMI_MIXED) + [f"{specials} x{specials}y <|reserved_token_{len(ranks) + 5}|>"]:
            ids = ours.encode(text, add_special=False, parse_special=True)
            assert ids == ref.encode(text, add_special_tokens=False).ids, text
            assert ids == ik.tokenize(text, add_bos=False, special=True), text
        ids = ours.encode(MIXED, add_special=False)
        assert ours.decode(ids) == MIXED and ours.decode_bytes(ids) == ik.detokenize(ids)


# Where ik_llama.cpp's hand-written splitters (which the GGUF is tokenized by) split otherwise than
# the regexes of the tokenizers they stand for; ours follows ik.  (text, ik's words, the regex's words)
DIVERGENT = {
    # the C splitter takes a whole run of letters: no split at a lower -> upper case change
    "kimi-k2 case change": ("kimi-k2", KIMI_REGEX, "camelCase XMLHttpRequest", ["camelCase", " XMLHttpRequest"],
                            ["camel", "Case", " XMLHttp", "Request"]),
    # ik's unicode_tolower finds no ASCII capital (pretokenize._contraction): upper-case contractions
    # are not contractions
    "kimi-k2 contraction": ("kimi-k2", KIMI_REGEX, "We'Ve DON'T a'lL", ["We", "'Ve", " DON", "'T", " a", "'lL"],
                            ["We'Ve", " DON'T", " a'lL"]),
    # combining marks: llama.cpp's std::regex form of o200k has no \p{M} (a mark is a letter's
    # category stand-in only as a "non-letter"), the C Kimi splitter takes letters only
    "gpt-4o marks": ("gpt-4o", O200K_REGEX, "e\u0301t\u00e9 a\u0300b\u0300C\u0300d",
                     ["e", "\u0301t\u00e9", " a", "\u0300b", "\u0300C", "\u0300d"],
                     ["e\u0301t\u00e9", " a\u0300b\u0300", "C\u0300d"]),
    "kimi-k2 marks": ("kimi-k2", KIMI_REGEX, "e\u0301t\u00e9 Z\u0351\u0352a",
                      ["e", "\u0301t\u00e9", " Z", "\u0351\u0352", "a"], ["e\u0301t\u00e9", " Z\u0351\u0352a"]),
    "qwen2 contraction": ("qwen2", QWEN2_REGEX, "x'REd 'Sd", ["x", "'REd", " '", "Sd"], ["x", "'RE", "d", " '", "Sd"]),
    "glm4 contraction": ("glm4", GLM4_REGEX, "IT'Sx", ["IT", "'Sx"], ["IT", "'S", "x"]),
}
# ... so the mixed text that Kimi's tokenizer must split as tiktoken does has its contractions in
# lower case
KIMI_MIXED = MIXED.replace("We'Ve a'lL DON'T", "we've a'll don't")


@pytest.mark.parametrize("case", list(DIVERGENT))
def test_splits_diverging_from_the_regex_follow_ik(case, tmp_path):
    from tokenizers import Regex, pre_tokenizers
    from quantkit.text import bpe
    pre, regex, text, ik_words, regex_words = DIVERGENT[case]
    assert pretokenize.regex_split(text, pretokenize.REGEX_SETS[pretokenize.PRE_TOKENIZERS[pre][0]]) == ik_words
    assert [w for w, _ in pre_tokenizers.Split(Regex(regex), "isolated").pre_tokenize_str(text)] == regex_words
    # a vocabulary whose merges spell each word of either split: the tokens then show the words
    tokens, merges = list(bpe._BYTE_CHAR), []
    for word in ik_words + regex_words:
        spelled = bpe.byte_encode(word)
        for i in range(2, len(spelled) + 1):
            if spelled[:i] not in tokens:
                merges.append(f"{spelled[:i - 1]} {spelled[i - 1]}")
                tokens.append(spelled[:i])
    S = ValueType.STRING
    meta = {"tokenizer.ggml.model": MetaValue(S, "gpt2"), "tokenizer.ggml.pre": MetaValue(S, pre),
            "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, tokens, S),
            "tokenizer.ggml.token_type": MetaValue(ValueType.ARRAY, np.ones(len(tokens), "<i4"), ValueType.INT32),
            "tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, merges, S)}
    ours = Tokenizer.from_metadata(meta).encode(text, add_special=False)
    with peers.IkVocab(_write_gguf(tmp_path / "v.gguf", meta)) as ik:
        assert ours == ik.tokenize(text, add_bos=False)
    assert [tokens[i] for i in ours] == [bpe.byte_encode(w) for w in ik_words]


def test_ik_tolower_finds_no_ascii_capital():
    """The cause of the lower-case-only contractions (pretokenize._contraction), in the wheel itself."""
    import ctypes
    d = peers.wheel_dir()
    lib = ctypes.CDLL(str(d / "lib" / "libllama.so"))
    tolower = getattr(lib, "_Z15unicode_tolowerj", None)
    if tolower is None:
        pytest.skip("the wheel does not export unicode_tolower")
    tolower.argtypes, tolower.restype = [ctypes.c_uint32], ctypes.c_uint32
    assert all(tolower(c) == c for c in range(0x41, 0x5B))


# ---- chat templates ----

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 = 4."},
        {"role": "user", "content": "And 3+3? 答えて。"}]


def _transformers_render(template, messages, **kw):
    from transformers.utils.chat_template_utils import render_jinja_template
    out = render_jinja_template(conversations=[messages], chat_template=template, **kw)
    return out[0][0] if isinstance(out, tuple) else out[0] if isinstance(out, list) else out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_as_transformers(family, add_generation_prompt):
    name, d, meta, _ = family
    ours = Tokenizer.from_metadata(meta)
    tokens = meta["tokenizer.ggml.tokens"].value
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    specials = dict(bos_token=tokens[bos.value] if bos else "", eos_token=tokens[eos.value] if eos else "")
    for messages in (CHAT, CHAT[1:2]):
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        want = _transformers_render(meta["tokenizer.chat_template"].value, messages,
                                    add_generation_prompt=add_generation_prompt, **specials)
        assert got == want


def test_kimi_chat_template_renders_as_transformers(kimi):
    d, ranks, meta, _ = kimi
    ours = Tokenizer.from_metadata(meta)
    tokens = meta["tokenizer.ggml.tokens"].value
    got = ours.apply_chat_template(CHAT)
    assert got == _transformers_render(meta["tokenizer.chat_template"].value, CHAT, add_generation_prompt=True,
                                       bos_token=tokens[len(ranks)], eos_token=tokens[len(ranks) + 1])
    assert got.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>")
    assert got.endswith("<|im_assistant|>assistant<|im_middle|>")


# ---- bad input ----

def test_bad_tiktoken_files_are_refused(kimi, tmp_path):
    import shutil
    d = shutil.copytree(kimi[0], tmp_path / "k")
    config = Fields(json.loads((d / "config.json").read_text()), str(d / "config.json"))
    lines = (d / "tiktoken.model").read_text().splitlines()
    for text, needle in (("\n".join(lines[:-1] + ["!!! 5"]), "not '<base64 token> <rank>'"),
                         ("\n".join(lines + [lines[3].split()[0] + f" {len(lines)}"]), "repeats the token"),
                         ("\n".join(lines[:-1] + [lines[-1].split()[0] + " 99999"]), "ranks are not"),
                         ("\n".join([base64.b64encode(b"\xfa\xfb\xfc\xfd").decode() + " " + lines[0].split()[1]]
                                    + lines[1:]), "single bytes are not tokens")):
        (d / "tiktoken.model").write_text(text)
        with pytest.raises(QuantkitError, match=needle):
            vocab_metadata(d, config.dim("vocab_size"), config)
    (d / "tiktoken.model").write_text("\n".join(lines))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    for key in ("tokenizer_class", "auto_map"):
        tc.pop(key)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(QuantkitError, match="does not name Kimi's TikTokenTokenizer"):
        vocab_metadata(d, config.dim("vocab_size"), config)


# ---- through the converter and the runtime ----

def test_kimi_checkpoint_converts_and_ik_tokenizes_it(kimi, tmp_path):
    """A checkpoint directory with Kimi's tokenizer files and no tokenizer.json converts (the tiny
    llama weights stand in for the model: the vocabulary is what is tested), and ik_llama.cpp
    tokenizes the converted file as ours does."""
    import shutil
    import hf_models as H
    import quantkit
    from quantkit.hf import open_hf
    d, ranks, meta, _ = kimi
    n_vocab = len(meta["tokenizer.ggml.tokens"].value)
    m = H.write_tiny_llama(tmp_path / "m", n_vocab=n_vocab)
    (m / "tokenizer.json").unlink()
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(d / f, m / f)
    with open_hf(m) as model:
        assert model.get("tokenizer.ggml.pre") == "kimi-k2"
        assert list(model.get("tokenizer.ggml.tokens")) == meta["tokenizer.ggml.tokens"].value
    out = tmp_path / "f32.gguf"
    quantkit.quantize_model(m, out, "f32")
    ours = Tokenizer.from_file(out)
    text = KIMI_MIXED + " [BOS]<|im_end|>"
    assert ours.encode(text, add_special=False, parse_special=True) == peers.ik_tokenize(out, text, add_bos=False,
                                                                                        special=True)


def test_kimi_vocabulary_without_merges_loads_as_in_ik(kimi, tmp_path):
    """llama.cpp loads a "kimi-k2" gpt2 vocabulary without merges (words are then byte tokens); any
    other pre-tokenizer needs them."""
    d, ranks, meta, _ = kimi
    bare = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
    ours = Tokenizer.from_metadata(bare)
    with peers.IkVocab(_write_gguf(tmp_path / "bare.gguf", bare)) as ik:
        assert ours.encode("hello 世界 it's", add_special=False) == ik.tokenize("hello 世界 it's", add_bos=False)
    bare["tokenizer.ggml.pre"] = MetaValue(ValueType.STRING, "qwen2")
    with pytest.raises(QuantkitError, match="without merges"):
        Tokenizer.from_metadata(bare)


# ---- special tokens as SpecialVocab finds them, on the post-processors and configs it parses ----

def _bos_eos_template(tok, bos, eos):
    from tokenizers import processors
    return processors.TemplateProcessing(single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
                                         special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])


def _roberta(tok, bos, eos):
    from tokenizers import processors
    return processors.RobertaProcessing((eos, tok.token_to_id(eos)), (bos, tok.token_to_id(bos)))


# variant -> (post-processor maker or None, tokenizer_config.json changes, config.json changes, files)
SPECIAL_VARIANTS = {
    # the template ends with <|endoftext|> while tokenizer_config.json's eos is <|im_end|>: that one
    # becomes the eot, <|endoftext|> the eos
    "template eos rebinds": (lambda t: _bos_eos_template(t, "<|im_start|>", "<|endoftext|>"),
                             {"bos_token": "<|im_start|>"}, {}, {}),
    "roberta": (lambda t: _roberta(t, "<|im_start|>", "<|im_end|>"), {"cls_token": "<|im_start|>",
                                                                    "sep_token": "<|im_end|>"}, {}, {}),
    "empty tokenizer_config": (None, None, {}, {"chat_template.jinja": "{{ messages }}"}),
    "jinja file beside the config": (None, {"chat_template": None}, {}, {"chat_template.jinja": "{{ messages }}"}),
    "config eos list, mask by config": (None, {"eos_token": None}, {"eos_token_id": [1, 2], "mask_token_id": 3},
                                        {}),
    # SpecialVocab (given no vocabulary size) writes an id past the vocabulary, which llama.cpp then
    # replaces by its default with a warning: we write none
    "ids out of range": (None, {}, {"unk_token_id": 10 ** 6}, {}),
}
NOT_WRITTEN = {"ids out of range": {"tokenizer.ggml.unknown_token_id": 10 ** 6}}


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)
@pytest.mark.parametrize("variant", list(SPECIAL_VARIANTS))
def test_special_tokens_as_special_vocab_finds_them(family, variant, tmp_path):
    import shutil
    from tokenizers import Tokenizer as HFTokenizer
    name, src, _, _ = family
    post, tc_changes, config_changes, files = SPECIAL_VARIANTS[variant]
    d = shutil.copytree(src, tmp_path / "t")
    (d / "vocab.gguf").unlink()
    if post is not None:
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        tok.post_processor = post(tok)
        tok.save(str(d / "tokenizer.json"))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc = {} if tc_changes is None else {**tc, **tc_changes}
    (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tc.items() if v is not None}))
    config = {**json.loads((d / "config.json").read_text()), **config_changes}
    (d / "config.json").write_text(json.dumps(config))
    for f, text in files.items():
        (d / f).write_text(text)
    fields = Fields(config, str(d / "config.json"))
    ours = {k: v for k, v in _plain(vocab_metadata(d, fields.dim("vocab_size"), fields)).items()
            if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")}
    theirs = {k: v for k, v in _converter_keys(d, "qwen2", "Qwen3ForCausalLM").items()
              if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")}
    assert {**ours, **NOT_WRITTEN.get(variant, {})} == theirs


# every template file, with the switches the families' templates take
TEMPLATE_CASES = [(f.name, kwargs) for f in sorted(TEMPLATES.glob("*.jinja"))
                  for kwargs in ({}, {"enable_thinking": False}, {"thinking": True})]


@pytest.mark.parametrize("file, kwargs", TEMPLATE_CASES, ids=[f"{f}-{k}" for f, k in TEMPLATE_CASES])
def test_template_files_render_as_transformers(file, kwargs):
    from quantkit.text.chat import BoundedEnvironment
    source = (TEMPLATES / file).read_text()
    env = BoundedEnvironment()
    template = env.compile_template(source)
    specials = dict(bos_token="<s>", eos_token="</s>")
    for messages in (CHAT, CHAT[1:2]):
        for add_generation_prompt in (True, False):
            got = env.render(template, messages=messages, add_generation_prompt=add_generation_prompt,
                             **specials, **kwargs)
            assert got == _transformers_render(source, messages, add_generation_prompt=add_generation_prompt,
                                               **specials, **kwargs)


def test_bad_tiktoken_checkpoint_refused_by_the_cli(kimi, tmp_path, capsys):
    """`quantkit quantize` on a Kimi directory with a broken tiktoken.model: one line, exit 1, no
    output, every input unchanged."""
    import shutil
    import hf_models as H
    from hostile import Snapshot, assert_refused
    from quantkit.cli import main
    d, _, meta, _ = kimi
    m = H.write_tiny_llama(tmp_path / "m", n_vocab=len(meta["tokenizer.ggml.tokens"].value))
    (m / "tokenizer.json").unlink()
    shutil.copy(d / "tokenizer_config.json", m / "tokenizer_config.json")
    lines = (d / "tiktoken.model").read_text().splitlines()
    (m / "tiktoken.model").write_text("\n".join(lines[:7] + ["not base64! 7"] + lines[8:]) + "\n")
    snap = Snapshot(m)
    out = tmp_path / "out.gguf"
    rc = main(["quantize", str(m), str(out), "f32"])
    captured = capsys.readouterr()
    assert_refused(rc, captured.out, captured.err, "tiktoken.model", "line 8")
    assert not out.exists()
    snap.assert_unchanged()
