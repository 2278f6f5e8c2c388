"""`quantkit quantize` and `quantkit inspect` end to end, including every way a run can go wrong."""
from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from quantkit.cli import main, parse_size
from quantkit.errors import QuantkitError

from models import deepseek_v3_tensors, write_llama, write_sparse


def run_cli(*args, cwd=None):
    """Run the real console entry point in a fresh interpreter (as a user would)."""
    p = subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=600)
    return p.returncode, p.stdout, p.stderr


def assert_clean_failure(rc, out, err, *needles):
    assert rc != 0
    assert "Traceback" not in err + out
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("m") / "llama.gguf", n_layer=2, n_embd=256, n_ff=512)


def test_quantize_with_recipe_matches_gguf_py(tmp_path, llama):
    recipe = tmp_path / "r.txt"
    recipe.write_text("token_embd\\.weight=q8_0\nattn_v=f16\nffn_down=q5_1\nattn_k=bf16\n")
    out = tmp_path / "out.gguf"
    rc, stdout, err = run_cli("quantize", llama, out, "q4_0", "--pure", "--custom-q", recipe, "--json", "--threads", "2")
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["result"]["files"] == [str(out)]
    src, dst = gguf.GGUFReader(str(llama)), gguf.GGUFReader(str(out))
    expect = {"token_embd": "Q8_0", "attn_v": "F16", "ffn_down": "Q5_1", "attn_k": "BF16", "output.": "Q4_0",
              "attn_q": "Q4_0", "ffn_up": "Q4_0", "ffn_gate": "Q4_0", "_norm": "F32"}
    src_by = {t.name: t for t in src.tensors}
    for t in dst.tensors:
        want = next(v for k, v in expect.items() if k in t.name)
        assert t.tensor_type.name == want, t.name
        x = np.asarray(src_by[t.name].data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        ref = gguf.quants.quantize(x, t.tensor_type)       # gguf-py: the no-FMA C reference
        np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), ref.view(np.uint8).reshape(-1),
                                      err_msg=t.name)
    f = {k: v.contents() for k, v in dst.fields.items() if not k.startswith("GGUF.")}
    assert f["general.file_type"] == 2 and dst.fields["general.file_type"].types[0] == gguf.GGUFValueType.UINT32
    assert f["general.quantization_version"] == 2
    assert f["quantkit.recipe"] == "token_embd\\.weight=q8_0\nattn_v=f16\nffn_down=q5_1\nattn_k=bf16"
    assert f["llama.block_count"] == 2                      # input metadata kept
    assert f["quantkit.flavor"] == "ik"


def test_dry_run_deepseek_v3_671b_plan(tmp_path, repo_root):
    """The IQ2_K_R4 recipe's plan on a full-size (sparse) DeepSeek-V3 tensor table, nothing written."""
    src = write_sparse(tmp_path / "dsv3.gguf", "deepseek2", {"deepseek2.block_count": 61}, deepseek_v3_tensors())
    out = tmp_path / "out.gguf"
    rc, stdout, err = run_cli("quantize", src, out, "IQ2_K_R4", "--custom-q",
                              repo_root / "recipes/deepseek-v3-iq2_k_r4.txt", "--token-embedding-type", "q8_0",
                              "--output-tensor-type", "q8_0", "--dry-run", "--json")
    assert rc == 0, err
    doc = json.loads(stdout)
    assert not out.exists()
    assert round(doc["plan"]["totals"]["gib_out"], 3) == 226.003
    by_type = {r["group"]: r["tensors"] for r in doc["plan"]["by_type"]}
    assert by_type["iq2_k_r4"] == 116 and by_type["iq3_k_r4"] == 58
    # the human-readable plan renders too
    rc, stdout, err = run_cli("quantize", src, out, "IQ2_K_R4", "--custom-q",
                              repo_root / "recipes/deepseek-v3-iq2_k_r4.txt", "--dry-run")
    assert rc == 0, err
    assert "blk.60.ffn_down_exps.weight" in stdout and "iq3_k_r4" in stdout and "by rule" in stdout


