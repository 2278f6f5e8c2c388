"""Recipes: ordered ``regex=type`` rules that pick a tensor's type, ik_llama.cpp ``--custom-q`` style.

Semantics are those of ``llama-quantize --custom-q`` (specs/ik-quants.md §11): each rule's pattern is
*searched* in the tensor name (not anchored: write ``^…$`` yourself), rules are tried in order and the
first match wins.  A recipe is written either as a file, one rule a line::

    # routed experts on CPU
    blk\\.[3-9]\\.ffn_down_exps\\.weight=iq3_k_r4
    token_embd\\.weight=q8_0          # a trailing comment after whitespace

or inline, as ik's comma-separated form ``re1=type1,re2=type2`` (a pattern cannot hold a comma
there), or inline in the file syntax: the published scripts pass ``--custom-q "$custom"`` with the
rules (and comments) one a line.  Each rule splits at its first ``=``.  Type names are
case-insensitive.  Patterns must have bounded matching work (see tensor_regex).

Mainline llama-quantize's ``--tensor-type REGEX=TYPE`` and ``--tensor-type-file F`` give rules too
(:func:`load_tensor_types`), with mainline's semantics: the pattern is lower-cased, then searched in
the name; the first matching rule wins; a tensor a rule claims skips the preset's mix heuristics
(and their layer counters); the rules apply only with a quantized TYPE (llama_tensor_get_type
checks ggml_is_quantized(default_type)); ``--token-embedding-type`` and ``--output-tensor-type``
win over them.  The file holds ``REGEX=TYPE`` items separated by spaces or newlines, nothing else
(mainline reads it with ``file >> arg``: no comments).
"""
from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass

from .errors import QuantkitError
from .tensor_regex import compile_bounded
from .inputs import read_text
from .types import QuantType, type_from_name, type_name, type_name_suggestion

MAX_RECIPE_BYTES = 1 << 20     # published recipes are a few KB

_TRAILING_COMMENT = re.compile(r"\s+#.*$")


@dataclass(frozen=True)
class Rule:
    pattern: str
    qtype: QuantType
    source: str         # "recipe.txt:12" or "--custom-q #3", for messages
    regex: re.Pattern
    tensor_type: bool = False   # mainline's --tensor-type semantics (see parse_tensor_type)

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
        raise QuantkitError(f"{source}: unknown type '{tname}' in rule '{item.strip()}'"
                            f"{type_name_suggestion(tname)}") from None
    return Rule(pattern, qtype, source, compile_bounded(pattern, source))


def parse_recipe_text(text: str, origin: str, line_sep: str = ":") -> list[Rule]:
    """Rules of a recipe file's text; ``origin`` names the file in messages (``origin:line``)."""
    rules = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = _TRAILING_COMMENT.sub("", line).strip()
        if not stripped or stripped.startswith("#"):
            continue
        # a line may itself hold ik's comma form
        for item in stripped.split(",") if "," in stripped and stripped.count("=") > 1 else [stripped]:
            if item.strip():
                rules.append(_parse_rule(item, f"{origin}{line_sep}{lineno}"))
    return rules


def parse_inline(arg: str, index: int) -> list[Rule]:
    """Rules of one inline ``--custom-q "re1=t1,re2=t2"`` argument (ik's comma form)."""
    return [_parse_rule(item, f"--custom-q #{index} item {i}")
            for i, item in enumerate(arg.split(","), 1) if item.strip()]


def _recipe_file_text(arg: str, inline: bool) -> str | None:
    """The text of recipe file ``arg``, or None when ``arg`` (which looks like inline rules) names
    nothing: probing a long inline value as a path fails with ENAMETOOLONG, which means the same."""
    try:
        os.stat(arg)
    except (OSError, ValueError) as e:
        if inline:
            return None
        shown = arg if len(arg) <= 200 else f"{arg[:200]}… ({len(arg)} characters)"
        if isinstance(e, OSError) and e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise QuantkitError(f"--custom-q: recipe file '{shown}': {e.strerror}") from None
        raise QuantkitError(f"--custom-q: recipe file '{shown}' not found") from None
    return read_text(arg, "--custom-q", MAX_RECIPE_BYTES)


def parse_tensor_type(item: str, source: str) -> Rule:
    """One mainline ``--tensor-type`` item (tools/quantize parse_tensor_type): split at the first
    ``=``, the pattern lower-cased (as mainline does, so ``ATTN_Q`` finds ``attn_q``), the type a
    ggml type name in any case."""
    pattern, sep, tname = item.partition("=")
    if not sep:
        raise QuantkitError(f"{source}: expected 'regex=type', got '{item}'")
    if not pattern:
        raise QuantkitError(f"{source}: missing tensor name in '{item}'")
    if not tname:
        raise QuantkitError(f"{source}: missing quantization type in '{item}'")
    try:
        if tname != tname.strip():
            raise ValueError
        qtype = type_from_name(tname)
    except ValueError:
        raise QuantkitError(f"{source}: invalid ggml type '{tname}' in '{item}'"
                            f"{type_name_suggestion(tname)}") from None
    lowered = pattern.lower()
    if lowered != pattern:
        logging.getLogger("quantkit").warning(f"{source}: pattern '{pattern}' lower-cased to '{lowered}', as "
                                              f"llama-quantize does")
    return Rule(lowered, qtype, source, compile_bounded(lowered, source), tensor_type=True)


def load_tensor_types(items: list[str], files: list[str] = ()) -> list[Rule]:
    """Rules of ``--tensor-type`` values (each one ``REGEX=TYPE``), then of ``--tensor-type-file``
    files (items separated by whitespace), in the order given."""
    rules = [parse_tensor_type(item, f"--tensor-type #{i}") for i, item in enumerate(items, 1)]
    for path in files:
        text = read_text(path, "--tensor-type-file", MAX_RECIPE_BYTES)
        for lineno, line in enumerate(text.splitlines(), 1):
            rules += [parse_tensor_type(item, f"{path}:{lineno}") for item in line.split()]
    return rules


def combined(recipe: Recipe | None, tensor_types: list[Rule]) -> Recipe | None:
    """``--custom-q`` rules, then the ``--tensor-type`` rules: the first that matches wins."""
    rules = (recipe.rules if recipe else []) + list(tensor_types)
    return Recipe(rules, "\n".join(str(r) for r in rules)) if rules else None


def load_recipe(args: list[str]) -> Recipe:
    """Build a recipe from ``--custom-q`` values: each is a file path or inline rules (one that holds
    a newline or an ``=`` and names no existing file): several lines in the file syntax, or one line
    in ik's comma form.

    Rules accumulate in the order given, as repeated ``--custom-q`` flags do in llama-quantize.
    """
    rules: list[Rule] = []
    for i, arg in enumerate(args, 1):
        text = _recipe_file_text(arg, inline="=" in arg or "\n" in arg)
        if text is not None:
            rules += parse_recipe_text(text, arg)
        elif "\n" in arg:
            rules += parse_recipe_text(arg, f"--custom-q #{i}", line_sep=" line ")
        else:
            rules += parse_inline(arg, i)
    text = "\n".join(str(r) for r in rules)
    return Recipe(rules, text)
