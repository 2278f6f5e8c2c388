"""Hostile numbers: values no quantizer can represent, imatrices that are not importance data,
imatrix "files" that never end, and merges of entries that do not belong together (issue 22,
items 11, 14 and 15).

The rule for every quantizable type (formats/limits.py derives the bounds): a row is quantized
with every decoded value finite and the planted value kept, or refused with a one-line error
naming the tensor, row and column; never a block of zeros.  What each type does with one value of
1e38, 3e38, FLT_MAX, 131008 (2 x 65504) or 65504000 in a row of 256:

* f32 and bf16_r16 (which truncates) keep all of them; bf16 all but FLT_MAX (it rounds to inf:
  refused);
* every other type refuses 1e38, 3e38, FLT_MAX and 65504000 (an fp16 scale or f16 value
  overflows, or the float32 scale search would: its bound is at most 5.8e5);
* 131008 is kept by every type except f16 (above 65504), ik's q2_K (and q2_k_r4) without an
  imatrix (its fp16 scale overflows), and the types whose bound is lower: q3_K/q4_K/q5_K with an
  imatrix (their search over the sub-block scales: 1.0e5, 8.3e4) and the trellis types (their
  row-scale search: 1.3e4 for rows of 256), all refused.

Refusals are checked through the library (quantkit.quantize_model, merge_imatrix, …: a one-line
QuantkitError, which the CLI prints as its one line) and, for the exit status and the files left,
through a subprocess of the CLI in a few places.
"""
from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest

import quantkit
from hostile import Snapshot, assert_refused, run_cli
from models import write_llama
from quantkit import formats
from quantkit.errors import QuantkitError
from quantkit.formats import limits
from quantkit.imatrix import load_imatrix, save_gguf
from quantkit.imatrix_tools import RawImatrix
from quantkit.quantize import quantize_rows
from quantkit.types import QuantType, traits, type_name

N = 256


def refusal(call) -> str:
    """The one-line QuantkitError ``call()`` raises (the line the CLI prints)."""
    with pytest.raises(QuantkitError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message, message
    return message

COL = 37                    # where the hostile value goes (block 1 of 32-value types, 2 of 16-value)
FLT_MAX = float(np.finfo(np.float32).max)
BIG = (1e38, 3e38, FLT_MAX, 65504.0 * 2, 65504.0 * 1000)


def quant_paths():
    """(type, flavor, with_imatrix) for every quantizer: both flavors of the types both projects
    have (ggml ids below 64), ik's for its own (IQK, trellis, q6_0, interleaved: they ignore the
    flavor)."""
    out = []
    for qt, fmt in sorted(formats.registered().items()):
        for flavor in ("ik", "mainline"):
            if flavor == "mainline" and qt >= 64:
                continue
            for imat in (False, True):
                if (flavor, imat) in fmt.quant_paths:
                    tag = f"{type_name(qt)}-{flavor}-{'imat' if imat else 'plain'}"
                    out.append(pytest.param(qt, flavor, imat, id=tag))
    return out


def rows_for(qt, seed=0, scale=0.02):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((traits(qt).interleave_rows, N)) * scale).astype(np.float32)


def refused_at(e: QuantkitError, row: int, col: int) -> bool:
    m = re.search(r"tensor 't': row (\d+), column (\d+):", str(e))
    return m is not None and (int(m.group(1)), int(m.group(2))) == (row, col) and "\n" not in str(e)


# ---- item 11: values ----

