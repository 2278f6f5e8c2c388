"""`quantkit recipe` (issue 27, part recipecli): recipe_search.search_recipe, api.make_recipe and the CLI.

One search on a tiny llama (fast and measured sensitivity jobs, in this process) is shared by the
module; the tests check what the search promises: the recipe fits the budget and reproduces exactly
the predicted bytes and types through `quantize --custom-q` (and mainline's --tensor-type-file
form), a second run finds every job in the cache, a smaller budget never predicts less damage, and
every bad option is one line and exit 1 with nothing written.
"""
from __future__ import annotations

import json
import math

import pytest

from hostile import Snapshot, assert_refused, run_cli
from models import write_deepseek2, write_llama
from quantkit import api
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.recipe_search import DEFAULT_TYPES, candidate_types, search_recipe
from quantkit.types import QuantType, type_name

T = QuantType
TYPES = "q8_0,q4_K,q2_K"
CALIB = "The quick brown fox jumps over the lazy dog. " * 60       # ~2,700 byte tokens: 2 chunks of 64
FAST = dict(workers=1, bandwidth="cpu=50G")                        # in this process; no bandwidth measurement


def run_main(capsys, *args):
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    model = write_llama(d / "llama.gguf", n_layer=2, vocab=True)
    calib = d / "calib.txt"
    calib.write_text(CALIB)
    cache = d / "cache"
    n = api.plan_quantize(model, "Q8_0").n_elements
    r = api.make_recipe(model, d / "r.recipe", tensor_type_file_out=d / "r.tt", budget="4.5bpw", types=TYPES,
                        calibration=calib, measure=4, calib_ctx=64, calib_chunks=1, cache_dir=cache, **FAST)
    return {"dir": d, "model": model, "calib": calib, "cache": cache, "n": n, "result": r}


def test_recipe_fits_and_reproduces_exactly(tiny):
    r, d, model = tiny["result"], tiny["dir"], tiny["model"]
    assert r.total_bytes <= 4.5 * tiny["n"] / 8
    assert r.sizes["cpu"] == r.total_bytes                  # all on the CPU: memory is the file
    for form in (dict(custom_q=str(d / "r.recipe")), dict(tensor_type_file=str(d / "r.tt"))):
        plan = api.plan_quantize(model, **form)
        assert plan.bytes_out == r.total_bytes
        want = {name: t for o in r.chosen.values() for name, t in o.types.items()}
        got = {tp.name: tp.dst_type for tp in plan.tensors if tp.action != "copy"}
        assert got == want
    assert (d / "r.recipe").read_text() == r.recipe_text and r.recipe_text.startswith("# quantkit recipe")
    assert "#" not in (d / "r.tt").read_text()


def test_recipe_uses_the_budget_it_is_given(tiny):
    # 4.5 bpw of q8_0/q4_K/q2_K: not all q4_K (that is 4.5 bpw of the groups, the norms come on top),
    # so some group goes down to q2_K and, with what is left, some other can go up
    r = tiny["result"]
    chosen = {type_name(t) for t in r.choice.values()}
    assert "q2_K" in chosen and len(chosen) >= 2
    assert r.optimal
    assert r.predicted_kld == pytest.approx(sum(r.kld.values()))
    assert r.calibrated and r.to_json()["calibration"]["samples"]
    rows = r.rows()
    assert sorted(row["group"] for row in rows) == sorted(g.key for g in r.groupset.groups)
    layers = [min(r.groupset.group(row["group"]).layers) for row in rows if row["kind"] not in ("token_embd", "output")]
    assert layers == sorted(layers)                         # by layer number (blk.10 after blk.9), not by name
    assert sum(row["bytes"] for row in rows) + sum(r.groupset.fixed.values()) == r.total_bytes


