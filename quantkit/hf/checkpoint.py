"""A checkpoint's tensors as the architecture converters take them: by name, shape-checked against
what config.json implies, float8 paired with its block scales, and every tensor accounted for
(a tensor no converter takes is an error, as in convert_hf_to_gguf.py: "Can not map tensor")."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QuantkitError
from ..gguf_io.constants import MetaValue, ValueType
from .config import Config
from . import compressed_tensors
from .lazy import Lazy, Stored
from .numerics import FP8_BLOCK, block_scales, powers_of_two
from .safetensors import SafeTensor

log = logging.getLogger("quantkit")
SCALE_SUFFIX = "_scale_inv"         # DeepSeek's FP8 checkpoints: "<name>.weight_scale_inv"


@dataclass
class Conversion:
    """What an architecture converter returns: GGUF metadata and the output tensors in file order,
    each as (GGUF name, ggml shape, rows)."""
    metadata: dict[str, MetaValue] = field(default_factory=dict)
    tensors: list[tuple[str, tuple[int, ...], Lazy]] = field(default_factory=list)

    def add(self, name: str, lazy: Lazy, shape: tuple[int, ...] | None = None) -> None:
        self.tensors.append((name, shape or lazy.ggml_shape, lazy))

    def meta(self, key: str, value, vtype: ValueType) -> None:
        self.metadata[key] = MetaValue(vtype, value)


class Checkpoint:
    def __init__(self, tensors: dict[str, SafeTensor], directory: Path, packed_int4: bool = False):
        self.tensors, self.directory = tensors, directory
        self.used: set[str] = set()
        self.packed_int4 = packed_int4      # compressed-tensors int4 Linears (X.weight_packed ...) are read

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None, as_f32: bool = False) -> Lazy:
        """The tensor ``name`` (HF shape ``shape`` if given); float8 comes with its scale grid, a
        pack-quantized int4 weight is decoded to float32."""
        t = self.tensors.get(name)
        if t is None and self.packed_int4 and compressed_tensors.is_packed(self.tensors, name):
            lazy = compressed_tensors.open_packed(self.tensors, name, shape, self.directory)
            self.used.update(name + s for s in compressed_tensors.SUFFIXES)
            return lazy
        if t is None:
            raise QuantkitError(f"{self.directory}: tensor '{name}' is missing from the checkpoint")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise QuantkitError(f"{self.directory}: tensor '{name}' has shape {list(t.shape)} but config.json "
                                f"implies {list(shape)}")
        if t.dtype not in ("F32", "F16", "BF16", "F8_E4M3"):
            raise QuantkitError(f"{self.directory}: tensor '{name}' is {t.dtype}; only F32, F16, BF16 and "
                                "F8_E4M3 weights are converted")
        self.used.add(name)
        scale = None
        if t.dtype == "F8_E4M3":
            scale = self.tensors.get(name + SCALE_SUFFIX)
            if scale is None or len(t.shape) != 2:
                raise QuantkitError(f"{self.directory}: float8 tensor '{name}' has no {name + SCALE_SUFFIX} "
                                    "block scales (only DeepSeek's 128x128 block-scaled FP8 is converted)")
            grid = tuple(-(-d // FP8_BLOCK) for d in t.shape)
            if tuple(scale.shape) != grid or scale.dtype not in ("F32", "F8_E8M0"):
                raise QuantkitError(f"{self.directory}: '{name + SCALE_SUFFIX}' is {scale.dtype} {list(scale.shape)}; "
                                    f"128x128 blocks of {list(t.shape)} need F32 (or F8_E8M0) {list(grid)}")
            self._check_scales(name + SCALE_SUFFIX, scale)
            self.used.add(name + SCALE_SUFFIX)
        return Stored(t, scale, as_f32=as_f32 or len(t.shape) == 1)

    # FP8 block scales: quantization_config.scale_fmt, which the DeepSeek converter sets (fp8_scale_format)
    scale_format: str | None = None

    def _check_scales(self, name: str, scale: SafeTensor) -> None:
        """E8M0 scales are powers of two unless NaN (0xFF); float32 ones must be when config.json
        says scale_fmt "ue8m0" (what makes the decoded values exact: see numerics.py)."""
        if scale.dtype != "F8_E8M0" and self.scale_format != "ue8m0":
            return
        bad = ~powers_of_two(block_scales(scale.dtype, scale.data))
        if bad.any():
            r, c = (int(i[0]) for i in np.nonzero(bad))
            value = block_scales(scale.dtype, scale.data)[r, c]
            raise QuantkitError(f"{self.directory}: '{name}' block [{r}, {c}] is {value!r}, not a power of two "
                                "(ue8m0 block scales are)")

    def skip(self, pattern: str) -> None:
        """Tensors the GGUF does not carry (rotary caches, the MTP layer ...)."""
        rx = re.compile(pattern)
        self.used.update(n for n in self.tensors if rx.search(n))

    def check_all_used(self) -> None:
        left = sorted(n for n in self.tensors if n not in self.used)
        if left:
            raise QuantkitError(f"{self.directory}: cannot map tensor '{left[0]}'"
                                f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} to a GGUF tensor")


def permute_qk_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order convert_hf_to_gguf.py gives llama's q and k projections.

    HF's rotary embedding pairs dimension i with i + d/2 within each head ("rotate half"); ggml's
    normal rope pairs 2i with 2i + 1. Per head of d rows, GGUF row 2i + s is HF row s*d/2 + i::

        HF   rows of a head:  x0 x1 x2 x3 | y0 y1 y2 y3        (pairs (x_i, y_i))
        GGUF rows of a head:  x0 y0 x1 y1 x2 y2 x3 y3
    """
    d = n_rows // n_head
    h, i, s = np.meshgrid(np.arange(n_head), np.arange(d // 2), np.arange(2), indexing="ij")
    return (h * d + s * (d // 2) + i).reshape(-1)


def base_conversion(arch: str, cfg: Config, rms_eps_default: float) -> Conversion:
    """A Conversion holding the hyperparameters every decoder-only model has, under ``arch``'s keys
    (what convert_hf_to_gguf.py's base class writes)."""
    U32, F32 = ValueType.UINT32, ValueType.FLOAT32
    c = Conversion()
    n_head = cfg.dim("num_attention_heads")
    c.meta(f"{arch}.context_length", cfg.dim("max_position_embeddings"), U32)
    c.meta(f"{arch}.embedding_length", cfg.dim("hidden_size"), U32)
    c.meta(f"{arch}.feed_forward_length", cfg.dim("intermediate_size"), U32)
    c.meta(f"{arch}.block_count", cfg.dim("num_hidden_layers"), U32)
    c.meta(f"{arch}.attention.head_count", n_head, U32)
    c.meta(f"{arch}.attention.head_count_kv", cfg.dim("num_key_value_heads", n_head), U32)
    c.meta(f"{arch}.rope.freq_base", cfg.rope_theta, F32)
    c.meta(f"{arch}.attention.layer_norm_rms_epsilon", cfg.number("rms_norm_eps", rms_eps_default, low=0.0), F32)
    c.meta(f"{arch}.vocab_size", cfg.dim("vocab_size"), U32)
    return c


def add_output_head(c: Conversion, ck: Checkpoint, cfg: Config) -> None:
    """output_norm, and output.weight unless the embeddings are tied: the loaders then use token_embd.

    convert_hf_to_gguf.py looks only at the tensors: it writes lm_head.weight whenever the checkpoint
    has one and ties the output otherwise. Here config.json decides, as in transformers: with
    ``tie_word_embeddings: true`` the output is token_embd even where an lm_head.weight is stored
    (transformers ties it over the stored one); with ``false`` (LlamaConfig's and DeepseekV3Config's
    default when the key is absent, but a checkpoint saved as tied may omit it: absent is "as stored")
    an lm_head.weight must be there: without it transformers would start from random weights, and
    the converter would silently write a tied model."""
    n_embd, n_vocab = cfg.dim("hidden_size"), cfg.dim("vocab_size")
    c.add("output_norm.weight", ck.get("model.norm.weight", (n_embd,)))
    tied = cfg.boolean("tie_word_embeddings", None)
    if tied is False and not ck.has("lm_head.weight"):
        raise QuantkitError(f"{cfg.path}: says tie_word_embeddings: false but the checkpoint has no lm_head.weight "
                            "(a shard missing?); set it to true if the output really is the embedding matrix")
    if ck.has("lm_head.weight") and not tied:
        c.add("output.weight", ck.get("lm_head.weight", (n_vocab, n_embd)))
    elif ck.has("lm_head.weight"):
        if not _same_data(ck.tensors["lm_head.weight"], ck.tensors["model.embed_tokens.weight"]):
            log.warning(f"{cfg.path}: tie_word_embeddings is true but the stored lm_head.weight differs from "
                        "the embeddings: the output uses the embeddings, as transformers does "
                        "(convert_hf_to_gguf.py would write lm_head.weight)")
        ck.skip(r"^lm_head\.weight$")


def _same_data(a: SafeTensor, b: SafeTensor, block_bytes: int = 1 << 24) -> bool:
    """Whether two stored tensors hold the same bytes (read a block of rows at a time)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    n_rows = a.matrix().shape[0]
    step = max(1, block_bytes // max(1, a.matrix()[:1].nbytes))
    return all(np.array_equal(a.read_rows(r, min(r + step, n_rows)).view(np.uint8),
                              b.read_rows(r, min(r + step, n_rows)).view(np.uint8))
               for r in range(0, n_rows, step))
