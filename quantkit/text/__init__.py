"""Text and tokens: a GGUF vocabulary (vocab.py), the tokenizer over it (tokenizer.py: byte-level BPE
with pretokenize.py and bpe.py, SentencePiece-style with spm.py) and chat templates (chat.py), ported
from llama.cpp so they give its token ids and text.  The runtime tokenizes with it; the HF converter
(hf/vocab.py) matches a tokenizer.json's pre-tokenizer against its table."""
