"""Start-up costs a user pays on every command (issue 28): what a command imports before it does
its job.  The times are measured in bench/startup.py; here the imports that made them are kept out."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models import write_llama

_CHECK = """
import contextlib, io, sys
from quantkit.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main(["--help"]) == 0
    assert main(["inspect", sys.argv[1]]) == 0
    assert main(["inspect", sys.argv[1], "--json"]) == 0
    assert main(["quantize", sys.argv[2], sys.argv[2] + ".out", "q8_0"]) == 1      # no GGUF: refused
assert "numba" not in sys.modules, "a command that compiles nothing imported numba"
from quantkit import formats
from quantkit.types import QuantType
assert formats.can_quantize(QuantType.Q4_K) and formats.can_quantize(QuantType.Q4_K_R4)
loaded = sorted(m for m in sys.modules if m.startswith("quantkit.formats.") or m.startswith("quantkit.kernels."))
for lattice in ("iq2xs", "iq3xs", "iq1"):     # seconds of numpy tables on import
    assert f"quantkit.kernels.{lattice}" not in loaded, loaded
"""


def test_commands_import_only_what_they_use(tmp_path):
    """`--help`, `inspect` and a refused quantize import no numba (~0.3 s); a k-quant's format does
    not import the i-quant modules, which build their lattice tables on import."""
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, n_vocab=256)
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model\n")
    run = subprocess.run([sys.executable, "-c", _CHECK, str(model), str(not_gguf)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_batch_commands_let_openmp_workers_sleep(monkeypatch, tmp_path):
    """quantize and repack set OMP_WAIT_POLICY=passive before their first kernel (quantkit/omp_wait.py:
    spinning workers of two thread teams made quantizing 3-4x slower on a shared machine) and
    OPENBLAS_NUM_THREADS=1, and keep a value the user set."""
    import contextlib
    import io
    import os

    from quantkit.cli import main
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model\n")
    for command in (["quantize", not_gguf, tmp_path / "q.gguf", "q8_0"], ["repack", not_gguf, tmp_path / "r.gguf"]):
        for var, given, want in (("OMP_WAIT_POLICY", None, "passive"), ("OMP_WAIT_POLICY", "active", "active"),
                                 ("OPENBLAS_NUM_THREADS", None, "1"), ("OPENBLAS_NUM_THREADS", "3", "3")):
            if given is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, given)
            with contextlib.redirect_stderr(io.StringIO()):
                assert main([str(a) for a in command]) == 1
            assert os.environ[var] == want, command


_BLAS_CHECK = """
import contextlib, io, os, sys
os.environ.pop("OPENBLAS_NUM_THREADS", None)
from quantkit.cli import main
assert "numpy" not in sys.modules
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main(["quantize", sys.argv[1], sys.argv[1] + ".out", "q8_0"]) == 1      # no GGUF: refused
assert "numpy" in sys.modules
assert len(os.listdir("/proc/self/task")) == 1, "OpenBLAS started threads"
"""


def test_quantize_loads_openblas_with_one_thread(tmp_path):
    """The variable is set before numpy is first imported (else OpenBLAS has started a thread per
    extra core already): after a quantize, the process has no thread but its own."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc to count threads")
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model\n")
    run = subprocess.run([sys.executable, "-c", _BLAS_CHECK, str(not_gguf)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


_Q8_0_CHECK = """
import contextlib, io, sys
from quantkit.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main(["quantize", sys.argv[1], sys.argv[2], "q8_0", "--threads", "2"]) == 0
assert "numba" not in sys.modules, "a q8_0 quantize of an F16 model imported numba"
"""


def test_q8_0_of_a_float_model_imports_no_numba_and_writes_the_kernels_bytes(tmp_path):
    """F16 -> q8_0 (and F32 -> q8_0 for the 1-D norms: copies) runs numpy alone (formats/q8_0_numpy.py,
    quantize.needs_numba): no numba import (~0.3 s of the command).  The file is the one numba's
    kernels write, byte for byte (this process has numba loaded, so formats take the kernel)."""
    import contextlib
    import io

    import numba  # noqa: F401  (the kernel path below)
    import numpy as np

    from quantkit.cli import main
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=512, n_vocab=512, dtype=np.float16)
    numpy_out, kernel_out = tmp_path / "numpy.gguf", tmp_path / "kernel.gguf"
    run = subprocess.run([sys.executable, "-c", _Q8_0_CHECK, str(model), str(numpy_out)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["quantize", str(model), str(kernel_out), "q8_0", "--threads", "2"]) == 0
    assert numpy_out.read_bytes() == kernel_out.read_bytes()


_EXIT_CHECK = """
import gc, runpy, sys
sys.argv = ["quantkit", "--help"]
try:
    runpy.run_module("quantkit", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
assert gc.get_freeze_count() > 10000, gc.get_freeze_count()
"""


def test_the_program_leaves_its_objects_to_the_os():
    """`python -m quantkit` (and the script, cli.run) freezes the run's objects out of the garbage
    collector before the process ends: the interpreter's finalization would otherwise search them
    all for cycles (~15 ms of a q8_0 quantize of a small model)."""
    import tomllib
    from pathlib import Path
    run = subprocess.run([sys.executable, "-c", _EXIT_CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["quantkit"] == "quantkit.cli:run"


_GC_CHECK = """
import contextlib, gc, io, runpy, sys
from quantkit import api, plan
seen = {}
def watch(owner, name, label):
    f = getattr(owner, name)
    def watched(*a, **k):
        seen.setdefault(label, gc.isenabled())
        return f(*a, **k)
    setattr(owner, name, watched)
watch(plan, "make_plan", "planning")
watch(api.Quantization, "write", "writing")
watch(api, "inspect_model", "inspect")
for argv in (["quantize", sys.argv[1], sys.argv[2], "q8_0"], ["inspect", sys.argv[1]]):
    gc.enable()
    sys.argv = ["quantkit", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_module("quantkit", run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    gc.unfreeze()
assert seen == {"planning": False, "writing": True, "inspect": True}, seen
"""


def test_the_program_collects_garbage_while_it_works(tmp_path):
    """cli.run turns the garbage collector off for start-up only: a quantize plans without it
    (~9 ms of collections that find nothing) and writes with it, and other commands run with it."""
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, n_vocab=256)
    run = subprocess.run([sys.executable, "-c", _GC_CHECK, str(model), str(tmp_path / "q.gguf")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
