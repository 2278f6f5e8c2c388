"""quantkit.text_table writes the tables of a pipe itself (rich spent ~0.2 s on a 272-row plan): its
lines must be rich's, character for character, and rich must still draw what it lays out itself
(a terminal, colour, a tab or newline in a cell)."""
from __future__ import annotations

import io

import numpy as np
import pytest

from models import write_llama
from quantkit import text_table
from quantkit.cli import main
from quantkit.console import Console
from quantkit.text_table import Column, print_table

COLUMNS = [Column("tensor", overflow="fold"), Column("shape", no_wrap=True), Column("size", "right", no_wrap=True),
           Column("rule / note", overflow="fold")]
# what plan cells hold: ASCII, escapes as cli._shown writes them, the arrows and signs quantkit writes
SIMPLE = list("abc._-0123456789 ") + [r"\x1b", "→", "×", "…", "—"]
# and what rich measures itself: wide (CJK), combining, zero-width and right-to-left characters, tabs
HOSTILE = SIMPLE + ["名", "字", "é", "e\u0301", "\u200b", "ש", "🙂", "\t"]


def _both(title, columns, rows, monkeypatch) -> tuple[str, str]:
    """(text_table's own lines, rich's) for one table, on a pipe without colour."""
    plain, rich = io.StringIO(), io.StringIO()
    print_table(Console(file=plain, highlight=False, markup=False, emoji=False), title, columns, rows)
    with monkeypatch.context() as m:
        m.setattr(text_table, "plain_lines", lambda *a: None)
        print_table(Console(file=rich, highlight=False, markup=False, emoji=False), title, columns, rows)
    return plain.getvalue(), rich.getvalue()


@pytest.mark.parametrize("alphabet", [SIMPLE, HOSTILE], ids=["simple", "hostile"])
def test_plain_lines_are_richs(monkeypatch, alphabet):
    rng = np.random.default_rng(5)

    def text(n):
        return "".join(rng.choice(alphabet) for _ in range(n))
    drawn = []
    real = text_table.plain_lines
    monkeypatch.setattr(text_table, "plain_lines", lambda *a: drawn.append(real(*a) is not None) or real(*a))
    for n_rows in (1, 2, 3, 5, 7, 12, 40):
        rows = [(text(rng.integers(0, 30)), f"{rng.integers(1, 9999)}×{rng.integers(1, 99)}", text(rng.integers(0, 9)),
                 ((text(rng.integers(1, 50)), "dim"), " ", ("+imatrix", "bold"))) for _ in range(n_rows)]
        for title in ("plan", "by rule ", "x" * 7, None):
            plain, rich = _both(title, COLUMNS, rows, monkeypatch)
            assert plain == rich
    # simple cells: every table drawn by text_table itself; hostile ones: left to rich
    assert drawn == [alphabet is SIMPLE] * 28


def test_rich_draws_what_it_lays_out_itself(monkeypatch):
    called = []
    monkeypatch.setattr(text_table, "plain_lines", lambda *a: called.append(1))    # would draw nothing
    screen = type("Terminal", (io.StringIO,), {"isatty": lambda self: True})()
    print_table(Console(file=screen, width=30, color_system=None), "plan", COLUMNS, [("a" * 40, "1", "2", "r")])
    assert not called and "aaaa" in screen.getvalue() and max(map(len, screen.getvalue().splitlines())) <= 30
    coloured = io.StringIO()
    print_table(Console(file=coloured, force_terminal=True, color_system="standard", width=200), "plan", COLUMNS,
                [("a", "1", "2", (("fallback", "yellow"),))])
    assert not called and "\x1b[" in coloured.getvalue()
    monkeypatch.undo()
    plain, rich = _both("plan", COLUMNS, [("two\nlines", "1", "2\tx", "r")], monkeypatch)
    assert plain == rich and "two" in plain and "lines" in plain


def test_a_quantize_plan_prints_as_rich_drew_it(tmp_path, capsys, monkeypatch):
    """The plan, by-type and by-rule tables of a real plan, piped: the same text as rich's."""
    model = write_llama(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320)
    args = ["quantize", str(model), str(tmp_path / "o.gguf"), "Q4_K_M", "--dry-run", "--custom-q",
            "blk\\.1\\.ffn_up.*=q8_0,attn_v=q5_0"]
    assert main(args) == 0
    ours = capsys.readouterr().out
    monkeypatch.setattr(text_table, "plain_lines", lambda *a: None)
    assert main(args) == 0
    assert ours == capsys.readouterr().out
    assert "┃ tensor " in ours and "by rule" in ours and "blk\\.1\\.ffn_up.*=q8_0" in ours
