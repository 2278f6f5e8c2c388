"""Regexes from recipes and options, searched in tensor names, with a bound on the matching work.

Python's ``re`` backtracks and has no time limit: ``(a+)+$`` searched in a 63-byte name runs for
minutes, ``.*a.*a.*a.*b`` for 40 ms per name (a minute over a 1,000-tensor model and a few rules).
A pattern comes from a file or the command line, so it is checked before use, statically on the
parse tree ``re`` itself builds (deterministic, no timer, works in any thread): the number of ways a
backtracking match can split one name among the pattern's quantifiers, for a name of
``NAME_LENGTH`` characters (GGUF names have at most 63 bytes), must stay within ``MAX_PATHS``.

* a quantifier over one character (``.*``, ``[0-9]+``, ``\\d{1,3}``) or over a fixed string
  (``(ab)+``) can stop at up to NAME_LENGTH + 1 places: it multiplies the count by that;
* ``?`` and alternations (``(gate|up)``) add their alternatives;
* a repeated group that can itself match in several ways (``(a+)+``, ``(a|ab)*``, nested
  quantifiers: exponential) is refused unless its repeat count is small and fixed;
* the last quantifier of a pattern is never backtracked into (nothing after it can fail).

MAX_PATHS allows two unbounded quantifiers in a row (``blk\\..*\\.ffn_.*_exps``: 0.1 ms per name at
worst), which covers every published recipe and ``--override-tensor``; three (``.*.*.*b``) are
refused.  Backreferences are refused (matching them is NP-hard in general).
"""
from __future__ import annotations

import re
import re._constants as sre       # the parse tree of Python's own regex compiler (stable since 3.11)
import re._parser as sre_parse

from .errors import QuantkitError

NAME_LENGTH = 63                  # GGML_MAX_NAME less its NUL: the longest tensor name
MAX_PATHS = (NAME_LENGTH + 1) ** 2

_ONE_CHAR = {sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN}
_ZERO_WIDTH = {sre.AT}
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}


class UnboundedRegex(ValueError):
    """A pattern whose backtracking work cannot be bounded; the message says why."""


def _seq_paths(items, last_is_free: bool) -> int:
    total = 1
    for i, (op, av) in enumerate(items):
        total *= _item_paths(op, av, free=last_is_free and i == len(items) - 1)
        if total > MAX_PATHS:
            raise UnboundedRegex("too many quantifiers or alternatives in a row")
    return total


def _item_paths(op, av, free: bool = False) -> int:
    if op in _ONE_CHAR or op in _ZERO_WIDTH:
        return 1
    if op == sre.BRANCH:
        return sum(_seq_paths(alt, free) for alt in av[1])
    if op == sre.SUBPATTERN:
        return _seq_paths(av[3], free)
    if op == sre.ATOMIC_GROUP:
        return _seq_paths(av, False)
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return _seq_paths(av[1], False)
    if op in _REPEATS:
        return _repeat_paths(*av, free=free)
    if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
        raise UnboundedRegex("backreferences are not supported")
    raise UnboundedRegex(f"unsupported construct {op}")


def _repeat_paths(lo: int, hi: int, body, free: bool) -> int:
    body_paths = _seq_paths(body, False)
    width_lo, width_hi = body.getwidth()
    if hi <= 1:                                     # x? or x{1}: the body, or the body and nothing
        return body_paths + (1 if lo == 0 else 0)
    if body_paths == 1 and width_lo == width_hi:   # one way per count: .*, [0-9]+, (ab){2,}
        return 1 if free else min(hi, NAME_LENGTH) - min(lo, NAME_LENGTH) + 1
    if hi == sre.MAXREPEAT or hi > NAME_LENGTH:
        raise UnboundedRegex("a repeated group can match in several ways (nested quantifiers or an "
                             "alternation under * or +: exponential backtracking)")
    paths = 0
    for count in range(lo, hi + 1):                 # several ways per round, a bounded number of rounds
        paths += body_paths ** count
        if paths > MAX_PATHS:
            raise UnboundedRegex("a repeated group with alternatives multiplies them too often")
    return paths


def backtracking_paths(pattern: str, flags: int = 0) -> int:
    """The static bound on the ways a match of ``pattern`` can split a name (see the module doc);
    raises UnboundedRegex (or re.error for a pattern that does not compile)."""
    tree = sre_parse.parse(pattern, flags)
    return _seq_paths(tree.data, last_is_free=True)


def _shown(pattern: str, limit: int = 200) -> str:
    return pattern if len(pattern) <= limit else f"{pattern[:limit]}… ({len(pattern)} characters)"


def compile_bounded(pattern: str, where: str) -> re.Pattern:
    """``re.compile(pattern)`` for a pattern searched in tensor names, once its matching work is
    known to be bounded; anything else is a user error naming ``where`` and the pattern."""
    try:
        regex = re.compile(pattern)
        backtracking_paths(pattern)
    except re.error as e:
        raise QuantkitError(f"{where}: invalid regex '{_shown(pattern)}': {e}") from None
    except (RecursionError, OverflowError) as e:
        raise QuantkitError(f"{where}: invalid regex '{_shown(pattern)}': too large or too deeply nested "
                            f"({e})") from None
    except UnboundedRegex as e:
        raise QuantkitError(f"{where}: regex '{_shown(pattern)}' refused: {e}; its matching time could grow "
                            f"without bound (write it with at most two unbounded quantifiers such as .* in a "
                            f"row, and none nested)") from None
    return regex
