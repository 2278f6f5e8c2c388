"""The runtime's model configuration: GGUF metadata read, and validated before any kernel runs.

The numba kernels do no bounds checks.  A rope dimension count larger than the head, a key/value
head count that does not divide the query heads, or a matrix with fewer rows than the
configuration implies makes them read or write outside their arrays: a crash, or wrong numbers
with exit status 0.  So every hyperparameter the runtime reads is checked here for its type and
range and against the other keys, and every tensor the forward pass uses must have the shape the
configuration implies; a file that fails is refused with a QuantkitError that names the key or the
tensor.  :meth:`ModelConfig.from_gguf` is the only way a :class:`~quantkit.runtime.model.Model`
gets its configuration, so ``run``, ``perplexity``, ``imatrix`` and every ops backend go through it.

Architectures: ``llama`` (SmolLM2, Llama 2/3, Mistral and friends), ``deepseek2``
(DeepSeek-V2/V3/R1: multi-head latent attention and routed experts, see ``deepseek2.py``) and the
grouped-query-attention families ``qwen3``, ``qwen3moe`` and ``glm4moe`` (llama's attention with
NEOX rope, per-head q/k norms, GLM's partial rope and attention biases; routed experts).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..errors import QuantkitError
from ..gguf_io.constants import MetaValue, ValueType

SUPPORTED = ("llama", "deepseek2", "gpt-oss", "qwen3", "qwen3moe", "glm4moe")
# llama's attention with NEOX rope and per-head q/k norms (required: qwen3*, optional: glm4moe)
GQA_NEOX = ("qwen3", "qwen3moe", "glm4moe")
QK_NORM_REQUIRED = ("qwen3", "qwen3moe")
GATING = {1: "softmax", 2: "sigmoid"}          # deepseek2.expert_gating_func

V = ValueType
_INT_TYPES = {V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64}
_NUMBER_TYPES = _INT_TYPES | {V.FLOAT32, V.FLOAT64}
_REQUIRED = object()
# rope scaling factors outside this range are no context extension but a broken file (a factor
# near 0 makes 1 / factor overflow)
FACTOR_RANGE = (1e-3, 1e6)


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int            # 0: queries straight from attn_q (V2-Lite)
    kv_lora_rank: int           # compressed kv per position (what the cache keeps, with k_rope)
    qk_nope: int                # per-head query/key dims without rope
    qk_rope: int                # roped dims, the key's shared by all heads (n_rot)
    v_head_dim: int
    kq_scale: float             # softmax scale: mscale^2 / sqrt(qk_nope + qk_rope)
    # ggml_rope_ext arguments (YaRN)
    freq_scale: float
    ext_factor: float
    rope_mscale: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int


@dataclass(frozen=True)
class MoEConfig:
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int           # the first layers have a plain FFN
    gating: str                 # "softmax" or "sigmoid"
    weights_norm: bool
    weights_scale: float
    n_group: int                # group-limited routing: experts of the n_group_used best groups only
    n_group_used: int


@dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss's attention (runtime/gptoss.py): even layers see a sliding window of keys, odd ones
    all (llama.cpp hard-codes the pattern), every layer has per-head sinks; rope is NEOX with
    ggml_rope_ext's YaRN arguments."""
    window: int                 # a query at p sees keys p - window < j <= p on sliding layers
    ext_factor: float           # 1 for YaRN, else 0
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int

    @staticmethod
    def sliding(layer: int) -> bool:
        return layer % 2 == 0


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): per layer, n_head indexer query
    heads of head_dim (the first qk_rope roped) score every key; a query attends only to the top_k
    best of the keys it sees once it sees more than top_k."""
    n_head: int
    head_dim: int
    top_k: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int               # per head, keys and values alike
    n_rot: int                  # leading dims of each head that get the rotary embedding
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_scale: float           # positions are multiplied by this (1 / linear scaling factor)
    mla: MLAConfig | None = None    # latent attention (deepseek2) instead of per-head keys and values
    moe: MoEConfig | None = None    # routed experts after moe.n_dense_lead plain-FFN layers
    gptoss: GptOssConfig | None = None  # sinks, sliding window, YaRN (gpt-oss)
    dsa: DSAConfig | None = None    # the DSA indexer (DeepSeek-V3.2) selecting the keys of the MLA attention
    rope_neox: bool = False     # NEOX rope (pairs i, i + n_rot/2) instead of adjacent pairs
    n_nextn: int = 0            # multi-token-prediction layers after the n_layer blocks (not run)
    ffn_norm: str = "ffn_norm"  # the name of the norm before the FFN (glm4moe: post_attention_norm)

    @classmethod
    def from_gguf(cls, model) -> "ModelConfig":
        """The configuration of ``model`` (a GGUFModel), every key and tensor shape validated."""
        arch = model.architecture
        if not isinstance(arch, str) or arch not in SUPPORTED:
            raise QuantkitError(f"{model.path}: architecture {_show_value(arch)} is not supported by the runtime "
                                f"(supported: {', '.join(SUPPORTED)})")
        keys = Keys(model, arch)
        config = (_read_deepseek2(keys) if arch == "deepseek2" else _read_gptoss(keys) if arch == "gpt-oss"
                  else _read_gqa(keys) if arch in GQA_NEOX
                  else _read_llama(keys))
        _Tensors(model, keys, config).check()
        return config


# ---- typed metadata reads ----

def _show_value(v) -> str:
    """A metadata value for an error message: escaped, and short."""
    if isinstance(v, MetaValue):
        if v.vtype == V.ARRAY:
            return f"an array of {len(v.value)} {v.elem_type.name.lower()}"
        v = v.value
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


class Keys:
    """Typed, range-checked reads of the ``<arch>.<name>`` metadata keys of one model."""

    def __init__(self, model, arch: str):
        self.model, self.arch = model, arch

    def name(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self.name(key) in self.model.metadata

    def fail(self, key: str, value, why: str) -> QuantkitError:
        """The error for key ``key`` (without the architecture prefix) holding ``value``."""
        return QuantkitError(f"{self.model.path}: metadata key {self.name(key)} = {_show_value(value)}: {why}")

    def _get(self, key: str, default):
        mv = self.model.metadata.get(self.name(key))
        if mv is None and default is _REQUIRED:
            raise QuantkitError(f"{self.model.path}: metadata key {self.name(key)} is missing")
        return mv

    def int(self, key: str, default=_REQUIRED, lo: int | None = None, hi: int | None = None,
            hi_why: str = "", per_layer: bool = False) -> int:
        """An integer key in [lo, hi]; ``per_layer``: also an array of one value per layer, all equal."""
        mv = self._get(key, default)
        if mv is None:
            return default
        v = mv.value
        if mv.vtype == V.ARRAY and per_layer and mv.elem_type in _INT_TYPES and len(v):
            values = {int(x) for x in v}
            if len(values) != 1:
                raise self.fail(key, mv, "per-layer values that differ are not supported by the runtime")
            v = values.pop()
        elif mv.vtype not in _INT_TYPES:
            raise self.fail(key, mv, f"must be an integer (it is {mv.vtype.name.lower()})")
        v = int(v)
        if lo is not None and v < lo:
            raise self.fail(key, v, f"must be at least {lo}")
        if hi is not None and v > hi:
            raise self.fail(key, v, f"must be at most {hi}{hi_why}")
        return v

    def float(self, key: str, default=_REQUIRED, above: float | None = None, at_least: float | None = None,
              below: float | None = None) -> float:
        """A finite number key, > ``above`` / >= ``at_least`` / < ``below`` where given."""
        mv = self._get(key, default)
        if mv is None:
            return default
        if mv.vtype not in _NUMBER_TYPES:
            raise self.fail(key, mv, f"must be a number (it is {mv.vtype.name.lower()})")
        v = float(mv.value)
        if not math.isfinite(v):
            raise self.fail(key, v, "must be a finite number")
        if above is not None and not v > above:
            raise self.fail(key, v, f"must be greater than {above:g}")
        if at_least is not None and v < at_least:
            raise self.fail(key, v, f"must be at least {at_least:g}")
        if below is not None and not v < below:
            raise self.fail(key, v, f"must be less than {below:g}")
        return v

    def str(self, key: str, default=_REQUIRED, choices: tuple[str, ...] = ()) -> str:
        mv = self._get(key, default)
        if mv is None:
            return default
        if mv.vtype != V.STRING:
            raise self.fail(key, mv, f"must be a string (it is {mv.vtype.name.lower()})")
        if choices and mv.value not in choices:
            raise self.fail(key, mv, f"is not supported for {self.arch} (supported: {', '.join(choices)})")
        return mv.value

    def bool(self, key: str, default=_REQUIRED) -> bool:
        mv = self._get(key, default)
        if mv is None:
            return default
        if mv.vtype != V.BOOL:
            raise self.fail(key, mv, f"must be a bool (it is {mv.vtype.name.lower()})")
        return bool(mv.value)

    def factor(self, key: str) -> float:
        """A rope scaling factor: 0 (or missing) for none, else within FACTOR_RANGE."""
        f = self.float(key, 0.0, at_least=0.0)
        if f and not FACTOR_RANGE[0] <= f <= FACTOR_RANGE[1]:
            raise self.fail(key, f, f"must be 0 (no scaling) or between {FACTOR_RANGE[0]:g} and {FACTOR_RANGE[1]:g}")
        return f


# ---- the keys of each architecture ----

def _heads(k: Keys) -> tuple[int, int, int]:
    """n_layer, n_embd, n_head."""
    return (k.int("block_count", lo=1), k.int("embedding_length", lo=1),
            k.int("attention.head_count", lo=1, per_layer=True))


def _n_vocab(k: Keys) -> int:
    """The vocabulary size: token_embd's rows, which ``vocab_size`` and the token list (where the
    file has them) must match, as llama.cpp requires."""
    model = k.model
    emb = model.by_name.get("token_embd.weight")
    if emb is None:
        raise QuantkitError(f"{model.path}: tensor 'token_embd.weight' is missing")
    if len(emb.shape) != 2 or emb.shape[1] < 1:
        raise QuantkitError(f"{model.path}: tensor 'token_embd.weight' has shape {list(emb.shape)}, "
                            "expected [n_embd, n_vocab]")
    n_vocab = emb.shape[1]
    vocab_size = k.int("vocab_size", None, lo=1)
    if vocab_size is not None and vocab_size != n_vocab:
        raise k.fail("vocab_size", vocab_size, f"the token embedding token_embd.weight has {n_vocab} rows")
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if tokens.vtype != V.ARRAY or tokens.elem_type != V.STRING:
            raise QuantkitError(f"{model.path}: metadata key tokenizer.ggml.tokens = {_show_value(tokens)}: "
                                "must be an array of strings")
        if len(tokens.value) != n_vocab:
            raise QuantkitError(f"{model.path}: metadata key tokenizer.ggml.tokens holds {len(tokens.value)} "
                                f"tokens, but the token embedding token_embd.weight has {n_vocab} rows")
    return n_vocab


def _rope_dims(k: Keys, hi: int, hi_why: str, default=_REQUIRED) -> int:
    n_rot = k.int("rope.dimension_count", default, lo=2, hi=hi, hi_why=hi_why)
    if n_rot % 2:
        raise k.fail("rope.dimension_count", n_rot, "must be even (the rotary embedding turns pairs of dims)")
    return n_rot


def _gqa_heads(k: Keys, min_head_dim: int = 1) -> tuple[int, int, int, int, int]:
    """n_layer, n_embd, n_head, n_head_kv and the head size of grouped-query attention, whose keys
    and values have the same size."""
    n_layer, n_embd, n_head = _heads(k)
    n_head_kv = k.int("attention.head_count_kv", n_head, lo=1, per_layer=True)
    if n_head % n_head_kv:
        raise k.fail("attention.head_count_kv", n_head_kv, f"must divide {k.name('attention.head_count')} = {n_head}")
    if k.has("attention.key_length"):
        head_dim = k.int("attention.key_length", lo=min_head_dim)
    elif n_embd % n_head:
        raise k.fail("attention.head_count", n_head, f"does not divide {k.name('embedding_length')} = {n_embd} "
                                                     f"(and there is no {k.name('attention.key_length')})")
    else:
        head_dim = n_embd // n_head
    v_len = k.int("attention.value_length", head_dim, lo=1)
    if v_len != head_dim:
        raise k.fail("attention.value_length", v_len, f"differs from the key length {head_dim}: not supported for {k.arch}")
    return n_layer, n_embd, n_head, n_head_kv, head_dim


def _read_llama(k: Keys) -> ModelConfig:
    n_layer, n_embd, n_head, n_head_kv, head_dim = _gqa_heads(k)
    n_rot = _rope_dims(k, head_dim, f" (the head size, {head_dim})", head_dim)
    scaling = k.str("rope.scaling.type", "none", choices=("none", "linear"))
    factor = k.factor("rope.scaling.factor")
    return ModelConfig(
        arch=k.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_rot=n_rot, n_vocab=_n_vocab(k), n_ctx_train=k.int("context_length", lo=1),
        rms_eps=k.float("attention.layer_norm_rms_epsilon", above=0.0, below=1.0),
        rope_base=k.float("rope.freq_base", 10000.0, above=0.0),
        rope_scale=1.0 / factor if scaling == "linear" and factor else 1.0)


def _read_deepseek2(k: Keys) -> ModelConfig:
    """MLA and MoE parameters as ik_llama.cpp reads them (llm_load_hparams, LLM_ARCH_DEEPSEEK2)."""
    n_layer, n_embd, n_head = _heads(k)
    # per-head K/V (the fused attn_kv_b layout) or one latent KV head (mainline's MLA layout)
    n_head_kv = k.int("attention.head_count_kv", n_head, lo=1, per_layer=True)
    if n_head_kv not in (1, n_head):
        raise k.fail("attention.head_count_kv", n_head_kv,
                     f"must be 1 or {k.name('attention.head_count')} = {n_head} for deepseek2")
    kv_lora = k.int("attention.kv_lora_rank", lo=1)
    q_lora = k.int("attention.q_lora_rank", 0, lo=0)
    if k.has("attention.key_length_mla"):
        # mainline's MLA layout: key_length/value_length describe the latent cache (kv_lora + rope
        # dims / kv_lora), the *_mla keys the per-head sizes
        qk_key, v_key = "attention.key_length_mla", "attention.value_length_mla"
    else:
        qk_key, v_key = "attention.key_length", "attention.value_length"
    qk_head, v_head = k.int(qk_key, lo=3), k.int(v_key, lo=1)
    # at least one dim of each head is not roped
    n_rot = _rope_dims(k, qk_head - 1, f" (less than the head size {k.name(qk_key)} = {qk_head})")
    if qk_key.endswith("_mla"):
        for key, want in (("attention.key_length", kv_lora + n_rot), ("attention.value_length", kv_lora)):
            got = k.int(key, want)
            if got != want:
                raise k.fail(key, got, f"a file with {k.name('attention.key_length_mla')} describes the latent "
                                       f"cache here: {want} ({k.name('attention.kv_lora_rank')}"
                                       f"{' + rope dims' if key.endswith('key_length') else ''})")
    rope_base = k.float("rope.freq_base", 10000.0, above=0.0)

    # rope scaling as ik_llama.cpp reads it: a missing type means linear, a missing factor 1
    scaling = k.str("rope.scaling.type", "linear", choices=("none", "linear", "yarn"))
    factor = k.factor("rope.scaling.factor")
    if factor and scaling != "none" and factor < 1:
        raise k.fail("rope.scaling.factor", factor, "must be at least 1 for deepseek2 (a context extension)")
    freq_scale = 1.0 / factor if factor and scaling != "none" else 1.0
    attn_factor = k.float("rope.scaling.attn_factor", 1.0, above=0.0)
    n_ctx_train = k.int("context_length", lo=1)
    n_ctx_orig = k.int("rope.scaling.original_context_length", n_ctx_train, lo=1)
    if scaling == "yarn" and rope_base == 1.0:
        raise k.fail("rope.freq_base", rope_base, "YaRN needs a base other than 1 (it divides by its log)")
    # DeepSeek's YaRN: the softmax scale carries mscale^2 with mscale = 0.1 * mscale_all_dim * ln(s) + 1
    # (yarn_log_multiplier = 0.1 * mscale_all_dim) instead of scaling q and k; so llm_build_deepseek2
    # gives the rope a magnitude 1 / (1 + 0.1 ln s) that cancels YaRN's own (ggml_rope_ext multiplies
    # by 1 + 0.1 ln s when ext_factor != 0; with linear scaling nothing cancels it, as in ik_llama.cpp)
    mscale = attn_factor * (1.0 + k.float("rope.scaling.yarn_log_multiplier", 0.0) * math.log(1.0 / freq_scale))
    mla = MLAConfig(
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope=qk_head - n_rot, qk_rope=n_rot, v_head_dim=v_head,
        kq_scale=mscale * mscale / math.sqrt(qk_head),
        freq_scale=freq_scale, ext_factor=1.0 if scaling == "yarn" else 0.0,
        rope_mscale=1.0 / (1.0 + 0.1 * math.log(1.0 / freq_scale)),
        # ik_llama.cpp does not read yarn_beta_fast/slow for deepseek2: ggml's defaults, which are
        # also DeepSeek's published values
        beta_fast=32.0, beta_slow=1.0, n_ctx_orig=n_ctx_orig)
    if not math.isfinite(mla.kq_scale):
        raise k.fail("rope.scaling.yarn_log_multiplier", k.model.get(k.name("rope.scaling.yarn_log_multiplier")),
                     "makes the attention scale overflow")

    # files without it are DeepSeek-V2 (softmax), except that ik_llama.cpp takes 47/48-layer ones
    # for GLM-4.7-Flash (sigmoid)
    gating = k.int("expert_gating_func", 2 if n_layer in (47, 48) else 1)
    if gating not in GATING:
        raise k.fail("expert_gating_func", gating, "is not supported for deepseek2 (1: softmax, 2: sigmoid)")
    n_expert = k.int("expert_count", lo=1)
    n_group, n_group_used, n_used = _expert_groups(k, n_expert)
    moe = MoEConfig(
        n_expert=n_expert, n_expert_used=n_used,
        n_expert_shared=k.int("expert_shared_count", 0, lo=0),
        n_dense_lead=k.int("leading_dense_block_count", 0, lo=0, hi=n_layer, hi_why=f" ({k.name('block_count')})"),
        gating=GATING[gating], weights_norm=k.bool("expert_weights_norm", False),
        weights_scale=k.float("expert_weights_scale", 1.0, above=0.0),
        n_group=n_group, n_group_used=n_group_used)
    return ModelConfig(
        arch=k.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        # per query head; keys and values exist per head only inside the latent attention
        n_head_kv=n_head, head_dim=qk_head, n_rot=n_rot, n_vocab=_n_vocab(k), n_ctx_train=n_ctx_train,
        rms_eps=k.float("attention.layer_norm_rms_epsilon", above=0.0, below=1.0), rope_base=rope_base,
        rope_scale=freq_scale, mla=mla, moe=moe, dsa=_read_dsa(k, mla))


INDEXER_KEYS = ("attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k")


def _read_dsa(k: Keys, mla: MLAConfig) -> DSAConfig | None:
    """The indexer keys (all three or none): V3.2's indexer projects the query LoRA, and ropes
    the first qk_rope dims of its heads."""
    present = [key for key in INDEXER_KEYS if k.has(key)]
    if not present:
        return None
    if len(present) < len(INDEXER_KEYS):
        missing = next(key for key in INDEXER_KEYS if key not in present)
        raise QuantkitError(f"{k.model.path}: {k.name(present[0])} is set but {k.name(missing)} is missing "
                            "(the DSA indexer needs all three)")
    if not mla.q_lora_rank:
        raise k.fail("attention.indexer.head_count", k.int(INDEXER_KEYS[0]),
                     f"the indexer reads the query LoRA, but {k.name('attention.q_lora_rank')} is 0")
    return DSAConfig(n_head=k.int(INDEXER_KEYS[0], lo=1, hi=1 << 16),
                     # at least the roped dims (rope.dimension_count), which lead each head
                     head_dim=k.int(INDEXER_KEYS[1], lo=mla.qk_rope, hi=1 << 16),
                     top_k=k.int(INDEXER_KEYS[2], lo=1))


def _read_gptoss(k: Keys) -> ModelConfig:
    """gpt-oss as llama.cpp reads it (LLM_ARCH_OPENAI_MOE): grouped-query attention with sinks,
    every other layer windowed, NEOX rope with YaRN, biased experts chosen by softmax over the top-k
    router logits."""
    n_layer, n_embd, n_head, n_head_kv, head_dim = _gqa_heads(k, min_head_dim=2)
    # llama.cpp's gpt-oss scales the scores by 1 / sqrt(n_rot) and sizes attn_output by n_rot: the
    # whole head is roped
    n_rot = _rope_dims(k, head_dim, f" (the head size, {head_dim})", head_dim)
    if n_rot != head_dim:
        raise k.fail("rope.dimension_count", n_rot, f"must be the head size {head_dim} for gpt-oss")
    scaling = k.str("rope.scaling.type", "none", choices=("none", "linear", "yarn"))
    factor = k.factor("rope.scaling.factor")
    freq_scale = 1.0 / factor if factor and scaling != "none" else 1.0
    rope_base = k.float("rope.freq_base", 10000.0, above=0.0)
    if scaling == "yarn" and rope_base == 1.0:
        raise k.fail("rope.freq_base", rope_base, "YaRN needs a base other than 1 (it divides by its log)")
    n_ctx_train = k.int("context_length", lo=1)
    n_expert = k.int("expert_count", lo=1)
    moe = MoEConfig(n_expert=n_expert,
                    n_expert_used=k.int("expert_used_count", lo=1, hi=n_expert, hi_why=f" ({k.name('expert_count')})"),
                    n_expert_shared=0, n_dense_lead=0, gating="softmax_weight", weights_norm=False, weights_scale=1.0,
                    n_group=1, n_group_used=0)
    gptoss = GptOssConfig(
        window=k.int("attention.sliding_window", lo=1), ext_factor=1.0 if scaling == "yarn" else 0.0,
        beta_fast=k.float("rope.scaling.yarn_beta_fast", 32.0, above=0.0),
        beta_slow=k.float("rope.scaling.yarn_beta_slow", 1.0, above=0.0),
        n_ctx_orig=k.int("rope.scaling.original_context_length", n_ctx_train, lo=1))
    return ModelConfig(
        arch=k.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_rot=n_rot, n_vocab=_n_vocab(k), n_ctx_train=n_ctx_train,
        rms_eps=k.float("attention.layer_norm_rms_epsilon", above=0.0, below=1.0), rope_base=rope_base,
        rope_scale=freq_scale, moe=moe, gptoss=gptoss)


def _expert_groups(k: Keys, n_expert: int) -> tuple[int, int, int]:
    """expert_group_count, expert_group_used_count and expert_used_count, checked together."""
    n_group = k.int("expert_group_count", 1, lo=0) or 1
    if n_expert % n_group:
        raise k.fail("expert_group_count", n_group, f"does not divide {k.name('expert_count')} = {n_expert}")
    n_group_used = k.int("expert_group_used_count", 0, lo=0, hi=n_group,
                         hi_why=f" ({k.name('expert_group_count')})")
    # with group-limited routing only the experts of n_group_used groups can be chosen
    can_choose = n_group_used * (n_expert // n_group) if 0 < n_group_used < n_group else n_expert
    n_used = k.int("expert_used_count", lo=1, hi=can_choose,
                   hi_why=f" (the experts {k.name('expert_count')} and the expert groups offer)")
    return n_group, n_group_used, n_used


def _read_gqa(k: Keys) -> ModelConfig:
    """qwen3, qwen3moe, glm4moe: llama's keys, NEOX rope, and the routed experts as ik_llama.cpp
    reads them (llm_load_hparams; its graphs build_qwen3moe and build_glm4_moe)."""
    base = _read_llama(k)
    n_nextn = 0
    moe = None
    if k.arch == "glm4moe":
        # the nextn (MTP) layers ik's converter keeps after the blocks: loaded, never run
        n_nextn = k.int("nextn_predict_layers", 0, lo=0, hi=base.n_layer - 1,
                        hi_why=f" (less than {k.name('block_count')})")
        n_layer = base.n_layer - n_nextn
        n_expert = k.int("expert_count", lo=1)
        n_group, n_group_used, n_used = _expert_groups(k, n_expert)
        gating = k.int("expert_gating_func", 0) or 2            # ik: 0 (none) means sigmoid for glm4moe
        if gating not in GATING:
            raise k.fail("expert_gating_func", gating, "is not supported for glm4moe (1: softmax, 2: sigmoid)")
        moe = MoEConfig(
            n_expert=n_expert, n_expert_used=n_used, n_expert_shared=k.int("expert_shared_count", lo=0),
            n_dense_lead=k.int("leading_dense_block_count", 0, lo=0, hi=n_layer, hi_why=f" (the {n_layer} blocks)"),
            gating=GATING[gating], weights_norm=k.bool("expert_weights_norm", False),
            weights_scale=k.float("expert_weights_scale", above=0.0), n_group=n_group, n_group_used=n_group_used)
    elif k.arch == "qwen3moe":
        n_expert = k.int("expert_count", lo=1)
        # ik's qwen3moe graph always normalises the chosen weights; the key is quantkit's converter's
        # note for a checkpoint with norm_topk_prob false
        moe = MoEConfig(
            n_expert=n_expert, n_expert_used=k.int("expert_used_count", lo=1, hi=n_expert,
                                                   hi_why=f" ({k.name('expert_count')})"),
            n_expert_shared=0, n_dense_lead=0, gating="softmax", weights_norm=k.bool("expert_weights_norm", True),
            weights_scale=1.0, n_group=1, n_group_used=0)
    return dataclasses.replace(base, n_layer=base.n_layer - n_nextn, moe=moe, rope_neox=True, n_nextn=n_nextn,
                               ffn_norm="post_attention_norm" if k.arch == "glm4moe" else "ffn_norm")


# ---- tensor shapes ----

def _dims(shape) -> tuple[int, ...]:
    """A ggml shape without trailing 1s (ggml pads every shape to 4 dims with them)."""
    shape = tuple(int(n) for n in shape)
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


_LAYER = re.compile(r"^blk\.(\d+)\.")


class _Tensors:
    """Checks that every tensor the forward pass of ``config`` reads is there with the shape the
    configuration implies (a matrix with the wrong row count would be read past its end)."""

    def __init__(self, model, keys: Keys, config: ModelConfig):
        self.model, self.k, self.c = model, keys, config

    def _fail(self, name: str, shape, expected: str, why: str) -> QuantkitError:
        return QuantkitError(f"{self.model.path}: tensor '{name}' has shape {list(shape)}, expected {expected} "
                             f"({why})")

    def tensor(self, name: str, *shapes: tuple[int, ...], why: str, optional: bool = False):
        """The tensor ``name``, whose shape must be one of ``shapes`` (ggml order)."""
        t = self.model.by_name.get(name)
        if t is None:
            if optional:
                return None
            raise QuantkitError(f"{self.model.path}: tensor '{name}' is missing")
        if _dims(t.shape) not in [_dims(s) for s in shapes]:
            raise self._fail(name, t.shape, " or ".join(str(list(s)) for s in shapes), why)
        return t

    def matrix(self, name: str, n_in: int, n_out: int, why: str, optional: bool = False):
        """A weight ``name``.weight [n_in, n_out], and its bias [n_out] if the file has one."""
        t = self.tensor(name + ".weight", (n_in, n_out), why=why, optional=optional)
        if t is not None:
            self.tensor(name + ".bias", (n_out,), why=f"the bias of {name}.weight [{n_in}, {n_out}]", optional=True)
        return t

    def rows_of(self, name: str, n_in: int, n_dims: int, why: str) -> int:
        """The row count of ``name``, a weight of ``n_dims`` dims with rows of ``n_in`` (the FFN
        sizes are not in the metadata the runtime reads: the gate matrix sets them)."""
        t = self.model.by_name.get(name)
        if t is None:
            raise QuantkitError(f"{self.model.path}: tensor '{name}' is missing")
        shape = _dims(t.shape) + (1,) * (n_dims - len(_dims(t.shape)))
        if len(shape) != n_dims or shape[0] != n_in or shape[1] < 1:
            expected = "[" + ", ".join([str(n_in), "n_ff", *(["n_expert"] if n_dims == 3 else [])]) + "]"
            raise self._fail(name, t.shape, expected, why)
        return shape[1]

    def ffn(self, p: str, n_embd: int, suffix: str = "") -> None:
        """SwiGLU tensors ``p``ffn_{gate,up,down}``suffix``."""
        why = f"n_embd = {self.k.name('embedding_length')} = {n_embd}; n_ff from ffn_gate{suffix}"
        n_ff = self.rows_of(f"{p}ffn_gate{suffix}.weight", n_embd, 2, why)
        self.matrix(f"{p}ffn_gate{suffix}", n_embd, n_ff, why)
        self.matrix(f"{p}ffn_up{suffix}", n_embd, n_ff, why)
        self.matrix(f"{p}ffn_down{suffix}", n_ff, n_embd, why)

    def check(self) -> None:
        c, k = self.c, self.k
        layers = {int(m.group(1)) for t in self.model.tensors if (m := _LAYER.match(t.name))}
        # (counted, not listed: a block_count of 2**64 - 1 is as possible as any other)
        n_blocks = c.n_layer + c.n_nextn
        below = sum(1 for i in layers if i < n_blocks)
        if below != len(layers) or below != n_blocks:
            have = f"layers {min(layers)}..{max(layers)}" if layers else "no layer"
            raise k.fail("block_count", n_blocks, f"the file has tensors of {have}"
                                                  f"{f' ({len(layers)} of them)' if layers and below < n_blocks else ''}")
        e_why = f"n_embd = {k.name('embedding_length')} = {c.n_embd}"
        self.tensor("token_embd.weight", (c.n_embd, c.n_vocab), why=e_why)
        self.matrix("output", c.n_embd, c.n_vocab, why=f"{e_why}, n_vocab = {c.n_vocab}", optional=True)
        self.tensor("output_norm.weight", (c.n_embd,), why=e_why)
        for i in range(c.n_layer):
            p = f"blk.{i}."
            self.tensor(p + "attn_norm.weight", (c.n_embd,), why=e_why)
            self.tensor(p + ("post_attention_norm" if c.gptoss else c.ffn_norm) + ".weight", (c.n_embd,), why=e_why)
            if c.gptoss:
                self.tensor(p + "attn_sinks.weight", (c.n_head,),
                            why=f"one sink per head, {k.name('attention.head_count')} = {c.n_head}")
            if c.mla:
                self.mla_attention(p)
            else:
                self.attention(p)
            routed = c.moe is not None and i >= c.moe.n_dense_lead
            if c.moe is not None and (p + "ffn_gate_inp.weight" in self.model.by_name) != routed:
                # a layer of the other kind: the count of leading dense layers is off
                raise k.fail("leading_dense_block_count", c.moe.n_dense_lead,
                             f"layer {i} is {'a dense' if routed else 'an expert'} layer in the file")
            if routed:
                self.experts(p)
            else:
                self.ffn(p, c.n_embd)

    def attention(self, p: str) -> None:
        c, k = self.c, self.k
        size = (k.name("attention.key_length") if k.has("attention.key_length")
                else f"{k.name('embedding_length')} / {k.name('attention.head_count')}")
        q_why = (f"{k.name('embedding_length')} = {c.n_embd}, {k.name('attention.head_count')} = {c.n_head} "
                 f"heads of {c.head_dim} ({size})")
        kv_why = f"{k.name('attention.head_count_kv')} = {c.n_head_kv} heads of {c.head_dim} ({size})"
        self.matrix(p + "attn_q", c.n_embd, c.n_head * c.head_dim, q_why)
        self.matrix(p + "attn_k", c.n_embd, c.n_head_kv * c.head_dim, kv_why)
        self.matrix(p + "attn_v", c.n_embd, c.n_head_kv * c.head_dim, kv_why)
        self.matrix(p + "attn_output", c.n_head * c.head_dim, c.n_embd, q_why)
        if c.rope_neox:
            # per-head RMSNorm of q and k, one head_dim vector each
            for name in ("attn_q_norm", "attn_k_norm"):
                self.tensor(p + name + ".weight", (c.head_dim,), why=f"one per head dim: {size} = {c.head_dim}",
                            optional=c.arch not in QK_NORM_REQUIRED)

    def mla_attention(self, p: str) -> None:
        c, k, mla = self.c, self.k, self.c.mla
        n_head, lora, nope, rope, v_dim = c.n_head, mla.kv_lora_rank, mla.qk_nope, mla.qk_rope, mla.v_head_dim
        heads = f"{k.name('attention.head_count')} = {n_head} heads of {nope} + {rope} (key_length, rope dims)"
        if mla.q_lora_rank:
            q_why = f"{k.name('attention.q_lora_rank')} = {mla.q_lora_rank}, {heads}"
            self.matrix(p + "attn_q_a", c.n_embd, mla.q_lora_rank, q_why)
            self.tensor(p + "attn_q_a_norm.weight", (mla.q_lora_rank,), why=q_why)
            self.matrix(p + "attn_q_b", mla.q_lora_rank, n_head * (nope + rope), q_why)
        else:
            self.matrix(p + "attn_q", c.n_embd, n_head * (nope + rope), heads)
        lora_why = f"{k.name('attention.kv_lora_rank')} = {lora}, {k.name('rope.dimension_count')} = {rope}"
        self.matrix(p + "attn_kv_a_mqa", c.n_embd, lora + rope, lora_why)
        self.tensor(p + "attn_kv_a_norm.weight", (lora,), why=lora_why)
        per_head = f"{lora_why}, {heads}, value_length {v_dim}"
        if p + "attn_k_b.weight" in self.model.by_name and p + "attn_v_b.weight" in self.model.by_name:
            # per-head matrices, also stored flattened to 2-D (the rows are the same)
            self.tensor(p + "attn_k_b.weight", (nope, lora, n_head), (nope, lora * n_head), why=per_head)
            self.tensor(p + "attn_v_b.weight", (lora, v_dim, n_head), (lora, v_dim * n_head), why=per_head)
        else:
            self.tensor(p + "attn_kv_b.weight", (lora, n_head * (nope + v_dim)), why=per_head)
        self.matrix(p + "attn_output", n_head * v_dim, c.n_embd, per_head)
        if c.dsa:
            self.indexer(p)

    def indexer(self, p: str) -> None:
        c, k, dsa = self.c, self.k, self.c.dsa
        why = (f"{k.name('attention.indexer.head_count')} = {dsa.n_head} heads of "
               f"{k.name('attention.indexer.key_length')} = {dsa.head_dim}, {k.name('attention.q_lora_rank')} = "
               f"{c.mla.q_lora_rank}, n_embd {c.n_embd}")
        self.tensor(p + "indexer.attn_q_b.weight", (c.mla.q_lora_rank, dsa.n_head * dsa.head_dim), why=why)
        self.tensor(p + "indexer.attn_k.weight", (c.n_embd, dsa.head_dim), why=why)
        self.tensor(p + "indexer.k_norm.weight", (dsa.head_dim,), why=why)
        self.tensor(p + "indexer.k_norm.bias", (dsa.head_dim,), why=why)
        self.tensor(p + "indexer.proj.weight", (c.n_embd, dsa.n_head), why=why)

    def experts(self, p: str) -> None:
        c, k, moe = self.c, self.k, self.c.moe
        n_expert = moe.n_expert
        why = f"n_embd = {k.name('embedding_length')} = {c.n_embd}, {k.name('expert_count')} = {n_expert}"
        self.matrix(p + "ffn_gate_inp", c.n_embd, n_expert, why)
        self.tensor(p + "exp_probs_b.bias", (n_expert,), why=why, optional=True)
        if p + "ffn_gate_up_exps.weight" in self.model.by_name:
            # gate and up experts fused in one tensor (ik_llama.cpp's ffn_gate_up_exps): per expert
            # n_ff gate rows, then n_ff up rows
            for name in ("ffn_gate_exps", "ffn_up_exps"):
                if p + name + ".weight" in self.model.by_name:
                    raise QuantkitError(f"{self.model.path}: layer {p[4:-1]} has both '{p}ffn_gate_up_exps.weight' "
                                        f"and '{p}{name}.weight': the gate/up experts twice")
            rows = self.rows_of(p + "ffn_gate_up_exps.weight", c.n_embd, 3, why)
            n_ff, source = rows // 2, "ffn_gate_up_exps: n_ff gate rows, then n_ff up rows per expert"
            shapes = (("ffn_gate_up_exps", (c.n_embd, 2 * n_ff, n_expert)), ("ffn_down_exps", (n_ff, c.n_embd, n_expert)))
        else:
            n_ff, source = self.rows_of(p + "ffn_gate_exps.weight", c.n_embd, 3, why), "ffn_gate_exps"
            shapes = (("ffn_gate_exps", (c.n_embd, n_ff, n_expert)), ("ffn_up_exps", (c.n_embd, n_ff, n_expert)),
                      ("ffn_down_exps", (n_ff, c.n_embd, n_expert)))
        for name, shape in shapes:
            self.tensor(p + name + ".weight", shape, why=f"{why}; n_ff from {source}")
            if c.gptoss:        # per-expert biases (n_out, n_expert)
                self.tensor(p + name + ".bias", shape[1:], why=f"{why}; n_ff from {source}")
        if c.gptoss:
            n_ff_exp = k.int("expert_feed_forward_length", n_ff, lo=1)
            if n_ff_exp != n_ff:
                raise k.fail("expert_feed_forward_length", n_ff_exp, f"the experts {source} have {n_ff} rows")
        if moe.n_expert_shared:
            self.ffn(p, c.n_embd, "_shexp")
        elif p + "ffn_gate_shexp.weight" in self.model.by_name:
            # shared experts the forward pass would leave out
            raise QuantkitError(f"{self.model.path}: tensor '{p}ffn_gate_shexp.weight' is in the file but "
                                f"{k.name('expert_shared_count')} is 0")
