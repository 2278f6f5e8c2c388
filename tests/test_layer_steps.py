"""A generation step in one call (runtime/layer_steps.py on team.py's threads) computes what the
layer loop computes, bit for bit: every layer and the head of a llama model, whatever the weight
types, the number of tokens (up to FUSED_TOKENS), the first logits wanted and the threads.

The reference is the model's own layer loop (Model.layer / Model.head through ops_cpu, what every
other runtime test checks against ik_llama.cpp), forced by leaving the model without its
one-call step.  Tiny llamas of 2 layers are quantized here by quantkit's library API.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

from models import write_llama
from quantkit.api import quantize_model
from quantkit.gguf_io.reader import open_model
from quantkit.runtime import activations, collect, layer_steps, ops_cpu
from quantkit.runtime.model import Model, StepShape
from quantkit.runtime import team as teams

# a type per kind of step kernel: legacy, k-quant, IQK with grid, an interleaved group kernel
# (q4_0_r8, iq2_k_r4: read as stored, R rows at once), a sign-grid i-quant (code_dots), E8M0
TYPES = ["f32", "q8_0", "q4_K", "iq4_xs", "q4_0_r8", "iq2_k_r4", "iq3_s", "mxfp4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> path: tiny llamas with 3 query heads per kv head (attention jobs split inside a
    group on 2 threads) and 2 (whole groups), quantized to each type."""
    d = tmp_path_factory.mktemp("steps")
    out = {"gqa3": write_llama(d / "gqa3.gguf", n_layer=2, n_embd=384, n_ff=512, n_head=6, n_head_kv=2, n_vocab=320),
           "gqa2": write_llama(d / "gqa2.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=256,
                               tied=True)}
    return out


def _quantized(models, tmp_path, name, qtype):
    src = models[name]
    if qtype == "f32":
        return src
    dst = tmp_path / f"{name}-{qtype}.gguf"
    quantize_model(src, dst, qtype)
    return dst


def _passes(model, one_call: bool, threads: int, prompt, chunks):
    """Logits of a prompt (a batch, on 2 threads: a float32 batch's BLAS tiles depend on the
    threads) then of each chunk of steps on ``threads``, one call or the layer loop."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        cache = model.new_cache(64)
        out = [model.forward(prompt, cache, logits_from=len(prompt) - 1)]
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        for tokens, logits_from in chunks:
            model._steps = (None, None) if one_call else (model.ops, None)
            if one_call:
                assert model.layer_steps() is not None
            out.append(model.forward(tokens, cache, logits_from=logits_from))
        return out
    finally:
        numba.set_num_threads(saved)
        model._steps = (None, None)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_step_in_one_call_equals_the_layer_loop(models, tmp_path, qtype):
    prompt = [1, 7, 42, 99, 3, 250, 17, 8, 64]
    chunks = [([5], 0), ([11, 12, 13], 0), ([200], 0), ([7, 8, 9, 10], 2), ([31, 32], 1), ([40, 41, 42, 43], 1)]
    for name in ("gqa3", "gqa2"):
        with open_model(_quantized(models, tmp_path, name, qtype)) as g:
            model = Model(g, ops_cpu)
            want = _passes(model, False, 2, prompt, chunks)
            for threads in (1, 2):
                got = _passes(model, True, threads, prompt, chunks)
                for i, (a, b) in enumerate(zip(want, got)):
                    assert a.shape == b.shape and np.array_equal(a, b), (name, threads, i, np.abs(a - b).max())


def test_three_threads_on_two_cores_give_the_same_bits(models, tmp_path, monkeypatch):
    """More participants than cores (the helpers yield their core while they wait), and so other
    splits of the attention jobs and product rows: the same logits.  The caller waits long enough
    for its helpers to join (on 2 busy cores they may not get one within the usual 50 us)."""
    monkeypatch.setattr(teams.team, "JOIN_AWAKE_S", 0.5)
    monkeypatch.setattr(teams.team, "JOIN_ASLEEP_S", 0.5)
    ran = []
    run = teams.team.run
    monkeypatch.setattr(teams.team, "run", lambda fn, job, n: ran.append(run(fn, job, n)) or ran[-1])
    with open_model(_quantized(models, tmp_path, "gqa3", "q4_K")) as g:
        model = Model(g, ops_cpu)
        steps = _layer_steps_of(model.layer_steps())
        c = model.config
        x = ops_cpu.embed(model.tok_embd, np.array([4, 5], np.int64))
        pos = np.arange(3, 5)
        angles = ops_cpu.rope_angles(pos, c.n_rot, c.rope_base, c.rope_scale)
        got = []
        for threads in (1, 3, 2, 4):
            cache = model.new_cache(16)
            model.forward([1, 2, 3], cache)
            got.append(steps(x, 3, *cache.bits, 0, angles, threads))
        assert all(np.array_equal(got[0], other) for other in got[1:])
        assert {3, 4} <= set(ran)       # the helpers did take part


def _layer_steps_of(runner) -> layer_steps.LayerSteps:
    """The LayerSteps an ops_cpu.layer_steps runner calls."""
    for cell in runner.__closure__:
        if isinstance(cell.cell_contents, layer_steps.LayerSteps):
            return cell.cell_contents
    raise AssertionError("no LayerSteps in the runner")


def test_a_step_the_one_call_does_not_take_goes_layer_by_layer(models, tmp_path):
    """A float32 cache, a full context, more tokens than a step, a cache of another shape: the
    call declines (None) and the model's layer loop computes (and reports a full context)."""
    with open_model(_quantized(models, tmp_path, "gqa2", "q8_0")) as g:
        model = Model(g, ops_cpu)
        run = model.layer_steps()
        steps = _layer_steps_of(run)
        c = model.config
        x = ops_cpu.embed(model.tok_embd, np.array([4], np.int64))
        f32_cache = ops_cpu.KVCache(c.n_layer, 8, c.n_head_kv, c.head_dim, c.head_dim, "f32", "f32")
        assert run(x, np.arange(1), f32_cache, 0) is None
        full = model.new_cache(2)
        full.n_past = 2
        assert run(x, np.arange(2, 3), full, 0) is None
        with pytest.raises(ValueError, match="context is full"):
            model.forward([4], full)
        five = ops_cpu.embed(model.tok_embd, np.arange(5))
        assert run(five, np.arange(5), model.new_cache(8), 0) is None
        # the step itself checks what it reads: the cache's shape and room, x, the first logits
        angles = ops_cpu.rope_angles(np.arange(1), c.n_rot, c.rope_base, c.rope_scale)
        keys, values = model.new_cache(8).bits
        assert steps(x, 0, keys, values, 0, angles, 2) is not None
        assert steps(x, 8, keys, values, 0, angles, 2) is None                 # past the end
        assert steps(x, 0, keys[:1], values[:1], 0, angles, 2) is None         # one layer of two
        assert steps(x, 0, keys[..., :8], values[..., :8], 0, angles, 2) is None
        assert steps(x, 0, keys.view(np.int16), values, 0, angles, 2) is None
        assert steps(x, 0, keys, values, 1, angles, 2) is None                 # logits_from past x
        assert steps(x[:, :-32], 0, keys, values, 0, angles, 2) is None
        assert steps(x, 0, keys, values, 0, (angles[0][:, :-1], angles[1][:, :-1]), 2) is None
        # a float32 cache: the layer loop
        model.cache_type = ("f32", "f32")
        assert model.forward([4], model.new_cache(8)).shape == (1, c.n_vocab)


