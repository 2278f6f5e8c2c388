"""Generation speed predicted from a plan alone: the memory roofline.

Generating one token is a matrix-vector product with every weight the token passes through, and a
matrix-vector product reads each weight once and does two operations with it: far too few to keep
the arithmetic units busy, so its time is the bytes it reads over the memory's bandwidth (the
roofline's memory-bound side, ``memory_time = total_bytes / mem_bw``, as seeds/002 models the
decode step).  Per token that is:

* every dense weight whole (attention, shared experts, dense FFNs, norms, routers, the output);
* of a routed-expert tensor (``*_exps``: one matrix per expert, the experts along the last
  dimension) only the ``n_expert_used`` experts the router picks;
* of the token embeddings one row (a lookup, not a product); a model without an output matrix
  multiplies by its token embeddings instead (llama.cpp duplicates them onto the output layer's
  device), which reads them whole there;
* nothing of the MTP/NextN blocks (``nextn_predict_layers``) that llama.cpp does not run.

Each device reads its own tensors at its own bandwidth, one after the other (a layer waits for the
one before it), so the seconds per token are the sum over devices of bytes / bandwidth.  The
prediction is an upper bound on tokens/s: real runs reach part of the bandwidth, and the attention
over a long context reads the KV cache on top (not modelled here).
"""
from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .errors import QuantkitError
from .placement import DEVICES, Placement
from .plan import OUTPUT_NAME, TOKEN_EMBD_NAMES
from .presets import layer_of
from .sizes import parse_size
from .types import QuantType, tensor_nbytes


# --------------------------------------------------------------------------- bandwidth
def parse_bandwidth(text: str) -> dict[str, float]:
    """``--bandwidth cpu=60G,gpu=900G`` -> {"cpu": 60e9, "gpu": 900e9} bytes/s (G = 1e9, GiB = 2**30,
    as parse_size; a trailing "/s" or "B/s" is allowed).  A bare size is the CPU's."""
    result: dict[str, float] = {}
    items = [s.strip() for s in str(text).split(",")]
    if not any(items):
        raise QuantkitError(f"--bandwidth: empty value '{text}' (example: cpu=60G,gpu=900G)")
    for item in items:
        dev, sep, size = item.rpartition("=")
        dev = dev.strip().lower() if sep else "cpu"
        if dev not in DEVICES:
            raise QuantkitError(f"--bandwidth: '{item}': the device is cpu or gpu (example: cpu=60G,gpu=900G)")
        if dev in result:
            raise QuantkitError(f"--bandwidth: {dev} given twice in '{text}'")
        size = size.strip()
        size = size[:-2] if size.lower().endswith("/s") else size
        result[dev] = float(parse_size(size, f"--bandwidth {dev}"))
    return result


def bandwidth_of(value) -> dict[str, float]:
    """--bandwidth as the library takes it: None (none given), a text for parse_bandwidth, or a
    mapping of device ("cpu", "gpu") to bytes/s."""
    if value is None:
        return {}
    if isinstance(value, str):
        return parse_bandwidth(value)
    bandwidth = {str(k): float(v) for k, v in dict(value).items()}
    bad = [k for k in bandwidth if k not in DEVICES]
    if bad:
        raise QuantkitError(f"bandwidth: unknown device '{bad[0]}' (cpu or gpu)")
    return bandwidth


def with_cpu_measured(bandwidth: dict[str, float], threads: int | None = None) -> tuple[dict[str, float], tuple]:
    """``bandwidth`` with the CPU's measured (measure_cpu_bandwidth) where none is given for it, and
    the devices so measured."""
    bandwidth = dict(bandwidth)
    if "cpu" in bandwidth:
        return bandwidth, ()
    bandwidth["cpu"] = measure_cpu_bandwidth(threads)
    return bandwidth, ("cpu",)


def _read_all(chunk: np.ndarray) -> int:
    # an OR over every word: each byte is read once, next to no arithmetic (numpy drops the GIL here)
    return int(np.bitwise_or.reduce(chunk))


