"""`quantkit recipe`: the mix of types that fits a budget with the least predicted damage.

The search runs in stages, each over the library of one job:

1. groups (quantkit.groups): the model's quantizable tensors in groups that take one type each
   (a layer's attention, its ffn_up+ffn_gate, its routed down experts, ...), with every candidate
   type that passes the planner's constraints, sized as the planner writes it (fallbacks included);
2. sensitivity (quantkit.sensitivity): a fast error per (group, candidate) from actually quantizing
   it, and a few measured KLDs (only that group quantized, the rest as in the input) that calibrate
   the fast errors into predicted KLDs; every job through quantkit.workers (local processes or a
   Ray cluster), every result cached on disk as it comes (quantkit.sensitivity_cache);
3. solve (quantkit.solve): one candidate per group minimising the summed predicted KLD with the
   bytes on each device (and the seconds per generated token, for a speed floor) within budget;
4. emit (quantkit.recipe_emit): the choice as a compact recipe of layer-range regexes, checked to
   reproduce exactly the chosen types and sizes through the planner;
5. speed (quantkit.speed): the predicted generation speed of the result (bytes read per token on
   each device over that device's bandwidth).

The sum of per-group KLDs is the usual first-order model of how damage adds up (each group's
quantization noise is small and roughly independent of the others'); bench/recipe.py measures how
close it comes to the KLD of the quantized file.
"""
from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QuantkitError
from .gguf_io.reader import open_model
from .groups import check_types, make_groups, parse_budget
from .hf import open_hf
from .imatrix import load_imatrix
from .inputs import read_text
from .placement import parse_placement
from .recipe_emit import check_reproduces, compact_rules, custom_q_arg, recipe_text, tensor_type_file_text
from .sensitivity import (SensitivityCache, calibrate, cached_run, fast_error, fast_jobs, fingerprint, measure_jobs,
                          measure_sample, measured_kld)
from .solve import InfeasibleBudget, Item, solve
from .speed import bandwidth_of, device_seconds, plan_speed, with_cpu_measured
from .types import QuantType, traits, type_from_name, type_name, type_name_suggestion
from .workers import run_jobs

RESOURCES = ("cpu", "gpu", "time")      # the solver's resources: bytes per device, seconds per token
FLAVORS = ("ik", "mainline")

# Candidate types when --types is not given: the types published recipes mix, from 8.5 down to ~2.2
# bits per weight; those that need importance weights only with an imatrix.  Dominated candidates
# cost only their sensitivity jobs: the solver never picks a type that is both larger and worse.
DEFAULT_TYPES = {
    "ik": ("q8_0", "q6_K", "iq6_k", "q5_K", "iq5_k", "iq5_ks", "q4_K", "iq4_k", "iq4_ks", "iq4_xs", "iq3_k",
           "iq3_ks", "q3_K", "iq2_kl", "iq2_k", "iq2_ks", "q2_K"),
    "mainline": ("q8_0", "q6_K", "q5_K", "q4_K", "iq4_xs", "q3_K", "iq3_s", "iq3_xxs", "q2_K", "iq2_s"),
}
IMATRIX_TYPES = {"ik": ("iq2_xs", "iq2_xxs"), "mainline": ("iq2_xs", "iq2_xxs")}
MEASURE_PER_KIND = 3                    # measured samples per group kind when --measure is not given
CALIB_CTX = 512                         # tokens per chunk of the measured jobs' calibration text
CALIB_CHUNKS = 4                        # chunks of the calibration text a measured job scores
MAX_TEXT_BYTES = 1 << 30                # calibration text, as api's -f
CACHE_FILE = "sensitivity.jsonl"


def candidate_types(types, flavor: str = "ik", has_imatrix: bool = False) -> list[QuantType]:
    """The candidate types: ``types`` (names, comma-separated text or a sequence of them; None: the
    flavor's defaults), each checked by groups.check_types (a type the flavor loads and quantkit
    quantizes, with what is given).  One-line QuantkitError for a bad one."""
    if flavor not in FLAVORS:
        raise QuantkitError(f"flavor: '{flavor}' is none of ik, mainline")
    if types is None:
        names = list(DEFAULT_TYPES[flavor]) + (list(IMATRIX_TYPES[flavor]) if has_imatrix else [])
        return check_types([type_from_name(n) for n in names], flavor, has_imatrix)
    if isinstance(types, str):
        types = [types]
    names = [n.strip() for item in types for n in str(item).split(",")]
    if not names or any(not n for n in names):
        raise QuantkitError(f"--types: an empty type name in '{','.join(map(str, types))}' "
                            f"(give names separated by commas: q4_K,iq3_k,...)")
    parsed = []
    for n in names:
        try:
            parsed.append(type_from_name(n))
        except ValueError:
            raise QuantkitError(f"--types: unknown type '{n}'{type_name_suggestion(n)}") from None
    return check_types(parsed, flavor, has_imatrix)


