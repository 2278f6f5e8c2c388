"""llama-quantize's options where a llama.cpp user's fingers go (issue 23, item 3): the trailing thread
count, mainline's --tensor-type / --tensor-type-file / --prune-layers, --override-kv, ik's
--ffn-gate-inp-type and --partial-requant.

The cases run through the library (quantkit.plan_quantize / quantize_model, in-process; a refusal is
a one-line QuantkitError); the CLI (``quantkit.cli.main`` in-process) only for its positionals (the
trailing NTHREADS, ``IN TYPE``).  The wheel's ik ``llama-quantize`` is the peer where it has the
option (--ffn-gate-inp-type, --override-kv).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

import peers
import quantkit
from hostile import Snapshot, assert_refused
from models import rewrite_gguf, write_deepseek2, write_llama
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.gguf_io.constants import MetaValue, ValueType
from quantkit.gguf_io.reader import open_model
from quantkit.kv_override import apply_overrides, overridden_getter, parse_kv_override, resolve
from quantkit.plan import PlanOptions, attach_imatrix, make_plan
from quantkit.presets import ModelInfo, find_preset
from quantkit.prune import parse_prune_layers
from quantkit.recipes import combined, load_recipe, load_tensor_types
from quantkit.runtime.hparams import ModelConfig
from quantkit.types import QuantType as T, type_name

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")


def quantize(capsys, *args):
    """``quantkit quantize ARGS`` in this process: (rc, stdout, stderr)."""
    rc = main(["quantize", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def refused(call, *needles) -> str:
    """The one-line QuantkitError ``call()`` raises, holding every needle (the CLI prints that line)."""
    with pytest.raises(QuantkitError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message
    return message


def targets(plan) -> dict[str, str]:
    return {t.name: type_name(t.dst_type) for t in plan.tensors}


def plan_of(path, preset: str, flavor: str = "ik", **kw):
    with open_model(path) as m:
        opts = PlanOptions(preset=find_preset(preset, flavor), flavor=flavor, model=ModelInfo.from_metadata(m.get),
                           metadata=m.metadata, **kw)
        return make_plan(m.tensors, opts)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("l") / "llama.gguf", n_layer=8, n_embd=256, n_ff=256, n_vocab=256)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_deepseek2(tmp_path_factory.mktemp("ds") / "ds.gguf", n_layer=4, n_dense=1)


# ------------------------------------------------------------------------- trailing thread count
def test_trailing_thread_count(llama, tmp_path, capsys, monkeypatch):
    import quantkit.quantize as qz
    seen = []
    monkeypatch.setattr(qz, "run_plan", lambda model, plan, out, opts, *a, **k: seen.append((out, opts.threads)) or
                        qz.Result([out], 0, 1.0, 0))
    assert quantize(capsys, llama, tmp_path / "a.gguf", "q8_0", "3")[0] == 0
    assert quantize(capsys, llama, "Q8_0", "2")[0] == 0                            # IN TYPE NTHREADS
    assert quantize(capsys, llama, tmp_path / "c.gguf", "q8_0", "4", "--threads", "4")[0] == 0
    assert quantize(capsys, llama, tmp_path / "d.gguf", "q8_0", "0")[0] == 0      # 0: every core
    assert seen == [(tmp_path / "a.gguf", 3), (llama.parent / "ggml-model-Q8_0.gguf", 2),
                    (tmp_path / "c.gguf", 4), (tmp_path / "d.gguf", None)]


@pytest.mark.parametrize("args, needle", [
    (("q8_0", "4", "--threads", "2"), "NTHREADS 4 and --threads 2 differ"),
    (("q8_0", "8x"), "'8x' is not a thread count"),
    (("q8_0", "5000"), "'5000' is not a thread count"),
])
def test_trailing_thread_count_refused(llama, tmp_path, capsys, args, needle):
    rc, out, err = quantize(capsys, llama, tmp_path / "o.gguf", *args)
    assert_refused(rc, out, err, needle)
    assert not (tmp_path / "o.gguf").exists()


# ------------------------------------------------------------------------- --tensor-type
def test_tensor_type_is_lower_cased_and_first_match_wins(llama):
    plan = quantkit.plan_quantize(llama, "q8_0", tensor_type=[r"BLK\.1\.ATTN_Q=q4_0", "attn_q=q5_0", "attn=q4_1"])
    t = targets(plan)
    assert t["blk.1.attn_q.weight"] == "q4_0"
    assert t["blk.2.attn_q.weight"] == "q5_0"
    assert t["blk.2.attn_k.weight"] == "q4_1" and t["blk.2.ffn_up.weight"] == "q8_0"


def test_tensor_type_skips_the_mix_counters_custom_q_does_not(llama):
    """Q4_K_M gives attn_v q6_K where use_more_bits(i_attention_wv, 8) (i = 0, 3, 6, 7).  A --tensor-type
    rule claiming blk.0's attn_v takes it out of the count (mainline), so the next ones move up by
    one; ik's --custom-q counts every tensor."""
    def attn_v(plan):
        return {int(t.name.split(".")[1]): t.dst_type for t in plan.tensors if "attn_v" in t.name}

    rule = r"blk\.0\.attn_v=q8_0"
    custom = attn_v(plan_of(llama, "Q4_K_M", recipe=load_recipe([rule])))
    manual = attn_v(plan_of(llama, "Q4_K_M", recipe=combined(None, load_tensor_types([rule]))))
    assert custom[0] == manual[0] == T.Q8_0
    assert [i for i in range(1, 8) if custom[i] == T.Q6_K] == [3, 6, 7]
    assert [i for i in range(1, 8) if manual[i] == T.Q6_K] == [1, 4, 7]


