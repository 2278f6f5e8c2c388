"""Command line.  The only module that prints.

Every user error ends as one line on stderr and a non-zero exit code; set QUANTKIT_DEBUG=1 to see
the traceback of an unexpected error.

Names, paths, metadata, rules and messages come from files and the command line: the consoles read
no markup or emoji codes in what they print (a chat template's ``[/INST]`` or a rule's ``[a-z]`` is
text), styles are given as ``_styled`` parts, and ``_shown`` writes control characters as escapes.
Every --json document is written by ``_print_json``: strict JSON, non-finite numbers as null.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import shlex
import sys
import textwrap
import warnings
from pathlib import Path

import click
from rich.text import Text

from .version import __version__
from .api import MAX_TEXT_BYTES, parse_size  # noqa: F401  (the CLI's names for them)
from .console import Console
from .errors import QuantkitError
from .types import type_name
from .words import counted

out = Console(highlight=False, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)
GIB = 1024 ** 3
_DRY_RUN = "dry run: nothing written"
INSPECT_CELL_CHARS = 2000       # of a metadata key or value in inspect's table
INSPECT_VALUE_WIDTH = 120       # columns of inspect's value column, where a longer value folds

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def Table(*args, **kwargs):
    """rich's Table, imported when a command draws one through rich (~20 ms that quantize, which
    prints its plan through quantkit.text_table, is spared)."""
    from rich.table import Table
    return Table(*args, **kwargs)


def _shown(value, limit: int | None = None, one_line: bool = False) -> str:
    """Text from a file or the command line as it is shown: control characters (an ESC would drive
    the terminal) as escapes, newlines too where it must stay ``one_line``, at most ``limit``
    characters (then its length)."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}… ({len(text):,} characters)"
    return (_CONTROL_OR_NEWLINE if one_line else _CONTROL).sub(lambda m: repr(m[0])[1:-1], text)


def _styled(*parts) -> Text:
    """A line of parts, each plain text or a (text, style) pair; all of them shown as they are."""
    return Text.assemble(*((_shown(p[0]), p[1]) if isinstance(p, tuple) else _shown(p) for p in parts))


def _add_row(table: Table, *cells, limit: int | None = None) -> None:
    table.add_row(*(c if isinstance(c, Text) else _shown(c, limit) for c in cells))


def _warn(message, label: str = "warning:") -> None:
    err.print(_styled((label, "yellow"), " ", _shown(message, one_line=True)))


def _finite(value):
    """``value`` with every non-finite float (NaN, ±inf) as None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):     # a numpy scalar
        return _finite(value.item())
    return value


def _print_json(doc) -> None:
    """Every --json output: strict JSON (no NaN / Infinity, which json.loads of other languages
    refuse); a number that is not finite is written as null."""
    print(json.dumps(_finite(doc), indent=1, allow_nan=False))


class _WarningsToStderr(logging.Handler):
    def emit(self, record):
        _warn(record.getMessage())


def _output_and_type(model_in: Path, out_arg: str, type_arg: str | None, flavor: str,
                     threads_arg: str | None = None) -> tuple[Path, str | None, str | None]:
    """llama-quantize's positionals: ``IN OUT TYPE [NTHREADS]``, or ``IN TYPE [NTHREADS]``, which
    writes ``ggml-model-TYPE.gguf`` next to IN.  A file is never named like a type."""
    from .presets import type_label
    label = type_label(out_arg, flavor)
    if label is None:
        return Path(out_arg), type_arg, threads_arg
    if type_arg is not None and threads_arg is None and type_arg.isdigit():
        threads_arg, type_arg = type_arg, None          # IN TYPE NTHREADS
    if type_arg is not None:
        raise QuantkitError(f"OUT '{out_arg}' names a type, and TYPE '{type_arg}' follows it: give IN OUT TYPE, "
                            f"or IN TYPE to write ggml-model-{label}.gguf next to IN "
                            f"(./{out_arg} names a file called {out_arg})")
    derived = model_in.parent / f"ggml-model-{label}.gguf"
    _warn(f"no OUT given: writing {derived} (llama-quantize's name for IN TYPE)", "note:")
    return derived, out_arg, threads_arg


def _trailing_threads(text: str | None, threads: int | None) -> int | None:
    """llama-quantize's last positional, the thread count (0: every core, as there), reconciled
    with --threads."""
    if text is None:
        return threads
    if not (text.isascii() and text.isdigit()) or int(text) > 1024:
        raise QuantkitError(f"NTHREADS: '{text}' is not a thread count (0 to 1024; 0 uses every core, as in "
                            f"llama-quantize)")
    n = int(text) or None
    if threads is not None and n != threads:
        raise QuantkitError(f"NTHREADS {text} and --threads {threads} differ: give one of them")
    return n


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _shape(shape) -> str:
    return "×".join(str(d) for d in shape)


# --------------------------------------------------------------------------- rendering
def render_plan(plan, show_tensors: bool = True) -> None:
    from .text_table import Column, print_table
    if show_tensors:
        # names and rules fold where the width is short (a narrow terminal, COLUMNS): never cut
        columns = [Column("tensor", overflow="fold"), Column("shape", no_wrap=True), Column("source", no_wrap=True),
                   Column("target", no_wrap=True), Column("size", "right", no_wrap=True),
                   Column("rule / note", overflow="fold")]
        rows = []
        for p in plan.tensors:
            source = (type_name(p.src_type), " ", ("=", "dim") if p.action == "copy" else "→")
            target = type_name(p.dst_type)
            if p.fallback:
                target = ((target, "yellow"), " ", (f"(was {type_name(p.requested)})", "dim"))
            note = (_shown(p.rule + ("; " + "; ".join(p.notes) if p.notes else "")),
                    *([" ", ("+imatrix", "dim")] if p.imatrix else []))
            rows.append((_shown(p.name), _shape(p.shape), source, target, _fmt_bytes(p.nbytes_out), note))
        print_table(out, "plan", columns, rows)
    for title, rows in (("by type", plan.by_type()), ("by rule", plan.by_rule())):
        columns = [Column(title.split()[1], overflow="fold" if title == "by rule" else "ellipsis"),
                   *(Column(c, "right") for c in ("tensors", "weights", "size", "bpw"))]
        print_table(out, title, columns, [(_shown(r["group"]), str(r["tensors"]), f"{r['elements']:,}",
                                           _fmt_bytes(r["bytes"]), f"{r['bpw']:.3f}") for r in rows])
    bpw = 8 * plan.bytes_out / plan.n_elements if plan.n_elements else 0
    out.print(_styled(("total", "bold"), f": {counted(len(plan.tensors), 'tensor')}, {plan.n_elements:,} weights, "
                      f"{plan.bytes_in / GIB:.3f} GiB → {plan.bytes_out / GIB:.3f} GiB, {bpw:.3f} bpw, "
                      + (f"preset {plan.preset.name}, " if plan.preset is not None else "")
                      + f"file type {plan.file_type}, flavor {plan.flavor}"
                      + (f", blocks {','.join(map(str, plan.pruned_layers))} pruned ({plan.block_count} left)"
                         if plan.pruned_layers else "")))
    for key, mv in plan.kv_overrides:
        out.print(_styled(("metadata", "bold"), f": {key} = {mv.value!r} ({mv.vtype.name.lower()}, --override-kv)"))


def render_speed(speed) -> None:
    """One line: the predicted tokens/s, and per device the bytes read a token, the bandwidth and
    the bytes held."""
    parts = []
    for dev, nbytes in speed.bytes_per_token.items():
        bw = speed.bandwidth.get(dev)
        how = " (measured)" if dev in speed.measured else ""
        at = f" at {bw / 1e9:.1f} GB/s{how}" if bw else ""
        parts.append(f"{dev} reads {_fmt_bytes(nbytes)} a token{at}, holds {_fmt_bytes(speed.stored[dev])}")
    notes = (["output = token_embd (tied)"] if speed.tied_output else []) + \
        ([f"{speed.n_expert_used} of {speed.n_expert} experts a token"] if speed.n_expert else []) + \
        ([f"MTP blocks {','.join(map(str, speed.skipped_layers))} not run"] if speed.skipped_layers else [])
    out.print(_styled(("predicted generation", "bold"), f": {speed.tokens_per_s:.1f} tokens/s, memory-bound "
                      f"(an upper bound): " + "; ".join(parts) + (f" ({', '.join(notes)})" if notes else "")))


def _tensor_progress(what: str, plan, show: bool = True):
    """A step per tensor of ``plan``, measured in bytes read (quantkit.progress)."""
    from .progress import Reporter
    return Reporter(err, what, len(plan.tensors), plan.bytes_in, unit="bytes", show=show)


def _tensor_step(reporter, plan):
    """``run_plan``'s progress callback: a step per tensor, named with its types."""
    by_name = {p.name: p for p in plan.tensors}

    def progress(name, done, total):
        p = by_name[name]
        reporter.step(_shown(f"{name} {type_name(p.src_type)} -> {type_name(p.dst_type)}", one_line=True), done)
    return progress


