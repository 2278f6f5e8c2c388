"""Benchmark (the proof of `quantkit recipe`): at a few budgets between ~3 and ~6 bits per weight,
the solved recipe's KLD against the best llama.cpp / ik_llama.cpp preset that fits the same budget,
measured on held-out text that is not the calibration text, and the search's predicted KLD beside
the measured one.

Models: SmolLM2-135M-Instruct (the shipped Q4_1, dequantized to F32 once: the reference is that
model) and a tiny DeepSeek-V3-shaped model (MLA + 8 routed experts, 6 layers), see
``write_tiny_deepseek``.  Calibration text (imatrix and measured sensitivity): the GPL v3
(imatrix/calib-gpl3.txt); held-out text: Debian's Apache-2.0 and GFDL-1.3 licence texts.  Every
model, preset and recipe is quantized with the same imatrix.  A budget is the bytes of the
quantized tensors (``bpw * weights / 8``); a preset fits when its tensors take no more.

    python bench/recipe.py [--models smollm2,deepseek] [--budgets 3.25,4,5,6] [--work DIR] [-j N]
                           [--presets Q3_K_M,...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CALIB = REPO / "imatrix" / "calib-gpl3.txt"
HELD_OUT = [Path("/usr/share/common-licenses/Apache-2.0"), Path("/usr/share/common-licenses/GFDL-1.3")]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

# ik presets from ~2.7 to ~6.6 bpw (their default type's bpw; the mixes add a little), the llama.cpp
# k-quant mixes among them: the candidates a user would pick from for a 3-6 bpw budget
PRESETS = ["IQ2_KL", "Q3_K_S", "IQ3_KS", "IQ3_K", "Q3_K_M", "Q3_K_L", "IQ4_XS", "IQ4_KS", "Q4_K_S", "IQ4_K",
           "Q4_K_M", "IQ5_KS", "Q5_K_S", "IQ5_K", "Q5_K_M", "Q6_K", "IQ6_K"]
BUDGETS = [3.25, 4.0, 5.0, 6.0]
CTX = {"smollm2": 512, "deepseek": 256}


def write_tiny_deepseek(path: Path, seed: int = 7) -> Path:
    """A DeepSeek-V3-shaped F32 GGUF (tests/models.write_deepseek2: MLA with DeepSeek's head sizes,
    one dense layer then MoE layers of 8 routed experts, 2 used, and a shared expert) whose output
    distributions are peaked and depend on the context, so that a KLD compares something: random
    weights as write_deepseek2 draws them, then token embeddings of unit scale (the current token
    matters, as in a trained model), per-channel RMS-norm gains drawn log-normal (outlier input
    channels, which real models have and imatrix weighting is for) and an output norm that puts the
    mean next-token entropy near 2.4 nats (a trained model's range; random weights give ~6, uniform).
    """
    from models import rewrite_gguf, write_deepseek2
    import gguf
    raw = path.with_name(path.stem + ".raw.gguf")
    write_deepseek2(raw, n_layer=6, n_dense=1, n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=512, seed=seed)
    rng = np.random.default_rng(seed + 1)
    changed = {}
    for t in gguf.GGUFReader(str(raw)).tensors:
        a = np.array(t.data, np.float32).reshape([int(n) for n in reversed(t.shape)])
        if t.name == "output_norm.weight":
            changed[t.name] = a * 10.0
        elif t.name == "token_embd.weight":
            changed[t.name] = a * 30.0
        elif t.name.endswith(("attn_norm.weight", "ffn_norm.weight")):
            changed[t.name] = np.exp(rng.normal(0.0, 0.7, a.shape)).astype(np.float32)
    rewrite_gguf(raw, path, tensors=changed)
    raw.unlink()
    return path


def prepare(name: str, work: Path, jobs: int | None) -> tuple[Path, Path]:
    """The model (F32 GGUF) and its imatrix on the calibration text."""
    from quantkit import api
    model, imatrix = work / f"{name}-f32.gguf", work / f"{name}-imatrix.gguf"
    if not model.exists():
        if name == "smollm2":
            from conftest import smollm2_file
            api.quantize_model(smollm2_file(), model, "F32", allow_requantize=True)
        else:
            write_tiny_deepseek(model)
    if not imatrix.exists():
        api.collect_imatrix(model, CALIB, imatrix, ctx_size=CTX[name], threads=jobs)
    return model, imatrix


def held_out_text(work: Path) -> Path:
    path = work / "held-out.txt"
    if not path.exists():
        path.write_text("\n\n".join(p.read_text() for p in HELD_OUT))
    return path


def base_logits(name: str, model: Path, text: Path, work: Path, threads: int | None, chunks: int | None) -> Path:
    from quantkit import api
    base = work / f"{name}-base.logits"
    if not base.exists():
        api.perplexity(model, text, ctx_size=CTX[name], chunks=chunks, kl_divergence_base=base, threads=threads)
    return base


def measure(model: Path, out: Path, base: Path, threads: int | None, type_: str | None = None, **options) -> dict:
    """Quantize ``model`` (a preset ``type_`` or ``custom_q``), then its KLD against ``base``."""
    from quantkit import api
    t = time.perf_counter()
    r = api.quantize_model(model, out, type_, threads=threads, **options)
    q_seconds = time.perf_counter() - t
    nbytes = sum(tp.nbytes_out for tp in api.plan_quantize(model, type_, **options).tensors)
    stats = api.kl_divergence(out, base, threads=threads).summary()
    out.unlink()
    return {"bytes": nbytes, "kld": stats["kld"]["mean"][0], "kld_err": stats["kld"]["mean"][1],
            "same_top_pct": stats["same_top_p"][0], "quantize_s": q_seconds, "file_bytes": r.bytes_written}


def preset_rows(name, model, imatrix, base, work, presets, threads) -> list[dict]:
    from quantkit import api
    n_elements = api.plan_quantize(model, "Q8_0").n_elements
    rows = []
    for p in presets:
        m = measure(model, work / f"{name}-{p}.gguf", base, threads, p, imatrix=imatrix)
        m.update(preset=p, bpw=8 * m["bytes"] / n_elements)
        print(f"{name} {p}: {m['bpw']:.3f} bpw, KLD {m['kld']:.5f}", file=sys.stderr, flush=True)
        rows.append(m)
    return rows


def recipe_rows(name, model, imatrix, base, work, budgets, jobs, threads, presets, types=None) -> list[dict]:
    from quantkit import api
    n_elements = api.plan_quantize(model, "Q8_0").n_elements
    rows = []
    for b in budgets:
        budget_bytes = int(b * n_elements / 8)
        recipe = work / f"{name}-{b}bpw.recipe"
        t = time.perf_counter()
        r = api.make_recipe(model, recipe, budget=f"{b}bpw", imatrix=imatrix, calibration=CALIB, types=types,
                            cache_dir=work / "cache", workers=jobs, calib_ctx=CTX[name])
        search_s = time.perf_counter() - t
        m = measure(model, work / f"{name}-{b}bpw.gguf", base, threads, None, custom_q=[str(recipe)], imatrix=imatrix)
        fitting = [p for p in presets if p["bytes"] <= budget_bytes]
        best = min(fitting, key=lambda p: p["kld"]) if fitting else None
        row = {"model": name, "budget_bpw": b, "budget_bytes": budget_bytes,
               "recipe_bpw": 8 * m["bytes"] / n_elements, "recipe_bytes": m["bytes"],
               "predicted_bytes": r.total_bytes, "recipe_kld": m["kld"], "predicted_kld": r.predicted_kld,
               "optimal": r.optimal, "search_s": search_s, "jobs": r.jobs,
               "preset": best["preset"] if best else None, "preset_bpw": best["bpw"] if best else None,
               "preset_kld": best["kld"] if best else None}
        print(f"{name} {b} bpw: recipe {row['recipe_bpw']:.3f} bpw KLD {m['kld']:.5f} (predicted "
              f"{r.predicted_kld:.5f}) vs {row['preset']} {row['preset_bpw'] or 0:.3f} bpw KLD "
              f"{row['preset_kld'] or float('nan'):.5f}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | budget bpw | recipe bpw | recipe KLD | predicted KLD | best preset that fits | preset bpw | "
             "preset KLD | recipe / preset |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['recipe_kld'] / r['preset_kld']:.2f}" if r["preset_kld"] else "-"
        lines.append(f"| {r['model']} | {r['budget_bpw']} | {r['recipe_bpw']:.3f} | {r['recipe_kld']:.5f} | "
                     f"{r['predicted_kld']:.5f} | {r['preset'] or '-'} | "
                     + (f"{r['preset_bpw']:.3f} | {r['preset_kld']:.5f}" if r["preset"] else "- | -")
                     + f" | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,deepseek")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--work", type=Path, help="Keep models, logits and the sensitivity cache here (default: a temp dir).")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="Sensitivity worker processes.")
    ap.add_argument("-t", "--threads", type=int, default=None, help="Runtime threads.")
    ap.add_argument("--skip-recipes", action="store_true", help="Only the presets (the baseline half).")
    ap.add_argument("--chunks", type=int, default=None, help="Chunks of the held-out text scored (default: all).")
    ap.add_argument("--presets-from", type=Path, help="Preset rows of an earlier --json run (not measured again).")
    ap.add_argument("--types", help="The recipe's candidate types (default: the flavor's).")
    ap.add_argument("--json", type=Path, help="Write every row as JSON here.")
    a = ap.parse_args(argv)
    budgets = [float(b) for b in a.budgets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text = held_out_text(work)
        doc = {"presets": {}, "recipes": []}
        for name in a.models.split(","):
            model, imatrix = prepare(name, work, a.threads)
            base = base_logits(name, model, text, work, a.threads, a.chunks)
            earlier = json.loads(a.presets_from.read_text())["presets"].get(name, []) if a.presets_from else []
            todo = [p for p in a.presets.split(",") if p not in {r["preset"] for r in earlier}]
            presets = earlier + preset_rows(name, model, imatrix, base, work, todo, a.threads)
            doc["presets"][name] = presets
            if not a.skip_recipes:
                doc["recipes"] += recipe_rows(name, model, imatrix, base, work, budgets, a.jobs, a.threads, presets,
                                              a.types)
        if a.json:
            a.json.write_text(json.dumps(doc, indent=1))
    for name, rows in doc["presets"].items():
        print(f"\n{name} presets:\n| preset | bpw | KLD |\n|---|---|---|")
        for r in sorted(rows, key=lambda r: r["bpw"]):
            print(f"| {r['preset']} | {r['bpw']:.3f} | {r['kld']:.5f} |")
    if doc["recipes"]:
        print("\n" + table(doc["recipes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
