"""A chosen type per tensor group, written as the few regex rules published recipes are made of.

Groups that take the same type in the same layers share a rule, and a rule names its layers as
ranges, as people write them::

    blk\\.(?:[3-9]|[1-5][0-9]|60)\\.ffn_down_exps\\.weight=iq3_k
    blk\\.(?:[0-9]|1[0-5])\\.ffn_(?:gate|up)_shexp\\.weight=q8_0

The rules do not overlap (each tensor is matched by one rule, whatever their order) and match
exactly the grouped tensors (never a tensor kept as it is); a pattern is anchored (``^``, ``$``)
only where it would otherwise also be found in another tensor's name (``output\\.weight`` in
``attn_output.weight``).  Every pattern passes ``tensor_regex.compile_bounded`` and is its own
lower case, so mainline's ``--tensor-type`` (which lower-cases patterns) reads the same rules.

``recipe_text`` writes them as a ``--custom-q`` file (``quantkit quantize``), ``custom_q_arg`` as
the comma-separated ``--custom-q`` argument of ik_llama.cpp's llama-quantize,
``tensor_type_file_text`` as mainline's ``--tensor-type-file``, and
``check_reproduces`` runs the planner over both to prove they give exactly the chosen types.
"""
from __future__ import annotations

import os
import re

from .errors import QuantkitError
from .groups import GroupSet
from .plan import PlanOptions, make_plan
from .presets import layer_of
from .recipes import Recipe, parse_recipe_text, parse_tensor_type
from .tensor_regex import UnboundedRegex, backtracking_paths, compile_bounded
from .types import QuantType, type_name

_PLAIN = set("abcdefghijklmnopqrstuvwxyz0123456789_")


def _escape(text: str) -> str:
    """``text`` as a regex that is its own lower case: an upper-case letter (which mainline's
    lower-casing would change) becomes "any character but its lower case" (``D``: ``[^d]``), which
    tells ``ffn_Down`` from ``ffn_down``; compact_rules checks the result is still exact."""
    return "".join(c if c in _PLAIN else f"[^{re.escape(c.lower())}]" if c.lower() != c else re.escape(c)
                   for c in text)


