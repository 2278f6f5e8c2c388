"""The consoles quantkit prints through, laid out for where their output goes.

On a terminal rich fits tables to the terminal's width.  Off a terminal (piped to ``tee`` or
``less``, redirected to a log, under nohup) rich would draw every table 80 columns wide and cut
what does not fit with "…": rule, note and tensor names (``blk\\…``, ``toke…``) lost from the log.
There the width is unbounded, so each table takes the width its cells need and every name stays
on one line, whole, for grep.  ``COLUMNS`` sets the width of a terminal (rich reads it), not of a
pipe: a process that loaded GNU readline (pytest, IPython, pdb) exports ``COLUMNS=80`` to every
child, which would cut logs again.  On a terminal narrower than a table, columns that hold names
and rules fold (wrap onto the next line) rather than lose their ends.

Whether output goes to a person's terminal is :func:`interactive`: the file is a TTY.
``FORCE_COLOR`` (set in CI logs for colour) makes rich colour a pipe, but a pipe stays a pipe:
no live bar, no cut tables.
"""
from __future__ import annotations

import rich.console

UNBOUNDED = 1 << 20         # the width of a pipe: no table is that wide, so nothing is cut


def interactive(console: rich.console.Console) -> bool:
    """Whether ``console`` writes to a terminal (its file is a TTY)."""
    isatty = getattr(console.file, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:          # a closed file
        return False


class Console(rich.console.Console):
    """A rich console whose width off a terminal is unbounded (decided at each print, since the
    file it writes to, ``sys.stdout`` or ``sys.stderr``, can be replaced)."""

    @property
    def size(self) -> rich.console.ConsoleDimensions:
        dims = super().size
        return dims if interactive(self) else rich.console.ConsoleDimensions(UNBOUNDED, dims.height)

    @size.setter
    def size(self, new_size) -> None:
        rich.console.Console.size.fset(self, new_size)
