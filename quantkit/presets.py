"""llama-quantize's preset mixes (``Q4_K_M``, ``IQ4_K``, …) and the per-tensor rules behind them.

A preset is what the C tools call an *ftype*: a name on the command line, a ``LLAMA_FTYPE_*`` number
written to ``general.file_type``, a default tensor type, and a set of heuristics
(``llama_tensor_get_type``) that give some tensors more bits (``output.weight``, ``attn_v``, the
first and last ``ffn_down`` layers, …).  The rules below transcribe the C code of both flavors:

* ik: ik_llama.cpp ``src/llama-quantize.cpp`` @ 8337e4c (Aug 2026).  The wheel peer
  (ik-llama-cpp-python 0.1.5, ik @ 55d3c05, Apr 2026) differs only in two places, marked "HEAD only";
  neither applies to the models the tests use.
* mainline: llama.cpp ``src/llama-quant.cpp`` @ 007dbbf (specs/ggml-quants.md §2.3).

The functions here only choose types.  Row-length and row-interleave fallbacks, recipes and the
``--token-embedding-type``/``--output-tensor-type`` overrides are applied by plan.py.

Neither fork's llama_tensor_get_type names qwen3, qwen3moe, glm4moe, gpt-oss or deepseek2 (V3.2, Kimi-K2):
their mixes follow from what the rules read, which ModelInfo gathers from the metadata as llm_load_hparams
does: the expert count, n_gqa (ik: DeepSeek MLA files' one KV head counts as n_head), block_count with
GLM's NextN layer in it, Qwen3's MODEL_8B class; and from name substrings (ik's "attn_k" also takes
attn_k_b, attn_kv_a_mqa and V3.2's indexer.attn_k, "attn_q" attn_q_a/attn_q_b and indexer.attn_q_b,
"ffn_gate" the fused ffn_gate_up_exps).  tests/test_presets_2026.py checks them against the wheel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import QuantkitError
from .mixes import find_mix
from .suggest import did_you_mean
from .types import QuantType, file_types, traits, type_from_name, type_name

T = QuantType
FLAVORS = ("ik", "mainline")


# ---------------------------------------------------------------------------------- the presets
@dataclass(frozen=True)
class Preset:
    name: str                   # as llama-quantize lists it (upper case)
    default_type: QuantType     # llama_ftype_get_default_type
    ftypes: dict                # flavor -> LLAMA_FTYPE_* value; a flavor missing here has no such preset

    def ftype(self, flavor: str) -> int:
        return self.ftypes[flavor]


# name, LLAMA_FTYPE in ik (include/llama.h), in mainline (-: not a preset there), default type.
# Order and names follow ik's QUANT_OPTIONS (examples/quantize/quantize.cpp), then mainline-only ones.
_TABLE = """
Q4_0        2     2     Q4_0
Q4_1        3     3     Q4_1
Q5_0        8     8     Q5_0
Q5_1        9     9     Q5_1
Q6_0        135   -     Q6_0
MXFP4       38    -     MXFP4
IQ2_XXS     19    19    IQ2_XXS
IQ2_XXS_R4  219   -     IQ2_XXS_R4
IQ2_XS      20    20    IQ2_XS
IQ2_XS_R4   220   -     IQ2_XS_R4
IQ2_S       28    28    IQ2_XS      # IQ2_S and IQ2_M are mixes: their default is one size down
IQ2_M       29    29    IQ2_S
IQ2_M_R4    229   -     IQ2_S_R4
IQ1_S       24    24    IQ1_S
IQ1_S_R4    224   -     IQ1_S_R4
IQ1_M_R4    231   -     IQ1_M_R4
IQ1_M       31    31    IQ1_M
IQ1_BN      136   -     IQ1_BN
IQ2_BN      137   -     IQ2_BN
IQ2_BN_R4   337   -     IQ2_BN_R4
Q2_K        10    10    Q2_K
Q2_K_R4     210   -     Q2_K_R4
Q2_K_S      21    21    Q2_K
IQ3_XXS     23    23    IQ3_XXS
IQ3_KT      152   -     IQ3_KT
IQ4_KT      153   -     IQ4_KT
IQ3_XXS_R4  223   -     IQ3_XXS_R4
IQ3_S       26    26    IQ3_S
IQ3_S_R4    226   -     IQ3_S_R4
IQ3_M       27    27    IQ3_S
Q3_K_R4     211   -     Q3_K_R4
IQ3_XS      22    22    IQ3_S
Q3_K_S      11    11    Q3_K
Q3_K_M      12    12    Q3_K
Q3_K_L      13    13    Q3_K
IQ4_NL      25    25    IQ4_NL
IQ4_NL_R4   225   -     IQ4_NL_R4
IQ4_XS_R8   230   -     IQ4_XS_R8
Q4_0_R8     202   -     Q4_0_R8
Q5_0_R4     208   -     Q5_0_R4
Q6_0_R4     335   -     Q6_0_R4
Q8_0_R8     207   -     Q8_0_R8
Q8_KV       149   -     Q8_KV
IQ4_XS      30    30    IQ4_XS
IQ4_KS      145   -     IQ4_KS
IQ4_KS_R4   345   -     IQ4_KS_R4
IQ5_KS_R4   350   -     IQ5_KS_R4
IQ4_KSS     148   -     IQ4_KSS
IQ5_KS      150   -     IQ5_KS
IQ2_K       138   -     IQ2_K
IQ2_K_R4    338   -     IQ2_K_R4
IQ2_KS      147   -     IQ2_KS
IQ1_KT      156   -     IQ1_KT
IQ2_KT      151   -     IQ2_KT
IQ2_KL      155   -     IQ2_KL
IQ3_KS      154   -     IQ3_KS
IQ3_K       139   -     IQ3_K
IQ3_K_R4    339   -     IQ3_K_R4
IQ3_KL      146   -     IQ3_K       # a mix: IQ3_K with IQ4_KS/IQ5_K bumps
IQ4_K       140   -     IQ4_K
IQ4_K_R4    340   -     IQ4_K_R4
IQ5_K       141   -     IQ5_K
IQ5_K_R4    341   -     IQ5_K_R4
IQ6_K       142   -     IQ6_K
Q4_K_R4     214   -     Q4_K_R4
Q4_K_S      14    14    Q4_K
Q4_K_M      15    15    Q4_K
Q5_K_R4     216   -     Q5_K_R4
Q5_K_S      16    16    Q5_K
Q5_K_M      17    17    Q5_K
Q6_K        18    18    Q6_K
Q6_K_R4     218   -     Q6_K_R4
Q8_K_R8     399   -     Q8_K_R8
Q8_KV_R8    398   -     Q8_KV_R8
Q8_0        7     7     Q8_0
Q4_0_4_4    33    -     Q4_0_4_4
Q4_0_4_8    34    -     Q4_0_4_8
Q4_0_8_8    35    -     Q4_0_8_8
F16         1     1     F16
BF16        32    32    BF16
BF16_R16    232   -     BF16_R16
F32         0     0     F32
# mainline only (mainline's Q1_0 is 40 where ik's Q1_0_G128 is 41; mainline's 38 is MXFP4_MOE)
TQ1_0       -     36    TQ1_0
TQ2_0       -     37    TQ2_0
MXFP4_MOE   -     38    MXFP4
Q1_0        -     40    Q1_0
"""
# Both tools list these aliases; they write the ftype of the mix they stand for.
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}


def _read_table(table: str) -> dict[str, Preset]:
    """The presets of ``_TABLE``: a row a preset, its columns separated by spaces, # a comment."""
    presets = {}
    for line in table.splitlines():
        fields = line.split("#")[0].split()
        if not fields:
            continue
        name, ik, mainline, default = fields
        assert name not in presets, name
        ftypes = {f: int(n) for f, n in (("ik", ik), ("mainline", mainline)) if n != "-"}
        presets[name] = Preset(name, T[default], ftypes)
    return presets


