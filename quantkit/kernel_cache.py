"""numba's on-disk cache keyed on all of quantkit's sources, so that a stale kernel never runs.

numba keeps a ``cache=True`` kernel under a stamp of the one source file that defines it (a hash of
its bytes), and the index key adds the function's own bytecode and numba's target (``magic_tuple``:
the CPU name and features).  An edit anywhere else (an ``@njit`` helper the kernel calls, a constant
table, the LLVM IR strings of runtime/dot.py, quantkit/cpu.py's feature choice) leaves that stamp
alone, and the kernel compiled from the old code would keep running.

Here every quantkit kernel's stamp is instead a hash of all of the package's ``.py`` files and grids.npz (paths and
bytes), computed once per process, when the first cached kernel is defined (4-13 ms measured for
~90 files, 1 MB; numba's own import takes ~600 ms).  So any edit in quantkit/ makes every cached
kernel stale, and the next process recompiles what it uses; the target stays in numba's index key.
(A file edited while a process runs is seen by the next process, not by that one.)

How: :func:`install` puts :class:`PackageLocator` first in numba's list of cache locators.  For a
function defined in quantkit it asks numba's own locators which place they would choose
(NUMBA_CACHE_DIR where it is set, else ``__pycache__`` beside the module where that is writable,
else numba's user-wide cache directory) and keeps that place, its file names and everything else;
only the stamp differs.  Functions outside quantkit get numba's locators unchanged.  (A user who
sets NUMBA_CACHE_LOCATOR_CLASSES chooses the locators, and this one with them.)

Old entries: numba treats an index whose stamp differs as empty, and the first save after an edit
rewrites the index with the new stamp and numbers the data files from 1 again, overwriting the old
ones.  What overwriting misses (an index that names a kernel by a line number that has since moved,
the extra data files of an index that held more signatures) is pruned: the first save of a process
into a cache directory deletes the ``.nbi`` indexes there whose numba version or stamp is not the
current one, and the ``.nbc`` data files that no index there owns any more.  Only quantkit's files
are in such a directory (it is quantkit's ``__pycache__``, or a folder numba names after the source
directory), and only ``.nbi`` / ``.nbc`` files are touched.

Loading: numba's ``Cache.load_overload`` first refreshes the whole target context (imports and
installs every typing and lowering registry numba has: ~0.2-0.3 s, most of a small quantize's
kernel loading) although rebuilding a cached library needs none of them: it unpickles the function
descriptor and environment, links the stored object code and asks for the entry point.  The one
thing it needs is numba's runtime (NRT, which allocating kernels call).  :func:`install` makes
quantkit's kernels (those with this locator) load with just that; everything else, and every
compile (numba's compiler refreshes the contexts itself), is numba's own path.

Saving: numba's save reads the index, picks the first free data file name, writes the index, then
the data file; two processes compiling two signatures of one kernel at once (pytest's workers, two
quantize jobs after an upgrade) can both pick ``<base>.1.nbc`` and leave an index whose entry loads
the other signature's code: a kernel that computes garbage.  quantkit's saves (and prunes) hold an
exclusive ``flock`` on ``quantkit-cache.lock`` in the cache directory, so each save sees the index
the previous one wrote.  Loads need no lock: under one stamp a data file name, once in an index, is
only ever rewritten with the same key's data, through a temporary file and a rename.

Every module with ``cache=True`` kernels imports this module before its first decorator (the
kernels package does so in its ``__init__``); tests/test_kernel_cache.py checks that every cached
dispatcher in quantkit got this locator.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import threading
from pathlib import Path

import numba
from numba.core import config
from numba.core.caching import (Cache, CacheImpl, InTreeCacheLocator, UserProvidedCacheLocator, UserWideCacheLocator,
                                _CacheLocator)

#: the package whose sources key the cache
PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def package_stamp() -> str:
    """A hash of every ``.py`` file of the package and of its data the kernels freeze in as
    constants (grids.npz), their relative paths and bytes, once per process."""
    digest = hashlib.sha256()
    sources = [*PACKAGE_DIR.rglob("*.py"), *PACKAGE_DIR.rglob("*.npz")]
    for path in sorted(p for p in sources if "__pycache__" not in p.parts):
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return "quantkit-sources-" + digest.hexdigest()


def _in_package(py_file: str) -> bool:
    return _folder_in(os.path.dirname(py_file), PACKAGE_DIR)


@functools.lru_cache(maxsize=None)
def _folder_in(folder: str, package: Path) -> bool:
    """Whether ``folder`` is ``package`` or inside it (once per folder: ~90 kernels are defined in
    a handful of folders)."""
    try:
        resolved = Path(folder).resolve()
    except OSError:
        return False
    return resolved == package or package in resolved.parents


_pruned: set[str] = set()          # cache directories pruned in this process
_prune_lock = threading.Lock()


def _stale(index: Path) -> bool:
    """Whether numba's index file ``index`` holds another numba version's or another stamp's entries."""
    try:
        with open(index, "rb") as f:
            if pickle.load(f) != numba.__version__:
                return True
            stamp, _ = pickle.loads(f.read())
    except FileNotFoundError:
        return False
    except Exception:           # unreadable: numba could not use it either
        return True
    return stamp != package_stamp()


