"""The units a recipe search chooses types for: tensor groups, and each group's candidate types.

A *group* is the set of tensors one recipe rule gives one type: a layer's attention tensors, its
ffn_down, its ffn_up and ffn_gate together (a fused MoE needs them alike, and published recipes
always give them one type), each routed-expert and shared-expert tensor kind per layer, the token
embeddings, the output; other weights form a kind named after them (``blk.N.indexer.*``:
"indexer").  With ``layer_span`` > 1 the layers of a kind are taken ``layer_span`` at a time
(``blk.0-3.attn``).  Tensors the C tools never quantize (norms, routers, 1-D) are in no group: their
bytes are fixed.

Each group's *options* are the candidate types it may take, as the planner would write them: the
sizes come from ``plan.make_plan`` itself run with a recipe that asks every tensor for the candidate
type, so row-length fallbacks, interleaved-layout fallbacks and the never-interleaved token
embeddings are the planner's own.  A candidate is left out of a group where a real run would stop
(a type the flavor cannot quantize, with or without an imatrix; a very-low-bit type without one) or
where the user's constraints forbid it (row-interleaved ``_rN`` layouts only for tensors that stay on
the CPU, never for token embeddings).  Options that write the same types are one option.

Bytes are counted per device as speed.plan_speed counts them: ``nbytes`` held in each device's
memory (a tied output's token_embd a second time on the GPU, where llama.cpp copies it) and
``bytes_per_token`` read to generate a token (the active experts only; nothing of an MTP block);
``file_bytes`` is what the GGUF file holds (plan.Plan.bytes_out).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from . import formats
from .errors import QuantkitError
from .placement import Placement
from .plan import TOKEN_EMBD_NAMES, PlanOptions, imatrix_weights, make_plan
from .presets import layer_of, tensor_requires_imatrix
from .recipes import Recipe, Rule
from .sizes import parse_size
from .speed import Accounting, expert_counts, mtp_layers
from .tensor_regex import compile_bounded
from .types import PROJECTS, QuantType, loads, traits, type_name

MIXED = "mixed"         # the device of a group whose tensors are not all on one device

_FFN = re.compile(r"^ffn_(down|up|gate|gate_up|up_gate)(_[a-z]+)?$")


@dataclass(frozen=True)
class Option:
    """One candidate type of a group, as the planner would write it."""
    qtype: QuantType                    # the type asked for (what the recipe rule says)
    types: dict[str, QuantType]         # per tensor name: the type written, after the planner's fallbacks
    nbytes: dict[str, int]              # stored bytes per device
    bytes_per_token: dict[str, int]     # bytes read per generated token, per device (speed.bytes_per_token)
    # bytes in the GGUF file; ``nbytes`` also counts the GPU's copy of a tied output's token_embd
    file_bytes: int = 0

    @property
    def fallback(self) -> bool:
        """Some tensor is written in another type than the one asked for."""
        return any(t != self.qtype for t in self.types.values())

    def __hash__(self):
        return hash((self.qtype, tuple(sorted(self.types.items()))))


@dataclass
class Group:
    key: str            # "blk.3.attn", "blk.0-3.ffn_down_exps", "token_embd", "output"
    kind: str           # "attn", "ffn_down", "ffn_up_gate", "ffn_down_exps", ... "token_embd", "output"
    layers: tuple[int, ...]
    tensors: list[str]
    shapes: dict[str, tuple[int, ...]]
    device: str         # "cpu", "gpu", or MIXED
    options: list[Option]
    n_elements: int

    def option(self, qtype: QuantType) -> Option:
        """The option whose rule asks for ``qtype``."""
        for o in self.options:
            if o.qtype == qtype:
                return o
        raise QuantkitError(f"group {self.key}: {type_name(qtype)} is not one of its candidate types "
                            f"({', '.join(type_name(o.qtype) for o in self.options)})")


@dataclass
class GroupSet:
    groups: list[Group]
    fixed: dict[str, int]               # stored bytes per device of the tensors no group holds
    fixed_per_token: dict[str, int]
    n_elements: int                     # every weight of the model (bpw = 8 * bytes / n_elements)
    flavor: str
    metadata_get: Callable              # the model's metadata (expert counts ...)
    kept: list[str] = field(default_factory=list)   # names of the tensors no group holds, kept as they are
    placement: Placement | None = None
    fixed_file_bytes: int = 0           # the file bytes of the kept tensors

    def __post_init__(self):
        self._by_key = {g.key: g for g in self.groups}

    def group(self, key: str) -> Group:
        return self._by_key[key]

    def chosen(self, choice: dict[str, QuantType]) -> list[tuple[Group, Option]]:
        """(group, its chosen option) of every group; ``choice`` maps each group key to a rule type."""
        missing = [g.key for g in self.groups if g.key not in choice]
        unknown = [k for k in choice if k not in self._by_key]
        if missing or unknown:
            raise QuantkitError("a choice must name every group once: "
                                + (f"missing {', '.join(missing[:5])}" if missing else "")
                                + ("; " if missing and unknown else "")
                                + (f"unknown {', '.join(unknown[:5])}" if unknown else ""))
        return [(g, g.option(choice[g.key])) for g in self.groups]

    def tensor_types(self, choice: dict[str, QuantType]) -> dict[str, QuantType]:
        """The type every grouped tensor is written as under ``choice``."""
        return {name: t for _, o in self.chosen(choice) for name, t in o.types.items()}

    def nbytes(self, choice: dict[str, QuantType]) -> dict[str, int]:
        """Stored bytes per device of the whole model under ``choice`` (fixed tensors included)."""
        return _add(self.fixed, *(o.nbytes for _, o in self.chosen(choice)))

    def file_bytes(self, choice: dict[str, QuantType]) -> int:
        """Bytes of tensor data in the GGUF file written under ``choice`` (plan.Plan.bytes_out)."""
        return self.fixed_file_bytes + sum(o.file_bytes for _, o in self.chosen(choice))

    def per_token(self, choice: dict[str, QuantType]) -> dict[str, int]:
        """Bytes read per generated token, per device, under ``choice``."""
        return _add(self.fixed_per_token, *(o.bytes_per_token for _, o in self.chosen(choice)))

    def bpw(self, nbytes: int) -> float:
        return 8 * nbytes / self.n_elements if self.n_elements else 0.0


def _add(*dicts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def kind_of(name: str) -> tuple[int | None, str]:
    """(layer, group kind) of a quantizable tensor name."""
    layer = layer_of(name)
    if layer is None:
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        return None, base
    base = name[len(f"blk.{layer}."):]
    base = base[:-len(".weight")] if base.endswith(".weight") else base
    if base.startswith("attn_"):
        return layer, "attn"
    m = _FFN.match(base)
    if m:
        return layer, ("ffn_down" if m[1] == "down" else "ffn_up_gate") + (m[2] or "")
    return layer, base.split(".")[0]


def _interleaved(qtype: QuantType) -> bool:
    """A row-interleaved layout (_r4, _r8, _r16; ARM's q4_0_4x4 family is no candidate: check_types)."""
    return traits(qtype).interleave_rows > 1


def check_types(types, flavor: str, has_imatrix: bool) -> list[QuantType]:
    """The candidate types, each one the flavor's llama.cpp loads and quantkit quantizes (with an
    imatrix where one is given); anything else is a one-line error naming the type."""
    if flavor not in PROJECTS:
        raise QuantkitError(f"flavor: '{flavor}' is none of {', '.join(PROJECTS)}")
    out: list[QuantType] = []
    for t in types:
        t = QuantType(t)
        name = type_name(t)
        if not loads(t, flavor):
            project = "mainline llama.cpp" if flavor == "mainline" else PROJECTS[flavor]
            raise QuantkitError(f"--types: {project} cannot load {name} (--flavor {flavor})")
        if not formats.can_quantize(t, flavor, has_imatrix):
            if not has_imatrix and formats.can_quantize(t, flavor, True):
                raise QuantkitError(f"--types: {name} needs importance weights: give an imatrix (--imatrix) or "
                                    f"leave {name} out")
            raise QuantkitError(f"--types: quantizing to {name} ({flavor} flavor) is not implemented")
        if t not in out:
            out.append(t)
    if not out:
        raise QuantkitError("--types: no candidate type given")
    return out


def _one_type_plan(tensors, qtype: QuantType, flavor: str):
    """The planner's plan asking every tensor for ``qtype`` through a recipe rule."""
    rule = Rule(".", qtype, "recipe search", compile_bounded(".", "recipe search"))
    return make_plan(tensors, PlanOptions(recipe=Recipe([rule], str(rule)), flavor=flavor, allow_requantize=True))


def imatrix_entries(imat, tensors, flavor: str) -> Callable[[str], bool]:
    """``has_entry(name)`` for make_groups: whether a loaded imatrix (imatrix.load_imatrix) gives
    the tensor importance weights, looked up as plan.attach_imatrix does it for a real run."""
    shapes = {t.name: tuple(t.shape) for t in tensors}
    found: dict[str, bool] = {}        # asked once per candidate type: each entry is checked once

    def has_entry(name: str) -> bool:
        if name not in found:
            found[name] = imatrix_weights(imat, name, shapes[name], flavor) is not None
        return found[name]
    return has_entry


def make_groups(model, types, placement: Placement | None = None, *, flavor: str = "ik", layer_span: int = 1,
                has_imatrix: bool = False, has_entry: Callable[[str], bool] | None = None,
                imatrix=None) -> GroupSet:
    """The groups of ``model`` (an open GGUF or HF model: .tensors, .get) and their options among
    ``types`` (QuantTypes, in order of preference where two write the same).

    Which tensors get importance weights: ``imatrix`` (a loaded imatrix: its own entries, see
    imatrix_entries), else ``has_entry(name)``, else with ``has_imatrix`` every tensor but the token
    embeddings (which no imatrix covers)."""
    if isinstance(layer_span, bool) or not isinstance(layer_span, int) or layer_span < 1:
        raise QuantkitError(f"layer span must be a whole number of layers, at least 1 (got {layer_span!r})")
    tensors = list(model.tensors)
    if imatrix is not None:
        has_imatrix = len(imatrix) > 0
        has_entry = has_entry or imatrix_entries(imatrix, tensors, flavor)
    types = check_types(types, flavor, has_imatrix)
    placement = placement if placement is not None else Placement()
    if has_entry is None:
        def has_entry(name):
            return has_imatrix and name not in TOKEN_EMBD_NAMES
    n_expert, n_used = expert_counts(model.get)
    account = Accounting.of((t.name for t in tensors), placement, n_expert, n_used, mtp_layers(model.get))
    plans = {t: {tp.name: tp for tp in _one_type_plan(tensors, t, flavor).tensors} for t in types}
    first = plans[types[0]]

    fixed: dict[str, int] = {}
    fixed_per_token: dict[str, int] = {}
    kept: list[str] = []
    fixed_file_bytes = 0
    # (kind, span bucket, device) -> tensors, in model order
    buckets: dict[tuple, list] = {}
    n_elements = 0
    for t in tensors:
        shape = tuple(t.shape)
        n_elements += math.prod(shape)
        tp = first[t.name]
        if tp.rule.startswith("kept"):
            kept.append(t.name)
            fixed_file_bytes += account.add(fixed, fixed_per_token, t.name, shape, QuantType(t.qtype))
            continue
        layer, kind = kind_of(t.name)
        buckets.setdefault((kind, layer), []).append(t)

    # the tensors of one layer and kind are one unit, on their device if they agree; units of a kind
    # group by span of layers and device, each group a run of the layers that have the kind
    kind_layers: dict[str, list] = {}
    for kind, layer in buckets:
        kind_layers.setdefault(kind, []).append(layer)
    kind_order = {kind: i for i, kind in enumerate(kind_layers)}
    for layers in kind_layers.values():
        layers.sort(key=lambda l: -1 if l is None else l)
    members: dict[tuple, list] = {}
    for (kind, layer), ts in sorted(buckets.items(), key=lambda kv: (kind_order[kv[0][0]],
                                                                     -1 if kv[0][1] is None else kv[0][1])):
        devices = {placement.device(t.name) for t in ts}
        dev = devices.pop() if len(devices) == 1 else MIXED
        at = None if layer is None else kind_layers[kind].index(layer)
        run = members.get((kind, dev))
        last = run[-1] if run else None
        if (last is not None and layer is not None and last[0] == at - 1
                and layer // layer_span == last[1][0] // layer_span):
            last[1].append(layer)
            last[2].extend(ts)
        else:
            members.setdefault((kind, dev), []).append([at, [layer], list(ts)])
        members[(kind, dev)][-1][0] = at

    groups = []
    for (kind, dev), runs in members.items():
        for _, layers, ts in runs:
            layers = tuple(l for l in layers if l is not None)
            if layers:
                span_text = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
                key = f"blk.{span_text}.{kind}"
            else:
                key = kind
            names = [t.name for t in ts]
            shapes = {t.name: tuple(t.shape) for t in ts}
            options = _options(names, shapes, dev, types, plans, account, flavor, has_entry)
            if not options:
                raise QuantkitError(f"group {key}: none of the candidate types ({', '.join(map(type_name, types))}) "
                                    f"can be used for its tensors ({', '.join(names[:3])}"
                                    f"{' ...' if len(names) > 3 else ''}); add a type that can (e.g. q8_0)")
            groups.append(Group(key, kind, layers, names, shapes, dev, options,
                                sum(math.prod(s) for s in shapes.values())))
    order = {name: i for i, name in enumerate(t.name for t in tensors)}
    groups.sort(key=lambda g: order[g.tensors[0]])
    return GroupSet(groups, fixed, fixed_per_token, n_elements, flavor, model.get, kept, placement, fixed_file_bytes)


def _options(names, shapes, device, types, plans, account: Accounting, flavor, has_entry):
    by_types: dict[tuple, Option] = {}
    embeddings = any(n in TOKEN_EMBD_NAMES for n in names)
    for qtype in types:
        if _interleaved(qtype) and (device != "cpu" or embeddings):
            continue
        written = {n: plans[qtype][n].dst_type for n in names}
        if not all(_quantizable(plans[qtype][n], flavor, has_entry) for n in names):
            continue
        nbytes: dict[str, int] = {}
        per_token: dict[str, int] = {}
        file_bytes = sum(account.add(nbytes, per_token, n, shapes[n], written[n]) for n in names)
        asked = qtype
        if len(set(written.values())) == 1:
            # every tensor falls back to one type: the rule names that type (q5_K on 576-long rows
            # is q6_0), which the planner keeps as it is, since it wrote it for these rows
            asked = next(iter(written.values()))
        option = Option(asked, written, nbytes, per_token, file_bytes)
        key = tuple(sorted(written.items()))
        prev = by_types.get(key)
        # of two candidates that write the same, keep the one asking for what is written
        if prev is None or (prev.fallback and not option.fallback):
            by_types[key] = option
    return list(by_types.values())


def _quantizable(tp, flavor: str, has_entry) -> bool:
    """Whether a real run writes the plan's tensor ``tp`` as planned (plan.check_implemented,
    check_imatrix)."""
    if tp.action == "copy":
        return True
    if not loads(tp.dst_type, flavor) or not formats.can_dequantize(tp.src_type):
        return False
    with_weights = has_entry(tp.name)
    if not with_weights and tensor_requires_imatrix(tp.name, tp.dst_type, None, flavor):
        return False
    return formats.can_quantize(tp.dst_type, flavor, with_weights)


_BPW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*bpw\s*$", re.I)


def parse_budget(text: str, n_elements: int, what: str = "--budget") -> int:
    """A size budget in bytes: '220G' (powers of 1000), '220GiB' (powers of 1024), '123456789'
    (bytes), or '4.5bpw' (bits per weight over the model's ``n_elements`` weights)."""
    text = str(text)
    m = _BPW.match(text)
    if m is None:
        try:
            return parse_size(text, what)
        except QuantkitError as e:
            if "cannot read" not in str(e):
                raise
            raise QuantkitError(f"{what}: cannot read size '{text}' (examples: 220G, 200GiB, 123456789, "
                                f"4.5bpw)") from None
    n = int(float(m[1]) * n_elements / 8)
    if n <= 0:
        raise QuantkitError(f"{what} must be positive (got '{text}')")
    return n


__all__ = ["Option", "Group", "GroupSet", "MIXED", "make_groups", "parse_budget", "kind_of", "check_types",
           "imatrix_entries"]
