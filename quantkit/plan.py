"""The quantization plan: which type every tensor gets, and why, before anything is written.

Type selection follows ik_llama.cpp's llama-quantize (specs/ik-quants.md §11):

1. tensors the C tools never quantize (1-D, norms, the MoE router, …) keep their type;
2. the first recipe rule whose regex is found in the name, else the preset's choice for the tensor
   (presets.py: the mix heuristics of the flavor's llama_tensor_get_type, skipped with --pure and for
   float presets), else the default TYPE;
3. ``--token-embedding-type`` / ``--output-tensor-type`` win for their tensors, and
   ``--ffn-gate-inp-type`` for the MoE router (ik: the only way to quantize it);
4. a row length the type's block does not divide falls back (types.py's row_fallback), flagged;
5. token embeddings are never row-interleaved, and an interleaved type whose row count is not a
   multiple of its row group falls back to its base layout, flagged.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .errors import QuantkitError
from .kv_override import resolve as resolve_overrides
from .presets import ModelInfo, Preset, imatrix_problem, mainline_order, mix_types
from .prune import check_prunable, prune_tensors
from .recipes import Recipe
from .types import PROJECTS, QuantType, TYPE_TRAITS, loads, tensor_nbytes, traits, type_name

T = QuantType

LAST_RESORT = T.F16     # when a type has no row fallback, or even the fallback's block does not divide the row

TOKEN_EMBD_NAMES = ("token_embd.weight", "per_layer_token_embd.weight")
OUTPUT_NAME = "output.weight"

# Substrings of tensor names llama-quantize never quantizes (tensor_allows_quantization).
_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "attn_rel_b.weight",
                    "position_embd", "pos_embd", "token_types.weight", "time_mix_", "channel_mix_",
                    "ssm_x.weight", "ssm_dt.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
                    ".rel_pos", ".patch_embd", ".patch_merger")
_GATE_INP_REASON = "'ffn_gate_inp.weight' tensors are never quantized"
_FLOAT_TYPES = {T.F32, T.F16, T.BF16}
_INT_TYPES = {T.I8, T.I16, T.I32, T.I64}


def why_not_quantizable(name: str, shape: tuple[int, ...], src: QuantType) -> str | None:
    """Reason a tensor is never quantized by the C tools, or None if it may be."""
    if src in _INT_TYPES:
        return "integer tensor"
    if len([d for d in shape]) < 2 or all(d == 1 for d in shape[1:]):
        return "1-D tensor"
    if not name.endswith("weight"):
        return "not a weight"
    for s in _NEVER_QUANTIZED:
        if s in name:
            return f"'{s}' tensors are never quantized"
    return None


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    src_type: QuantType
    dst_type: QuantType
    rule: str                   # what chose dst_type: a rule "pattern=type", "default", …
    rule_index: int | None = None
    requested: QuantType | None = None  # the type asked for, when a fallback replaced it
    notes: list[str] = field(default_factory=list)
    imatrix: bool = False       # quantized with importance weights
    repack: bool = False        # a byte shuffle between plain and row-interleaved layouts
    source_name: str = ""       # the input's name for it, where --prune-layers renamed it

    @property
    def input_name(self) -> str:
        return self.source_name or self.name

    @property
    def action(self) -> str:
        if self.dst_type == self.src_type:
            return "copy"
        if self.repack:
            return "repack"
        return "quantize" if traits(self.dst_type).quantized else "convert"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes_in(self) -> int:
        return tensor_nbytes(self.src_type, self.shape)

    @property
    def nbytes_out(self) -> int:
        return tensor_nbytes(self.dst_type, self.shape)

    @property
    def fallback(self) -> bool:
        return self.requested is not None

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "source": type_name(self.src_type),
                "target": type_name(self.dst_type), "action": self.action, "rule": self.rule,
                "bytes_in": self.nbytes_in, "bytes_out": self.nbytes_out,
                "requested": type_name(self.requested) if self.requested is not None else None,
                "imatrix": self.imatrix, "notes": self.notes,
                **({"input_name": self.source_name} if self.source_name else {})}


@dataclass
class Plan:
    tensors: list[TensorPlan]
    default_type: QuantType | None
    file_type: int
    flavor: str
    warnings: list[str] = field(default_factory=list)
    preset: Preset | None = None
    block_count: int | None = None      # blocks left after --prune-layers
    pruned_layers: tuple[int, ...] = ()
    kv_overrides: list = field(default_factory=list)    # (key, MetaValue) written over the metadata

    @property
    def bytes_in(self) -> int:
        return sum(t.nbytes_in for t in self.tensors)

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes_out for t in self.tensors)

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def fallbacks(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.fallback]

    def group(self, key) -> list[dict]:
        """Totals per group (count, elements, bytes, bits per weight), largest first."""
        acc: dict = defaultdict(lambda: [0, 0, 0])
        for t in self.tensors:
            a = acc[key(t)]
            a[0] += 1
            a[1] += t.n_elements
            a[2] += t.nbytes_out
        rows = [{"group": k, "tensors": n, "elements": e, "bytes": b, "bpw": 8 * b / e if e else 0.0}
                for k, (n, e, b) in acc.items()]
        return sorted(rows, key=lambda r: -r["bytes"])

    def by_type(self) -> list[dict]:
        return self.group(lambda t: type_name(t.dst_type))

    def by_rule(self) -> list[dict]:
        return self.group(lambda t: t.rule)

    def to_json(self) -> dict:
        gib = 1024 ** 3
        return {
            "default_type": type_name(self.default_type) if self.default_type is not None else None,
            "preset": self.preset.name if self.preset is not None else None,
            "file_type": self.file_type, "flavor": self.flavor,
            "tensors": [t.to_json() for t in self.tensors],
            "totals": {"tensors": len(self.tensors), "elements": self.n_elements,
                       "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                       "gib_out": self.bytes_out / gib,
                       "bpw": 8 * self.bytes_out / self.n_elements if self.n_elements else 0.0},
            "by_type": self.by_type(), "by_rule": self.by_rule(),
            "fallbacks": len(self.fallbacks), "warnings": self.warnings,
            **({"pruned_layers": list(self.pruned_layers), "block_count": self.block_count}
               if self.pruned_layers else {}),
            **({"kv_overrides": [{"key": k, "type": mv.vtype.name.lower(), "value": mv.value}
                                 for k, mv in self.kv_overrides]} if self.kv_overrides else {}),
        }


@dataclass
class PlanOptions:
    default_type: QuantType | None = None
    recipe: Recipe | None = None
    token_embedding_type: QuantType | None = None
    output_tensor_type: QuantType | None = None
    pure: bool = False
    leave_output_tensor: bool = False
    allow_requantize: bool = False
    strict: bool = False
    flavor: str = "ik"
    preset: Preset | None = None        # a mix (Q4_K_M, IQ4_K, …); its default type is the default
    model: ModelInfo | None = None      # hyper-parameters the mix rules look at (from the metadata)
    has_imatrix: bool = False           # some mix rules change with an imatrix
    keep_input_order: bool = False      # mainline sorts tensors unless it keeps the input shards
    ffn_gate_inp_type: QuantType | None = None  # ik's --ffn-gate-inp-type: the MoE routers' type
    prune_layers: tuple[int, ...] = ()  # mainline's --prune-layers: blocks removed, the rest renumbered
    metadata: dict | None = None        # the input's metadata ({key: MetaValue}): --prune-layers and
                                        # --override-kv are checked against it
    kv_overrides: list = field(default_factory=list)    # --override-kv (kv_override.KVOverride)


def _row_fallback(qtype: QuantType, n_per_row: int, flavor: str) -> QuantType:
    if n_per_row % traits(qtype).block_size == 0:
        return qtype
    fb = traits(qtype).row_fallback_for(flavor)
    if fb is not None and n_per_row % traits(fb).block_size == 0:
        return fb
    return LAST_RESORT


# ik's interleaved_properties also lists the ARM layouts q4_0_4x4/4x8/8x8 (quantkit does not write them, so
# their traits have no row group): token embeddings and row counts off the group fall back to q4_0 there too
_ARM_Q4_0_GROUPS = {T.Q4_0_4_4: 4, T.Q4_0_4_8: 4, T.Q4_0_8_8: 8}


def _row_group(qtype: QuantType) -> tuple[int, QuantType | None]:
    """(rows interleaved together, the layout to fall back to) of ``qtype``."""
    if qtype in _ARM_Q4_0_GROUPS:
        return _ARM_Q4_0_GROUPS[qtype], T.Q4_0
    tt = traits(qtype)
    return tt.interleave_rows, tt.group_fallback or tt.base


def _row_length_note(n_per_row: int, qtype: QuantType, fixed: QuantType) -> str:
    return (f"row length {n_per_row} is not a multiple of {type_name(qtype)}'s block {traits(qtype).block_size}: "
            f"using {type_name(fixed)}")


def _file_type(default_type: QuantType | None, tensors: list[TensorPlan], preset: Preset | None,
               flavor: str) -> int:
    if preset is not None:
        return preset.ftype(flavor)
    if default_type is not None and traits(default_type).ftype is not None:
        return traits(default_type).ftype
    # as the loader guesses it: the type holding the most weights among the converted tensors
    weight = defaultdict(int)
    for t in tensors:
        if len(t.shape) >= 2:
            weight[t.dst_type] += t.n_elements
    for qtype, _ in sorted(weight.items(), key=lambda kv: -kv[1]):
        if traits(qtype).ftype is not None:
            return traits(qtype).ftype
    return 0


def _preset_mix(tensors, opts: PlanOptions, default_type: QuantType | None) -> dict[str, QuantType]:
    """The preset's per-tensor types, or {} where the C tools skip the heuristics."""
    preset = opts.preset
    if preset is None or opts.pure or default_type is None or not traits(default_type).quantized:
        return {}
    visit = []
    for t in tensors:
        name, shape = t.name, tuple(t.shape)
        if why_not_quantizable(name, shape, QuantType(t.qtype)) is not None:
            continue
        if opts.leave_output_tensor and name == OUTPUT_NAME:
            continue
        # mainline does not run the heuristics for a tensor a --tensor-type rule claims (so its
        # counters skip it); ik runs them for every tensor and lets the custom rule win afterwards.
        # --tensor-type rules keep mainline's way in both flavors, --custom-q rules the flavor's.
        rule = opts.recipe.match(name) if opts.recipe else None
        if rule is not None and (opts.flavor == "mainline" or rule.tensor_type):
            continue
        visit.append((name, shape))
    return mix_types(visit, [t.name for t in tensors], preset, opts.flavor, opts.model or ModelInfo(),
                     has_imatrix=opts.has_imatrix, token_embedding_type=opts.token_embedding_type,
                     output_tensor_type=opts.output_tensor_type)


