"""numba's compiles as a user sees them: one line when kernels compile, and a count of the kernels a
piece of code made ready, so that timings can be kept free of them.

numba compiles a kernel on its first call with a new signature, unless its on-disk cache holds it
(every quantkit kernel has ``cache=True``): ``__pycache__`` beside the module where that is
writable, else numba's user cache directory, or NUMBA_CACHE_DIR where it is set; its entries are
keyed on all of quantkit's sources (kernel_cache.py), so an edit of quantkit compiles them again.  A
compile takes seconds (all of a type's kernels: 5-30 s), a load from the cache a few milliseconds.

Which one happens is known for sure only inside numba's ``Dispatcher.compile``: it tries the cache
first and returns on a hit; on a miss it broadcasts the ``"numba:compile"`` event (with the
dispatcher, whose ``_cache.cache_path`` says where the result will be kept) around the compile.  So
the notice listens to that event: it is printed when the first real compile starts, never for a
cache load, and whatever numba's cache locator chose is where it says the kernels go.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

#: where the notice goes (the CLI sets it: a "note:" line on stderr); None: nowhere
notify: Callable[[str], None] | None = None
#: QUANTKIT_COMPILE_NOTICE=0 in the environment silences the notice
ENV_SWITCH = "QUANTKIT_COMPILE_NOTICE"

_lock = threading.Lock()
_outermost: list["CompileLog"] = []     # the announcing scope, while one is open


@dataclass
class CompileLog:
    """What numba compiled (cache misses; a kernel loaded from its cache is not one) within a scope."""
    what: str
    compiles: int = 0           # top-level compiles: a kernel with the helpers compiled inside it is one
    seconds: float = 0.0        # their wall time
    cache: str | None = None    # where numba keeps them (the first one's cache directory)
    announced: bool = False


def _cache_place(dispatcher) -> str | None:
    """Where numba's cache keeps ``dispatcher``'s kernels, as a user would look for it."""
    path = getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
    if not path:
        return None             # not cached: compiled in every process
    path = Path(path)
    if path.name == "__pycache__":      # beside the module (numba's in-tree locator)
        package = Path(__file__).resolve().parent       # the kernels live in its subpackages
        return str(package / "*" / "__pycache__") if package in path.resolve().parents else str(path)
    return str(path.parent)     # NUMBA_CACHE_DIR or numba's user cache dir: one folder per source folder


def cache_place() -> str | None:
    """Where numba's cache keeps quantkit's kernels (as it does for one of them; every module
    normally gets the same kind of place)."""
    from .kernels import floats         # numba with it: the CLI imports this module for every command
    return _cache_place(floats.fp32_to_bf16_rows)


def notice_line(what: str, cache: str | None) -> str:
    if cache is None:
        return f"compiling kernels for {what} (numba cannot cache them: this happens in every run)"
    return f"compiling kernels for {what} — once per install (cached in {cache})"


def _listener(log: CompileLog, say: Callable[[str], None] | None):
    """A listener for numba's "numba:compile" events that fills ``log`` (numba is imported here,
    not with this module: the CLI imports it for commands that compile nothing)."""
    from numba.core import event

    class Listener(event.Listener):
        depth, t0 = 0, 0.0

        def on_start(self, ev):
            self.depth += 1
            if self.depth > 1:              # a helper compiled inside a kernel: part of its compile
                return
            self.t0 = time.perf_counter()
            log.compiles += 1
            if log.cache is None:
                log.cache = _cache_place(ev.data["dispatcher"])
            if not log.announced:
                log.announced = True
                if say is not None:
                    say(notice_line(log.what, log.cache))

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0:
                log.seconds += time.perf_counter() - self.t0
    return Listener()


def _enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "no", "off", "false")


@contextmanager
def announced(what: str) -> Iterator[CompileLog]:
    """Within: when numba starts the first compile (not a load from its cache), say once
    ``compiling kernels for <what> — once per install (cached in …)`` through :data:`notify`.

    ``what`` names what the user asked for (``Q4_K_M (q4_K, q6_K)``, ``the runtime (q8_0)``), not a
    kernel.  Scopes opened inside an open one announce nothing of their own: the outer one has
    said it, once.  Yields the :class:`CompileLog` of the scope."""
    log = CompileLog(what)
    with _lock:
        nested = bool(_outermost)
        if not nested:
            _outermost.append(log)
    if nested:
        log.announced = True            # the open scope speaks for this one
    from numba.core import event
    listener = _listener(log, notify if _enabled() else None)
    try:
        with event.install_listener("numba:compile", listener):
            yield log
    finally:
        if not nested:
            with _lock:
                _outermost.clear()


def ready_kernels() -> int:
    """Kernel signatures this process holds ready in quantkit's modules, compiled or loaded from
    numba's cache: the first use of a kernel with a signature adds one.  The difference across a
    timed region says whether it paid for compiling or loading kernels (0: it did not)."""
    from numba.core.dispatcher import Dispatcher
    total = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "quantkit" or name.startswith("quantkit.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                total += len(value.overloads)
    return total