def _parse_positive(value, what: str) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise QuantkitError(f"{what}: '{value}' is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise QuantkitError(f"{what}: {value} must be a positive number")
    return v


# --------------------------------------------------------------------------- result
@dataclass
class RecipeResult:
    """What ``search_recipe`` found: the groups, the chosen type per group, the predicted KLD,
    sizes per device against the budgets, the predicted speed, the recipe in both forms, and the
    solver's proof (``optimal``; ``bound``: a lower bound of the predicted KLD of any mix)."""
    model: Path
    flavor: str
    groupset: object                    # groups.GroupSet
    choice: dict                        # group key -> QuantType (the recipe rule's type)
    chosen: dict                        # group key -> groups.Option
    kld: dict                           # group key -> predicted KLD of the chosen option
    predicted_kld: float
    sizes: dict                         # device -> stored bytes (fixed tensors included)
    budgets: dict                       # device -> bytes allowed (inf: none)
    total_bytes: int                    # the file's tensor data (plan.Plan.bytes_out of the recipe)
    n_elements: int
    speed: object                       # speed.SpeedPrediction
    min_speed: float | None
    rules: list                         # (regex, QuantType)
    recipe_text: str
    tensor_type_file_text: str
    optimal: bool
    bound: float
    types: list                         # the candidate types
    predictor: object = None            # sensitivity.Predictor: the per-kind factors from fast error to KLD
    jobs: dict = field(default_factory=dict)        # {"fast"|"measured": {"run": n, "cached": n, "seconds": s}}
    seconds: dict = field(default_factory=dict)     # stage -> seconds
    requantize: bool = False            # the recipe requantizes tensors the input stores quantized

    def quantize_command(self, recipe_path, out: str = "OUT") -> str:
        """The quantize command line that writes this recipe (with --allow-requantize where the
        input's tensors are already quantized, as llama-quantize needs it)."""
        return (f"quantkit quantize {shlex.quote(str(self.model))} {out} --custom-q {shlex.quote(str(recipe_path))}"
                + (" --allow-requantize" if self.requantize else ""))

    @property
    def calibrated(self) -> bool:
        """The predictions are KLDs (some measured samples fitted the factors), not raw fast errors."""
        return bool(self.predictor is not None and self.predictor.measured)

    @property
    def bpw(self) -> float:
        return 8 * self.total_bytes / self.n_elements if self.n_elements else 0.0

    def rows(self) -> list[dict]:
        """The table: a row per group, by layer (token embeddings first, the output last)."""
        rows = []
        for g in sorted(self.groupset.groups, key=_group_order):
            o = self.chosen[g.key]
            nbytes = sum(o.nbytes.values())
            written = sorted({type_name(t) for t in o.types.values()})
            rows.append({"group": g.key, "kind": g.kind, "device": g.device, "tensors": len(g.tensors),
                         "type": type_name(self.choice[g.key]), "written": written,
                         "bytes": nbytes, "bpw": 8 * nbytes / g.n_elements if g.n_elements else 0.0,
                         "kld": self.kld[g.key]})
        return rows

    def to_json(self) -> dict:
        return {
            "model": str(self.model), "flavor": self.flavor,
            "predicted_kld": self.predicted_kld, "calibrated": self.calibrated, "optimal": self.optimal,
            "bound": self.bound, "calibration": self.predictor.to_json() if self.predictor is not None else None,
            "total_bytes": self.total_bytes, "n_elements": self.n_elements, "bpw": self.bpw,
            "sizes": self.sizes, "budgets": {d: (None if math.isinf(b) else b) for d, b in self.budgets.items()},
            "speed": self.speed.to_json(), "min_speed": self.min_speed,
            "types": [type_name(t) for t in self.types],
            "rules": [{"pattern": p, "type": type_name(t)} for p, t in self.rules],
            "recipe": self.recipe_text, "tensor_type_file": self.tensor_type_file_text,
            "custom_q_arg": custom_q_arg(self.rules), "requantize": self.requantize,
            "groups": self.rows(), "jobs": self.jobs, "seconds": self.seconds,
        }


def _group_order(g) -> tuple:
    if g.layers:
        return (1, min(g.layers))
    return (0 if "token_embd" in g.key else 2, 0)      # sorted() keeps the model's order within


# --------------------------------------------------------------------------- search
def _progress(on_progress, stage: str, done: int, total: int, note: str = "") -> None:
    if on_progress is not None:
        on_progress(stage, done, total, note)


def _open_model(path: Path):
    return open_hf(path) if path.is_dir() else open_model(path)


def search_recipe(model_in, *, budget, gpu_budget=None, override_tensor=(), imatrix=None, calibration=None,
                  types=None, bandwidth=None, min_speed=None, measure: int | None = None, cache_dir=None,
                  workers: int | None = None, ray_address: str | None = None, flavor: str = "ik",
                  layer_span: int = 1, on_progress=None, time_limit: float = 30.0,
                  calib_ctx: int = CALIB_CTX, calib_chunks: int = CALIB_CHUNKS) -> RecipeResult:
    """The best mix of ``types`` for ``model_in`` (a GGUF file or HF model directory) within
    ``budget`` (bytes in host memory: the whole model without ``gpu_budget``; "220G", "4.5bpw" or
    an int) and ``gpu_budget`` (bytes on the GPU: the tensors ``override_tensor`` rules
    (REGEX=cpu|gpu) do not keep on the CPU), and ``min_speed`` (tokens/s predicted from
    ``bandwidth``, "cpu=60G,gpu=900G"; default: measured CPU bandwidth).  ``measure``: measured
    sensitivity jobs calibrating the fast ones (needs ``calibration``, a text file; None: a few
    per group kind when a calibration text is given, else none).  ``cache_dir``: where results
    are kept between runs.  ``workers``/``ray_address``: quantkit.workers.run_jobs'.
    ``on_progress(stage, done, total, note)`` as the stages go.  A ``RecipeResult``."""

    if flavor not in FLAVORS:
        raise QuantkitError(f"flavor: '{flavor}' is none of ik, mainline")
    if not isinstance(layer_span, int) or layer_span < 1:
        raise QuantkitError(f"layer span: {layer_span} must be 1 or more")
    if measure is not None and (not isinstance(measure, int) or measure < 0):
        raise QuantkitError(f"--measure: {measure} must be 0 or more")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise QuantkitError(f"-j/--workers: {workers} must be 1 or more")
    min_speed = _parse_positive(min_speed, "--min-speed")
    model_in = Path(model_in)
    imatrix_path = None if imatrix is None else Path(imatrix)
    calib_path = None if calibration is None else Path(calibration)
    if measure and calib_path is None:
        raise QuantkitError("--measure needs a calibration text (-f FILE): the measured KLD is computed on it")
    if measure is None:
        measure = None if calib_path is not None else 0
    if calib_path is not None:
        read_text(calib_path, "-f", MAX_TEXT_BYTES, errors="replace")     # a bad -f fails before any work
    bw = bandwidth_of(bandwidth or None)
    placement = parse_placement(override_tensor or (), gpu=gpu_budget is not None or "gpu" in bw)
    bw, measured_bw = with_cpu_measured(bw)
    if placement.gpu and "gpu" not in bw:
        raise QuantkitError("--gpu-budget: give the GPU's memory bandwidth too (--bandwidth cpu=60G,gpu=900G) "
                            "for the speed prediction")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    imat = None
    if imatrix_path is not None:
        imat = load_imatrix(imatrix_path)
    has_imatrix = imat is not None and len(imat) > 0
    cand = candidate_types(types, flavor, has_imatrix)

    with contextlib.ExitStack() as stack:
        model = stack.enter_context(_open_model(model_in))
        if measure is None and model_in.is_dir():
            measure = 0         # measured jobs run the GGUF; an HF input: the fast estimates alone
        elif measure and model_in.is_dir():
            raise QuantkitError(f"--measure: {model_in} is a model directory; the measured KLD runs quantkit's "
                                f"runtime on a GGUF file (convert it first, or use --measure 0: fast estimates)")
        _progress(on_progress, "groups", 0, 1)
        gs = make_groups(model, cand, placement, flavor=flavor, layer_span=layer_span, has_imatrix=has_imatrix,
                         imatrix=imat)
        _progress(on_progress, "groups", 1, 1, f"{len(gs.groups)} groups")
        cap_cpu = parse_budget(str(budget), gs.n_elements)
        cap_gpu = parse_budget(str(gpu_budget), gs.n_elements) if placement.gpu else math.inf
        seconds["groups"] = time.perf_counter() - t0

        check_feasible(gs, bw, (cap_cpu, cap_gpu), min_speed)
        if measure is None:
            measure = MEASURE_PER_KIND * len({g.kind for g in gs.groups})
        sens = _sensitivities(model, model_in, gs, imatrix_path, calib_path, measure, cache_dir, workers, ray_address,
                              calib_ctx, calib_chunks, on_progress)
        seconds.update({m: j["seconds"] for m, j in sens.jobs.items()})
        predictor = sens.predictor

        t = time.perf_counter()
        _progress(on_progress, "solve", 0, 1)
        sol, costs = _solve(gs, predictor, bw, (cap_cpu, cap_gpu), min_speed, time_limit)
        _progress(on_progress, "solve", 1, 1, "optimal" if sol.optimal else f"bound {sol.bound:.4g}")
        seconds["solve"] = time.perf_counter() - t

        t = time.perf_counter()
        chosen = {g.key: g.options[i] for g, i in zip(gs.groups, sol.choice)}
        kld = {g.key: costs[k][i] for k, (g, i) in enumerate(zip(gs.groups, sol.choice))}
        choice = {k: o.qtype for k, o in chosen.items()}
        rules, text, tt_text, plan = _emit(model, gs, chosen, choice, flavor, model_in)
        seconds["emit"] = time.perf_counter() - t

        speed = plan_speed(plan, model.get, placement, bw, measured=measured_bw)
        sizes, file_bytes = gs.nbytes(choice), gs.file_bytes(choice)
        _check_sizes(plan, speed, sizes, file_bytes)
    seconds["total"] = time.perf_counter() - t0
    return RecipeResult(model_in, flavor, gs, choice, chosen, kld, sum(kld.values()), sizes,
                        {"cpu": cap_cpu, "gpu": cap_gpu}, file_bytes, gs.n_elements, speed, min_speed, rules, text,
                        tt_text, sol.optimal, sol.bound, cand, predictor, sens.jobs, seconds,
                        requantize=any(tp.action != "copy" and traits(tp.src_type).quantized for tp in plan.tensors))


def default_cache_dir() -> Path:
    """~/.cache/quantkit/recipe ($XDG_CACHE_HOME/quantkit/recipe where that is set)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quantkit" / "recipe"


@dataclass
class Sensitivities:
    predictor: object                   # sensitivity.Predictor
    fast: dict                          # (group key, type name) -> fast error
    measured: dict                      # (group key, type name) -> measured KLD
    jobs: dict                          # mode -> {"jobs", "run", "cached", "seconds"}


def _sensitivities(model, model_in: Path, gs, imatrix_path, calib_path, measure: int, cache_dir, workers,
                   ray_address, calib_ctx: int, calib_chunks: int, on_progress) -> Sensitivities:
    """Every (group, option)'s fast error and ``measure`` measured KLDs, from the cache where it has
    them, the rest through workers.run_jobs (each result cached as it arrives); calibrated."""

    names = {}                          # job -> "blk.3.attn as q4_K", for a job's error
    def run(fn, jobs, on_result=None):
        return run_jobs(fn, jobs, workers=workers, ray_address=ray_address, on_result=on_result,
                        describe=lambda job: names.get(id(job), "a sensitivity job"))

    cache_path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_FILE
    fp = fingerprint(model)
    out, jobs_doc = {}, {}
    with SensitivityCache(cache_path) as cache:
        stages = [("fast", fast_error, fast_jobs(gs, model_in, imatrix=imatrix_path))]
        if measure:
            samples = measure_sample(gs, measure)
            stages.append(("measured", measured_kld,
                           measure_jobs(gs, samples, model_in, calib_path, imatrix=imatrix_path, n_ctx=calib_ctx,
                                        chunks=calib_chunks)))
        for mode, fn, keyed in stages:
            names.update((id(job), f"{key} as {name}") for (key, name), job in keyed)
            t, counts = time.perf_counter(), {"run": 0, "cached": 0}
            _progress(on_progress, mode, 0, len(keyed))

            def arrived(key, value, cached, counts=counts, mode=mode, n=len(keyed)):
                counts["cached" if cached else "run"] += 1
                _progress(on_progress, mode, counts["run"] + counts["cached"], n, key[0])
            out[mode] = cached_run(fn, keyed, cache=cache, model_fp=fp, mode=mode, run=run, on_result=arrived)
            jobs_doc[mode] = {"jobs": len(keyed), **counts, "seconds": time.perf_counter() - t}
    fast, measured = out["fast"], out.get("measured", {})
    return Sensitivities(calibrate(gs, fast, measured), fast, measured, jobs_doc)


def _option_seconds(option, bandwidth: dict) -> float:
    """Seconds per generated token spent reading this option's weights (devices one after the other)."""
    return sum(device_seconds(option.bytes_per_token, bandwidth).values())


def _solve(gs, predictor, bandwidth, caps, min_speed, time_limit):
    """The multiple-choice knapsack over the groups: predicted KLD under bytes per device and seconds
    per token.  Returns the Solution and the per-group option costs."""

    classes, costs = [], []
    for g in gs.groups:
        row = [max(0.0, float(predictor.kld(g, o))) for o in g.options]
        costs.append(row)
        classes.append([Item(c, _weights(o, bandwidth)) for c, o in zip(row, g.options)])
    cap = _capacity(gs, bandwidth, caps, min_speed)
    try:
        sol = solve(classes, cap, time_limit=time_limit, names=RESOURCES)
    except InfeasibleBudget as e:
        raise QuantkitError(_infeasible(e.smallest, gs, bandwidth, caps, min_speed, e.jointly)) from None
    return sol, costs


def _capacity(gs, bandwidth, caps, min_speed) -> tuple[float, float, float]:
    """What the groups may use of each resource: the budgets less the kept tensors' share."""
    fixed_s = sum(device_seconds(gs.fixed_per_token, bandwidth).values())
    return (caps[0] - gs.fixed.get("cpu", 0), caps[1] - gs.fixed.get("gpu", 0),
            (1.0 / min_speed - fixed_s) if min_speed else math.inf)


def check_feasible(gs, bandwidth, caps, min_speed) -> None:
    """Before any sensitivity job: each budget on its own must hold the smallest option of every
    group (whether all fit together is the solver's to find)."""
    least = [sum(min(_weights(o, bandwidth)[r] for o in g.options) for g in gs.groups) for r in range(3)]
    cap = _capacity(gs, bandwidth, caps, min_speed)
    if any(least[r] > cap[r] for r in range(3)):
        raise QuantkitError(_infeasible(least, gs, bandwidth, caps, min_speed, False))


def _weights(option, bandwidth) -> tuple[float, float, float]:
    return (float(option.nbytes.get("cpu", 0)), float(option.nbytes.get("gpu", 0)), _option_seconds(option, bandwidth))


def _infeasible(smallest, gs, bandwidth, caps, min_speed, jointly: bool) -> str:
    """No mix fits, in the user's terms: per budget, the least any mix of the candidate types
    needs (the kept tensors included)."""
    parts = []
    for r, (what, where) in enumerate((("--budget", "in host memory"), ("--gpu-budget", "on the GPU"))):
        if math.isfinite(caps[r]):
            least = smallest[r] + gs.fixed.get(RESOURCES[r], 0)
            parts.append(f"{what} {_size(caps[r])}: the smallest mix takes {_size(least)} {where}")
    if min_speed:
        fixed_s = sum(device_seconds(gs.fixed_per_token, bandwidth).values())
        parts.append(f"--min-speed {min_speed:g}: the fastest mix makes {1 / (smallest[2] + fixed_s):.4g} tokens/s")
    how = "the budgets cannot all be met at once" if jointly else "a budget is too small"
    return f"no mix of the candidate types fits ({how}): " + "; ".join(parts)


def _size(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{int(n):,} bytes"


def _emit(model, gs, chosen, choice, flavor, model_in):
    """The recipe in both forms and the plan it makes, checked to give every tensor the chosen type."""

    rules = compact_rules(gs, choice)
    types = {name: t for o in chosen.values() for name, t in o.types.items()}
    plan = check_reproduces(model, rules, types, flavor)
    text = recipe_text(rules, [f"quantkit recipe for {model_in.name} ({flavor} flavor)"])
    return rules, text, tensor_type_file_text(rules), plan


def _check_sizes(plan, speed, sizes: dict, file_bytes: int) -> None:
    """The recipe through the planner writes exactly the predicted file and holds exactly the
    predicted bytes on each device."""
    held = {d: n for d, n in speed.stored.items() if n}
    want = {d: n for d, n in sizes.items() if n}
    if plan.bytes_out != file_bytes or held != want:
        raise QuantkitError(f"internal check: the emitted recipe plans {plan.bytes_out:,} file bytes, {held} per "
                            f"device; the search predicted {file_bytes:,}, {want}")
