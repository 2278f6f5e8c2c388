"""`quantkit imatrix convert | merge | stats` and quantize's `--missing-expert` policy, through the
library beneath them (quantkit.convert_imatrix, merge_imatrix, imatrix_stats, quantize_model);
the stats table's rendering is tested with the CLI's output (test_cli_output.py).

Conversions are checked against llama-imatrix's own pair of files (one run written in both formats,
../shared/golden/imatrix), merges against sums and counts added by hand, the expert policy against
formats.quantize with the weights each policy stands for.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

import quantkit
from hostile import Snapshot
from models import write_deepseek2
from quantkit import formats
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import open_model
from quantkit.imatrix import load_imatrix, save_gguf
from quantkit.types import QuantType


@pytest.fixture(scope="module")
def golden(shared_dir):
    return shared_dir / "golden" / "imatrix"


def assert_same_weights(a, b, rtol=1e-6):
    assert set(a.weights) == set(b.weights)
    for n in a.weights:
        np.testing.assert_allclose(a.weights[n], b.weights[n], rtol=rtol, err_msg=n)


def test_convert_gguf_to_dat_gives_llama_imatrix_dat(golden, tmp_path):
    out = tmp_path / "x.dat"
    r = quantkit.convert_imatrix(golden / "smollm2-q4_1-gpl3.gguf", out)
    assert (r.file, r.chunks, r.inputs) == (out, 8, 1)
    ours, ref = load_imatrix(out), load_imatrix(golden / "smollm2-q4_1-gpl3.dat")
    assert_same_weights(ours, ref)
    assert {n: c.tolist() for n, c in ours.counts.items()} == {n: c.tolist() for n, c in ref.counts.items()}
    assert ours.chunk_count == ref.chunk_count == 8
    assert r.entries == len(ref.weights)


def test_convert_dat_to_gguf_with_its_chunk_size(golden, tmp_path):
    out = tmp_path / "x.gguf"
    r = quantkit.convert_imatrix(golden / "smollm2-q4_1-gpl3.dat", out, chunk_size=256)
    assert (r.chunks, r.chunk_size) == (8, 256)
    ours, ref = load_imatrix(out), load_imatrix(golden / "smollm2-q4_1-gpl3.gguf")
    assert_same_weights(ours, ref)
    assert (ours.chunk_count, ours.chunk_size) == (8, 256)
    assert all(int(c[0]) == 2048 for c in ours.counts.values())


def test_merge_adds_sums_and_counts(golden, tmp_path):
    out = tmp_path / "m.gguf"
    src = golden / "smollm2-q4_1-gpl3.gguf"
    r = quantkit.merge_imatrix([src, src], out)
    assert (r.file, r.inputs, r.chunks) == (out, 2, 16)
    ours, ref = load_imatrix(out), load_imatrix(src)
    assert_same_weights(ours, ref)              # twice the sums over twice the tokens
    assert all(int(c[0]) == 4096 for c in ours.counts.values()) and ours.chunk_count == 16


def moe_imatrix(path, n_expert=4, n_in=256, counts=(10, 0, 5, 7), seed=0):
    rng = np.random.default_rng(seed)
    c = np.array(counts, np.float32)
    sums = rng.uniform(0.5, 2.0, (n_expert, n_in)).astype(np.float32) * c[:, None]
    save_gguf(path, {"blk.1.ffn_up_exps.weight": sums, "blk.1.ffn_down.weight": sums[:1] * 0 + 3.0},
              {"blk.1.ffn_up_exps.weight": c, "blk.1.ffn_down.weight": np.array([1], np.float32)},
              datasets=["synthetic"], chunk_count=1, chunk_size=16)
    return sums, c


def test_merge_spreads_a_single_count_over_experts(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    sa, ca = moe_imatrix(a)
    sb, cb = moe_imatrix(b, counts=(1, 2, 3, 4), seed=1)
    out = tmp_path / "ab.gguf"
    assert quantkit.merge_imatrix([a, b], out).entries == 2
    m = load_imatrix(out)
    np.testing.assert_array_equal(m.counts["blk.1.ffn_up_exps.weight"], (ca + cb).astype(np.int64))
    want = (sa + sb) / (ca + cb)[:, None]
    np.testing.assert_allclose(m.weights["blk.1.ffn_up_exps.weight"], want.reshape(-1), rtol=1e-6)


def test_stats_reports_experts_without_data(tmp_path):
    path = tmp_path / "moe.gguf"
    sums, c = moe_imatrix(path)
    st = quantkit.imatrix_stats(path, top=3)
    assert st.experts_without_data == {"blk.1.ffn_up_exps.weight": [1]}
    assert (st.chunks, st.chunk_size, st.datasets) == (10 // 16, 16, ["synthetic"])    # the busiest expert's
    row = next(r for r in st.entries if r["name"] == "blk.1.ffn_up_exps.weight")
    imp = np.mean([sums[e] / c[e] for e in (0, 2, 3)], axis=0)
    assert row["matrices"] == 4 and row["no_data"] == [1] and row["tokens"] == 22
    assert row["top_columns"] == np.argsort(-imp, kind="stable")[:3].tolist()
    assert abs(row["max_over_mean"] - imp.max() / imp.mean()) < 1e-6 * row["max_over_mean"]
    assert st.to_json()["experts_without_data"] == st.experts_without_data


@pytest.mark.parametrize("call, needle", [
    (lambda d: quantkit.merge_imatrix([], d / "o.gguf"), "no imatrix file given"),
    (lambda d: quantkit.merge_imatrix([d / "moe.gguf"], d / "moe.gguf"), "-o"),
    (lambda d: quantkit.convert_imatrix(d / "moe.gguf", d / "moe.gguf"), "OUT"),
    (lambda d: quantkit.convert_imatrix(d / "missing.gguf", d / "o.dat"), "missing.gguf"),
    (lambda d: quantkit.imatrix_stats(d / "moe.gguf", top=0), "top"),
])
def test_imatrix_file_errors_raise_quantkit_error(tmp_path, call, needle):
    moe_imatrix(tmp_path / "moe.gguf")
    before = Snapshot(tmp_path)
    with pytest.raises(QuantkitError) as e:
        call(tmp_path)
    assert needle in str(e.value)
    before.assert_unchanged()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds-imat")
    model = write_deepseek2(d / "ds.gguf", n_layer=2, n_dense=1, n_expert=4, seed=5)
    imat = d / "partial.gguf"
    moe_imatrix(imat)
    return model, imat


def expert_rows(path, name, e):
    with open_model(path) as m:
        t = m.by_name[name]
        raw = t.raw()
        n = t.shape[1]
        return raw[e * n:(e + 1) * n].copy(), t.shape


def test_missing_expert_policies(deepseek, tmp_path, caplog):
    model, imat = deepseek
    name = "blk.1.ffn_up_exps.weight"
    options = dict(custom_q=f"{name}=q4_K", imatrix=imat)

    out = tmp_path / "err.gguf"
    with pytest.raises(QuantkitError) as e:
        quantkit.quantize_model(model, out, missing_expert="error", **options)
    assert "experts without imatrix data" in str(e.value) and name in str(e.value) and not out.exists()

    files = {}
    for policy in ("unit", "fill-mean"):
        files[policy] = tmp_path / f"{policy}.gguf"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quantkit"):
            quantkit.quantize_model(model, files[policy], missing_expert=policy, **options)
        assert "partial data" in caplog.text and name in caplog.text
    f32_rows, shape = expert_rows(model, name, 1)
    x = f32_rows.view(np.float32).reshape(shape[1], shape[0])
    data = load_imatrix(imat)
    w = data.weights[name].reshape(4, -1)
    expected = {"unit": np.ones(shape[0], np.float32), "fill-mean": w[[0, 2, 3]].mean(axis=0)}
    for policy, path in files.items():
        got, _ = expert_rows(path, name, 1)
        want = formats.quantize(x, QuantType.Q4_K, expected[policy].astype(np.float32))
        np.testing.assert_array_equal(got, want, err_msg=policy)
    # experts with data are quantized alike under both policies
    for e in (0, 2, 3):
        np.testing.assert_array_equal(expert_rows(files["unit"], name, e)[0], expert_rows(files["fill-mean"], name, e)[0])


def test_experts_that_never_fire_end_to_end(tmp_path, shared_dir):
    """A tiny deepseek2 (16 experts, 2 used) through `quantkit imatrix` on a short text: the experts
    that got no token are reported at collection, listed by `stats`, refused by
    `quantize --missing-expert error` and quantized with `fill-mean`."""
    model = write_deepseek2(tmp_path / "ds.gguf", n_expert=16, n_expert_used=2, n_layer=3, n_dense=1, seed=3)
    text = tmp_path / "t.txt"
    text.write_text((shared_dir / "golden" / "imatrix" / "calib-gpl3.txt").read_text()[:3000])
    imat = tmp_path / "ds.imatrix.gguf"
    collected = quantkit.collect_imatrix(model, text, imat, ctx_size=32, chunks=2)
    partial = collected.partial
    assert partial and len(collected.warnings) == len(partial)
    assert all("experts got no token" in w for w in collected.warnings)
    assert quantkit.imatrix_stats(imat).experts_without_data == partial
    data = load_imatrix(imat)
    assert {n: np.nonzero(c == 0)[0].tolist() for n, c in data.counts.items() if (c == 0).any()} == partial
    options = dict(custom_q=r"ffn_.*_exps=q4_K", imatrix=imat)
    out = tmp_path / "q.gguf"
    with pytest.raises(QuantkitError, match="experts without imatrix data"):
        quantkit.quantize_model(model, out, missing_expert="error", **options)
    assert not out.exists()
    result = quantkit.quantize_model(model, out, missing_expert="fill-mean", **options)
    assert result.paths == [out] and out.exists()


def test_stats_figures(tmp_path):
    """The statistics of two dense entries in consecutive layers, recomputed here by hand."""
    rng = np.random.default_rng(2)
    a = rng.uniform(0, 1, 64) ** 4
    b = a * rng.uniform(0.5, 1.5, 64)
    path = tmp_path / "two.gguf"
    save_gguf(path, {"blk.0.ffn_up.weight": a[None] * 10, "blk.1.ffn_up.weight": b[None] * 10},
              {"blk.0.ffn_up.weight": np.array([10.0]), "blk.1.ffn_up.weight": np.array([10.0])},
              datasets=["x"], chunk_count=1, chunk_size=10)
    rows = {r["name"]: r for r in quantkit.imatrix_stats(path).entries}
    r0, r1 = rows["blk.0.ffn_up.weight"], rows["blk.1.ffn_up.weight"]
    a32 = a.astype(np.float32).astype(np.float64)
    b32 = b.astype(np.float32).astype(np.float64)
    p = a32 / a32.sum()
    assert abs(r0["entropy"] - float(-(p * np.log2(p)).sum())) < 1e-6
    assert abs(r0["entropy_norm"] - r0["entropy"] / 6.0) < 1e-9
    assert abs(r0["active_pct"] - 100 * (a32 > 1e-5).mean()) < 1e-9
    assert abs(r0["zd_pct"] - 100 * ((a32 - a32.mean()) > a32.std()).mean()) < 1e-9
    assert r0["cos_prev"] is None
    assert abs(r1["cos_prev"] - a32 @ b32 / np.linalg.norm(a32) / np.linalg.norm(b32)) < 1e-6
    assert abs(r1["std"] - b32.std()) < 1e-6 * b32.std()
