"""Compile ahead of time (``quantkit warmup``): numba compiles the kernels of some types, and of the
runtime, into its on-disk cache now, so that no later command waits for them.

Every command also makes its own kernels ready before it times anything (quantize.warm_up_plan,
runtime/warmup.py) and says when it compiles; this is for doing it once, up front (after an
install, in a container image).  A second run finds everything in numba's cache and takes a
fraction of a second per type.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .compiling import CompileLog, announced, cache_place
from .errors import QuantkitError
from .types import QuantType, traits, type_from_name, type_name
from . import formats
from .gguf_io.constants import MetaValue, ValueType
from .gguf_io.reader import open_model
from .gguf_io.writer import GGUFWriter, TensorSpec, plan_shards
from .presets import ModelInfo, find_preset, mix_types, preset_or_type_hint
from .quantize import quantize_rows
from .runtime import ops_cpu
from .runtime.model import Model
from .runtime.warmup import warm_up

N_PER_ROW = 256                 # a row every block size divides (the largest is 256)


@dataclass
class Warmed:
    """One step of a warm-up: what was made ready, how many kernels numba compiled for it (0: all
    came from its cache), and the step's wall time."""
    what: str
    compiles: int
    seconds: float
    cache: str | None

    def to_json(self) -> dict:
        return {"what": self.what, "compiled": self.compiles, "seconds": self.seconds, "cache": self.cache}


def _warmed(log: CompileLog, t0: float) -> Warmed:
    return Warmed(log.what, log.compiles, time.perf_counter() - t0, log.cache or cache_place())


# ---------------------------------------------------------------------------------- which types
def _representative_mix(preset, flavor: str) -> set[QuantType]:
    """The types a preset's mix gives a 32-layer llama of 4096 columns (its default type included)."""
    if not traits(preset.default_type).quantized:       # F16, BF16, F32: no mix (plan._preset_mix)
        return {preset.default_type}
    n_embd, n_ff, n_layer = 4096, 14336, 32
    visit = [("token_embd.weight", (n_embd, 32000)), ("output.weight", (n_embd, 32000))]
    for i in range(n_layer):
        visit += [(f"blk.{i}.{name}.weight", shape) for name, shape in (
            ("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, 1024)), ("attn_v", (n_embd, 1024)),
            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_embd, n_ff)), ("ffn_up", (n_embd, n_ff)),
            ("ffn_down", (n_ff, n_embd)))]
    mix = mix_types(visit, [n for n, _ in visit], preset, flavor, ModelInfo(n_layer=n_layer), has_imatrix=True)
    return {preset.default_type, *mix.values()}


def resolve_types(names, flavor: str = "ik") -> list[QuantType]:
    """Type and preset names -> the types to make ready: a ggml type itself, a preset (Q4_K_M) the
    types its mix uses.  None or empty: every type quantkit quantizes."""
    if not names:
        return sorted((t for t in formats.registered() if formats.registered()[t].quant_paths),
                      key=lambda t: type_name(t))
    spelled = {type_name(t): t for t in QuantType}
    found: set[QuantType] = set()
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if not part:
                continue
            if part in spelled:             # q4_K is the type; Q4_K (llama-quantize's alias of Q4_K_M) the preset
                found.add(spelled[part])
                continue
            preset = find_preset(part, flavor)
            if preset is not None:
                found |= _representative_mix(preset, flavor)
                continue
            try:
                found.add(type_from_name(part))
            except ValueError:
                hint = preset_or_type_hint(part, flavor, loaded_only=False)
                raise QuantkitError(f"--types: unknown type '{part}': neither a ggml type nor a preset"
                                    + (f"; {hint}" if hint else "") + " (quantkit types lists them all)") from None
    return sorted(found, key=lambda t: type_name(t))


# ---------------------------------------------------------------------------------- quantizers
def warm_quantizer(qtype: QuantType) -> Warmed:
    """Quantize a few random rows to ``qtype`` the way ``quantize`` does (checks included), on every
    path the format implements (each flavor, with and without an imatrix), and decode them."""
    t0 = time.perf_counter()
    t = traits(qtype)
    rows = np.random.default_rng(0).standard_normal((t.interleave_rows, N_PER_ROW)).astype(np.float32)
    fmt = formats.registered().get(qtype)
    paths = sorted(fmt.quant_paths) if fmt is not None else []
    with announced(type_name(qtype)) as log:
        blocks = None
        for flavor, with_imatrix in paths:
            imatrix = np.ones(N_PER_ROW, np.float32) if with_imatrix else None
            blocks = quantize_rows(rows, qtype, imatrix, flavor, "warm-up")
        if blocks is None:
            blocks = np.zeros((t.interleave_rows, t.row_size(N_PER_ROW)), np.uint8)
        if formats.can_dequantize(qtype):
            formats.dequantize(blocks, qtype, N_PER_ROW)
    return _warmed(log, t0)


