"""The import graph of quantkit/ runs one way (issue 24 item 5).

Every module is parsed with ``ast`` (nothing is imported: the test costs milliseconds); every import
of a quantkit module counts, those inside functions too.  The graph is drawn between *units*: a
subpackage (quantkit.formats, quantkit.kernels, ...) or a top-level module (quantkit.plan, ...), and
the units sit in the layers below, from the top down.  An import may go to its own unit or to a unit
of a lower layer, never sideways or up; so there is no cycle between units either.

Direction, from what the code does: formats/ holds the numpy references and the registry and calls
the numba kernels of kernels/ (formats -> kernels); kernels import no formats.  gguf_io reads and
writes files and sits above both (the brief's "gguf_io -> formats -> kernels"; today it needs neither).
The value tables both layers read live in the leaf quantkit.tables.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"

# From the top down.  Each entry: (layer name, its units).  A unit is a module or a package prefix;
# a module belongs to the longest unit that prefixes it.
LAYERS: list[tuple[str, list[str]]] = [
    ("entry point", ["quantkit.__main__"]),
    ("cli: parses and renders", ["quantkit.cli"]),
    # the package's namespace re-exports the library beneath the CLI (quantkit.quantize_model, …)
    ("package namespace", ["quantkit"]),
    ("library API", ["quantkit.api"]),
    ("commands over the library", ["quantkit.warmup", "quantkit.catalog", "quantkit.imatrix_tools"]),
    # the recipe search: groups -> sensitivity (through workers) -> solve -> emit -> speed
    ("recipe search", ["quantkit.recipe_search"]),
    # the recipe search: its rules written from the groups; the groups of tensors and their candidate
    # types, from the planner and speed
    ("recipe rules", ["quantkit.recipe_emit"]),
    ("recipe groups", ["quantkit.groups"]),
    # group sensitivities from quantizing (quantize pipeline) and measuring (runtime)
    ("sensitivity", ["quantkit.sensitivity"]),
    # hf/ (reading HF checkpoints) and runtime/ both tokenize with quantkit.text, below them both
    ("runtime, HF checkpoints and the quantize pipeline", ["quantkit.runtime", "quantkit.hf", "quantkit.quantize",
                                                           "quantkit.repack", "quantkit.imatrix", "quantkit.describe",
                                                           "quantkit.speed"]),
    # quantize --resume: the journal and verified partials the quantize pipeline writes through
    ("resumable outputs", ["quantkit.resume"]),
    ("vocabulary, tokenizer and chat templates", ["quantkit.text"]),
    ("GGUF files and the plan", ["quantkit.gguf_io", "quantkit.plan"]),
    ("formats (numpy references, registry) and policy", ["quantkit.formats", "quantkit.outputs",
                                                         "quantkit.presets", "quantkit.recipes",
                                                         "quantkit.compiling", "quantkit.placement",
                                                         "quantkit.sensitivity_cache"]),
    # quantkit.mixes: named mixes (Q4_X) the presets resolve like a TYPE
    ("kernels (numba) and small helpers", ["quantkit.kernels", "quantkit.inputs", "quantkit.mixes",
                                           "quantkit.kv_override", "quantkit.prune",
                                           "quantkit.tensor_regex", "quantkit.progress",
                                           "quantkit.sizes", "quantkit.workers",
                                           # the recipe search's exact knapsack solver (numpy only)
                                           "quantkit.solve"]),
    # each type's block layout as data, which formats (the reference decoder), the runtime (fused
    # products) and kernels may all read; it reads the type table and the value tables only
    ("block layouts", ["quantkit.layouts"]),
    # the kernels freeze type ids and block sizes from the one table of types
    ("the type table", ["quantkit.types"]),
    # leaves: they import no quantkit module (test_leaves_import_nothing)
    ("leaves", ["quantkit.errors", "quantkit.row_threads", "quantkit.kernel_cache", "quantkit.version", "quantkit.tables", "quantkit.grids", "quantkit.cpu", "quantkit.signals", "quantkit.omp_wait",
                "quantkit.suggest", "quantkit.words", "quantkit.console", "quantkit.perplexity_log",
                "quantkit.gguf_io.constants"]),
]

# Imports inside functions that stay, each with why.  Any other one fails the test: an import that
# dodges a cycle is fixed by breaking the cycle.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    ("quantkit.formats", "quantkit.formats._all"):
        "start-up time: the format modules register on first use; `quantkit repack` needs only the "
        "interleave kernels (formats.registered's docstring)",
    ("quantkit.formats", "quantkit.formats.repacked"):
        "start-up time: an interleaved type's format is registered once its plain type's module is "
        "imported on first use (formats.FORMAT_MODULES)",
    ("quantkit.formats._base", "quantkit.formats.decode"):
        "start-up time: the reference decoder and the kernel modules it takes tables from are imported "
        "by the reference path only (formats._base.reference_decoder), not by every quantize",
    ("quantkit.formats.legacy", "quantkit.kernels.legacy"):
        "start-up time: registering Q8_0 (numpy's quantizer, formats/q8_0_numpy.py) imports no numba, "
        "so a q8_0 quantize of a float model never pays for it; the other legacy types' kernels do",
    ("quantkit.formats.floats", "quantkit.kernels.floats"):
        "start-up time: F16/BF16 decode in numpy; only encoding BF16 needs the kernel (and numba)",
    ("quantkit.quantize", "quantkit.formats.interleave"):
        "start-up time: the shuffle kernels (and numba) only for a plan that repacks; "
        "api.open_quantization imports quantize for every quantize, a refused one too",
    ("quantkit.compiling", "quantkit.kernels.floats"):
        "start-up time: cli.main imports compiling for every command, and the kernels bring numba "
        "(~0.3 s), which `--help`, `inspect` or `types` never need",
    ("quantkit.runtime.session", "quantkit.runtime.ops_torch"):
        "optional dependency: torch is imported only for --device cuda / torch-cpu",
    ("quantkit.runtime.triton_qmm", "quantkit.runtime.triton_qmm.registry"):
        "optional dependency: the family decoders are @triton.jit functions, so triton is imported on "
        "the first supports()/kernel call, never by importing the package (triton missing: supports() is False)",
    ("quantkit.runtime.triton_qmm", "quantkit.runtime.triton_qmm.template"):
        "optional dependency: the kernels are @triton.jit functions, imported on the first launch",
    ("quantkit.text.tokenizer", "quantkit.text.chat"):
        "start-up time of an optional feature: chat.py is built on Jinja2 (50 ms to import), which only "
        "chat templates need (`run --chat`); where it is missing, the error says how to install it",
}
# The CLI's lazy imports keep `quantkit --help` and every command's start-up cheap (no numba); the
# library API the CLI calls, and the package namespace that re-exports it, import lazily for the same
# reason (the CLI imports quantkit.api at start-up).
FUNCTION_LEVEL_ALLOWED_MODULES = {"quantkit.cli", "quantkit.api", "quantkit"}


@dataclass(frozen=True)
class Import:
    importer: str           # dotted module name
    target: str             # dotted module name (a package's __init__ is the package's name)
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - (node.level - 1)] if is_package else base[:len(base) - node.level]
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def imports() -> tuple[Import, ...]:
    modules = _modules()
    found: list[Import] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        inside = {id(sub) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for sub in ast.walk(fn) if isinstance(sub, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(name, path.name == "__init__.py", node)
                # `from pkg import x`: x is a submodule, or a name defined in pkg itself
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            else:
                continue
            for target in targets:
                imp = Import(name, target, node.lineno, id(node) in inside)
                if (target == "quantkit" or target.startswith("quantkit.")) and imp not in found:
                    found.append(imp)
    return tuple(found)


def unit_of(module: str) -> str:
    units = [u for _, us in LAYERS for u in us if module == u or module.startswith(u + ".")]
    assert units, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return max(units, key=len)


def layer_of(unit: str) -> int:
    return next(i for i, (_, us) in enumerate(LAYERS) if unit in us)


def unit_graph() -> dict[str, dict[str, list[Import]]]:
    graph: dict[str, dict[str, list[Import]]] = {}
    for imp in imports():
        a, b = unit_of(imp.importer), unit_of(imp.target)
        if a != b:
            graph.setdefault(a, {}).setdefault(b, []).append(imp)
    return graph


def _where(imp: Import) -> str:
    return f"{imp.importer}:{imp.line} imports {imp.target}" + (" (in a function)" if imp.in_function else "")


def find_cycle(graph: dict[str, dict[str, list]]) -> list[str] | None:
    """A cycle of units (first unit repeated at the end), or None."""
    state: dict[str, int] = {}         # 1 on the stack, 2 done

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (cycle := visit(v, stack)):
                return cycle
        stack.pop()
        state[u] = 2
        return None
    for u in sorted(graph):
        if u not in state and (cycle := visit(u, [])):
            return cycle
    return None


# ---- the graph itself ----

def test_every_module_is_parsed_and_placed():
    modules = _modules()
    assert {"quantkit.cli", "quantkit.formats.kquants", "quantkit.kernels.kquants", "quantkit.gguf_io.reader",
            "quantkit.runtime.collect", "quantkit.tables"} <= set(modules)
    for name in modules:
        unit_of(name)
    units = [u for _, us in LAYERS for u in us]
    assert len(units) == len(set(units)), "a unit is in two layers"
    stale = [u for u in units if not any(m == u or m.startswith(u + ".") for m in modules)]
    assert not stale, f"LAYERS names units that do not exist: {stale}"
    # the parser sees both kinds of import (guards against a test that finds nothing)
    assert any(i.in_function for i in imports()) and any(not i.in_function for i in imports())


def test_no_cycle_between_packages():
    cycle = find_cycle(unit_graph())
    assert cycle is None, "import cycle between units: " + " -> ".join(cycle)


def test_no_cycle_between_modules():
    """Inside a package too, apart from the allow-listed imports (whose reasons name their cycle)."""
    graph: dict[str, dict[str, list[Import]]] = {}
    for imp in imports():
        if imp.importer != imp.target and (imp.importer, imp.target) not in FUNCTION_LEVEL_ALLOWED:
            graph.setdefault(imp.importer, {}).setdefault(imp.target, []).append(imp)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": [], "c": []}, "b": {"c": []}}) is None


def test_every_import_goes_down_the_layers():
    bad = [_where(imp) + f" ({LAYERS[layer_of(a)][0]} -> {LAYERS[layer_of(b)][0]})"
           for a, targets in unit_graph().items() for b, imps in targets.items()
           if layer_of(b) <= layer_of(a) for imp in imps]
    assert not bad, "imports that do not go down the layers:\n" + "\n".join(bad)


# ---- the rules the issue names ----

def _imports_of(prefix: str) -> list[Import]:
    return [i for i in imports() if i.importer == prefix or i.importer.startswith(prefix + ".")]


def test_kernels_import_no_formats():
    bad = [_where(i) for i in _imports_of("quantkit.kernels")
           if i.target == "quantkit.formats" or i.target.startswith("quantkit.formats.")]
    assert not bad, "\n".join(bad)
    # what they do import: themselves, the type table (ids, block sizes) and leaves (cpu features,
    # value tables)
    leaves = set(LAYERS[-1][1])
    allowed = {"quantkit.kernels", "quantkit.types"} | leaves
    assert {unit_of(i.target) for i in _imports_of("quantkit.kernels")} <= allowed


def test_gguf_io_imports_nothing_above_it():
    own = layer_of("quantkit.gguf_io")
    bad = [_where(i) for i in _imports_of("quantkit.gguf_io")
           if unit_of(i.target) not in ("quantkit.gguf_io", "quantkit.gguf_io.constants")
           and layer_of(unit_of(i.target)) <= own]
    assert not bad, "\n".join(bad)


def test_collect_imports_nothing_from_the_top_level():
    """runtime/collect.py works with the runtime and the shared error class only: the imatrix file
    (quantkit.imatrix_tools.RawImatrix.from_stats) is built above it."""
    outside = [i for i in _imports_of("quantkit.runtime.collect") if not i.target.startswith("quantkit.runtime.")]
    assert [i.target for i in outside] == ["quantkit.errors"], "\n".join(_where(i) for i in outside)


def test_the_runtime_computes_through_the_ops_interface():
    """The model and the passes over it (perplexity, imatrix collection, warm-up, mainline rounding)
    reach a backend through ``runtime.ops.Ops`` only: session.py chooses one and hands it down, and
    the torch backend uses the numba one for the tensors it keeps on the CPU."""
    backends = {"quantkit.runtime.ops_cpu", "quantkit.runtime.ops_torch"}
    choosers = {"quantkit.runtime.session", "quantkit.runtime.ops_torch"}
    bad = [_where(i) for i in _imports_of("quantkit.runtime") if i.target in backends and i.importer not in choosers]
    assert not bad, "\n".join(bad)
    users = {i.importer for i in _imports_of("quantkit.runtime") if i.target == "quantkit.runtime.ops"}
    assert {"quantkit.runtime.model", "quantkit.runtime.collect", "quantkit.runtime.activations"} <= users


def test_leaves_import_nothing():
    leaves = set(LAYERS[-1][1])
    bad = [_where(i) for i in imports() if unit_of(i.importer) in leaves
           and unit_of(i.target) != unit_of(i.importer)]
    assert not bad, "\n".join(bad)


def test_no_function_level_imports_beyond_the_allow_list():
    seen = {(i.importer, i.target) for i in imports() if i.in_function}
    bad = [_where(i) for i in imports() if i.in_function and i.importer not in FUNCTION_LEVEL_ALLOWED_MODULES
           and (i.importer, i.target) not in FUNCTION_LEVEL_ALLOWED]
    assert not bad, ("imports inside functions (fix the cycle they dodge, or add them to "
                     "FUNCTION_LEVEL_ALLOWED with the reason):\n" + "\n".join(bad))
    stale = sorted(set(FUNCTION_LEVEL_ALLOWED) - seen)
    assert not stale, f"FUNCTION_LEVEL_ALLOWED lists imports that are gone: {stale}"


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from .formats import interleave\n", [("quantkit.formats.interleave", True)]),
    ("from .errors import QuantkitError\n", [("quantkit.errors", False)]),
    ("from . import formats, __version__\n", [("quantkit.formats", False), ("quantkit", False)]),
])
def test_parser_reads_relative_and_function_level_imports(tmp_path, monkeypatch, source, expected):
    """The parser itself, on a module written for the purpose (placed as quantkit/x.py)."""
    fake = tmp_path / "quantkit"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "errors.py").write_text("")
    (fake / "formats").mkdir()
    (fake / "formats" / "__init__.py").write_text("")
    (fake / "formats" / "interleave.py").write_text("")
    (fake / "x.py").write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    _modules.cache_clear()
    imports.cache_clear()
    try:
        got = [(i.target, i.in_function) for i in imports() if i.importer == "quantkit.x"]
    finally:
        _modules.cache_clear()
        imports.cache_clear()
    assert got == expected
