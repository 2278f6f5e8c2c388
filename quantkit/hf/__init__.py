"""Hugging Face checkpoints (config.json + safetensors + tokenizer) read as a GGUF model.

:func:`open_hf` gives an object with the interface of :class:`~quantkit.gguf_io.reader.GGUFModel`
(``metadata``, ``tensors``, ``by_name``, ``get``), whose tensors are the ones convert_hf_to_gguf.py
would write (names, shapes, layouts, storage types) and whose data is produced from the safetensors
memory maps as the quantize pipeline reads it. So ``quantize HF_DIR OUT`` is convert-then-quantize in
one streaming pass: nothing but the rows in flight is ever held in memory.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import QuantkitError
from ..gguf_io.constants import KEY_ARCHITECTURE, MetaValue, ValueType
from ..gguf_io.reader import ModelView, TensorInfo
from ..types import traits
from . import compressed_tensors, deepseek, deepseek32, glm4moe, gptoss, llama, qwen3
from .checkpoint import Checkpoint
from .config import Config, describe
from .lazy import LazySource
from .safetensors import open_checkpoint
from .vocab import vocab_metadata

# config.json "architectures" -> (GGUF architecture, converter)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", llama.convert),
    "MistralForCausalLM": ("llama", llama.convert),
    "DeepseekV3ForCausalLM": ("deepseek2", deepseek.convert),
    "DeepseekV2ForCausalLM": ("deepseek2", deepseek.convert),
    "GptOssForCausalLM": ("gpt-oss", gptoss.convert),
    "DeepseekV32ForCausalLM": ("deepseek2", deepseek32.convert),
    "Qwen3ForCausalLM": ("qwen3", qwen3.convert),
    "Qwen3MoeForCausalLM": ("qwen3moe", qwen3.convert_moe),
    "Glm4MoeForCausalLM": ("glm4moe", glm4moe.convert),
}


class HFModel(ModelView):
    def __init__(self, directory: Path):
        self.path = directory
        cfg = Config(directory / "config.json")
        arch = cfg.architecture
        if arch not in ARCHITECTURES:
            raise QuantkitError(f"{directory}: architecture '{arch}' is not supported "
                                f"(supported: {', '.join(ARCHITECTURES)})")
        gguf_arch, convert = ARCHITECTURES[arch]
        packed_int4 = _check_quantization(cfg)
        tensors, self.files = open_checkpoint(directory)
        try:
            ck = Checkpoint(tensors, directory, packed_int4)
            conv = convert(cfg, ck)
            ck.check_all_used()
            meta = {KEY_ARCHITECTURE: MetaValue(ValueType.STRING, gguf_arch),
                    "general.name": MetaValue(ValueType.STRING, directory.resolve().name)}
            meta.update(conv.metadata)
            meta.update(vocab_metadata(directory, cfg.dim("vocab_size"), cfg))
        except BaseException:
            self.close()
            raise
        self.metadata = meta
        self.tensors: list[TensorInfo] = []
        for name, shape, lazy in conv.tensors:
            n_elements = 1
            for d in shape:
                n_elements *= d
            nbytes = traits(lazy.qtype).row_size(shape[0]) * (n_elements // shape[0])
            self.tensors.append(TensorInfo(name, tuple(shape), lazy.qtype, 0, nbytes, LazySource(lazy)))
        self.by_name = {t.name: t for t in self.tensors}

    n_shards = 1

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []


def _check_quantization(cfg: Config) -> bool:
    """Only DeepSeek's FP8 (float8_e4m3fn with 128 x 128 block scales) and Kimi-K2's compressed-tensors
    int4 (compressed_tensors.py) are checkpoint quantizations we read; other schemes (GPTQ, AWQ,
    per-tensor FP8 ...) store other tensors under other names. True for the int4 one."""
    q = cfg.object("quantization_config")
    if not q.raw:
        return False
    method = q.string("quant_method", None)
    if method == "mxfp4" and cfg.architecture == "GptOssForCausalLM":
        return False    # gpt-oss's experts as *_blocks/*_scales: hf/gptoss.py keeps them as ggml MXFP4
    if method == "compressed-tensors":
        compressed_tensors.check_scheme(q)
        return True
    block = q.raw.get("weight_block_size", [128, 128])
    if method != "fp8" or block != [128, 128]:
        raise QuantkitError(f"{cfg.path}: quantization_config {method!r} with weight_block_size {describe(block)} is "
                            "not supported (only fp8 with 128x128 blocks, as DeepSeek-V3 ships, and "
                            "compressed-tensors int4, as Kimi-K2 ships)")
    return False


def open_hf(directory: str | os.PathLike) -> HFModel:
    return HFModel(Path(directory))
