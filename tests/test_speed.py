"""Predicted generation speed (issue 27, part speed): placement.py, speed.py and ``quantize --dry-run``.

The roofline: seconds per token = sum over devices of (weight bytes the device reads per token) /
(its bandwidth); routed experts count n_expert_used of n_expert, token embeddings one row, a tied
output the whole embedding table on the output's device, MTP blocks nothing.  Expected values here
are computed from the plan's tensors with the arithmetic written out, not with speed.py's helpers.
"""
from __future__ import annotations

import json
import math

import pytest

from hostile import Snapshot, assert_refused, run_cli
from models import deepseek_v3_tensors, write_deepseek2, write_glm4moe, write_llama, write_sparse
from quantkit import api
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.placement import Placement, parse_placement
from quantkit.speed import (bytes_per_token, expert_counts, measure_cpu_bandwidth, parse_bandwidth, plan_speed,
                            predict_speed)
from quantkit.types import QuantType, tensor_nbytes

T = QuantType


def run_main(capsys, *args):
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed")
    return {"dir": d,
            "llama": write_llama(d / "llama.gguf", n_layer=2, n_embd=64, n_ff=128, n_vocab=96),
            "tied": write_llama(d / "tied.gguf", n_layer=2, n_embd=64, n_ff=128, n_vocab=96, tied=True),
            "ds": write_deepseek2(d / "ds.gguf", n_layer=3, n_dense=1, n_expert=4, n_expert_used=2, n_vocab=64)}


# --------------------------------------------------------------------------- bytes_per_token
def test_bytes_per_token_dense_experts_and_embeddings():
    # a dense matrix: the whole of it
    assert bytes_per_token("blk.0.attn_q.weight", (256, 128), T.Q4_K, 8, 2) == 128 * 144
    # routed experts (ggml order: row, rows, experts): 2 of the 8 expert matrices
    assert bytes_per_token("blk.3.ffn_down_exps.weight", (256, 64, 8), T.Q4_K, 8, 2) == 2 * 64 * 144
    assert bytes_per_token("blk.3.ffn_gate_up_exps.weight", (256, 64, 8), T.Q8_0, 8, 3) == 3 * 64 * 8 * 34
    # a per-expert bias (gpt-oss): the used experts' rows
    assert bytes_per_token("blk.0.ffn_up_exps.bias", (64, 8), T.F32, 8, 2) == 2 * 64 * 4
    # shared experts and the router are dense
    assert bytes_per_token("blk.3.ffn_down_shexp.weight", (256, 64), T.Q4_K, 8, 2) == 64 * 144
    assert bytes_per_token("blk.3.ffn_gate_inp.weight", (256, 8), T.F32, 8, 2) == 256 * 8 * 4
    # token embeddings: one row a token
    assert bytes_per_token("token_embd.weight", (256, 1000), T.Q6_K, 0, 0) == 210
    assert bytes_per_token("per_layer_token_embd.weight", (512, 1000), T.Q8_0, 0, 0) == 16 * 34
    # no expert counts in the metadata: the whole tensor
    assert bytes_per_token("blk.3.ffn_down_exps.weight", (256, 64, 8), T.Q4_K, 0, 0) == 8 * 64 * 144


def test_bytes_per_token_refuses_expert_count_mismatch():
    with pytest.raises(QuantkitError, match="holds 8 experts.*says 16"):
        bytes_per_token("blk.3.ffn_down_exps.weight", (256, 64, 8), T.Q4_K, 16, 2)


# --------------------------------------------------------------------------- placement
def test_placement_rules_first_match_and_defaults():
    p = parse_placement([r"blk\.[0-1]\.ffn=cpu", "ffn_.*_exps=CPU", "attn=CUDA0", "output=gpu"], gpu=True)
    assert p.device("blk.0.ffn_down.weight") == "cpu"
    assert p.device("blk.7.ffn_up_exps.weight") == "cpu"
    assert p.device("blk.7.attn_q.weight") == "gpu"
    assert p.device("blk.7.ffn_down_shexp.weight") == "gpu"     # no rule: where the layers go
    assert p.device("output.weight") == "gpu"
    # the input layer stays in host memory, whatever the rules
    assert parse_placement([".=gpu"], gpu=True).device("token_embd.weight") == "cpu"
    assert parse_placement([], gpu=True).device("per_layer_token_embd.weight") == "cpu"
    # no GPU: everything on the CPU
    assert Placement().device("blk.0.attn_q.weight") == "cpu"


def test_placement_comma_lists_and_patterns_with_commas():
    p = parse_placement(["exps=cpu,attn=cuda:1"], gpu=True)
    assert p.rules == (("exps", "cpu"), ("attn", "gpu"))
    # a pattern holding a comma (a {m,n} count) is one rule
    p = parse_placement([r"blk\.[0-9]{1,2}\.ffn=cpu"], gpu=True)
    assert p.rules == ((r"blk\.[0-9]{1,2}\.ffn", "cpu"),)
    assert p.device("blk.12.ffn_up.weight") == "cpu" and p.device("blk.123.ffn_up.weight") == "gpu"