def test_measured_jobs_calibrate_and_are_cached(tiny):
    r = tiny["result"]
    assert r.jobs["measured"]["jobs"] == 4 and r.jobs["measured"]["run"] == 4
    assert r.jobs["fast"]["run"] == r.jobs["fast"]["jobs"] == sum(len(g.options) for g in r.groupset.groups)
    # the same search again: every job from the cache, the same answer
    again = search_recipe(tiny["model"], budget="4.5bpw", types=TYPES, calibration=tiny["calib"], measure=4,
                          calib_ctx=64, calib_chunks=1, cache_dir=tiny["cache"], **FAST)
    assert again.jobs["fast"]["run"] == 0 and again.jobs["measured"]["run"] == 0
    assert again.jobs["fast"]["cached"] == r.jobs["fast"]["jobs"]
    assert again.choice == r.choice and again.predicted_kld == pytest.approx(r.predicted_kld)


def test_widened_search_computes_only_the_new_jobs(tiny):
    # one more candidate type: only its jobs run, the others come from the cache
    wider = search_recipe(tiny["model"], budget="4.5bpw", types=TYPES + ",q6_K", measure=0, cache_dir=tiny["cache"],
                          **FAST)
    n_groups = len(wider.groupset.groups)
    assert wider.jobs["fast"]["run"] == n_groups
    assert wider.jobs["fast"]["cached"] == wider.jobs["fast"]["jobs"] - n_groups
    assert "measured" not in wider.jobs


def test_smaller_budget_predicts_more_damage(tiny):
    a = search_recipe(tiny["model"], budget="3.5bpw", types=TYPES, measure=0, cache_dir=tiny["cache"], **FAST)
    b = search_recipe(tiny["model"], budget="6bpw", types=TYPES, measure=0, cache_dir=tiny["cache"], **FAST)
    assert a.total_bytes <= 3.5 * tiny["n"] / 8 < b.total_bytes <= 6 * tiny["n"] / 8
    assert a.predicted_kld > b.predicted_kld


def test_speed_floor_is_a_constraint(tiny):
    free = search_recipe(tiny["model"], budget="8bpw", types=TYPES, measure=0, cache_dir=tiny["cache"], **FAST)
    floor = free.speed.tokens_per_s * 1.5           # faster than the unconstrained best: fewer bytes per token
    fast = search_recipe(tiny["model"], budget="8bpw", types=TYPES, measure=0, cache_dir=tiny["cache"],
                         min_speed=floor, **FAST)
    assert fast.speed.tokens_per_s >= floor * (1 - 1e-9)
    assert fast.predicted_kld >= free.predicted_kld
    with pytest.raises(QuantkitError, match="no mix of the candidate types fits"):
        search_recipe(tiny["model"], budget="8bpw", types=TYPES, measure=0, cache_dir=tiny["cache"],
                      min_speed=free.speed.tokens_per_s * 100, **FAST)


def test_cli_json_and_table(tiny, tmp_path, capsys):
    out = tmp_path / "cli.recipe"
    rc, stdout, err = run_main(capsys, "recipe", tiny["model"], "-o", out, "--budget", "4.5bpw", "--types", TYPES,
                               "--measure", "0", "--cache", tiny["cache"], "-j", "1", "--bandwidth", "cpu=50G",
                               "--json")
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["output"] == str(out) and doc["recipe"] == out.read_text()
    assert doc["custom_q_arg"] == ",".join(doc["tensor_type_file"].split())     # ik's llama-quantize --custom-q
    assert doc["total_bytes"] == api.plan_quantize(tiny["model"], custom_q=str(out)).bytes_out
    assert doc["budgets"] == {"cpu": int(4.5 * tiny["n"] / 8), "gpu": None}
    assert doc["speed"]["bandwidth"] == {"cpu": 50e9} and doc["speed"]["tokens_per_s"] > 0
    assert {g["type"] for g in doc["groups"]} <= set(TYPES.split(","))
    rc, stdout, err = run_main(capsys, "recipe", tiny["model"], "-o", tmp_path / "t.recipe", "--budget", "4.5bpw",
                               "--types", TYPES, "--measure", "0", "--cache", tiny["cache"], "-j", "1",
                               "--bandwidth", "cpu=50G")
    assert rc == 0, err
    for needle in ("blk.0.ffn_up_gate", "fast error", "not a KLD", "tokens/s", "--custom-q", "optimal"):
        assert needle in stdout, stdout