def test_corrupt_input_fails_cleanly(tmp_path, llama):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(llama.read_bytes()[:5000])
    out = tmp_path / "out.gguf"
    rc, o, e = run_cli("quantize", bad, out, "q8_0")
    assert_clean_failure(rc, o, e, str(bad), "offset")
    assert not out.exists()
    rc, o, e = run_cli("quantize", tmp_path / "nope.gguf", out, "q8_0")
    assert_clean_failure(rc, o, e, "no such file")
    rc, o, e = run_cli("inspect", bad)
    assert_clean_failure(rc, o, e, "truncated")


@pytest.mark.parametrize("recipe,needle", [("attn_q=q9_k\n", "r.txt:1"), ("x=q8_0\n(=q8_0\n", "r.txt:2")])
def test_bad_recipe_fails_cleanly(tmp_path, llama, recipe, needle):
    r = tmp_path / "r.txt"
    r.write_text(recipe)
    out = tmp_path / "out.gguf"
    rc, o, e = run_cli("quantize", llama, out, "q8_0", "--custom-q", r)
    assert_clean_failure(rc, o, e, needle)
    assert not out.exists()


def test_refuses_to_overwrite_input_and_bad_options(tmp_path, llama):
    rc, o, e = run_cli("quantize", llama, llama, "q8_0")
    assert_clean_failure(rc, o, e, "input file")
    rc, o, e = run_cli("quantize", llama, tmp_path / "o.gguf", "q9_9")
    assert_clean_failure(rc, o, e, "unknown type 'q9_9'")
    rc, o, e = run_cli("quantize", llama, tmp_path / "o.gguf", "nvfp4", "--flavor", "mainline")  # not yet
    assert_clean_failure(rc, o, e, "not implemented")
    assert not (tmp_path / "o.gguf").exists()


def test_nan_input_names_the_tensor(tmp_path):
    src = tmp_path / "nan.gguf"
    w = gguf.GGUFWriter(str(src), arch="llama")
    x = np.ones((4, 64), np.float32)
    x[2, 5] = np.nan
    w.add_tensor("blk.0.attn_q.weight", x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    out = tmp_path / "out.gguf"
    rc, o, e = run_cli("quantize", src, out, "q8_0")
    assert_clean_failure(rc, o, e, "blk.0.attn_q.weight", "non-finite")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [src]       # no temporary file left either


def test_f16_overflow_is_refused(tmp_path):
    src = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(src), arch="llama")
    w.add_tensor("blk.0.attn_q.weight", np.full((2, 64), 1e6, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    rc, o, e = run_cli("quantize", src, tmp_path / "out.gguf", "f16")
    assert_clean_failure(rc, o, e, "blk.0.attn_q.weight", "quantized output")


def test_interrupt_leaves_no_output(tmp_path, llama, monkeypatch, capsys):
    import quantkit.formats as formats
    real = formats.quantize
    calls = {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(formats, "quantize", interrupted)
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(llama), str(out), "q8_0"]) == 130
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_split_output_and_keep_split(tmp_path, llama):
    out = tmp_path / "split.gguf"
    rc, o, e = run_cli("quantize", llama, out, "q8_0", "--split-max-size", "300K")
    assert rc == 0, e
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 1 and not out.exists()
    rc, o, e = run_cli("quantize", shards[0], tmp_path / "again.gguf", "q8_0", "--keep-split")
    assert rc == 0, e
    again = sorted(tmp_path.glob("again-*-of-*.gguf"))
    assert len(again) == len(shards)
    for a, b in zip(shards, again):      # same tensors in the same shards, q8_0 copied verbatim
        ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
        assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
        for ta, tb in zip(ra.tensors, rb.tensors):
            assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data))


def test_inspect_json(llama):
    rc, o, e = run_cli("inspect", llama, "--json")
    assert rc == 0, e
    doc = json.loads(o)
    assert doc["totals"]["tensors"] == len(gguf.GGUFReader(str(llama)).tensors)
    assert {r["type"] for r in doc["by_type"]} == {"f32"}