def _is_gate_inp(name: str) -> bool:
    return "ffn_gate_inp.weight" in name


def make_plan(tensors, opts: PlanOptions) -> Plan:
    """Choose the target type of every tensor.  ``tensors`` are objects with name/shape/qtype."""
    recipe = opts.recipe
    default_type = opts.default_type
    if default_type is None and opts.preset is not None:
        default_type = opts.preset.default_type
    if recipe and default_type is not None and not traits(default_type).quantized:
        manual = next((r for r in recipe.rules if r.tensor_type), None)
        if manual is not None:
            raise QuantkitError(f"{manual.source}: llama-quantize applies --tensor-type rules only with a quantized "
                                f"TYPE, and {type_name(default_type)} is not one (it would ignore them); give a "
                                f"quantized TYPE, or none to keep the other tensors as they are")
    tensors = list(tensors)
    kv_values = resolve_overrides(opts.kv_overrides, opts.metadata or {}, opts.flavor)
    block_count = None
    if opts.prune_layers:
        block_count = check_prunable(opts.metadata or {}, opts.prune_layers, [t.name for t in tensors])
        tensors = prune_tensors(tensors, opts.prune_layers)
    if opts.flavor == "mainline" and not opts.keep_input_order:
        tensors.sort(key=lambda t: mainline_order(t.name))
    mix = _preset_mix(tensors, opts, default_type)
    mix_label = f"{opts.preset.name} mix" if opts.preset is not None else ""
    plans: list[TensorPlan] = []
    rule_hits = defaultdict(int)
    rule_names = defaultdict(int)     # rules whose pattern matched some name, quantizable or not
    for t in tensors:
        name, shape, src = t.name, tuple(t.shape), QuantType(t.qtype)
        if recipe:
            for i, r in enumerate(recipe.rules):
                if r.matches(name):
                    rule_names[i] += 1
        source_name = getattr(t, "input_name", name)    # a renamed (pruned) tensor's input name
        source_name = "" if source_name == name else source_name
        reason = why_not_quantizable(name, shape, src)
        if reason is None and opts.leave_output_tensor and name == OUTPUT_NAME:
            reason = "--leave-output-tensor"
        gate_inp = None
        if opts.ffn_gate_inp_type is not None and _is_gate_inp(name) and reason == _GATE_INP_REASON:
            # ik quantizes a router only when the option names another type than it has
            if opts.ffn_gate_inp_type == src:
                reason = f"already {type_name(src)} (--ffn-gate-inp-type)"
            else:
                reason, gate_inp = None, opts.ffn_gate_inp_type
        if reason is not None:
            plans.append(TensorPlan(name, shape, src, src, f"kept: {reason}", source_name=source_name))
            continue

        dst, label, index = default_type, "default", None
        if mix.get(name, dst) != dst:
            dst, label = mix[name], mix_label
        rule = recipe.match(name) if recipe else None
        if rule is not None:
            index = recipe.rules.index(rule)
            dst, label = rule.qtype, str(rule)
            rule_hits[index] += 1
        if name in TOKEN_EMBD_NAMES and opts.token_embedding_type is not None:
            dst, label, index = opts.token_embedding_type, "--token-embedding-type", None
        elif name == OUTPUT_NAME and opts.output_tensor_type is not None:
            dst, label, index = opts.output_tensor_type, "--output-tensor-type", None
        if gate_inp is not None:
            dst, label, index = gate_inp, "--ffn-gate-inp-type", None
        if dst is None:
            plans.append(TensorPlan(name, shape, src, src, "kept: no rule and no default type",
                                    source_name=source_name))
            continue

        tp = TensorPlan(name, shape, src, dst, label, index, source_name=source_name)
        # (4) row length not divisible by the block size
        fixed = _row_fallback(dst, shape[0], opts.flavor)
        if fixed != dst:
            tp.requested, tp.dst_type = dst, fixed
            tp.notes.append(_row_length_note(shape[0], dst, fixed))
        # (5) interleaved layouts
        group, base = _row_group(tp.dst_type)
        if group > 1 and base is not None:
            n_rows_per_matrix = shape[1] if len(shape) > 1 else 1
            why = None
            if name in TOKEN_EMBD_NAMES:
                why = "token embeddings are never stored interleaved"
            elif n_rows_per_matrix % group:
                why = f"{n_rows_per_matrix} rows are not a multiple of {group}"
            if why:
                tp.requested = tp.requested or tp.dst_type
                tp.notes.append(f"{why}: using {type_name(base)}")
                tp.dst_type = base
                # iq1_s_r4/iq1_m_r4 have 32-blocks, their bases 256-blocks: the row may not fit the base
                # (the C tools do not check again and fail); fall back as for the base itself
                fixed = _row_fallback(base, shape[0], opts.flavor)
                if fixed != base:
                    tp.notes.append(_row_length_note(shape[0], base, fixed))
                    tp.dst_type = fixed
        if tp.dst_type != src and src not in _FLOAT_TYPES and not opts.allow_requantize:
            raise QuantkitError(f"tensor '{name}' is already {type_name(src)}: requantizing it to "
                                f"{type_name(tp.dst_type)} needs --allow-requantize")
        plans.append(tp)

    warnings = []
    if recipe:
        for i, r in enumerate(recipe.rules):
            if rule_hits[i]:
                continue
            if rule_names[i]:
                warnings.append(f"{r.source}: rule '{r}' matches only tensors that are never "
                                f"quantized or claimed by earlier rules")
            else:
                warnings.append(f"{r.source}: rule '{r}' matches no tensor")
    _check_flavor_loads(plans, opts.flavor, recipe)
    fallbacks = [p for p in plans if p.fallback]
    if fallbacks:
        if opts.strict:
            p = fallbacks[0]
            raise QuantkitError(f"--strict: tensor '{p.name}' cannot be {type_name(p.requested)}: "
                                f"{p.notes[-1]}" + (f" (and {len(fallbacks) - 1} more)"
                                                    if len(fallbacks) > 1 else ""))
        warnings.append(f"{len(fallbacks)} tensor(s) use a fallback type (see the plan)")
    return Plan(plans, default_type, _file_type(default_type, plans, opts.preset, opts.flavor), opts.flavor,
                warnings, opts.preset, block_count, tuple(opts.prune_layers), kv_values)