def test_gpu_budget_and_placement(tmp_path):
    model = write_deepseek2(tmp_path / "ds.gguf", n_layer=3, n_dense=1, n_expert=4, n_expert_used=2, n_vocab=64)
    n = api.plan_quantize(model, "Q8_0").n_elements
    r = search_recipe(model, budget="4bpw", gpu_budget="3bpw", override_tensor=["exps=cpu"], types="q8_0,q4_K,q2_K",
                      bandwidth="cpu=50G,gpu=500G", measure=0, cache_dir=tmp_path / "cache", workers=1)
    assert r.sizes["gpu"] <= int(3 * n / 8) and r.sizes["cpu"] <= int(4 * n / 8)
    with pytest.raises(QuantkitError, match=r"--gpu-budget .*: the smallest mix takes .* on the GPU"):
        search_recipe(model, budget="4bpw", gpu_budget="1bpw", override_tensor=["exps=cpu"], types="q8_0,q4_K,q2_K",
                      bandwidth="cpu=50G,gpu=500G", measure=0, cache_dir=tmp_path / "cache", workers=1)
    devices = {g.key: g.device for g in r.groupset.groups}
    assert devices["blk.1.ffn_down_exps"] == "cpu" and devices["blk.1.attn"] == "gpu"
    assert devices["token_embd"] == "cpu"
    assert r.speed.seconds["gpu"] > 0 and r.speed.seconds["cpu"] > 0
    assert api.plan_quantize(model, custom_q=[r.recipe_text]).bytes_out == r.total_bytes


def test_default_types_per_flavor():
    ik = candidate_types(None, "ik", has_imatrix=False)
    assert [type_name(t) for t in ik] == list(DEFAULT_TYPES["ik"])
    assert T.IQ2_XS not in ik and T.IQ2_XS in candidate_types(None, "ik", has_imatrix=True)
    ml = candidate_types(None, "mainline", has_imatrix=False)
    assert T.IQ4_K not in ml and T.Q4_K in ml
    assert candidate_types(["q4_K,q8_0", "q4_K"], "ik") == [T.Q4_K, T.Q8_0]


@pytest.mark.parametrize("args, needles", [
    (["--budget", "lots"], ["--budget", "cannot read size"]),
    (["--budget", "0.5bpw"], ["no mix", "budget"]),
    (["--budget", "100"], ["no mix"]),
    (["--budget", "4bpw", "-ot", "[=cpu"], ["--override-tensor"]),
    (["--budget", "4bpw", "-ot", "attn=gpu"], ["GPU"]),
    (["--budget", "4bpw", "-ot", "attn"], ["REGEX=cpu"]),
    (["--budget", "4bpw", "--types", "q9_9"], ["--types", "unknown type 'q9_9'"]),
    (["--budget", "4bpw", "--types", "q4_K,,q8_0"], ["--types", "empty"]),
    (["--budget", "4bpw", "--types", "iq2_xs"], ["iq2_xs", "--imatrix"]),
    (["--budget", "4bpw", "--types", "iq4_k", "--flavor", "mainline"], ["iq4_k", "mainline"]),
    (["--budget", "4bpw", "--measure", "3"], ["--measure", "-f"]),
    (["--budget", "4bpw", "--min-speed", "0"], ["--min-speed"]),
    (["--budget", "4bpw", "--min-speed", "nan"], ["--min-speed"]),
    (["--budget", "4bpw", "--gpu-budget", "1G", "--bandwidth", "cpu=50G"], ["bandwidth", "gpu"]),
    (["--budget", "4bpw", "--bandwidth", "cpu=fast"], ["--bandwidth"]),
    (["--budget", "4bpw", "-f", "/nonexistent/calib.txt"], ["calib.txt"]),
])
def test_bad_options_refused(tiny, tmp_path, capsys, args, needles):
    out = tmp_path / "bad.recipe"
    snap = Snapshot(tiny["model"], tiny["calib"])
    base = ["--cache", tmp_path / "cache", "-j", "1"] + ([] if "--bandwidth" in args else ["--bandwidth", "cpu=50G"])
    rc, stdout, err = run_main(capsys, "recipe", tiny["model"], "-o", out, *args, *base)
    assert_refused(rc, stdout, err, *needles)
    assert not out.exists() and list(tmp_path.iterdir()) in ([], [tmp_path / "cache"])
    snap.assert_unchanged()


