"""Tiny synthetic models written with gguf-py (an independent writer), for tests and benchmarks.

Shapes follow llama.cpp's tensor layouts (ggml order, shape[0] = row length); numpy arrays are
(rows, row length), i.e. reversed.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def _w(rng, *np_shape, scale=0.02, dtype=np.float32):
    return (rng.standard_normal(np_shape, dtype=np.float32) * scale).astype(dtype)


def write_llama(path: Path, n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=512,
                tied=False, dtype=np.float32, seed=0, vocab=False, alignment=None) -> Path:
    """A llama-architecture GGUF with random weights (with ``vocab``, a minimal tokenizer so that
    ik_llama.cpp loads it; with ``alignment``, its data aligned to that and ``general.alignment``)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0 if dtype == np.float32 else 1)
    if vocab:
        add_spm_vocab(w, n_vocab)
    kv = n_embd // n_head * n_head_kv
    w.add_tensor("token_embd.weight", _w(rng, n_vocab, n_embd, dtype=dtype))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if not tied:
        w.add_tensor("output.weight", _w(rng, n_vocab, n_embd, dtype=dtype))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "attn_q.weight", _w(rng, n_embd, n_embd, dtype=dtype))
        w.add_tensor(p + "attn_k.weight", _w(rng, kv, n_embd, dtype=dtype))
        w.add_tensor(p + "attn_v.weight", _w(rng, kv, n_embd, dtype=dtype))
        w.add_tensor(p + "attn_output.weight", _w(rng, n_embd, n_embd, dtype=dtype))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "ffn_gate.weight", _w(rng, n_ff, n_embd, dtype=dtype))
        w.add_tensor(p + "ffn_up.weight", _w(rng, n_ff, n_embd, dtype=dtype))
        w.add_tensor(p + "ffn_down.weight", _w(rng, n_embd, n_ff, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_llama_sized(path: Path, n_layer: int, vocab_size: int, n_head=4, n_head_kv=1, n_embd=256, n_ff=256,
                      n_vocab=256, seed=0) -> Path:
    """A tiny f16 llama whose metadata claims a real model's size class (llm_load_hparams: 32 layers and a
    vocabulary of >= 40000 is MODEL_8B, 80 layers with GQA is MODEL_70B), for the quantize rules that
    depend on it.  The ``llama.vocab_size`` key says ``vocab_size``; the embedding tables keep only
    ``n_vocab`` rows, which llama-quantize never checks."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab_size)
    w.add_file_type(1)
    kv = n_embd // n_head * n_head_kv
    w.add_tensor("token_embd.weight", _w(rng, n_vocab, n_embd, dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _w(rng, n_vocab, n_embd, dtype=np.float16))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (kv, n_embd)), ("attn_v", (kv, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            w.add_tensor(p + name + ".weight", _w(rng, *shape, dtype=np.float16))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_spm_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A minimal SentencePiece-style vocabulary (control tokens, the 256 byte tokens, fillers), enough
    for ik_llama.cpp's loader, which refuses a model without one."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:n_vocab])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types[:n_vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_deepseek2(path: Path, n_layer=4, n_dense=1, n_embd=256, n_ff=512, n_ff_exp=256, n_expert=4,
                    n_expert_used=2, n_shared=1, n_head=4, q_lora_rank=256, kv_lora_rank=512,
                    qk_nope=128, qk_rope=64, v_head=128, n_vocab=512, dtype=np.float32, seed=0,
                    fused_kv_b=False, split_kv_b=False, gating=2, probs_bias=0.0, weights_norm=True, weights_scale=2.5,
                    n_group=0, n_group_used=0, yarn: dict | None = None, fused_gate_up=False) -> Path:
    """A DeepSeek-V3-shaped (MLA + MoE) GGUF with random weights.

    The per-head MLA tensors keep DeepSeek's real head sizes (attn_k_b rows of qk_nope = 128,
    attn_v_b rows of kv_lora_rank = 512), since those drive the row-length fallbacks.

    The file is a mainline-style MLA GGUF (one KV head, key_length = kv_lora_rank + rope dims).
    ik_llama.cpp's loader converts such files only when the head sizes are DeepSeek's (576/512,
    64 rope dims) and ``n_head`` is a multiple of 4; otherwise it aborts with "Sorry, uknown model"
    (llm_load_hparams), which is why ``n_head`` defaults to 4.

    Variants (the defaults write the file described above):

    * ``fused_kv_b``: the older layout with only attn_kv_b [kv_lora, n_head * (qk_nope + v_head)]
      and per-head metadata (head_count_kv = n_head, key_length = qk_nope + qk_rope), which
      ik_llama.cpp loads with any head sizes;
    * ``split_kv_b`` (with ``fused_kv_b``): also attn_k_b and attn_v_b split from attn_kv_b and
      stored flat in 2-D, attn_k_b [qk_nope, n_head * kv_lora] (each head's key rows transposed)
      and attn_v_b [kv_lora, n_head * v_head]: the layout of ik_llama.cpp's converter (and
      quantkit's), which the runtime computes with through attn_k_b/attn_v_b;
    * ``q_lora_rank=0``: queries from attn_q, as DeepSeek-V2-Lite (ik_llama.cpp expects that only
      of 26- or 27-layer models);
    * ``gating`` 1 (softmax, DeepSeek-V2: no exp_probs_b) or 2 (sigmoid, V3); ``probs_bias``: the
      scale of a random exp_probs_b (0: zeros); ``weights_norm``, ``weights_scale``; ``n_group``,
      ``n_group_used``: expert_group_count / expert_group_used_count (written when > 0);
    * ``yarn``: YaRN rope scaling, ``{"factor", "original_context_length", "log_multiplier"}`` and
      optionally ``"attn_factor"``;
    * ``fused_gate_up``: the routed gate and up experts as one tensor ffn_gate_up_exps
      [n_embd, 2 * n_ff_exp, n_expert], each expert's gate rows then its up rows (ik_llama.cpp's
      layout); the same numbers as the file written without it, with the same seed.
    """
    rng = np.random.default_rng(seed)
    a = "deepseek2"
    w = gguf.GGUFWriter(str(path), arch=a)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head if fused_kv_b else 1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_used_count(n_expert_used)
    w.add_vocab_size(n_vocab)
    w.add_uint32(f"{a}.leading_dense_block_count", n_dense)
    if q_lora_rank:
        w.add_uint32(f"{a}.attention.q_lora_rank", q_lora_rank)
    w.add_uint32(f"{a}.attention.kv_lora_rank", kv_lora_rank)
    if fused_kv_b:
        w.add_uint32(f"{a}.attention.key_length", qk_nope + qk_rope)
        w.add_uint32(f"{a}.attention.value_length", v_head)
    else:
        w.add_uint32(f"{a}.attention.key_length", kv_lora_rank + qk_rope)
        w.add_uint32(f"{a}.attention.value_length", kv_lora_rank)
        w.add_uint32(f"{a}.attention.key_length_mla", qk_nope + qk_rope)
        w.add_uint32(f"{a}.attention.value_length_mla", v_head)
    w.add_uint32(f"{a}.expert_feed_forward_length", n_ff_exp)
    w.add_uint32(f"{a}.expert_count", n_expert)
    w.add_uint32(f"{a}.expert_shared_count", n_shared)
    w.add_float32(f"{a}.expert_weights_scale", weights_scale)
    w.add_bool(f"{a}.expert_weights_norm", weights_norm)
    w.add_uint32(f"{a}.expert_gating_func", gating)
    if n_group > 0:
        w.add_uint32(f"{a}.expert_group_count", n_group)
        w.add_uint32(f"{a}.expert_group_used_count", n_group_used)
    w.add_uint32(f"{a}.rope.dimension_count", qk_rope)
    if yarn:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", yarn["factor"])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", yarn["original_context_length"])
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", yarn.get("log_multiplier", 0.0))
        if "attn_factor" in yarn:
            w.add_float32(f"{a}.rope.scaling.attn_factor", yarn["attn_factor"])
    w.add_file_type(0 if dtype == np.float32 else 1)
    add_spm_vocab(w, n_vocab)
    w.add_tensor("token_embd.weight", _w(rng, n_vocab, n_embd, dtype=dtype))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _w(rng, n_vocab, n_embd, dtype=dtype))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        if q_lora_rank:
            w.add_tensor(p + "attn_q_a_norm.weight", np.ones(q_lora_rank, np.float32))
        w.add_tensor(p + "attn_kv_a_norm.weight", np.ones(kv_lora_rank, np.float32))
        if q_lora_rank:
            w.add_tensor(p + "attn_q_a.weight", _w(rng, q_lora_rank, n_embd, dtype=dtype))
            w.add_tensor(p + "attn_q_b.weight", _w(rng, n_head * (qk_nope + qk_rope), q_lora_rank, dtype=dtype))
        else:
            w.add_tensor(p + "attn_q.weight", _w(rng, n_head * (qk_nope + qk_rope), n_embd, dtype=dtype))
        w.add_tensor(p + "attn_kv_a_mqa.weight", _w(rng, kv_lora_rank + qk_rope, n_embd, dtype=dtype))
        if fused_kv_b:
            kv_b = _w(rng, n_head * (qk_nope + v_head), kv_lora_rank, dtype=dtype)
            w.add_tensor(p + "attn_kv_b.weight", kv_b)
            if split_kv_b:
                heads = kv_b.reshape(n_head, qk_nope + v_head, kv_lora_rank)
                w.add_tensor(p + "attn_k_b.weight", np.ascontiguousarray(
                    heads[:, :qk_nope].transpose(0, 2, 1).reshape(n_head * kv_lora_rank, qk_nope)))
                w.add_tensor(p + "attn_v_b.weight", np.ascontiguousarray(
                    heads[:, qk_nope:].reshape(n_head * v_head, kv_lora_rank)))
        else:
            w.add_tensor(p + "attn_k_b.weight", _w(rng, n_head, kv_lora_rank, qk_nope, dtype=dtype))
            w.add_tensor(p + "attn_v_b.weight", _w(rng, n_head, v_head, kv_lora_rank, dtype=dtype))
        w.add_tensor(p + "attn_output.weight", _w(rng, n_embd, n_head * v_head, dtype=dtype))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        if i < n_dense:
            w.add_tensor(p + "ffn_gate.weight", _w(rng, n_ff, n_embd, dtype=dtype))
            w.add_tensor(p + "ffn_up.weight", _w(rng, n_ff, n_embd, dtype=dtype))
            w.add_tensor(p + "ffn_down.weight", _w(rng, n_embd, n_ff, dtype=dtype))
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", _w(rng, n_expert, n_embd))
        if gating == 2:
            bias = _w(rng, n_expert, scale=probs_bias) if probs_bias else np.zeros(n_expert, np.float32)
            w.add_tensor(p + "exp_probs_b.bias", bias)
        gate, up = _w(rng, n_expert, n_ff_exp, n_embd, dtype=dtype), _w(rng, n_expert, n_ff_exp, n_embd, dtype=dtype)
        if fused_gate_up:
            w.add_tensor(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))
        else:
            w.add_tensor(p + "ffn_gate_exps.weight", gate)
            w.add_tensor(p + "ffn_up_exps.weight", up)
        w.add_tensor(p + "ffn_down_exps.weight", _w(rng, n_expert, n_embd, n_ff_exp, dtype=dtype))
        w.add_tensor(p + "ffn_gate_shexp.weight", _w(rng, n_ff_exp * n_shared, n_embd, dtype=dtype))
        w.add_tensor(p + "ffn_up_shexp.weight", _w(rng, n_ff_exp * n_shared, n_embd, dtype=dtype))
        w.add_tensor(p + "ffn_down_shexp.weight", _w(rng, n_embd, n_ff_exp * n_shared, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_sparse(path: Path, arch: str, metadata: dict, tensors: list[tuple[str, tuple, int]]) -> Path:
    """A GGUF whose tensor data is a sparse hole: full-size on paper, no disk or time spent.

    For plan-only tests on big shapes.  ``tensors``: (name, ggml shape, type id).
    """
    from quantkit.gguf_io.constants import MetaValue, ValueType, pad_to
    from quantkit.gguf_io.writer import TensorSpec, alignment_of, encode_header
    from quantkit.types import QuantType

    meta = {"general.architecture": MetaValue(ValueType.STRING, arch)}
    for k, v in metadata.items():
        meta[k] = v if isinstance(v, MetaValue) else MetaValue(ValueType.UINT32, v)
    specs = [TensorSpec(n, tuple(s), QuantType(t)) for n, s, t in tensors]
    header, offsets = encode_header(meta, specs)
    size = len(header) + (offsets[-1] + pad_to(specs[-1].nbytes, alignment_of(meta)) if specs else 0)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)
    return path


def deepseek_v3_tensors(n_layer=61, n_dense=3, n_embd=7168, n_ff=18432, n_ff_exp=2048, n_expert=256,
                        n_head=128, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
                        n_vocab=129280, type_id=30, with_kv_b=True) -> list[tuple[str, tuple, int]]:
    """The tensor table of DeepSeek-V3 (671B) as ik_llama.cpp MLA GGUFs store it, BF16 by default.

    ik's converter keeps the fused ``attn_kv_b`` beside the split ``attn_k_b``/``attn_v_b``.
    """
    F32 = 0
    t = [("token_embd.weight", (n_embd, n_vocab), type_id), ("output_norm.weight", (n_embd,), F32),
         ("output.weight", (n_embd, n_vocab), type_id)]
    for i in range(n_layer):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (n_embd,), F32), (p + "attn_q_a_norm.weight", (q_lora,), F32),
              (p + "attn_kv_a_norm.weight", (kv_lora,), F32),
              (p + "attn_q_a.weight", (n_embd, q_lora), type_id),
              (p + "attn_q_b.weight", (q_lora, n_head * (qk_nope + qk_rope)), type_id),
              (p + "attn_kv_a_mqa.weight", (n_embd, kv_lora + qk_rope), type_id),
              *([(p + "attn_kv_b.weight", (kv_lora, n_head * (qk_nope + v_head)), type_id)] if with_kv_b else []),
              (p + "attn_k_b.weight", (qk_nope, kv_lora, n_head), type_id),
              (p + "attn_v_b.weight", (kv_lora, v_head, n_head), type_id),
              (p + "attn_output.weight", (n_head * v_head, n_embd), type_id),
              (p + "ffn_norm.weight", (n_embd,), F32)]
        if i < n_dense:
            t += [(p + "ffn_gate.weight", (n_embd, n_ff), type_id), (p + "ffn_up.weight", (n_embd, n_ff), type_id),
                  (p + "ffn_down.weight", (n_ff, n_embd), type_id)]
        else:
            t += [(p + "ffn_gate_inp.weight", (n_embd, n_expert), F32), (p + "exp_probs_b.bias", (n_expert,), F32),
                  (p + "ffn_gate_exps.weight", (n_embd, n_ff_exp, n_expert), type_id),
                  (p + "ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert), type_id),
                  (p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), type_id),
                  (p + "ffn_gate_shexp.weight", (n_embd, n_ff_exp), type_id),
                  (p + "ffn_up_shexp.weight", (n_embd, n_ff_exp), type_id),
                  (p + "ffn_down_shexp.weight", (n_ff_exp, n_embd), type_id)]
    return t


def rewrite_gguf(src: Path, dst: Path, keys: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with some metadata keys and tensors changed (read and
    written with gguf-py), for crafted-metadata tests.

    ``keys``: {key: value}; None removes the key, a ``(value, gguf.GGUFValueType)`` pair sets the
    type, and otherwise an existing key keeps its type where the value fits it (ints, floats) and a
    new one gets the python value's (int: UINT32, or INT32 when negative; float: FLOAT32; str; bool;
    list: an array of its first element's type).  ``tensors``: {name: float32 array in numpy order
    (rows, row length) or None to remove}; other tensors are copied byte for byte."""
    keys, tensors = dict(keys or {}), dict(tensors or {})
    T = gguf.GGUFValueType
    r = gguf.GGUFReader(str(src))
    fields = {f.name: f for f in r.fields.values() if not f.name.startswith("GGUF.")}

    def infer(v):
        if isinstance(v, bool):
            return T.BOOL
        if isinstance(v, int):
            return T.INT32 if v < 0 else T.UINT32
        if isinstance(v, float):
            return T.FLOAT32
        return T.STRING if isinstance(v, str) else T.ARRAY

    arch = keys.pop("general.architecture", fields["general.architecture"].contents())     # a string
    w = gguf.GGUFWriter(str(dst), arch=arch)
    names = [n for n in fields if n != "general.architecture"] + [n for n in keys if n not in fields]
    for name in names:
        if name not in keys:
            f = fields[name]
            value, vtype = f.contents(), f.types[0]
            sub = f.types[-1] if vtype == T.ARRAY else None
        else:
            value = keys[name]
            if value is None:
                continue
            if isinstance(value, tuple):
                value, vtype = value
            else:
                vtype = _keep_type(fields[name].types[0] if name in fields else None, value, infer(value))
            sub = infer(value[0]) if vtype == T.ARRAY and value else (T.UINT32 if vtype == T.ARRAY else None)
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name in tensors:
            continue
        w.add_tensor(t.name, t.data, raw_shape=[int(n) for n in reversed(t.shape)], raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        if data is not None:
            w.add_tensor(name, np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _keep_type(old, value, inferred):
    """An existing number key's own type for a new number that fits it (a float key stays float,
    an unsigned one takes a negative value as INT32), else the value's inferred type."""
    T = gguf.GGUFValueType
    ints = {T.UINT8, T.UINT16, T.UINT32, T.UINT64, T.INT8, T.INT16, T.INT32, T.INT64}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return inferred
    if old in (T.FLOAT32, T.FLOAT64):
        return old
    if old in ints and isinstance(value, int):
        return T.INT32 if value < 0 and old.name.startswith("UINT") else old
    return inferred


# ---------------------------------------------------------------------------------- 2026 architectures
# Tiny GGUFs of qwen3, qwen3moe, glm4moe, gpt-oss and DeepSeek-V3.2 with the tensor names, shapes, types
# and metadata keys the converters write (ik_llama.cpp's convert_hf_to_gguf.py; mainline's for gpt-oss and
# V3.2), for the quantize rules: the real models' layer counts, expert counts and GQA ratios, with small
# widths.  Tensors come in the order a converted file has them: the checkpoint's (sorted) names, so
# layers 0, 1, 10, 11, … 2, 20, … as a sharded safetensors checkpoint lists them; llama-quantize's
# counters run in that order.  ``sparse=True`` writes the data as a hole (zeros, no disk or time spent):
# enough for plans and the wheel's --dry-run (which reads it only to validate it: its time grows with the
# file's size).  Expert counts default to 16: the rules ask only for >= 4 and >= 8 (ik) or == 8
# (mainline), so 16 steers them as the real 128-384 do, at a fraction of the bytes.
# The MoE writers' ``sparse=False, vocab=True`` make a model the runtime and the wheel compute: random
# data and a minimal tokenizer of ``n_vocab`` tokens (``vocab_size`` then n_vocab), as the MoE imatrix
# tests (tests/test_imatrix_moe.py) use them.

F32_ID, F16_ID, BF16_ID, MXFP4_ID = 0, 1, 30, 39


def _hf_layer_order(n_layer: int) -> list[int]:
    """Layer indices as sorted safetensors names list them (str order)."""
    return sorted(range(n_layer), key=str)


def _write_table(path: Path, arch: str, add_keys, table: list[tuple[str, tuple, int]], *, sparse: bool,
                 seed: int = 0, vocab: int = 0) -> Path:
    """Write ``table`` ((name, ggml shape, type id) in file order) with gguf-py, after the metadata
    ``add_keys(writer)`` adds.  Data: ones for norms, small random values otherwise (MXFP4: random
    nibbles, scales near 2^-6); with ``sparse``, a hole.  ``vocab``: that many tokens of a minimal
    SentencePiece vocabulary (add_spm_vocab), for the runtime and the wheel's loader."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    add_keys(w)
    if vocab:
        add_spm_vocab(w, vocab)
    Q = gguf.GGMLQuantizationType
    names, fused_bias = {row[0] for row in table}, {}
    for name, shape, type_id in table:
        np_shape = tuple(reversed(shape))
        qtype = Q(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * type_size
        if sparse:
            if type_id in (F32_ID, F16_ID):
                w.add_tensor_info(name, np_shape, np.dtype(np.float32 if type_id == F32_ID else np.float16), nbytes)
            else:
                byte_shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
            continue
        if name.endswith("ffn_gate_up_exps.weight"):
            # the gate experts' numbers (and biases), then the up experts': those of the file written
            # split with the same seed, drawn in its order
            half = (np_shape[0], np_shape[1] // 2, np_shape[2])
            has_bias = name[:-len("weight")] + "bias" in names
            gate, gate_b = _random_data(rng, name, half, type_id), _w(rng, *half[:2]) if has_bias else None
            up, up_b = _random_data(rng, name, half, type_id), _w(rng, *half[:2]) if has_bias else None
            data = np.concatenate([gate, up], axis=1)
            if has_bias:        # written with the bias row that follows
                fused_bias[name[:-len("weight")] + "bias"] = np.concatenate([gate_b, up_b], axis=1)
        else:
            data = fused_bias.pop(name) if name in fused_bias else _random_data(rng, name, np_shape, type_id)
        if type_id == MXFP4_ID:
            w.add_tensor(name, data, raw_dtype=qtype)
        elif type_id == BF16_ID:
            bits = (data.view(np.uint32) + 0x8000) >> 16
            w.add_tensor(name, bits.astype(np.uint16), raw_shape=np_shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, data.astype(np.float16) if type_id == F16_ID else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if sparse:
        w.write_ti_data_to_file()
        w.write_padding(w.fout[0], w.fout[0].tell())
        end = w.fout[0].tell() + sum(gguf.GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment)
                                     for ti in w.tensors[0].values())
        w.fout[0].truncate(end)
    else:
        w.write_tensors_to_file()
    w.close()
    return path


def _random_data(rng, name: str, np_shape: tuple, type_id: int) -> np.ndarray:
    """A tensor's data for _write_table: float32 (ones for a norm), or MXFP4 blocks (bytes)."""
    if type_id == MXFP4_ID:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        n_blocks = int(np.prod(np_shape)) // block
        blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
        blocks[:, 0] = rng.integers(118, 124, n_blocks)     # E8M0 scales 2^-9 … 2^-4
        return blocks.reshape(*np_shape[:-1], np_shape[-1] // block * type_size)
    return np.ones(np_shape, np.float32) if name.endswith("norm.weight") else _w(rng, *np_shape)


def _add_common_keys(w, *, n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, vocab_size, rope_dims,
                     rope_base, eps, file_type, context=4096):
    w.add_block_count(n_layer)
    w.add_context_length(context)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dims)
    w.add_vocab_size(vocab_size)
    w.add_file_type(file_type)


def _gqa_attention(p, n_embd, n_head, n_head_kv, head_dim, t, *, bias=False, qk_norm=True):
    """A GQA attention block's tensors in checkpoint order (self_attn.k_norm, k_proj.bias, k_proj.weight,
    o_proj, q_norm, q_proj, v_proj)."""
    q, kv = n_head * head_dim, n_head_kv * head_dim
    rows = [(p + "attn_k_norm.weight", (head_dim,), F32_ID)] if qk_norm else []
    rows += [(p + "attn_k.bias", (kv,), F32_ID)] if bias else []
    rows += [(p + "attn_k.weight", (n_embd, kv), t), (p + "attn_output.weight", (q, n_embd), t)]
    rows += [(p + "attn_q_norm.weight", (head_dim,), F32_ID)] if qk_norm else []
    rows += [(p + "attn_q.bias", (q,), F32_ID)] if bias else []
    rows.append((p + "attn_q.weight", (n_embd, q), t))
    rows += [(p + "attn_v.bias", (kv,), F32_ID)] if bias else []
    return rows + [(p + "attn_v.weight", (n_embd, kv), t)]


def _experts(p, n_embd, n_ff_exp, n_expert, t, *, bias=False, fused=False):
    """Stacked routed experts; ``fused``: gate and up in one ffn_gate_up_exps [n_embd, 2 n_ff_exp, n_expert]
    (what ik's loader merges them into, and files written so)."""
    rows = [(p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), t)]
    rows += [(p + "ffn_down_exps.bias", (n_embd, n_expert), F32_ID)] if bias else []
    if fused:
        rows.append((p + "ffn_gate_up_exps.weight", (n_embd, 2 * n_ff_exp, n_expert), t))
        return rows + ([(p + "ffn_gate_up_exps.bias", (2 * n_ff_exp, n_expert), F32_ID)] if bias else [])
    for which in ("gate", "up"):
        rows.append((p + f"ffn_{which}_exps.weight", (n_embd, n_ff_exp, n_expert), t))
        rows += [(p + f"ffn_{which}_exps.bias", (n_ff_exp, n_expert), F32_ID)] if bias else []
    return rows


def _dense_ffn(p, n_embd, n_ff, t, suffix=""):
    return [(p + f"ffn_down{suffix}.weight", (n_ff, n_embd), t), (p + f"ffn_gate{suffix}.weight", (n_embd, n_ff), t),
            (p + f"ffn_up{suffix}.weight", (n_embd, n_ff), t)]


def _ends(table, n_embd, n_vocab, t, tied):
    """lm_head sorts before model.*, model.norm after the layers."""
    head = [] if tied else [("output.weight", (n_embd, n_vocab), t)]
    return head + [("token_embd.weight", (n_embd, n_vocab), t)] + table + [("output_norm.weight", (n_embd,), F32_ID)]


def write_qwen3(path: Path, n_layer=36, n_embd=256, n_ff=512, n_head=4, n_head_kv=1, head_dim=128, n_vocab=256,
                vocab_size=151936, tied=False, type_id=F16_ID, sparse=True, seed=0) -> Path:
    """Qwen3 (dense): per-head q/k RMSNorm, head_dim 128 whatever the width.  The defaults are Qwen3-8B's
    class to the quantize rules: 36 layers and a width other than 2560 make it MODEL_8B, its vocabulary
    (``qwen3.vocab_size``, 151936) is over 127999, n_gqa = 4; ``tied`` as the 0.6B-4B models.  The
    embedding tables hold only ``n_vocab`` rows (llama-quantize never checks)."""
    table = []
    for i in _hf_layer_order(n_layer):
        p = f"blk.{i}."
        table += [(p + "attn_norm.weight", (n_embd,), F32_ID), *_dense_ffn(p, n_embd, n_ff, type_id),
                  (p + "ffn_norm.weight", (n_embd,), F32_ID),
                  *_gqa_attention(p, n_embd, n_head, n_head_kv, head_dim, type_id)]

    def keys(w):
        _add_common_keys(w, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, vocab_size=vocab_size, rope_dims=head_dim, rope_base=1e6, eps=1e-6,
                         file_type=type_id)
    return _write_table(path, "qwen3", keys, _ends(table, n_embd, n_vocab, type_id, tied), sparse=sparse, seed=seed)


def write_qwen3moe(path: Path, n_layer=48, n_embd=256, n_ff=768, n_ff_exp=256, n_expert=16, n_expert_used=8,
                   n_head=8, n_head_kv=1, head_dim=128, n_vocab=256, vocab_size=151936, type_id=F16_ID,
                   fused_gate_up=False, sparse=True, seed=0, vocab=False) -> Path:
    """Qwen3-MoE, Qwen3-30B-A3B's class: 48 layers (94: 235B-A22B), 128 experts (16 by default, see
    above), every layer MoE, no shared expert, n_gqa = 8 (235B: 16), q/k norms; ``fused_gate_up``:
    ffn_gate_up_exps."""
    vocab_size = n_vocab if vocab else vocab_size
    table = []
    for i in _hf_layer_order(n_layer):
        p = f"blk.{i}."
        table += [(p + "attn_norm.weight", (n_embd,), F32_ID),
                  *_experts(p, n_embd, n_ff_exp, n_expert, type_id, fused=fused_gate_up),
                  (p + "ffn_gate_inp.weight", (n_embd, n_expert), F32_ID),
                  (p + "ffn_norm.weight", (n_embd,), F32_ID),
                  *_gqa_attention(p, n_embd, n_head, n_head_kv, head_dim, type_id)]

    def keys(w):
        _add_common_keys(w, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, vocab_size=vocab_size, rope_dims=head_dim, rope_base=1e6, eps=1e-6,
                         file_type=type_id)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
    return _write_table(path, "qwen3moe", keys, _ends(table, n_embd, n_vocab, type_id, False), sparse=sparse,
                        seed=seed, vocab=n_vocab if vocab else 0)


def write_glm4moe(path: Path, n_layer=46, n_dense=1, nextn=1, n_embd=256, n_ff=512, n_ff_exp=256, n_expert=16,
                  n_expert_used=8, n_shared=1, n_head=12, n_head_kv=1, head_dim=128, n_vocab=256,
                  vocab_size=151552, qk_norm=False, type_id=F16_ID, sparse=True, seed=0, vocab=False) -> Path:
    """GLM-4.5-Air's class (glm4moe): ``n_layer`` layers, the first ``n_dense`` dense, then routed experts
    (128 in the real model, 16 by default; sigmoid gate with exp_probs_b) and a shared expert; attention
    with q/k/v biases (``qk_norm``: GLM-4.5's q/k norms), half-rotary heads, n_gqa = 12; and ``nextn``
    NextN/MTP layers after them, which ik's converter keeps (block_count counts them) with their nextn.*
    tensors.  GLM-4.5: 92 + 1 layers, 160 experts, 3 dense."""
    vocab_size = n_vocab if vocab else vocab_size
    n_total = n_layer + nextn
    table = []
    for i in _hf_layer_order(n_total):
        p = f"blk.{i}."
        # model.layers.N.{eh_proj, embed_tokens, enorm, hnorm} sort before input_layernorm, shared_head.* last
        rows = [(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd), type_id),
                (p + "nextn.embed_tokens.weight", (n_embd, n_vocab), type_id),
                (p + "nextn.enorm.weight", (n_embd,), F32_ID),
                (p + "nextn.hnorm.weight", (n_embd,), F32_ID)] if i >= n_layer else []
        rows.append((p + "attn_norm.weight", (n_embd,), F32_ID))
        if i < n_dense:
            rows += _dense_ffn(p, n_embd, n_ff, type_id)
        else:
            # mlp.experts.* (stacked when the last one is read), mlp.gate.{e_score_correction_bias, weight},
            # mlp.shared_experts.*
            rows += [*_experts(p, n_embd, n_ff_exp, n_expert, type_id),
                     (p + "exp_probs_b.bias", (n_expert,), F32_ID),
                     (p + "ffn_gate_inp.weight", (n_embd, n_expert), F32_ID),
                     *_dense_ffn(p, n_embd, n_ff_exp * n_shared, type_id, "_shexp")]
        rows += [(p + "post_attention_norm.weight", (n_embd,), F32_ID),
                 *_gqa_attention(p, n_embd, n_head, n_head_kv, head_dim, type_id, bias=True, qk_norm=qk_norm)]
        if i >= n_layer:
            rows += [(p + "nextn.shared_head_head.weight", (n_embd, n_vocab), type_id),
                     (p + "nextn.shared_head_norm.weight", (n_embd,), F32_ID)]
        table += rows

    def keys(w):
        _add_common_keys(w, n_layer=n_total, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, vocab_size=vocab_size, rope_dims=head_dim // 2, rope_base=1e6,
                         eps=1e-5, file_type=type_id)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_shared_count(n_shared)
        w.add_leading_dense_block_count(n_dense)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_uint32("glm4moe.nextn_predict_layers", nextn)
    return _write_table(path, "glm4moe", keys, _ends(table, n_embd, n_vocab, type_id, False), sparse=sparse,
                        seed=seed, vocab=n_vocab if vocab else 0)


def write_gptoss(path: Path, n_layer=24, n_embd=320, n_ff_exp=320, n_expert=32, n_expert_used=4, n_head=8,
                 n_head_kv=1, head_dim=64, n_vocab=256, vocab_size=201088, sliding_window=128, type_id=F16_ID,
                 expert_type_id=MXFP4_ID, fused_gate_up=False, sparse=True, seed=0, vocab=False) -> Path:
    """gpt-oss-20b's class (gpt-oss, ik's OPENAI_MOE): 24 layers (120b: 36) of 32 experts (120b: 128) stored
    MXFP4 as the checkpoint has them, with biases on everything, attention sinks, n_gqa = 8.  The width
    (2880 in the real models, 320 here) is a multiple of 64 and not of 128 or 256: every 256-block type falls
    back on the rows that long, as on the real model, and the 64-block ones (iq1_bn) fit.  ``fused_gate_up``:
    ffn_gate_up_exps (and its bias: each expert's gate biases, then its up biases), which ik_llama.cpp's
    loader takes at 8337e4cd (the wheel's llama-quantize reads it, its older loader refuses it)."""
    vocab_size = n_vocab if vocab else vocab_size
    table = []
    for i in _hf_layer_order(n_layer):
        p = f"blk.{i}."
        q, kv = n_head * head_dim, n_head_kv * head_dim
        table += [(p + "attn_norm.weight", (n_embd,), F32_ID),
                  *_experts(p, n_embd, n_ff_exp, n_expert, expert_type_id, bias=True, fused=fused_gate_up),
                  (p + "ffn_gate_inp.bias", (n_expert,), F32_ID),
                  (p + "ffn_gate_inp.weight", (n_embd, n_expert), F32_ID),
                  (p + "post_attention_norm.weight", (n_embd,), F32_ID),
                  (p + "attn_k.bias", (kv,), F32_ID), (p + "attn_k.weight", (n_embd, kv), type_id),
                  (p + "attn_output.bias", (n_embd,), F32_ID), (p + "attn_output.weight", (q, n_embd), type_id),
                  (p + "attn_q.bias", (q,), F32_ID), (p + "attn_q.weight", (n_embd, q), type_id),
                  (p + "attn_sinks.weight", (n_head,), F32_ID),
                  (p + "attn_v.bias", (kv,), F32_ID), (p + "attn_v.weight", (n_embd, kv), type_id)]

    def keys(w):
        _add_common_keys(w, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff_exp, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, vocab_size=vocab_size, rope_dims=head_dim, rope_base=150000.0,
                         eps=1e-5, file_type=type_id, context=131072)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_sliding_window(sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    return _write_table(path, "gpt-oss", keys, _ends(table, n_embd, n_vocab, type_id, False), sparse=sparse,
                        seed=seed, vocab=n_vocab if vocab else 0)


# a DeepSeek layer's tensors in the order of their checkpoint names (input_layernorm, mlp.experts.* stacked
# when the last is read, mlp.gate.*, mlp.shared_experts.*, post_attention_layernorm, self_attn.indexer.{k_norm,
# weights_proj, wk, wq_b}, kv_a_layernorm, kv_a_proj_with_mqa, kv_b_proj (split), o_proj, q_a_layernorm, q_a_proj,
# q_b_proj), as a converted file lists them
_DEEPSEEK_HF_ORDER = [
    "attn_norm.weight", "ffn_down.weight", "ffn_gate.weight", "ffn_up.weight",
    "ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "exp_probs_b.bias", "ffn_gate_inp.weight",
    "ffn_down_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_norm.weight",
    "indexer.k_norm.bias", "indexer.k_norm.weight", "indexer.proj.weight", "indexer.attn_k.weight",
    "indexer.attn_q_b.weight", "attn_kv_a_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_b.weight",
    "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight", "attn_q_a_norm.weight", "attn_q_a.weight",
    "attn_q_b.weight"]


def write_deepseek32(path: Path, n_layer=61, n_dense=3, n_embd=256, n_ff=512, n_ff_exp=256, n_expert=16,
                     n_expert_used=8, n_head=8, q_lora=256, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
                     n_vocab=256, vocab_size=129280, index_n_heads=64, index_head_dim=128, index_topk=2048,
                     n_group=8, n_group_used=4, type_id=F16_ID, sparse=True, seed=0, vocab=False) -> Path:
    """DeepSeek-V3.2 (deepseek2 with the DSA lightning indexer), as mainline's converter writes it: MLA in
    the mainline layout (one KV head, 3-D attn_k_b/attn_v_b, no attn_kv_b), 61 layers of which 3 dense,
    256 experts (16 by default) in 8 groups, one shared, and per layer
    blk.N.indexer.{attn_q_b, attn_k, k_norm, proj} with the attention.indexer.* keys.  Kimi-K2 is the same
    without the indexer: ``index_n_heads=0``, 384 experts, 1 dense layer, one group, vocab 163840.
    ``n_head`` stays a multiple of 4 and the head sizes DeepSeek's: ik converts mainline MLA files only
    then."""
    vocab_size = n_vocab if vocab else vocab_size
    base = deepseek_v3_tensors(n_layer=n_layer, n_dense=n_dense, n_embd=n_embd, n_ff=n_ff, n_ff_exp=n_ff_exp,
                               n_expert=n_expert, n_head=n_head, q_lora=q_lora, kv_lora=kv_lora, qk_nope=qk_nope,
                               qk_rope=qk_rope, v_head=v_head, n_vocab=n_vocab, type_id=type_id, with_kv_b=False)
    rows = {}
    for name, shape, t in base:
        rows.setdefault(layer_of_name(name), []).append((name, shape, t))
    ends = rows.pop(None)
    table = [r for r in ends if r[0] != "output_norm.weight"]
    for i in _hf_layer_order(n_layer):
        p = f"blk.{i}."
        layer = rows[i]
        if index_n_heads:
            layer += [(p + "indexer.k_norm.bias", (index_head_dim,), F32_ID),
                      (p + "indexer.k_norm.weight", (index_head_dim,), F32_ID),
                      (p + "indexer.proj.weight", (n_embd, index_n_heads), type_id),
                      (p + "indexer.attn_k.weight", (n_embd, index_head_dim), type_id),
                      (p + "indexer.attn_q_b.weight", (q_lora, index_n_heads * index_head_dim), type_id)]
        table += sorted(layer, key=lambda r: _DEEPSEEK_HF_ORDER.index(r[0][len(p):]))
    table += [r for r in ends if r[0] == "output_norm.weight"]
    def keys(w):
        a = "deepseek2"
        w.add_block_count(n_layer)
        w.add_context_length(163840)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_used_count(n_expert_used)
        w.add_vocab_size(vocab_size)
        w.add_uint32(f"{a}.leading_dense_block_count", n_dense)
        w.add_uint32(f"{a}.attention.q_lora_rank", q_lora)
        w.add_uint32(f"{a}.attention.kv_lora_rank", kv_lora)
        w.add_uint32(f"{a}.attention.key_length", kv_lora + qk_rope)
        w.add_uint32(f"{a}.attention.value_length", kv_lora)
        w.add_uint32(f"{a}.attention.key_length_mla", qk_nope + qk_rope)
        w.add_uint32(f"{a}.attention.value_length_mla", v_head)
        w.add_uint32(f"{a}.expert_feed_forward_length", n_ff_exp)
        w.add_uint32(f"{a}.expert_count", n_expert)
        w.add_uint32(f"{a}.expert_shared_count", 1)
        w.add_float32(f"{a}.expert_weights_scale", 2.5)
        w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 2)
        w.add_uint32(f"{a}.expert_group_count", n_group)
        w.add_uint32(f"{a}.expert_group_used_count", n_group_used)
        w.add_uint32(f"{a}.rope.dimension_count", qk_rope)
        if index_n_heads:
            w.add_uint32(f"{a}.attention.indexer.head_count", index_n_heads)
            w.add_uint32(f"{a}.attention.indexer.key_length", index_head_dim)
            w.add_uint32(f"{a}.attention.indexer.top_k", index_topk)
        w.add_file_type(type_id)
    return _write_table(path, "deepseek2", keys, table, sparse=sparse, seed=seed, vocab=n_vocab if vocab else 0)


def layer_of_name(name: str) -> int | None:
    """N of a ``blk.N.`` tensor name, else None."""
    return int(name.split(".")[1]) if name.startswith("blk.") else None
