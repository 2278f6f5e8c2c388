"""The type table against ik_llama.cpp's own (the ``ik-llama-cpp-python`` wheel), type names, peers API."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import peers
from quantkit.gguf_io.reader import open_model
from quantkit.types import TYPE_TRAITS, QuantType, is_known_type_id, tensor_nbytes, type_from_name, type_name

MAINLINE_ONLY = {QuantType.TQ1_0, QuantType.TQ2_0, QuantType.NVFP4}
# ids of ik_llama.cpp @ 8337e4cd (the golden vectors' commit) that the wheel's older ggml lacks
NEWER_THAN_THE_WHEEL = {QuantType.MXFP4_R8}

ggml = peers.load_ggml()
needs_wheel = pytest.mark.skipif(ggml is None, reason="ik-llama-cpp-python is not installed")


# ---- the table vs ggml.c's type_traits ----

@needs_wheel
def test_every_table_entry_matches_the_wheel():
    unknown = set()
    for qtype, t in TYPE_TRAITS.items():
        c = ggml.type_traits(int(qtype))
        if c is None:
            unknown.add(qtype)
            continue
        got = (c.type_name.decode(), c.blck_size, c.type_size, c.row_meta_size, c.is_quantized)
        assert got == (t.name, t.block_size, t.type_size, t.row_meta_size, t.quantized), qtype.name
        for k in (1, 2, 3, 7, 16, 56):
            n = k * t.block_size
            assert ggml.row_size(int(qtype), n) == t.row_size(n), (qtype.name, n)
            assert tensor_nbytes(qtype, (n, 3)) == 3 * ggml.row_size(int(qtype), n)
    assert unknown == MAINLINE_ONLY | NEWER_THAN_THE_WHEEL  # the fork has no 34/35 TQ*, 40 NVFP4


@needs_wheel
def test_the_wheel_knows_no_type_missing_from_the_table():
    extra = [(i, ggml.type_name(i)) for i in range(peers.GGML_TYPE_COUNT)
             if ggml.knows(i) and not is_known_type_id(i)]
    assert extra == []


@needs_wheel
def test_interleaved_types_are_named_after_their_row_group():
    for qtype, t in TYPE_TRAITS.items():
        if t.interleave_rows > 1 and qtype not in NEWER_THAN_THE_WHEEL:
            assert ggml.type_name(int(qtype)).endswith(f"_r{t.interleave_rows}"), qtype.name


# ---- names ----

def test_type_from_name_is_case_insensitive_and_names_are_canonical():
    for qtype, t in TYPE_TRAITS.items():
        for spelling in (t.name, t.name.upper(), t.name.lower(), f" {t.name.title()} "):
            assert type_from_name(spelling) == qtype, spelling
        assert type_name(qtype) == type_name(int(qtype)) == t.name
    assert type_name(QuantType.Q4_K) == "q4_K" and type_name(QuantType.IQ4_KS_R4) == "iq4_ks_r4"
    assert type_from_name("Q4_k") == QuantType.Q4_K
    assert type_from_name("q1_0") == type_from_name("Q1_0_G128") == QuantType.Q1_0
    with pytest.raises(ValueError, match="unknown tensor type 'q4_z'"):
        type_from_name("q4_z")


# ---- the peer API works ----

@needs_wheel
def test_quantize_chunk_and_to_float_agree_with_gguf_py():
    """Proves ggml_init ran (without it the fp16 table is zero and every scale decodes as 0)."""
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    for T in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0,
              gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_1):
        theirs = ggml.quantize_chunk(int(T), x)
        assert theirs == gguf.quantize(x, T).tobytes(), T.name
        y = ggml.to_float(int(T), theirs, x.size, 256)
        np.testing.assert_array_equal(y, gguf.dequantize(gguf.quantize(x, T), T).reshape(-1))
    q8 = ggml.to_float(int(QuantType.Q8_0), ggml.quantize_chunk(int(QuantType.Q8_0), x), x.size, 256)
    assert np.abs(q8 - x.reshape(-1)).max() < 0.03


@needs_wheel
def test_quantize_chunk_with_imatrix_and_interleaved_rows():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    w = rng.random(512).astype(np.float32)
    for qtype in (QuantType.Q4_K, QuantType.IQ4_KS, QuantType.IQ4_K_R4):
        plain = ggml.quantize_chunk(int(qtype), x)
        weighted = ggml.quantize_chunk(int(qtype), x, w)
        assert len(plain) == len(weighted) == tensor_nbytes(qtype, (512, 4))
        assert plain != weighted and ggml.validate_row_data(int(qtype), weighted)
        y = ggml.to_float(int(qtype), weighted, x.size, 512)
        assert np.abs(y - x.reshape(-1)).mean() < 0.15, qtype.name
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        ggml.quantize_chunk(int(QuantType.IQ4_K_R4), x[:3])
    with pytest.raises(ValueError, match="without an imatrix"):
        ggml.quantize_chunk(int(QuantType.IQ2_XXS), x)


@needs_wheel
def test_llama_quantize_runs():
    assert peers.llama_quantize_bin().name == "llama-quantize"
    assert peers.llama_quantize_runs()


@needs_wheel
def test_ik_logits_on_smollm2(smollm2_path):
    with open_model(smollm2_path) as m:
        n_vocab = len(m.get("tokenizer.ggml.tokens"))
    tokens = peers.ik_tokenize(smollm2_path, "The quick brown fox jumps over the lazy")
    last = peers.ik_logits(smollm2_path, tokens)
    assert last.shape == (n_vocab,) and last.dtype == np.float32 and np.isfinite(last).all()
    assert [int(last.argmax())] == peers.ik_tokenize(smollm2_path, " dog", add_bos=False)
    every = peers.ik_logits(smollm2_path, tokens, all_positions=True)
    assert every.shape == (len(tokens), n_vocab) and np.isfinite(every).all()
    np.testing.assert_array_equal(every[-1], last)