def test_output_over_an_input_refused(tiny, capsys):
    for target in (tiny["model"], tiny["calib"]):
        snap = Snapshot(tiny["model"], tiny["calib"])
        rc, stdout, err = run_main(capsys, "recipe", tiny["model"], "-o", target, "--budget", "4bpw", "-f",
                                   tiny["calib"], "--cache", tiny["cache"], "-j", "1")
        assert_refused(rc, stdout, err, "input file")
        snap.assert_unchanged()


def test_infeasible_budget_through_the_console_entry_point(tiny, tmp_path):
    # the exit-code contract of a real process: a search that cannot fit ends as one line, exit 1
    out = tmp_path / "r.recipe"
    rc, stdout, err = run_cli("recipe", tiny["model"], "-o", out, "--budget", "1000", "--types", TYPES,
                              "--cache", tiny["cache"], "-j", "1", "--bandwidth", "cpu=50G")
    line = assert_refused(rc, stdout, err, "no mix")
    assert "budget" in line and not out.exists()


def test_hf_checkpoint_fast_only(tmp_path, capsys):
    from hf_models import write_tiny_llama
    hf = write_tiny_llama(tmp_path / "hf", n_layer=1, n_embd=32, n_ff=64, n_vocab=64)
    r = search_recipe(hf, budget="6bpw", types="q8_0,q4_0", cache_dir=tmp_path / "cache", **FAST)
    assert "measured" not in r.jobs
    assert api.plan_quantize(hf, custom_q=[r.recipe_text]).bytes_out == r.total_bytes
    (tmp_path / "c.txt").write_text(CALIB)
    with pytest.raises(QuantkitError, match="model directory"):
        search_recipe(hf, budget="6bpw", types="q8_0,q4_0", calibration=tmp_path / "c.txt", measure=2,
                      cache_dir=tmp_path / "cache", **FAST)
    assert not math.isnan(r.predicted_kld)


def test_interrupt_says_the_jobs_are_kept(tiny, tmp_path, capsys, monkeypatch):
    # Ctrl-C during the search: exit 130, and the line that says the finished jobs are in the cache
    def interrupted(*args, on_progress=None, **kwargs):
        on_progress("fast", 1, 10, "blk.0.attn")
        raise KeyboardInterrupt
    monkeypatch.setattr(api, "make_recipe", interrupted)
    rc, stdout, err = run_main(capsys, "recipe", tiny["model"], "-o", tmp_path / "r.recipe", "--budget", "4bpw",
                               "--cache", tmp_path / "cache")
    assert rc == 130
    assert f"kept in {tmp_path / 'cache' / 'sensitivity.jsonl'}: the same command goes on" in err
    assert not (tmp_path / "r.recipe").exists()


def test_a_quantized_input_gets_the_command_that_requantizes(tiny, tmp_path):
    """The printed quantize command works as printed: a Q8_0 input needs --allow-requantize (as
    llama-quantize does), an F32 one does not."""
    assert not tiny["result"].requantize
    assert "--allow-requantize" not in tiny["result"].quantize_command("r.recipe")
    q8 = tmp_path / "q8.gguf"
    api.quantize_model(tiny["model"], q8, "Q8_0")
    r = api.make_recipe(q8, tmp_path / "r.recipe", budget="6bpw", types="q8_0,q4_K", cache_dir=tmp_path / "c", **FAST)
    assert r.requantize and r.to_json()["requantize"]
    assert r.quantize_command(tmp_path / "r.recipe").endswith("--allow-requantize")
    with pytest.raises(QuantkitError, match="allow-requantize"):
        api.plan_quantize(q8, custom_q=str(tmp_path / "r.recipe"))
    result = api.quantize_model(q8, tmp_path / "out.gguf", custom_q=str(tmp_path / "r.recipe"), allow_requantize=True)
    assert result.bytes_written > 0
    assert api.plan_quantize(q8, custom_q=str(tmp_path / "r.recipe"), allow_requantize=True).bytes_out == r.total_bytes
