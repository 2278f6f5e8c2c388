"""numba compiling, as a user sees it (issue 23, item 7): one line when kernels compile (never when
they load from numba's cache), no compile or cache load inside a timed pass, and ``quantkit
warmup`` to compile ahead of time.

A cold cache is a fresh NUMBA_CACHE_DIR (numba then neither reads nor writes the __pycache__
folders the rest of the suite shares), with a type whose kernels compile in seconds (bf16; f16 and
q8_0 of float rows run numpy alone)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

import quantkit
from hostile import assert_refused, run_cli
from models import write_llama
from quantkit import compiling
from quantkit.cli import main

NOTICE = "compiling kernels for"


def _notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if NOTICE in line]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("compile")
    f32 = write_llama(d / "f32.gguf", n_layer=1, n_embd=256, n_ff=256, n_vocab=256, vocab=True)
    quantkit.quantize_model(f32, d / "q8_0.gguf", "q8_0")
    return {"f32": f32, "q8_0": d / "q8_0.gguf"}


# ---- the notice ----

def test_notice_once_when_cold_then_silent_when_cached(tmp_path, models):
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    env = {"NUMBA_CACHE_DIR": str(cache), "QUANTKIT_COMPILE_NOTICE": "1"}
    rc, out, err = run_cli("quantize", models["f32"], tmp_path / "a.gguf", "bf16", env=env)
    assert rc == 0, err
    lines = _notices(err)
    # the bf16 converter compiles: one line for what was asked
    assert len(lines) == 1, err
    assert lines[0].startswith("note: compiling kernels for BF16 (bf16) — once per install"), lines[0]
    assert str(cache) in lines[0], lines[0]
    assert any(cache.iterdir()), "numba cached nothing in NUMBA_CACHE_DIR"
    # the same kernels again: loaded from the cache, not a word
    rc, out, err = run_cli("quantize", models["f32"], tmp_path / "b.gguf", "bf16", env=env)
    assert rc == 0 and _notices(err) == [], err
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    # warmup compiles what quantize did not use (other flavors, an imatrix) ...
    rc, out, err = run_cli("warmup", "--types", "bf16", env=env)
    assert rc == 0 and len(_notices(err)) <= 1, err
    # ... and a second one finds it all cached
    rc, out, err = run_cli("warmup", "--types", "bf16", "--json", env=env)
    assert rc == 0 and _notices(err) == [], err
    doc = json.loads(out)
    assert [s["what"] for s in doc["steps"]] == ["bf16"] and doc["steps"][0]["compiled"] == 0, doc
    assert doc["cache"] == str(cache), doc


def test_announced_says_it_once_per_scope_and_only_for_compiles(monkeypatch):
    said = []
    monkeypatch.setattr(compiling, "notify", said.append)
    monkeypatch.setenv(compiling.ENV_SWITCH, "1")
    add1, add2 = njit(lambda x: x + 1), njit(lambda x: x + 2)      # not cached: a compile each time
    with compiling.announced("the test's kernels") as log:
        with compiling.announced("an inner step") as inner:
            add1(1)
        add2(2)
    assert log.compiles == 2 and inner.compiles == 1 and log.seconds > 0
    assert said == [compiling.notice_line("the test's kernels", None)], said
    assert "every run" in said[0]           # numba keeps no cache of these: no "once per install"
    with compiling.announced("compiled already") as log:
        add1(3)                             # in the process already: no compile, no word
    assert log.compiles == 0 and len(said) == 1
    monkeypatch.setenv(compiling.ENV_SWITCH, "0")
    with compiling.announced("switched off") as log:
        njit(lambda x: x + 3)(1)
    assert log.compiles == 1 and len(said) == 1


def test_warmup_refuses_an_unknown_type(capsys):
    rc = main(["warmup", "--types", "q8_0,q4km"])
    captured = capsys.readouterr()
    assert_refused(rc, captured.out, captured.err, "--types", "'q4km'", "did you mean Q4_K_M")


def test_warmup_resolves_presets_to_their_mix():
    from quantkit.types import type_name
    from quantkit.warmup import resolve_types
    assert [type_name(t) for t in resolve_types(["Q4_K_M"])] == ["q4_K", "q6_K"]
    assert [type_name(t) for t in resolve_types(["q8_0,F16"])] == ["f16", "q8_0"]


# ---- nothing compiled or loaded inside a timed pass ----
# Each scenario runs in a fresh interpreter, where no kernel is loaded yet (numba's cache is the
# suite's): a pass timed before the warm-up made its kernels ready would load them (ready_kernels
# grows inside it).

_SCENARIO = textwrap.dedent("""
    import json, sys
    import numpy as np
    from quantkit import compiling
    model_path, mode = sys.argv[1], sys.argv[2]
    doc = {}
    def kernels_after(module, name):         # the kernels ready when module.name (a warm-up) returns
        real = getattr(module, name)
        def wrapped(*a, **k):
            log = real(*a, **k)
            doc["after_warm_up"] = compiling.ready_kernels()
            return log
        setattr(module, name, wrapped)
    if mode == "quantize":
        from quantkit import quantize
        from quantkit.cli import main
        kernels_after(quantize, "warm_up_plan")
        doc["before"] = compiling.ready_kernels()
        assert main(["quantize", model_path, sys.argv[3], "q4_0"]) == 0     # (q8_0 of floats: numpy)
        doc["end"] = compiling.ready_kernels()
    else:
        from quantkit.runtime import perplexity as ppl
        from quantkit.runtime.generate import GenerationStats, Sampler, SamplerOptions, generate
        from quantkit.runtime.session import open_session
        with open_session(model_path, threads=2) as s:
            doc["before"] = compiling.ready_kernels()
            if mode == "generate":
                stats = GenerationStats()
                list(generate(s.model, list(range(1, 11)), 4, Sampler(SamplerOptions(temp=0)), stats=stats))
                doc.update(while_timed=stats.kernels_while_timed, end=compiling.ready_kernels(),
                           warm_up_seconds=stats.warm_up_seconds)
            else:
                kernels_after(ppl, "warm_up")
                chunks = [np.arange(1, 33, dtype=np.int64), np.arange(33, 65, dtype=np.int64)]
                doc["after_chunks"] = []
                ppl.perplexity(s.model, chunks, lambda i, r: doc["after_chunks"].append(compiling.ready_kernels()))
    print(json.dumps(doc))
""")


def _scenario(tmp_path, *args) -> dict:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO)
    p = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_generation_is_timed_after_the_warm_up(tmp_path, models):
    doc = _scenario(tmp_path, models["q8_0"], "generate")
    assert doc["end"] > doc["before"], doc          # the warm-up made the kernels ready ...
    assert doc["while_timed"] == 0, doc             # ... so the prompt and the steps only computed


def test_perplexity_chunks_come_after_the_warm_up(tmp_path, models):
    doc = _scenario(tmp_path, models["q8_0"], "perplexity")
    assert doc["after_warm_up"] > doc["before"], doc
    assert doc["after_chunks"] == [doc["after_warm_up"]] * 2, doc


def test_quantize_is_timed_after_the_warm_up(tmp_path, models):
    doc = _scenario(tmp_path, models["f32"], "quantize", tmp_path / "o.gguf")
    assert doc["after_warm_up"] > doc["before"], doc
    assert doc["end"] == doc["after_warm_up"], doc