def test_shapes_that_do_not_fit_are_refused_before_any_kernel(models, tmp_path):
    """The kernels read without bounds checks: rows of another length, a norm of another size or
    heads that do not divide are refused when the step is built (ops_cpu.layer_steps: None)."""
    with open_model(_quantized(models, tmp_path, "gqa2", "q8_0")) as g:
        model = Model(g, ops_cpu)
        c = model.config
        plans = [model._plan(i) for i in range(c.n_layer)]
        layers = [(p.attn_norm, p.qkv[0], p.attn_output[0][0], p.ffn_norm, p.gate_up[0], p.down[0][0]) for p in plans]
        good = StepShape(c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.rope_neox, c.rope_base,
                         c.rope_scale, c.rms_eps, plans[0].scale)
        norm = model.vector("output_norm.weight")
        assert ops_cpu.layer_steps(layers, model.output, norm, good) is not None
        swapped = [(a, [qkv[0], qkv[1], qkv[2]], down, f, gu, o) for a, qkv, o, f, gu, down in layers]
        assert ops_cpu.layer_steps(swapped, model.output, norm, good) is None          # o and down swapped
        short = [(a[:-32], qkv, o, f, gu, d) for a, qkv, o, f, gu, d in layers]
        assert ops_cpu.layer_steps(short, model.output, norm, good) is None            # a norm too short
        assert ops_cpu.layer_steps(layers, model.output, norm, good._replace(n_head_kv=3)) is None
        assert ops_cpu.layer_steps(layers, model.output, norm, good._replace(n_rot=c.head_dim + 2)) is None
        assert ops_cpu.layer_steps(layers, model.output, norm, good._replace(n_embd=c.n_embd + 32)) is None
        assert ops_cpu.layer_steps(layers, layers[0][2], norm, good) is not None        # any n_embd-wide head


def test_wrappers_that_see_the_products_keep_the_layer_loop(models, tmp_path):
    """An observer (imatrix) and mainline's rounding wrap the backend: a step through them must
    not run in one call, or its products would pass them by."""
    with open_model(_quantized(models, tmp_path, "gqa2", "q8_0")) as g:
        model = Model(g, ops_cpu)
        assert model.layer_steps() is not None
        seen = []
        stats = collect.ActivationStats()
        stats.add_dense = lambda name, x: seen.append(name)
        model.ops = collect.ObservingOps(ops_cpu, stats, {})
        assert model.layer_steps() is None
        model.forward([1], model.new_cache(4))
        assert "blk.0.attn_q.weight" in seen and "blk.1.ffn_down.weight" in seen
        model.ops = activations.MainlineRounding(ops_cpu)
        assert model.layer_steps() is None
        model.ops = ops_cpu.float_products          # a batch's float products; steps stay 8-bit ones
        assert model.layer_steps() is not None


def test_the_team_is_parked_when_the_tile_pool_starts(models, tmp_path):
    """After a step the helpers spin for the next one; a batch's tile pool sends them to sleep first."""
    with open_model(_quantized(models, tmp_path, "gqa2", "q8_0")) as g:
        model = Model(g, ops_cpu)
        saved = numba.get_num_threads()
        numba.set_num_threads(2)
        try:
            cache = model.new_cache(32)
            model.forward([1], cache)
            assert teams.team._spinning
            model.forward(list(range(10)), cache)           # a batch: the tile pool's threads
            assert not teams.team._spinning
        finally:
            numba.set_num_threads(saved)
