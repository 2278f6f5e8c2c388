"""The real model end to end: SmolLM2 through quantkit and through the wheel's llama-quantize.

From one F32 SmolLM2 file, the mixed recipe in recipes/smollm2-mix.txt applied by both tools:
* every tensor gets the same type in both files;
* q8_0, f16 and f32 tensors are byte-identical to llama-quantize's;
* q4_0/q5_0 tensors equal gguf-py's quantizer (the portable no-FMA reference) exactly.  The wheel
  is an FMA build (``x*id + 8.5`` is fused) and rounds a few rows differently: those are counted
  and reported, and must stay a small minority;
* the file loads in ik_llama.cpp (the wheel) and its logits match llama-quantize's file closely.
"""
from __future__ import annotations

import subprocess

import gguf
import numpy as np
import pytest

import peers
import quantkit
from quantkit.gguf_io.reader import open_model
from quantkit.recipes import load_recipe

pytestmark = pytest.mark.skipif(peers.llama_quantize_bin() is None, reason="ik-llama-cpp-python not installed")

PROMPT = "The capital of France is Paris. The capital of Germany is"


def tensor_types(path) -> dict[str, int]:
    with open_model(path) as m:
        return {t.name: int(t.qtype) for t in m.tensors}


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path, repo_root):
    d = tmp_path_factory.mktemp("smollm2")
    f32 = d / "smollm2-f32.gguf"
    quantkit.quantize_model(smollm2_path, f32, "f32", allow_requantize=True)
    recipe_file = repo_root / "recipes" / "smollm2-mix.txt"
    ours, theirs = d / "ours.gguf", d / "theirs.gguf"
    quantkit.quantize_model(f32, ours, "q4_0", custom_q=recipe_file, threads=2)
    inline = ",".join(load_recipe([str(recipe_file)]).text.splitlines())
    p = subprocess.run([str(peers.llama_quantize_bin()), "--custom-q", inline, str(f32), str(theirs), "Q4_0", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return {"src": smollm2_path, "f32": f32, "ours": ours, "theirs": theirs}


def test_f32_conversion_decodes_like_gguf_py(files):
    src, f32 = gguf.GGUFReader(str(files["src"])), gguf.GGUFReader(str(files["f32"]))
    by = {t.name: t for t in f32.tensors}
    for t in src.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        np.testing.assert_array_equal(np.asarray(by[t.name].data).reshape(-1), ref, err_msg=t.name)


def test_same_types_and_bytes_as_llama_quantize(files, capsys):
    ours, theirs, f32 = (gguf.GGUFReader(str(files[k])) for k in ("ours", "theirs", "f32"))
    theirs_by = {t.name: t for t in theirs.tensors}
    src_by = {t.name: t for t in f32.tensors}
    assert sorted(theirs_by) == sorted(t.name for t in ours.tensors)
    seen_types, fma_rows, total_rows = set(), 0, 0
    for t in ours.tensors:
        th = theirs_by[t.name]
        assert t.tensor_type == th.tensor_type, t.name
        a = np.asarray(t.data).view(np.uint8).reshape(int(np.prod(t.shape[1:])), -1)
        b = np.asarray(th.data).view(np.uint8).reshape(a.shape)
        kind = t.tensor_type.name
        seen_types.add(kind)
        if kind in ("Q8_0", "F16", "F32"):
            np.testing.assert_array_equal(a, b, err_msg=t.name)
        else:
            x = np.asarray(src_by[t.name].data, dtype=np.float32).reshape(a.shape[0], -1)
            ref = gguf.quants.quantize(x, t.tensor_type).view(np.uint8).reshape(a.shape)
            np.testing.assert_array_equal(a, ref, err_msg=t.name)
            diff = int((a != b).any(axis=1).sum())
            fma_rows += diff
            total_rows += a.shape[0]
    assert {"Q8_0", "F16", "F32", "Q5_0", "Q4_0"} <= seen_types
    with capsys.disabled():
        print(f"\n[smollm2] q4_0/q5_0 rows that differ from the FMA-built wheel: {fma_rows} of {total_rows}")
    assert fma_rows < total_rows * 0.05


def test_loads_in_ik_llama_cpp_and_computes_like_llama_quantize(files):
    tokens = peers.ik_tokenize(files["src"], PROMPT)
    ours = peers.ik_logits(files["ours"], tokens)
    theirs = peers.ik_logits(files["theirs"], tokens)
    ref = peers.ik_logits(files["f32"], tokens)
    assert np.isfinite(ours).all() and ours.shape == ref.shape
    # the two files differ in a handful of FMA-rounded rows only
    assert np.corrcoef(ours, theirs)[0, 1] > 0.999
    assert np.corrcoef(ours, ref)[0, 1] > 0.95
    assert int(np.argmax(ours)) == int(np.argmax(theirs))


def test_split_output_loads_in_ik_llama_cpp(files, tmp_path):
    """--split-max-size shards are what the C split loader expects (it opens them from the first)."""
    out = tmp_path / "split.gguf"
    quantkit.quantize_model(files["ours"], out, split_max_size="40M")
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) == 3 and shards[0].name == "split-00001-of-00003.gguf"
    tokens = peers.ik_tokenize(files["src"], PROMPT)
    np.testing.assert_array_equal(peers.ik_logits(shards[0], tokens), peers.ik_logits(files["ours"], tokens))


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q6_K", "Q3_K_M", "Q5_K_S", "IQ4_XS", "IQ4_K"])
def test_preset_loads_in_ik_and_matches_llama_quantize(files, tmp_path, preset):
    """A preset written by quantkit: same tensor types as the wheel's file (the 576-wide rows take the
    fallbacks, q6_0 among them), finite logits close to both the wheel's file and the F32 model."""
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantkit.quantize_model(files["f32"], ours, preset, threads=2)
    p = subprocess.run([str(peers.llama_quantize_bin()), str(files["f32"]), str(theirs), preset, "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    a, b = tensor_types(ours), tensor_types(theirs)       # gguf-py does not know ik's types (q6_0)
    assert a == b
    assert len(set(a.values())) >= 3          # a mix, not one type
    tokens = peers.ik_tokenize(files["src"], PROMPT)
    lo, lt, ref = (peers.ik_logits(f, tokens) for f in (ours, theirs, files["f32"]))
    assert np.isfinite(lo).all()
    assert np.corrcoef(lo, lt)[0, 1] > 0.995
    assert np.corrcoef(lo, ref)[0, 1] > 0.95
