"""Recipes: ordered ``regex=type`` rules that pick a tensor's type, ik_llama.cpp ``--custom-q`` style.

Semantics are those of ``llama-quantize --custom-q`` (specs/ik-quants.md §11): each rule's pattern is
*searched* in the tensor name (not anchored: write ``^…$`` yourself), rules are tried in order and the
first match wins.  A recipe is written either as a file, one rule a line::

    # routed experts on CPU
    blk\\.[3-9]\\.ffn_down_exps\\.weight=iq3_k_r4
    token_embd\\.weight=q8_0          # a trailing comment after whitespace

or inline, as ik's comma-separated form ``re1=type1,re2=type2`` (a pattern cannot hold a comma
there).  Each rule splits at its first ``=``.  Type names are case-insensitive.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import QuantkitError
from .types import QuantType, type_from_name, type_name

_TRAILING_COMMENT = re.compile(r"\s+#.*$")


@dataclass(frozen=True)
class Rule:
    pattern: str
    qtype: QuantType
    source: str         # "recipe.txt:12" or "--custom-q #3", for messages
    regex: re.Pattern

    def matches(self, tensor_name: str) -> bool:
        return self.regex.search(tensor_name) is not None

    def __str__(self) -> str:
        return f"{self.pattern}={type_name(self.qtype)}"


@dataclass
class Recipe:
    rules: list[Rule]
    text: str           # normalized text, stored in the output file's metadata

    def match(self, tensor_name: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(tensor_name):
                return rule
        return None

    def __bool__(self) -> bool:
        return bool(self.rules)


def _parse_rule(item: str, source: str) -> Rule:
    pattern, sep, tname = item.partition("=")
    pattern, tname = pattern.strip(), tname.strip()
    if not sep or not pattern or not tname:
        raise QuantkitError(f"{source}: expected 'regex=type', got '{item.strip()}'")
    try:
        qtype = type_from_name(tname)
    except ValueError:
        raise QuantkitError(f"{source}: unknown type '{tname}' in rule '{item.strip()}'") from None
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise QuantkitError(f"{source}: invalid regex '{pattern}': {e}") from None
    return Rule(pattern, qtype, source, regex)


def parse_recipe_text(text: str, origin: str) -> list[Rule]:
    """Rules of a recipe file's text; ``origin`` names the file in messages (``origin:line``)."""
    rules = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = _TRAILING_COMMENT.sub("", line).strip()
        if not stripped or stripped.startswith("#"):
            continue
        # a line may itself hold ik's comma form
        for item in stripped.split(",") if "," in stripped and stripped.count("=") > 1 else [stripped]:
            if item.strip():
                rules.append(_parse_rule(item, f"{origin}:{lineno}"))
    return rules


def parse_inline(arg: str, index: int) -> list[Rule]:
    """Rules of one inline ``--custom-q "re1=t1,re2=t2"`` argument (ik's comma form)."""
    return [_parse_rule(item, f"--custom-q #{index} item {i}")
            for i, item in enumerate(arg.split(","), 1) if item.strip()]


def load_recipe(args: list[str]) -> Recipe:
    """Build a recipe from ``--custom-q`` values: each is a file path or an inline rule list.

    Rules accumulate in the order given, as repeated ``--custom-q`` flags do in llama-quantize.
    """
    rules: list[Rule] = []
    for i, arg in enumerate(args, 1):
        path = Path(arg)
        if "=" not in arg or (path.suffix and path.is_file()):
            if not path.is_file():
                raise QuantkitError(f"--custom-q: recipe file '{arg}' not found")
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise QuantkitError(f"{arg}: cannot read recipe: {e}") from None
            rules += parse_recipe_text(text, str(arg))
        else:
            rules += parse_inline(arg, i)
    text = "\n".join(str(r) for r in rules)
    return Recipe(rules, text)
