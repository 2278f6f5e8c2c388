"""`quantkit inspect --json` is for machines: every metadata value in its own JSON type, checked
against gguf-py's reader for every GGUF value type, arrays of each and arrays of arrays; arrays past
JSON_ARRAY_ITEMS items are cut with "truncated": true and their "length".  Through the library
(quantkit.inspect_model returns the document); the CLI for what only it does: strict JSON (NaN and
infinities as null) and the table."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import quantkit
from quantkit.cli import main
from quantkit.describe import JSON_ARRAY_ITEMS
from quantkit.errors import QuantkitError

T = gguf.GGUFValueType
SCALARS = {     # key: (value, type)
    "t.uint8": (200, T.UINT8), "t.int8": (-100, T.INT8), "t.uint16": (60000, T.UINT16),
    "t.int16": (-30000, T.INT16), "t.uint32": (30, T.UINT32), "t.int32": (-2_000_000_000, T.INT32),
    "t.float32": (1e-5, T.FLOAT32), "t.bool_false": (False, T.BOOL), "t.bool_true": (True, T.BOOL),
    "t.string": ("a \"quoted\"\nline \x1b[31m ✓", T.STRING), "t.uint64": (2**64 - 1, T.UINT64),
    "t.int64": (-2**63, T.INT64), "t.float64": (0.1, T.FLOAT64),
}
ARRAYS = {      # key: (items, element type)
    "a.uint8": ([0, 255], T.UINT8), "a.int8": ([-128, 127], T.INT8), "a.uint16": ([1, 65535], T.UINT16),
    "a.int16": ([-32768, 5], T.INT16), "a.uint32": ([7, 2**32 - 1], T.UINT32), "a.int32": ([-1, 2], T.INT32),
    "a.float32": ([0.5, -2.25, 1e-5], T.FLOAT32), "a.bool": ([True, False, True], T.BOOL),
    "a.string": (["x", "", "ü\x00z"], T.STRING), "a.uint64": ([2**63 + 1], T.UINT64),
    "a.int64": ([-2**40, 3], T.INT64), "a.float64": ([1 / 3, -0.0], T.FLOAT64)
}
LONG = JSON_ARRAY_ITEMS + 5
NESTED = [[1, 2], [3], [4, 5, 6]]


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """A tiny GGUF that gguf-py writes with a key of every value type."""
    path = tmp_path_factory.mktemp("typed") / "typed.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    for key, (items, elem) in ARRAYS.items():
        w.add_key_value(key, items, T.ARRAY, sub_type=elem)
    w.add_key_value("a.long", list(range(LONG)), T.ARRAY, sub_type=T.INT32)
    w.add_key_value("a.long_strings", [f"tok{i}" for i in range(LONG)], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("a.nested", NESTED, T.ARRAY, sub_type=T.ARRAY)
    w.add_key_value("t.nan", float("nan"), T.FLOAT32)
    w.add_key_value("a.inf", [float("inf"), 1.0], T.ARRAY, sub_type=T.FLOAT64)
    w.add_tensor("x.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(path) -> dict:
    return {kv["key"]: kv for kv in quantkit.inspect_model(path)["metadata"]}


def test_every_value_type_as_gguf_py_reads_it(typed):
    meta = _metadata(typed)
    fields = gguf.GGUFReader(str(typed)).fields
    for key in [*SCALARS, *ARRAYS]:
        expected = fields[key].contents()
        if isinstance(expected, np.generic):
            expected = expected.item()
        got = meta[key]["value"]
        assert got == expected, key
        assert type(got) is type(expected), key                 # 30, not "30"; false, not "False"
    for key, (value, vtype) in SCALARS.items():
        assert meta[key]["type"] == vtype.name.lower() and "length" not in meta[key]
    assert meta["t.uint32"]["value"] == 30 and meta["t.bool_false"]["value"] is False
    assert meta["t.float32"]["value"] == float(np.float32(1e-5))   # the stored float32, exactly
    for key, (items, elem) in ARRAYS.items():
        assert meta[key]["type"] == f"array[{elem.name.lower()}]"
        assert (meta[key]["length"], meta[key]["truncated"]) == (len(items), False)


def test_json_output_is_strict(typed, capsys):
    """NaN and infinities, which json.loads of other languages refuse, are written as null."""
    assert main(["inspect", str(typed), "--json"]) == 0

    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")
    doc = json.loads(capsys.readouterr().out, parse_constant=refuse)
    meta = {kv["key"]: kv for kv in doc["metadata"]}
    assert meta["t.nan"]["value"] is None and meta["a.inf"]["value"] == [None, 1.0]
    assert meta["t.uint32"]["value"] == 30 and meta["a.long"]["length"] == LONG


def test_long_arrays_are_cut_with_their_length(typed):
    meta = _metadata(typed)
    fields = gguf.GGUFReader(str(typed)).fields
    for key in ("a.long", "a.long_strings"):
        entry = meta[key]
        assert entry["length"] == LONG and entry["truncated"] is True
        assert entry["value"] == fields[key].contents()[:JSON_ARRAY_ITEMS]


def test_nested_arrays(typed, tmp_path):
    """gguf-py writes arrays of arrays (and reads them back flattened); the C loaders refuse them,
    so only inspect reads them: every other command refuses the file in one line."""
    meta = _metadata(typed)
    entry = meta["a.nested"]
    assert entry["value"] == NESTED and entry["type"] == "array[array]"
    assert (entry["length"], entry["truncated"]) == (len(NESTED), False)
    flat = gguf.GGUFReader(str(typed)).fields["a.nested"].contents()
    assert [x for inner in entry["value"] for x in inner] == flat
    with pytest.raises(QuantkitError) as e:
        quantkit.quantize_model(typed, tmp_path / "o.gguf", "q8_0")
    assert "a.nested" in str(e.value) and "nested arrays are not supported" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "o.gguf").exists()


def test_table_still_shows_arrays_in_part(typed, capsys, monkeypatch):
    from quantkit import cli
    monkeypatch.setattr(cli.out, "width", 400)      # a row a line
    rc = main(["inspect", str(typed), "--no-tensors"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"… ({LONG} items)]" in out and "[[1, 2], [3], [4, 5, 6]]" in out


def _nested_file(path, depth):
    """An int32 array inside ``depth - 1`` arrays of one array each (gguf-py nests no deeper than
    Python lists do, so the bytes are written here)."""
    import struct
    from quantkit.gguf_io.constants import GGUF_MAGIC
    key = b"a.deep"
    value = struct.pack("<iQ", 5, 1) + struct.pack("<i", 7)
    for _ in range(depth - 1):
        value = struct.pack("<iQ", 9, 1) + value
    body = struct.pack("<Q", len(key)) + key + struct.pack("<i", 9) + value
    path.write_bytes(GGUF_MAGIC + struct.pack("<Iqq", 3, 0, 1) + body)
    return path


def test_nesting_is_bounded(tmp_path):
    from quantkit.gguf_io.reader import MAX_ARRAY_DEPTH
    meta = _metadata(_nested_file(tmp_path / "ok.gguf", MAX_ARRAY_DEPTH))
    value = meta["a.deep"]["value"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value = value[0]
    assert value == [7]
    with pytest.raises(QuantkitError, match="nested more than"):
        quantkit.inspect_model(_nested_file(tmp_path / "deep.gguf", MAX_ARRAY_DEPTH + 1))
