"""The library beneath the command line: each command as a function taking paths and options and
returning the objects the code computes (a ``plan.Plan``, a ``quantize.Result``), raising
``QuantkitError`` for bad input.  The CLI parses its arguments, calls these and renders.

Options have llama-quantize's names (``custom_q``, ``tensor_type``, ``imatrix``, ``pure``, …); a
repeatable option takes one string or a sequence of them.

A run that shows its plan before writing (as the CLI does) opens it first: ``open_quantization``
and ``open_repack`` give a context that holds the open model and its plan, and write on request::

    with open_quantization("in.gguf", "out.gguf", "Q4_K_M") as q:
        print(q.plan.bytes_out)
        print(q.speed().tokens_per_s)     # predicted generation speed (bandwidth=, override_tensor=)
        result = q.write()

``quantize_model`` / ``repack_model`` do both at once; ``plan_quantize`` / ``plan_repack`` only plan
(a dry run).  ``inspect_model``, ``list_types``, ``perplexity``, ``kl_divergence``, ``generate``,
``collect_imatrix``, ``convert_imatrix``, ``merge_imatrix``, ``imatrix_stats``, ``make_recipe`` and
``warm_kernels`` are the other commands; the long ones take callbacks for a caller that shows progress.  The
functions print nothing: warnings go to the ``quantkit`` logger.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QuantkitError
from .sizes import parse_size
from .types import QuantType, type_from_name, type_name_suggestion

def _split_size(split_max_size, keep_split: bool) -> int | None:
    """--split-max-size as bytes (an int, or a size text such as '4G'), checked against --keep-split."""
    if split_max_size and keep_split:
        raise QuantkitError("--split-max-size and --keep-split cannot be used together")
    if not split_max_size:
        return None
    if isinstance(split_max_size, int):
        if split_max_size <= 0:
            raise QuantkitError("--split-max-size must be positive")
        return split_max_size
    return parse_size(split_max_size)


def _many(value) -> tuple:
    """A repeatable option: None, one value, or a sequence of them."""
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (value,)
    return tuple(value)


def _parse_type(value: str | None, what: str) -> QuantType | None:
    if value is None:
        return None
    try:
        return type_from_name(value)
    except ValueError:
        raise QuantkitError(f"{what}: unknown type '{value}'{type_name_suggestion(value)}") from None


# --------------------------------------------------------------------------- quantize
@dataclass
class Quantization:
    """An open model and its quantization plan; ``write`` writes it.  Use it as a context manager
    (the model's files stay open until it ends)."""
    model: object                       # gguf_io.reader model or hf model
    plan: object                        # plan.Plan
    model_out: Path | None
    problems: list[QuantkitError]       # what a real run stops on (imatrix rules, types not implemented)
    write_options: object               # quantize.WriteOptions
    imatrix_of: dict = field(default_factory=dict)
    missing_imatrix: list[str] = field(default_factory=list)
    _stack: contextlib.ExitStack | None = None
    placement: object = None            # placement.Placement: where each tensor lives when it generates
    bandwidth: dict = field(default_factory=dict)   # bytes/s per device given (--bandwidth)
    threads: int | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def speed(self):
        """The plan's predicted generation speed (a ``speed.SpeedPrediction``): the bandwidth given,
        the CPU's measured where none was given for it."""
        return predict_plan_speed(self.plan, self.model.get, self.placement, self.bandwidth, self.threads)

    def check(self) -> None:
        """Raise what a real run would stop on (a dry run only reports it)."""
        if self.problems:
            raise self.problems[0]

    def write(self, progress=None):
        """Write the plan to ``model_out``: a ``quantize.Result``.  ``progress(name, done, total)``
        is called after each tensor."""
        from .quantize import run_plan
        if self.model_out is None:
            raise QuantkitError("no output file given: this quantization only plans (open it with model_out)")
        self.check()
        imatrix_of = self.imatrix_of
        result = run_plan(self.model, self.plan, self.model_out, self.write_options,
                          lambda tp: imatrix_of.get(tp.name), progress)
        result.missing_imatrix = self.missing_imatrix
        return result


def _open_hf(model_dir):
    """A Hugging Face model directory, opened (quantkit.hf is imported for one only: its converters
    and vocabularies are ~0.1 s of imports a GGUF input has no use for)."""
    from .hf import open_hf
    return open_hf(model_dir)


def open_quantization(model_in, model_out=None, type: str | None = None, *, custom_q=(), tensor_type=(),
                      tensor_type_file=(), ffn_gate_inp_type: str | None = None, override_kv=(),
                      prune_layers=None, imatrix=None, include_weights=(), exclude_weights=(),
                      missing_expert: str = "unit", token_embedding_type: str | None = None,
                      output_tensor_type: str | None = None, leave_output_tensor: bool = False,
                      pure: bool = False, allow_requantize: bool = False, strict: bool = False,
                      ignore_imatrix_rules: bool = False, flavor: str = "ik", split_max_size=None,
                      keep_split: bool = False, partial_requant: bool = False,
                      threads: int | None = None, override_tensor=(), bandwidth=None,
                      resume: bool = False) -> Quantization:
    """Open ``model_in`` (a GGUF file or a Hugging Face model directory, or a ``ModelView`` the
    caller made: a model whose rows are made on read, bench/deepseek671.py) and plan its quantization
    to ``model_out`` (None: plan only) with llama-quantize's TYPE (a preset, a ggml type or COPY)
    and options.  Checks every option and the output path before reading the model.
    ``override_tensor`` (``-ot REGEX=cpu|gpu``) and ``bandwidth`` ("cpu=60G,gpu=900G" or a dict of
    bytes/s) are for ``Quantization.speed()``, the predicted generation speed.  ``resume``: write
    a partial that an interrupted or killed run leaves for the next ``resume`` run to go on from
    (quantkit.resume)."""
    from . import formats
    from .gguf_io.reader import ModelView, open_model
    from .kv_override import overridden_getter, parse_kv_overrides
    from .mixes import find_mix, note_exact_copies
    from .outputs import check_outputs
    from .plan import PlanOptions, attach_imatrix, check_imatrix, check_implemented, make_plan
    from .presets import ModelInfo, preset_or_type
    from .prune import parse_prune_layers
    from .quantize import WriteOptions
    from .recipes import combined, load_recipe, load_tensor_types

    given = model_in if isinstance(model_in, ModelView) else None       # closed with the Quantization
    model_in = Path(given.path if given is not None else model_in)
    # (-ot and --bandwidth are checked now, before any work; without them the placement is the
    # default one, and speed.py, ~1.5 ms of imports, waits for a speed prediction if one is asked)
    placement, bandwidth = speed_options(override_tensor, bandwidth) \
        if _many(override_tensor) or bandwidth is not None else (None, {})
    custom_q, tensor_type, tensor_type_file = _many(custom_q), _many(tensor_type), _many(tensor_type_file)
    custom_q = tuple(map(str, custom_q))
    mix = find_mix(type)            # Q4_X: a recipe over a base type (the user's rules come first)
    if mix is not None:
        type, custom_q = mix.base, custom_q + (mix.rules,)
    override_kv, include_weights, exclude_weights = _many(override_kv), _many(include_weights), _many(exclude_weights)
    if missing_expert not in ("unit", "fill-mean", "error"):
        raise QuantkitError(f"missing_expert: '{missing_expert}' is none of unit, fill-mean, error")
    if flavor not in ("ik", "mainline"):
        raise QuantkitError(f"flavor: '{flavor}' is none of ik, mainline")
    max_size = _split_size(split_max_size, keep_split)
    if resume and partial_requant:
        raise QuantkitError("--resume and --partial-requant cannot be used together (--resume keeps every "
                            "tensor an interrupted run wrote)")
    if include_weights and exclude_weights:
        raise QuantkitError("--include-weights and --exclude-weights cannot be used together")
    only_copy = type is not None and type.upper() == "COPY"
    typed = custom_q or tensor_type or tensor_type_file or token_embedding_type or output_tensor_type or ffn_gate_inp_type
    if only_copy and typed:
        raise QuantkitError("TYPE COPY copies every tensor unchanged: it takes no --custom-q, --tensor-type(-file), "
                            "--token-embedding-type, --output-tensor-type or --ffn-gate-inp-type")
    if type is None and not (typed or split_max_size or override_kv or prune_layers or model_in.is_dir()):
        raise QuantkitError(f"nothing to do: with no TYPE and no --custom-q every tensor of {model_in} would be "
                            f"copied unchanged; give a TYPE (Q4_K_M, q8_0, ...) or a recipe, or TYPE COPY to copy "
                            f"on purpose")
    imatrix_path = None if imatrix is None else Path(imatrix)
    read = (imatrix_path, *(p for p in custom_q if os.path.isfile(p)), *tensor_type_file)      # besides IN
    if model_out is not None:
        model_out = Path(model_out)
        check_outputs([model_out], [model_in, *read])
    preset, default = (None, None) if only_copy or type is None else preset_or_type(type, flavor)
    if prune_layers is not None and not isinstance(prune_layers, str):
        prune_layers = ",".join(map(str, prune_layers))
    opts = PlanOptions(
        default_type=default, preset=preset,
        recipe=combined(load_recipe(list(custom_q)) if custom_q else None,
                        load_tensor_types(list(tensor_type), list(tensor_type_file))),
        token_embedding_type=_parse_type(token_embedding_type, "--token-embedding-type"),
        output_tensor_type=_parse_type(output_tensor_type, "--output-tensor-type"),
        ffn_gate_inp_type=_parse_type(ffn_gate_inp_type, "--ffn-gate-inp-type"),
        kv_overrides=parse_kv_overrides(override_kv),
        prune_layers=parse_prune_layers(prune_layers) if prune_layers is not None else (),
        pure=pure, leave_output_tensor=leave_output_tensor, allow_requantize=allow_requantize,
        strict=strict, flavor=flavor, keep_input_order=keep_split)
    imat = None
    if imatrix_path is not None:
        from .imatrix import load_imatrix
        imat = load_imatrix(imatrix_path, include=list(include_weights), exclude=list(exclude_weights))
        if imat.partial and missing_expert != "error":
            logging.getLogger("quantkit").warning(
                f"{imatrix_path}: {len(imat.partial)} entries have experts without data (partial data), "
                + ("weight 1 used there" if missing_expert == "unit" else "the other experts' mean used there")
                + f": {', '.join(imat.partial[:4])}{' ...' if len(imat.partial) > 4 else ''}")
        imat = imat.with_missing_experts(missing_expert)
    opts.has_imatrix = imat is not None and len(imat) > 0

    if model_in.is_dir() and keep_split:
        raise QuantkitError("--keep-split needs a split GGUF input; use --split-max-size with a model directory")
    stack = contextlib.ExitStack()
    with stack:
        model = stack.enter_context(given if given is not None else
                                    _open_hf(model_in) if model_in.is_dir() else open_model(model_in))
        # the C tools load the model with the overrides: an overridden hyper-parameter moves the mix
        opts.model = ModelInfo.from_metadata(overridden_getter(model.get, opts.kv_overrides))
        opts.metadata = model.metadata
        plan = make_plan(model.tensors, opts)
        note_exact_copies(mix, plan, model)
        imatrix_of, missing = attach_imatrix(plan, imat) if imat is not None else ({}, [])
        problems = []
        for check in (lambda: None if ignore_imatrix_rules else
                      check_imatrix(plan, opts.has_imatrix, lambda tp: tp.name in imatrix_of),
                      lambda: check_implemented(plan, formats.can_quantize, formats.can_dequantize,
                                                lambda tp: tp.name in imatrix_of)):
            try:
                check()
            except QuantkitError as e:
                problems.append(e)
        wopts = WriteOptions(split_max_size=max_size, keep_split=keep_split, threads=threads,
                             recipe_text=opts.recipe.text if opts.recipe else None, inputs=read,
                             partial_requant=partial_requant, resume=resume)
        if imat is not None:
            wopts.imatrix_info = {"file": str(imatrix_path), "dataset": (imat.datasets or [None])[0],
                                  "entries_count": len(imat), "chunks_count": imat.chunk_count}
        return Quantization(model, plan, model_out, problems, wopts, imatrix_of, missing, stack.pop_all(),
                            placement, bandwidth, threads)


def speed_options(override_tensor=(), bandwidth=None):
    """(placement.Placement, {device: bytes/s}) of ``-ot`` values and a ``--bandwidth`` text (or a
    dict): a GPU exists when a gpu bandwidth is given."""
    from .placement import parse_placement
    from .speed import bandwidth_of
    bandwidth = bandwidth_of(bandwidth)
    return parse_placement(_many(override_tensor), gpu="gpu" in bandwidth), bandwidth


def predict_plan_speed(plan, metadata_get, placement=None, bandwidth=None, threads: int | None = None):
    """A plan's predicted generation speed (``speed.plan_speed``), measuring the CPU's bandwidth
    (``speed.measure_cpu_bandwidth`` with ``threads``) where ``bandwidth`` has none for it."""
    from .placement import Placement
    from .speed import plan_speed, with_cpu_measured
    bandwidth, measured = with_cpu_measured(bandwidth or {}, threads)
    return plan_speed(plan, metadata_get, placement if placement is not None else Placement(), bandwidth,
                      measured=measured)


def plan_quantize(model_in, type: str | None = None, **options):
    """The ``plan.Plan`` of quantizing ``model_in`` (``quantize --dry-run``); nothing is written
    and nothing checked against a real run (``open_quantization(...).problems`` has that)."""
    with open_quantization(model_in, None, type, **options) as q:
        return q.plan


def quantize_model(model_in, model_out, type: str | None = None, *, progress=None, **options):
    """Quantize ``model_in`` to ``model_out`` (llama-quantize IN OUT TYPE): a ``quantize.Result``."""
    with open_quantization(model_in, model_out, type, **options) as q:
        return q.write(progress)


# --------------------------------------------------------------------------- repack
@dataclass
class Repacking:
    """An open model and its repack plan; ``write`` writes it (a context manager, as Quantization)."""
    model_in: Path
    model: object
    plan: object
    model_out: Path | None
    undo: bool
    split_max_size: int | None
    keep_split: bool
    _stack: contextlib.ExitStack | None = None

    __enter__ = Quantization.__enter__
    __exit__ = Quantization.__exit__
    close = Quantization.close

    @property
    def n_moved(self) -> int:
        """Tensors that change layout."""
        return sum(t.action == "repack" for t in self.plan.tensors)

    def check(self) -> None:
        """Raise when no tensor changes layout (nothing to write)."""
        if self.n_moved == 0:
            raise QuantkitError(f"{self.model_in}: nothing to {'undo' if self.undo else 'repack'} "
                                f"(no tensor {'is interleaved' if self.undo else 'qualifies'}; see the plan)")

    def write(self, progress=None):
        """Write the repacked model to ``model_out``: a ``quantize.Result``."""
        from .quantize import run_plan
        if self.model_out is None:
            raise QuantkitError("no output file given: this repack only plans (open it with model_out)")
        from .quantize import WriteOptions
        from .repack import repack_metadata
        self.check()
        # the first shard's own metadata: split.* keys keep their places in a split output
        wopts = WriteOptions(split_max_size=self.split_max_size, keep_split=self.keep_split,
                             metadata=repack_metadata(self.model.files[0].metadata, self.plan, self.undo))
        return run_plan(self.model, self.plan, self.model_out, wopts, progress=progress)


def open_repack(model_in, model_out=None, *, pattern=(), undo: bool = False, bf16: bool = False,
                split_max_size=None, keep_split: bool = False) -> Repacking:
    """Open ``model_in`` and plan regrouping its tensors into ik_llama.cpp's row-interleaved layouts
    (or back, ``undo``); ``pattern``: regexes (each may hold several, comma-separated) choosing the
    tensors, as ik's --repack-pattern."""
    from .formats import interleave
    from .gguf_io.reader import open_model
    from .outputs import check_outputs
    from .repack import RepackOptions, make_repack_plan

    model_in = Path(model_in)
    max_size = _split_size(split_max_size, keep_split)
    if model_out is not None:
        model_out = Path(model_out)
        check_outputs([model_out], [model_in])
    split = tuple(p for arg in _many(pattern) for p in arg.split(",") if p)
    opts = RepackOptions(patterns=split, undo=undo, bf16=bf16)
    stack = contextlib.ExitStack()
    with stack:
        model = stack.enter_context(open_model(model_in))
        plan = make_repack_plan(model.tensors, model.metadata, opts, interleave.supports)
        return Repacking(model_in, model, plan, model_out, undo, max_size, keep_split, stack.pop_all())


def plan_repack(model_in, **options):
    """The ``plan.Plan`` of repacking ``model_in`` (``repack --dry-run``)."""
    with open_repack(model_in, None, **options) as r:
        return r.plan


def repack_model(model_in, model_out, *, progress=None, **options):
    """Repack ``model_in`` to ``model_out``: a ``quantize.Result``."""
    with open_repack(model_in, model_out, **options) as r:
        return r.write(progress)


# --------------------------------------------------------------------------- inspect
def inspect_model(path) -> dict:
    """A GGUF file's metadata (values whole), tensors and totals per type: what ``inspect --json``
    prints (``describe.describe``)."""
    from .describe import describe
    from .gguf_io.reader import open_model
    with open_model(Path(path), nested_arrays=True) as model:
        return describe(model)


def list_types() -> dict:
    """Every ggml type a GGUF file can hold and every llama-quantize preset of both flavors, with
    sizes, ftypes, the flavors quantkit writes each in and whose llama.cpp loads it: what ``types
    --json`` prints (``catalog.catalog``)."""
    from .catalog import catalog
    return catalog()


# --------------------------------------------------------------------------- runtime
MAX_TEXT_BYTES = 1024 ** 3      # calibration / evaluation text (-f): wiki.test.raw is 1.3 MB


def read_text_file(path, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A calibration / evaluation text (``-f``): a regular file of at most ``max_bytes``."""
    from .inputs import read_text
    return read_text(Path(path), "-f", max_bytes, errors="replace")


def perplexity(model, text_file, *, ctx_size: int = 512, chunks: int | None = None, kl_divergence_base=None,
               threads: int | None = None, device: str = "cpu", override_tensor=(), on_start=None,
               on_chunk=None, max_text_bytes: int = MAX_TEXT_BYTES, cache_type="f16", kld_top_k: int | None = None,
               float_products: bool = False):
    """Perplexity of ``model`` on ``text_file``, llama-perplexity's way (chunks of ``ctx_size``
    tokens, the second half of each scored): a ``runtime.perplexity.PplResult`` (``.ppl``,
    ``.ppl_error``, ``.chunk_ppl``).  ``kl_divergence_base``: also save the logits there for a
    later ``kl_divergence``: all of them (llama-perplexity's format), or with ``kld_top_k=K`` only
    each position's K most probable tokens and the rest's mass (runtime/kld_topk.py: 8K + 8 bytes a
    position instead of 2 x n_vocab; its KLD is a lower bound of the full one).
    ``on_start(n_chunks)`` is called once the text is cut into chunks, ``on_chunk(i, result so
    far)`` after each chunk.  ``cache_type``: the KV cache's type, "f16"
    or "f32", or a (K, V) pair (llama.cpp's -ctk/-ctv; runtime/cache_type.py).  ``float_products``:
    a batch's quantized products in float32 (decoded tiles and BLAS: what the stored weights mean
    with float32 activations) instead of with activations rounded to 8 bits per 32 as ggml's and a
    generation step's are (runtime/ops_cpu.py; the CPU device only)."""
    from .outputs import check_outputs
    from .runtime import perplexity as ppl
    from .runtime.kld_topk import TopkWriter
    from .runtime.session import open_session, parse_overrides

    model, text_file = Path(model), Path(text_file)
    if kld_top_k is not None:
        if kl_divergence_base is None:
            raise QuantkitError("--kld-top-k K needs --kl-divergence-base FILE (the base to write)")
        try:
            k = None if isinstance(kld_top_k, bool) else operator.index(kld_top_k)
        except TypeError:
            k = None
        if k is None or k < 1:
            raise QuantkitError(f"--kld-top-k: {kld_top_k!r} is not a whole number >= 1")
        kld_top_k = k
    if kl_divergence_base is not None:
        kl_divergence_base = Path(kl_divergence_base)
        check_outputs([kl_divergence_base], [model, text_file], what="--kl-divergence-base")
    text = read_text_file(text_file, max_text_bytes)        # before the model loads: a bad -f fails fast
    with open_session(model, threads, device=device, cpu_tensors=parse_overrides(_many(override_tensor)),
                      cache_type=cache_type, float_products=float_products) as s:
        chunk_list = s.chunks(text, ctx_size, chunks)
        if on_start is not None:
            on_start(len(chunk_list))
        writer = None
        if kl_divergence_base is not None and kld_top_k is not None:
            writer = TopkWriter(kl_divergence_base, ctx_size, s.model.config.n_vocab, chunk_list, kld_top_k)
        elif kl_divergence_base is not None:
            writer = ppl.LogitsWriter(kl_divergence_base, ctx_size, s.model.config.n_vocab, chunk_list)
        with writer if writer is not None else contextlib.nullcontext():
            return ppl.perplexity(s.model, chunk_list, on_chunk, writer)


def kl_divergence(model, kl_divergence_base, *, chunks: int | None = None, threads: int | None = None,
                  device: str = "cpu", override_tensor=(), on_start=None, on_chunk=None, cache_type="f16",
                  float_products: bool = False):
    """KL divergence of ``model`` from the base model whose logits ``perplexity(...,
    kl_divergence_base=FILE)`` saved (llama-perplexity's --kl-divergence), in either form (full or
    top-k, told by the file's magic): a ``runtime.perplexity.KldStats`` (``.summary()``: KLD,
    top-token, Δp statistics; from a top-k base the KLD is over its top-k tokens and the rest, a
    lower bound of the full one, and ``"kld_top_k"`` says K).  ``cache_type``, ``float_products``:
    see :func:`perplexity`."""
    from .runtime import perplexity as ppl
    from .runtime.session import open_session, parse_overrides

    with open_session(Path(model), threads, device=device,
                      cpu_tensors=parse_overrides(_many(override_tensor)), cache_type=cache_type,
                      float_products=float_products) as s:
        base = ppl.read_base(Path(kl_divergence_base))
        if chunks:
            base.chunks = base.chunks[:chunks]
        if on_start is not None:
            on_start(len(base.chunks))
        return ppl.kl_divergence(s.model, base, on_chunk)


@dataclass
class Generation:
    """What ``generate`` made: the prompt as the model read it (``chat``: in its chat template), its
    tokens, the generated text and ``runtime.generate.GenerationStats`` (tokens, speeds)."""
    prompt: str
    prompt_tokens: list[int]
    text: str
    stats: object
    threads: int
    placement: dict | None              # where a device backend computes the matrices (None: numba CPU)


def _placement(session) -> dict | None:
    """Where a device backend computes the matrices (None for the all-CPU numba backend)."""
    summary = getattr(session.model.ops, "placement_summary", None)
    if summary is None:
        return None
    return summary([session.model.w.need(t.name) for t in session.gguf.tensors if t.n_dims >= 2])


def generate(model, prompt: str, *, n_predict: int = 128, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95,
             seed: int | None = None, chat: bool = False, ctx_size: int | None = None, threads: int | None = None,
             device: str = "cpu", override_tensor=(), on_placement=None, on_prompt=None,
             on_piece=None, cache_type="f16", float_products: bool = False) -> Generation:
    """Generate up to ``n_predict`` tokens after ``prompt`` with quantkit's reference runtime
    (llama-cli's sampling options; ``temp=0`` is greedy): a ``Generation``.  Callbacks, for a caller
    that streams: ``on_placement(placement)`` once the model is loaded and the prompt fits,
    ``on_prompt(text)`` when the first token is about to be computed (kernels ready),
    ``on_piece(text)`` as each piece of text becomes printable.  ``cache_type``, ``float_products``:
    see :func:`perplexity`."""
    from .runtime.generate import GenerationStats, Sampler, SamplerOptions, context_size
    from .runtime.generate import generate as generate_tokens
    from .runtime.session import TextStream, open_session, parse_overrides

    sampler = Sampler(SamplerOptions(temp=temp, top_k=top_k, top_p=top_p, seed=seed))     # checks the options
    with open_session(Path(model), threads, device=device,
                      cpu_tensors=parse_overrides(_many(override_tensor)), cache_type=cache_type,
                      float_products=float_products) as s:
        tok = s.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text, add_special=True, parse_special=chat)
        context_size(s.model, ids, n_predict, ctx_size)     # a prompt that does not fit: before it is shown
        placement = _placement(s)
        if on_placement is not None:
            on_placement(placement)
        stats = GenerationStats()
        # checked and warmed up before the prompt is shown (a compile notice gets its own line)
        tokens = generate_tokens(s.model, ids, n_predict, sampler, stop_ids=tok.eog_ids, n_ctx=ctx_size, stats=stats)
        if on_prompt is not None:
            on_prompt(text)
        stream = TextStream(tok)
        pieces = []
        for t in tokens:
            pieces.append(stream.push(t))
            if on_piece is not None and pieces[-1]:
                on_piece(pieces[-1])
        pieces.append(stream.flush())
        if on_piece is not None and pieces[-1]:
            on_piece(pieces[-1])
        return Generation(text, ids, "".join(pieces), stats, s.threads, placement)


@dataclass
class ImatrixResult:
    """What ``collect_imatrix`` wrote: the file, its entries, the chunks of this run, the perplexity
    over them and the experts that got no token (``{entry: [expert, ...]}``, said in ``warnings``)."""
    file: Path
    entries: int
    chunks: int
    n_ctx: int
    ppl: float
    partial: dict
    warnings: list[str]                 # one line per entry with experts that got no token

    def to_json(self) -> dict:
        return {"file": str(self.file), "entries": self.entries, "chunks": self.chunks, "n_ctx": self.n_ctx,
                "ppl": self.ppl, "partial": self.partial}


def collect_imatrix(model, text_file, output="imatrix.gguf", *, ctx_size: int = 512, chunks: int | None = None,
                    process_output: bool = False, in_file=(), chunk: int = 0, output_frequency: int = 10,
                    activations: str = "mainline", threads: int | None = None, device: str = "cpu",
                    override_tensor=(), on_start=None, on_chunk=None, on_save=None,
                    max_text_bytes: int = MAX_TEXT_BYTES, partial_experts: str = "keep",
                    cache_type="f16", float_products: bool = False) -> ImatrixResult:
    """Collect an importance matrix of ``model`` over ``text_file`` as llama-imatrix does and write it
    to ``output`` (.dat: the legacy format, else GGUF): an ``ImatrixResult``.  ``in_file``: imatrix
    files to start from, ``chunk``: chunks of the text to skip (those they hold).
    ``partial_experts``: what is written of entries whose experts got no token, ``keep`` (mainline
    llama-imatrix) or ``ik`` (ik_llama.cpp's: see quantkit.imatrix_tools).  The output is
    saved every ``output_frequency`` chunks; an interrupt (KeyboardInterrupt) carries ``saved`` and
    ``n_chunks``: how many of this run's chunks the output holds.  Callbacks: ``on_start(n_chunks)``,
    ``on_chunk(i, nll of the chunk's tokens)``, ``on_save(chunks saved so far)``.  ``cache_type``,
    ``float_products``: see :func:`perplexity` (with ``activations="mainline"`` the products of the
    types mainline rounds activations for are float32 ones after that rounding anyway)."""
    import math

    from . import signals
    from .imatrix_tools import PARTIAL_POLICIES, RawImatrix
    from .outputs import check_outputs
    from .runtime.activations import MainlineRounding
    from .runtime.collect import ActivationStats, ObservingOps, collect
    from .runtime.session import open_session, parse_overrides

    if activations not in ("mainline", "exact"):
        raise QuantkitError(f"activations: '{activations}' is none of mainline, exact")
    if partial_experts not in PARTIAL_POLICIES:
        raise QuantkitError(f"partial_experts: '{partial_experts}' is none of {', '.join(PARTIAL_POLICIES)}")
    model, text_file, output = Path(model), Path(text_file), Path(output)
    in_files = [Path(p) for p in _many(in_file)]
    check_outputs([output], [model, text_file, *in_files], what="-o")
    datasets = []
    stats = ActivationStats(process_output=process_output)
    if in_files:
        raw = _read_imatrices(in_files, ctx_size)
        stats, datasets = ActivationStats.from_raw(raw, process_output), raw.datasets
    datasets.append(str(text_file))
    text = read_text_file(text_file, max_text_bytes)        # before the model loads: a bad -f fails fast

    def observing(gguf, ops):
        ops = MainlineRounding(ops) if activations == "mainline" else ops
        return ObservingOps(ops, stats, {t.name: tuple(t.shape) for t in gguf.tensors})
    with open_session(model, threads, wrap_ops=observing, device=device,
                      cpu_tensors=parse_overrides(_many(override_tensor)), cache_type=cache_type,
                      float_products=float_products) as s:
        chunk_list = s.chunks(text, ctx_size, chunks, skip=chunk)
        if on_start is not None:
            on_start(len(chunk_list))
        saved = 0                                       # chunks of this run that output holds

        def on_collected(i, v):
            nonlocal saved
            if on_chunk is not None:
                on_chunk(i, v)
            if (i + 1) % output_frequency == 0 and i + 1 < len(chunk_list):
                with signals.deferred():        # an interrupt comes after both: the count is the file's
                    RawImatrix.from_stats(stats, ctx_size, datasets).save(output, partial_experts)  # atomic: renamed
                    saved = i + 1
                if on_save is not None:
                    on_save(saved)
        try:
            nll = collect(s.model, chunk_list, on_collected, all_logits=process_output)
        except KeyboardInterrupt as e:      # Ctrl-C, SIGTERM, SIGHUP: what the output holds
            e.saved, e.n_chunks = saved, len(chunk_list)
            raise
    if not stats.entries:
        raise QuantkitError(f"{model}: no matrix product was observed (no blk.* weights?)")
    raw = RawImatrix.from_stats(stats, ctx_size, datasets)
    missing = raw.never_fired()
    skipped = raw.skipped(partial_experts)
    warnings = [_partial_warning(name, experts, raw.counts[name].size, name in skipped)
                for name, experts in missing.items()]
    if skipped:
        warnings.append(f"stored {len(raw.sums) - len(skipped)} of {len(raw.sums)} entries: the others have too "
                        "many experts without data for ik_llama.cpp's llama-imatrix (--partial-experts ik)")
    raw.save(output, partial_experts)
    return ImatrixResult(output, len(raw.sums) - len(skipped), len(chunk_list), ctx_size,
                         math.exp(sum(nll) / len(nll)), missing, warnings)


def _partial_warning(name: str, experts: list[int], n_expert: int, skipped: bool) -> str:
    """One entry's line about its experts that got no token, and what the file keeps of it."""
    listed = f"{', '.join(map(str, experts[:16]))}{' ...' if len(experts) > 16 else ''}"
    fate = ("not stored: quantize will find no imatrix for it" if skipped else
            "stored: quantize gives them weight 1")
    return f"{name}: {len(experts)} of {n_expert} experts got no token (partial data): {listed}; {fate}"


# --------------------------------------------------------------------------- imatrix files
def _read_imatrices(paths, chunk_size: int):
    """The files' raw sums and counts, merged (``imatrix_tools.RawImatrix``)."""
    from .imatrix_tools import RawImatrix
    if not paths:
        raise QuantkitError("no imatrix file given")
    raw = RawImatrix.from_file(paths[0], chunk_size)
    for p in paths[1:]:
        raw = raw.merged(RawImatrix.from_file(p, chunk_size))
    return raw


@dataclass
class ImatrixFile:
    """What ``convert_imatrix`` / ``merge_imatrix`` wrote: the file, its entries, its chunks of
    ``chunk_size`` tokens and how many files it was made from."""
    file: Path
    entries: int
    chunks: int
    chunk_size: int
    inputs: int

    def to_json(self) -> dict:
        return {"file": str(self.file), "entries": self.entries, "chunks": self.chunks,
                "chunk_size": self.chunk_size, "inputs": self.inputs}


def merge_imatrix(in_files, output, *, chunk_size: int = 512, partial_experts: str = "keep") -> ImatrixFile:
    """Merge imatrix files into ``output`` (.dat: the legacy format, else GGUF): sums and token
    counts added, so each file weighs what it saw.  ``chunk_size``: tokens per chunk of the run that
    made a legacy .dat input (it does not store it; GGUF inputs do).  ``partial_experts``: as
    ``collect_imatrix``'s."""
    from .outputs import check_outputs
    in_files, output = [Path(p) for p in _many(in_files)], Path(output)
    check_outputs([output], in_files, what="-o")
    raw = _read_imatrices(in_files, chunk_size)
    raw.save(output, partial_experts)
    return ImatrixFile(output, len(raw.sums) - len(raw.skipped(partial_experts)), raw.chunk_count, raw.chunk_size,
                       len(in_files))


def convert_imatrix(in_file, output, *, chunk_size: int = 512, partial_experts: str = "keep") -> ImatrixFile:
    """Rewrite an imatrix in the format ``output``'s extension names (.dat legacy, else GGUF);
    ``partial_experts``: as ``collect_imatrix``'s."""
    from .outputs import check_outputs
    in_file, output = Path(in_file), Path(output)
    check_outputs([output], [in_file])
    raw = _read_imatrices([in_file], chunk_size)
    raw.save(output, partial_experts)
    return ImatrixFile(output, len(raw.sums) - len(raw.skipped(partial_experts)), raw.chunk_count, raw.chunk_size, 1)


@dataclass
class ImatrixStats:
    """An imatrix file looked inside (``imatrix stats``): per entry a row of statistics
    (``RawImatrix.stats``) and the experts that got no token (``{entry: [expert, ...]}``)."""
    file: Path
    chunk_size: int
    chunks: int
    datasets: list[str]
    entries: list[dict]
    experts_without_data: dict[str, list[int]]

    def to_json(self) -> dict:
        return {"file": str(self.file), "chunk_size": self.chunk_size, "chunks": self.chunks,
                "datasets": self.datasets, "entries": self.entries, "experts_without_data": self.experts_without_data}


def imatrix_stats(path, *, chunk_size: int = 512, top: int = 5) -> ImatrixStats:
    """Per entry of an imatrix: values, experts without data, and the importance of its columns
    (sum, mean, σ, entropy, …, and the ``top`` most important columns)."""
    if top < 1:
        raise QuantkitError(f"top: {top} columns: give 1 or more")
    path = Path(path)
    raw = _read_imatrices([path], chunk_size)
    return ImatrixStats(path, raw.chunk_size, raw.chunk_count, raw.datasets, raw.stats(top), raw.never_fired())


# --------------------------------------------------------------------------- recipe
def make_recipe(model_in, output=None, *, tensor_type_file_out=None, budget, gpu_budget=None, override_tensor=(),
                imatrix=None, calibration=None, types=None, bandwidth=None, min_speed=None, measure=None,
                cache_dir=None, workers=None, ray_address=None, flavor: str = "ik", layer_span: int = 1,
                calib_ctx: int = 512, calib_chunks: int = 4, on_progress=None, time_limit: float = 30.0):
    """Search the mix of types that fits ``budget`` with the least predicted KLD
    (``recipe_search.search_recipe``: the options are its own) and write the recipe to ``output``
    (a ``--custom-q`` file) and, given, mainline's ``--tensor-type-file`` form to
    ``tensor_type_file_out`` (None: nothing written).  Every output is checked against the inputs
    before the search and written whole or not at all.  A ``recipe_search.RecipeResult``."""
    from .outputs import AtomicOutput, check_outputs
    from .recipe_search import search_recipe

    outputs = [Path(p) for p in (output, tensor_type_file_out) if p is not None]
    if outputs:
        check_outputs(outputs, [model_in, imatrix, calibration], what="-o")
    result = search_recipe(model_in, budget=budget, gpu_budget=gpu_budget, override_tensor=_many(override_tensor),
                           imatrix=imatrix, calibration=calibration, types=types, bandwidth=bandwidth,
                           min_speed=min_speed, measure=measure, cache_dir=cache_dir, workers=workers,
                           ray_address=ray_address, flavor=flavor, layer_span=layer_span, calib_ctx=calib_ctx,
                           calib_chunks=calib_chunks, on_progress=on_progress, time_limit=time_limit)
    if outputs:
        with AtomicOutput() as out:         # both files or neither
            if output is not None:
                out.open(output, "-o").write(result.recipe_text.encode())
            if tensor_type_file_out is not None:
                out.open(tensor_type_file_out, "--tensor-type-file-out").write(result.tensor_type_file_text.encode())
    return result


# --------------------------------------------------------------------------- warmup
@dataclass
class KernelWarmup:
    """What ``warm_kernels`` made ready: its steps (``warmup.Warmed``: what, kernels compiled,
    seconds, numba's cache), their totals and where numba's cache is (None: no step said)."""
    steps: list
    compiles: int
    seconds: float
    cache: str | None

    @classmethod
    def of(cls, steps: list) -> "KernelWarmup":
        return cls(steps, sum(w.compiles for w in steps), sum(w.seconds for w in steps),
                   next((w.cache for w in steps if w.cache), None))

    def to_json(self) -> dict:
        return {"steps": [w.to_json() for w in self.steps], "seconds": self.seconds, "cache": self.cache}


def warm_kernels(types=None, *, runtime: bool = False, flavor: str = "ik", on_step=None) -> KernelWarmup:
    """Compile the numba kernels that quantize ``types`` (ggml types or presets, comma-separated or
    a sequence; None: every type quantkit quantizes), and with ``runtime`` those the runtime
    computes them with, into numba's cache (``quantkit warmup``).  ``on_step(warmup.Warmed)`` after
    each step."""
    from .warmup import warm
    if flavor not in ("ik", "mainline"):
        raise QuantkitError(f"flavor: '{flavor}' is none of ik, mainline")
    return KernelWarmup.of(warm(list(_many(types)), runtime=runtime, flavor=flavor, on_step=on_step))