PRESETS: dict[str, Preset] = _read_table(_TABLE)


def find_preset(text: str, flavor: str = "ik") -> Preset | None:
    """The preset a TYPE argument names in ``flavor`` (case-insensitive, aliases and ftype numbers
    accepted as llama-quantize does), or None."""
    key = text.strip().upper()
    key = ALIASES.get(key, key)
    p = PRESETS.get(key)
    if p is not None:
        return p if flavor in p.ftypes else None
    if key.isdigit():       # llama-quantize also takes the ftype number
        return next((p for p in PRESETS.values() if p.ftypes.get(flavor) == int(key)), None)
    return None


def preset_names(flavor: str) -> list[str]:
    return [p.name for p in PRESETS.values() if flavor in p.ftypes] + list(ALIASES)


def flavor_article(flavor: str) -> str:
    """'an ik', 'a mainline'."""
    return f"{'an' if flavor[:1] in 'aeiou' else 'a'} {flavor}"


def preset_or_type_hint(text: str, flavor: str, loaded_only: bool = True) -> str:
    """'did you mean …?' for a mistyped preset or type name, or ''.  Presets first: a name that is
    both (Q4_0) is shown as the preset, an alias as what it stands for; with ``loaded_only`` only
    types the flavor's llama.cpp loads."""
    names = {name: ALIASES.get(name, name) for name in preset_names(flavor)}
    names.update((t.name, t.name) for t in file_types() if not loaded_only or flavor in t.loads)
    return did_you_mean(text, names)


def type_label(text: str, flavor: str) -> str | None:
    """The name llama-quantize gives the type ``text`` names (a preset as spelled, upper case; a
    preset's ftype number as the preset; a ggml type; COPY), or None when it names no type: what
    ``quantize IN TYPE`` calls its output, ggml-model-<label>.gguf."""
    if not text or text != text.strip():
        return None
    key = text.upper()
    if key == "COPY" or find_mix(text) is not None:
        return key
    preset = find_preset(text, flavor)
    if preset is not None:
        return preset.name if key.isdigit() else key
    try:
        type_from_name(text)
    except ValueError:
        return None
    return key


def preset_or_type(text: str, flavor: str) -> tuple[Preset | None, QuantType]:
    """What quantize's TYPE names in ``flavor``: a preset (which wins, as in llama-quantize) and its
    default type, or (None, a ggml type).  Anything else is an error naming the nearest names, or
    the flavor that has the preset."""
    preset = find_preset(text, flavor)
    if preset is not None:
        return preset, preset.default_type
    try:
        return None, type_from_name(text)
    except ValueError:
        pass
    for other in FLAVORS:
        theirs = find_preset(text, other) if other != flavor else None
        if theirs is not None:
            what = theirs.name if text.strip().upper() == theirs.name else f"'{text}' names {theirs.name}, which"
            raise QuantkitError(f"TYPE: {what} is {flavor_article(other)} preset, not {flavor_article(flavor)} "
                                f"one: add --flavor {other}")
    hint = preset_or_type_hint(text, flavor)
    raise QuantkitError(f"TYPE: unknown type '{text}': neither a ggml type nor {flavor_article(flavor)} preset"
                        + (f"; {hint}" if hint else "") + " (quantkit types lists them all)")