def _digit_class(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    return f"[{lo}-{hi}]" if hi > lo + 1 else f"[{lo}{hi}]"


def _range_alternatives(lo: int, hi: int) -> list[str]:
    """Regex alternatives for the decimal numbers lo..hi (no leading zeros): 3..60 ->
    [3-9], [1-5][0-9], 60."""
    out = []
    for n_digits in range(len(str(lo)), len(str(hi)) + 1):
        first = 0 if n_digits == 1 else 10 ** (n_digits - 1)
        start, stop = max(lo, first), min(hi, 10 ** n_digits - 1)
        while start <= stop:
            # the widest block [start, start + step * k) of whole ranges of trailing digits
            step = 1
            while step * 10 <= first and start % (step * 10) == 0 and start + step * 10 - 1 <= stop:
                step *= 10
            end = start + step - 1
            while end + step <= stop and (end + step) // (step * 10) == start // (step * 10):
                end += step
            a, b = start // step, end // step
            head = str(a // 10) if a >= 10 else ""
            out.append(head + _digit_class(a % 10, b % 10) + "[0-9]" * (len(str(step)) - 1))
            start = end + 1
    return out


def layers_regex(layers) -> str:
    """A regex matching exactly the decimal numbers in ``layers`` (as whole names' components)."""
    layers = sorted(set(layers))
    alternatives, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        alternatives += _range_alternatives(layers[i], layers[j])
        i = j + 1
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def _cut_prefix(prefix: str) -> str:
    """A common prefix shortened to end at a name separator, so the alternatives are whole words."""
    i = max(prefix.rfind("_"), prefix.rfind("."))
    return prefix[:i + 1]


def names_regex(names) -> str:
    """A regex for a set of names: their common prefix and suffix once, the rest alternatives
    (``ffn_(?:gate|up)\\.weight``)."""
    names = sorted(set(names))
    if len(names) == 1:
        return _escape(names[0])
    prefix = _cut_prefix(os.path.commonprefix(names))
    rests = [n[len(prefix):] for n in names]
    suffix = os.path.commonprefix([r[::-1] for r in rests])[::-1]
    cut = next((i for i, c in enumerate(suffix) if c in "._"), len(suffix))
    suffix = suffix[cut:]
    middles = [r[:len(r) - len(suffix)] for r in rests]
    if not all(middles):
        prefix, suffix, middles = "", "", names
    return _escape(prefix) + "(?:" + "|".join(map(_escape, middles)) + ")" + _escape(suffix)


def compact_rules(groupset: GroupSet, choice: dict[str, QuantType]) -> list[tuple[str, QuantType]]:
    """Few regex rules giving every group the type ``choice[group.key]`` asks for (see the module doc)."""
    chosen = groupset.chosen(choice)
    # a rule is its type, its layers and the names after "blk.N." it matches there: it stands for
    # the product layers x names, which must be its own tensors (or names no tensor has).  Start
    # with one rule per group, then merge rules of one type whose names agree (a kind's layers, as
    # people write them), then those whose layers agree (kinds taking one type in the same layers):
    # a union of products sharing a side is again such a product
    rules = []
    for index, (group, option) in enumerate(chosen):
        rest = {n[len(f"blk.{layer_of(n)}."):] for n in group.tensors} if group.layers else group.tensors
        rules.append(_Rule(option.qtype, index, set(group.layers)).add(index, rest, group.tensors))
    rules = _merged(rules, lambda r: frozenset(r.names))
    rules = _merged(rules, lambda r: frozenset(r.layers))
    out = []
    names = [n for g in groupset.groups for n in g.tensors] + list(groupset.kept)
    for rule in sorted(rules, key=lambda r: (r.first, min(r.layers, default=-1))):
        for part in _bounded_parts(rule):
            out.append((_anchored(_rule_pattern(part), part, names), part.qtype))
    return out


def _rule_pattern(rule: "_Rule") -> str:
    if rule.layers:
        return rf"blk\.{layers_regex(rule.layers)}\.{names_regex(rule.names)}"
    return names_regex(rule.names)


def _bounded_parts(rule: "_Rule") -> list["_Rule"]:
    """The rule, or where its layer and name alternatives together make a pattern whose matching
    work tensor_regex refuses (scattered layers times many names), one rule per name."""
    try:
        backtracking_paths(_rule_pattern(rule))
        return [rule]
    except UnboundedRegex:
        if len(rule.names) < 2:
            raise
    parts = []
    for name in sorted(rule.names):
        part = _Rule(rule.qtype, rule.first, set(rule.layers))
        part.add(rule.first, [name], [t for t in rule.tensors if t.endswith("." + name)])
        parts.append(part)
    return parts


class _Rule:
    def __init__(self, qtype: QuantType, first: int, layers: set):
        self.qtype, self.first, self.layers = qtype, first, layers
        self.names: set[str] = set()
        self.tensors: set[str] = set()

    def add(self, first: int, names, tensors) -> "_Rule":
        self.first = min(self.first, first)
        self.names |= set(names)
        self.tensors |= set(tensors)
        return self


def _merged(rules, key) -> list[_Rule]:
    """Layer rules of one type with the same ``key`` as one rule (the others as they are)."""
    out: dict[tuple, _Rule] = {}
    for i, r in enumerate(rules):
        k = (r.qtype, key(r)) if r.layers else (i,)
        if k in out:
            out[k].layers |= r.layers
            out[k].add(r.first, r.names, r.tensors)
        else:
            out[k] = r
    return list(out.values())


def _anchored(pattern: str, rule: _Rule, names: list[str]) -> str:
    """``pattern``, anchored at the start (and the end) where it must be to match exactly its tensors."""
    for candidate in (pattern, f"^{pattern}", f"^{pattern}$"):
        regex = compile_bounded(candidate, "recipe rule")
        if {n for n in names if regex.search(n)} == rule.tensors:
            if candidate.lower() != candidate:
                break
            return candidate
    odd = sorted(n for n in names if n.lower() != n)
    if odd:
        raise QuantkitError(f"tensor names with upper-case letters ({', '.join(odd[:3])}) cannot all be told apart "
                            f"by recipe patterns, which mainline llama-quantize lower-cases")
    raise RuntimeError(f"recipe rule {pattern}={type_name(rule.qtype)} does not match exactly "
                       f"{sorted(rule.tensors)[:3]}")


def recipe_text(rules, header=()) -> str:
    """A ``--custom-q`` recipe file: the header lines as comments, then one ``regex=type`` a line."""
    lines = [f"# {h}" if h else "#" for line in header for h in str(line).splitlines() or [""]]
    lines += [f"{pattern}={type_name(qtype)}" for pattern, qtype in rules]
    return "\n".join(lines) + "\n"


def tensor_type_file_text(rules) -> str:
    """Mainline llama-quantize's ``--tensor-type-file``: ``regex=type`` items, one a line, no comments."""
    return "".join(f"{pattern}={type_name(qtype)}\n" for pattern, qtype in rules)


def custom_q_arg(rules) -> str:
    """The rules as one ``--custom-q`` argument of ik_llama.cpp's llama-quantize, which takes them
    comma-separated (no pattern holds a comma)."""
    return ",".join(f"{pattern}={type_name(qtype)}" for pattern, qtype in rules)


def check_reproduces(model, rules, choice_types: dict[str, QuantType], flavor: str):
    """Raise QuantkitError unless the planner, given ``rules`` as a ``--custom-q`` file and as a
    ``--tensor-type-file``, writes every tensor of ``choice_types`` as that type and keeps every
    other tensor as it is; returns the ``--custom-q`` form's plan."""
    text = recipe_text(rules)
    forms = [("--custom-q", parse_recipe_text(text, "recipe")),
             ("--tensor-type-file", [parse_tensor_type(item, f"tensor-type-file:{i}")
                                     for i, item in enumerate(tensor_type_file_text(rules).split(), 1)])]
    plans = []
    for form, parsed in forms:
        recipe = Recipe(parsed, "\n".join(map(str, parsed)))
        plan = make_plan(model.tensors, PlanOptions(recipe=recipe, flavor=flavor, allow_requantize=True))
        plans.append(plan)
        wrong = []
        planned = {tp.name for tp in plan.tensors}
        for tp in plan.tensors:
            want = choice_types.get(tp.name)
            if want is None and tp.action != "copy":
                wrong.append(f"{tp.name}: the recipe makes it {type_name(tp.dst_type)}, the choice keeps it")
            elif want is not None and tp.dst_type != want:
                wrong.append(f"{tp.name}: the recipe makes it {type_name(tp.dst_type)}, the choice "
                             f"{type_name(want)}")
        wrong += [f"{n}: no such tensor" for n in choice_types if n not in planned]
        if wrong:
            raise QuantkitError(f"the recipe ({form}) does not reproduce the chosen types: " + "; ".join(wrong[:3])
                                + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    return plans[0]


__all__ = ["compact_rules", "recipe_text", "tensor_type_file_text", "custom_q_arg", "check_reproduces", "layers_regex", "names_regex"]