def _check_flavor_loads(plans: list[TensorPlan], flavor: str, recipe: Recipe | None) -> None:
    """Each flavor writes files its own llama.cpp loads: a tensor converted to (or asked for as) a
    type that project does not define (iq4_k, any _r4/_r8, trellis, q6_0 for mainline) is an error
    before anything is written.  Kept tensors are the input's own and are not judged."""
    bad: dict[QuantType, list[TensorPlan]] = defaultdict(list)
    for tp in plans:
        if tp.action == "copy":
            continue
        for qtype in dict.fromkeys(q for q in (tp.requested, tp.dst_type) if q is not None):
            if not loads(qtype, flavor):
                bad[qtype].append(tp)
    if not bad:
        return

    def chosen_by(tp: TensorPlan) -> str:
        if tp.rule == "default":
            return "TYPE"
        if tp.rule_index is not None and recipe:
            return f"rule '{tp.rule}' ({recipe.rules[tp.rule_index].source})"
        return tp.rule

    parts = []
    for qtype, tps in bad.items():
        names = ", ".join(t.name for t in tps[:3]) + (f" and {len(tps) - 3} more" if len(tps) > 3 else "")
        parts.append(f"{type_name(qtype)} ({names}; from {', '.join(dict.fromkeys(map(chosen_by, tps)))})")
    project = "mainline llama.cpp" if flavor == "mainline" else PROJECTS[flavor]
    other = next((f for f in PROJECTS if f != flavor and all(loads(q, f) for q in bad)), None)
    hint = (f"use --flavor {other} ({PROJECTS[other]} loads {'it' if len(bad) == 1 else 'them'}) or a type "
            f"{project} loads" if other else f"use a type {project} loads (quantkit types lists them)")
    raise QuantkitError(f"--flavor {flavor}: {project} cannot load " + "; ".join(parts) + f": {hint}")


