"""The consoles quantkit prints through, laid out for where their output goes.

On a terminal rich fits tables to the terminal's width.  Off a terminal (piped to ``tee`` or
``less``, redirected to a log, under nohup) rich would draw every table 80 columns wide and cut
what does not fit with "…": rule, note and tensor names (``blk\\…``, ``toke…``) lost from the log.
There the width is unbounded, so each table takes the width its cells need, unless ``COLUMNS``
is set, which is the width then (columns that hold names fold at it rather than cut).

Whether output goes to a person's terminal is :func:`interactive`: the file is a TTY.
``FORCE_COLOR`` (set in CI logs for colour) makes rich colour a pipe, but a pipe stays a pipe:
no live bar, no cut tables.
"""
from __future__ import annotations

import os

import rich.console

UNBOUNDED = 1 << 20         # the width of a pipe: no table is that wide, so nothing is cut


def interactive(console: rich.console.Console) -> bool:
    """Whether ``console`` writes to a terminal (its file is a TTY)."""
    isatty = getattr(console.file, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:          # a closed file
        return False


def pipe_width() -> int:
    """The width of output that goes to no terminal: ``COLUMNS`` when set, else unbounded."""
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else UNBOUNDED


class Console(rich.console.Console):
    """A rich console whose width off a terminal is :func:`pipe_width` (decided at each print,
    since the file it writes to, ``sys.stdout`` or ``sys.stderr``, can be replaced)."""

    @property
    def size(self) -> rich.console.ConsoleDimensions:
        dims = super().size
        return dims if interactive(self) else rich.console.ConsoleDimensions(pipe_width(), dims.height)

    @size.setter
    def size(self, new_size) -> None:
        rich.console.Console.size.fset(self, new_size)