@pytest.mark.parametrize("spec,gpu,needle", [
    ("exps", True, "expected REGEX=cpu or REGEX=gpu"),
    ("=cpu", True, "expected REGEX=cpu"),
    ("exps=disk", True, "expected REGEX=cpu"),
    ("exps=gpu", False, "none was given"),
    ("(a+)+=cpu", True, "refused"),
    ("[a=cpu", True, "invalid regex"),
])
def test_placement_refuses_bad_specs(spec, gpu, needle):
    with pytest.raises(QuantkitError, match=needle.replace("(", r"\(")) as e:
        parse_placement([spec], gpu=gpu)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- bandwidth
def test_parse_bandwidth():
    assert parse_bandwidth("cpu=60G,gpu=900G") == {"cpu": 60e9, "gpu": 900e9}
    assert parse_bandwidth("gpu=1TiB/s, cpu=50GB/s") == {"gpu": float(1024 ** 4), "cpu": 50e9}
    assert parse_bandwidth("80G") == {"cpu": 80e9}


@pytest.mark.parametrize("text,needle", [("", "empty"), ("fpga=1G", "cpu or gpu"), ("cpu=1G,cpu=2G", "twice"),
                                         ("cpu=fast", "cannot read size"), ("cpu=0", "must be positive")])
def test_parse_bandwidth_refuses(text, needle):
    with pytest.raises(QuantkitError, match=needle):
        parse_bandwidth(text)


def test_measure_cpu_bandwidth_is_plausible():
    bw = measure_cpu_bandwidth(1, 1 << 24)
    assert 1e8 < bw < 1e13, bw


# --------------------------------------------------------------------------- predict_speed
def test_predict_speed_two_devices_by_hand():
    tensors = [("token_embd.weight", (256, 100), T.Q8_0), ("output.weight", (256, 100), T.Q6_K),
               ("blk.0.attn_q.weight", (256, 256), T.Q8_0), ("blk.0.attn_norm.weight", (256,), T.F32),
               ("blk.0.ffn_down_exps.weight", (256, 64, 8), T.Q4_K)]
    p = parse_placement(["exps=cpu"], gpu=True)
    s = predict_speed(tensors, p, {"cpu": 10e9, "gpu": 100e9}, 8, 2)
    cpu = 8 * 34 + 2 * 64 * 144                         # one embedding row, 2 of 8 experts
    gpu = 100 * 210 + 256 * 8 * 34 + 256 * 4            # output, attn_q, the norm
    assert s.bytes_per_token == {"cpu": cpu, "gpu": gpu}
    assert s.stored == {"cpu": 100 * 8 * 34 + 8 * 64 * 144, "gpu": gpu}
    assert s.seconds_per_token == pytest.approx(cpu / 10e9 + gpu / 100e9)
    assert s.tokens_per_s == pytest.approx(1 / s.seconds_per_token)
    doc = json.loads(json.dumps(s.to_json()))
    assert doc["bytes_per_token"] == {"cpu": cpu, "gpu": gpu} and doc["tokens_per_s"] == pytest.approx(s.tokens_per_s)
    with pytest.raises(QuantkitError, match="no bandwidth for the gpu"):
        predict_speed(tensors, p, {"cpu": 10e9}, 8, 2)


def test_tied_output_reads_the_embeddings_whole_on_the_output_device():
    tensors = [("token_embd.weight", (64, 100), T.Q8_0), ("blk.0.attn_q.weight", (64, 64), T.Q8_0)]
    emb = 100 * 2 * 34
    s = predict_speed(tensors, Placement(), {"cpu": 1e9}, 0, 0)
    assert s.tied_output and s.bytes_per_token == {"cpu": 2 * 34 + emb + 64 * 2 * 34}
    assert s.stored == {"cpu": emb + 64 * 2 * 34}                 # one copy in host memory
    s = predict_speed(tensors, Placement(gpu=True), {"cpu": 1e9, "gpu": 1e10}, 0, 0)
    assert s.bytes_per_token == {"cpu": 2 * 34, "gpu": emb + 64 * 2 * 34}
    assert s.stored == {"cpu": emb, "gpu": emb + 64 * 2 * 34}     # the output's copy on the GPU


def _by_hand(plan, n_expert, n_used, device=lambda name: "cpu"):
    per = {}
    for t in plan.tensors:
        n = tensor_nbytes(t.dst_type, t.shape)
        if t.name == "token_embd.weight":
            n //= t.shape[1]
        elif "_exps." in t.name:
            n = n * n_used // n_expert
        per[device(t.name)] = per.get(device(t.name), 0) + n
    return per


