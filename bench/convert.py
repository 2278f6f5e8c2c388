"""Benchmark: Hugging Face checkpoint -> quantized GGUF in one step, beside convert-then-quantize.

A Llama-shaped BF16 checkpoint (random weights, sharded safetensors with an index, SmolLM2's
tokenizer) is written once, then turned into a TYPE GGUF three ways, each a child process timed
with its peak RSS (os.wait4):

* one step:   quantkit quantize HF_DIR out.gguf TYPE
* two steps:  quantkit quantize HF_DIR bf16.gguf bf16 (the convert step; what convert_hf_to_gguf.py
              --outtype bf16 writes), then llama-quantize (ik_llama.cpp's wheel) or quantkit on it

With --fp8 the checkpoint's projections are DeepSeek-style FP8 with 128x128 block scales, and the
steps start with DeepSeek's fp8_cast_bf16.py (re-enacted with torch). The one-step and quantkit
step-by-step outputs are checked to be byte-identical.

    python bench/convert.py [--type Q4_K_M] [--hidden 2048] [--layers 12] [--threads 2] [--fp8]
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile
from pathlib import Path

from quantize import REPO, llama_quantize, run


def to_fp8(w):
    """DeepSeek's FP8 storage of a weight: float8_e4m3fn and a float32 scale per 128 x 128 block."""
    import torch
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = w.float()
    scale = (padded.view(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0).float()
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), scale.contiguous()


def cast_fp8_to_bf16(src: Path, dst: Path) -> None:
    """What DeepSeek's inference/fp8_cast_bf16.py does (the first of today's three steps): every
    shard loaded, each FP8 weight times its block scales in float32, stored as BF16."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        t = load_file(str(f))
        out = {}
        for name, w in t.items():
            if name.endswith("_scale_inv"):
                continue
            if w.dtype == torch.float8_e4m3fn:
                s = t[name + "_scale_inv"]
                full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
                w = (w.float() * full).to(torch.bfloat16)
            out[name] = w
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update({n: f.name for n in out})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_checkpoint(d: Path, hidden: int, layers: int, ff: int, fp8: bool = False,
                    shard_bytes: int = 1 << 30) -> int:
    """A LlamaForCausalLM directory, BF16 or with DeepSeek-style FP8 projections; returns the bytes
    of its weights."""
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, str(REPO / "tests"))
    import hf_models
    from conftest import smollm2_file
    meta = hf_models.smollm2_tokenizer_meta(smollm2_file())
    n_vocab, n_head = len(meta["tokenizer.ggml.tokens"]), hidden // 64
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(n_vocab, hidden), "model.norm.weight": torch.ones(hidden).bfloat16(),
               "lm_head.weight": w(n_vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
                        p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
                        p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(hidden, hidden),
                        p + "self_attn.v_proj.weight": w(hidden, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                        p + "mlp.gate_proj.weight": w(ff, hidden), p + "mlp.up_proj.weight": w(ff, hidden),
                        p + "mlp.down_proj.weight": w(hidden, ff)})
    if fp8:
        for name in [n for n, t in tensors.items() if t.ndim == 2 and ".layers." in n]:
            tensors[name], tensors[name + "_scale_inv"] = to_fp8(tensors[name])
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        if cur and size + t.numel() * t.element_size() > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * t.element_size()
    shards.append(cur)
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": n_head,
        "num_key_value_heads": n_head, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "vocab_size": n_vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        **({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}} if fp8 else {})}))
    hf_models.write_tokenizer(d, meta)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp8", action="store_true", help="an FP8 checkpoint (DeepSeek's format): today's route "
                    "starts with fp8_cast_bf16.py")
    args = ap.parse_args()
    lq = llama_quantize()
    qk = [sys.executable, "-m", "quantkit", "quantize"]
    t = str(args.threads)
    py = f"import sys; sys.path[:0] = [{str(REPO / 'bench')!r}]\nfrom pathlib import Path\nfrom convert import *\n"
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        hf = d / "hf"
        gen = py + f"print(make_checkpoint(Path({str(hf)!r}), {args.hidden}, {args.layers}, {args.ff}, {args.fp8}))"
        weight_bytes = int(run([sys.executable, "-c", gen])[2].split()[-1])
        print(f"checkpoint: {weight_bytes / 1e9:.2f} GB of {'FP8 + BF16' if args.fp8 else 'BF16'} weights in "
              f"{len(list(hf.glob('*.safetensors')))} shards -> {args.type}, {args.threads} threads")
        print(f"{'route':58} {'wall s':>8} {'peak RSS MB':>12}")

        def step(label, cmd):
            os.sync()
            wall, rss, _ = run(cmd)
            print(f"{label:58} {wall:8.1f} {rss / 1e6:12.0f}", flush=True)
            return wall, rss

        one = d / "one.gguf"
        w1, r1 = step("one step: quantkit quantize HF_DIR", qk + [str(hf), str(one), args.type, "--threads", t])
        w0, r0, bf16_dir = 0.0, 0, hf
        if args.fp8:
            bf16_dir = d / "cast" / "hf"          # the same directory name: general.name is equal
            bf16_dir.parent.mkdir()
            w0, r0 = step("step 0: fp8_cast_bf16 (DeepSeek's script, torch)",
                          [sys.executable, "-c", py + f"cast_fp8_to_bf16(Path({str(hf)!r}), Path({str(bf16_dir)!r}))"])
        bf16 = d / "bf16.gguf"
        wc, rc = step("step 1: quantkit quantize HF_DIR -> bf16 GGUF (convert)",
                      qk + [str(bf16_dir), str(bf16), "bf16", "--threads", t])
        two = d / "two.gguf"
        wq, rq = step("step 2a: quantkit quantize bf16 GGUF", qk + [str(bf16), str(two), args.type, "--threads", t])
        lqo = d / "lq.gguf"
        wl, rl = step("step 2b: llama-quantize bf16 GGUF (ik wheel)", [lq, str(bf16), str(lqo), args.type, t])
        same = filecmp.cmp(one, two, shallow=False)
        disk = bf16.stat().st_size + (sum(f.stat().st_size for f in bf16_dir.iterdir()) if args.fp8 else 0)
        print(f"\n{'cast + ' if args.fp8 else ''}convert + llama-quantize: {w0 + wc + wl:.1f} s, peak "
              f"{max(r0, rc, rl) / 1e6:.0f} MB, {disk / 1e9:.2f} GB of intermediate files")
        print(f"{'cast + ' if args.fp8 else ''}convert + quantkit:       {w0 + wc + wq:.1f} s, peak "
              f"{max(r0, rc, rq) / 1e6:.0f} MB")
        print(f"one step:                            {w1:.1f} s, peak {r1 / 1e6:.0f} MB, no intermediate file "
              f"({(w0 + wc + wl) / w1:.2f}x faster than {'cast + ' if args.fp8 else ''}convert + llama-quantize)")
        print(f"one-step output == the output of the steps (quantkit): {same}")


if __name__ == "__main__":
    main()
