"""Hostile or careless input models (issue 22, items 8, 15 and 16): split sets mixed from several
models, safetensors indexes that point out of the model directory, FIFOs and devices as model files,
malformed config.json / index / safetensors headers / tokenizer files, and GGUF tensor tables with
degenerate shapes. Each must be a one-line refusal naming the problem, never a hang, a traceback or
an ``internal error``.

Most cases go in-process through the library (open_model / open_hf raising QuantkitError: cheap);
a few through the real CLI, where the exit status, the one stderr line and the untouched inputs are
the contract (tests/hostile.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

import hf_models as H
import quantkit
from hostile import Snapshot, assert_refused, run_cli
from models import write_llama
from quantkit.errors import QuantkitError
from quantkit.gguf_io.constants import MetaValue, ValueType
from quantkit.gguf_io.reader import GGUFFile, open_model
from quantkit.gguf_io.writer import GGUFWriter, TensorSpec, encode_header, plan_shards, shard_paths
from quantkit.hf import open_hf
from quantkit.types import QuantType

FIFO_TIMEOUT = 20      # seconds: a reader that blocks on a FIFO fails the test instead of hanging it


def _refused_in_thread(fn, fifo: Path) -> str:
    """The QuantkitError message of ``fn()``, run in a thread; if it is still running after the
    timeout (blocked opening ``fifo``), open the FIFO's write end to release it and fail."""
    result = {}

    def target():
        try:
            fn()
            result["error"] = None
        except QuantkitError as e:
            result["error"] = str(e)
        except BaseException as e:          # noqa: BLE001 - reported below
            result["error"] = f"{type(e).__name__}: {e}"
            result["unexpected"] = True

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(FIFO_TIMEOUT)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)     # a reader is waiting: this lets it go
        os.close(fd)
        t.join(FIFO_TIMEOUT)
        pytest.fail(f"blocked on the FIFO {fifo} for {FIFO_TIMEOUT} s")
    assert not result.get("unexpected"), result["error"]
    assert result["error"] is not None, "accepted a FIFO"
    return result["error"]


# ---------------------------------------------------------------- GGUF tensor tables