# ---------------------------------------------------------------------------------- model facts
_INT = re.compile(r"^\s*blk\.([+-]?\d+)")


@dataclass
class ModelInfo:
    """The hyper-parameters llama_tensor_get_type looks at (llm_load_hparams)."""
    arch: str = ""
    n_layer: int = 0            # block_count, MTP/NextN layers included
    n_expert: int = 0
    n_head: int = 0             # of layer 0
    n_head_kv: int = 0
    n_vocab: int = 0
    n_embd: int = 0

    @classmethod
    def from_metadata(cls, get) -> "ModelInfo":
        """``get(key, default)`` reads GGUF metadata (GGUFModel.get)."""
        arch = get("general.architecture", "") or ""

        def first(key, default=0):
            v = get(f"{arch}.{key}", default)
            if isinstance(v, (list, tuple)):        # per-layer arrays: the C code asks for layer 0
                v = v[0] if v else default
            # llama.cpp's loader refuses a key of the wrong type: so do we, in one line
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise QuantkitError(f"metadata '{arch}.{key}' is {str(v)[:40]!r}: expected a whole number")
            return int(v)

        n_head = first("attention.head_count")
        n_vocab = get(f"{arch}.vocab_size", None)
        if n_vocab is not None and (isinstance(n_vocab, bool) or not isinstance(n_vocab, int)):
            raise QuantkitError(f"metadata '{arch}.vocab_size' is {str(n_vocab)[:40]!r}: expected a whole number")
        if n_vocab is None:
            n_vocab = len(get("tokenizer.ggml.tokens", []) or [])
        return cls(arch=arch, n_layer=first("block_count"), n_expert=first("expert_count"), n_head=n_head,
                   n_head_kv=first("attention.head_count_kv", n_head), n_vocab=int(n_vocab),
                   n_embd=first("embedding_length"))

    def n_gqa(self, flavor: str) -> int:
        n_head_kv = self.n_head_kv
        # ik's loader rewrites mainline-style DeepSeek MLA files (one KV head) to n_head_kv = n_head
        if flavor == "ik" and self.arch in ("deepseek2", "mistral4") and n_head_kv == 1:
            n_head_kv = self.n_head
        return self.n_head // n_head_kv if n_head_kv else 0

    def size_class(self, flavor: str) -> str | None:
        """"8B" or "70B" where llm_load_hparams would say MODEL_8B / MODEL_70B (the only sizes the
        rules test), else None.  Mainline only ever asks for 70B."""
        a, n = self.arch, self.n_layer
        size = None
        if a == "llama" and self.n_expert != 8:
            if n == 32 and self.n_vocab != 49152 and self.n_vocab >= 40000:
                size = "8B"
            elif n == 36:
                size = "8B"       # granite
            elif n == 80 and self.n_head != self.n_head_kv:
                size = "70B"
        elif a in ("deci", "qwen2", "olmo") and n == 80:
            size = "70B"
        elif a in ("qwen3", "qwen3vl") and n == 36 and self.n_embd != 2560:
            size = "8B"
        elif (a == "cohere2" and n == 32) or (a == "mistral3" and n == 34):
            size = "8B"
        return size if flavor == "ik" or size == "70B" else None


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # the layers that get the bigger type in *_M mixes: the first and last eighth, every third between
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def layer_of(name: str) -> int | None:
    """``sscanf(name, "blk.%d.")``."""
    m = _INT.match(name)
    return int(m[1]) if m else None


@dataclass
class _State:
    """quantize_state_internal: the model, the options and the running counters."""
    preset: str
    flavor: str
    model: ModelInfo
    has_output: bool
    has_imatrix: bool
    output_tensor_type: QuantType | None
    token_embedding_type: QuantType | None
    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    gqa: int = field(init=False)
    size: str | None = field(init=False)

    def __post_init__(self):
        self.gqa = self.model.n_gqa(self.flavor)
        self.size = self.model.size_class(self.flavor)

    def layer_info(self, counter: int, name: str) -> tuple[int, int]:
        # Mixtral's experts are not stored layer by layer, so with experts the layer is parsed from
        # the name; without, the running count of such tensors stands for the layer.
        n_layer = self.model.n_layer
        if max(1, self.model.n_expert) > 1:
            i = layer_of(name)
            if i is None:
                raise QuantkitError(f"Failed to determine layer for tensor {name}")
            if not 0 <= i < n_layer:
                raise QuantkitError(f"Bad layer {i} for tensor {name}. Must be in [0, {n_layer})")
            return i, n_layer
        return counter, n_layer


# ---------------------------------------------------------------------------------- ik rules
# ftype groups ik's llama_tensor_get_type tests (names of presets)
_IK_OUTPUT_LOW = {"IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M", "IQ2_K", "IQ3_K", "IQ2_KS",
                  "IQ3_K_R4", "IQ3_KS", "IQ2_K_R4", "IQ3_XXS_R4", "IQ2_KL", "IQ2_M_R4", "IQ1_S_R4", "IQ1_M_R4",
                  "IQ2_KT", "IQ3_KT", "IQ1_KT"}
_IK_OUTPUT_TIED_IQ5K = {"IQ3_S", "IQ3_M", "IQ3_KL", "IQ4_XS", "IQ3_S_R4", "IQ4_KS", "IQ4_KSS", "IQ4_KS_R4"}
_IK_OUTPUT_KEEP = {T.Q8_0, T.Q8_0_R8, T.IQ6_K, T.Q6_K_R4, T.Q8_K_R8, T.Q8_KV, T.Q8_KV_R8}
_IK_EMBD_Q2K = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ1_S_R4", "IQ1_M_R4"}
_IK_IQ2_GROUP = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M", "IQ2_KS", "IQ2_XXS_R4", "IQ2_XS_R4",
                 "IQ2_M_R4"}
