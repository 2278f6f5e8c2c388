"""The runtime tokenizer against ik_llama.cpp's own (libllama of the ik-llama-cpp-python wheel).

Token ids (``llama_tokenize``), per-token pieces (``llama_token_to_piece``), detokenized text
(``llama_detokenize``), token attributes and end-of-generation flags must agree exactly: on
SmolLM2-135M-Instruct's gpt2 vocabulary, on that vocabulary re-labelled with other pre-tokenizers, and
on SentencePiece-style ("llama") vocabularies written here.  The vocabulary files written here hold
no tensors; ik_llama.cpp loads them with ``vocab_only``.
"""
from __future__ import annotations

import importlib.util
import random
import sys
import unicodedata

import gguf
import pytest

import peers
from models import add_spm_vocab
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.text import pretokenize
from quantkit.text import vocab as vocab_module
from quantkit.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(peers.wheel_dir() is None, reason="ik-llama-cpp-python not installed")

# ---- corpus ----
CORPUS = {
    "empty": "",
    "one_space": " ",
    "prose": "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "code": 'def f(x):\n    return {"a": [1, 2, 3], \'b\': x ** 2}  # comment\n\tif x >= 0x1F: pass\n',
    "cpp": 'int main() { std::vector<int> v{1,2,3}; for (auto& i : v) printf("%d\\n", i); return 0; }',
    "numbers": "0 1 12 123 1234 12345 123456 1234567 12345678901234567890 3.14159 -42 1e-10 1,000,000 ٣٤٥ ½ ²",
    "digit_run": "9" * 100 + " " + "1234567890" * 5,
    "spaces": "a  b   c    d     e" + " " * 17 + "f",
    "space_run": " " * 100 + "x",
    "newlines": "line1\nline2\n\nline3\n\n\n\nline4\r\nline5\r\n\r\n",
    "tabs": "\tindented\n\t\tmore\t \t mixed \t\n",
    "leading_trailing": "   leading and trailing   ",
    "trailing_newlines": "text\n\n",
    "only_whitespace": " \n\t \n ",
    "contractions": "It's don't we're they've I'm you'll he'd IT'S DON'T WE'RE 'S 'T 're o'clock rock 'n' roll",
    "quotes": "\"double\" 'single' ‘curly’ “curly” «guillemets» ' lone ' apostrophes",
    "punctuation": "Hello!!! What?!?! Wait... ---- ==== *** ((( ))) [[]] {{}} <<>> ~~~ @@@ ### $$$ %%% ^^^ &&& ||| ;;",
    "clean_spaces": "a , b . c ? d ! e ' f 's g 'm h 're i 've j 'll k 't",
    "accents": "Café naïve résumé über Straße façade Ångström Zürich São Paulo Łódź",
    "cjk": "日本語のテキスト。中文文本，汉字。한국어 텍스트입니다.",
    "emoji": "I ❤️ emoji 😀😃😄 👍🏽 🇫🇷🇯🇵 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍💻",
    "scripts": "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم! שלום עולם नमस्ते",
    "combining": "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0352\u0353\u0354 \u20dd \u0301lead",
    "control": "bell\x07 nul\x00 esc\x1b[31m del\x7f vt\x0b ff\x0c nel\x85 zwsp\u200b bom\ufeff",
    "unicode_whitespace": "nbsp\u00a0em\u2003ideographic\u3000line\u2028para\u2029end",
    "supplementary": "\U00010400\U0001D400\U0001F7D9\U00011F50 \U000E0001 \U0010FFFD \U0002EBF0",
    "sentencepiece_space": "\u2581already\u2581escaped \u2581",
    "mixed": "abcПриветΓειά日本123😀 x=1;y=2",
    "url": "https://example.com/path?q=1&r=two#frag mail@example.org",
    "long_word": "a" * 300,
    "chatml": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "specials_adjacent": "<|im_end|><|im_start|><|endoftext|>x<|im_start|> <|im_end|>  <repo_name>r<file_sep>",
    "special_like": "<|im_start <|im_end| |im_start|> < |im_end|> <|IM_START|> <<|im_start|>>",
    "spm_specials": "<s>hi</s> <unk> <|user|> x <tool> <|im_start|> y  <|im_end|>\n z",
    "spm_nul": "the the \u2581the\u2581the\0tail tail\0 [EMPTY_1] \0\0",
}
SPM_CORPUS = ("empty", "one_space", "prose", "code", "numbers", "spaces", "newlines", "leading_trailing",
              "contractions", "accents", "cjk", "emoji", "scripts", "combining", "control", "sentencepiece_space",
              "chatml", "spm_specials", "spm_nul")

