"""quantkit: per-tensor GGUF quantization recipes, byte-exact with llama.cpp / ik_llama.cpp.

The library beneath the command line (quantkit.api) is reachable from here: ``quantkit.quantize_model``,
``quantkit.plan_quantize``, ``quantkit.repack_model``, … are loaded on first use, so that importing
quantkit (the CLI's start-up) stays cheap."""
from .version import __version__

_API = ("Quantization", "Repacking", "open_quantization", "plan_quantize", "quantize_model", "open_repack",
        "plan_repack", "repack_model", "inspect_model", "perplexity", "kl_divergence", "generate", "Generation",
        "collect_imatrix", "ImatrixResult", "convert_imatrix", "merge_imatrix", "ImatrixFile", "imatrix_stats",
        "ImatrixStats", "list_types", "warm_kernels", "KernelWarmup", "make_recipe", "QuantkitError")


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'quantkit' has no attribute '{name}'")


def __dir__():
    return [*globals(), *_API]
