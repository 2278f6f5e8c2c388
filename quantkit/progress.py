"""How every long command reports its progress: a live bar on a terminal, plain lines in a log.

On a terminal (the console's file is a TTY) a rich bar is drawn and removed when the work ends.
Piped to ``tee``, redirected to a log or run under nohup, a bar is nothing (rich draws none off a
terminal), and a ten-hour quantization would log nothing until its end; so there each step
prints one plain line, flushed at once::

    quantize: [  12/1147] blk.0.attn_q_b.weight bf16 -> iq4_k_r4: 0.4% done, 0:00:41 elapsed, ETA 2:49:02

the command, the step of all steps (a tensor, a chunk), what the step did, then the share of the
work done (by its own measure: bytes read for quantize and repack, chunks for imatrix), the time
elapsed and the time left at the pace so far.  :data:`LINE` matches the start of these lines.
"""
from __future__ import annotations

import re
import time

from .console import interactive

LINE = re.compile(r"^[a-z][a-z -]*: \[ *\d+/\d+\] ")
# the start of every line a long command prints on stderr as it goes (its steps, its notes,
# perplexity's llama-perplexity lines), never of an error ("quantkit: error: ...") or a warning
LOG_LINE = re.compile(r"^(?:quantize|repack|imatrix|perplexity|kl-divergence|kl_divergence|recipe): ")


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    s = max(0, int(seconds + 0.5))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Reporter:
    """Progress of ``steps`` steps on ``console``, as a context manager; :meth:`step` after each.

    ``total``: the measure of the work the share done and the ETA come from (default: the steps),
    in ``unit`` ("bytes" shows sizes and speed on the bar).  ``show=False`` reports nothing (a
    --json run); ``lines=False`` prints no plain lines, for a command that prints its own
    progress lines (perplexity: llama-perplexity's)."""

    def __init__(self, console, what: str, steps: int, total: float | None = None, unit: str = "",
                 show: bool = True, lines: bool = True):
        self.console, self.what, self.steps = console, what, steps
        self.total = steps if total is None else total
        self.unit = unit
        live = show and interactive(console)
        self.mode = "bar" if live else "lines" if show and lines else "off"
        self.done_steps = 0
        self._bar = self._task = None

    def __enter__(self) -> "Reporter":
        self.t0 = time.perf_counter()
        if self.mode == "bar":
            # imported for a bar only (a log's lines need none of rich.progress: ~20 ms of start-up)
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            amount = ((DownloadColumn(), TransferSpeedColumn()) if self.unit == "bytes" else
                      (TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}} {self.unit}"),))
            # stdout is not redirected: what a command prints there (perplexity's line) stays there
            self._bar = Progress(TextColumn("{task.description}", style="cyan", markup=False), BarColumn(),
                                 *amount, TimeRemainingColumn(), console=self.console, transient=True,
                                 redirect_stdout=False, redirect_stderr=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step(self, label: str = "", done: float | None = None) -> None:
        """One more step is done, ``label`` saying what (shown as it is: escape what came from a
        file); ``done``: the work done so far, in ``total``'s measure (default: the steps)."""
        self.done_steps += 1
        done = self.done_steps if done is None else done
        if self.mode == "bar":
            self._bar.update(self._task, completed=done, description=label or self.what)
        elif self.mode == "lines":
            elapsed = self.elapsed
            share = done / self.total if self.total else 1.0
            eta = clock(elapsed * (self.total - done) / done) if done > 0 else "?"
            width = len(str(self.steps))
            self.note(f"[{self.done_steps:>{width}}/{self.steps}] {label + ': ' if label else ''}"
                      f"{100 * share:.1f}% done, {clock(elapsed)} elapsed, ETA {eta}")

    def note(self, text: str) -> None:
        """A line of its own in a log (``what: text``), printed and flushed at once; nothing on
        a terminal, where the bar shows the state."""
        if self.mode == "lines":
            f = self.console.file
            f.write(f"{self.what}: {text}\n")
            f.flush()