# alphabets the random strings are drawn from
ALPHABETS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r\v\f\u00a0\u2003\u3000\u0085\u2028\u2581",
    "'sStTrReEvVmMlLdD",
    "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~",
    "éèêëàâäôöûüçñÉÀÇßøåæœŁł",
    "日本語中文한국어漢字かなカナ。，",
    "😀🤖👍🏽❤️‍🔥👨‍👩‍👧\u200d\ufe0f🇫🇷",
    "ПриветмирΓειασουκόσμεمرحبابالعالم",
    "\u0301\u0308\u0327\u20dd\u094d",
    "\x00\x01\x1b\x7f\u200b\u200e\ufeff",
    "\U0001F7D9\U00011F50\U000E0001\U0010FFFD\ud7ff\ue000\U0002EBF0",
)
WORDS = (" ", "  ", "\n", "\r\n", "\t", "'s", "'re", " '", "?", " ?", " .", "123456789", "hello", " world",
         "é", "日本", "🤖", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "<s>", "</s>", "<unk>",
         "<|user|>", "<tool>")


def random_strings(seed: int, n: int) -> list[str]:
    """Strings mixing runs from the alphabets with whole words and special-token texts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 10)):
            if rng.random() < 0.4:
                parts.append(rng.choice(WORDS))
            else:
                alphabet = rng.choice(ALPHABETS)
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


RANDOM = random_strings(20240611, 400)
FLAGS = ((False, False), (False, True), (True, False), (True, True))     # (add_special, parse_special)


# ---- checks shared by every vocabulary ----
def assert_encode(ours: Tokenizer, theirs: peers.IkVocab, text: str, flags=FLAGS) -> None:
    for add, parse in flags:
        got = ours.encode(text, add_special=add, parse_special=parse)
        want = theirs.tokenize(text, add_bos=add, special=parse)
        assert got == want, f"encode({text!r}, add_special={add}, parse_special={parse})"


def assert_decode(ours: Tokenizer, theirs: peers.IkVocab, ids: list[int]) -> None:
    for remove, unparse in FLAGS:       # every (remove_special, unparse_special)
        got = ours.decode_bytes(ids, special=unparse, remove_special=remove)
        want = theirs.detokenize(ids, remove_special=remove, unparse_special=unparse)
        assert got == want, f"decode({ids}, special={unparse}, remove_special={remove})"
        assert ours.decode(ids, special=unparse, remove_special=remove) == want.decode("utf-8", "replace")


def assert_vocab(ours: Tokenizer, theirs: peers.IkVocab) -> None:
    """Pieces (with and without ``special``), attributes and EOG flags of every token."""
    assert ours.n_vocab == theirs.n_vocab
    bad = []
    for t in range(ours.n_vocab):
        for special in (False, True):
            if ours.token_piece(t, special) != theirs.piece(t, special=special):
                bad.append((t, ours.token_text(t), "piece", special))
        if ours.attrs[t] != theirs.attr(t):
            bad.append((t, ours.token_text(t), "attr", ours.attrs[t], theirs.attr(t)))
        if (t in ours.eog_ids) != theirs.is_eog(t):
            bad.append((t, ours.token_text(t), "eog", t in ours.eog_ids))
    assert not bad, f"{len(bad)} tokens disagree, first: {bad[:5]}"


# ---- vocabulary files ----
def smollm2_tokenizer_meta(path) -> dict:
    with open_model(path) as m:
        return {k: vocab_module._py(v) for k, v in m.metadata.items() if k.startswith("tokenizer.")}


def vocab_file(path, add_vocab, name: str | None = None):
    """A llama-architecture GGUF with no tensors; ``add_vocab(writer)`` adds the vocabulary."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    if name:
        w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(64)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_vocab(path, *, model: str, tokens, types, scores=None, merges=None, pre=None, name=None,
                extra: dict | None = None):
    """A vocabulary-only file: ``extra`` maps GGUFWriter ``add_<key>`` methods to their value."""
    def add_vocab(w):
        w.add_tokenizer_model(model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        if scores is not None:
            w.add_token_scores(scores)
        if merges is not None:
            w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        for key, value in (extra or {}).items():
            getattr(w, f"add_{key}")(value)
    return vocab_file(path, add_vocab, name)


def spm_vocabulary(smol: Tokenizer, n_pieces: int):
    """A SentencePiece-style vocabulary: controls, the 256 byte tokens, user-defined and unused tokens,
    then the first ``n_pieces`` SmolLM2 pieces that are whole UTF-8 text (spaces as ``▁``), scored in id
    order three at a time so that equal scores occur (llama.cpp then merges the leftmost bigram first),
    then texts with a NUL."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    for text, typ in (("<|im_start|>", 3), ("<|im_end|>", 3), ("<|endoftext|>", 3), ("<|user|>", 4),
                      ("\u2581<tool>", 4), ("<tool>", 4), ("<unused0>", 5)):
        tokens.append(text)
        types.append(typ)
    scores = [0.0] * len(tokens)
    seen, n_fixed = set(tokens), len(tokens)
    for t in range(smol.n_vocab):
        if len(tokens) - n_fixed >= n_pieces:
            break
        if smol.attrs[t] != vocab_module.ATTR_NORMAL:
            continue
        try:
            text = smol.token_piece(t).decode("utf-8").replace(" ", "\u2581")
        except UnicodeDecodeError:
            continue
        if text in seen:
            continue
        seen.add(text)
        tokens.append(text)
        types.append(1)
        scores.append(-float(t // 3))
    # llama.cpp reads token texts as C strings: these are "▁the▁the" and "[EMPTY_<id>]" (as is
    # SmolLM2's piece "\0", among the pieces above)
    for text in ("\u2581the\u2581the\0tail", "\0\0"):
        assert text.split("\0")[0] not in seen
        tokens.append(text)
        types.append(1)
        scores.append(0.0)
    return tokens, types, scores


# ---- SmolLM2 (gpt2 byte-level BPE, pre-tokenizer "smollm") ----
@pytest.fixture(scope="module")
def smol(smollm2_path):
    theirs = peers.IkVocab(smollm2_path)
    yield Tokenizer.from_file(smollm2_path), theirs
    theirs.close()


@pytest.mark.parametrize("name", CORPUS)
def test_encode_matches_ik(smol, name):
    assert_encode(*smol, CORPUS[name])


@pytest.mark.parametrize("name", CORPUS)
def test_decode_matches_ik(smol, name):
    ours, theirs = smol
    text = CORPUS[name]
    for parse in (False, True):
        ids = theirs.tokenize(text, add_bos=True, special=parse)
        assert_decode(ours, theirs, ids)
        # byte-level BPE without clean_spaces loses nothing
        assert ours.decode(ids, special=True) == text


def test_random_strings_match_ik(smol):
    ours, theirs = smol
    for text in RANDOM:
        assert_encode(ours, theirs, text, flags=((False, False), (True, True)))
        assert_decode(ours, theirs, theirs.tokenize(text, add_bos=True, special=True))


def test_random_token_sequences_decode_like_ik(smol):
    ours, theirs = smol
    rng = random.Random(7)
    specials = sorted(ours._special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(ours.n_vocab)
               for _ in range(rng.randint(0, 12))]
        assert_decode(ours, theirs, ids)


def test_long_text_matches_ik(smol, shared_dir):
    ours, theirs = smol
    text = (shared_dir / "golden/imatrix/calib-gpl3.txt").read_text(encoding="utf-8")[:16384]
    ids = ours.encode(text)
    assert ids == theirs.tokenize(text, add_bos=False)
    assert len(ids) > 3000
    assert ours.decode_bytes(ids) == theirs.detokenize(ids) == text.encode("utf-8")


def test_vocab_pieces_attrs_eog_match_ik(smol):
    ours, theirs = smol
    assert_vocab(ours, theirs)
    # the ids the chat template relies on, and what ends a generation
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>", parse_special=True) == [1, 2, 0]
    assert ours.eog_ids == {t for t in range(ours.n_vocab) if theirs.is_eog(t)} >= {0, 2}


def test_bad_token_ids_raise(smol):
    ours, _ = smol
    for t in (-1, ours.n_vocab):
        for special in (False, True):
            with pytest.raises(ValueError):
                ours.token_piece(t, special)
        with pytest.raises(ValueError):
            ours.decode([5, t], special=True)


def test_unicode_flags_match_ik():
    """Every codepoint's category and whitespace flags, as llama.cpp's unicode_cpt_flags_from_cpt."""
    ik_flags = peers.ik_unicode_flags()
    if ik_flags is None:
        pytest.skip("unicode_cpt_flags_from_cpt is not exported by this libllama")
    if tuple(map(int, unicodedata.unidata_version.split("."))) > (15, 1, 0):
        pytest.xfail(f"Python's Unicode {unicodedata.unidata_version} is newer than llama.cpp's 15.1 "
                     "(see quantkit.text.pretokenize)")
    bad = [(hex(c), ik_flags(c) & 0x1FF, pretokenize._cpt_flags(c))
           for c in range(0x110000) if ik_flags(c) & 0x1FF != pretokenize._cpt_flags(c)]
    assert not bad, f"{len(bad)} codepoints disagree, first: {bad[:10]}"


# ---- chat template ----
# SmolLM2's tokenizer.chat_template: a default system message when the first message is not a system
# one, then "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then "<|im_start|>assistant\n".
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.skipif(importlib.util.find_spec("jinja2") is None, reason="jinja2 is not installed")
def test_chat_template_smollm2(smol):
    ours, theirs = smol
    assert "<|im_start|>" in ours.chat_template and SMOL_SYSTEM in ours.chat_template
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = ours.apply_chat_template(user)
    assert prompt == (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = ours.encode(prompt, add_special=True, parse_special=True)
    assert ids == theirs.tokenize(prompt, add_bos=True, special=True)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_without_jinja2(smol, monkeypatch):
    ours, _ = smol
    monkeypatch.setitem(sys.modules, "jinja2", None)        # makes `import jinja2` raise ImportError
    with pytest.raises(QuantkitError, match="pip install jinja2"):
        ours.apply_chat_template([{"role": "user", "content": "Hi"}])


# ---- other pre-tokenizers on a cut-down SmolLM2 vocabulary ----
# one name per regex set of llama-vocab.cpp (and its flags: clean_spaces, ignore_merges, add_bos)
PRE_NAMES = ("default", "llama-bpe", "deepseek-llm", "deepseek-coder", "deepseek-v3", "youtu", "falcon", "gpt-2",
             "jais-2", "qwen2", "stablelm2", "qwen35", "glm4", "poro-chat", "bloom", "viking", "tekken",
             "chameleon", "gpt-4o", "bailingmoe", "seed-coder", "exaone-moe", "trillion", "kimi-k2")
N_CUT = 6000


@pytest.fixture(scope="module")
def cut_vocab(smollm2_path):
    """The first N_CUT SmolLM2 tokens and the merges that stay inside them (BPE then ends each word
    in tokens of the cut vocabulary, as all 256 byte characters are among them)."""
    meta = smollm2_tokenizer_meta(smollm2_path)
    tokens = meta["tokenizer.ggml.tokens"][:N_CUT]
    keep = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if m.replace(" ", "", 1) in keep
              and all(p in keep for p in m.split(" ", 1))]
    return tokens, meta["tokenizer.ggml.token_type"][:N_CUT], merges


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_pre_tokenizers_match_ik(cut_vocab, tmp_path, pre):
    tokens, types, merges = cut_vocab
    path = write_vocab(tmp_path / f"{pre}.gguf", model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges)
    ours = Tokenizer.from_file(path)
    with peers.IkVocab(path) as theirs:
        for text in [CORPUS[n] for n in ("prose", "code", "numbers", "contractions", "clean_spaces", "cjk",
                                         "scripts", "newlines", "spaces", "chatml")] + RANDOM[:100]:
            assert_encode(ours, theirs, text, flags=((False, False), (True, True)))
            assert_decode(ours, theirs, theirs.tokenize(text, add_bos=True, special=True))


def test_unknown_pre_tokenizer_is_refused(cut_vocab, tmp_path):
    tokens, types, merges = cut_vocab
    path = write_vocab(tmp_path / "unknown.gguf", model="gpt2", pre="no-such-pre", tokens=tokens, types=types,
                       merges=merges)
    with pytest.raises(RuntimeError):
        peers.IkVocab(path)
    with pytest.raises(QuantkitError, match="no-such-pre"):
        Tokenizer.from_file(path)


def test_duplicate_tokens_are_refused():
    """llama.cpp aborts on a vocabulary with duplicate texts (GGML_ASSERT in llama_vocab::impl::load,
    so not tried here); texts are cut at a NUL first, so "a\\0x" duplicates "a"."""
    for tokens in (["<unk>", "a", "b", "a"], ["<unk>", "a", "a\0x"]):
        meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens}
        with pytest.raises(QuantkitError, match="duplicate"):
            Tokenizer.from_metadata(meta)


# ---- SentencePiece-style ("llama") vocabularies ----
SPM_VARIANTS = {
    # tests/models.py's minimal vocabulary: no piece merges with another, every text becomes byte tokens
    "minimal": None,
    "pieces": {},
    # no space prefix, EOS added, and general.name "phi-3": control tokens swallow the spaces after them
    "pieces-phi3": {"name": "Phi-3 mini", "extra": {"add_space_prefix": False, "add_bos_token": False,
                                                    "add_eos_token": True}},
}


@pytest.fixture(scope="module", params=list(SPM_VARIANTS))
def spm(request, tmp_path_factory, smol):
    path = tmp_path_factory.mktemp("spm") / f"{request.param}.gguf"
    variant = SPM_VARIANTS[request.param]
    if variant is None:
        vocab_file(path, lambda w: add_spm_vocab(w, 512))
    else:
        tokens, types, scores = spm_vocabulary(smol[0], 6000)
        write_vocab(path, model="llama", tokens=tokens, types=types, scores=scores, **variant)
    theirs = peers.IkVocab(path)
    yield Tokenizer.from_file(path), theirs
    theirs.close()


def test_phi3_vocab_without_its_tokens_is_refused(smol, tmp_path):
    """llama.cpp gives phi-3 models (by general.name) fixed strip flags and needs the tokens for that."""
    tokens, types, scores = spm_vocabulary(smol[0], 100)
    i = tokens.index("<|endoftext|>")
    tokens[i] = "<|end_of_text|>"
    path = write_vocab(tmp_path / "phi3.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                       name="Phi-3 mini")
    with pytest.raises(RuntimeError):
        peers.IkVocab(path)
    with pytest.raises(QuantkitError, match="<\\|endoftext\\|>"):
        Tokenizer.from_file(path)


def test_spm_corpus_matches_ik(spm):
    ours, theirs = spm
    for name in SPM_CORPUS:
        text = CORPUS[name]
        assert_encode(ours, theirs, text)
        for parse in (False, True):
            assert_decode(ours, theirs, theirs.tokenize(text, add_bos=True, special=parse))


def test_spm_random_strings_match_ik(spm):
    ours, theirs = spm
    for text in RANDOM[:150]:
        assert_encode(ours, theirs, text, flags=((False, False), (True, True)))
        assert_decode(ours, theirs, theirs.tokenize(text, add_bos=True, special=True))


def test_spm_vocab_matches_ik(spm):
    assert_vocab(*spm)
