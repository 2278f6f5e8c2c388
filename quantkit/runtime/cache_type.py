"""The KV cache's element type, llama.cpp's ``-ctk/-ctv`` (``--cache-type-k/--cache-type-v``): f16
(the default, llama.cpp's too) or f32.

With an f16 cache ggml multiplies the keys with an f16 copy of the query and the values with f16
copies of the softmax probabilities; with an f32 cache it multiplies in float32, rounding none of
keys, values, queries or probabilities.  The backends' caches (``ops_cpu.KVCache``/``MLACache``,
``ops_torch``'s) hold the chosen type and their attention follows it, so an f32 cache gives the
logits of a float32 reference (transformers) to float precision.
"""
from __future__ import annotations

import numpy as np

from ..errors import QuantkitError

CACHE_TYPES = {"f16": np.float16, "f32": np.float32}
DEFAULT = "f16"


def cache_types(cache_type="f16", mla: bool = False) -> tuple[str, str]:
    """``cache_type`` ("f16", "f32", or a (K, V) pair of them) -> the (K, V) types, checked.
    ``mla``: the model's cache is multi-head latent attention's, whose values are part of its key
    rows (one cache row per position), so K and V must be the same type."""
    k_type, v_type = (cache_type, cache_type) if isinstance(cache_type, str) else tuple(cache_type)
    for which, t in (("K", k_type), ("V", v_type)):
        if t not in CACHE_TYPES:
            raise QuantkitError(f"unsupported {which} cache type {str(t)!r} (supported: {', '.join(CACHE_TYPES)})")
    if mla and k_type != v_type:
        raise QuantkitError(f"this model's MLA cache keeps K and V in one row: the K and V cache types must be the "
                            f"same (got K {k_type}, V {v_type})")
    return k_type, v_type