def test_tensor_type_precedence(llama):
    """--custom-q rules come first; --token-embedding-type wins over both; --pure keeps the rules."""
    plan = quantkit.plan_quantize(llama, "Q4_K_M", custom_q="attn_q=q4_1", tensor_type=["attn=q5_0", "token_embd=q4_0"],
                                  token_embedding_type="q8_0", pure=True)
    t = targets(plan)
    assert t["blk.0.attn_q.weight"] == "q4_1" and t["blk.0.attn_k.weight"] == "q5_0"
    assert t["token_embd.weight"] == "q8_0"
    assert t["blk.0.ffn_up.weight"] == "q4_K"        # --pure: the default type, no mix


def test_tensor_type_file(llama, tmp_path):
    f = tmp_path / "types.txt"
    f.write_text("attn_q=q4_0  attn_k=q5_0\n\nffn_down=Q8_0\n")
    t = targets(quantkit.plan_quantize(llama, "q4_1", tensor_type_file=f))
    assert (t["blk.3.attn_q.weight"], t["blk.3.attn_k.weight"], t["blk.3.ffn_down.weight"]) == ("q4_0", "q5_0", "q8_0")
    rules = load_tensor_types([], [str(f)])
    assert [r.source for r in rules] == [f"{f}:1", f"{f}:1", f"{f}:3"]


@pytest.mark.parametrize("qtype, rule, needle", [
    ("q8_0", "attn_q", "expected 'regex=type'"),
    ("q8_0", "=q8_0", "missing tensor name"),
    ("q8_0", "attn_q=", "missing quantization type"),
    ("q8_0", "attn_q=q9_9", "invalid ggml type 'q9_9'"),
    ("q8_0", "attn_q=Q4_K_M", "invalid ggml type 'Q4_K_M'"),    # a preset, not a type
    ("q8_0", "(a+)+=q4_0", "refused"),
    ("f16", "attn_q=q4_0", "only with a quantized TYPE"),
    ("COPY", "attn_q=q4_0", "TYPE COPY"),
])
def test_tensor_type_refused(llama, tmp_path, qtype, rule, needle):
    refused(lambda: quantkit.quantize_model(llama, tmp_path / "o.gguf", qtype, tensor_type=rule), needle)
    assert not (tmp_path / "o.gguf").exists()