# --------------------------------------------------------------------------- commands
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantkit")
def cli():
    """quantkit: GGUF quantization with per-tensor recipes, byte-exact with llama.cpp/ik_llama.cpp."""
    if click.get_current_context().invoked_subcommand not in _PLAN_THEN_WRITE:
        _resume_gc()


@cli.command()
@click.argument("model_in", metavar="IN", type=click.Path(path_type=Path))
# outputs are checked by quantkit.outputs (one line, exit 1), not by click.Path (a usage error)
@click.argument("model_out", metavar="OUT", type=click.Path(path_type=str))
@click.argument("default_type", metavar="[TYPE]", required=False)
@click.argument("threads_arg", metavar="[NTHREADS]", required=False)
@click.option("--custom-q", "custom_q", multiple=True, metavar="RECIPE",
              help="Recipe file (regex=type per line) or inline rules: 're1=t1,re2=t2', or lines in the file syntax; "
                   "repeatable; first match wins.")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="REGEX=TYPE",
              help="Mainline llama-quantize's rule: the lower-cased REGEX searched in tensor names, with a quantized "
                   "TYPE only; claimed tensors skip the mix heuristics; repeatable, after --custom-q's rules.")
@click.option("--tensor-type-file", "tensor_type_files", multiple=True, metavar="FILE",
              help="--tensor-type rules from FILE, REGEX=TYPE items separated by spaces or newlines (mainline's format).")
@click.option("--ffn-gate-inp-type", metavar="TYPE",
              help="Type for the MoE routers (ffn_gate_inp, otherwise never quantized), as ik's llama-quantize.")
@click.option("--override-kv", "override_kv", multiple=True, metavar="KEY=TYPE:VALUE",
              help="Set a metadata value in OUT (TYPE int, float, bool or str); repeatable.")
@click.option("--prune-layers", metavar="L0,L1,...",
              help="Remove these blocks and renumber the rest (mainline llama-quantize); refused where the model "
                   "would not hold together.")
@click.option("--partial-requant", is_flag=True,
              help="Keep the output files (shards) that are already complete, write only the missing ones (ik).")
@click.option("--resume", is_flag=True,
              help="Write a partial output (with a journal) that an interrupted or killed run keeps; run the same "
                   "command with --resume again to verify what it wrote and go on from there.")
@click.option("--imatrix", "imatrix_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Importance matrix (GGUF or legacy .dat).")
@click.option("--include-weights", multiple=True, help="Use only imatrix entries containing this text.")
@click.option("--exclude-weights", multiple=True, help="Ignore imatrix entries containing this text.")
@click.option("--missing-expert", type=click.Choice(["unit", "fill-mean", "error"]), default="unit",
              show_default=True,
              help="Experts the imatrix has no data for (GGUF imatrix): weight 1 as llama-quantize, the mean "
                   "of the other experts, or an error.")
@click.option("--token-embedding-type", help="Type for token_embd.weight (wins over the recipe).")
@click.option("--output-tensor-type", help="Type for output.weight (wins over the recipe).")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight as it is.")
@click.option("--pure", is_flag=True,
              help="No preset mix heuristics: the preset's default type for every tensor no rule matches.")
@click.option("--allow-requantize", is_flag=True, help="Allow quantized inputs (dequantized, then quantized).")
@click.option("--strict", is_flag=True, help="Any fallback type is an error.")
@click.option("--ignore-imatrix-rules", is_flag=True,
              help="Quantize very-low-bit types (IQ1_*, IQ2_XXS/XS/S, IQ1_KT, IQ2_KT…) without an imatrix.")
@click.option("--flavor", type=click.Choice(["ik", "mainline"]), default="ik", show_default=True,
              help="Whose quantizer bytes to reproduce; mainline writes only types mainline llama.cpp loads.")
@click.option("--split-max-size", help="Split the output into shards of at most SIZE (e.g. 4G).")
@click.option("--keep-split", is_flag=True, help="One output shard per input shard.")
@click.option("--threads", "-t", type=click.IntRange(1, 1024), help="Threads for quantization.")
@click.option("--dry-run", is_flag=True, help="Print the plan and its predicted generation speed, and stop.")
@click.option("--bandwidth", metavar="cpu=SIZE,gpu=SIZE",
              help="Memory bandwidth per device (bytes/s: cpu=60G,gpu=900G) for the predicted generation speed "
                   "(default: the CPU's, measured, and no GPU).")
@click.option("-ot", "--override-tensor", "override_tensor", multiple=True, metavar="REGEX=cpu|gpu",
              help="For the predicted speed: tensors whose name matches REGEX live on that device (as llama.cpp's "
                   "-ot; the rest on the GPU when --bandwidth gives one); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print plan and result as JSON on stdout.")