def test_plan_speed_deepseek2_experts_and_placement(models):
    with api.open_quantization(models["ds"], None, "q8_0", bandwidth="cpu=20G") as q:
        s = q.speed()
        plan, get = q.plan, q.model.get
    assert (s.n_expert, s.n_expert_used) == (4, 2) and not s.tied_output and s.measured == ()
    assert s.bytes_per_token == _by_hand(plan, 4, 2)
    assert s.tokens_per_s == pytest.approx(20e9 / s.bytes_per_token["cpu"])
    # experts on the CPU, the rest on the GPU
    p = parse_placement(["_exps=cpu"], gpu=True)
    s2 = plan_speed(plan, get, p, {"cpu": 20e9, "gpu": 200e9})
    dev = p.device
    assert s2.bytes_per_token == _by_hand(plan, 4, 2, dev)
    assert s2.bytes_per_token["gpu"] > 0 and sum(s2.stored.values()) == plan.bytes_out
    assert s2.seconds_per_token == pytest.approx(s2.bytes_per_token["cpu"] / 20e9 + s2.bytes_per_token["gpu"] / 200e9)


def test_plan_speed_follows_override_kv(models):
    # --override-kv deepseek2.expert_used_count=int:1 is what the written file says: one expert a token
    with api.open_quantization(models["ds"], None, "q8_0", bandwidth="cpu=20G",
                               override_kv="deepseek2.expert_used_count=int:1") as q:
        s = q.speed()
        assert s.n_expert_used == 1 and s.bytes_per_token == _by_hand(q.plan, 4, 1)


def test_mtp_blocks_are_not_read(tmp_path):
    src = write_glm4moe(tmp_path / "glm.gguf", n_layer=3, n_dense=1, nextn=1, n_expert=4, n_expert_used=2)
    with api.open_quantization(src, None, "q8_0", bandwidth="cpu=20G") as q:
        s = q.speed()
        plan = q.plan
    assert s.skipped_layers == (3,)
    expected = _by_hand(plan, 4, 2)["cpu"] - sum(
        tensor_nbytes(t.dst_type, t.shape) * (2 if "_exps." in t.name else 4) // 4
        for t in plan.tensors if t.name.startswith("blk.3."))
    assert s.bytes_per_token["cpu"] == expected and s.stored["cpu"] == plan.bytes_out


def test_bad_expert_metadata_refused(tmp_path):
    meta = {"llama.expert_count": 4, "llama.expert_used_count": 8}
    src = write_sparse(tmp_path / "bad.gguf", "llama", meta, [("blk.0.attn_q.weight", (64, 64), 0)])
    with api.open_quantization(src, None, "q8_0", bandwidth="cpu=20G") as q, \
            pytest.raises(QuantkitError, match="expert_used_count = 8 is more than llama.expert_count = 4"):
        q.speed()


@pytest.mark.parametrize("value", ["four", -1, [4, 4], True, 2.5])
def test_expert_count_not_a_count_refused(value):
    meta = {"general.architecture": "llama", "llama.expert_count": value}
    with pytest.raises(QuantkitError, match="llama.expert_count: .* is not a count"):
        expert_counts(lambda k, d=None: meta.get(k, d))


def test_expert_counts_absent_is_dense():
    assert expert_counts(lambda k, d=None: {"general.architecture": "llama"}.get(k, d)) == (0, 0)


# --------------------------------------------------------------------------- quantize --dry-run
def test_dry_run_shows_predicted_speed(models, tmp_path, capsys):
    src = models["llama"]
    rc, out, err = run_main(capsys, "quantize", src, tmp_path / "o.gguf", "q8_0", "--dry-run", "--bandwidth", "cpu=10G")
    assert rc == 0, err
    with api.open_quantization(src, None, "q8_0") as q:
        per = _by_hand(q.plan, 0, 0)["cpu"]
    line = next(x for x in out.splitlines() if x.startswith("predicted generation"))
    assert f"{10e9 / per:.1f} tokens/s" in line and "10.0 GB/s" in line and "(measured)" not in line
    assert not (tmp_path / "o.gguf").exists()

    rc, out, err = run_main(capsys, "quantize", src, tmp_path / "o.gguf", "q8_0", "--dry-run", "--json",
                            "--bandwidth", "cpu=10G,gpu=100G", "-ot", "ffn=cpu")
    assert rc == 0, err
    doc = json.loads(out)["speed"]
    assert doc["bandwidth"] == {"cpu": 10e9, "gpu": 100e9} and doc["measured"] == []
    assert doc["bytes_per_token"]["gpu"] > 0 and doc["bytes_per_token"]["cpu"] > per // 2
    assert doc["tokens_per_s"] == pytest.approx(1 / (doc["bytes_per_token"]["cpu"] / 10e9
                                                     + doc["bytes_per_token"]["gpu"] / 100e9))