def test_tensor_type_file_refused(llama, tmp_path):
    f = tmp_path / "types.txt"
    f.write_text("attn_q=q4_0\n# a comment\n")      # mainline's format has no comments
    refused(lambda: quantkit.plan_quantize(llama, "q8_0", tensor_type_file=f), f"{f}:2", "expected 'regex=type'")
    refused(lambda: quantkit.plan_quantize(llama, "q8_0", tensor_type_file=tmp_path), "--tensor-type-file", "directory")


def test_tensor_type_mainline_flavor(llama):
    """Mainline: a claimed output.weight takes the rule's type, not the mix's q6_K."""
    base = targets(quantkit.plan_quantize(llama, "Q4_K_M", flavor="mainline"))
    t = targets(quantkit.plan_quantize(llama, "Q4_K_M", flavor="mainline", tensor_type="^output=q8_0"))
    assert base["output.weight"] == "q6_K" and t["output.weight"] == "q8_0"
    assert {k: v for k, v in t.items() if k != "output.weight"} == {k: v for k, v in base.items() if k != "output.weight"}


# ------------------------------------------------------------------------- --override-kv
@pytest.mark.parametrize("text, needle", [
    ("general.name", "expected KEY=TYPE:VALUE"),
    ("=str:x", "the key is empty"),
    ("k" * 128 + "=int:1", "more than 127 bytes"),
    ("a key=int:1", "printable ASCII"),
    ("general.name=string:x", "TYPE must be int, float, bool or str"),
    ("general.name=x", "TYPE must be"),
    ("a.b=int:12abc", "'12abc' is not an integer"),
    ("a.b=int:", "'' is not an integer"),
    ("a.b=int:99999999999999999999", "64-bit"),
    ("a.b=float:abc", "not a number"),
    ("a.b=float:nan", "not a finite float32"),
    ("a.b=float:1e39", "not a finite float32"),
    ("a.b=bool:True", "true or false"),
    ("a.b=str:" + "x" * 128, "at most 127 bytes"),
    ("split.count=int:2", "written by quantkit itself"),
    ("quantkit.recipe=str:x", "written by quantkit itself"),
])
def test_override_kv_syntax_refused(text, needle):
    with pytest.raises(QuantkitError, match="--override-kv") as e:
        parse_kv_override(text)
    assert needle in str(e.value)


def test_override_kv_values_as_each_flavor_writes_them():
    meta = {"general.architecture": MetaValue(ValueType.STRING, "llama"),
            "llama.context_length": MetaValue(ValueType.UINT32, 2048),
            "general.name": MetaValue(ValueType.STRING, "x"),
            "llama.rope.freq_base": MetaValue(ValueType.FLOAT32, 1e4)}
    given = [parse_kv_override(t) for t in ("general.name=str:new", "new.int=int:7", "new.float=float:0.5",
                                            "new.flag=bool:false", "llama.context_length=int:4096")]
    for flavor, new_int in (("ik", ValueType.INT32), ("mainline", ValueType.UINT32)):
        out = apply_overrides(meta, resolve(given, meta, flavor), flavor)
        assert out["new.int"] == MetaValue(new_int, 7)
        assert out["new.float"] == MetaValue(ValueType.FLOAT32, 0.5)
        assert out["new.flag"] == MetaValue(ValueType.BOOL, False)
        assert out["general.name"] == MetaValue(ValueType.STRING, "new")
        assert out["llama.context_length"] == MetaValue(ValueType.UINT32, 4096)    # an existing key keeps its type
        order = list(out)
        if flavor == "ik":       # gguf_set_val in place
            assert order[:4] == list(meta)
        else:                    # gguf.cpp removes and appends
            assert order == ["general.architecture", "llama.rope.freq_base", "general.name", "new.int", "new.float",
                             "new.flag", "llama.context_length"]
    for text, flavor, needle in (("llama.context_length=float:1.0", "ik", "is an int (uint32), not float"),
                                 ("llama.rope.freq_base=int:1", "ik", "is a float"),
                                 ("llama.context_length=int:-1", "ik", "does not fit a uint32"),
                                 ("new.int=int:-1", "mainline", "llama.cpp writes a new int key as u32"),
                                 ("new.int=int:4294967296", "ik", "i32")):
        with pytest.raises(QuantkitError, match="--override-kv") as e:
            resolve([parse_kv_override(text)], meta, flavor)
        assert needle in str(e.value), str(e.value)