def test_parse_size():
    assert parse_size("500M") == 500_000_000
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("4g") == 4_000_000_000
    with pytest.raises(QuantkitError):
        parse_size("lots")


def test_tensor_order_follows_the_flavor(tmp_path):
    """ik writes tensors in input order; mainline in its loader's order (non-block tensors first, then
    by layer number, then by name), except with --keep-split."""
    src = write_llama(tmp_path / "l11.gguf", n_layer=11, n_embd=256, n_ff=256, n_vocab=256)
    names_in = [t.name for t in gguf.GGUFReader(str(src)).tensors]

    def layer(name):
        return int(name.split(".")[1]) if name.startswith("blk.") else -1

    want_mainline = sorted(names_in, key=lambda n: (layer(n), n.encode()))
    assert want_mainline != names_in        # blk.10 after blk.9, output tensors first
    for flavor, extra, want in (("ik", (), names_in), ("mainline", (), want_mainline),
                                ("mainline", ("--keep-split",), names_in)):
        out = tmp_path / f"{flavor}{len(extra)}.gguf"
        rc, o, e = run_cli("quantize", src, out, "q8_0", "--flavor", flavor, *extra)
        assert rc == 0, e
        got = [t.name for t in gguf.GGUFReader(str(out)).tensors]
        assert got == want, flavor
        rc, o, e = run_cli("quantize", src, out, "q8_0", "--flavor", flavor, *extra, "--dry-run", "--json")
        assert [t["name"] for t in json.loads(o)["plan"]["tensors"]] == want


def test_full_disk_fails_before_writing(tmp_path, llama, monkeypatch, capsys):
    """The output is reserved whole first: no space is one line and no file, before any tensor."""
    import errno
    import os

    import quantkit.formats as formats

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    def never(*a, **k):
        raise AssertionError("quantized although the disk is full")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    monkeypatch.setattr(formats, "quantize", never)
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(llama), str(out), "q8_0"]) == 1
    assert "not enough disk space" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ---- words (issue 23, item 10) ----

def _walk(command, path):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, [*path, name])


def test_every_command_and_option_has_help():
    """`--help` explains every option of every command (imatrix merge's -o had none)."""
    import click

    from quantkit.cli import cli
    missing = []
    for path, command in _walk(cli, ["quantkit"]):
        if not (command.help or "").strip():
            missing.append(" ".join(path))
        ctx = click.Context(command, info_name=path[-1])
        missing += [f"{' '.join(path)} {'/'.join(p.opts)}" for p in command.get_params(ctx)
                    if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert len(list(_walk(cli, ["quantkit"]))) > 8         # the walk reached the subcommands
    assert missing == []


def test_counted_nouns():
    from quantkit.words import counted
    assert [counted(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
    assert counted(1, "entry", "entries") == "1 entry" and counted(3, "entry", "entries") == "3 entries"


@pytest.fixture(scope="module")
def llama_vocab(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("m") / "llama-vocab.gguf", n_layer=1, n_embd=64, n_ff=128,
                       n_vocab=320, vocab=True)


def _main(capsys, *args):
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_run_says_1_token_and_1_thread(llama_vocab, capsys):
    rc, out, err = _main(capsys, "run", llama_vocab, "-p", "hi", "-n", "1", "--temp", "0", "--threads", "1")
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "generation: 1 token in" in line and line.endswith("; 1 thread"), line


def test_run_context_too_small_is_one_line_without_the_prompt(llama_vocab, capsys):
    """`run -c 3` used to echo the prompt on stdout before the error, so a terminal showed the prompt
    glued to the error line."""
    prompt = "a prompt that does not fit"
    rc, out, err = _main(capsys, "run", llama_vocab, "-p", prompt, "-n", "4", "-c", "3", "--threads", "1")
    assert rc == 1 and out == "", out
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "tokens to generate exceed the context of 3 tokens" in err and prompt not in err, err