def _raw_gguf(path: Path, specs: list[TensorSpec], meta: dict | None = None) -> Path:
    """A GGUF file of zero-filled tensors written by our header encoder, for byte surgery."""
    meta = meta if meta is not None else {"general.architecture": MetaValue(ValueType.STRING, "llama")}
    header, _ = encode_header(meta, specs)
    path.write_bytes(header + bytes(sum(-(-s.nbytes // 32) * 32 for s in specs)))
    return path


def _set_shape(path: Path, name: bytes, dims: list[int]) -> None:
    """Rewrite a tensor's dimensions in place (same n_dims)."""
    b = bytearray(path.read_bytes())
    at = b.index(name) + len(name) + 4
    b[at:at + 8 * len(dims)] = struct.pack(f"<{len(dims)}q", *dims)
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("dims", [[32, 0], [0, 4]])
def test_gguf_zero_dimension_refused(tmp_path, dims):
    """ik_llama.cpp's gguf loader asserts every dimension > 0; a zero one used to divide by zero."""
    p = _raw_gguf(tmp_path / "z.gguf", [TensorSpec("a.weight", (32, 4), QuantType.F32),
                                        TensorSpec("b.weight", (32, 2), QuantType.F32)])
    _set_shape(p, b"a.weight", dims)
    with pytest.raises(QuantkitError, match=r"tensor 'a.weight' has a zero dimension"):
        open_model(p)


def test_gguf_zero_dimensions_tensor_is_one_element(tmp_path):
    """n_dims = 0 is valid for ggml (its four dimensions default to 1): one element, written back
    with one dimension as ggml writes it (ggml_n_dims >= 1)."""
    p = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama")          # gguf-py writes a 0-d array with n_dims 0
    w.add_tensor("a.weight", np.array(2.5, np.float32))
    w.add_tensor("b.weight", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    at = p.read_bytes().index(b"a.weight") + len(b"a.weight")
    assert p.read_bytes()[at:at + 4] == bytes(4)
    with open_model(p) as m:
        t = m.by_name["a.weight"]
        assert (t.shape, t.n_elements, t.nbytes) == ((1,), 1, 4)
        assert t.raw().view(np.float32)[0, 0] == 2.5
    out = tmp_path / "out.gguf"
    quantkit.quantize_model(p, out, "f32")
    with open_model(out) as m:
        assert m.by_name["a.weight"].shape == (1,)
        assert m.by_name["a.weight"].raw().view(np.float32)[0, 0] == 2.5


def test_gguf_empty_tensor_name_refused(tmp_path):
    p = _raw_gguf(tmp_path / "e.gguf", [TensorSpec("", (32, 2), QuantType.F32)])
    with pytest.raises(QuantkitError, match="tensor #0 has an empty name"):
        open_model(p)


def test_gguf_key_not_utf8_refused(tmp_path):
    p = _raw_gguf(tmp_path / "k.gguf", [TensorSpec("a.weight", (32, 2), QuantType.F32)],
                  {"general.architecture": MetaValue(ValueType.STRING, "llama"),
                   "t.k\xe9y": MetaValue(ValueType.UINT32, 1)})
    b = p.read_bytes()
    key = "t.k\xe9y".encode()
    p.write_bytes(b.replace(key, b"t.k\xff\xfey"))
    with pytest.raises(QuantkitError, match="metadata key #1 is not valid UTF-8"):
        open_model(p)


@pytest.mark.parametrize("elem", [ValueType.STRING, ValueType.UINT32])
def test_gguf_array_length_near_2_63_refused_at_once(tmp_path, elem):
    p = _raw_gguf(tmp_path / "a.gguf", [TensorSpec("a.weight", (32, 2), QuantType.F32)],
                  {"t.arr": MetaValue(ValueType.ARRAY, ["x"] if elem == ValueType.STRING else np.array([7], "<u4"),
                                      elem)})
    b = bytearray(p.read_bytes())
    at = b.index(b"t.arr") + len(b"t.arr") + 4 + 4           # key, value type, element type: the length
    assert struct.unpack_from("<Q", b, at)[0] == 1
    b[at:at + 8] = struct.pack("<Q", 2**63 - 1)
    p.write_bytes(bytes(b))
    with pytest.raises(QuantkitError, match=r"claims 9223372036854775807"):
        open_model(p)


def test_gguf_offset_plus_size_past_int64_refused(tmp_path):
    p = _raw_gguf(tmp_path / "o.gguf", [TensorSpec("a.weight", (32, 2), QuantType.F32)])
    b = bytearray(p.read_bytes())
    at = b.index(b"a.weight") + len(b"a.weight") + 4 + 16 + 4
    b[at:at + 8] = struct.pack("<Q", 2**64 - 32)        # aligned, and offset + size wraps a u64
    p.write_bytes(bytes(b))
    with pytest.raises(QuantkitError, match="extends past the end of the file"):
        open_model(p)


def test_gguf_5mb_metadata_string_reads(tmp_path):
    text = "x" * (5 << 20)
    p = _raw_gguf(tmp_path / "big.gguf", [TensorSpec("a.weight", (32, 2), QuantType.F32)],
                  {"general.architecture": MetaValue(ValueType.STRING, "llama"),
                   "tokenizer.chat_template": MetaValue(ValueType.STRING, text)})
    with open_model(p) as m:
        assert m.get("tokenizer.chat_template") == text


def test_gguf_split_count_of_wrong_type_refused(tmp_path):
    p = _raw_gguf(tmp_path / "m.gguf", [TensorSpec("a.weight", (32, 2), QuantType.F32)],
                  {"split.count": MetaValue(ValueType.STRING, "3")})
    with pytest.raises(QuantkitError, match="split.count is a string, expected an integer"):
        open_model(p)


# ---------------------------------------------------------------- non-regular files

@pytest.mark.parametrize("kind", ["fifo", "dir", "dev"])
def test_gguf_input_that_is_not_a_regular_file_refused(tmp_path, kind):
    if kind == "fifo":
        p = tmp_path / "m.gguf"
        os.mkfifo(p)
        msg = _refused_in_thread(lambda: open_model(p), p)
        assert "is a FIFO (named pipe), not a regular file" in msg
    elif kind == "dir":
        (tmp_path / "d.gguf").mkdir()
        with pytest.raises(QuantkitError, match="is a directory, not a regular file"):
            GGUFFile(tmp_path / "d.gguf")
    else:
        with pytest.raises(QuantkitError, match="/dev/zero: is a character device, not a regular file"):
            open_model("/dev/zero")


def test_fifo_shard_of_a_split_set_refused(tmp_path, split_src):
    paths = _split(split_src, tmp_path / "s.gguf", 3)
    paths[2].unlink()
    os.mkfifo(paths[2])
    assert "is a FIFO" in _refused_in_thread(lambda: open_model(paths[0]), paths[2])


def test_cli_inspect_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    snap = Snapshot(tmp_path)
    assert_refused(*run_cli("inspect", fifo, timeout=120), "is a FIFO")
    snap.assert_unchanged()


# ---------------------------------------------------------------- split sets

@pytest.fixture(scope="module")
def split_src(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("split") / "a.gguf", n_layer=2, n_embd=32, n_ff=64, n_head=2,
                       n_head_kv=1, n_vocab=64)


def _split(src: Path, out: Path, n: int, edit=None) -> list[Path]:
    """``src`` cut into ``n`` shards as quantkit (and gguf-split) writes them; ``edit(shards)`` may
    change the shard plan (metadata, tensor lists) before writing."""
    with open_model(src) as m:
        specs = [TensorSpec(t.name, t.shape, t.qtype) for t in m.tensors]
        groups = [i * n // len(specs) for i in range(len(specs))]
        shards = plan_shards(m.metadata, specs, groups=groups)
        if edit:
            edit(shards)
        paths = shard_paths(out, n)
        by_name = {t.name: t for t in m.tensors}
        with GGUFWriter(paths, shards) as w:
            for _, shard_specs in shards:
                for t in shard_specs:
                    w.write_tensor(t.name, by_name[t.name].raw())
    return paths


def test_split_set_reads_back(tmp_path, split_src):
    paths = _split(split_src, tmp_path / "s.gguf", 3)
    with open_model(paths[0]) as m, open_model(split_src) as ref:
        assert m.n_shards == 3 and [t.name for t in m.tensors] == [t.name for t in ref.tensors]


def test_split_shard_from_a_model_with_other_tensors_refused(tmp_path, split_src):
    """Shard 2 of another model's 3-shard set (3 layers instead of 2) dropped into the set."""
    ours = _split(split_src, tmp_path / "a.gguf", 3)
    other_src = write_llama(tmp_path / "b-src.gguf", n_layer=3, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                            n_vocab=64, seed=1)
    other = _split(other_src, tmp_path / "b.gguf", 3)
    shutil.copy(other[1], ours[1])
    with pytest.raises(QuantkitError, match=r"a-00002-of-00003.gguf: shard 2 of 3 says the model has 30 tensors, "
                                            r"shard 1 says 21: the shards come from different models"):
        open_model(ours[0])


def test_split_shard_with_another_architecture_refused(tmp_path, split_src):
    def other_arch(shards):
        shards[2][0]["general.architecture"] = MetaValue(ValueType.STRING, "deepseek2")
    paths = _split(split_src, tmp_path / "s.gguf", 3, other_arch)
    with pytest.raises(QuantkitError, match=r"s-00003-of-00003.gguf: shard 3 of 3 has another general.architecture "
                                            "than shard 1"):
        open_model(paths[0])


def test_split_single_file_renamed_as_a_shard_refused(tmp_path, split_src):
    paths = _split(split_src, tmp_path / "s.gguf", 3)
    shutil.copy(split_src, paths[1])
    with pytest.raises(QuantkitError, match=r"s-00002-of-00003.gguf: shard 2 of 3 has no split.count"):
        open_model(paths[0])


def test_split_shards_renamed_out_of_order_refused(tmp_path, split_src):
    paths = _split(split_src, tmp_path / "s.gguf", 3)
    tmp = paths[1].with_name("tmp")
    paths[1].rename(tmp)
    paths[2].rename(paths[1])
    tmp.rename(paths[2])
    with pytest.raises(QuantkitError, match=r"shard 2 of 3 has split.no 2, expected 1"):
        open_model(paths[0])


def test_split_set_named_with_another_count_refused(tmp_path, split_src):
    paths = _split(split_src, tmp_path / "s.gguf", 3)
    for i, p in enumerate(paths[:2]):
        p.rename(p.with_name(f"t-{i + 1:05d}-of-00002.gguf"))
    with pytest.raises(QuantkitError, match=r"shard 1 of 2 has split.count 3"):
        open_model(tmp_path / "t-00001-of-00002.gguf")


def test_split_name_of_zero_shards_refused(tmp_path, split_src):
    p = shutil.copy(split_src, tmp_path / "x-00001-of-00000.gguf")
    with pytest.raises(QuantkitError, match=r"not a shard name \(shard 1 of 0\)"):
        open_model(p)


def test_split_without_tensor_count_refused(tmp_path, split_src):
    def drop(shards):
        del shards[0][0]["split.tensors.count"]
    paths = _split(split_src, tmp_path / "s.gguf", 2, drop)
    with pytest.raises(QuantkitError, match=r"has no split.tensors.count"):
        open_model(paths[0])


def test_cli_mixed_split_set_refused_and_inputs_unchanged(tmp_path, split_src):
    (tmp_path / "in").mkdir()
    ours = _split(split_src, tmp_path / "in" / "a.gguf", 2)
    other_src = write_llama(tmp_path / "b.gguf", n_layer=3, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_vocab=64)
    other = _split(other_src, tmp_path / "b-split.gguf", 2)
    shutil.copy(other[1], ours[1])
    snap = Snapshot(tmp_path / "in")
    out = tmp_path / "out.gguf"
    assert_refused(*run_cli("quantize", ours[0], out, "q8_0"), "a-00002-of-00002.gguf", "different models")
    snap.assert_unchanged()
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))


# ---------------------------------------------------------------- Hugging Face directories

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return H.write_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _config(**changes):
    def edit(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is _DELETE:
                del cfg[k]
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


_DELETE = object()


def _header(edit_entries, file="model.safetensors"):
    """Rewrite a safetensors header (a dict of entries) in place, keeping the data."""
    def edit(d: Path):
        p = d / file
        b = p.read_bytes()
        (n,) = struct.unpack_from("<Q", b)
        header = json.loads(b[8:8 + n])
        new = edit_entries(header)
        text = (new if isinstance(new, str) else json.dumps(header)).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(struct.pack("<Q", len(text)) + text + b[8 + n:])
    return edit


def _entry(name, **fields):
    return _header(lambda h: h[name].update(fields))


def _index(weight_map):
    def edit(d: Path):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return edit


def _text(file, text):
    def edit(d: Path):
        (d / file).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


def _replace(file, old, new):
    def edit(d: Path):
        text = (d / file).read_text()
        assert old in text
        (d / file).write_text(text.replace(old, new))
    return edit


def _tokenizer(**changes):
    def edit(d: Path):
        tj = json.loads((d / "tokenizer.json").read_text())
        for path, v in changes.items():
            node = tj
            *parents, last = path.split("__")
            for k in parents:
                node = node[k]
            node[last] = v
        (d / "tokenizer.json").write_text(json.dumps(tj))
    return edit


def _two_shards_with_a_shared_tensor(d: Path):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    save_file(t, str(d / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": t["model.norm.weight"]}, str(d / "model-00002-of-00002.safetensors"))


EMBED = "model.embed_tokens.weight"
DEEP = "[" * 100_000 + "]" * 100_000

# (breakage, words the one-line error must contain)
HF_CASES = {
    # config.json shapes
    "architectures nested": (_config(architectures=[["LlamaForCausalLM"]]),
                             "'architectures' is [[\"LlamaForCausalLM\"]] (a list), expected a list of model class"),
    "architectures not a list": (_config(architectures="LlamaForCausalLM"), "'architectures' is \"LlamaForCausalLM\""),
    "string for a number": (_config(hidden_size="32"), "'hidden_size' is \"32\" (a string), expected an integer"),
    "zero heads": (_config(num_attention_heads=0), "'num_attention_heads' is 0 (an integer), expected an integer "
                                                   "from 1"),
    "zero kv heads": (_config(num_key_value_heads=0), "'num_key_value_heads' is 0"),
    "bool for an int": (_config(num_hidden_layers=True), "'num_hidden_layers' is true (a boolean), expected an "
                                                         "integer"),
    "float for an int": (_config(num_hidden_layers=1.5), "'num_hidden_layers' is 1.5 (a number), expected an integer"),
    "null": (_config(hidden_size=None), "'hidden_size' is missing"),
    "missing key": (_config(intermediate_size=_DELETE), "'intermediate_size' is missing"),
    "1e300": (_config(hidden_size=1e300), "'hidden_size' is 1e+300 (a number), expected an integer"),
    "2**70": (_config(vocab_size=2**70), "'vocab_size' is 1180591620717411303424 (an integer), expected an integer "
                                         "from 1 to 4294967295"),
    "nan": (_replace("config.json", "1e-05", "NaN"), "'rms_norm_eps' is NaN (a number), expected a number of at "
                                                     "least 0"),
    "1e400": (_replace("config.json", "10000.0", "1e400"), "'rope_theta' is Infinity (a number), expected a positive"),
    "5000-digit integer": (_replace("config.json", '"vocab_size": 64', '"vocab_size": ' + "9" * 5000),
                           "config.json: not valid JSON"),
    "rope_theta string": (_config(rope_theta="1e4"), "'rope_theta' is \"1e4\" (a string), expected a positive number"),
    "yarn without original context": (_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                                      "'rope_scaling.original_max_position_embeddings' is missing"),
    "linear without factor": (_config(rope_scaling={"type": "linear"}), "'rope_scaling.factor' is missing"),
    "rope_scaling not an object": (_config(rope_scaling="yarn"), "'rope_scaling' is \"yarn\" (a string), expected "
                                                                 "an object"),
    "llama3 high <= low": (_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                 "high_freq_factor": 4.0}),
                           "'rope_scaling.high_freq_factor' is 4.0 (a number), expected a number greater than"),
    "odd head size": (_config(head_dim=15), "the head size 15 is odd"),
    "huge head_dim": (_config(head_dim=2**40), "'head_dim' is 1099511627776"),
    "tie not a bool": (_config(tie_word_embeddings="no"), "'tie_word_embeddings' is \"no\" (a string), expected true "
                                                          "or false"),
    "quantization_config string": (_config(quantization_config="fp8"), "'quantization_config' is \"fp8\""),
    "json nested 100k deep": (_text("config.json", DEEP), "config.json: JSON nested too deeply"),
    "config not an object": (_text("config.json", "[1]"), "config.json: not a JSON object"),
    "config not utf-8": (_text("config.json", b'{"a": "\xff"}'), "config.json: not UTF-8 text"),
    "config not json": (_text("config.json", "{"), "config.json: not valid JSON"),
    # the index
    "weight_map a list": (_index(["model.safetensors"]), "'weight_map' is [\"model.safetensors\"] (a list), expected "
                                                         "an object"),
    "weight_map empty": (_index({}), "'weight_map' is {} (an object), expected an object mapping tensor names"),
    "weight_map absolute path": (_index({EMBED: "/etc/hostname"}), "weight_map puts 'model.embed_tokens.weight' in "
                                                                   "\"/etc/hostname\""),
    "weight_map ..": (_index({EMBED: "../tiny/model.safetensors"}), "no directory part, no '..'"),
    "weight_map value an object": (_index({EMBED: {"file": "model.safetensors"}}), "weight_map puts"),
    "index nested 100k deep": (_text("model.safetensors.index.json", DEEP), "JSON nested too deeply"),
    # safetensors headers
    "negative shape": (_entry(EMBED, shape=[-64, -32]), "has shape [-64, -32] (a list), expected a list of "
                                                        "non-negative integers"),
    "overflowing shape": (_entry(EMBED, shape=[2**62, 2**62]), "85070591730234615865843651857942052864 bytes"),
    "string shape": (_entry(EMBED, shape=["64", 32]), "has shape [\"64\", 32]"),
    "unknown dtype": (_entry(EMBED, dtype="Q4_0"), "unsupported dtype \"Q4_0\""),
    "offsets reversed": (_header(lambda h: h[EMBED].update(data_offsets=h[EMBED]["data_offsets"][::-1])),
                         "do not fit its shape or the file"),
    "offsets outside the file": (_entry(EMBED, data_offsets=[10**12, 10**12 + 8192]), "do not fit its shape"),
    "offsets overlapping": (_header(lambda h: h["model.norm.weight"].update(
        data_offsets=[h[EMBED]["data_offsets"][0], h[EMBED]["data_offsets"][0] + 128])), "inside"),
    "offsets not numbers": (_entry(EMBED, data_offsets=["0", "8192"]), "expected [begin, end]"),
    "bytes after the data": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes() +
                                                                            bytes(8)), "bytes after the header"),
    "entry not an object": (_header(lambda h: h.__setitem__(EMBED, [1, 2])), "header entry that is [1, 2]"),
    "__metadata__ not strings": (_header(lambda h: h.__setitem__("__metadata__", {"format": 1})),
                                 "__metadata__ is not an object of strings"),
    "header a list": (_header(lambda h: "[]"), "safetensors header is [] (a list), not a JSON object"),
    "header nested 100k deep": (_header(lambda h: DEEP), "safetensors header: JSON nested too deeply"),
    "header key twice": (_header(lambda h: json.dumps(h)[:-1] + ', "model.norm.weight": ' +
                                 json.dumps(h["model.norm.weight"]) + "}"),
                         "the safetensors header has 'model.norm.weight' twice"),
    "header length past the file": (lambda d: (d / "model.safetensors").write_bytes(
        struct.pack("<Q", 4096) + (d / "model.safetensors").read_bytes()[8:100]), "header length runs past the end"),
    "header length over 100 MiB": (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**63)),
                                   "header length is over the 100 MiB limit"),
    "tensor in two shards": (_two_shards_with_a_shared_tensor, "tensor 'model.norm.weight' is in both "
                                                               "model-00001-of-00002.safetensors and model-00002"),
    # tokenizer files
    "added token id a string": (_tokenizer(added_tokens=[{"id": "x", "content": "<s>"}]),
                                "'added_tokens[0].id' is \"x\" (a string)"),
    "vocab a list": (_tokenizer(model__vocab=[1, 2]), "'model.vocab' is [1, 2] (a list), expected an object"),
    "negative token id": (_tokenizer(model__vocab={"a": -5}), "model.vocab gives \"a\" (a string) the id -5"),
    "pre_tokenizer a list": (_tokenizer(pre_tokenizer=[1]), "'pre_tokenizer' is [1] (a list), expected an object"),
    "merges mixed": (_tokenizer(model__merges=["a b", ["a", "b"]]), "neither 'a b' strings nor [a, b] pairs"),
    "tokenizer_config a list": (_text("tokenizer_config.json", "[]"), "tokenizer_config.json: not a JSON object"),
    "chat_template a number": (_text("tokenizer_config.json", '{"chat_template": 5}'),
                               "'chat_template' is 5 (an integer), expected a string or a list of named templates"),
    "bos_token content a number": (_text("tokenizer_config.json", '{"bos_token": {"content": 5}}'),
                                   "'bos_token.content' is 5 (an integer), expected a string"),
    "bos_token_id nested list": (_config(bos_token_id=[[1]]), "'bos_token_id' is [[1]] (a list)"),
    # item 15: untied embeddings without their output matrix
    "untied without lm_head": (lambda d: _rewrite_tensors(d, lambda t: t.pop("lm_head.weight")),
                               "says tie_word_embeddings: false but the checkpoint has no lm_head.weight"),
}


def _rewrite_tensors(d: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize("case", list(HF_CASES))
def test_malformed_hf_directory_refused(tmp_path, hf_dir, case):
    breakage, needle = HF_CASES[case]
    d = _copy(hf_dir, tmp_path / "m")
    breakage(d)
    with pytest.raises(QuantkitError) as e:
        open_hf(d).close()
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_tiny_hf_directory_is_valid(hf_dir):
    """The directory the cases above break converts as it is."""
    with open_hf(hf_dir) as m:
        assert "output.weight" in m.by_name and m.get("llama.block_count") == 1


@pytest.mark.parametrize("kind", ["fifo", "dir"])
@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                  "model.safetensors.index.json"])
def test_hf_file_that_is_not_a_regular_file_refused(tmp_path, hf_dir, file, kind):
    d = _copy(hf_dir, tmp_path / "m")
    if file == "model.safetensors.index.json":
        _index({EMBED: "model.safetensors"})(d)
    (d / file).unlink()
    if kind == "dir":
        (d / file).mkdir()
        with pytest.raises(QuantkitError, match=f"{file}: is a directory, not a regular file"):
            open_hf(d)
    else:
        os.mkfifo(d / file)
        assert f"{file}: is a FIFO (named pipe), not a regular file" in _refused_in_thread(lambda: open_hf(d),
                                                                                          d / file)


