"""Benchmark: Hugging Face checkpoint -> quantized GGUF in one step, beside convert-then-quantize.

A Llama-shaped BF16 checkpoint (random weights, sharded safetensors with an index, SmolLM2's
tokenizer) is written once, then turned into a TYPE GGUF three ways, each a child process timed
with its peak RSS (os.wait4):

* one step:   quantkit quantize HF_DIR out.gguf TYPE
* two steps:  quantkit quantize HF_DIR bf16.gguf bf16 (the convert step; what convert_hf_to_gguf.py
              --outtype bf16 writes), then llama-quantize (ik_llama.cpp's wheel) or quantkit on it

The one-step and quantkit two-step outputs are checked to be byte-identical.

    python bench/convert.py [--type Q4_K_M] [--hidden 2048] [--layers 12] [--threads 2]
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


def make_checkpoint(d: Path, hidden: int, layers: int, ff: int, shard_bytes: int = 1 << 30) -> int:
    """A BF16 LlamaForCausalLM directory; returns its weight bytes."""
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
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        if cur and size + t.numel() * 2 > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * 2
    shards.append(cur)
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * 2 for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": n_head,
        "num_key_value_heads": n_head, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "vocab_size": n_vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    hf_models.write_tokenizer(d, meta)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    lq = llama_quantize()
    qk = [sys.executable, "-m", "quantkit", "quantize"]
    t = str(args.threads)
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        d = Path(d)
        hf = d / "hf"
        gen = (f"import sys; sys.path[:0] = [{str(REPO / 'bench')!r}]\nfrom pathlib import Path\n"
               f"from convert import make_checkpoint\n"
               f"print(make_checkpoint(Path({str(hf)!r}), {args.hidden}, {args.layers}, {args.ff}))")
        weight_bytes = int(run([sys.executable, "-c", gen])[2].split()[-1])
        print(f"checkpoint: {weight_bytes / 1e9:.2f} GB of BF16 weights in "
              f"{len(list(hf.glob('*.safetensors')))} shards -> {args.type}, {args.threads} threads")
        print(f"{'route':58} {'wall s':>8} {'peak RSS MB':>12}")

        def step(label, cmd):
            os.sync()
            wall, rss, _ = run(cmd)
            print(f"{label:58} {wall:8.1f} {rss / 1e6:12.0f}", flush=True)
            return wall, rss

        one = d / "one.gguf"
        w1, r1 = step("one step: quantkit quantize HF_DIR", qk + [str(hf), str(one), args.type, "--threads", t])
        bf16 = d / "bf16.gguf"
        wc, rc = step("step 1: quantkit quantize HF_DIR -> bf16 GGUF (convert)",
                      qk + [str(hf), str(bf16), "bf16", "--threads", t])
        two = d / "two.gguf"
        wq, rq = step("step 2a: quantkit quantize bf16 GGUF", qk + [str(bf16), str(two), args.type, "--threads", t])
        lqo = d / "lq.gguf"
        wl, rl = step("step 2b: llama-quantize bf16 GGUF (ik wheel)", [lq, str(bf16), str(lqo), args.type, t])
        same = filecmp.cmp(one, two, shallow=False)
        print(f"\nconvert (quantkit) + llama-quantize: {wc + wl:.1f} s, peak {max(rc, rl) / 1e6:.0f} MB, "
              f"{bf16.stat().st_size / 1e9:.2f} GB intermediate file")
        print(f"convert (quantkit) + quantkit:       {wc + wq:.1f} s, peak {max(rc, rq) / 1e6:.0f} MB")
        print(f"one step:                            {w1:.1f} s, peak {r1 / 1e6:.0f} MB, no intermediate file "
              f"({(wc + wl) / w1:.2f}x faster than convert + llama-quantize)")
        print(f"one-step output == convert-then-quantize output (quantkit): {same}")


if __name__ == "__main__":
    main()
