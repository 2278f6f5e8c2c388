"""GGUF reader/writer: round trips against gguf-py and a llama.cpp-written file, and corrupt inputs."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from quantkit.errors import GGUFFormatError, QuantkitError
from quantkit.gguf_io.constants import MetaValue, ValueType
from quantkit.gguf_io.reader import GGUFFile, open_model
from quantkit.gguf_io.writer import GGUFWriter, TensorSpec, encode_header, plan_shards, shard_paths
from quantkit.types import QuantType

from models import write_llama


def _all_kinds_file(path: Path) -> Path:
    """A gguf-py file with every metadata value type and a few tensor types."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "bc", ""])
    w.add_array("t.arr_f32", [0.5, 1.5])
    rng = np.random.default_rng(1)
    w.add_tensor("a.weight", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 5, 32), dtype=np.float32).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.bias", np.arange(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_every_value_type_like_gguf_py(tmp_path):
    path = _all_kinds_file(tmp_path / "kinds.gguf")
    ref = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            assert key in f.metadata
            mv = f.metadata[key]
            assert int(mv.vtype) == int(field.types[0])
            expect = field.contents()
            got = mv.to_python()
            if isinstance(expect, float) or (isinstance(expect, list) and expect and isinstance(expect[0], float)):
                np.testing.assert_allclose(got, expect)
            else:
                assert got == expect, key
        assert [t.name for t in f.tensors] == [t.name for t in ref.tensors]
        for ours, theirs in zip(f.tensors, ref.tensors):
            assert ours.shape == tuple(int(d) for d in theirs.shape)
            assert int(ours.qtype) == int(theirs.tensor_type)
            assert ours.nbytes == theirs.n_bytes
            assert ours.offset == theirs.data_offset
            np.testing.assert_array_equal(ours.raw().reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))


def test_rewrite_is_byte_identical(tmp_path, smollm2_path):
    """Copying the llama.cpp-written SmolLM2 file through our writer reproduces it byte for byte."""
    out = tmp_path / "copy.gguf"
    with open_model(smollm2_path) as m:
        specs = [TensorSpec(t.name, t.shape, t.qtype) for t in m.tensors]
        with GGUFWriter([out], plan_shards(m.metadata, specs)) as w:
            for t in m.tensors:
                w.write_tensor(t.name, t.raw())
    assert out.read_bytes() == Path(smollm2_path).read_bytes()


def test_writer_output_is_read_by_gguf_py(tmp_path):
    path = _all_kinds_file(tmp_path / "kinds.gguf")
    out = tmp_path / "out.gguf"
    with open_model(path) as m:
        specs = [TensorSpec(t.name, t.shape, t.qtype) for t in m.tensors]
        with GGUFWriter([out], plan_shards(m.metadata, specs)) as w:
            for t in m.tensors:
                w.write_tensor(t.name, t.raw())
        ref = gguf.GGUFReader(str(out))
        for ours, theirs in zip(m.tensors, ref.tensors):
            np.testing.assert_array_equal(ours.raw().reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))
        assert ref.fields["t.u64"].contents() == 2**63 + 5
        assert ref.fields["t.arr_str"].contents() == ["a", "bc", ""]
    # trailing padding: the file ends on the alignment
    assert out.stat().st_size % 32 == 0


def test_split_write_and_read_back(tmp_path):
    src = write_llama(tmp_path / "m.gguf", n_layer=3)
    with open_model(src) as m:
        specs = [TensorSpec(t.name, t.shape, t.qtype) for t in m.tensors]
        shards = plan_shards(m.metadata, specs, max_bytes=600_000)
        assert len(shards) > 2
        paths = shard_paths(tmp_path / "out.gguf", len(shards))
        assert paths[0].name == f"out-00001-of-{len(shards):05d}.gguf"
        with GGUFWriter(paths, shards) as w:
            for t in m.tensors:
                w.write_tensor(t.name, t.raw())
        for i, p in enumerate(paths):
            r = gguf.GGUFReader(str(p))
            assert r.fields["split.no"].contents() == i
            assert r.fields["split.no"].types[0] == gguf.GGUFValueType.UINT16
            assert r.fields["split.count"].types[0] == gguf.GGUFValueType.UINT16
            assert r.fields["split.tensors.count"].types[0] == gguf.GGUFValueType.INT32
            assert ("llama.block_count" in r.fields) == (i == 0)
        with open_model(paths[0]) as back:
            assert back.n_shards == len(shards)
            assert [t.name for t in back.tensors] == [t.name for t in m.tensors]
            for a, b in zip(back.tensors, m.tensors):
                np.testing.assert_array_equal(a.raw(), b.raw())
            assert "split.no" not in back.metadata
        paths[1].unlink()
        with pytest.raises(QuantkitError, match="missing shard 2"):
            open_model(paths[0])