@lru_cache(maxsize=4)
def measure_cpu_bandwidth(threads: int | None = None, nbytes: int = 1 << 28) -> float:
    """Bytes/s the CPU reads from memory, streaming ``nbytes`` (far more than any cache) with
    ``threads`` threads (default: every core this process may use); the best of a few passes, a
    fraction of a second in all.  Measured once a process for the same arguments."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, int(threads))
    words = max(int(nbytes) // 8, 1 << 20)
    data = np.ones(words, dtype=np.uint64)             # written once: every page is mapped before timing
    parts = np.array_split(data, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(_read_all, parts))                # warm-up: threads started, TLB filled
        start = time.perf_counter()
        for _ in range(8):
            t = time.perf_counter()
            list(pool.map(_read_all, parts))
            best = min(best, time.perf_counter() - t)
            if time.perf_counter() - start > 0.3:
                break
    return data.nbytes / best


# --------------------------------------------------------------------------- bytes per token
def is_routed_expert(name: str, shape) -> bool:
    """A tensor holding one matrix (or bias row) per routed expert, the experts along its last
    dimension: ffn_{gate,up,down,gate_up}_exps (not the shared experts' *_shexp)."""
    return "_exps." in name and len(shape) >= 2


def bytes_per_token(name: str, shape, qtype, n_expert: int, n_expert_used: int) -> int:
    """Bytes read from the weights to generate one token: the whole tensor; for routed-expert
    tensors (*_exps) n_expert_used/n_expert of it (the active experts; the tensor's last dimension is
    its expert count); token embeddings one row."""
    shape = tuple(int(d) for d in shape)
    qtype = QuantType(qtype)
    if name in TOKEN_EMBD_NAMES and shape:
        return tensor_nbytes(qtype, shape[:1])
    if is_routed_expert(name, shape) and n_expert_used > 0:
        experts = shape[-1]
        if n_expert > 0 and experts != n_expert:
            raise QuantkitError(f"tensor '{name}' holds {experts} experts, the model's metadata says {n_expert}")
        return tensor_nbytes(qtype, shape[:-1]) * min(n_expert_used, experts)
    return tensor_nbytes(qtype, shape)


# --------------------------------------------------------------------------- prediction
@dataclass
class SpeedPrediction:
    bytes_per_token: dict[str, int]     # per device: weight bytes read per generated token
    stored: dict[str, int]              # per device: weight bytes held
    bandwidth: dict[str, float]         # per device: bytes/s used for the prediction
    seconds_per_token: float            # sum over devices of bytes / bandwidth
    tokens_per_s: float
    measured: tuple[str, ...] = ()      # devices whose bandwidth was measured here, not given
    tied_output: bool = False           # no output matrix: the token embeddings serve as one
    skipped_layers: tuple[int, ...] = ()  # MTP/NextN blocks generation does not run
    n_expert: int = 0
    n_expert_used: int = 0
    seconds: dict[str, float] = field(default_factory=dict)    # per device

    def to_json(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "seconds_per_token": self.seconds_per_token,
                "bytes_per_token": dict(self.bytes_per_token), "stored": dict(self.stored),
                "bandwidth": dict(self.bandwidth), "measured": list(self.measured),
                "seconds": dict(self.seconds), "tied_output": self.tied_output,
                "skipped_layers": list(self.skipped_layers), "n_expert": self.n_expert,
                "n_expert_used": self.n_expert_used}


@dataclass(frozen=True)
class Accounting:
    """How one model's tensors count, per device: the bytes each holds and reads per generated token
    (what predict_speed sums; groups.py counts its options with it, so both agree)."""
    placement: Placement
    n_expert: int = 0
    n_expert_used: int = 0
    skip_layers: frozenset = frozenset()     # MTP blocks: stored, never read while generating
    tied_output: str | None = None          # no output matrix: the device that reads token_embd as one

    @classmethod
    def of(cls, names, placement: Placement, n_expert: int = 0, n_expert_used: int = 0,
           skip_layers=()) -> "Accounting":
        """The accounting of a model whose tensors are ``names`` (a tied output is detected here)."""
        names = set(names)
        tied = TOKEN_EMBD_NAMES[0] in names and OUTPUT_NAME not in names
        return cls(placement, n_expert, n_expert_used, frozenset(int(i) for i in skip_layers),
                   placement.device(OUTPUT_NAME) if tied else None)

    def add(self, stored: dict, per_token: dict, name: str, shape, qtype) -> int:
        """Count tensor ``name`` stored as ``qtype`` into ``stored`` and ``per_token`` (device ->
        bytes); returns its bytes in the file."""
        shape = tuple(shape)
        dev = self.placement.device(name)
        size = tensor_nbytes(QuantType(qtype), shape)
        stored[dev] = stored.get(dev, 0) + size
        if layer_of(name) not in self.skip_layers:
            per_token[dev] = per_token.get(dev, 0) + bytes_per_token(name, shape, qtype, self.n_expert,
                                                                     self.n_expert_used)
        if self.tied_output is not None and name == TOKEN_EMBD_NAMES[0]:
            # llama.cpp creates the output from token_embd (TENSOR_DUPLICATED) on the output layer's
            # device: a second copy there when that is not the CPU, read whole every token
            out = self.tied_output
            per_token[out] = per_token.get(out, 0) + size
            if out != dev:
                stored[out] = stored.get(out, 0) + size
        return size


def device_seconds(per_token: dict[str, int], bandwidth: dict[str, float]) -> dict[str, float]:
    """Seconds per token each device spends reading its ``per_token`` bytes at its bandwidth (the
    solver's speed resource is their sum); a device that reads something needs a bandwidth."""
    seconds = {}
    for dev, nbytes in per_token.items():
        bw = bandwidth.get(dev)
        if nbytes and bw is None:
            raise QuantkitError(f"no bandwidth for the {dev}: give it with --bandwidth {dev}=SIZE "
                                f"(bytes/s, e.g. {'900G' if dev == 'gpu' else '60G'})")
        if bw is not None and not (math.isfinite(bw) and bw > 0):
            raise QuantkitError(f"--bandwidth {dev}: {bw} is not a positive number of bytes/s")
        seconds[dev] = nbytes / bw if nbytes else 0.0
    return seconds


def predict_speed(tensors, placement: Placement, bandwidth: dict[str, float], n_expert: int, n_expert_used: int,
                  *, skip_layers=(), measured=()) -> SpeedPrediction:
    """The roofline prediction for ``tensors`` ((name, shape, qtype) triples, as they will be
    stored) placed by ``placement``, each device reading at ``bandwidth[device]`` bytes/s.
    ``skip_layers``: blocks generation never runs (MTP); they are stored but not read."""
    tensors = list(tensors)
    devices = DEVICES if placement.gpu else ("cpu",)
    per_token = dict.fromkeys(devices, 0)
    stored = dict.fromkeys(devices, 0)
    account = Accounting.of((t[0] for t in tensors), placement, n_expert, n_expert_used, skip_layers)
    for name, shape, qtype in tensors:
        account.add(stored, per_token, name, shape, qtype)
    seconds = device_seconds(per_token, bandwidth)
    total = sum(seconds.values())
    return SpeedPrediction(per_token, stored, {d: float(bandwidth[d]) for d in devices if d in bandwidth},
                           total, 1.0 / total if total > 0 else math.inf, tuple(measured),
                           account.tied_output is not None, tuple(sorted(account.skip_layers)), n_expert,
                           n_expert_used, seconds)


def _count(get, key: str) -> int:
    """A non-negative integer metadata value (0 where absent); anything else is a user error."""
    value = get(key, None)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise QuantkitError(f"metadata {key}: {str(value)[:80]!r} is not a count")
    return value


def expert_counts(metadata_get) -> tuple[int, int]:
    """(expert_count, expert_used_count) of the model's metadata, checked against each other."""
    arch = metadata_get("general.architecture", "")
    arch = arch if isinstance(arch, str) else ""
    n_expert = _count(metadata_get, f"{arch}.expert_count")
    n_used = _count(metadata_get, f"{arch}.expert_used_count")
    if n_used > n_expert:
        raise QuantkitError(f"metadata {arch}.expert_used_count = {n_used} is more than "
                            f"{arch}.expert_count = {n_expert}")
    return n_expert, n_used


def mtp_layers(metadata_get, block_count: int | None = None) -> tuple[int, ...]:
    """The MTP/NextN blocks (the last ``nextn_predict_layers`` ones), which generation skips."""
    arch = metadata_get("general.architecture", "")
    arch = arch if isinstance(arch, str) else ""
    n_next = _count(metadata_get, f"{arch}.nextn_predict_layers")
    if not n_next:
        return ()
    n_block = block_count if block_count is not None else _count(metadata_get, f"{arch}.block_count")
    if n_next > n_block:
        raise QuantkitError(f"metadata {arch}.nextn_predict_layers = {n_next} is more than the {n_block} blocks")
    return tuple(range(n_block - n_next, n_block))


def plan_speed(plan, metadata_get, placement: Placement, bandwidth: dict[str, float], *, measured=()) -> SpeedPrediction:
    """predict_speed over a ``plan.Plan``'s output tensors; ``metadata_get(key, default)`` gives the
    expert counts (the plan's --override-kv values win, as in the file written)."""
    overrides = {k: mv.to_python() for k, mv in getattr(plan, "kv_overrides", ())}

    def get(key, default=None):
        return overrides[key] if key in overrides else metadata_get(key, default)
    n_expert, n_used = expert_counts(get)
    skip = mtp_layers(get, getattr(plan, "block_count", None))
    return predict_speed([(t.name, t.shape, t.dst_type) for t in plan.tensors], placement, bandwidth,
                         n_expert, n_used, skip_layers=skip, measured=measured)


__all__ = ["Accounting", "SpeedPrediction", "bandwidth_of", "bytes_per_token", "device_seconds", "expert_counts", "is_routed_expert",
           "measure_cpu_bandwidth", "mtp_layers", "parse_bandwidth", "plan_speed", "predict_speed", "with_cpu_measured"]
