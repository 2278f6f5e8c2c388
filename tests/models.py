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
