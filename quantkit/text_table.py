"""Tables as the commands print them: rich's table on a terminal, the same characters written
directly where rich would only lay them out at their natural width.

A quantize plan is a row per tensor (272 rows for SmolLM2, 1,147 for DeepSeek-V3), and rich spends
~1 ms a row measuring, wrapping and rendering them: ~0.2 s of a small quantize's whole command.
Off a terminal (a pipe, a log: quantkit.console gives such a console unbounded width) and without
colour, rich draws each column at the width of its widest cell and nothing is wrapped, folded or
styled, so :func:`print_table` writes those lines itself: the same title, box (rich's default,
HEAVY_HEAD), padding and justification, character for character (tests/test_text_table.py compares
them with rich's output).  Anywhere else (a terminal, which may be narrower than the table and
folds names; FORCE_COLOR; a cell holding a tab, a newline or a character rich measures itself, such
as a wide or right-to-left one) it is rich.

Cells arrive already escaped (cli._shown: no control characters but tab and newline); a cell is a
string or a sequence of ``(text, style)`` / plain-string parts, whose styles only rich shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .console import UNBOUNDED, interactive

Part = Union[str, tuple]        # text, or (text, style)
Cell = Union[str, Sequence[Part]]


@dataclass(frozen=True)
class Column:
    header: str
    justify: str = "left"           # "left" or "right"
    overflow: str = "ellipsis"      # rich's overflow on a terminal too narrow ("fold": wrap, never cut)
    no_wrap: bool = False


def _plain(cell: Cell) -> str:
    if isinstance(cell, str):
        return cell
    return "".join(p if isinstance(p, str) else p[0] for p in cell)


# the non-ASCII characters quantkit writes in plan cells (arrows, shapes, cut text): one cell wide
# each, laid out by rich as any letter; a cell with any other one (a wide CJK name, combining or
# right-to-left characters, which rich measures and orders itself) is left to rich
SIMPLE = frozenset("→×…—±·−")


def _simple(text: str) -> bool:
    """Printable ASCII and :data:`SIMPLE` only: one terminal cell a character."""
    if text.isascii():
        return text.isprintable()
    return all(c in SIMPLE or (c.isascii() and c.isprintable()) for c in text)


def plain_lines(title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str] | None:
    """rich's rendering of the table at unbounded width without styles, as lines; None where rich
    lays it out itself (no rows, a character not :func:`_simple` in a cell or the title, a title
    wider than the table, a table wider than a pipe's width)."""
    if not rows:
        return None
    texts = [[c.header for c in columns], *rows]
    widths = [0] * len(columns)
    for row in texts:
        for i, text in enumerate(row):
            if not _simple(text):
                return None
            w = len(text)
            if w > widths[i]:
                widths[i] = w
    total = sum(widths) + 3 * len(columns) + 1
    if total > UNBOUNDED or (title is not None and (not _simple(title) or len(title) > total)):
        return None

    def line(cells, left, mid, right):
        parts = []
        for text, w, col in zip(cells, widths, columns):
            if col.justify == "right":      # rich strips a right-justified cell's trailing spaces
                text = text.rstrip()        # (after measuring the column with them)
                parts.append(f" {' ' * (w - len(text))}{text} ")
            else:
                parts.append(f" {text}{' ' * (w - len(text))} ")
        return left + mid.join(parts) + right

    def rule(left, mid, right, fill):
        return left + mid.join(fill * (w + 2) for w in widths) + right
    out = []
    if title is not None:
        title = title.rstrip()             # rich's centring strips it first, as a right justification
        excess = total - len(title)
        out.append(" " * (excess // 2) + title + " " * (excess - excess // 2))
    out.append(rule("┏", "┳", "┓", "━"))
    out.append(line(texts[0], "┃", "┃", "┃"))
    out.append(rule("┡", "╇", "┩", "━"))
    out.extend(line(r, "│", "│", "│") for r in rows)
    out.append(rule("└", "┴", "┘", "─"))
    return out


def print_table(console, title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[Cell]],
                header_style: str = "bold") -> None:
    """Print a table of ``rows`` under ``title`` on ``console`` (a quantkit.console.Console)."""
    if not interactive(console) and console.color_system is None and not console.record:
        lines = plain_lines(title, columns, [[_plain(c) for c in row] for row in rows])
        if lines is not None:
            file = console.file
            file.write("\n".join(lines) + "\n")
            file.flush()
            return
    from rich.table import Table
    from rich.text import Text
    table = Table(title=title, header_style=header_style)
    for c in columns:
        table.add_column(c.header, justify=c.justify, overflow=c.overflow, no_wrap=c.no_wrap)
    for row in rows:
        table.add_row(*(c if isinstance(c, str) else Text.assemble(*c) for c in row))
    console.print(table)
