"""What `quantkit perplexity` prints: llama-perplexity's own lines, so that scripts written for its
logs (``grep -o '\\[[0-9]*\\][0-9.]*'``, "Final estimate: PPL = ...") read ours.

As llama-perplexity (tools/perplexity/perplexity.cpp) prints them:

* on stderr, before the first chunk: ``perplexity: calculating perplexity over N chunks, n_ctx=C,
  batch_size=C, n_seq=1``; after it: ``perplexity: 4.56 seconds per pass - ETA 1 hours 2.50 minutes``
  (``kl_divergence:`` in --kl-divergence mode);
* on stdout, after each chunk, flushed at once, on one line: the running perplexity ``[1]41.4754,``
  (``"[%d]%.4lf,"``), then a newline and ``Final estimate: PPL = 20.8163 +/- 0.99059``;
* with --kl-divergence, a header and a row per chunk of running statistics (PPL(Q),
  ln(PPL(Q)/PPL(base)), KLD, RMS Δp, same top p), then the summary.

The lines go out as they are made, on a terminal or not, so a log under nohup fills as it goes.
"""
from __future__ import annotations

KLD_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
              "Δp RMS            Same top p")


def eta_text(seconds_per_pass: float, n_chunk: int) -> str:
    """llama-perplexity's estimate after the first chunk: ``4.56 seconds per pass - ETA 1 hours
    2.50 minutes``."""
    total = int(seconds_per_pass * n_chunk)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return f"{seconds_per_pass:.2f} seconds per pass - ETA {hours}{total % 3600 / 60.0:.2f} minutes"


def kld_row(chunk: int, r: dict) -> str:
    """One chunk's row of running statistics (a ``KldStats.running()``), in the C formats."""
    return (f"{chunk:4d}    {r['ppl'][0]:9.4f} ± {r['ppl'][1]:9.4f}"
            f"    {r['ln_ppl_ratio'][0]:10.5f} ± {r['ln_ppl_ratio'][1]:10.5f}"
            f"    {r['kld'][0]:10.5f} ± {r['kld'][1]:10.5f}"
            f"    {r['dp_rms'][0]:6.3f} ± {r['dp_rms'][1]:6.3f} %"
            f"    {r['same_top_p'][0]:6.3f} ± {r['same_top_p'][1]:6.3f} %")


class PerplexityLog:
    """Prints a run's lines as it goes: ``out`` and ``err`` are the stdout and stderr consoles."""

    def __init__(self, out, err, n_chunk: int, n_ctx: int, kld: bool = False):
        self.out, self.err, self.n_chunk, self.kld = out, err, n_chunk, kld
        self.who = "kl_divergence" if kld else "perplexity"
        if not kld:
            err.print(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, "
                      f"batch_size={n_ctx}, n_seq=1")

    def _write(self, text: str) -> None:
        f = self.out.file
        f.write(text)
        f.flush()

    def chunk(self, i: int, result, seconds: float) -> None:
        """After chunk ``i`` (from 0): ``result`` a PplResult (its running perplexity) or, with
        --kl-divergence, a KldStats; ``seconds`` since the first chunk began."""
        if i == 0:
            self.err.print(f"{self.who}: {eta_text(seconds, self.n_chunk)}")
            if self.kld:
                self._write(f"\n{KLD_HEADER}\n")
        if self.kld:
            self._write(kld_row(i + 1, result.running()) + "\n")
        else:
            self._write(f"[{i + 1}]{result.chunk_ppl[-1]:.4f},")

    def final(self, result) -> None:
        """The end of the run: perplexity's estimate, or the KL divergence summary of ``result``
        (``KldStats.summary()``)."""
        self._write("\n")
        lines = kld_summary(result) if self.kld else [
            f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}"]
        self._write("".join(line + "\n" for line in lines))


def _label(key: str) -> str:
    """A percentile's label as llama-perplexity prints it: Maximum, 99.9%, Median,  5.0%, ..."""
    names = {"max": "Maximum", "median": "Median", "min": "Minimum"}
    return (names[key] if key in names else f"{float(key[:-1]):4.1f}%").ljust(7)


def kld_summary(doc: dict) -> list[str]:
    """The statistics llama-perplexity --kl-divergence prints at the end, in its order and formats."""
    pm = lambda v, w, d, w2=None: f"{v[0]:{w}.{d}f} ± {v[1]:{w2 or w}.{d}f}"     # noqa: E731
    k, d = doc["kld"], doc["delta_p"]
    return [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {pm(doc['ppl'], 10, 6)}",
        f"Mean PPL(base)                : {pm(doc['ppl_base'], 10, 6)}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * doc['cor_ln_ppl']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {pm(doc['ln_ppl_ratio'], 10, 6)}",
        f"Mean PPL(Q)/PPL(base)         : {pm(doc['ppl_ratio'], 10, 6)}",
        f"Mean PPL(Q)-PPL(base)         : {pm(doc['ppl_diff'], 10, 6)}",
        "",
        "====== KL divergence statistics ======",
        *([f"(from a top-{doc['kld_top_k']} base: the KLD over its {doc['kld_top_k']} most probable tokens and the "
           "rest, a lower bound of the full KLD)"] if doc.get("kld_top_k") else []),
        f"Mean    KLD: {pm(k['mean'], 10, 6)}",
        *(f"{_label(key)} KLD: {k[key]:10.6f}" for key in
          ("max", "99.9%", "99.0%", "95.0%", "90.0%", "median", "10.0%", "5.0%", "1.0%", "0.1%", "min")),
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {pm(d['mean'], 6, 3, 5)} %",
        *(f"{_label(key)} Δp: {d[key]:6.3f}%" for key in
          ("max", "99.9%", "99.0%", "95.0%", "90.0%", "75.0%", "median", "25.0%", "10.0%", "5.0%", "1.0%", "0.1%",
           "min")),
        f"RMS Δp    : {pm(d['rms'], 6, 3, 5)} %",
        f"Same top p: {pm(doc['same_top_p'], 6, 3, 5)} %",
    ]