def test_hf_index_shard_that_is_a_fifo_refused(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    os.mkfifo(d / "model-00002-of-00002.safetensors")
    _index({EMBED: "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"})(d)
    assert "is a FIFO" in _refused_in_thread(lambda: open_hf(d), d / "model-00002-of-00002.safetensors")


def test_hf_model_files_through_symlinks_still_read(tmp_path, hf_dir):
    """Hugging Face's cache links each file of a snapshot to a blob elsewhere: that stays valid."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in hf_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    with open_hf(snap) as m:
        assert len(m.tensors) == len(list(open_hf(hf_dir).tensors))


@pytest.mark.parametrize("same", [True, False])
def test_tied_config_with_a_stored_lm_head(tmp_path, hf_dir, caplog, same):
    """tie_word_embeddings: true with an lm_head.weight stored: the output is token_embd, as in
    transformers (which ties over the stored matrix); a warning when the stored one differs, since
    convert_hf_to_gguf.py would write it."""
    d = _copy(hf_dir, tmp_path / "m")
    _config(tie_word_embeddings=True)(d)
    if same:
        _rewrite_tensors(d, lambda t: t.__setitem__("lm_head.weight", t[EMBED].copy()))
    with caplog.at_level(logging.WARNING, logger="quantkit"), open_hf(d) as m:
        assert "output.weight" not in m.by_name
    warned = [r.getMessage() for r in caplog.records if "lm_head.weight differs" in r.getMessage()]
    assert len(warned) == (0 if same else 1), warned


def test_untied_config_without_key_and_without_lm_head_is_tied(tmp_path, hf_dir):
    """No tie_word_embeddings key (save_pretrained omits it when it equals PretrainedConfig's default,
    true): the stored tensors decide, as in the converter."""
    d = _copy(hf_dir, tmp_path / "m")
    _config(tie_word_embeddings=_DELETE)(d)
    _rewrite_tensors(d, lambda t: t.pop("lm_head.weight"))
    with open_hf(d) as m:
        assert "output.weight" not in m.by_name


def test_cli_index_pointing_outside_prints_nothing_of_that_file(tmp_path, hf_dir):
    """An index naming a file outside the model directory is refused by name: the file is never
    opened, so nothing of it reaches the error (the old reader printed its first 8 bytes as a
    'header length')."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"hunter2-hunter2-hunter2\n")
    d = _copy(hf_dir, tmp_path / "m")
    _index({EMBED: str(secret), "lm_head.weight": "model.safetensors"})(d)
    snap = Snapshot(d, secret)
    out = tmp_path / "out.gguf"
    rc, so, se = run_cli("quantize", d, out, "q8_0")
    line = assert_refused(rc, so, se, "weight_map puts 'model.embed_tokens.weight' in", "no directory part")
    assert "hunter2" not in so + se and str(int.from_bytes(b"hunter2-", "little")) not in line
    snap.assert_unchanged()
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m", "secret.txt"]


def test_cli_malformed_config_refused_and_inputs_unchanged(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    _config(rope_scaling={"rope_type": "yarn", "factor": 4.0})(d)
    snap = Snapshot(d)
    out = tmp_path / "out.gguf"
    assert_refused(*run_cli("quantize", d, out, "q8_0"), "original_max_position_embeddings' is missing")
    snap.assert_unchanged()
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m"]
