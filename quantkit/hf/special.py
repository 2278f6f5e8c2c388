"""Special tokens, add-bos/eos/sep flags and the chat template of a Hugging Face tokenizer, as
gguf-py's SpecialVocab finds them for convert_hf_to_gguf.py:

1. tokenizer.json's ``post_processor`` (each of a Sequence's processors): a RobertaProcessing adds
   bos, eos and sep; a TemplateProcessing whose single-sequence template has two steps or more adds
   bos when it starts with the bos (or cls) token and eos when it ends with the eos token (an end
   token that is not tokenizer_config.json's eos becomes the eos, the old eos the eot or eom); its
   pair template "A <x> [<y>] B" adds sep when <x>/<y> is the sep or eos token;
2. only when tokenizer_config.json has content: its chat template (else ``chat_template.jinja``, else
   ``chat_template.json``'s), its ``add_<type>_token`` flags and its ``<type>_token`` texts, each the
   id of the first of tokenizer.json's added tokens with that content;
3. config.json's ``<type>_token_id`` for the types still without an id.

A type keeps the first id it gets.  Every value comes from untrusted JSON: a value of the wrong
kind in tokenizer_config.json or config.json (a number for a template, a token or its content, a
list of lists for an id) is refused, where SpecialVocab would skip it; a list of ids, which
SpecialVocab skips, is skipped; tokenizer.json's post-processor is read as far as it has the shape
described (the converter's own crude parse), and skipped beyond.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import QuantkitError
from ..inputs import read_bounded
from .config import MAX_JSON_BYTES, Fields

TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# the types GGUFWriter has a key for (no cls: SpecialVocab warns and skips it); gguf-py spells
# the separator "seperator"
ID_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding", "mask": "mask",
           "eot": "eot", "eom": "eom"}
FLAG_TYPES = ("bos", "eos", "sep")


def _obj(x) -> dict:
    return x if isinstance(x, dict) else {}


def _special_id(step) -> str | None:
    value = _obj(_obj(step).get("SpecialToken")).get("id")
    return value if isinstance(value, str) else None


def _sequence_id(step):
    return _obj(_obj(step).get("Sequence")).get("id")


class SpecialVocab:
    """``ids`` (type -> token id), ``flags`` (type -> add it) and ``template`` of a tokenizer."""

    def __init__(self, directory: Path, tokenizer: dict | None, tc: Fields, config: Fields, n_vocab: int):
        self.ids: dict[str, int] = {}
        self.flags: dict[str, bool] = {}
        self.template: str | None = None
        self.n_vocab = n_vocab
        self.types = TYPES
        # the raw entries: SpecialVocab compares them as they are (an AddedToken object equals no
        # token text: DeepSeek-V3's bos is one), and looks their content up
        texts = {f"{t}_token": tc.raw[f"{t}_token"] for t in (*TYPES, "eot", "eom")
                 if _token_text(tc, f"{t}_token") is not None}
        added = tokenizer.get("added_tokens") if tokenizer is not None else None
        added = [a for a in added if isinstance(a, dict)] if isinstance(added, list) else []
        if tokenizer is not None:
            self._post_processor(_obj(tokenizer.get("post_processor")), texts, bool(tc.raw))
        if tc.raw:
            self._from_config(directory, tc, texts, added)
        for typ in self.types:
            self._set(typ, _config_id(config, f"{typ}_token_id"))

    def _set(self, typ: str, tid) -> None:
        """SpecialVocab._set_special_token: ints only, the first one wins; an id past the vocabulary
        (or negative: the converter stops there) is no token."""
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < self.n_vocab:
            self.ids.setdefault(typ, tid)

    def _post_processor(self, post: dict, tc: dict, has_tc: bool) -> None:
        """``tc``: tokenizer_config.json's token texts, rewritten as SpecialVocab rewrites them;
        ``has_tc``: whether that file has content."""
        bos, cls, eos, sep = (tc.get(f"{t}_token") for t in ("bos", "cls", "eos", "sep"))
        if not bos and cls and has_tc:
            tc["bos_token"] = bos = cls
        if not eos and sep and has_tc:
            tc["eos_token"] = eos = sep
        if not post:
            return
        processors = post.get("processors", [post])
        for processor in processors if isinstance(processors, list) else []:
            processor = _obj(processor)
            kind = processor.get("type")
            if kind == "RobertaProcessing":
                self.flags.update(bos=True, eos=True, sep=True)
                if not cls and has_tc:
                    value = processor.get("cls", [bos])
                    tc["cls_token"] = cls = value[0] if isinstance(value, list) and value else None
                if not sep and has_tc:
                    value = processor.get("sep", [eos])
                    tc["sep_token"] = sep = value[0] if isinstance(value, list) and value else None
                continue
            if kind != "TemplateProcessing":
                continue
            single = processor.get("single", [])
            pair = processor.get("pair", [])
            single = single if isinstance(single, list) else []
            pair = pair if isinstance(pair, list) else []
            first = last = None
            if len(single) > 1:
                if first := _special_id(single[0]):
                    if not has_tc:
                        bos = first
                    self.flags["bos"] = first in (bos, cls)
                if last := _special_id(single[-1]):
                    if not has_tc:
                        eos = last
                    elif last != eos:
                        if "eot" not in self.types:
                            self.types += ("eot",)
                            tc["eot_token"] = eos
                        elif "eom" not in self.types:
                            self.types += ("eom",)
                            tc["eom_token"] = eos
                        tc["eos_token"] = eos = last
                    self.flags["eos"] = last == eos
            if pair:
                start = 1 if first and _special_id(pair[0]) == first else 0
                stop = -1 if last and _special_id(pair[-1]) == last else None
                pair = pair[start:stop]
                if pair and _sequence_id(pair[0]) == "A" and _sequence_id(pair[-1]) == "B" and (pair := pair[1:-1]):
                    add_sep = False
                    entry = _special_id(pair[0])
                    if entry and entry in (sep, eos) and not last:
                        add_sep = True
                    if len(pair) == 2 and (entry := _special_id(pair[1])) and entry in (sep, eos):
                        add_sep = True
                    self.flags["sep"] = add_sep
                    if add_sep and not sep and has_tc:
                        tc["sep_token"] = eos

    def _from_config(self, directory: Path, tc: Fields, texts: dict, added: list[dict]) -> None:
        alt = None
        jinja, json_file = directory / "chat_template.jinja", directory / "chat_template.json"
        if jinja.is_file():
            try:
                alt = read_bounded(jinja, MAX_JSON_BYTES, "a chat template").decode("utf-8")
            except UnicodeDecodeError as e:
                raise QuantkitError(f"{jinja}: not UTF-8 text (invalid byte at offset {e.start})") from None
        elif json_file.is_file():
            alt = Fields.load(json_file, "a chat template").raw.get("chat_template")
            if alt is not None and not isinstance(alt, str):
                raise QuantkitError(f"{json_file}: chat_template is not a string")
        template = tc.raw.get("chat_template", alt)
        if isinstance(template, list):      # named templates: the default one
            template = next((t.string("template") for t in tc.objects("chat_template")
                             if t.string("name", None) == "default"), None)
        elif template is not None and not isinstance(template, str):
            tc.fail("chat_template", "a string or a list of named templates")
        self.template = template
        for typ in self.types:
            flag = tc.raw.get(f"add_{typ}_token")
            if isinstance(flag, bool):
                self.flags[typ] = flag
            content = texts.get(f"{typ}_token")
            content = content.get("content") if isinstance(content, dict) else content
            if isinstance(content, str):
                self._set(typ, next((a.get("id") for a in added if a.get("content") == content), None))


def _token_text(tc: Fields, key: str) -> str | None:
    """A token of tokenizer_config.json: a string, or an AddedToken object with its content."""
    value = tc.raw.get(key)
    if isinstance(value, dict):
        return tc.object(key).string("content")
    if value is not None and not isinstance(value, str):
        tc.fail(key, "a token (a string or an object with its content)")
    return value


def _config_id(config: Fields, key: str) -> int | None:
    """config.json's id of a special token: an integer; a list of them (Llama 3.1's three eos ids,
    GLM's) is no id for SpecialVocab."""
    value = config.raw.get(key)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return config.integer(key, None, low=-2**63, high=2**64)