def quantize(model_in, model_out, default_type, threads_arg, custom_q, tensor_types, tensor_type_files, ffn_gate_inp_type,
             override_kv, prune_layers, partial_requant, resume, imatrix_path, include_weights, exclude_weights, missing_expert,
             token_embedding_type, output_tensor_type, leave_output_tensor, pure, allow_requantize,
             strict, ignore_imatrix_rules, flavor, split_max_size, keep_split, threads, dry_run, as_json,
             bandwidth, override_tensor):
    """Quantize IN to OUT with a per-tensor recipe.

    IN is a GGUF file (or the first shard of a split one) or a Hugging Face model directory
    (config.json, *.safetensors, tokenizer.json: LlamaForCausalLM, DeepseekV3ForCausalLM with FP8 or
    BF16 weights or Kimi-K2's int4 experts, which q4_0 holds losslessly), converted as convert_hf_to_gguf.py would and quantized in one streaming pass.

    TYPE is a llama-quantize preset (Q4_K_M, Q6_K, IQ4_XS, IQ4_K, …: the C tool's per-tensor mix for
    every tensor no recipe rule matches) or a ggml type name (that type for all of them, as --pure);
    `quantkit types` lists both, with the flavors that have them. Q4_X is the published Kimi-K2
    mix (routed experts q4_0, copied losslessly from Kimi's int4 checkpoint; the rest Q8_0).
    Omit it to keep unmatched tensors as they are: with --custom-q, --token-embedding-type,
    --output-tensor-type, --split-max-size or a model directory (a plain conversion); with none of
    them there is nothing to do, which is an error, while TYPE COPY copies every tensor on purpose.
    As in llama-quantize, `quantize IN TYPE` writes ggml-model-TYPE.gguf next to IN, and a last
    NTHREADS positional is the thread count (`quantize IN OUT Q4_K_M 8`; it must agree with --threads).

    OUT is written whole or not at all, never over an input; if it is a symlink, its target is
    replaced (the link stays).
    """
    from .api import open_quantization
    from .omp_wait import passive_for_batch_jobs

    passive_for_batch_jobs()
    model_out, default_type, threads_arg = _output_and_type(model_in, model_out, default_type, flavor, threads_arg)
    threads = _trailing_threads(threads_arg, threads)
    with open_quantization(
            model_in, model_out, default_type, custom_q=custom_q, tensor_type=tensor_types,
            tensor_type_file=tensor_type_files, ffn_gate_inp_type=ffn_gate_inp_type, override_kv=override_kv,
            prune_layers=prune_layers, imatrix=imatrix_path, include_weights=include_weights,
            exclude_weights=exclude_weights, missing_expert=missing_expert,
            token_embedding_type=token_embedding_type, output_tensor_type=output_tensor_type,
            leave_output_tensor=leave_output_tensor, pure=pure, allow_requantize=allow_requantize, strict=strict,
            ignore_imatrix_rules=ignore_imatrix_rules, flavor=flavor, split_max_size=split_max_size,
            keep_split=keep_split, partial_requant=partial_requant, threads=threads,
            override_tensor=override_tensor, bandwidth=bandwidth, resume=resume) as q:
        plan, problems = q.plan, [str(e) for e in q.problems]
        if not dry_run:
            q.check()
        speed = q.speed() if dry_run or bandwidth or override_tensor else None
        doc = {"plan": plan.to_json(), "dry_run": dry_run, **({"speed": speed.to_json()} if speed else {})}
        if problems:
            doc["not_implemented"] = problems
        if not as_json:
            render_plan(plan)
            if speed is not None:
                render_speed(speed)
            for w in plan.warnings:
                _warn(w)
            for p in problems:
                _warn(f"a real run would stop here: {p}", "note:")
        result = _dry_run_or_write("quantize", q, doc, dry_run, as_json)
    if result is None or as_json:
        return
    rate = result.n_weights / result.seconds / 1e6 if result.seconds else 0
    if result.kept:
        out.print(_styled(("kept", "green"), f" {', '.join(str(p) for p in result.kept)}: already complete "
                          f"(--partial-requant)"))
    if result.reused_tensors:
        out.print(_styled(("reused", "green"), f" {result.reused_tensors} tensors ({_fmt_bytes(result.reused_bytes)}) "
                          f"that an interrupted run had written (checksums verified, --resume)"))
    files = ", ".join(str(p) for p in result.paths if p not in result.kept)
    compiled = f"; compiling kernels took {result.compile_seconds:.1f} s before" if result.compile_seconds else ""
    if files:
        out.print(_styled(("wrote", "green"), f" {files}: {_fmt_bytes(result.bytes_written)} in "
                          f"{result.seconds:.1f} s ({rate:.1f} M weights/s{compiled})"))


def _dry_run_or_write(what: str, job, doc: dict, dry_run: bool, as_json: bool):
    """The end of quantize and repack, once the plan is shown: a dry run says so (or prints ``doc``)
    and gives None; a real run writes ``job`` (an api.Quantization or api.Repacking) with a
    progress step per tensor and gives its Result (with --json: ``doc`` and the result printed)."""
    if dry_run:
        if as_json:
            _print_json(doc)
        else:
            out.print(_DRY_RUN)
        return None
    _resume_gc()
    with _tensor_progress(what, job.plan, show=not as_json) as reporter:
        result = job.write(_tensor_step(reporter, job.plan))
    if as_json:
        doc["result"] = result.to_json()
        _print_json(doc)
    return result


@cli.command()
@click.argument("model_in", metavar="IN", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model_out", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--pattern", "patterns", multiple=True, metavar="REGEX[,REGEX...]",
              help="Only tensors one of these regexes finds (ik's --repack-pattern); repeatable.")
