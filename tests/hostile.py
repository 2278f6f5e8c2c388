"""The clean-refusal contract that every hostile or careless input must meet, as test helpers.

A refusal is: exit status 1, exactly one non-empty line on stderr, no traceback, no ``internal
error`` (that is for real bugs), no crash signal; every input file is unchanged (hashed before and
after) and no output or partial file is left behind.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args, cwd=None, env=None, timeout=600, input=None):
    """The real console entry point in a fresh interpreter, as a user runs it: (rc, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=timeout, input=input,
                       env=None if env is None else {**os.environ, **env})
    return p.returncode, p.stdout, p.stderr


def without_progress(err: str) -> str:
    """stderr less the progress lines a piped run prints before it stops (quantkit.progress):
    the error, warnings, notes."""
    from quantkit.progress import LOG_LINE
    return "\n".join(line for line in err.splitlines() if not LOG_LINE.match(line)).strip()


def assert_refused(rc: int, out: str, err: str, *needles: str) -> str:
    """rc 1, one line on stderr naming every needle, no traceback and no internal error; the line.
    Progress lines before it (a piped run prints a line per tensor or chunk: quantkit.progress)
    are not part of the refusal."""
    assert rc == 1, f"rc {rc} (a negative rc is a crash signal)\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert "Traceback" not in err + out, err
    assert "internal error" not in err, err
    lines = [line for line in without_progress(err).splitlines() if line.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Snapshot:
    """Every regular file under some directories (and some single files), with hash, size, mode
    and link target: ``unchanged()`` checks that nothing was written, added, removed or replaced."""

    def __init__(self, *roots: Path):
        self.roots = [Path(r) for r in roots]
        self.before = self._take()

    def _take(self) -> dict[str, tuple]:
        state = {}
        for root in self.roots:
            paths = [root] if not root.is_dir() else sorted(p for p in root.rglob("*"))
            for p in paths:
                st = os.lstat(p)
                if p.is_symlink():
                    state[str(p)] = ("link", os.readlink(p))
                elif p.is_file():
                    state[str(p)] = ("file", digest(p), st.st_size, st.st_mode, st.st_ino)
                else:
                    state[str(p)] = ("other", st.st_mode, st.st_ino)
        return state

    def changes(self) -> list[str]:
        after = self._take()
        out = [f"removed {k}" for k in self.before.keys() - after.keys()]
        out += [f"added {k}" for k in after.keys() - self.before.keys()]
        out += [f"changed {k}" for k in self.before.keys() & after.keys() if self.before[k] != after[k]]
        return sorted(out)

    def assert_unchanged(self) -> None:
        changes = self.changes()
        assert not changes, changes
