"""Where each tensor of a model lives while it generates: on the CPU (host memory) or on the GPU.

The rules are llama.cpp's ``-ot/--override-tensor REGEX=BUFFER`` (llama-model.cpp, create_tensor):
each pattern is *searched* in the tensor name, the first match wins, and a tensor no rule matches
goes where the layers go: the GPU when there is one (``-ngl 99``, as every published recipe runs
it), else the CPU.  The input layer never moves: llama.cpp keeps token embeddings in host memory
(get_rows of one row a token needs no GPU).  Buffer names of GPU backends (CUDA0, ROCm1, Vulkan0,
Metal, SYCL0 ...) all mean "gpu": one GPU bandwidth is modelled.  As in llama.cpp's common/arg.cpp,
one ``-ot`` value may hold several rules separated by commas.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import QuantkitError
from .tensor_regex import compile_bounded

DEVICES = ("cpu", "gpu")

# token_embd.weight (and token_embd_norm, an input-layer tensor too), Gemma-3n's per_layer_token_embd
INPUT_LAYER_PREFIXES = ("token_embd", "per_layer_token_embd")

_GPU_BUFFER = re.compile(r"(?:gpu|cuda|rocm|hip|vulkan|metal|sycl|opencl|cann|musa)(?::?\d+)?", re.I)


def device_of_buffer(name: str) -> str | None:
    """'cpu' or 'gpu' for an ``-ot`` buffer name (cpu, CPU, gpu, CUDA0, cuda:1, Vulkan0 ...), else None."""
    name = name.strip()
    if name.lower() == "cpu":
        return "cpu"
    return "gpu" if _GPU_BUFFER.fullmatch(name) else None


@dataclass(frozen=True)
class Placement:
    """Where each tensor lives during generation."""
    rules: tuple[tuple[str, str], ...] = ()     # (regex, device), first match wins
    gpu: bool = False                           # a GPU exists (a --gpu-budget or a gpu bandwidth was given)
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        compiled = tuple((compile_bounded(p, "--override-tensor"), d) for p, d in self.rules)
        object.__setattr__(self, "_compiled", compiled)

    def device(self, name: str) -> str:
        """"cpu" or "gpu": the input layer on the CPU, else the first rule whose regex is found in
        ``name``, else the GPU if there is one."""
        if name.startswith(INPUT_LAYER_PREFIXES):
            return "cpu"
        for regex, dev in self._compiled:
            if regex.search(name):
                return dev
        return "gpu" if self.gpu else "cpu"

    def to_json(self) -> dict:
        return {"rules": [f"{p}={d}" for p, d in self.rules], "gpu": self.gpu}


def _split_items(spec: str) -> list[str]:
    """One ``-ot`` value: comma-separated rules (llama.cpp's form) where every piece is a rule, else
    one rule (a pattern such as ``blk\\.[0-9]{1,2}\\.`` holds a comma)."""
    pieces = spec.split(",")
    if len(pieces) > 1 and all("=" in p for p in pieces):
        return [p for p in pieces if p.strip()]
    return [spec]


def parse_placement(override_tensor=(), gpu: bool = False) -> Placement:
    """A Placement from ``-ot REGEX=cpu|gpu`` values (CUDA0 and other GPU buffer names mean gpu);
    one-line QuantkitError on a malformed spec, a regex that does not compile or is unbounded
    (tensor_regex.compile_bounded), or a rule that names the GPU when ``gpu`` is False."""
    if isinstance(override_tensor, str):
        override_tensor = (override_tensor,)
    rules = []
    for spec in override_tensor:
        for item in _split_items(str(spec)):
            pattern, sep, target = item.rpartition("=")
            dev = device_of_buffer(target) if sep else None
            if not sep or not pattern or dev is None:
                raise QuantkitError(f"--override-tensor '{item}': expected REGEX=cpu or REGEX=gpu (CUDA0 ... "
                                    f"mean gpu)")
            if dev == "gpu" and not gpu:
                raise QuantkitError(f"--override-tensor '{item}': puts tensors on the GPU, but none was given "
                                    f"(give its bandwidth, --bandwidth gpu=900G, or a --gpu-budget)")
            compile_bounded(pattern, f"--override-tensor '{item}'")
            rules.append((pattern, dev))
    return Placement(tuple(rules), bool(gpu))


__all__ = ["DEVICES", "Placement", "parse_placement", "device_of_buffer", "INPUT_LAYER_PREFIXES"]
