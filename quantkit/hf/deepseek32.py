"""DeepseekV32ForCausalLM (DeepSeek-V3.2) -> GGUF ``deepseek2`` with the DSA lightning indexer.

V3.2 is DeepSeek-V3 (the conversion of ``deepseek.py``) plus, in every layer's attention, an indexer
that picks the ``index_topk`` keys each query attends to.  Its tensors keep the names gguf-py gives
them (``MODEL_TENSOR.INDEXER_*`` of ik_llama.cpp's and mainline's constants.py)::

    self_attn.indexer.wq_b            [n_ihead * head_dim, q_lora]  -> blk.N.indexer.attn_q_b.weight
    self_attn.indexer.wk              [head_dim, n_embd]            -> blk.N.indexer.attn_k.weight
    self_attn.indexer.k_norm.{weight,bias} [head_dim] (a LayerNorm) -> blk.N.indexer.k_norm.{weight,bias}
    self_attn.indexer.weights_proj    [n_ihead, n_embd]             -> blk.N.indexer.proj.weight

and its hyperparameters the keys ``deepseek2.attention.indexer.{head_count,key_length,top_k}``
(gguf-py's Keys.Attention.INDEXER_*).  The rows are stored as they are: the indexer's rope is the
"rotate half" (NEOX) kind on the first qk_rope_head_dim dims of each head (DeepSeek fixed its
reference code to this on 2025-11-17), which the runtime applies as such, so no permutation.
The MTP layer (model.layers.61 in the real checkpoint) is skipped with the rest of deepseek.py's.
"""
from __future__ import annotations

from ..errors import QuantkitError
from ..gguf_io.constants import ValueType
from . import deepseek
from .checkpoint import Checkpoint, Conversion
from .config import Config

U32 = ValueType.UINT32


def convert(cfg: Config, ck: Checkpoint) -> Conversion:
    a = "deepseek2"
    n_layer, n_embd = cfg.dim("num_hidden_layers"), cfg.dim("hidden_size")
    q_lora, qk_rope = cfg.integer("q_lora_rank", 0), cfg.dim("qk_rope_head_dim")
    n_ihead, head_dim, top_k = cfg.dim("index_n_heads"), cfg.dim("index_head_dim"), cfg.dim("index_topk")
    if not q_lora:
        raise QuantkitError(f"{cfg.path}: DeepSeek-V3.2's indexer reads the query LoRA, but q_lora_rank is 0")
    if head_dim < qk_rope:
        raise QuantkitError(f"{cfg.path}: index_head_dim {head_dim} is less than qk_rope_head_dim {qk_rope}: the "
                            "indexer ropes the first qk_rope_head_dim dims of each of its heads")
    c = deepseek.convert(cfg, ck)
    c.meta(f"{a}.attention.indexer.head_count", n_ihead, U32)
    c.meta(f"{a}.attention.indexer.key_length", head_dim, U32)
    c.meta(f"{a}.attention.indexer.top_k", top_k, U32)
    for i in range(n_layer):
        s, g = f"model.layers.{i}.self_attn.indexer.", f"blk.{i}.indexer."
        c.add(g + "attn_q_b.weight", ck.get(s + "wq_b.weight", (n_ihead * head_dim, q_lora)))
        c.add(g + "attn_k.weight", ck.get(s + "wk.weight", (head_dim, n_embd)))
        c.add(g + "k_norm.weight", ck.get(s + "k_norm.weight", (head_dim,)))
        c.add(g + "k_norm.bias", ck.get(s + "k_norm.bias", (head_dim,)))
        c.add(g + "proj.weight", ck.get(s + "weights_proj.weight", (n_ihead, n_embd)))
    return c
