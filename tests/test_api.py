"""The library beneath the CLI (quantkit.api): its calls return the objects the commands render,
with the values the commands print, write the bytes the commands write, and raise QuantkitError
for what the commands refuse.  In-process: the CLI through ``main([...])``, stdout captured."""
from __future__ import annotations

import json
import sys

import pytest

import quantkit
from quantkit.cli import main
from quantkit.errors import QuantkitError

from hostile import Snapshot
from models import write_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("m") / "llama.gguf", n_layer=1, n_embd=256, n_ff=256, n_vocab=256)


def _cli_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_import_quantkit_stays_cheap():
    """The functions are loaded on first use: `import quantkit` (the CLI's start-up) loads no numpy."""
    import subprocess
    code = "import sys, quantkit; assert 'numpy' not in sys.modules and 'quantkit.api' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert quantkit.plan_quantize is quantkit.api.plan_quantize
    with pytest.raises(AttributeError):
        quantkit.no_such_function


def test_plan_equals_dry_run_json(capsys, llama, tmp_path):
    recipe = tmp_path / "r.txt"
    recipe.write_text("ffn_down=q8_0\n")
    plan = quantkit.plan_quantize(llama, "Q4_K_M", custom_q=recipe, output_tensor_type="q6_K")
    doc = _cli_json(capsys, "quantize", llama, tmp_path / "unused.gguf", "Q4_K_M", "--custom-q", recipe,
                    "--output-tensor-type", "q6_K", "--dry-run")
    assert plan.to_json() == doc["plan"]
    assert plan.preset.name == "Q4_K_M"
    assert {tp.name: tp.dst_type.name for tp in plan.tensors}["blk.0.ffn_down.weight"] == "Q8_0"
    assert not (tmp_path / "unused.gguf").exists()


def test_written_file_equals_the_clis(capsys, llama, tmp_path):
    steps = []
    result = quantkit.quantize_model(llama, tmp_path / "api.gguf", "q4_0", pure=True, threads=1,
                                     progress=lambda name, done, total: steps.append(name))
    doc = _cli_json(capsys, "quantize", llama, tmp_path / "cli.gguf", "q4_0", "--pure", "--threads", "1")
    assert (tmp_path / "api.gguf").read_bytes() == (tmp_path / "cli.gguf").read_bytes()
    assert result.paths == [tmp_path / "api.gguf"]
    assert result.bytes_written == doc["result"]["bytes_written"] == (tmp_path / "api.gguf").stat().st_size
    assert sorted(steps) == sorted(t["name"] for t in doc["plan"]["tensors"])


def test_open_quantization_plans_then_writes(llama, tmp_path):
    out = tmp_path / "q.gguf"
    with quantkit.open_quantization(llama, out, "q8_0", tensor_type=["attn_q=q4_0"]) as q:
        assert not out.exists() and q.problems == []
        types = {tp.name: tp.dst_type.name for tp in q.plan.tensors}
        result = q.write()
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_k.weight"] == "Q8_0"
    assert out.stat().st_size == result.bytes_written
    assert result.bytes_written > q.plan.bytes_out      # the header and metadata besides the tensors


def test_repack_equals_the_clis(capsys, llama, tmp_path):
    src = tmp_path / "q4k.gguf"
    quantkit.quantize_model(llama, src, "q4_K", pure=True)
    plan = quantkit.plan_repack(src)
    doc = _cli_json(capsys, "repack", src, tmp_path / "unused.gguf", "--dry-run")
    assert plan.to_json() == doc["plan"]
    result = quantkit.repack_model(src, tmp_path / "api.gguf")
    _cli_json(capsys, "repack", src, tmp_path / "cli.gguf")
    assert (tmp_path / "api.gguf").read_bytes() == (tmp_path / "cli.gguf").read_bytes()
    assert result.bytes_written == (tmp_path / "api.gguf").stat().st_size
    with quantkit.open_repack(src) as r:
        assert r.n_moved == sum(t["action"] == "repack" for t in doc["plan"]["tensors"]) > 0


def _write_a_plan_only(model):
    with quantkit.open_quantization(model, None, "q4_0") as q:
        q.write()


@pytest.mark.parametrize("call, needle", [
    (lambda m, o: quantkit.plan_quantize(m), "nothing to do"),
    (lambda m, o: quantkit.plan_quantize(m, "q4_0", include_weights="a", exclude_weights="b"),
     "--include-weights and --exclude-weights cannot be used together"),
    (lambda m, o: quantkit.plan_quantize(m, "q4_0", split_max_size="4G", keep_split=True),
     "--split-max-size and --keep-split cannot be used together"),
    (lambda m, o: quantkit.plan_quantize(m, "q4_0", output_tensor_type="q9_9"),
     "--output-tensor-type: unknown type 'q9_9'"),
    (lambda m, o: quantkit.plan_quantize(m, "COPY", custom_q="x=q4_0"), "TYPE COPY copies every tensor"),
    (lambda m, o: quantkit.quantize_model(m, m, "q4_0"), "OUT"),
    (lambda m, o: quantkit.quantize_model(m, o, "q4_0", split_max_size="lots"), "cannot read size 'lots'"),
    (lambda m, o: quantkit.plan_quantize(m.parent / "missing.gguf", "q4_0"), "missing.gguf"),
    (lambda m, o: quantkit.repack_model(m, o), "nothing to repack"),
    (lambda m, o: _write_a_plan_only(m), "no output file given"),
])
def test_errors_raise_quantkit_error(llama, tmp_path, call, needle):
    before = Snapshot(llama)
    with pytest.raises(QuantkitError) as e:
        call(llama, tmp_path / "out.gguf")
    assert needle in str(e.value)
    before.assert_unchanged()
    assert not (tmp_path / "out.gguf").exists()


def test_a_real_run_stops_where_a_dry_run_reports(llama, tmp_path):
    """Types that need an imatrix: the plan is there, the problem listed, and write() raises it."""
    with quantkit.open_quantization(llama, tmp_path / "o.gguf", "iq2_xxs") as q:
        assert q.plan.tensors and q.problems
        with pytest.raises(QuantkitError, match="imatrix"):
            q.write()
    assert not (tmp_path / "o.gguf").exists()
