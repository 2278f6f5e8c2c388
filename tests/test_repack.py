"""`quantkit repack`: plain <-> row-interleaved layouts, against the wheel's `llama-quantize --repack`.

A llama model with a mix of plain types (written by quantkit) is repacked by both tools: same types,
same tensor bytes (a byte shuffle does not depend on FMA) and the same file type; `--undo` gives the
plain bytes back; the repacked file loads in ik_llama.cpp and computes the same logits.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import peers
from models import write_deepseek2, write_llama
from quantkit.formats import interleave
from quantkit.gguf_io.reader import open_model

needs_wheel = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

# plain types with an interleaved variant, one per tensor kind; token_embd is never interleaved
MIX = ("attn_q=q4_0,attn_k=q8_0,attn_v=q5_0,attn_output=iq4_nl,ffn_gate=q4_K,ffn_up=q6_K,ffn_down=iq4_xs,"
       "output=q3_K,token_embd=q2_K")
MIX_IQK = "attn_q=iq2_k,attn_k=iq3_k,attn_v=iq4_k,attn_output=iq5_k,ffn_gate=iq4_ks,ffn_up=iq5_ks,ffn_down=q6_0"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True)


def tensors(path) -> dict[str, tuple[int, tuple, np.ndarray]]:
    """name -> (type id, shape, raw bytes), in file order (gguf-py does not know ik's types)."""
    with open_model(path) as m:
        return {t.name: (int(t.qtype), tuple(t.shape), t.source.read(t.offset, t.nbytes)) for t in m.tensors}


def file_type(path):
    with open_model(path) as m:
        return m.get("general.file_type")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("repack")
    f32 = write_llama(d / "f32.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=512,
                      vocab=True)
    out = {}
    for tag, mix in (("k", MIX), ("iqk", MIX_IQK)):
        p = cli("quantize", f32, d / f"{tag}.gguf", "q8_0", "--pure", "--custom-q", mix)
        assert p.returncode == 0, p.stderr
        out[tag] = d / f"{tag}.gguf"
    return d, f32, out


@needs_wheel
@pytest.mark.parametrize("tag", ["k", "iqk"])
def test_repack_equals_llama_quantize_and_undo_restores(plain, tag):
    d, _, files = plain
    src = files[tag]
    ours, theirs, back = d / f"{tag}-r.gguf", d / f"{tag}-lq.gguf", d / f"{tag}-back.gguf"
    p = cli("repack", src, ours)
    assert p.returncode == 0, p.stderr
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
    p = cli("repack", ours, back, "--undo")
    assert p.returncode == 0, p.stderr
    for name, (qtype, _, raw) in tensors(back).items():
        assert qtype == s[name][0], name
        np.testing.assert_array_equal(raw, s[name][2], err_msg=name)
    assert file_type(back) == file_type(src)


@needs_wheel
def test_repacked_file_computes_the_same_logits(plain):
    """The interleaved kernels of ik_llama.cpp accumulate in another order (and quantize activations
    per row group), so logits agree to a small relative error, not bit for bit."""
    d, _, files = plain
    src = files["k"]
    out = d / "k-logits.gguf"
    assert cli("repack", src, out).returncode == 0
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
    p = cli("repack", src, tmp_path / "o.gguf", "--pattern", r"ffn_(gate|up)", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)["plan"]["tensors"]
    moved = {t["name"] for t in plan if t["action"] == "repack"}
    assert moved == {f"blk.{i}.ffn_{k}.weight" for i in range(2) for k in ("gate", "up")}
    assert not (tmp_path / "o.gguf").exists()
    # nothing to do: one clean line, no output file
    for args in ((f32, tmp_path / "f.gguf"), (src, tmp_path / "u.gguf", "--undo"),
                 (src, tmp_path / "x.gguf", "--pattern", "nothing_matches")):
        p = cli("repack", *args)
        assert p.returncode == 1 and "nothing to" in p.stderr and "Traceback" not in p.stderr
        assert not args[1].exists()
    p = cli("repack", src, tmp_path / "y.gguf", "--pattern", "(")
    assert p.returncode == 1 and "invalid regex" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_expert_tensors_repack_per_expert(tmp_path):
    """3-D expert tensors: row groups never cross an expert; undo restores the bytes."""
    f32 = write_deepseek2(tmp_path / "ds.gguf", n_layer=2, n_dense=1, n_expert=4)
    q = tmp_path / "q.gguf"
    assert cli("quantize", f32, q, "q8_0", "--pure", "--custom-q", "exps=q4_0").returncode == 0
    r, back = tmp_path / "r.gguf", tmp_path / "back.gguf"
    assert cli("repack", q, r).returncode == 0
    assert cli("repack", r, back, "--undo").returncode == 0
    a, b, c = tensors(q), tensors(r), tensors(back)
    qtype, shape, raw = a["blk.1.ffn_gate_exps.weight"]
    assert b["blk.1.ffn_gate_exps.weight"][0] == 202                    # q4_0_r8
    n, rows, n_exp = shape
    raw = raw.reshape(n_exp * rows, -1)
    per_expert = np.concatenate([interleave.interleave(raw[e * rows:(e + 1) * rows], 202, n) for e in range(n_exp)])
    np.testing.assert_array_equal(b["blk.1.ffn_gate_exps.weight"][2].reshape(per_expert.shape), per_expert)
    for name in a:
        np.testing.assert_array_equal(c[name][2], a[name][2])