@click.option("--undo", is_flag=True, help="Interleaved tensors back to their plain layout.")
@click.option("--bf16", is_flag=True, help="Also BF16/F16 -> bf16_r16 (ik does it only in AVX512-BF16 builds).")
@click.option("--split-max-size", help="Split the output into shards of at most SIZE (e.g. 4G).")
@click.option("--keep-split", is_flag=True, help="One output shard per input shard.")
@click.option("--dry-run", is_flag=True, help="Print the plan and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print plan and result as JSON on stdout.")
def repack(model_in, model_out, patterns, undo, bf16, split_max_size, keep_split, dry_run, as_json):
    """Regroup IN's tensors into ik_llama.cpp's row-interleaved CPU layouts (q4_K -> q4_k_r4,
    iq2_k -> iq2_k_r4, ...) without requantizing, or back with --undo.  The bytes equal
    `llama-quantize --repack` and the runtime repack (-rtr).  OUT is written as by quantize: whole
    or not at all, never over an input, through a symlink."""
    from .api import open_repack
    from .omp_wait import passive_for_batch_jobs

    passive_for_batch_jobs()
    with open_repack(model_in, model_out, pattern=patterns, undo=undo, bf16=bf16, split_max_size=split_max_size,
                     keep_split=keep_split) as r:
        plan, n_moved = r.plan, r.n_moved
        doc = {"plan": plan.to_json(), "dry_run": dry_run}
        if not as_json:
            render_plan(plan)
        r.check()
        result = _dry_run_or_write("repack", r, doc, dry_run, as_json)
    if result is None or as_json:
        return
    rate = result.bytes_written / result.seconds / 1e9 if result.seconds else 0
    out.print(_styled(("wrote", "green"), f" {', '.join(str(p) for p in result.paths)}: "
                      f"{counted(n_moved, 'tensor')} {'restored' if undo else 'repacked'}, "
                      f"{_fmt_bytes(result.bytes_written)} in {result.seconds:.1f} s ({rate:.2f} GB/s)"))


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.option("--no-tensors", is_flag=True, help="Only metadata and totals.")
def inspect(path, as_json, no_tensors):
    """Show a GGUF file's metadata, tensors and totals per type (a long metadata value in part, with
    its length; --json has it whole)."""
    from .api import inspect_model
    from .describe import value_text
    doc = inspect_model(path)
    if as_json:
        _print_json(doc)
        return
    t = Table(title=_shown(f"{path} — metadata", one_line=True), header_style="bold")
    t.add_column("key", overflow="fold")
    t.add_column("type")
    # a long value folds into lines of at most INSPECT_VALUE_WIDTH, also in a log (unbounded width)
    t.add_column("value", overflow="fold", max_width=INSPECT_VALUE_WIDTH)
    for kv in doc["metadata"]:
        # a long value (a chat template, a vocabulary) shown in part: laying out a 5 MB cell takes
        # rich most of a minute; --json has it whole
        _add_row(t, kv["key"], kv["type"], value_text(kv), limit=INSPECT_CELL_CHARS)
    out.print(t)
    if not no_tensors:
        t = Table(title="tensors", header_style="bold")
        for col in ("tensor", "shape", "type", "size"):
            t.add_column(col, justify="right" if col == "size" else "left",
                         overflow="fold" if col == "tensor" else "ellipsis")
        for x in doc["tensors"]:
            _add_row(t, x["name"], _shape(x["shape"]), x["type"], _fmt_bytes(x["bytes"]))
        out.print(t)
    t = Table(title="totals per type", header_style="bold")
    for col in ("type", "tensors", "weights", "size", "bpw"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for r in doc["by_type"]:
        _add_row(t, r["type"], r["tensors"], f"{r['elements']:,}", _fmt_bytes(r["bytes"]), f"{r['bpw']:.3f}")
    out.print(t)
    tot = doc["totals"]
    out.print(_styled(("total", "bold"), f": {counted(tot['tensors'], 'tensor')}, {tot['elements']:,} weights, "
                      f"{_fmt_bytes(tot['bytes'])}, {tot['bpw']:.3f} bpw, {doc['shards']} file(s)"))


@cli.command("types")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def types_(as_json):
    """Every ggml type a GGUF file can hold and every llama-quantize preset of both flavors: bits
    per weight, block size, the --flavor values quantkit writes it with, whose llama.cpp loads it
    (mainline llama.cpp, ik_llama.cpp) and whether quantkit's own runtime computes with it."""
    from rich import box

    from .api import list_types
    doc = list_types()
    if as_json:
        _print_json(doc)
        return
    # narrow enough for 80 columns: "both" stands for both flavors / both projects
    def both(names) -> str:
        return "both" if len(names) == 2 else " ".join(names) or "-"

    def table(title, columns):
        t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
        for col in columns:
            t.add_column(col, justify="right" if col in ("id", "ftype", "bpw", "block") else "left", no_wrap=True)
        return t

    def tail(r):
        return (both([p for p, yes in r["loaded_by"].items() if yes]), both(r["quantkit_writes"]),
                "yes" if r["quantkit_runs"] else "-")
    t = table("types", ("type", "id", "bpw", "block", "loaded by", "writes", "runs"))
    for r in doc["types"]:
        _add_row(t, r["name"], r["id"], f"{r['bits_per_weight']:g}", r["block_size"], *tail(r))
    out.print(t)
    t = table("presets", ("preset", "ftype", "flavors", "type", "bpw", "loaded by", "writes", "runs"))
    for r in doc["presets"]:
        ftype = "/".join(dict.fromkeys(str(n) for n in r["ftype"].values()))
        _add_row(t, r["name"], ftype, both(list(r["ftype"])), r["default_type"], f"{r['bits_per_weight']:g}", *tail(r))
    out.print(t)
    out.print("aliases: " + ", ".join(f"{a} = {b}" for a, b in doc["aliases"].items()))
    # a legend of fixed text: wrapped here, since a pipe's width is unbounded (console.py)
    out.print(textwrap.fill(
        "bpw: bits per weight of the type's blocks (a preset: of its default type; the mix gives some tensors "
        "more). loaded by: whose llama.cpp loads a file with it (both: llama.cpp and ik_llama.cpp; a preset in "
        "llama.cpp: written with --flavor mainline). writes: the --flavor values quantkit quantizes it with "
        "(both: ik and mainline). runs: quantkit run, perplexity and imatrix compute with it.", 80))


@cli.command()
@click.argument("model_in", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_path", required=True, type=click.Path(path_type=Path),
              help="The recipe (a --custom-q file for quantize and ik's llama-quantize).")
@click.option("--budget", required=True, metavar="SIZE",
              help="Bytes in host memory (the whole model without --gpu-budget): 220G, 220GiB, a number of bytes, "
                   "or 4.5bpw (bits per weight of the whole model).")
@click.option("--gpu-budget", metavar="SIZE", help="Bytes on the GPU: the tensors no -ot rule keeps on the CPU.")
@click.option("-ot", "--override-tensor", "overrides", multiple=True, metavar="REGEX=cpu|gpu",
              help="Where tensors live while generating (llama.cpp's -ot, first match wins; CUDA0 means gpu); "
                   "interleaved _rN types only for CPU tensors.")
@click.option("--imatrix", "imatrix_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Importance matrix: weights the fast error, and enables the types that need one.")
@click.option("-f", "--file", "calib_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Calibration text for the measured KLD jobs that calibrate the fast estimates.")
@click.option("--types", "types", multiple=True, metavar="T1,T2,...",
              help="Candidate types (default: the flavor's usual mix from q8_0 down to ~2 bpw); repeatable.")
@click.option("--bandwidth", metavar="cpu=60G,gpu=900G",
              help="Memory bandwidth per device (bytes/s) for the speed prediction; default: the CPU's, measured.")
@click.option("--min-speed", type=float, metavar="TOK/S", help="Predicted generation speed floor (tokens/s).")
@click.option("--measure", type=click.IntRange(min=0), default=None,
              help="Measured KLD jobs (default with -f: a few per group kind; 0: fast estimates only).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=512, show_default=True,
              help="Tokens per chunk of the calibration text (measured jobs).")
@click.option("--chunks", type=click.IntRange(min=1), default=4, show_default=True,
              help="Chunks of the calibration text a measured job scores.")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory of the sensitivity cache (default: ~/.cache/quantkit/recipe).")
@click.option("-j", "--jobs", "workers", type=click.IntRange(min=1), default=None,
              help="Local worker processes (default: every core).")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the sensitivity jobs on this Ray cluster (auto, ray://host:port, or local); needs ray.")
@click.option("--layer-span", type=click.IntRange(min=1), default=1, show_default=True,
              help="Layers per group: 4 makes blk.0-3.attn one group (fewer jobs, coarser recipe).")
@click.option("--flavor", type=click.Choice(["ik", "mainline"]), default="ik", show_default=True,
              help="Whose types and quantizers: ik_llama.cpp's or mainline llama.cpp's.")
@click.option("--tensor-type-file-out", "tt_path", type=click.Path(path_type=Path),
              help="Also write the recipe as mainline llama-quantize's --tensor-type-file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def recipe(model_in, out_path, budget, gpu_budget, overrides, imatrix_path, calib_path, types, bandwidth, min_speed,
           measure, ctx_size, chunks, cache_dir, workers, ray_address, layer_span, flavor, tt_path, as_json):
    """Find the mix of types for MODEL (GGUF or HF directory) that fits --budget with the least
    predicted KL divergence, and write it as a recipe: per tensor group (a layer's attention, its
    ffn_up+gate, each expert kind, embeddings, output) a fast error from quantizing it, calibrated
    by measured KLDs, then an exact knapsack solve.  `quantkit quantize MODEL OUT --custom-q RECIPE`
    reproduces exactly the predicted size.  See docs/recipe.md."""
    from .api import make_recipe
    from .recipe_search import CACHE_FILE, default_cache_dir

    cache = Path(cache_dir or default_cache_dir()) / CACHE_FILE
    with _RecipeProgress(show=not as_json) as progress, _resume_note(cache):
        r = make_recipe(model_in, out_path, tensor_type_file_out=tt_path, budget=budget, gpu_budget=gpu_budget,
                        override_tensor=overrides, imatrix=imatrix_path, calibration=calib_path, types=types or None,
                        bandwidth=bandwidth, min_speed=min_speed, measure=measure, cache_dir=cache_dir,
                        workers=workers, ray_address=ray_address, flavor=flavor, layer_span=layer_span,
                        calib_ctx=ctx_size, calib_chunks=chunks, on_progress=progress.update)
    if as_json:
        _print_json({**r.to_json(), "output": str(out_path), "tensor_type_file_out": str(tt_path) if tt_path else None})
        return
    _render_recipe(r, out_path, tt_path)


@contextlib.contextmanager
def _resume_note(cache: Path):
    """An interrupted search says where its finished jobs are kept (quantkit.main prints the note)."""
    try:
        yield
    except KeyboardInterrupt as e:
        e.add_note(f"recipe: the sensitivity jobs that finished are kept in {cache}: the same command goes on "
                   f"from them")
        raise


class _RecipeProgress(contextlib.ExitStack):
    """``search_recipe``'s on_progress: a bar (or 20 lines in a log) for each stage of jobs, a line
    for the others."""
    TICKS = 20

    def __init__(self, show: bool):
        super().__init__()
        self.show, self.stage, self.reporter, self.ticked = show, None, None, 0

    def update(self, stage: str, done: int, total: int, note: str = "") -> None:
        from .progress import Reporter
        if not self.show:
            return
        if stage != self.stage:
            self.stage, self.ticked = stage, 0
            if self.reporter is not None:
                self.reporter.__exit__(None, None, None)
                self.reporter = None
            if total > 1:
                self.reporter = Reporter(err, "recipe", min(total, self.TICKS), total, unit="jobs").__enter__()
                self.callback(lambda r=self.reporter: r.__exit__(None, None, None))
        label = _shown(f"{stage} {done}/{total}{': ' + note if note else ''}", one_line=True)
        if self.reporter is None:
            if done == total:
                err.print(_styled(("recipe", "cyan"), ": ", label))
            return
        ticks = self.TICKS * done // total if total > self.TICKS else done
        while self.ticked < ticks:
            self.ticked += 1
            self.reporter.step(label, done)


def _render_recipe(r, out_path, tt_path) -> None:
    """``recipe``'s table and summary: an api.make_recipe result (recipe_search.RecipeResult)."""
    t = Table(title="recipe", header_style="bold")
    damage = "pred. KLD" if r.calibrated else "fast error"
    for col in ("group", "kind", "device", "type", "size", "bpw", damage):
        t.add_column(col, justify="right" if col in ("size", "bpw", damage) else "left",
                     overflow="fold" if col == "group" else "ellipsis")
    for row in r.rows():
        written = [w for w in row["written"] if w != row["type"]]
        typ = _styled(row["type"], *([" ", (f"({', '.join(written)} where it falls back)", "dim")] if written else []))
        _add_row(t, row["group"], row["kind"], row["device"], typ, _fmt_bytes(row["bytes"]), f"{row['bpw']:.2f}",
                 f"{row['kld']:.3g}")
    out.print(t)
    sizes = "; ".join(f"{d} {_fmt_bytes(n)}" + ("" if math.isinf(r.budgets.get(d, math.inf)) else
                                                 f" of {_fmt_bytes(r.budgets[d])}") for d, n in r.sizes.items())
    out.print(_styled(("size", "bold"), f": {sizes} ({r.bpw:.3f} bpw over {r.n_elements:,} weights)"))
    proof = "optimal" if r.optimal else f"best found; no mix is below {r.bound:.4g}"
    if r.calibrated:
        out.print(_styled(("predicted KLD", "bold"), f": {r.predicted_kld:.4g} ({proof})"))
    else:
        out.print(_styled(("fast error", "bold"), f": {r.predicted_kld:.4g} ({proof}; not a KLD: give -f CALIB.txt "
                          f"for measured jobs that calibrate it)"))
    sp = r.speed
    bw = ", ".join(f"{d} {b / 1e9:.0f} GB/s{' measured' if d in sp.measured else ''}" for d, b in sp.bandwidth.items())
    floor = f", floor {r.min_speed:g}" if r.min_speed else ""
    out.print(_styled(("speed", "bold"), f": {sp.tokens_per_s:.1f} tokens/s predicted ({bw}{floor})"))
    jobs = "; ".join(f"{m} {j['run']} run, {j['cached']} cached, {j['seconds']:.1f} s" for m, j in r.jobs.items())
    out.print(_styled(("jobs", "bold"), f": {jobs}"))
    also = f" and {tt_path} (--tensor-type-file)" if tt_path else ""
    out.print(_styled(("wrote", "green"), f" {out_path}{also}: {counted(len(r.rules), 'rule')}; "
                      + r.quantize_command(out_path)))


# --------------------------------------------------------------------------- runtime
def _threads_option(f):
    return click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
                        help="Threads (default: all cores).")(f)


def _float_products_option(f):
    return click.option("--float-products", is_flag=True,
                        help="Multiply a batch (the prompt, a chunk) with float32 activations and decoded weights "
                             "instead of activations rounded to 8 bits as a generation step's (CPU device).")(f)


def _device_options(f):
    f = click.option("-ctv", "--cache-type-v", "cache_type_v", default="f16", show_default=True,
                     help="V cache type: f16 or f32 (as llama.cpp's -ctv).")(f)
    f = click.option("-ctk", "--cache-type-k", "cache_type_k", default="f16", show_default=True,
                     help="K cache type: f16 or f32 (f32: keys, queries and probabilities unrounded).")(f)
    f = click.option("-ot", "--override-tensor", "overrides", multiple=True, metavar="REGEX=cpu",
                     help="Keep tensors whose name matches REGEX on the CPU (repeatable; e.g. exps=cpu).")(f)
    return click.option("--device", default="cpu", show_default=True,
                        help="cpu (numba), cuda[:N] (torch on the GPU, needs torch), or torch-cpu "
                             "(the torch backend on the CPU).")(f)


@cli.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-p", "--prompt", required=True, help="Prompt text.")
@click.option("-n", "--n-predict", type=click.IntRange(min=0), default=128, show_default=True,
              help="Tokens to generate (stops early at an end-of-generation token).")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Keep the K most likely tokens (0 = all).")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="Nucleus sampling threshold (1 = off).")
@click.option("--seed", type=int, default=None, help="Random seed (default or -1: random).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), default=None,
              help="Context size (default: prompt + n-predict).")
@_threads_option
@_device_options
@_float_products_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of streaming.")
def run(model_path, prompt, n_predict, temp, top_k, top_p, seed, chat, ctx_size, threads, device, overrides,
        cache_type_k, cache_type_v, float_products, as_json):
    """Generate text from PROMPT with quantkit's reference runtime, streaming it, then print prompt
    and generation speed (tokens/s)."""
    from .api import generate

    def on_placement(placement):
        if placement and not as_json:
            err.print("weights: " + "; ".join(f"{where} {counted(v['tensors'], 'tensor')}, {v['MB']:.1f} MB"
                                               for where, v in placement.items()))

    def on_prompt(text):
        if not as_json:
            out.print(text, end="", markup=False, highlight=False)

    def on_piece(piece):
        if not as_json:
            out.print(piece, end="", markup=False, highlight=False)
            out.file.flush()
    g = generate(model_path, prompt, n_predict=n_predict, temp=temp, top_k=top_k, top_p=top_p, seed=seed, chat=chat,
                 ctx_size=ctx_size, threads=threads, device=device, override_tensor=overrides,
                 on_placement=on_placement, on_prompt=on_prompt, on_piece=on_piece,
                 cache_type=(cache_type_k, cache_type_v), float_products=float_products)
    stats = g.stats
    if as_json:
        _print_json({"prompt": g.prompt, "prompt_tokens": g.prompt_tokens, "text": g.text,
                     "tokens": stats.tokens, "threads": g.threads,
                     "prompt_tokens_per_second": stats.prompt_tps, "placement": g.placement,
                     "generation_tokens_per_second": stats.gen_tps})
        return
    out.print(markup=False, highlight=False)
    err.print(f"prompt: {counted(stats.n_prompt, 'token')} in {stats.prompt_seconds:.2f} s "
              f"({stats.prompt_tps:.1f} tokens/s); generation: {counted(stats.n_generated, 'token')} in "
              f"{stats.gen_seconds:.2f} s ({stats.gen_tps:.1f} tokens/s); {counted(g.threads, 'thread')}")


@cli.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-f", "--file", "text_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Text to evaluate, a regular file of at most 1 GiB (not needed with --kl-divergence: the base "
                   "file holds its tokens).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens per chunk; the second half of each chunk is scored.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Evaluate at most N chunks.")
@click.option("--kl-divergence-base", "kld_base", type=click.Path(path_type=Path),
              help="Save this model's logits to FILE (llama-perplexity's format) for a later --kl-divergence.")
@click.option("--kl-divergence", "kld", is_flag=True,
              help="Compare with the logits saved in --kl-divergence-base FILE (KLD, top-token, Δp statistics).")
@click.option("--kld-top-k", "kld_top_k", type=click.IntRange(min=1), default=None, metavar="K",
              help="Save only each position's K most probable tokens and the rest's mass to --kl-divergence-base "
                   "(8K+8 bytes a position, not 2 x vocabulary); --kl-divergence reads either form, and the KLD "
                   "from this one is a lower bound of the full KLD.")
@_threads_option
@_device_options
@_float_products_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def perplexity(model_path, text_path, ctx_size, chunks, kld_base, kld, kld_top_k, threads, device, overrides,
               cache_type_k, cache_type_v, float_products, as_json):
    """Perplexity of MODEL on a text, llama-perplexity's way (chunks of --ctx-size tokens, the
    second half of each scored), or KL divergence against a base model's saved logits."""
    from . import api
    from .console import interactive
    from .perplexity_log import PerplexityLog
    from .progress import Reporter

    if kld and kld_base is None:
        raise QuantkitError("--kl-divergence needs --kl-divergence-base FILE (the base model's saved logits)")
    if kld and kld_top_k is not None:
        raise QuantkitError("--kld-top-k is for writing a base; --kl-divergence reads either form by itself")
    if not kld and text_path is None:
        raise QuantkitError("-f FILE is needed (the text to evaluate)")
    shown = contextlib.ExitStack()      # the progress, from the first chunk to the end of the run
    log = reporter = total = None

    def on_start(n):
        nonlocal log, reporter, total
        total = n
        # llama-perplexity's lines are the progress (on stdout); a bar besides only where stdout
        # is not the terminal the bar is drawn on
        log = None if as_json else PerplexityLog(out, err, total, ctx_size, kld)
        reporter = shown.enter_context(Reporter(err, "kl-divergence" if kld else "perplexity", total, unit="chunks",
                                                show=not as_json and not interactive(out), lines=False))

    def on_chunk(i, r):
        reporter.step(f"KLD {sum(r.kld) / len(r.kld):.4f}" if kld else f"PPL {r.ppl:.4f}")
        if log is not None:
            log.chunk(i, r, reporter.elapsed)
    session = dict(threads=threads, device=device, override_tensor=overrides, on_start=on_start, on_chunk=on_chunk,
                   cache_type=(cache_type_k, cache_type_v), float_products=float_products)
    with shown:
        if kld:
            stats = api.kl_divergence(model_path, kld_base, chunks=chunks, **session)
        else:
            res = api.perplexity(model_path, text_path, ctx_size=ctx_size, chunks=chunks, kl_divergence_base=kld_base,
                                 max_text_bytes=MAX_TEXT_BYTES, kld_top_k=kld_top_k, **session)
    if kld:
        doc = stats.summary()
        if as_json:
            _print_json(doc)
        else:
            log.final(doc)
        return
    if as_json:
        _print_json({"ppl": res.ppl, "ppl_error": res.ppl_error, "chunks": total,
                     "n_ctx": ctx_size, "tokens_scored": len(res.nll), "chunk_ppl": res.chunk_ppl})
    else:
        log.final(res)


@cli.command()
@click.option("--types", "types", multiple=True, metavar="TYPE[,TYPE...]",
              help="ggml types or presets (Q4_K_M: the types its mix uses); repeatable. Default: every type "
                   "quantkit quantizes.")
@click.option("--runtime", is_flag=True, help="Also the kernels run / perplexity / imatrix compute these types with.")
@click.option("--json", "as_json", is_flag=True, help="Print what was made ready as JSON.")
def warmup(types, runtime, as_json):
    """Compile the numba kernels of quantization (and with --runtime of the runtime) now, into
    numba's cache, so that no later command waits for them: once per install.  Kernels already
    cached are only loaded (fast)."""
    from .api import warm_kernels

    def step(w):
        if not as_json:
            how = f"compiled {counted(w.compiles, 'kernel')}" if w.compiles else "already cached"
            out.print(_styled((w.what, "cyan"), f": {how} ({w.seconds:.1f} s)"))
    w = warm_kernels(types, runtime=runtime, on_step=step)
    if as_json:
        _print_json(w.to_json())
    else:
        where = f" (cached in {w.cache})" if w.cache else ""
        out.print(_styled(("ready", "green"), f": {counted(len(w.steps), 'step')}, {counted(w.compiles, 'kernel')} "
                          f"compiled in {w.seconds:.1f} s{where}"))


class _DefaultGroup(click.Group):
    """A group whose first argument, when it names none of its commands, starts ``default``'s
    arguments (``quantkit imatrix MODEL -f TEXT`` is ``quantkit imatrix collect MODEL -f TEXT``)."""

    def __init__(self, *args, default: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default = default

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = [self.default, *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_DefaultGroup, default="collect")
def imatrix():
    """Importance matrices: collect one (the default: quantkit imatrix MODEL -f TEXT), convert,
    merge, or look inside.  Outputs are written whole or not at all, never over an input, through
    a symlink (its target is replaced)."""


_PARTIAL_OPTION = click.option(
    "--partial-experts", type=click.Choice(["keep", "ik"]), default="keep", show_default=True,
    help="Entries with experts that got no token: keep writes them (mainline llama-imatrix; weight 1 for those "
         "experts); ik skips an entry unless fewer than 5%% of its experts lack data (ik_llama.cpp's llama-imatrix).")


@imatrix.command("collect")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-f", "--file", "text_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Calibration text, a regular file of at most 1 GiB.")
@click.option("-o", "--output", "out_path", default="imatrix.gguf", show_default=True,
              type=click.Path(path_type=Path),
              help="Output file: .dat writes the legacy format (what ik_llama.cpp reads), anything else GGUF.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=512, show_default=True,
              help="Tokens per chunk.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Process at most N chunks.")
@click.option("--process-output", is_flag=True, help="Also collect output.weight.")
@click.option("--in-file", "in_files", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Start from this imatrix's data (repeatable): with --chunk, resume a run from its last save.")
@click.option("--chunk", "skip_chunks", type=click.IntRange(min=0), default=0,
              help="Skip the first N chunks of the text (those an --in-file already holds).")
@click.option("--output-frequency", type=click.IntRange(min=1), default=10, show_default=True,
              help="Save OUT every N chunks, so an interrupted run can be resumed.")
@click.option("--activations", type=click.Choice(["mainline", "exact"]), default="mainline", show_default=True,
              help="mainline: round each quantized product's input to 8 bits as mainline ggml does, "
                   "so the values follow llama-imatrix's; exact: compute in float32.")
@_PARTIAL_OPTION
@_threads_option
@_device_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def imatrix_collect(model_path, text_path, out_path, ctx_size, chunks, process_output, in_files, skip_chunks,
                    output_frequency, activations, partial_experts, threads, device, overrides, cache_type_k,
                    cache_type_v, as_json):
    """Collect an importance matrix: per weight, the mean square of every input column over the
    calibration text (per expert for routed experts), as llama-imatrix does."""
    import math

    from .api import collect_imatrix
    from .progress import Reporter

    shown = contextlib.ExitStack()      # the progress, from the first chunk to the end of the run
    reporter = None

    def on_start(n):
        nonlocal reporter
        reporter = shown.enter_context(Reporter(err, "imatrix", n, unit="chunks", show=not as_json))

    def on_save(saved):
        reporter.note(_shown(f"saved {out_path} after chunk {skip_chunks + saved}", one_line=True))
    try:
        with shown:
            result = collect_imatrix(
                model_path, text_path, out_path, ctx_size=ctx_size, chunks=chunks, process_output=process_output,
                in_file=in_files, chunk=skip_chunks, output_frequency=output_frequency, activations=activations,
                threads=threads, device=device, override_tensor=overrides, on_start=on_start,
                on_chunk=lambda i, v: reporter.step(f"PPL {math.exp(sum(v) / len(v)):.4f}"), on_save=on_save,
                max_text_bytes=MAX_TEXT_BYTES, partial_experts=partial_experts,
                cache_type=(cache_type_k, cache_type_v))
    except KeyboardInterrupt as e:      # Ctrl-C, SIGTERM, SIGHUP: say how to go on from the last save
        if hasattr(e, "saved"):
            saved = e.saved
            resume = dict(model_path=model_path, text_path=text_path, ctx_size=ctx_size,
                          chunks=None if chunks is None else chunks - saved, skip=skip_chunks + saved,
                          process_output=process_output, output_frequency=output_frequency,
                          activations=activations, partial_experts=partial_experts, threads=threads,
                          device=device, overrides=overrides, cache_type=(cache_type_k, cache_type_v))
            e.add_note(_imatrix_resume(out_path, saved, output_frequency, e.n_chunks, resume))
        raise
    for w in result.warnings:
        _warn(w)
    if as_json:
        _print_json(result.to_json())
    else:
        out.print(_styled(("wrote", "green"), f" {out_path}: {counted(result.entries, 'entry', 'entries')} from "
                          f"{counted(result.chunks, 'chunk')} of {ctx_size} tokens (PPL {result.ppl:.4f})"))


def _imatrix_resume(out_path: Path, saved: int, frequency: int, n_chunks: int, o: dict) -> str:
    """What an interrupted ``imatrix collect`` says: how many chunks OUT holds, and the command
    that goes on from there (OUT as --in-file, its chunks skipped, written to a new file: a command
    never writes over its input)."""
    if saved == 0:
        return (f"imatrix: interrupted before the first save (every {frequency} chunks): no chunk saved, nothing "
                "to resume; run the command again")
    from .outputs import unused_name
    new_out = unused_name(out_path, "resumed")
    args = ["quantkit", "imatrix", "collect", o["model_path"], "-f", o["text_path"], "-o", new_out,
            "--in-file", out_path, "--chunk", o["skip"], "-c", o["ctx_size"],
            *(["--chunks", o["chunks"]] if o["chunks"] is not None else []),
            *(["--process-output"] if o["process_output"] else []),
            "--output-frequency", o["output_frequency"], "--activations", o["activations"],
            *(["--partial-experts", o["partial_experts"]] if o["partial_experts"] != "keep" else []),
            *(["--threads", o["threads"]] if o["threads"] is not None else []),
            *(["--device", o["device"]] if o["device"] != "cpu" else []),
            *(a for regex in o["overrides"] for a in ("-ot", regex)),
            *(a for flag, t in zip(("-ctk", "-ctv"), o.get("cache_type", ())) if t != "f16" for a in (flag, t))]
    return (f"imatrix: {out_path} holds chunks 1-{o['skip']} of the text ({saved} of this run's {n_chunks}, "
            f"saved every {frequency}); to resume from there:\n{shlex.join(map(str, args))}")


_CHUNK_OPTION = click.option(
    "-c", "--ctx-size", "chunk_size", type=click.IntRange(min=1), default=512, show_default=True,
    help="Tokens per chunk of the run that made a legacy .dat input (it does not store it; GGUF inputs do).")


@imatrix.command("convert")
@click.argument("in_path", metavar="IN", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out_path", metavar="OUT", type=click.Path(path_type=Path))
@_CHUNK_OPTION
@_PARTIAL_OPTION
def imatrix_convert(in_path, out_path, chunk_size, partial_experts):
    """Rewrite an imatrix in the format OUT's extension names (.dat legacy, else GGUF)."""
    from .api import convert_imatrix
    _wrote_imatrix(convert_imatrix(in_path, out_path, chunk_size=chunk_size, partial_experts=partial_experts))


@imatrix.command("merge")
@click.argument("in_paths", metavar="IN...", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out_path", required=True, type=click.Path(path_type=Path),
              help="Merged output file: .dat writes the legacy format (what ik_llama.cpp reads), anything else GGUF.")
@_CHUNK_OPTION
@_PARTIAL_OPTION
def imatrix_merge(in_paths, out_path, chunk_size, partial_experts):
    """Merge imatrix files: sums and token counts added, so each file weighs what it saw."""
    from .api import merge_imatrix
    _wrote_imatrix(merge_imatrix(in_paths, out_path, chunk_size=chunk_size, partial_experts=partial_experts),
                   merged=True)


def _wrote_imatrix(r, merged: bool = False) -> None:
    """convert's and merge's line: an api.ImatrixFile."""
    source = f" from {counted(r.inputs, 'file')}" if merged else ""
    out.print(_styled(("wrote", "green"), f" {r.file}: {counted(r.entries, 'entry', 'entries')}{source}, "
                      f"{counted(r.chunks, 'chunk')} of {r.chunk_size}"))


@imatrix.command("stats")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@_CHUNK_OPTION
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Most important columns shown.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def imatrix_stats(path, chunk_size, top, as_json):
    """Per entry: values, experts without data, and the importance of its columns (sum, mean,
    max/mean ratio, the most important columns)."""
    from .api import imatrix_stats
    st = imatrix_stats(path, chunk_size=chunk_size, top=top)
    if as_json:
        _print_json(st.to_json())
        return
    t = Table(title=_shown(f"{path}: {len(st.entries)} entries, {st.chunks} chunks of {st.chunk_size}", one_line=True),
              header_style="bold")
    for col in ("entry", "values", "matrices", "no data", "Σ importance", "mean", "σ", "active %", "entropy",
                "E norm %", "ZD %", "cos prev", "max/mean", "top columns"):
        t.add_column(col, justify="left" if col in ("entry", "no data", "top columns") else "right",
                     overflow="fold" if col in ("entry", "top columns") else "ellipsis")
    for r in st.entries:
        _add_row(t, r["name"], r["values"], r["matrices"],
                 _styled((str(len(r["no_data"])), "yellow")) if r["no_data"] else "", f"{r['sum']:.4g}",
                 f"{r['mean']:.4g}", f"{r['std']:.4g}", f"{r['active_pct']:.1f}", f"{r['entropy']:.3f}",
                 f"{100 * r['entropy_norm']:.1f}", f"{r['zd_pct']:.1f}",
                 "" if r["cos_prev"] is None else f"{r['cos_prev']:.3f}", f"{r['max_over_mean']:.1f}",
                 " ".join(map(str, r["top_columns"])))
    out.print(t)
    for name, experts in st.experts_without_data.items():
        out.print(_styled((name, "yellow"), f": experts without data: {', '.join(map(str, experts))}"))


def main(argv=None) -> int:
    from .signals import Terminated, terminate_on_signals
    logging.basicConfig(level=logging.WARNING, handlers=[_WarningsToStderr()])
    # numpy's overflow warnings are noise here: overflowed outputs are caught and reported by name
    warnings.simplefilter("ignore", RuntimeWarning)
    from . import compiling
    compiling.notify = lambda line: _warn(line, "note:")       # numba compiling, said once
    try:
        with terminate_on_signals():        # SIGTERM, SIGHUP: cleaned up like Ctrl-C
            cli.main(args=argv, prog_name="quantkit", standalone_mode=False)
        return 0
    except (click.exceptions.Abort, Terminated) as e:
        cause = e if isinstance(e, Terminated) else e.__cause__     # click turns interrupts into Abort
        notes = getattr(cause, "__notes__", ())       # what the command says about going on
        left = "" if getattr(cause, "partial_kept", False) else "; no partial output file was left behind"
        if isinstance(cause, Terminated):
            err.print(f"quantkit: terminated by {cause.name}{left}")
        else:
            err.print("quantkit: interrupted")
        for note in notes:
            err.print(_shown(note))
        return 128 + cause.signum if isinstance(cause, Terminated) else 130
    except KeyboardInterrupt as e:
        err.print("quantkit: interrupted" + ("" if getattr(e, "partial_kept", False) else
                                             "; no partial output file was left behind"))
        for note in getattr(e, "__notes__", ()):
            err.print(_shown(note))
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except QuantkitError as e:
        err.print(f"quantkit: error: {_shown(e, one_line=True)}")
        return 1
    except BrokenPipeError:
        return 1
    except Exception as e:      # a bug: still one line unless asked for the traceback
        if os.environ.get("QUANTKIT_DEBUG"):
            raise
        err.print(f"quantkit: internal error: {type(e).__name__}: {_shown(e, one_line=True)} "
                  f"(set QUANTKIT_DEBUG=1 for a traceback)")
        return 2


#: commands whose start-up (imports, planning) runs with the garbage collector off (run())
_PLAN_THEN_WRITE = ("quantize", "repack")
_gc_paused = False


def _resume_gc() -> None:
    """The garbage collector back on where :func:`run` turned it off, with the objects made so far
    (modules, the plan) frozen out of it: later collections look at the run's new objects only."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def run() -> int:
    """The program (the ``quantkit`` script, ``python -m quantkit``): :func:`main` on ``sys.argv``
    in a process that ends when it returns.

    The garbage collector costs such a process its start-up and its end, where it finds nothing
    to free (a q8_0 quantize of a small F16 model takes 0.2 s in all):

    * start-up: imports and planning make ~28,000 objects (numpy's, click's, rich's, the plan's),
      every one looked at for cycles by the collections their allocations set off, ~9 ms.  The
      collector is off from here (``python -m quantkit`` turns it off before importing this module)
      until the command is known (cli()), and for quantize and repack until their plan is made
      and shown (_dry_run_or_write), then back on (_resume_gc): the writing, and every other
      command, run with it on, as always.
    * the end: finalization searches every object left for cycles, ~15 ms; they are frozen out of
      the collector first.  Objects are still freed as their references go; only cycles among them
      are left to the OS, and nothing of quantkit's needs one collected (files are closed and
      outputs committed or removed before :func:`main` returns).
    """
    global _gc_paused
    gc.disable()
    _gc_paused = True
    code = main()
    _resume_gc()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(run())