def test_dry_run_measures_the_cpu_by_default(models, tmp_path, capsys):
    rc, out, err = run_main(capsys, "quantize", models["tied"], tmp_path / "o.gguf", "q8_0", "--dry-run", "--json")
    assert rc == 0, err
    doc = json.loads(out)["speed"]
    assert doc["measured"] == ["cpu"] and doc["bandwidth"]["cpu"] > 1e8 and doc["tied_output"] is True
    assert math.isfinite(doc["tokens_per_s"]) and doc["tokens_per_s"] > 0
    # a GPU's bandwidth alone: the layers and the (tied) output there, the CPU's measured for its embedding row
    rc, out, err = run_main(capsys, "quantize", models["tied"], tmp_path / "o.gguf", "q8_0", "--dry-run", "--json",
                            "--bandwidth", "gpu=1T")
    assert rc == 0, err
    doc = json.loads(out)["speed"]
    assert doc["measured"] == ["cpu"] and doc["bandwidth"]["gpu"] == 1e12
    assert doc["bytes_per_token"]["cpu"] == 2 * 34 and doc["stored"]["gpu"] > doc["stored"]["cpu"] == 96 * 2 * 34


def test_dry_run_of_published_recipe_deepseek_v3(tmp_path, repo_root, capsys):
    """The shipped DeepSeek-V3 IQ2_K_R4 recipe on the full 671B table (a sparse file): 8 of 256 experts
    a token, 58 MoE layers; routed experts on the CPU, the rest on a GPU."""
    meta = {"deepseek2.block_count": 61, "deepseek2.expert_count": 256, "deepseek2.expert_used_count": 8}
    src = write_sparse(tmp_path / "dsv3.gguf", "deepseek2", meta, deepseek_v3_tensors())
    rc, out, err = run_main(capsys, "quantize", src, tmp_path / "o.gguf", "IQ2_K_R4", "--custom-q",
                            repo_root / "recipes/deepseek-v3-iq2_k_r4.txt", "--dry-run", "--json",
                            "--bandwidth", "cpu=60G,gpu=900G", "-ot", "exps=cpu")
    assert rc == 0, err
    doc = json.loads(out)
    s, tensors = doc["speed"], doc["plan"]["tensors"]
    exps = sum(t["bytes_out"] for t in tensors if "_exps." in t["name"])
    assert s["stored"]["cpu"] == exps + next(t["bytes_out"] for t in tensors if t["name"] == "token_embd.weight")
    assert s["stored"]["cpu"] + s["stored"]["gpu"] == doc["plan"]["totals"]["bytes_out"]
    embd_row = next(t["bytes_out"] for t in tensors if t["name"] == "token_embd.weight") // 129280
    assert s["bytes_per_token"] == {"cpu": exps * 8 // 256 + embd_row, "gpu": s["stored"]["gpu"]}
    assert s["tokens_per_s"] == pytest.approx(1 / ((exps * 8 // 256 + embd_row) / 60e9 + s["stored"]["gpu"] / 900e9))


def test_real_run_predicts_only_when_asked(models, tmp_path, capsys):
    out_file = tmp_path / "o.gguf"
    rc, out, err = run_main(capsys, "quantize", models["llama"], out_file, "COPY", "--json")
    assert rc == 0, err
    assert "speed" not in json.loads(out)               # no bandwidth measured on a plain run
    out_file.unlink()
    rc, out, err = run_main(capsys, "quantize", models["llama"], out_file, "COPY", "--json", "--bandwidth", "cpu=10G")
    assert rc == 0, err
    assert json.loads(out)["speed"]["bandwidth"] == {"cpu": 10e9} and out_file.is_file()


@pytest.mark.parametrize("args,needle", [
    (["--bandwidth", "cpu=lots"], "cannot read size"),
    (["-ot", "exps=gpu"], "none was given"),
    (["-ot", "exps"], "expected REGEX=cpu"),
    (["-ot", "(a|ab)*c=cpu", "--bandwidth", "gpu=1T"], "refused"),
])
def test_bad_speed_options_refused_in_process(models, tmp_path, capsys, args, needle):
    snap = Snapshot(models["dir"])
    rc, out, err = run_main(capsys, "quantize", models["llama"], tmp_path / "o.gguf", "q8_0", "--dry-run", *args)
    assert_refused(rc, out, err, needle)
    snap.assert_unchanged()
    assert not (tmp_path / "o.gguf").exists()


def test_bad_bandwidth_refused_by_the_console_entry_point(models, tmp_path):
    rc, out, err = run_cli("quantize", models["llama"], tmp_path / "o.gguf", "q8_0", "--bandwidth", "cpu=-3G")
    assert_refused(rc, out, err, "--bandwidth")
    assert not (tmp_path / "o.gguf").exists()