def test_override_kv_written_and_seen_by_the_mix(llama, tmp_path):
    out = tmp_path / "o.gguf"
    quantkit.quantize_model(llama, out, "q8_0", override_kv=["general.name=str:renamed", "my.flag=bool:true",
                                                               "llama.context_length=int:777"])
    with open_model(out) as m:
        assert m.metadata["general.name"] == MetaValue(ValueType.STRING, "renamed")
        assert m.metadata["my.flag"] == MetaValue(ValueType.BOOL, True)
        assert m.get("llama.context_length") == 777
        get = m.get
        # the mix sees the overridden hyper-parameters, as the C loader applies the overrides
        info = ModelInfo.from_metadata(overridden_getter(get, [parse_kv_override("llama.expert_count=int:8")]))
        assert info.n_expert == 8 and ModelInfo.from_metadata(get).n_expert == 0
    plan = quantkit.plan_quantize(llama, "q8_0", flavor="mainline", override_kv="my.n=int:5")
    assert plan.to_json()["kv_overrides"] == [{"key": "my.n", "type": "uint32", "value": 5}]
    refused(lambda: quantkit.quantize_model(llama, tmp_path / "x.gguf", "q8_0", override_kv="general.architecture=int:3"),
            "general.architecture", "is a str")
    assert not (tmp_path / "x.gguf").exists()


EXPERTS = ("llama.expert_count=int:4", "llama.expert_used_count=int:2")


def test_override_kv_moves_the_mix(llama):
    """ik's Q4_K_M gives attn_v q8_0 in a model of 4 experts or more: overriding the expert count
    of a dense model moves it there, as the C loader applies the overrides before the mix."""
    base = targets(quantkit.plan_quantize(llama, "Q4_K_M"))
    moved = targets(quantkit.plan_quantize(llama, "Q4_K_M", override_kv=EXPERTS))
    assert base["blk.1.attn_v.weight"] != "q8_0"
    assert all(v == "q8_0" for n, v in moved.items() if "attn_v" in n)