_IK_ATTN_OUT_Q5K = {"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M",
                    "IQ4_XS", "IQ4_K", "IQ4_KSS", "IQ4_KS", "IQ4_KS_R4", "IQ5_KS", "IQ5_KS_R4", "IQ2_K", "IQ3_K",
                    "IQ3_KL", "Q4_K_R4", "IQ4_NL_R4", "IQ4_XS_R8", "Q3_K_R4", "IQ3_KT", "IQ3_KS", "Q2_K_R4",
                    "IQ4_K_R4", "IQ3_K_R4", "IQ2_K_R4", "IQ3_XXS_R4", "IQ3_S_R4"}
# attn_v with n_gqa >= 4: one step up from whatever the mix chose so far
_IK_GQA4_BUMP = {T.Q2_K: T.IQ3_S, T.IQ3_XXS: T.IQ3_S, T.Q2_K_R4: T.IQ3_K_R4, T.IQ3_XXS_R4: T.IQ3_K_R4,
                 T.Q3_K: T.Q4_K, T.IQ3_S: T.Q4_K, T.IQ3_K: T.IQ4_K, T.IQ3_KS: T.IQ4_KS, T.IQ2_KL: T.IQ4_KS,
                 T.IQ3_S_R4: T.Q4_K_R4, T.Q3_K_R4: T.Q4_K_R4, T.Q4_K: T.Q5_K, T.IQ4_XS: T.Q5_K, T.IQ4_NL: T.Q5_K,
                 T.IQ4_K: T.IQ5_K, T.IQ4_KS: T.IQ5_K, T.IQ4_NL_R4: T.Q5_K, T.IQ4_XS_R8: T.Q5_K, T.Q5_K: T.Q6_K,
                 T.IQ5_K: T.IQ6_K, T.IQ5_KS: T.IQ6_K}


def _ik_output(s: _State, shape, new: QuantType) -> QuantType:
    # output.weight, and token_embd.weight when it doubles as the output (tied embeddings)
    ft = s.preset
    if s.output_tensor_type is not None:
        return s.output_tensor_type
    if s.model.arch == "falcon" or shape[0] % 256:
        return T.Q8_0
    if ft in _IK_OUTPUT_LOW:
        return T.IQ4_K if not s.has_output else T.Q5_K
    if ft in ("IQ2_XXS_R4", "IQ2_XS_R4"):
        return T.IQ4_K_R4 if not s.has_output else T.Q5_K_R4
    if ft in _IK_OUTPUT_TIED_IQ5K and not s.has_output:
        return T.IQ5_K
    return new if new in _IK_OUTPUT_KEEP else T.Q6_K


def _ik_token_embd(s: _State, new: QuantType, given: QuantType | None) -> QuantType:
    ft = s.preset
    if given is not None:
        return given
    if ft in _IK_EMBD_Q2K:
        return T.Q2_K
    if ft in ("IQ2_S", "IQ2_M", "IQ2_M_R4", "IQ3_XXS", "IQ3_KT"):
        return T.IQ3_S
    if ft == "IQ3_XXS_R4":
        return T.IQ3_K
    if ft in ("IQ1_BN", "IQ2_BN", "IQ2_BN_R4"):
        return T.IQ4_NL
    return new


def _ik_very_low(s: _State, name: str, new: QuantType, r4: bool) -> QuantType:
    """IQ1_S_R4/IQ1_M_R4 (r4) and IQ2_KT: their own table of bumps."""
    m, ne = s.model, s.model.n_expert
    K = {False: dict(v4=T.IQ4_K, v2=T.IQ3_K, v1=T.Q2_K, k=T.Q4_K, blk0=T.IQ3_K, qkv=T.IQ3_K, sh=T.IQ4_K,
                     down=T.IQ3_K, out_moe=T.Q5_K, out=T.IQ3_K),
         True: dict(v4=T.IQ4_K_R4, v2=T.IQ3_K_R4, v1=T.Q2_K_R4, k=T.Q4_K_R4, blk0=T.IQ3_K_R4, qkv=T.IQ2_K_R4,
                    sh=T.IQ4_K_R4, down=T.Q2_K_R4, out_moe=T.Q5_K_R4, out=T.IQ2_K_R4)}[r4]
    if "attn_v.weight" in name:
        new = K["v4"] if ne >= 4 or s.gqa >= 4 else K["v2"] if s.gqa >= 2 else K["v1"]
        s.i_attention_wv += 1
    elif ne >= 8 and "attn_k" in name:
        new = K["k"]
    elif ne >= 8 and any(p in name for p in ("blk.0.ffn_down", "blk.0.ffn_gate", "blk.0.ffn_up")):
        new = K["blk0"]
    elif ne >= 8 and "attn_q" in name:
        new = K["k"]
    elif "attn_qkv.weight" in name:
        new = K["qkv"]
    elif "_shexp.weight" in name:
        new = K["sh"]
    elif "ffn_down" in name:
        i, n = s.layer_info(s.i_ffn_down, name)
        if i < n // 8:
            new = K["down"]
        s.i_ffn_down += 1
    elif "attn_output.weight" in name:
        new = K["out_moe"] if m.n_expert >= 4 else K["out"]
    return new