@pytest.mark.parametrize("qt, flavor, imat", quant_paths())
def test_unrepresentable_values_are_refused_or_kept(qt, flavor, imat):
    """One huge value in row 1: refused naming row 1 and its column, or quantized with every
    decoded value finite, the value within a factor 2 and its block not zeroed."""
    outcome = {}
    for big in BIG:
        x = rows_for(qt)
        row = min(1, x.shape[0] - 1)
        x[row, COL] = big
        qw = np.random.default_rng(1).uniform(0.5, 1.5, N).astype(np.float32) if imat else None
        try:
            q = quantize_rows(x, qt, qw, flavor, "t")
        except QuantkitError as e:
            assert refused_at(e, row, COL), str(e)
            outcome[big] = "refused"
            continue
        y = formats.dequantize(q, qt, N)
        bs = traits(qt).block_size
        assert np.isfinite(y).all()
        assert 0.5 < y[row, COL] / big < 2, (big, y[row, COL])
        assert np.any(y[row, COL // bs * bs:(COL // bs + 1) * bs] != 0)
        outcome[big] = "kept"
    name = type_name(qt)
    if name in ("f32", "iq2_bn", "iq2_bn_r4", "mxfp4", "mxfp4_r8"):
        # iq2_bn: a float32 row scale max|x|, no search; mxfp4: an E8M0 power of two up to 2^127
        assert set(outcome.values()) == {"kept"}
    elif name in ("q8_KV", "q8_KV_r8"):     # a float32 row scale max|x|/127: 127 d overflows at FLT_MAX only
        assert [b for b, o in outcome.items() if o == "refused"] == [FLT_MAX]
    elif name == "bf16":            # rounds to nearest even: FLT_MAX rounds up to inf
        assert [b for b, o in outcome.items() if o == "refused"] == [FLT_MAX]
    elif name == "bf16_r16":        # truncates: FLT_MAX becomes bf16's largest value
        assert set(outcome.values()) == {"kept"}
    else:                   # beyond every fp16 scale and every search bound
        assert all(outcome[b] == "refused" for b in (1e38, 3e38, FLT_MAX, 65504.0 * 1000)), outcome
        q2k_ik_plain = (traits(qt).base or qt) == QuantType.Q2_K and flavor == "ik" and not imat
        # f16, and the types whose fp16 scale is max|x| itself (iq1_bn, tq1_0, tq2_0): not above 65504
        # mainline's iq1_m: its fp16 super-block scale of a row holding 2 x 65504 decodes to inf (the
        # output check refuses it; with an imatrix, and in ik's flavor, it is kept)
        iq1_m_mainline = name == "iq1_m" and flavor == "mainline" and not imat
        expect = (name in ("f16", "iq1_bn", "tq1_0", "tq2_0") or q2k_ik_plain or iq1_m_mainline
                  or limits.largest_value(qt, N, imat) < 131008)
        assert outcome[65504.0 * 2] == ("refused" if expect else "kept"), outcome


@pytest.mark.parametrize("qt, flavor, imat", [p for p in quant_paths()
                                             if np.isfinite(limits.largest_value(p.values[0], N, p.values[2]))])
def test_rows_at_the_bound_quantize_as_at_unit_scale(qt, flavor, imat):
    """A row of ±B (every value at the type's bound: the largest sums its search can form)
    quantizes about as well as the same signs at ±1 (so no sum overflowed), or is refused by the
    output check (an fp16 scale or min past 65504: Q4_1, Q5_1, ik's Q2_K); just above B the
    input check refuses it, naming the first value."""
    rng = np.random.default_rng(2)
    signs = np.where(rng.random((traits(qt).interleave_rows, N)) < 0.5, -1, 1).astype(np.float32)
    qw = rng.uniform(0.5, 1.5, N).astype(np.float32) if imat else None
    b = np.float32(limits.largest_value(qt, N, imat))

    def rel_error(scale):
        x = signs * np.float32(scale)
        y = formats.dequantize(quantize_rows(x, qt, qw, flavor, "t"), qt, N)
        return float(np.sqrt(np.mean((y - x) ** 2))) / float(scale)

    unit = rel_error(1.0)
    try:
        at_bound = rel_error(b)
    except QuantkitError as e:          # the output check, not the input check
        assert "would decode to inf or nan" in str(e), str(e)
    else:
        assert at_bound <= 1.5 * unit + 0.02, (unit, at_bound)
    with pytest.raises(QuantkitError, match=r"row 0, column 0: \|x\| = .* beyond the largest value"):
        quantize_rows(signs * np.nextafter(b, np.float32(np.inf)), qt, qw, flavor, "t")


@pytest.mark.parametrize("qt", [t for t in sorted(formats.registered())
                                if np.isfinite(limits.largest_value(t, N, True))], ids=type_name)
def test_imatrix_products_past_the_bound_are_refused(qt):
    """With an imatrix the weights are qw·sqrt(σ² + x²): the search sums |x|·qw·|x|.  Scaled by
    a power of two up to the bound, ordinary rows quantize as well as with the plain imatrix; one
    step past it the column with the largest qw·|x| is named."""
    x = rows_for(qt, seed=3, scale=30.0)
    qw = np.random.default_rng(4).uniform(0.5, 1.5, N).astype(np.float32)
    qw[COL] = 8.0                   # the column that will carry the largest product
    x[:, COL] = 100.0
    k = next(k for k in range(200) if limits.first_excess(x, qt, qw * np.float32(2.0 ** (k + 1))) is not None)
    base = formats.dequantize(quantize_rows(x, qt, qw, "ik", "t"), qt, N)
    scaled = formats.dequantize(quantize_rows(x, qt, qw * np.float32(2.0 ** k), "ik", "t"), qt, N)
    err = lambda y: float(np.sqrt(np.mean((y - x) ** 2)))      # noqa: E731
    assert err(scaled) <= 1.5 * err(base) + 1e-3 * 30
    with pytest.raises(QuantkitError) as e:
        quantize_rows(x, qt, qw * np.float32(2.0 ** (k + 1)), "ik", "t")
    assert refused_at(e.value, 0, COL) and "imatrix weight" in str(e.value)


def test_row_extent_equals_numpy_and_flags_every_non_finite_row():
    """The input scan (formats.limits.row_extent) against plain numpy: max |x| and max |x|·w per
    row, +inf wherever a NaN or an infinity stands, in any column (the first, the last, the tail
    of the 70-wide rows)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 70)) * 10.0 ** rng.integers(-30, 30, (40, 1))).astype(np.float32)
    w = rng.random(70).astype(np.float32) * 1e3
    planted = {3: (0, np.nan), 9: (69, np.inf), 17: (33, -np.inf), 25: (65, np.nan)}
    for r, (c, v) in planted.items():
        x[r, c] = v
    got = limits.row_extent(x, w)
    finite = np.isfinite(x).all(axis=1)
    assert np.array_equal(np.flatnonzero(~finite), sorted(planted))
    assert np.isinf(got[~finite, 0]).all()
    a = np.abs(x[finite])
    np.testing.assert_array_equal(got[finite, 0], a.max(axis=1))
    np.testing.assert_array_equal(got[finite, 1], (a * w).max(axis=1))
    assert (limits.row_extent(x[finite])[:, 1] == 0).all()


def test_a_huge_weight_in_a_model_is_refused_naming_tensor_row_column(tmp_path):
    """Through the CLI, as a user meets it: rc 1, one line, no output file, the input unchanged."""
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, vocab=False)
    r = gguf.GGUFReader(str(model), "r+")
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    t.data[3, COL] = 1e38
    r.data.flush()
    del r
    snap = Snapshot(tmp_path)
    rc, out, err = run_cli("quantize", model, tmp_path / "q.gguf", "q6_K")
    assert_refused(rc, out, err, "blk.0.ffn_down.weight", "row 3", f"column {COL}")
    snap.assert_unchanged()


@pytest.mark.parametrize("qtype", ["iq2_k", "iq4_xs", "q8_0", "f16"])
def test_a_huge_weight_is_refused_in_process(tmp_path, qtype):
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, vocab=False)
    r = gguf.GGUFReader(str(model), "r+")
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    t.data[5, 200] = 3e38
    r.data.flush()
    del r
    line = refusal(lambda: quantkit.quantize_model(model, tmp_path / "q.gguf", qtype))
    assert "blk.0.attn_q.weight" in line and "row 5, column 200" in line
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_a_non_finite_half_is_refused_by_q8_0(tmp_path, value):
    """An F16 model's q8_0 runs from the half bits (q8_0_numpy.quantize_f16_rows); the chunk with a
    NaN or an infinity goes the float32 way, which names it."""
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, vocab=False, dtype=np.float16)
    r = gguf.GGUFReader(str(model), "r+")
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    t.data[5, 200] = value
    r.data.flush()
    del r
    line = refusal(lambda: quantkit.quantize_model(model, tmp_path / "q.gguf", "q8_0"))
    assert "blk.0.attn_q.weight" in line and "non-finite" in line and "row 5, column 200" in line
    assert not (tmp_path / "q.gguf").exists()


# ---- item 11: imatrix values ----

def imatrix_gguf(path, entries, chunk_size=16):
    """entries: name -> (sums (n_mat, n), counts (n_mat,)), written with gguf-py (any values)."""
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["x"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, (sums, counts) in sorted(entries.items()):
        sums, counts = np.asarray(sums, np.float32), np.asarray(counts, np.float32)
        w.add_tensor(name + ".in_sum2", sums.reshape(-1) if sums.shape[0] == 1 else sums)
        w.add_tensor(name + ".counts", counts if counts.size == 1 else counts.reshape(-1, 1))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def imatrix_dat(path, entries):
    """entries: name -> (ncall, values as stored)."""
    import struct
    b = struct.pack("<i", len(entries))
    for name, (ncall, vals) in entries.items():
        v = np.asarray(vals, "<f4")
        b += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, v.size) + v.tobytes()
    path.write_bytes(b)
    return path


@pytest.mark.parametrize("value, why", [(np.nan, "non-finite"), (np.inf, "non-finite"), (-2.0, "negative"),
                                        (3e38, "above"), (2.0 ** 61, "above")])
def test_imatrix_values_are_refused_at_load_naming_entry_and_column(tmp_path, value, why):
    sums = np.ones((4, 32), np.float32)
    sums[2, 7] = value
    f = imatrix_gguf(tmp_path / "i.gguf", {"blk.0.ffn_up_exps.weight": (sums, [1, 1, 1, 1]),
                                          "blk.0.attn_q.weight": (np.ones((1, 32)), [1])})
    with pytest.raises(QuantkitError) as e:
        load_imatrix(f)
    msg = str(e.value)
    assert "'blk.0.ffn_up_exps.weight', matrix 2, column 7" in msg and why in msg, msg
    d = imatrix_dat(tmp_path / "i.dat", {"blk.0.attn_q.weight": (1, np.where(np.arange(32) == 9, value, 1.0))})
    with pytest.raises(QuantkitError, match=rf"'blk.0.attn_q.weight', column 9: value .* {why}"):
        load_imatrix(d)


def test_largest_imatrix_value_loads(tmp_path):
    f = imatrix_gguf(tmp_path / "i.gguf", {"a.weight": (np.full((1, 32), limits.IMATRIX_LIMIT), [1])})
    assert load_imatrix(f).weights["a.weight"].max() == np.float32(limits.IMATRIX_LIMIT)


def test_quantize_refuses_an_imatrix_near_float_max(tmp_path):
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=256, n_ff=256, vocab=False)
    imat = imatrix_dat(tmp_path / "i.dat", {"blk.0.attn_k.weight": (1, np.full(256, 3e38, np.float32))})
    line = refusal(lambda: quantkit.quantize_model(model, tmp_path / "q.gguf", "iq4_k", imatrix=imat))
    assert "'blk.0.attn_k.weight', column 0" in line and "above" in line


@pytest.mark.parametrize("counts, needle", [([1, -3], "count -3 of matrix 1"), ([1, np.nan], "count nan of matrix 1"),
                                            ([1e19, 1], "count 1e+19 of matrix 0")])
def test_imatrix_counts_must_be_token_counts(tmp_path, counts, needle):
    f = imatrix_gguf(tmp_path / "i.gguf", {"e.weight": (np.ones((2, 32)), counts)})
    with pytest.raises(QuantkitError, match=re.escape(needle)):
        load_imatrix(f)
    d = imatrix_dat(tmp_path / "i.dat", {"a.weight": (-2, np.ones(32))})
    with pytest.raises(QuantkitError, match="negative ncall"):
        load_imatrix(d)


# ---- item 14: imatrix inputs that are not files ----

@pytest.mark.parametrize("call", [
    lambda model, out, bad: quantkit.quantize_model(model, out, "q8_0", imatrix=bad),
    lambda model, out, bad: quantkit.imatrix_stats(bad),
    lambda model, out, bad: quantkit.convert_imatrix(bad, out),
    lambda model, out, bad: quantkit.merge_imatrix([bad], out)], ids=["quantize", "stats", "convert", "merge"])
def test_imatrix_from_a_device_or_fifo_is_refused(tmp_path, call):
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=64, n_ff=64, vocab=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                 # nothing writes to it: opening it for reading would block
    for bad in ("/dev/zero", str(fifo)):
        line = refusal(lambda: call(model, tmp_path / "o.gguf", bad))
        assert f"{bad}:" in line and "not a regular file" in line, line
        assert not (tmp_path / "o.gguf").exists()


def test_imatrix_dev_zero_through_the_cli(tmp_path):
    model = write_llama(tmp_path / "m.gguf", n_layer=1, n_embd=64, n_ff=64, vocab=False)
    snap = Snapshot(tmp_path)
    rc, out, err = run_cli("quantize", model, tmp_path / "q.gguf", "q8_0", "--imatrix", "/dev/zero", timeout=120)
    assert_refused(rc, out, err, "/dev/zero", "not a regular file")
    snap.assert_unchanged()


# ---- item 15: merges and conversions ----

def test_merge_refuses_entries_of_different_shapes(tmp_path):
    """1 x 512 and 4 x 128: the same number of values, not the same tensor."""
    a = imatrix_gguf(tmp_path / "a.gguf", {"blk.0.ffn_up_exps.weight": (np.ones((1, 512)), [4])})
    b = imatrix_gguf(tmp_path / "b.gguf", {"blk.0.ffn_up_exps.weight": (np.ones((4, 128)), [1, 1, 1, 1])})
    snap = Snapshot(tmp_path)
    line = refusal(lambda: quantkit.merge_imatrix([a, b], tmp_path / "m.gguf"))
    assert ("'blk.0.ffn_up_exps.weight': 1 matrix of 512 values in one file, 4 matrices of 128 values in the other"
            in line), line
    snap.assert_unchanged()


def test_merge_of_a_legacy_dat_spreads_its_count_over_the_experts(tmp_path):
    """A .dat does not record its matrices: only the number of values has to match."""
    d = imatrix_dat(tmp_path / "a.dat", {"blk.0.ffn_up_exps.weight": (2, np.full(512, 3.0))})
    g = imatrix_gguf(tmp_path / "b.gguf", {"blk.0.ffn_up_exps.weight": (np.ones((4, 128)), [1, 2, 3, 4])})
    out = tmp_path / "m.gguf"
    assert quantkit.merge_imatrix([d, g], out, chunk_size=16).entries == 1
    m = load_imatrix(out)
    assert m.counts["blk.0.ffn_up_exps.weight"].tolist() == [33, 34, 35, 36]


@pytest.mark.parametrize("command", ["convert", "merge"])
def test_counts_that_do_not_match_the_sums_are_refused(tmp_path, command):
    orphan = imatrix_gguf(tmp_path / "o.gguf", {"e.weight": (np.ones((2, 32)), [3, 0])})
    no_ncall = imatrix_dat(tmp_path / "n.dat", {"a.weight": (0, np.ones(32))})
    run = {"convert": quantkit.convert_imatrix, "merge": quantkit.merge_imatrix}[command]
    for src, needle in ((orphan, "'e.weight': matrix 1 has sums but a count of 0"),
                        (no_ncall, "'a.weight' has values but ncall 0")):
        line = refusal(lambda: run(src, tmp_path / "out.gguf"))
        assert needle in line, line
        assert not (tmp_path / "out.gguf").exists()
    # llama-quantize ignores the sums of a matrix without tokens (weight 1): so does quantize
    assert load_imatrix(orphan).weights["e.weight"][32:].tolist() == [1.0] * 32


def test_what_the_output_format_cannot_hold_is_refused(tmp_path):
    """Sums past 3.4e38 (collected from activations of 1e20: GGUF stores float32 sums), a token
    count whose ncall does not fit the legacy format's int32, merged counts past int64's range."""
    raw = RawImatrix({"w.weight": np.full((1, 32), 1e40)}, {"w.weight": np.array([512])}, 512, ["x"])
    with pytest.raises(QuantkitError, match="'w.weight', column 0: the value overflows float32"):
        raw.save(tmp_path / "r.gguf")
    a = tmp_path / "a.gguf"
    save_gguf(a, {"w.weight": np.full((1, 32), 2.0 ** 40)}, {"w.weight": np.array([2.0 ** 40])}, datasets=["x"],
              chunk_count=1, chunk_size=16)
    line = refusal(lambda: quantkit.convert_imatrix(a, tmp_path / "a.dat"))
    assert f"'w.weight': {2 ** 40} tokens are {2 ** 36} chunks of 16" in line and "int32 ncall" in line, line
    b = tmp_path / "b.gguf"
    save_gguf(b, {"w.weight": np.full((1, 32), 2.0 ** 61)}, {"w.weight": np.array([2.0 ** 61])}, datasets=["x"],
              chunk_count=1, chunk_size=16)
    line = refusal(lambda: quantkit.merge_imatrix([b, b], tmp_path / "m.gguf"))
    assert "'w.weight': merged token counts pass 2^62" in line
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "a.dat").exists()