def check_imatrix(plan: Plan, imatrix_given: bool, has_entry) -> None:
    """Raise before writing anything where the C tool refuses to quantize without importance weights
    (very-low-bit targets; Q2_K in Q2_K_S).  ``has_entry(tensor_plan)`` tells whether the imatrix
    covers a tensor."""
    by_name = {t.name: t for t in plan.tensors}
    todo = [(t.name, t.dst_type) for t in plan.tensors if t.action != "copy"]
    problem = imatrix_problem(plan.preset, plan.flavor, todo, imatrix_given, lambda n: has_entry(by_name[n]))
    if problem:
        raise QuantkitError(problem)


def imatrix_weights(imat, name: str, shape, flavor: str):
    """Tensor ``name``'s (n_matrices, n_per_row) importance weights as the flavor's llama-quantize
    looks them up, or None: ik tries other entries where a tensor has none
    (imatrix.fallback_names), mainline only its own."""
    if imat is None or (flavor == "mainline" and name not in imat):
        return None
    return imat.weights_for(name, shape[0], shape[2] if len(shape) > 2 else 1)


def attach_imatrix(plan: Plan, imat) -> tuple[dict, list[str]]:
    """Look up every quantized tensor's importance weights (``imat.weights_for``) as the plan's flavor does.

    Marks the tensors that get weights, warns about the ones that do not (they are quantized
    without, as llama-quantize does), and returns ({name: (n_matrices, n_per_row) weights}, missing).
    """
    found, missing = {}, []
    for tp in plan.tensors:
        if tp.action != "quantize":
            continue
        # under the input's name: --prune-layers renames blocks, the imatrix knows the old names
        w = imatrix_weights(imat, tp.input_name, tp.shape, plan.flavor)
        if w is None:
            missing.append(tp.name)
        else:
            found[tp.name] = w
            tp.imatrix = True
    if missing:
        plan.warnings.append(f"no imatrix data for {len(missing)} tensor(s), quantized without: "
                             + ", ".join(missing))
    return found, missing


