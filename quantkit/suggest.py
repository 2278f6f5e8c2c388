"""'Did you mean …?' for a mistyped name: the nearest known names, compared without regard to case,
'_', '-' or spaces (``q4km`` is ``Q4_K_M``)."""
from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

_IGNORED = re.compile(r"[\s_\-]+")


def _key(name: str) -> str:
    return _IGNORED.sub("", name).lower()


def nearest(text: str, names: Mapping[str, str], n: int = 3) -> list[str]:
    """Up to ``n`` names closest to ``text``, best first.  ``names`` maps each spelling that is
    compared to the name to show for it (an alias to what it stands for); the first spelling of a
    key wins."""
    shown: dict[str, str] = {}
    for spelling, name in names.items():
        shown.setdefault(_key(spelling), name)
    if _key(text) in shown:         # the same name but for case and separators: that one only
        return [shown[_key(text)]]
    out: list[str] = []
    for key in difflib.get_close_matches(_key(text), list(shown), n=len(shown), cutoff=0.6):
        if shown[key] not in out:
            out.append(shown[key])
        if len(out) == n:
            break
    return out


def did_you_mean(text: str, names: Mapping[str, str]) -> str:
    """'did you mean Q4_K_M?' / 'did you mean Q4_K_M or Q4_K_S?', or '' when nothing is close."""
    near = nearest(text, names)
    if not near:
        return ""
    return "did you mean " + (near[0] if len(near) == 1 else ", ".join(near[:-1]) + " or " + near[-1]) + "?"