def prune(cache_dir: str) -> list[str]:
    """Delete the stale indexes (:func:`_stale`) in ``cache_dir`` and the data files no index there
    owns any more; returns the names deleted.  A file another process removes first is skipped."""
    folder = Path(cache_dir)
    removed = []

    def unlink(path: Path):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    try:
        indexes = sorted(folder.glob("*.nbi"))
        data = sorted(folder.glob("*.nbc"))
    except OSError:
        return removed
    for index in indexes:
        if _stale(index):
            unlink(index)
    # a data file is <base>.<n>.nbc beside its index <base>.nbi
    for path in data:
        base = path.name.rsplit(".", 2)[0]
        if not (folder / f"{base}.nbi").exists():
            unlink(path)
    return removed


# numba's locators whose place (and whether it is usable) depends only on the source's folder
_PER_FOLDER = (InTreeCacheLocator, UserProvidedCacheLocator, UserWideCacheLocator)
_chosen: dict[tuple, type] = {}


class PackageLocator(_CacheLocator):
    """numba's choice of place for a quantkit function's cache, stamped with :func:`package_stamp`."""

    def __init__(self, inner: _CacheLocator):
        self._inner = inner

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _in_package(py_file):
            return None
        # numba's from_function checks the place for each kernel (a temporary file written in it):
        # once a folder's kernels have a place, the next kernel of that folder gets the same one
        key = (os.path.dirname(py_file), config.CACHE_DIR, os.environ.get("XDG_CACHE_HOME"),
               tuple(CacheImpl._locator_classes))
        chosen = _chosen.get(key)
        if chosen is not None:
            return cls(chosen(py_func, py_file))
        for locator_class in CacheImpl._locator_classes:
            if locator_class is cls:
                continue
            inner = locator_class.from_function(py_func, py_file)
            if inner is not None:
                if type(inner) in _PER_FOLDER:
                    _chosen[key] = type(inner)
                return cls(inner)
        return None

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def ensure_cache_path(self):
        # numba calls this before every save, i.e. after a compile: the moment to prune what
        # the edit that caused the compile left behind (once per directory and process)
        self._inner.ensure_cache_path()
        path = self.get_cache_path()
        with _prune_lock:
            if path in _pruned:
                return
            _pruned.add(path)
        prune(path)

    def get_source_stamp(self):
        return package_stamp()

    def get_disambiguator(self):
        return self._inner.get_disambiguator()


#: the file whose flock serializes quantkit's saves into one cache directory
LOCK_NAME = "quantkit-cache.lock"


@contextlib.contextmanager
def directory_lock(cache_dir: str):
    """An exclusive ``flock`` on :data:`LOCK_NAME` in ``cache_dir`` while the block runs (between
    processes; numba's compiler lock already serializes a process's threads).  Where the lock file
    cannot be opened or the system has no flock, the block runs unlocked, as numba's own saves do."""
    try:
        import fcntl
        fd = os.open(os.path.join(cache_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                # closing the descriptor releases the lock


_numba_load_overload = Cache.load_overload
_numba_save_overload = Cache._save_overload if hasattr(Cache, "_save_overload") else None


def _load_overload(self, sig, target_context):
    """``Cache.load_overload`` for quantkit's kernels without the target context's refresh (the
    module docstring says why): numba's runtime made ready, then numba's own load from the cache."""
    if not isinstance(getattr(self._impl, "locator", None), PackageLocator):
        return _numba_load_overload(self, sig, target_context)
    from numba.core.runtime import rtsys
    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


def _save_overload(self, sig, data):
    """numba's ``Cache._save_overload`` for quantkit's kernels under :func:`directory_lock` (the
    module docstring says why)."""
    locator = getattr(self._impl, "locator", None)
    if not isinstance(locator, PackageLocator):
        return _numba_save_overload(self, sig, data)
    locator._inner.ensure_cache_path()          # the directory exists before its lock file
    with directory_lock(locator.get_cache_path()):
        return _numba_save_overload(self, sig, data)


def install() -> None:
    """Put :class:`PackageLocator` first in numba's cache locators, and load quantkit's kernels
    without refreshing numba's target context (once)."""
    if PackageLocator not in CacheImpl._locator_classes:
        CacheImpl._locator_classes.insert(0, PackageLocator)
    # numba's private load steps (numba >= 0.49): another numba without them keeps its own load
    if hasattr(Cache, "_load_overload") and hasattr(Cache, "_guard_against_spurious_io_errors"):
        Cache.load_overload = _load_overload
    if _numba_save_overload is not None:
        Cache._save_overload = _save_overload


install()