def _low_bit_attn_output(s: _State, new: QuantType, many_experts: bool, iq1_type: QuantType) -> QuantType:
    """attn_output in the IQ1/IQ2 mixes of both flavors, which differ in what counts as many experts
    (ik: 4 or more, mainline: 8) and in what IQ1_S/IQ1_M give it (ik: iq2_k, mainline: iq2_xxs)."""
    if many_experts:
        return T.Q5_K
    if s.preset in ("IQ1_S", "IQ1_M"):
        return iq1_type
    return T.IQ3_S if s.preset in ("IQ2_S", "IQ2_M", "IQ2_M_R4") else new


def _ik_iq2_group(s: _State, name: str, new: QuantType) -> QuantType:
    ft, ne = s.preset, s.model.n_expert
    iq2_s_like = ft in ("IQ2_S", "IQ2_M", "IQ2_M_R4")
    if "attn_v.weight" in name:
        if s.gqa >= 4 or ne >= 4:
            new = T.IQ4_K
        elif s.gqa >= 2 or ne >= 2:
            new = T.IQ3_K
        else:
            new = T.IQ3_S if iq2_s_like else T.Q2_K
        s.i_attention_wv += 1
    elif ne >= 8 and ("attn_k" in name or "attn_q" in name):
        new = T.Q4_K
    elif "attn_qkv.weight" in name:
        new = T.IQ3_XXS if iq2_s_like else T.IQ2_K
    elif "ffn_down" in name:
        # the raw counter, not the layer: with experts it counts every ffn_down* tensor
        if s.i_ffn_down < s.model.n_layer // 8:
            new = T.IQ3_S if iq2_s_like else T.Q2_K
        s.i_ffn_down += 1
    elif "attn_output.weight" in name:
        new = _low_bit_attn_output(s, new, ne >= 4, T.IQ2_K)
    return new


def _ik_attn_v(s: _State, new: QuantType) -> QuantType:
    ft, g = s.preset, s.gqa
    big_vocab = s.model.n_vocab >= 127999 and s.size in ("8B", "70B")
    if s.model.n_expert >= 4:
        new = T.Q8_0        # for 4-8 experts the bump costs next to nothing
    elif s.size == "70B":
        # 8 heads share attn_v in the 70B models: a small tensor, worth more bits
        if new in (T.Q3_K, T.Q4_K):
            new = T.Q5_K
        if new == T.IQ3_K:
            new = T.IQ5_K
    elif ft == "Q2_K":
        new = T.Q4_K if g >= 4 else T.Q3_K
    elif ft == "IQ2_K":
        new = T.IQ4_K if g >= 2 else T.IQ3_K
    elif ft == "IQ2_K_R4":
        new = T.IQ4_K_R4 if g >= 2 else T.IQ3_K_R4
    elif ft == "Q2_K_S" and g >= 4:
        new = T.Q4_K
    elif ft == "Q2_K_R4" and g >= 4:
        new = T.Q4_K_R4
    elif ft == "IQ3_XXS":
        new = T.Q4_K if g >= 4 else T.IQ3_K if g >= 2 else T.IQ3_S if not s.has_imatrix else T.IQ3_XXS
    elif ft == "IQ3_KT":
        new = T.IQ4_K if g >= 4 else T.IQ3_K
    elif ft == "IQ4_KT":
        new = T.IQ5_K if g >= 4 else T.IQ4_K
    elif ft == "IQ3_XXS_R4":
        new = T.Q4_K_R4 if g >= 4 else T.IQ3_K_R4 if g >= 2 else T.IQ3_K_R4 if not s.has_imatrix else T.IQ3_XXS_R4
    elif ft in ("IQ3_XS", "IQ3_S") and g >= 2:
        new = T.IQ4_K
    elif ft == "IQ3_S_R4" and g >= 2:
        new = T.IQ4_K_R4
    elif ft == "IQ3_K" and g >= 2:
        new = T.IQ4_K
    elif ft in ("IQ3_KS", "IQ2_KL") and g >= 2:
        new = T.IQ4_KS
    elif ft == "IQ3_K_R4" and g >= 2:
        new = T.IQ4_K_R4
    elif ft in ("IQ3_KL", "IQ3_M"):
        new = T.IQ5_K if g >= 2 else T.IQ4_K
    elif ft == "Q3_K_M":
        new = T.Q5_K if s.i_attention_wv < 2 else T.Q4_K
    elif ft == "Q3_K_L":
        new = T.Q5_K
    elif ft in ("IQ4_NL", "IQ4_XS", "IQ4_NL_R4", "IQ4_XS_R8", "IQ4_KS", "IQ4_KSS") and g >= 2:
        new = T.IQ5_K
    elif ft == "IQ4_KS_R4" and g >= 2:
        new = T.IQ5_K_R4
    elif ft in ("IQ4_K", "IQ4_K_R4") and g >= 2:
        new = T.IQ5_K
    elif ft in ("Q4_K_M", "Q5_K_M") and _use_more_bits(s.i_attention_wv, s.n_attention_wv):
        new = T.Q6_K
    elif ft in ("Q4_K_S", "Q4_K_R4") and s.i_attention_wv < 4:
        new = T.Q5_K
    elif ft == "Q5_K_S":
        if big_vocab:
            new = T.Q6_K
    elif ft in ("IQ5_K", "IQ5_KS"):
        if big_vocab:
            new = T.IQ6_K
    elif g >= 4 and not (s.model.arch == "dflash-draft" and ft in ("Q4_K_M", "Q5_K_M")):   # dflash: HEAD only
        new = _IK_GQA4_BUMP.get(new, new)
    s.i_attention_wv += 1
    return new


