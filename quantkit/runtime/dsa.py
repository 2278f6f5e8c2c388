"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer of one layer, which picks the keys
each query of the MLA attention (``deepseek2.py``) attends to.

Per layer, from the normed layer input h and the normed query LoRA q_resid (the MLA's own)::

    q  = indexer.attn_q_b · q_resid            n_head heads of head_dim
    k  = LayerNorm(indexer.attn_k · h)         one key per position (with weight and bias), cached
    q, k: "rotate half" (NEOX) rope on the first qk_rope dims of each head (the MLA's rope pairs
          adjacent dims; DeepSeek's reference code wants the indexer's non-interleaved)
    w  = indexer.proj · h / sqrt(n_head · head_dim)
    score(t, j) = Σ_h w[t, h] · relu(q[t, h] · k[j])

and query t keeps the ``top_k`` best-scoring of the keys it sees (all of them while it sees no more
than top_k): exact top-k over float32 scores of float32 cached keys, as transformers'
modeling_deepseek_v32.py computes them.  Where the references differ:

* DeepSeek's reference (inference/model.py) and ik_llama.cpp rotate q and k by a Walsh-Hadamard
  matrix first.  H is orthonormal, so H q · H k = q · k: it changes no score, only what rounding
  does to them — DeepSeek then quantizes q and k to FP8 (fp8_index), ik stores the keys in an F16
  cache.  transformers skips both (scores in float32, "the Hadamard transform is orthogonal ...
  FP8 quantization is a precision optimization"): so do we, which makes the selection the exact
  top-k of the model's real scores and comparable with transformers' float32 logits.
* ik_llama.cpp adds a large boost to each sequence's first key (its "attention sink"), so it is
  always kept; neither DeepSeek's reference nor transformers does: we do not.
* ik_llama.cpp runs its indexer only for the glm-dsa architecture (GLM-5); its deepseek2 loader
  does not even create the indexer tensors (a V3.2 file fails with "wrong number of tensors").
  Its indexer ropes with the architecture's rope type (ggml's normal mode, adjacent pairs, for
  glm-dsa); V3.2's indexer needs the "rotate half" pairs, as stored by the converter (no permutation).
"""
from __future__ import annotations

import math

# transformers' and DeepSeek's reference LayerNorm eps for k_norm (the GGUF carries no key for it)
K_NORM_EPS = 1e-6
# a layer's indexer tensors (shapes checked in hparams.py)
TENSORS = ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
           "indexer.proj.weight")


def select(m, i: int, h, q_resid, pos, cache):
    """The keys (n_tokens, n_kv) each query of layer i keeps (ops.dsa_topk), None for all of them;
    the layer's indexer keys go into the cache first."""
    c, dsa, mla, ops = m.config, m.config.dsa, m.config.mla, m.ops
    p, n = f"blk.{i}.indexer.", h.shape[0]
    q = m.linear(p + "attn_q_b", q_resid).reshape(n, dsa.n_head, dsa.head_dim)
    k = ops.layer_norm(m.linear(p + "attn_k", h), m.vector(p + "k_norm.weight"), m.vector(p + "k_norm.bias"),
                       K_NORM_EPS).reshape(n, 1, dsa.head_dim)
    rope = dict(freq_scale=mla.freq_scale, ext_factor=mla.ext_factor, mscale=mla.rope_mscale,
                beta_fast=mla.beta_fast, beta_slow=mla.beta_slow, n_ctx_orig=mla.n_ctx_orig, neox=True)
    q = ops.rope_ext(q, pos, mla.qk_rope, c.rope_base, **rope)
    k = ops.rope_ext(k, pos, mla.qk_rope, c.rope_base, **rope)
    cache.store_index(i, cache.n_past, k.reshape(n, dsa.head_dim))
    weights = m.linear(p + "proj", h) * (1.0 / math.sqrt(dsa.n_head * dsa.head_dim))
    return ops.dsa_topk(q, weights, cache, i, cache.n_past, dsa.top_k)
