"""Tiny Hugging Face checkpoints for the conversion tests, saved by transformers itself (and one
written directly, for the hostile-input tests, which need a valid directory to break and no torch).

The tokenizer is SmolLM2's, rebuilt with the ``tokenizers`` library from the vocabulary, merges and
special tokens of the shipped SmolLM2 GGUF (which convert_hf_to_gguf.py made from the original
tokenizer.json): so converting it back must give that GGUF's tokenizer arrays exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONTROL = 3


def smollm2_tokenizer_meta(smollm2: Path) -> dict:
    from quantkit.gguf_io.reader import open_model
    with open_model(smollm2) as m:
        return {k: m.get(k) for k in m.metadata if k.startswith("tokenizer.")}


def write_tokenizer(directory: Path, meta: dict, *, merges_as_pairs: bool = False) -> None:
    """tokenizer.json (byte-level BPE with SmolLM's digit split) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = meta["tokenizer.ggml.tokens"], list(meta["tokenizer.ggml.token_type"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.save(str(directory / "tokenizer.json"))
    if not merges_as_pairs:     # the older "a b" string format the original file has
        doc = json.loads((directory / "tokenizer.json").read_text())
        doc["model"]["merges"] = [" ".join(p) for p in doc["model"]["merges"]]
        (directory / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    bos, eos = (tokens[meta[f"tokenizer.ggml.{s}_token_id"]] for s in ("bos", "eos"))
    config = {"bos_token": bos, "eos_token": eos, "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]]
              if "tokenizer.ggml.unknown_token_id" in meta else None,
              "clean_up_tokenization_spaces": False, "model_max_length": 8192,
              "tokenizer_class": "GPT2Tokenizer"}
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token"] = tokens[meta["tokenizer.ggml.padding_token_id"]]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))


def write_tiny_llama(directory: Path, *, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=64,
                     tie=False) -> Path:
    """A minimal valid LlamaForCausalLM directory written with numpy and json alone: random F32
    weights in model.safetensors, config.json, and a byte-level BPE tokenizer (tokenizer.json of
    ``n_vocab`` single characters, no merges; tokenizer_config.json)."""
    from safetensors.numpy import save_file
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {chr(0x21 + i): i for i in range(n_vocab)}
    (directory / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "added_tokens": [], "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                                "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": False,
                                                                 "bos_token": "!", "eos_token": "\""}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": n_embd, "intermediate_size": n_ff,
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
        "max_position_embeddings": 128, "vocab_size": n_vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie}, indent=1))
    head = n_embd // n_head
    shapes = {"model.embed_tokens.weight": (n_vocab, n_embd), "model.norm.weight": (n_embd,)}
    if not tie:
        shapes["lm_head.weight"] = (n_vocab, n_embd)
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (n_embd,), p + "post_attention_layernorm.weight": (n_embd,),
                       p + "self_attn.q_proj.weight": (n_head * head, n_embd),
                       p + "self_attn.k_proj.weight": (n_head_kv * head, n_embd),
                       p + "self_attn.v_proj.weight": (n_head_kv * head, n_embd),
                       p + "self_attn.o_proj.weight": (n_embd, n_head * head),
                       p + "mlp.gate_proj.weight": (n_ff, n_embd), p + "mlp.up_proj.weight": (n_ff, n_embd),
                       p + "mlp.down_proj.weight": (n_embd, n_ff)})
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()},
              str(directory / "model.safetensors"))
    return directory