def _ffn_down(s: _State, name: str, new: QuantType) -> QuantType:
    """ffn_down in both flavors' llama_tensor_get_type: the same branches, but for IQ3_M (ik: 4 experts
    or more and iq4_k; mainline: 8 experts and q4_K); the presets only ik has never reach mainline."""
    ft, falcon, imat, ik = s.preset, s.model.arch == "falcon", s.has_imatrix, s.flavor == "ik"
    i, n = s.layer_info(s.i_ffn_down, name)
    more = _use_more_bits(i, n)
    if ft == "Q2_K":
        new = T.Q3_K
    elif ft == "Q2_K_S":
        if i < n // 8:
            new = T.Q4_K
    elif ft == "Q2_K_R4":
        if i < n // 8:
            new = T.Q4_K_R4
    elif ft == "IQ3_XXS" and not imat:
        new = T.Q4_K if i < n // 8 else T.Q3_K
    elif ft == "IQ3_KT" and not imat:
        new = T.IQ4_K if i < n // 8 else T.IQ3_K
    elif ft == "IQ3_XXS_R4" and not imat:
        new = T.Q4_K_R4 if i < n // 8 else T.IQ3_K_R4
    elif ft == "Q3_K_M":
        new = T.Q5_K if i < n // 16 else T.Q4_K if not falcon or more else T.Q3_K
    elif ft == "IQ3_M" and (i < n // 8 or ((s.model.n_expert >= 4 if ik else s.model.n_expert == 8) and more)):
        new = T.IQ4_K if ik else T.Q4_K
    elif ft == "Q3_K_L":
        new = T.Q4_K if falcon else T.Q5_K
    elif ft == "IQ3_KL":
        new = T.IQ4_KS if more else T.IQ3_K
    elif ft == "Q4_K_M":
        if falcon:
            new = T.Q6_K if i < n // 16 else T.Q5_K if more else T.Q4_K
        elif more:
            new = T.Q6_K
    elif i < n // 8 and not imat and ft in ("IQ4_NL", "IQ4_XS", "IQ4_KS", "IQ4_KSS", "IQ4_NL_R4", "IQ4_XS_R8"):
        new = T.Q5_K
    elif ft == "IQ4_KS_R4" and i < n // 8 and not imat:
        new = T.Q5_K_R4
    elif ft == "Q5_K_M" and more:
        new = T.Q6_K
    elif ft in ("Q4_K_S", "Q4_K_R4") and not falcon and i < n // 8:
        new = T.Q5_K
    elif ft in ("Q4_0", "Q5_0") and imat and i < n // 8:
        # the first ffn_down layers go wild even with an imatrix; only with one, so that a run
        # without imatrix gives what it always gave
        new = T.Q4_1 if ft == "Q4_0" else T.Q5_1
    elif ft == "Q4_0_R8" and imat and i < n // 8:
        new = T.IQ4_NL_R4
    s.i_ffn_down += 1
    return new


def _ik_attn_output(s: _State, new: QuantType) -> QuantType:
    ft = s.preset
    if s.model.arch == "falcon":
        return T.Q4_K if ft == "Q3_K_L" else new
    if s.model.n_expert >= 4:
        if ft in _IK_ATTN_OUT_Q5K:
            return T.Q5_K
        return T.IQ4_KS if ft == "IQ2_KL" else new
    bump = {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "IQ3_XXS_R4": T.IQ3_K_R4, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K,
            "IQ3_M": T.IQ4_K, "IQ2_K": T.IQ3_K, "IQ2_K_R4": T.IQ3_K_R4, "IQ3_KL": T.IQ4_KS}
    if ft == "IQ3_KT":
        return T.IQ3_K if s.gqa >= 4 else new
    return bump.get(ft, new)


def _ik_ffn_gate_up(s: _State, name: str, new: QuantType, which: str) -> QuantType:
    counter = getattr(s, which)
    i, n = s.layer_info(counter, name)
    if s.preset == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
        new = T.IQ3_XXS
    elif s.preset == "IQ3_KL" and _use_more_bits(i, n):
        new = T.IQ4_KS
    setattr(s, which, counter + 1)
    return new


def _ik_tensor_type(s: _State, name: str, shape, new: QuantType) -> QuantType:
    """ik_llama.cpp llama_tensor_get_type, before its custom rules and change_type_if_necessary.

    The branches are tried in the C code's order and test *substrings* of the name, so e.g.
    ``attn_k`` also catches ``attn_k_b`` and ``attn_kv_a_mqa``.
    """
    ft = s.preset
    if name == "output.weight" or (not s.has_output and name == "token_embd.weight"):
        return _ik_output(s, shape, new)
    if name == "token_embd.weight":
        return _ik_token_embd(s, new, s.token_embedding_type)
    if name == "per_layer_token_embd.weight":       # HEAD only; the wheel treats it as any other tensor
        return _ik_token_embd(s, new, None)
    if ft in ("IQ1_S_R4", "IQ1_M_R4"):
        return _ik_very_low(s, name, new, r4=True)
    if ft == "IQ2_KT":
        return _ik_very_low(s, name, new, r4=False)
    if ft in _IK_IQ2_GROUP:
        return _ik_iq2_group(s, name, new)
    if "attn_v.weight" in name:
        return _ik_attn_v(s, new)
    if "attn_k" in name:
        if s.model.n_expert >= 4:
            return T.Q8_0
        if ft == "IQ3_XS":
            return T.IQ3_XXS
        return T.IQ2_S if ft in ("IQ3_XXS", "IQ3_XXS_R4") else new
    if "attn_q" in name:
        if ft == "IQ3_XS":
            return T.IQ3_XXS
        if ft in ("IQ3_XXS", "IQ3_XXS_R4"):
            return T.IQ2_S
        if s.model.n_vocab >= 127999 and s.size in ("8B", "70B"):
            return {"Q5_K_S": T.Q4_K, "IQ5_K": T.IQ4_K, "IQ5_KS": T.IQ4_KS}.get(ft, new)
        return new
    if "ffn_down" in name:
        return _ffn_down(s, name, new)
    if "attn_output.weight" in name:
        return _ik_attn_output(s, new)
    if "attn_qkv.weight" in name:
        return {"Q3_K_M": T.Q4_K, "Q3_K_L": T.Q4_K, "IQ3_M": T.IQ4_K, "Q4_K_M": T.Q5_K,
                "Q5_K_M": T.Q6_K}.get(ft, new)
    if "ffn_gate" in name:
        return _ik_ffn_gate_up(s, name, new, "i_ffn_gate")
    if "ffn_up" in name:
        return _ik_ffn_gate_up(s, name, new, "i_ffn_up")
    return new


# ---------------------------------------------------------------------------------- mainline rules
def _ml_category(name: str) -> str:
    """tensor_get_category: the first match in this order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for sub, cat in (("attn_qkv.weight", "qkv"), ("attn_kv_b.weight", "kv_b"), ("attn_v.weight", "v"),
                     ("attn_k.weight", "k"), ("attn_q.weight", "q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if sub in name:
            return cat
    return "other"


_ML_ATTN_V = ("v", "qkv", "kv_b")       # "attention-v-like": more sensitive to quantization
_ML_IQ2_GROUP = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}
_ML_ATTN_OUT_Q5K = {"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M",
                    "IQ4_XS"}


def _ml_tensor_type(s: _State, name: str, shape, new: QuantType) -> QuantType:
    """mainline llama_tensor_get_type_impl (only called for tensors no --tensor-type rule claims)."""
    ft, cat, ne, g = s.preset, _ml_category(name), s.model.n_expert, s.gqa
    falcon = s.model.arch == "falcon"
    iq2_s_like = ft in ("IQ2_S", "IQ2_M")
    if cat == "output" or (not s.has_output and cat == "token_embd"):
        if s.output_tensor_type is not None:
            return s.output_tensor_type
        if ft == "MXFP4_MOE" or falcon or shape[0] % traits(new).block_size:
            return T.Q8_0
        if ft in _ML_IQ2_GROUP or ft == "IQ3_XXS":
            return T.Q5_K
        return new if new == T.Q8_0 else T.Q6_K
    if ft == "MXFP4_MOE":
        # expert tensors (3-D) to MXFP4, the rest to Q8_0; bailingmoe3's 3-D MLA tensors are not experts
        expert = len(shape) > 2 and shape[2] > 1
        if s.model.arch == "bailingmoe3":
            expert = expert and cat in ("ffn_up", "ffn_gate", "ffn_down")
        return T.MXFP4 if expert else T.Q8_0
    if cat == "token_embd":
        if ft in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return T.Q2_K
        if ft in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return T.IQ3_S
        return T.Q4_K if ft in ("TQ1_0", "TQ2_0") else new
    if ft in _ML_IQ2_GROUP:
        if cat in _ML_ATTN_V:
            new = T.Q4_K if g >= 4 or ne >= 4 else T.IQ3_S if iq2_s_like else T.Q2_K
            s.i_attention_wv += 1
        elif ne == 8 and cat == "k":
            new = T.Q4_K
        elif cat == "ffn_down":
            if s.i_ffn_down < s.model.n_layer // 8:
                new = T.IQ3_S if iq2_s_like else T.Q2_K
            s.i_ffn_down += 1
        elif cat == "attn_output":
            new = _low_bit_attn_output(s, new, ne == 8, T.IQ2_XXS)
        return new
    if cat in _ML_ATTN_V:
        if ft == "Q2_K":
            new = T.Q4_K if g >= 4 else T.Q3_K
        elif ft == "Q2_K_S" and g >= 4:
            new = T.Q4_K
        elif ft == "IQ3_XXS":
            new = T.Q4_K if g >= 4 else T.IQ3_S if not s.has_imatrix else T.IQ3_XXS
        elif ft in ("IQ3_XS", "IQ3_S") and g >= 4:
            new = T.Q4_K
        elif ft == "IQ3_M":
            new = T.Q4_K
        elif ft == "Q3_K_M":
            new = T.Q5_K if s.i_attention_wv < 2 else T.Q4_K
        elif ft == "Q3_K_L":
            new = T.Q5_K
        elif ft in ("IQ4_NL", "IQ4_XS") and g >= 4:
            new = T.Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and _use_more_bits(s.i_attention_wv, s.n_attention_wv):
            new = T.Q6_K
        elif ft == "Q4_K_S" and s.i_attention_wv < 4:
            new = T.Q5_K
        if s.size == "70B" and new in (T.Q3_K, T.Q4_K):
            new = T.Q5_K    # 8 heads share attn_v in the 70B models: small, worth more bits
        if ne == 8:
            new = T.Q8_0    # Mixtral: the bump costs next to nothing
        s.i_attention_wv += 1
        return new
    if cat == "k":
        if ne == 8:
            return T.Q8_0
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft, new)
    if cat == "q":
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft, new)
    if cat == "ffn_down":
        return _ffn_down(s, name, new)
    if cat == "attn_output":
        if falcon:
            return T.Q4_K if ft == "Q3_K_L" else new
        if ne == 8:
            return T.Q5_K if ft in _ML_ATTN_OUT_Q5K else new
        return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(ft, new)
    # (the C code's own attn_qkv branch is unreachable: qkv is attention-v-like and caught above)
    if cat in ("ffn_gate", "ffn_up"):
        which = "i_" + cat
        counter = getattr(s, which)
        i, n = s.layer_info(counter, name)
        if ft == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            new = T.IQ3_XXS
        setattr(s, which, counter + 1)
    return new


def mainline_order(name: str) -> tuple[int, str]:
    """Where mainline's llama_model_loader puts a tensor (its weights_map, which llama-quantize visits
    and writes in): by layer number, non-block tensors first, then by name (strcmp)."""
    i = layer_of(name)
    return (i if i is not None else -1, name)


# ---------------------------------------------------------------------------------- entry points
def mix_types(visit, all_names, preset: Preset, flavor: str, model: ModelInfo, *, has_imatrix: bool = False,
              token_embedding_type: QuantType | None = None,
              output_tensor_type: QuantType | None = None) -> dict[str, QuantType]:
    """The preset's type for each tensor in ``visit`` (``(name, shape)`` in file order).

    ``visit`` holds the tensors llama_tensor_get_type is called for: the quantizable ones (ik), less
    those a recipe rule claims (mainline).  ``all_names`` are every tensor of the model: they decide
    whether the embeddings are tied and how many attn_v tensors there are.  Counters run in the
    order the C tool visits tensors, so the result depends on it as the C tool's does.
    """
    default = preset.default_type
    all_names = list(all_names)
    if flavor == "ik":
        n_wv = sum("attn_v.weight" in n or "attn_qkv.weight" in n for n in all_names)
        rule, order = _ik_tensor_type, list(visit)
    else:
        n_wv = sum(_ml_category(n) in _ML_ATTN_V for n in all_names)
        rule, order = _ml_tensor_type, sorted(visit, key=lambda t: mainline_order(t[0]))
    if model.n_layer <= 0:      # no block_count: count the blocks
        layers = [i for i in map(layer_of, all_names) if i is not None]
        model = ModelInfo(**{**model.__dict__, "n_layer": max(layers) + 1 if layers else 0})
    s = _State(preset.name, flavor, model, has_output="output.weight" in all_names, has_imatrix=has_imatrix,
               output_tensor_type=output_tensor_type, token_embedding_type=token_embedding_type,
               n_attention_wv=n_wv)
    return {name: rule(s, name, tuple(shape), default) for name, shape in order}


# ---------------------------------------------------------------------------------- imatrix rules
_IK_NEEDS_IMATRIX_FTYPES = {"IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ2_XXS_R4", "Q2_K_S", "IQ2_XS_R4", "IQ1_S", "IQ1_S_R4",
                            "IQ1_M_R4", "IQ1_M"}
_IK_VERY_LOW_BPW = {T.IQ2_XXS, T.IQ2_XXS_R4, T.IQ2_XS, T.IQ2_XS_R4, T.IQ2_S, T.IQ2_S_R4, T.IQ1_S, T.IQ1_S_R4,
                    T.IQ1_M, T.IQ1_M_R4, T.IQ1_KT, T.IQ2_KT}
_ML_VERY_LOW_BPW = {T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S}


def tensor_requires_imatrix(name: str, qtype: QuantType, preset: Preset | None, flavor: str) -> bool:
    """Whether quantizing ``name`` to ``qtype`` needs importance weights (the result is garbage
    without), as the C tool decides it.  Embeddings and the output never do."""
    if name in ("token_embd.weight", "output.weight"):
        return False
    if flavor == "mainline" and name == "per_layer_token_embd.weight":
        return False
    very_low = _IK_VERY_LOW_BPW if flavor == "ik" else _ML_VERY_LOW_BPW
    # k-quants never need one, except the Q2_K tensors of a Q2_K_S file
    return qtype in very_low or (qtype == T.Q2_K and preset is not None and preset.name == "Q2_K_S")


def imatrix_problem(preset: Preset | None, flavor: str, tensors, imatrix_given: bool, has_entry) -> str | None:
    """The C tool's refusal to run without importance weights, or None.

    ``tensors`` are (name, target type) of the tensors that will be quantized; ``has_entry(name)``
    tells whether the imatrix has weights for one.
    """
    if flavor == "ik" and not imatrix_given and preset is not None and preset.name in _IK_NEEDS_IMATRIX_FTYPES:
        return (f"this quantization requires an imatrix! Please do not use IQ1_S, IQ1_M, IQ2_S, IQ2_XXS, IQ2_XS or "
                f"Q2_K_S quantization without an importance matrix ({preset.name}: pass --imatrix FILE)")
    for name, qtype in tensors:
        if not tensor_requires_imatrix(name, qtype, preset, flavor) or has_entry(name):
            continue
        what = f"Missing importance matrix for tensor {name} in a very low-bit quantization ({type_name(qtype)})"
        if imatrix_given:
            return what
        if flavor == "mainline":
            # mainline stops in its first pass over the tensors, naming the first that needs one
            what = f"offending tensor: {name}, target type: {type_name(qtype)}"
        return f"this quantization requires an imatrix! {what}; pass --imatrix FILE"
    return None


__all__ = ["Preset", "PRESETS", "ALIASES", "FLAVORS", "ModelInfo", "find_preset", "preset_names", "preset_or_type",
           "type_label", "flavor_article", "mix_types", "tensor_requires_imatrix", "imatrix_problem", "layer_of"]