# ---------------------------------------------------------------------------------- runtime
def _tiny_llama(path: Path, qtype: QuantType) -> None:
    """A two-layer llama whose matrices are all ``qtype`` and all zero (every type's zero bytes
    decode to zeros: the logits are finite), for the runtime to run."""
    n, n_vocab, n_layer = N_PER_ROW, 256, 2

    def u32(v):
        return MetaValue(ValueType.UINT32, v)
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"),
            "llama.block_count": u32(n_layer), "llama.context_length": u32(64),
            "llama.embedding_length": u32(n), "llama.feed_forward_length": u32(n),
            "llama.attention.head_count": u32(4), "llama.attention.head_count_kv": u32(2),
            "llama.rope.dimension_count": u32(n // 4),
            "llama.attention.layer_norm_rms_epsilon": MetaValue(ValueType.FLOAT32, 1e-5)}
    specs = [TensorSpec("token_embd.weight", (n, n_vocab), qtype),
             TensorSpec("output_norm.weight", (n,), QuantType.F32), TensorSpec("output.weight", (n, n_vocab), qtype)]
    for i in range(n_layer):
        for name, rows in (("attn_q", n), ("attn_k", n // 2), ("attn_v", n // 2), ("attn_output", n),
                           ("ffn_gate", n), ("ffn_up", n), ("ffn_down", n)):
            specs.append(TensorSpec(f"blk.{i}.{name}.weight", (n, rows), qtype))
        specs += [TensorSpec(f"blk.{i}.attn_norm.weight", (n,), QuantType.F32),
                  TensorSpec(f"blk.{i}.ffn_norm.weight", (n,), QuantType.F32)]
    with GGUFWriter([path], plan_shards(meta, specs)) as w:
        for s in specs:
            norm = s.qtype == QuantType.F32 and len(s.shape) == 1
            w.write_tensor(s.name, np.ones(n, np.float32) if norm else np.zeros(s.nbytes, np.uint8))


def runtime_types() -> list[QuantType]:
    """The types the runtime computes with (those quantkit or gguf-py decode, and plain floats)."""
    return sorted((t for t in QuantType if formats.can_dequantize(t) or t in (QuantType.F32, QuantType.F16)),
                  key=lambda t: type_name(t))


def warm_runtime(qtype: QuantType) -> Warmed:
    """Run the runtime's warm-up (a generation step and a batch) on a tiny llama of ``qtype``."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quantkit-warmup-") as d:
        path = Path(d) / f"{type_name(qtype)}.gguf"
        _tiny_llama(path, qtype)
        with open_model(path) as gguf:
            log = warm_up(Model(gguf, ops_cpu), (1, ops_cpu.FEW_TOKENS), what=f"the runtime ({type_name(qtype)})")
    return _warmed(log, t0)


def warm(types=None, quantizers: bool = True, runtime: bool = False, flavor: str = "ik", on_step=None) -> list[Warmed]:
    """Make the kernels of ``types`` (names: ggml types or presets; None: every type quantkit
    quantizes) ready in numba's cache: their quantizers, and with ``runtime`` the runtime's
    kernels for them.  ``on_step(Warmed)`` after each step.  Returns the steps."""
    qtypes = resolve_types(types, flavor)
    jobs = [(warm_quantizer, q) for q in qtypes] if quantizers else []
    if runtime:
        usable = set(runtime_types())
        jobs += [(warm_runtime, q) for q in ((q for q in qtypes if q in usable) if types else runtime_types())]
    names = ", ".join(type_name(q) for q in qtypes) if len(qtypes) <= 8 else f"{len(qtypes)} types"
    steps = []
    with announced(names + (" and the runtime" if runtime else "")):     # the steps' own notices are silent
        for job, qtype in jobs:
            steps.append(job(qtype))
            if on_step is not None:
                on_step(steps[-1])
    return steps
