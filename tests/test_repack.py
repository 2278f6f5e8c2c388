"""`quantkit repack`: plain <-> row-interleaved layouts, against the wheel's `llama-quantize --repack`.

A llama model with a mix of plain types (written by quantkit) is repacked by both tools: same types,
same tensor bytes (a byte shuffle does not depend on FMA) and the same file type; `--undo` gives the
plain bytes back; the repacked file loads in ik_llama.cpp and computes the same logits.
quantkit's side runs through the library (quantkit.quantize_model, repack_model, plan_repack)
in-process; one subprocess checks the CLI's refusal contract.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import peers
import quantkit
from hostile import Snapshot, assert_refused, digest, run_cli
from models import write_deepseek2, write_llama
from quantkit.errors import QuantkitError
from quantkit.formats import interleave
from quantkit.gguf_io.reader import open_model
from quantkit.repack import REPACKED_FTYPE

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

# plain types with an interleaved variant, one per tensor kind; token_embd is never interleaved
MIX = ("attn_q=q4_0,attn_k=q8_0,attn_v=q5_0,attn_output=iq4_nl,ffn_gate=q4_K,ffn_up=q6_K,ffn_down=iq4_xs,"
       "output=q3_K,token_embd=q2_K")
MIX_IQK = "attn_q=iq2_k,attn_k=iq3_k,attn_v=iq4_k,attn_output=iq5_k,ffn_gate=iq4_ks,ffn_up=iq5_ks,ffn_down=q6_0"
MIX_IQ3 = "attn_q=iq3_xxs,attn_k=iq3_s,attn_v=iq3_xxs,attn_output=iq3_s,ffn_gate=iq3_xxs,ffn_up=iq3_s,ffn_down=iq3_xxs"


def tensors(path) -> dict[str, tuple[int, tuple, np.ndarray]]:
    """name -> (type id, shape, raw bytes), in file order (gguf-py does not know ik's types)."""
    with open_model(path) as m:
        return {t.name: (int(t.qtype), tuple(t.shape), t.source.read(t.offset, t.nbytes)) for t in m.tensors}


def file_type(path):
    with open_model(path) as m:
        return m.get("general.file_type")


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    """The F32 tiny llama the plain mixes and the presets are quantized from."""
    return write_llama(tmp_path_factory.mktemp("f32") / "f32.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4,
                       n_head_kv=2, n_vocab=512, vocab=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_f32):
    d = tmp_path_factory.mktemp("repack")
    f32 = tiny_f32
    out = {}
    for tag, mix in (("k", MIX), ("iqk", MIX_IQK), ("iq3", MIX_IQ3)):
        out[tag] = d / f"{tag}.gguf"
        quantkit.quantize_model(f32, out[tag], "q8_0", pure=True, custom_q=mix)
    return d, f32, out


@needs_wheel
@pytest.mark.parametrize("tag", ["k", "iqk", "iq3"])
def test_repack_equals_llama_quantize_and_undo_restores(plain, tag):
    d, _, files = plain
    src = files[tag]
    ours, theirs, back = d / f"{tag}-r.gguf", d / f"{tag}-lq.gguf", d / f"{tag}-back.gguf"
    quantkit.repack_model(src, ours)
    p = subprocess.run([str(peers.llama_quantize_bin()), "--repack", str(src), str(theirs), "Q8_0", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    a, b, s = tensors(ours), tensors(theirs), tensors(src)
    assert list(a) == list(b)
    moved = 0
    for name, (qtype, _, raw) in a.items():
        assert qtype == b[name][0], name
        np.testing.assert_array_equal(raw, b[name][2], err_msg=name)
        moved += qtype != s[name][0]
    assert moved >= 7 and a["token_embd.weight"][0] == s["token_embd.weight"][0]
    assert file_type(ours) == file_type(theirs)
    # and back
    quantkit.repack_model(ours, back, undo=True)
    for name, (qtype, _, raw) in tensors(back).items():
        assert qtype == s[name][0], name
        np.testing.assert_array_equal(raw, s[name][2], err_msg=name)
    assert file_type(back) == file_type(src)
    # the files themselves: q8_0 -> q8_0_r8 needs no record, so ours is llama-quantize's file
    assert digest(back) == digest(src) and digest(ours) == digest(theirs)


@needs_wheel
def test_repacked_file_computes_the_same_logits(plain):
    """The interleaved kernels of ik_llama.cpp accumulate in another order (and quantize activations
    per row group), so logits agree to a small relative error, not bit for bit."""
    d, _, files = plain
    src = files["k"]
    out = d / "k-logits.gguf"
    quantkit.repack_model(src, out)
    tokens = list(range(5, 69))
    la = peers.ik_logits(src, tokens, all_positions=True)
    lb = peers.ik_logits(out, tokens, all_positions=True)
    assert np.isfinite(lb).all()
    assert np.abs(lb - la).max() <= 0.04 * np.abs(la).max()      # observed: 1.7%
    assert np.corrcoef(la.reshape(-1), lb.reshape(-1))[0, 1] > 0.999
    assert (la.argmax(axis=1) == lb.argmax(axis=1)).mean() > 0.9


def test_pattern_dry_run_and_errors(plain, tmp_path):
    _, f32, files = plain
    src = files["k"]
    plan = quantkit.plan_repack(src, pattern=r"ffn_(gate|up)")
    moved = {t.name for t in plan.tensors if t.action == "repack"}
    assert moved == {f"blk.{i}.ffn_{k}.weight" for i in range(2) for k in ("gate", "up")}
    # nothing to do: one line, no output file
    for model, out, options in ((f32, tmp_path / "f.gguf", {}), (src, tmp_path / "u.gguf", {"undo": True}),
                                (src, tmp_path / "x.gguf", {"pattern": "nothing_matches"})):
        with pytest.raises(QuantkitError, match="nothing to") as e:
            quantkit.repack_model(model, out, **options)
        assert "\n" not in str(e.value) and not out.exists()
    with pytest.raises(QuantkitError, match="invalid regex") as e:
        quantkit.repack_model(src, tmp_path / "y.gguf", pattern="(")
    assert "\n" not in str(e.value)


def test_expert_tensors_repack_per_expert(tmp_path):
    """3-D expert tensors: row groups never cross an expert; undo restores the bytes."""
    f32 = write_deepseek2(tmp_path / "ds.gguf", n_layer=2, n_dense=1, n_expert=4)
    q = tmp_path / "q.gguf"
    quantkit.quantize_model(f32, q, "q8_0", pure=True, custom_q="exps=q4_0")
    r, back = tmp_path / "r.gguf", tmp_path / "back.gguf"
    quantkit.repack_model(q, r)
    quantkit.repack_model(r, back, undo=True)
    a, b, c = tensors(q), tensors(r), tensors(back)
    qtype, shape, raw = a["blk.1.ffn_gate_exps.weight"]
    assert b["blk.1.ffn_gate_exps.weight"][0] == 202                    # q4_0_r8
    n, rows, n_exp = shape
    raw = raw.reshape(n_exp * rows, -1)
    per_expert = np.concatenate([interleave.interleave(raw[e * rows:(e + 1) * rows], 202, n) for e in range(n_exp)])
    np.testing.assert_array_equal(b["blk.1.ffn_gate_exps.weight"][2].reshape(per_expert.shape), per_expert)
    for name in a:
        np.testing.assert_array_equal(c[name][2], a[name][2])


# ---- round trips: `repack` then `repack --undo` gives back the input file, byte for byte --------------

# preset -> whether undo needs the recorded file type (several plain mixes share the repacked one)
ROUND_TRIP = {"Q4_K_M": True, "Q3_K_L": True, "Q4_0": False}


def metadata(path) -> dict:
    from quantkit.gguf_io.reader import GGUFFile
    with GGUFFile(path) as f:
        return {k: v.to_python() for k, v in f.metadata.items()}


@pytest.fixture(scope="module")
def presets(tmp_path_factory, tiny_f32):
    """A tiny llama quantized with presets (file types 15, 13 and 2) and each one repacked."""
    d = tmp_path_factory.mktemp("roundtrip")
    f32 = tiny_f32
    files = {}
    for preset in ROUND_TRIP:
        src, packed = d / f"{preset}.gguf", d / f"{preset}-r.gguf"
        quantkit.quantize_model(f32, src, preset)
        quantkit.repack_model(src, packed)
        files[preset] = src, packed
    return d, files


@pytest.mark.parametrize("preset", ROUND_TRIP)
def test_undo_of_repack_is_the_input_file(presets, preset, tmp_path):
    """The issue: the metadata came back reordered (file type and quantization version moved to the
    end) and Q4_K_M came back as file type 14 (Q4_K_S)."""
    _, files = presets
    src, packed = files[preset]
    back = tmp_path / "back.gguf"
    quantkit.repack_model(packed, back, undo=True)
    assert digest(back) == digest(src)
    a, b = metadata(src), metadata(packed)
    recorded = ROUND_TRIP[preset]
    # the input's keys in the input's order, the file type changed in place, the record appended
    assert list(b) == list(a) + (["quantkit.plain_file_type"] if recorded else [])
    assert b["general.file_type"] == REPACKED_FTYPE[a["general.file_type"]] != a["general.file_type"]
    assert b.get("quantkit.plain_file_type") == (a["general.file_type"] if recorded else None)
    assert {k: v for k, v in b.items() if k not in ("general.file_type", "quantkit.plain_file_type")} == \
        {k: v for k, v in a.items() if k != "general.file_type"}


@needs_wheel
@pytest.mark.parametrize("preset", ROUND_TRIP)
def test_repack_writes_what_llama_quantize_repack_writes(presets, preset):
    """Same metadata in the same order (general.file_type too), same tensors; the whole file is the
    same where undo needs no record."""
    d, files = presets
    src, packed = files[preset]
    theirs = d / f"{preset}-lq.gguf"
    p = subprocess.run([str(peers.llama_quantize_bin()), "--repack", str(src), str(theirs), "Q8_0", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ours = metadata(packed)
    ours.pop("quantkit.plain_file_type", None)
    assert list(ours.items()) == list(metadata(theirs).items())
    a, b = tensors(packed), tensors(theirs)
    assert list(a) == list(b)
    for name, (qtype, shape, raw) in a.items():
        assert (qtype, shape) == b[name][:2], name
        np.testing.assert_array_equal(raw, b[name][2], err_msg=name)
    assert (digest(packed) == digest(theirs)) == (not ROUND_TRIP[preset])


@needs_wheel
def test_recorded_file_type_loads_in_ik(presets):
    _, files = presets
    packed = files["Q4_K_M"][1]
    assert "quantkit.plain_file_type" in metadata(packed)
    assert np.isfinite(peers.ik_logits(packed, [5, 6, 7])).all()


def test_split_round_trips(presets, tmp_path):
    """A repack cut into shards undoes to the single input; a split input repacked and undone shard
    for shard (--keep-split) gives back every shard."""
    _, files = presets
    src = files["Q4_K_M"][0]
    result = quantkit.repack_model(src, tmp_path / "r.gguf", split_max_size="400K")
    shards = sorted(tmp_path.glob("r-0000*-of-*.gguf"))
    assert len(shards) >= 3 and result.paths == shards
    quantkit.repack_model(shards[0], tmp_path / "back.gguf", undo=True)
    assert digest(tmp_path / "back.gguf") == digest(src)
    # a split plain model: the undo of the shards above, one per shard
    quantkit.repack_model(shards[0], tmp_path / "x.gguf", undo=True, keep_split=True)
    x = sorted(tmp_path.glob("x-0000*.gguf"))
    assert len(x) == len(shards)
    quantkit.repack_model(x[0], tmp_path / "y.gguf", keep_split=True)
    quantkit.repack_model(tmp_path / f"y-00001-of-{len(x):05d}.gguf", tmp_path / "z.gguf", undo=True, keep_split=True)
    z = sorted(tmp_path.glob("z-0000*.gguf"))
    assert [digest(p) for p in z] == [digest(p) for p in x]


def test_split_keys_keep_their_places():
    """llama-quantize --keep-split sets split.* where the first shard has them; a model without them
    gets them after its metadata."""
    from quantkit.gguf_io.constants import MetaValue, ValueType
    from quantkit.gguf_io.writer import TensorSpec, plan_shards
    from quantkit.types import QuantType
    u32 = lambda v: MetaValue(ValueType.UINT32, v)      # noqa: E731
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"), "split.no": MetaValue(ValueType.UINT16, 0),
            "split.count": MetaValue(ValueType.UINT16, 5), "split.tensors.count": MetaValue(ValueType.INT32, 9),
            "general.file_type": u32(15)}
    specs = [TensorSpec(f"t{i}", (256,), QuantType.F32) for i in range(3)]
    shards = plan_shards(meta, specs, groups=[0, 1, 1])
    assert list(shards[0][0]) == list(meta)
    assert shards[0][0]["split.count"].value == 2 and shards[0][0]["split.tensors.count"].value == 3
    plain = {k: v for k, v in meta.items() if not k.startswith("split.")}
    assert list(plan_shards(plain, specs, groups=[0, 1, 1])[0][0]) == [*plain, "split.no", "split.count",
                                                                        "split.tensors.count"]
    assert list(plan_shards(meta, specs)[0][0]) == list(plain)      # one file: no split keys


def with_metadata(src, dst, **changes):
    """A copy of ``src`` with some metadata values changed in place (or added)."""
    from quantkit.gguf_io.reader import GGUFFile
    from quantkit.gguf_io.writer import GGUFWriter, TensorSpec
    with GGUFFile(src) as f:
        specs = [TensorSpec(t.name, t.shape, t.qtype) for t in f.tensors]
        with GGUFWriter([dst], [({**f.metadata, **changes}, specs)]) as w:
            for t in f.tensors:
                w.write_tensor(t.name, f.read(t.offset, t.nbytes))
    return dst


def test_file_type_record_and_refusals(presets, tmp_path):
    """A record that does not belong to the file is not trusted (and stays); a file type that is
    no number is refused in one line, the input unchanged."""
    from quantkit.gguf_io.constants import MetaValue, ValueType
    _, files = presets
    src = files["Q4_0"][0]
    # a plain Q4_0 file carrying a stray record: repack derives the plain type, undo ignores the stray
    stray = with_metadata(src, tmp_path / "stray.gguf", **{"quantkit.plain_file_type": MetaValue(ValueType.UINT32, 15)})
    quantkit.repack_model(stray, tmp_path / "s-r.gguf")
    assert metadata(tmp_path / "s-r.gguf")["general.file_type"] == 202
    quantkit.repack_model(tmp_path / "s-r.gguf", tmp_path / "s-back.gguf", undo=True)
    assert digest(tmp_path / "s-back.gguf") == digest(stray)
    bad = with_metadata(src, tmp_path / "bad.gguf", **{"general.file_type": MetaValue(ValueType.STRING, "15")})
    snap = Snapshot(tmp_path)
    rc, out, err = run_cli("repack", bad, tmp_path / "o.gguf")
    assert_refused(rc, out, err, "general.file_type", "not a file type")
    snap.assert_unchanged()


# ---- IQ2_XXS / IQ2_XS / IQ2_S: their C quantizers need an imatrix; the _r4 layouts recode signs ----
MIX_IQ2 = ("attn_q=iq2_xxs,attn_k=iq2_xs,attn_v=iq2_s,attn_output=iq2_xxs,ffn_gate=iq2_xs,ffn_up=iq2_s,"
           "ffn_down=iq2_xxs")


@pytest.fixture(scope="module")
def plain_iq2(tmp_path_factory, tiny_f32):
    from quantkit.imatrix import save_dat
    d = tmp_path_factory.mktemp("repack-iq2")
    rng = np.random.default_rng(3)
    with open_model(tiny_f32) as m:
        weights = {t.name: (rng.random(t.shape[0]) + 0.1).astype(np.float32)
                   for t in m.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"}
    imatrix = save_dat(d / "imatrix.dat", weights, ncall=1, chunk_count=1, dataset="synthetic")
    out = d / "iq2.gguf"
    quantkit.quantize_model(tiny_f32, out, "q8_0", pure=True, custom_q=MIX_IQ2, imatrix=imatrix)
    return d, tiny_f32, {"iq2": out}


@needs_wheel
def test_repack_iq2_equals_llama_quantize_and_undo_restores(plain_iq2):
    test_repack_equals_llama_quantize_and_undo_restores(plain_iq2, "iq2")


def test_undo_keeps_types_ik_quantizes_on_their_own():
    """iq1_s_r4 / iq1_m_r4 (blocks of 32, not iq1_s's 256) and q8_k_r8 (q8_K is no file type) are no
    repack of their base: --undo keeps them and says why; a regrouped type is undone."""
    from types import SimpleNamespace
    from quantkit.repack import RepackOptions, make_repack_plan
    from quantkit.types import QuantType as T
    tensors = [SimpleNamespace(name=f"blk.0.{q.name.lower()}.weight", shape=(256, 8), qtype=q)
               for q in (T.IQ1_S_R4, T.IQ1_M_R4, T.Q8_K_R8, T.IQ2_XXS_R4)]
    plan = make_repack_plan(tensors, {}, RepackOptions(undo=True), lambda q: True)
    got = {tp.name: (tp.dst_type, tp.rule) for tp in plan.tensors}
    for q in (T.IQ1_S_R4, T.IQ1_M_R4, T.Q8_K_R8):
        dst, rule = got[f"blk.0.{q.name.lower()}.weight"]
        assert dst == q and rule.startswith("kept: ik quantizes") and "no repack of" in rule, rule
    assert got["blk.0.iq2_xxs_r4.weight"] == (T.IQ2_XXS, "undo")
