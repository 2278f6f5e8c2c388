"""What the per-architecture tests (tests/test_arch_*.py) measure on a converted F32 GGUF: the logits
of quantkit's runtime (numba and torch backends, float16 or float32 KV cache), and their distance
to a reference.

The runtime follows ggml's CPU graph, which by default keeps the KV cache in float16 and multiplies
it with float16 copies of the query and of the probabilities; transformers computes all of it in
float32.  Those roundings alone move a tiny random model's logits by a few 1e-4 of max |logit|.  So
each architecture is also run with the float32 cache (``cache_type="f32"``, the CLI's ``-ctk f32
-ctv f32``), which rounds none of them: it must meet transformers to float32 precision, which leaves
no room for a wrong norm, rope or routing hidden under the float16 noise.
"""
from __future__ import annotations

import numpy as np

from quantkit.gguf_io.reader import open_model
from quantkit.runtime import ops_cpu
from quantkit.runtime.model import Model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 355, 6135, 42, 30, 216, 9, 3113] * 4
# the issue's bar against transformers' float32 logits
TOL, TOP_AGREE = 1e-3, 0.99
# float32 attention against transformers: float32 rounding only
EXACT = 2e-5


def backend(name: str):
    if name == "numba":
        return ops_cpu
    from quantkit.runtime.ops_torch import TorchOps
    return TorchOps("cpu")


def our_logits(path, tokens, ops=ops_cpu, cache_type: str = "f16") -> np.ndarray:
    """The logits of ``tokens``; ``cache_type`` "f32": the KV cache and attention in float32
    (``-ctk f32 -ctv f32``), nothing rounded to float16."""
    with open_model(path) as g:
        model = Model(g, ops, cache_type=cache_type)
        return model.forward(tokens, model.new_cache(len(tokens)))


def distance(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| as a fraction of max |ref|."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def top_agreement(ours: np.ndarray, ref: np.ndarray, decided_only: bool = False) -> float:
    """The fraction of positions where the top tokens agree; ``decided_only``: of the positions
    whose reference top two logits are more than 2 x TOL x max |ref| apart (where logits within
    the tolerance could not swap them: with 49152 random logits a near tie is common)."""
    agree = ours.argmax(1) == ref.argmax(1)
    if decided_only:
        top2 = np.sort(ref, axis=1)[:, -2:]
        agree = agree[top2[:, 1] - top2[:, 0] > 2 * TOL * np.abs(ref).max()]
    return float(agree.mean())


def shrink_vocab(src, dst, n_vocab: int = 8192):
    """A copy of the F32 file ``src`` keeping only the first ``n_vocab`` tokens (token_embd, output
    and nextn embed_tokens/shared_head_head rows, no tokenizer): the same network for those logits, and a file that gguf-py's reader
    (slow on a 49152-token vocabulary) rewrites quickly in the hostile-input tests."""
    import gguf

    from quantkit.gguf_io.reader import open_model
    with open_model(src) as g:
        w = gguf.GGUFWriter(str(dst), arch=g.architecture)
        for key, mv in g.metadata.items():
            if key.startswith("tokenizer.") or key == "general.architecture":
                continue
            value = n_vocab if key.endswith(".vocab_size") else mv.value
            w.add_key_value(key, value, gguf.GGUFValueType(int(mv.vtype)))
        for t in g.tensors:
            shape = list(t.shape)
            data = t.raw().view(np.float32).reshape(shape[::-1])
            if t.name in ("token_embd.weight", "output.weight") or t.name.endswith(
                    (".nextn.embed_tokens.weight", ".nextn.shared_head_head.weight")):
                data = data[:n_vocab]
            w.add_tensor(t.name, np.ascontiguousarray(data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


def quantized_vs_dequantized_in_the_wheel(src, tmp_path, qtype: str = "q4_K_M") -> float:
    """``src`` quantized by quantkit to ``qtype``: our logits on it against the wheel's on the same
    file dequantized to F32 (the wheel's own quantized products round activations to 8 bits, which
    moves a tiny random model's logits by tens of percent)."""
    import peers
    import quantkit
    quantized, dequantized = tmp_path / f"{qtype}.gguf", tmp_path / f"{qtype}-f32.gguf"
    quantkit.quantize_model(src, quantized, qtype)
    quantkit.quantize_model(quantized, dequantized, "f32", allow_requantize=True)
    theirs = np.asarray(peers.ik_logits(dequantized, PROMPT, all_positions=True))
    # our float products: what the stored weights mean, as the dequantized file's
    return distance(our_logits(quantized, PROMPT, ops_cpu.float_products), theirs.reshape(-1, theirs.shape[-1]))
