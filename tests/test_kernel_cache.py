"""numba's on-disk cache of quantkit's kernels is keyed on all of the package's sources (issue 24,
item 6: quantkit/kernel_cache.py), so a kernel compiled before an edit of a helper in another file
never runs after it.

The end-to-end case runs on a copy of the package with one tiny cached kernel added (a kernel in
kernels/ calling an @njit helper defined in another module), in fresh interpreters with a fresh
NUMBA_CACHE_DIR: cheap to compile, and nothing of the suite's own cache is touched."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import pytest
from numba.core import config
from numba.core.caching import CacheImpl, UserProvidedCacheLocator, UserWideCacheLocator
from numba.core.dispatcher import Dispatcher

import quantkit
from quantkit import kernel_cache

HELPER = "from numba import njit\n\n\n@njit\ndef offset():\n    return {}\n"
PROBE = textwrap.dedent("""
    from numba import njit

    from .._probe_helper import offset


    @njit(cache=True)
    def probe(x):
        return x + offset()
""")
RUN = textwrap.dedent("""
    import json
    from numba.core.base import BaseContext
    refreshes = []
    numba_refresh = BaseContext.refresh
    BaseContext.refresh = lambda self: (refreshes.append(1), numba_refresh(self))[1]
    import quantkit
    from quantkit.kernels._probe import probe
    value = probe(1)
    stats = probe.stats
    print(json.dumps({"package": quantkit.__file__, "value": int(value), "path": stats.cache_path,
                      "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                      "refreshes": len(refreshes)}))
""")


def _copy_package(root: Path) -> Path:
    package = root / "quantkit"
    shutil.copytree(Path(quantkit.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_probe_helper.py").write_text(HELPER.format(10))
    (package / "kernels" / "_probe.py").write_text(PROBE)
    return package


def _run(root: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "NUMBA_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)     # cwd: python -c puts it first on sys.path
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_an_edit_in_another_file_recompiles_and_an_unchanged_package_loads(tmp_path):
    package = _copy_package(tmp_path / "src")
    cache = tmp_path / "numba-cache"

    first = _run(tmp_path / "src", cache)
    assert Path(first["package"]).parent == package          # the copy ran, not the worktree
    assert (first["value"], first["misses"]) == (11, 1)
    # NUMBA_CACHE_DIR is where numba keeps it, as it chose without quantkit's locator
    assert Path(first["path"]).parent == cache
    assert list(Path(first["path"]).glob("_probe.probe-*.nbi"))

    assert first["refreshes"] > 0           # numba's compiler readies its contexts

    again = _run(tmp_path / "src", cache)                    # unchanged: loaded, not compiled
    assert (again["value"], again["hits"], again["misses"]) == (11, 1, 0)
    # ... without refreshing numba's target context (its ~0.2 s, kernel_cache._load_overload)
    assert again["refreshes"] == 0

    # a stale index and data file left by older sources (a kernel whose line has moved since)
    folder = Path(first["path"])
    (folder / "_probe.gone-3.py311.nbi").write_bytes(
        pickle.dumps(numba.__version__) + pickle.dumps(("quantkit-sources-old", {})))
    (folder / "_probe.gone-3.py311.1.nbc").write_bytes(b"old")

    # the kernel's own file is untouched: only the helper's module changes
    (package / "_probe_helper.py").write_text(HELPER.format(20))
    edited = _run(tmp_path / "src", cache)
    assert (edited["value"], edited["misses"]) == (21, 1)    # recompiled with the new helper
    assert not (folder / "_probe.gone-3.py311.nbi").exists()     # pruned by the save
    assert not (folder / "_probe.gone-3.py311.1.nbc").exists()
    assert list(folder.glob("_probe.probe-*.nbi"))          # the fresh entry stays

    after = _run(tmp_path / "src", cache)
    assert (after["value"], after["hits"], after["misses"]) == (21, 1, 0)


def _all_modules():
    root = Path(quantkit.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or path.name == "__main__.py":
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_cached_kernel_is_keyed_on_the_package():
    """A module with cache=True kernels that forgot to import kernel_cache before its decorators
    would get numba's per-file stamp back: every cached dispatcher must have quantkit's locator."""
    cached = 0
    for name in _all_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, Dispatcher) and value.__module__ == name and value._cache.cache_path:
                cached += 1
                assert isinstance(value._cache._impl.locator, kernel_cache.PackageLocator), \
                    f"{name}.{value.__name__}"
    assert cached > 50
    assert CacheImpl._locator_classes[0] is kernel_cache.PackageLocator


def _module_function(folder: Path):
    folder.mkdir(parents=True)
    (folder / "mod.py").write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("_kernel_cache_mod", folder / "mod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.f, str(folder / "mod.py")


@pytest.fixture
def package_at(monkeypatch):
    def at(folder):
        monkeypatch.setattr(kernel_cache, "PACKAGE_DIR", folder)
        kernel_cache.package_stamp.cache_clear()
    yield at
    kernel_cache.package_stamp.cache_clear()


def test_unwritable_pycache_falls_back_to_numbas_user_cache(tmp_path, monkeypatch, package_at):
    f, path = _module_function(tmp_path / "pkg")
    (tmp_path / "pkg" / "__pycache__").write_text("")    # no folder can be made there (even as root)
    package_at(tmp_path / "pkg")
    monkeypatch.setattr(config, "CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    locator = kernel_cache.PackageLocator.from_function(f, path)
    assert isinstance(locator._inner, UserWideCacheLocator)
    assert Path(locator.get_cache_path()).is_relative_to(tmp_path / "xdg")
    stamp = locator.get_source_stamp()
    (tmp_path / "pkg" / "other.py").write_text("X = 1\n")   # a new file changes the stamp
    kernel_cache.package_stamp.cache_clear()
    assert locator.get_source_stamp() != stamp


def test_numba_cache_dir_is_respected_and_other_code_is_left_alone(tmp_path, monkeypatch, package_at):
    f, path = _module_function(tmp_path / "pkg")
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "cache"))
    package_at(tmp_path / "pkg")
    locator = kernel_cache.PackageLocator.from_function(f, path)
    assert isinstance(locator._inner, UserProvidedCacheLocator)
    assert Path(locator.get_cache_path()).parent == tmp_path / "cache"
    package_at(tmp_path / "elsewhere")                   # not quantkit's: numba's own locators
    assert kernel_cache.PackageLocator.from_function(f, path) is None


LOCKED_SAVE = textwrap.dedent("""
    import fcntl, json, os
    from numba.core import caching
    import quantkit
    from quantkit import kernel_cache
    held = []
    numba_save_index = caching.IndexDataCacheFile._save_index

    def save_index(self, overloads):
        # another descriptor's non-blocking try fails while the saver holds the directory's lock
        fd = os.open(os.path.join(self._cache_path, kernel_cache.LOCK_NAME), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return numba_save_index(self, overloads)
    caching.IndexDataCacheFile._save_index = save_index
    from quantkit.kernels._probe import probe
    print(json.dumps({"value": int(probe(1)), "float": float(probe(1.5)), "held": held}))
""")


def test_saves_into_a_cache_directory_hold_its_lock(tmp_path):
    """numba's save picks a data file name from the index it read: two processes saving two
    signatures of one kernel at once could share ``.1.nbc`` and leave an index entry that loads the
    other signature's code.  quantkit's saves hold the directory's flock (kernel_cache.directory_lock)."""
    _copy_package(tmp_path / "src")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-c", LOCKED_SAVE], capture_output=True, text=True, env=env,
                       cwd=tmp_path / "src", timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (out["value"], out["float"]) == (11, 11.5)
    assert out["held"] == [True, True]          # both signatures' saves ran under the lock