def test_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old contents")
    specs = [TensorSpec("a.weight", (32, 2), QuantType.F32), TensorSpec("b.weight", (32, 2), QuantType.F32)]

    def exploding():
        yield np.zeros(32, np.float32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with GGUFWriter([out], plan_shards({}, specs)) as w:
            w.write_tensor("a.weight", np.zeros((2, 32), np.float32))
            w.write_tensor("b.weight", exploding())
    assert out.read_bytes() == b"old contents"          # not clobbered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]  # no temp file left


# ---------------------------------------------------------------- corrupt files
def _valid_bytes() -> tuple[bytes, int]:
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama")}
    specs = [TensorSpec("a.weight", (32, 2), QuantType.F32), TensorSpec("b.weight", (32, 1), QuantType.F32)]
    header, _ = encode_header(meta, specs)
    return header + bytes(256 + 128), len(header)


def _corrupt(tmp_path, data: bytes) -> Path:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return p


def _info_offset(data: bytes, name: bytes) -> int:
    return data.index(name) + len(name)     # just past the tensor name


@pytest.mark.parametrize("case", ["magic", "version1", "version9", "bigendian", "truncated_header",
                                  "past_eof", "misaligned", "dup_tensor", "dup_key", "overflow",
                                  "unknown_type", "too_many_dims", "empty", "row_not_block"])
def test_corrupt_inputs_name_file_and_offset(tmp_path, case):
    data, header_len = _valid_bytes()
    b = bytearray(data)
    if case == "magic":
        b[0:4] = b"GGUX"
    elif case == "version1":
        b[4:8] = struct.pack("<I", 1)
    elif case == "version9":
        b[4:8] = struct.pack("<I", 9)
    elif case == "bigendian":
        b[4:8] = struct.pack(">I", 3)
    elif case == "truncated_header":
        b = b[:header_len - 20]
    elif case == "past_eof":
        b = b[:header_len + 100]
    elif case == "misaligned":
        at = _info_offset(data, b"b.weight") + 4 + 16 + 4
        b[at:at + 8] = struct.pack("<Q", 260)
    elif case == "dup_tensor":
        i = data.index(b"b.weight")
        b[i:i + 8] = b"a.weight"
    elif case == "dup_key":
        meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"),
                "general.architecturf": MetaValue(ValueType.STRING, "llama")}
        header, _ = encode_header(meta, [])
        b = bytearray(header.replace(b"architecturf", b"architecture"))
    elif case == "overflow":
        at = _info_offset(data, b"a.weight") + 4
        b[at:at + 16] = struct.pack("<qq", 2**40, 2**40)
    elif case == "unknown_type":
        at = _info_offset(data, b"a.weight") + 4 + 16
        b[at:at + 4] = struct.pack("<i", 77)
    elif case == "too_many_dims":
        at = _info_offset(data, b"a.weight")
        b[at:at + 4] = struct.pack("<I", 7)
    elif case == "empty":
        b = bytearray()
    elif case == "row_not_block":
        at = _info_offset(data, b"a.weight") + 4 + 16
        b[at:at + 4] = struct.pack("<i", int(QuantType.Q8_0))
        at -= 16
        b[at:at + 8] = struct.pack("<q", 31)
    path = _corrupt(tmp_path, bytes(b))
    with pytest.raises(GGUFFormatError) as e:
        open_model(path)
    msg = str(e.value)
    assert str(path) in msg and "offset" in msg and "\n" not in msg


def test_string_array_errors_name_the_string_and_its_offset(tmp_path):
    """The vocabulary loop (reader._Cursor.strings): a string that is not UTF-8, one that runs past
    the end and a length field cut short each name the string's index and where it starts."""
    words = ["a" * 20, "b" * 20, "c" * 20, "d" * 20]
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"),
            "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, words, ValueType.STRING)}
    data, _ = encode_header(meta, [])
    data = data[:data.index(b"d" * 20) + 20]        # the file ends with the last string
    assert open_model(_corrupt(tmp_path, data)).metadata["tokenizer.ggml.tokens"].value == words
    what = "value of 'tokenizer.ggml.tokens'"
    third = data.index(struct.pack("<Q", 20) + b"c")       # the length field of string 2
    bad = bytearray(data)
    bad[third + 9] = 0xFF
    with pytest.raises(GGUFFormatError, match=rf"@ offset {third}: {what}\[2\] is not valid UTF-8"):
        open_model(_corrupt(tmp_path, bytes(bad)))
    bad = bytearray(data)
    bad[third:third + 8] = struct.pack("<Q", 1000)
    with pytest.raises(GGUFFormatError, match=rf"@ offset {third}: truncated file: {what}\[2\] runs past the "
                                              rf"end of the file \({len(data)} bytes\)"):
        open_model(_corrupt(tmp_path, bytes(bad)))
    last = data.index(struct.pack("<Q", 20) + b"d")
    with pytest.raises(GGUFFormatError, match=rf"@ offset {last}: truncated file: {what}\[3\] runs past the "
                                              rf"end of the file \({last + 4} bytes\)"):
        open_model(_corrupt(tmp_path, data[:last + 4]))     # inside the last string's length field


def test_a_vocabulary_read_is_written_back_as_its_bytes_until_it_changes(tmp_path):
    """String arrays keep their encoded bytes from the file (the writer copies an unchanged
    vocabulary instead of encoding 100k+ strings again); a changed one is encoded as it now is."""
    words = ["a", "é", "", "名字" * 3, "z" * 300]
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"),
            "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, list(words), ValueType.STRING)}
    data, _ = encode_header(meta, [])
    path = _corrupt(tmp_path, data)

    def tokens_of(header: bytes) -> list[str]:
        (tmp_path / "written.gguf").write_bytes(header)
        with open_model(tmp_path / "written.gguf") as m:
            return list(m.metadata["tokenizer.ggml.tokens"].value)
    with open_model(path) as m:
        read = m.metadata
    assert read["tokenizer.ggml.tokens"].value == words
    assert read["tokenizer.ggml.tokens"].value.encoded_if_unchanged() is not None
    assert encode_header(read, [])[0] == data
    for change in (lambda t: t.append("new"), lambda t: t.__setitem__(1, "e"), lambda t: t.pop()):
        with open_model(path) as m:
            changed = m.metadata
        tokens = changed["tokenizer.ggml.tokens"].value
        change(tokens)
        assert tokens.encoded_if_unchanged() is None
        header, _ = encode_header(changed, [])
        assert header != data and tokens_of(header) == list(tokens)
