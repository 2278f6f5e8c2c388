"""The runtime computes through one ops interface (runtime/ops.py, issue 24 item 5).

Both backends (ops_cpu, a module; ops_torch.TorchOps) provide every operation of ``ops.Ops`` with its
parameters, and the code above them (model, deepseek2, perplexity, collect, warmup, activations, the
wrappers) asks a backend for nothing else.  Parsed and inspected only: no kernel runs.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from quantkit.runtime import ops_cpu
from quantkit.runtime.ops import Ops

RUNTIME = Path(__file__).resolve().parent.parent / "quantkit" / "runtime"
BACKENDS = {"ops.py", "ops_cpu.py", "ops_torch.py"}


def _members() -> set[str]:
    return {n for n in vars(Ops) if not n.startswith("_")} | set(Ops.__annotations__)


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _check_backend(backend) -> list[str]:
    bad = []
    for name in sorted(_members()):
        if not hasattr(backend, name):
            bad.append(f"{name}: missing")
        elif name in Ops.__annotations__:
            if not isinstance(getattr(backend, name), int):
                bad.append(f"{name}: not an int")
        elif _params(getattr(backend, name)) != _params(getattr(Ops, name)):
            bad.append(f"{name}{inspect.signature(getattr(backend, name))}: the interface says "
                       f"{inspect.signature(getattr(Ops, name))}")
    return bad


def test_cpu_backend_implements_the_interface():
    assert not _check_backend(ops_cpu), "\n".join(_check_backend(ops_cpu))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_backend_implements_the_interface():
    from quantkit.runtime.ops_torch import TorchOps
    ops = TorchOps("cpu")
    assert not _check_backend(ops), "\n".join(_check_backend(ops))


def test_the_checker_sees_a_missing_operation_and_another_signature():
    class Partial:
        FUSED_TOKENS, FEW_TOKENS = 4, 8

        def host(self, x):
            return x

        def embed(self, w, ids, extra=1):
            return w

    bad = _check_backend(Partial())
    assert "matmul_q: missing" in bad
    assert any(b.startswith("embed(") for b in bad)
    assert not any(b.startswith(("host", "FUSED_TOKENS")) for b in bad)


def _backend_uses(tree: ast.AST) -> set[str]:
    """Names read from a backend: ``ops.X``, ``<anything>.ops.X`` and ``<anything>._ops.X``."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "ops") or (isinstance(v, ast.Attribute) and v.attr in ("ops", "_ops")):
                used.add(node.attr)
    return used


def test_callers_use_only_the_interface():
    members = _members()
    used: dict[str, set[str]] = {}
    for path in sorted(RUNTIME.glob("*.py")):
        if path.name not in BACKENDS:
            for name in _backend_uses(ast.parse(path.read_text())):
                used.setdefault(name, set()).add(path.name)
    outside = {n: sorted(files) for n, files in used.items() if n not in members}
    assert not outside, f"operations asked of a backend that ops.Ops does not declare: {outside}"
    # and the interface declares nothing that nobody uses (exactly the operations the callers need)
    assert members - set(used) == set(), f"declared but unused: {sorted(members - set(used))}"
    assert {"matmul_q", "attention", "FUSED_TOKENS", "host"} <= set(used)     # the scan sees the calls