def save_llama(directory: Path, tok_meta: dict, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
               tie=False, rope_scaling=None, dtype="float32", seed=0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    n_vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer,
                      num_attention_heads=n_head, num_key_value_heads=n_head_kv, max_position_embeddings=2048,
                      tie_word_embeddings=tie, rms_norm_eps=1e-5, bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                      eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"], rope_theta=100000.0,
                      rope_scaling=rope_scaling)
    model = LlamaForCausalLM(cfg).eval()
    _spread_weights(model)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def save_deepseek_v3(directory: Path, tok_meta: dict, *, n_layer=3, n_dense=1, n_embd=64, n_head=4, n_ff=128,
                     n_ff_exp=32, n_expert=4, n_used=2, n_shared=1, q_lora=32, kv_lora=16, qk_nope=16, qk_rope=8,
                     v_head=16, dtype="float32", rope_scaling=None, n_ctx=2048, seed=0) -> Path:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    n_vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg = DeepseekV3Config(vocab_size=n_vocab, hidden_size=n_embd, intermediate_size=n_ff,
                           moe_intermediate_size=n_ff_exp, num_hidden_layers=n_layer, first_k_dense_replace=n_dense,
                           num_attention_heads=n_head, num_key_value_heads=n_head, n_routed_experts=n_expert,
                           n_shared_experts=n_shared, num_experts_per_tok=n_used, n_group=1, topk_group=1,
                           q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_rope_head_dim=qk_rope,
                           qk_nope_head_dim=qk_nope, v_head_dim=v_head, max_position_embeddings=n_ctx,
                           rope_scaling=rope_scaling, bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                           eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = DeepseekV3ForCausalLM(cfg).eval()
    _spread_weights(model)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def save_deepseek_v32(directory: Path, tok_meta: dict, *, n_layer=3, n_dense=1, index_topk=16, index_n_heads=8,
                      index_head_dim=16, n_group=2, topk_group=1, attn_out_gain=1.0, seed=0) -> Path:
    """A tiny DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3's shape plus the DSA indexer in every
    layer, with a small ``index_topk`` so that short prompts exceed it; group-limited routing.
    ``attn_out_gain`` scales o_proj: below 1 the attention's share of the residual stream, and with it
    how much a random network amplifies the rounding of an f16 cache, is smaller."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    torch.manual_seed(seed)
    cfg = DeepseekV32Config(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=n_layer, first_k_dense_replace=n_dense,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, q_lora_rank=32,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            index_topk=index_topk, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
                            max_position_embeddings=2048, bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                            eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = DeepseekV32ForCausalLM(cfg).eval()
    _spread_weights(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_out_gain)
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def save_deepseek_v2_lite(directory: Path, tok_meta: dict, *, n_layer=27, seed=0) -> Path:
    """DeepSeek-V2-Lite's shape in miniature: queries without a LoRA (attn_q), softmax routing without
    normalisation, two shared experts.  27 layers: ik_llama.cpp takes q_lora_rank = 0 only from
    V2-Lite's 26/27-layer files."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=n_layer, first_k_dense_replace=1,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
                           num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, head_dim=8, max_position_embeddings=2048,
                           topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
                           bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                           eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = DeepseekV2ForCausalLM(cfg).eval()
    _spread_weights(model)
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def _spread_weights(model, seed: int = 1) -> None:
    """Random weights large enough that a few layers change the logits visibly (transformers'
    initialisation is 0.02-scaled, which leaves a tiny model close to its embeddings), and random
    router biases."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def hf_logits(directory: Path, tokens: list[int]) -> np.ndarray:
    """All-position logits (n_tokens, n_vocab) of a saved checkpoint, computed by transformers in f32."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


FP8_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")     # DeepSeek keeps these in BF16


def save_fp8_pair(src: Path, fp8_dir: Path, bf16_dir: Path) -> None:
    """DeepSeek's FP8 format made from a saved checkpoint: each linear weight as float8_e4m3fn with a
    float32 ``weight_scale_inv`` per 128 x 128 block (amax / 448, DeepSeek's recipe), everything else
    BF16; and its BF16 twin, dequantized the way DeepSeek's fp8_cast_bf16.py does it (fp8 * scale in
    float32, rounded to bfloat16)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(src / "model.safetensors"))
    fp8, twin = {}, {}
    for name, w in tensors.items():
        w = w.float()
        if w.ndim != 2 or any(k in name for k in FP8_KEEP):
            fp8[name] = twin[name] = w.to(torch.bfloat16)
            continue
        rows, cols = w.shape
        br, bc = -(-rows // 128), -(-cols // 128)
        padded = torch.zeros(br * 128, bc * 128)
        padded[:rows, :cols] = w
        amax = padded.view(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = (amax / 448.0).float()
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale.contiguous()
        twin[name] = (q.float() * full).to(torch.bfloat16)
    for d, data in ((fp8_dir, fp8), (bf16_dir, twin)):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        save_file(data, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=1))


# gpt-oss's FP4 (E2M1) values by code, as transformers' MXFP4 dequantization has them
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def random_mxfp4(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random MXFP4 weights of shape (..., rows, cols) in HF's quantized layout: blocks (..., rows,
    cols / 32, 16) uint8, byte k of a block holding weights 2k (low nibble) and 2k + 1 (high), and
    E8M0 scales (..., rows, cols / 32); with the float32 values they mean."""
    *lead, cols = shape
    codes = rng.integers(0, 16, (*lead, cols // 32, 32), dtype=np.uint8)
    scales = rng.integers(121, 125, (*lead, cols // 32), dtype=np.uint8)
    values = FP4_VALUES[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales, values.reshape(shape).astype(np.float32)


def save_gptoss(directory: Path, tok_meta: dict, *, n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                n_ff=64, n_expert=4, n_used=2, window=8, rope_scaling=None, seed=0) -> tuple[Path, Path]:
    """A GptOssForCausalLM saved by transformers (float32) whose expert weights are MXFP4 values,
    and its twin ``<directory>-mxfp4`` with the experts in HF's quantized layout
    (``*_blocks``/``*_scales`` and ``quantization_config.quant_method: mxfp4``), everything else
    the same: (float dir, mxfp4 dir)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    rope = rope_scaling or {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": True, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    cfg = GptOssConfig(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=n_embd, intermediate_size=n_ff,
                       num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head_kv,
                       head_dim=head_dim, num_local_experts=n_expert, num_experts_per_tok=n_used,
                       sliding_window=window, max_position_embeddings=256, rope_parameters=rope,
                       bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                       eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = GptOssForCausalLM(cfg).eval()
    _spread_weights(model)
    rng = np.random.default_rng(seed)
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(n_head))
            for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias,
                      layer.self_attn.o_proj.bias, layer.mlp.router.bias):
                p.copy_(0.3 * torch.randn(p.shape))
            ex = layer.mlp.experts
            ex.gate_up_proj_bias.copy_(0.3 * torch.randn(ex.gate_up_proj_bias.shape))
            ex.down_proj_bias.copy_(0.3 * torch.randn(ex.down_proj_bias.shape))
            # MXFP4 stores the experts output-major: gate_up (n_expert, 2 n_ff, n_embd),
            # down (n_expert, n_embd, n_ff); the float parameters are input-major
            for name, shape in (("gate_up_proj", (n_expert, 2 * n_ff, n_embd)),
                                ("down_proj", (n_expert, n_embd, n_ff))):
                blocks, scales, values = random_mxfp4(rng, shape)
                getattr(ex, name).copy_(torch.from_numpy(values).transpose(1, 2))
                pre = f"model.layers.{i}.mlp.experts.{name}"
                quantized[pre + "_blocks"] = torch.from_numpy(blocks)
                quantized[pre + "_scales"] = torch.from_numpy(scales)
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    twin = directory.with_name(directory.name + "-mxfp4")
    shutil.copytree(directory, twin)
    tensors = {k: v for k, v in load_file(str(twin / "model.safetensors")).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    tensors.update(quantized)
    save_file(tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((twin / "config.json").read_text())
    doc["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (twin / "config.json").write_text(json.dumps(doc, indent=1))
    return directory, twin


def save_qwen3(directory: Path, tok_meta: dict, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
               n_ff=96, tie=False, seed=0) -> Path:
    """Qwen3ForCausalLM: q/k norms, head_dim set apart from n_embd / n_head (as Qwen3 does)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=n_embd, intermediate_size=n_ff,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head_kv,
                      head_dim=head_dim, max_position_embeddings=2048, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                      eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = Qwen3ForCausalLM(cfg).eval()
    _spread_weights(model)
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def save_qwen3moe(directory: Path, tok_meta: dict, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff_exp=32, n_expert=8, n_used=3, norm=True, seed=0) -> Path:
    """Qwen3MoeForCausalLM: q/k norms, softmax routing over n_expert experts in every layer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=n_embd, intermediate_size=96,
                         moe_intermediate_size=n_ff_exp, num_hidden_layers=n_layer, num_attention_heads=n_head,
                         num_key_value_heads=n_head_kv, head_dim=head_dim, num_experts=n_expert,
                         num_experts_per_tok=n_used, norm_topk_prob=norm, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                         eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = Qwen3MoeForCausalLM(cfg).eval()
    _spread_weights(model)
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


def save_glm4moe(directory: Path, tok_meta: dict, *, n_layer=3, n_dense=1, n_embd=64, n_head=4, n_head_kv=2,
                 head_dim=32, n_ff=96, n_ff_exp=32, n_expert=8, n_used=3, n_shared=1, n_group=1, topk_group=1,
                 qk_norm=True, scale=2.5, seed=0) -> Path:
    """Glm4MoeForCausalLM: attention biases, partial (half) NEOX rope, optional q/k norms, dense lead
    layers, sigmoid routing with e_score_correction_bias, expert groups, a shared expert."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Glm4MoeConfig(vocab_size=len(tok_meta["tokenizer.ggml.tokens"]), hidden_size=n_embd, intermediate_size=n_ff,
                        moe_intermediate_size=n_ff_exp, num_hidden_layers=n_layer, num_attention_heads=n_head,
                        num_key_value_heads=n_head_kv, head_dim=head_dim, n_routed_experts=n_expert,
                        num_experts_per_tok=n_used, n_shared_experts=n_shared, first_k_dense_replace=n_dense,
                        n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=True,
                        use_qk_norm=qk_norm, attention_bias=True, partial_rotary_factor=0.5,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                        bos_token_id=tok_meta["tokenizer.ggml.bos_token_id"],
                        eos_token_id=tok_meta["tokenizer.ggml.eos_token_id"])
    model = Glm4MoeForCausalLM(cfg).eval()
    _spread_weights(model)
    with torch.no_grad():           # attention biases that matter (the default initialisation zeroes them)
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(directory)
    write_tokenizer(directory, tok_meta)
    return directory


# A GLM-4.5 MTP layer's own tensors (model.layers.N.<name>), their shapes from (n_embd, n_vocab)
GLM_MTP_TENSORS = {"eh_proj.weight": lambda e, v: (e, 2 * e), "embed_tokens.weight": lambda e, v: (v, e),
                   "enorm.weight": lambda e, v: (e,), "hnorm.weight": lambda e, v: (e,),
                   "shared_head.head.weight": lambda e, v: (v, e), "shared_head.norm.weight": lambda e, v: (e,)}


def append_glm_mtp_layer(directory: Path, *, omit=(), seed=3) -> dict:
    """Add to a save_glm4moe checkpoint the nextn (MTP) layer the released GLM checkpoints store after
    the last block (transformers does not build it): model.layers.{num_hidden_layers}. with a MoE
    block's self_attn/mlp/norm tensors (random, shaped like the last block's) and eh_proj, enorm,
    hnorm, shared_head.{head,norm}, embed_tokens (less ``omit``), in a shard of its own,
    model_mtp.safetensors (read with model.safetensors: there is no index); config.json gets
    num_nextn_predict_layers 1.  Returns the tensors added."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    cfg = json.loads((directory / "config.json").read_text())
    n_layer, n_embd, n_vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n_layer - 1}.", f"model.layers.{n_layer}."
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys() if n.startswith(last)}
    added = {mtp + n[len(last):]: 0.05 * torch.randn(shape, generator=g) for n, shape in shapes.items()}
    added.update({mtp + n: 0.05 * torch.randn(shape(n_embd, n_vocab), generator=g)
                  for n, shape in GLM_MTP_TENSORS.items() if n not in omit})
    save_file(added, str(directory / "model_mtp.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return added