@needs_wheel
def test_override_kv_matches_llama_quantize(llama, tmp_path):
    """Keys, value types, values and places as ik's llama-quantize writes them, and the tensor types
    of the mix it chose with the overridden expert count."""
    kv = ["general.name=str:peer", "my.int=int:-3", "my.float=float:1.5", "my.bool=bool:true", *EXPERTS]
    args = [a for x in kv for a in ("--override-kv", x)]
    theirs = tmp_path / "theirs.gguf"
    p = subprocess.run([str(peers.llama_quantize_bin()), *args, str(llama), str(theirs), "Q4_K_M", "2"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ours = tmp_path / "ours.gguf"
    quantkit.quantize_model(llama, ours, "Q4_K_M", override_kv=kv)
    with open_model(theirs) as a, open_model(ours) as b:
        for key in ("general.name", "my.int", "my.float", "my.bool", "llama.expert_count"):
            assert a.metadata[key] == b.metadata[key], key
        assert list(a.metadata).index("general.name") == list(b.metadata).index("general.name")
        # every key where llama-quantize puts it (general.file_type and quantization_version set in place)
        assert list(a.metadata) == [k for k in b.metadata if not k.startswith("quantkit.")]
        assert {t.name: t.qtype for t in a.tensors} == {t.name: t.qtype for t in b.tensors}


# ------------------------------------------------------------------------- --prune-layers
def test_prune_layers_renumbers_and_sets_block_count(llama, tmp_path):
    full, pruned = tmp_path / "full.gguf", tmp_path / "pruned.gguf"
    quantkit.quantize_model(llama, full, "q8_0")
    quantkit.quantize_model(llama, pruned, "q8_0", prune_layers="5,2,2")
    with open_model(full) as a, open_model(pruned) as b:
        assert ModelConfig.from_gguf(b).n_layer == 6       # the runtime's checks of keys against tensors
        assert b.get("llama.block_count") == 6
        assert b.metadata["llama.block_count"].vtype == ValueType.UINT32
        blocks = sorted({int(t.name.split(".")[1]) for t in b.tensors if t.name.startswith("blk.")})
        assert blocks == list(range(6))
        old_of = {0: 0, 1: 1, 2: 3, 3: 4, 4: 6, 5: 7}
        for t in b.tensors:
            src = t.name
            if t.name.startswith("blk."):
                n = int(t.name.split(".")[1])
                src = f"blk.{old_of[n]}." + t.name.split(".", 2)[2]
            ta = a.by_name[src]
            assert t.qtype == ta.qtype and t.shape == ta.shape
            assert bytes(t.source.read(t.offset, t.nbytes)) == bytes(ta.source.read(ta.offset, ta.nbytes)), t.name


def test_prune_layers_looks_up_the_imatrix_under_the_old_names(llama):
    class Imat:
        asked = []

        def weights_for(self, name, n_per_row, n_matrices):
            self.asked.append(name)
            return np.ones((n_matrices, n_per_row), np.float32)

    plan = plan_of(llama, "Q8_0", prune_layers=(0,))
    attach_imatrix(plan, Imat())
    by_new = {t.name: t.input_name for t in plan.tensors}
    assert by_new["blk.0.attn_q.weight"] == "blk.1.attn_q.weight"
    assert "blk.7.attn_q.weight" in Imat.asked and "blk.0.attn_q.weight" not in Imat.asked


def test_prune_layers_refused(llama, deepseek, tmp_path):
    def pruned(model, value):
        return lambda: quantkit.quantize_model(model, tmp_path / "o.gguf", "q8_0", prune_layers=value)
    for model, value, needles in ((llama, "8", ("blocks 0..7", "no block 8")),
                                  (llama, "0,1,2,3,4,5,6,7", ("all 8 blocks",)),
                                  (llama, "1,x", ("'x' is not a layer number",)),
                                  (llama, "-1", ("'-1' is not a layer number",)),
                                  (deepseek, "0", ("leading_dense_block_count",))):
        refused(pruned(model, value), "--prune-layers", *needles)
    per_layer = rewrite_gguf(llama, tmp_path / "arr.gguf", keys={"llama.feed_forward_length": [256] * 8})
    refused(pruned(per_layer, "3"), "llama.feed_forward_length has one value per block")
    for keys, needle in (({"llama.nextn_predict_layers": 2}, "NextN/MTP"),
                         ({"llama.attention.sliding_window_pattern": 4}, "sliding_window_pattern")):
        refused(pruned(rewrite_gguf(llama, tmp_path / "odd.gguf", keys=keys), "6"), needle)
    gap = rewrite_gguf(llama, tmp_path / "gap.gguf", keys={"llama.block_count": 9})
    refused(pruned(gap, "3"), "block 8 has no tensors")
    assert not (tmp_path / "o.gguf").exists()
    assert parse_prune_layers("3, 1,3") == (1, 3)


# ------------------------------------------------------------------------- --ffn-gate-inp-type
def test_ffn_gate_inp_type(deepseek):
    base = targets(quantkit.plan_quantize(deepseek, "Q4_K_M"))
    plan = quantkit.plan_quantize(deepseek, "Q4_K_M", ffn_gate_inp_type="q8_0", custom_q="gate_inp=q4_0")
    t = targets(plan)
    routers = [n for n in t if "ffn_gate_inp.weight" in n]
    assert routers and all(base[n] == "f32" and t[n] == "q8_0" for n in routers)   # wins over --custom-q
    assert {n: v for n, v in t.items() if n not in routers} == {n: v for n, v in base.items() if n not in routers}
    same = targets(quantkit.plan_quantize(deepseek, "Q4_K_M", ffn_gate_inp_type="f32"))
    assert same == base         # already that type: kept, as ik does


@needs_wheel
@pytest.mark.parametrize("preset", ["Q4_K_M", "IQ4_K"])
def test_ffn_gate_inp_type_matches_llama_quantize(deepseek, preset, tmp_path):
    theirs = tmp_path / "theirs.gguf"
    p = subprocess.run([str(peers.llama_quantize_bin()), "--ffn-gate-inp-type", "q8_0", str(deepseek), str(theirs),
                        preset, "2"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open_model(theirs) as m:
        want = {t.name: T(t.qtype).name.lower() for t in m.tensors}
    got = {n: v.lower() for n, v in targets(quantkit.plan_quantize(deepseek, preset, ffn_gate_inp_type="q8_0")).items()}
    assert got == want
    assert any("ffn_gate_inp" in n and v == "q8_0" for n, v in want.items())


# ------------------------------------------------------------------------- --partial-requant
def _bytes(paths):
    return {p.name: p.read_bytes() for p in paths}


def test_partial_requant_writes_only_what_is_missing(llama, tmp_path, capsys):
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir(), part_dir.mkdir()
    args = ("Q4_K_M", "--split-max-size", "150K")
    quantkit.quantize_model(llama, full_dir / "m.gguf", "Q4_K_M", split_max_size="150K")
    full = sorted(full_dir.iterdir())
    assert len(full) >= 3
    for p in full:
        shutil.copy(p, part_dir / p.name)
    missing = part_dir / full[1].name
    missing.unlink()
    kept = {p.name: os.stat(part_dir / p.name).st_ino for p in full if p != full[1]}
    result = quantkit.quantize_model(llama, part_dir / "m.gguf", "Q4_K_M", split_max_size="150K",
                                     partial_requant=True)
    assert sorted(p.name for p in result.kept) == sorted(kept)
    assert _bytes(sorted(part_dir.iterdir())) == _bytes(full)           # as a full run, byte for byte
    assert {n: os.stat(part_dir / n).st_ino for n in kept} == kept       # kept, not written again
    # everything there: nothing is written; the CLI says the kept files are complete
    rc, out, err = quantize(capsys, llama, part_dir / "m.gguf", *args, "--partial-requant")
    assert rc == 0, err
    assert "already complete (--partial-requant)" in out and "wrote" not in out
    assert quantkit.quantize_model(llama, part_dir / "m.gguf", "Q4_K_M", split_max_size="150K",
                                   partial_requant=True).bytes_written == 0


def test_partial_requant_resumes_an_interrupted_run(llama, tmp_path, monkeypatch):
    import quantkit.formats as formats
    options = dict(split_max_size="150K", partial_requant=True)
    (tmp_path / "ref").mkdir()
    quantkit.quantize_model(llama, tmp_path / "ref" / "m.gguf", "q8_0", **options)
    ref = sorted((tmp_path / "ref").iterdir())
    real, calls = formats.quantize, {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(formats, "quantize", interrupted)
    out = tmp_path / "run" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize_model(llama, out, "q8_0", **options)
    left = sorted(out.parent.iterdir())
    assert left and len(left) < len(ref)                     # whole shards only, no partial file
    assert _bytes(left) == {p.name: p.read_bytes() for p in ref if p.name in {q.name for q in left}}
    monkeypatch.setattr(formats, "quantize", real)
    quantkit.quantize_model(llama, out, "q8_0", **options)
    assert _bytes(sorted(out.parent.iterdir())) == _bytes(ref)


def test_partial_requant_single_file_and_a_different_file(llama, tmp_path):
    out = tmp_path / "m.gguf"
    quantkit.quantize_model(llama, out, "q8_0")
    ino = os.stat(out).st_ino
    assert quantkit.quantize_model(llama, out, "q8_0", partial_requant=True).kept == [out]
    assert os.stat(out).st_ino == ino
    snap = Snapshot(out)
    refused(lambda: quantkit.quantize_model(llama, out, "q4_0", partial_requant=True),   # another TYPE: not that file
            "--partial-requant", "header differs", "remove it")
    snap.assert_unchanged()
    with open(out, "r+b") as f:
        f.truncate(os.path.getsize(out) - 32)
    refused(lambda: quantkit.quantize_model(llama, out, "q8_0", partial_requant=True), "--partial-requant", "bytes, not")