def check_implemented(plan: Plan, can_quantize, can_dequantize, with_imatrix) -> None:
    """Raise before writing anything if some conversion in the plan is not implemented."""
    for t in plan.tensors:
        if t.action == "copy":
            continue
        if not can_dequantize(t.src_type):
            raise QuantkitError(f"tensor '{t.name}': reading {type_name(t.src_type)} is not implemented")
        imat = with_imatrix(t)
        needs_weights = not can_quantize(t.dst_type, plan.flavor, False) and can_quantize(t.dst_type, plan.flavor, True)
        if not imat and needs_weights:
            # iq1_s, iq2_xxs, iq2_xs: ggml's quantizer aborts without importance weights
            raise QuantkitError(f"tensor '{t.name}': {type_name(t.dst_type)} needs importance weights and the "
                                f"imatrix has none for this tensor; give it imatrix data (--imatrix) or "
                                f"another type (--custom-q)")
        if not can_quantize(t.dst_type, plan.flavor, imat):
            how = " with an imatrix" if imat else ""
            raise QuantkitError(f"tensor '{t.name}': quantizing to {type_name(t.dst_type)}{how} "
                                f"({plan.flavor} flavor) is not implemented yet")


__all__ = ["Plan", "PlanOptions", "TensorPlan", "make_plan", "attach_imatrix", "check_implemented", "check_imatrix",
           "why_not_quantizable", "TYPE_TRAITS"]
