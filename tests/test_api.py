"""The library beneath the CLI (quantkit.api): its calls return the objects the commands render,
with the values the commands print, write the bytes the commands write, and raise QuantkitError
for what the commands refuse.  In-process: the CLI through ``main([...])``, stdout captured."""
from __future__ import annotations

import json
import sys

import pytest

import quantkit
from quantkit.cli import _finite, main
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


def test_inspect_model_equals_inspect_json(capsys, llama):
    doc = quantkit.inspect_model(llama)
    assert doc == _cli_json(capsys, "inspect", llama)
    assert doc["totals"]["tensors"] == len(doc["tensors"]) > 0
    with pytest.raises(QuantkitError):
        quantkit.inspect_model(llama.parent / "missing.gguf")


@pytest.fixture(scope="module")
def calib(tmp_path_factory, repo_root):
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text((repo_root / "imatrix" / "calib-gpl3.txt").read_text()[:4000])
    return path


def test_perplexity_and_kld_equal_the_clis(capsys, smollm2_path, calib, tmp_path):
    starts, seen = [], []
    res = quantkit.perplexity(smollm2_path, calib, ctx_size=64, chunks=2, kl_divergence_base=tmp_path / "api.kld",
                              on_start=starts.append, on_chunk=lambda i, r: seen.append((i, r.ppl)))
    doc = _cli_json(capsys, "perplexity", smollm2_path, "-f", calib, "-c", "64", "--chunks", "2",
                    "--kl-divergence-base", tmp_path / "cli.kld")
    assert (res.ppl, res.ppl_error, res.chunk_ppl) == (doc["ppl"], doc["ppl_error"], doc["chunk_ppl"])
    assert starts == [2] and [i for i, _ in seen] == [0, 1] and seen[-1][1] == res.ppl
    assert (tmp_path / "api.kld").read_bytes() == (tmp_path / "cli.kld").read_bytes()
    stats = quantkit.kl_divergence(smollm2_path, tmp_path / "api.kld", chunks=1)
    kld = _cli_json(capsys, "perplexity", smollm2_path, "--kl-divergence-base", tmp_path / "cli.kld",
                    "--kl-divergence", "--chunks", "1")
    assert json.loads(json.dumps(_finite(stats.summary()))) == kld       # the CLI writes NaN as null
    assert kld["kld"]["mean"][0] == pytest.approx(0, abs=1e-3)   # the model against its own logits
    with pytest.raises(QuantkitError, match="more than"):
        quantkit.perplexity(smollm2_path, calib, max_text_bytes=100)


def test_generate_equals_run_json(capsys, smollm2_path):
    pieces = []
    g = quantkit.generate(smollm2_path, "The capital of France is", n_predict=6, temp=0, on_piece=pieces.append)
    doc = _cli_json(capsys, "run", smollm2_path, "-p", "The capital of France is", "-n", "6", "--temp", "0")
    assert (g.prompt, g.prompt_tokens, g.text, g.stats.tokens) == \
        (doc["prompt"], doc["prompt_tokens"], doc["text"], doc["tokens"])
    assert "".join(pieces) == g.text and len(g.stats.tokens) == 6
    with pytest.raises(QuantkitError, match="exceed the context"):
        quantkit.generate(smollm2_path, "The capital of France is", n_predict=6, ctx_size=4)


def test_collect_imatrix_equals_the_clis(capsys, smollm2_path, calib, tmp_path):
    chunks = []
    result = quantkit.collect_imatrix(smollm2_path, calib, tmp_path / "api.gguf", ctx_size=64, chunks=2,
                                      on_chunk=lambda i, nll: chunks.append(i))
    doc = _cli_json(capsys, "imatrix", smollm2_path, "-f", calib, "-o", tmp_path / "cli.gguf", "-c", "64",
                    "--chunks", "2")
    assert {**result.to_json(), "file": doc["file"]} == doc
    assert result.file == tmp_path / "api.gguf" and chunks == [0, 1] and result.entries > 0
    assert (tmp_path / "api.gguf").read_bytes() == (tmp_path / "cli.gguf").read_bytes()
    with pytest.raises(QuantkitError, match="-o"):
        quantkit.collect_imatrix(smollm2_path, calib, calib)


def test_imatrix_files_equal_the_clis(capsys, shared_dir, tmp_path):
    """convert / merge / stats: the files the CLI writes, the figures it prints (--json)."""
    src = shared_dir / "golden" / "imatrix" / "smollm2-q4_1-gpl3.gguf"
    conv = quantkit.convert_imatrix(src, tmp_path / "api.dat")
    capsys.readouterr()
    assert main(["imatrix", "convert", str(src), str(tmp_path / "cli.dat")]) == 0
    assert f"wrote {tmp_path / 'cli.dat'}: {conv.entries} entries, {conv.chunks} chunks of {conv.chunk_size}" \
        in capsys.readouterr().out
    assert (tmp_path / "api.dat").read_bytes() == (tmp_path / "cli.dat").read_bytes()
    merged = quantkit.merge_imatrix([src, tmp_path / "api.dat"], tmp_path / "m.gguf", chunk_size=256)
    assert (merged.inputs, merged.chunks, merged.entries) == (2, 2 * conv.chunks, conv.entries)
    stats = quantkit.imatrix_stats(tmp_path / "m.gguf", top=2)
    assert json.loads(json.dumps(_finite(stats.to_json()))) == \
        _cli_json(capsys, "imatrix", "stats", tmp_path / "m.gguf", "--top", "2")
    assert stats.file == tmp_path / "m.gguf" and all(len(r["top_columns"]) == 2 for r in stats.entries)


def test_list_types_equals_types_json(capsys):
    doc = quantkit.list_types()
    assert doc == _cli_json(capsys, "types")
    assert {"q4_K", "iq4_k"} <= {r["name"] for r in doc["types"]} and doc["aliases"]["Q4_K"] == "Q4_K_M"


def test_warm_kernels_reports_its_steps(capsys):
    steps = []
    w = quantkit.warm_kernels("f16,q8_0", on_step=steps.append)
    assert [s.what for s in w.steps] == [s.what for s in steps] == ["f16", "q8_0"]
    assert w.compiles == sum(s.compiles for s in w.steps) and w.seconds == pytest.approx(sum(s.seconds for s in steps))
    assert w.to_json()["steps"] == [s.to_json() for s in w.steps]
    with pytest.raises(QuantkitError, match="--types: unknown type 'q4km'.*did you mean Q4_K_M"):
        quantkit.warm_kernels(["q4km"])
    with pytest.raises(QuantkitError, match="flavor"):
        quantkit.warm_kernels("f16", flavor="other")


def test_the_namespace_has_every_function():
    for name in quantkit._API:
        assert getattr(quantkit, name) is getattr(quantkit.api, name), name
    assert {"convert_imatrix", "merge_imatrix", "imatrix_stats", "list_types", "warm_kernels"} <= set(dir(quantkit))
