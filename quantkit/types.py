"""The one table of ggml tensor types: ids, names and on-disk sizes.

Every other module reads layout facts from here.  A row of a tensor of type T with ``n_per_row``
elements occupies::

    row_size(T, n) = row_meta_size + type_size * n // block_size

bytes (ggml.c ``ggml_row_size``).  ``row_meta_size`` is the per-row scale some ik_llama.cpp types
keep in front of their blocks; interleaved (``_r4``/``_r8``/``_r16``) types store groups of
``interleave_rows`` rows, but their ``type_size`` is still the per-row equivalent, so the byte size of
a tensor does not depend on the interleaving.

Ids are those of ``enum ggml_type`` in ik_llama.cpp (ggml.h) and mainline llama.cpp.  Where the two
projects give an id different meanings (34/35 TQ*_0 mainline only, 36 I2_S fork only, 40 NVFP4
mainline only, 41 Q1_0 / Q1_0_G128 with the same layout) both readings are listed as one entry with
the layout that GGUF files of either project use.

``loads`` says whose llama.cpp loads a file holding the type: the projects whose ``enum ggml_type``
defines the id with this layout (mainline: ggml-org/llama.cpp ggml/include/ggml.h, which gguf-py's
GGMLQuantizationType mirrors; ik: ik_llama.cpp's ggml.h @ 8337e4c).  Mainline has none of the fork's
ids from 97 on (IQK, trellis, q6_0, bitnet, every ``_r4``/``_r8``/``_r16`` layout) and dropped
31-33 (q4_0_4x4…) from files; the fork has none of 34, 35 and 40.  Activation-only formats are in no
file, so nothing loads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .suggest import did_you_mean

QK_K = 256          # super-block size of the k-quants and of the IQK family
K_SCALE_SIZE = 12   # packed 6-bit scales/mins of q4_K/q5_K

# who loads a type (TypeTraits.loads): flavor -> the project whose llama.cpp it is
PROJECTS = {"mainline": "llama.cpp", "ik": "ik_llama.cpp"}
BOTH = ("ik", "mainline")
IK = ("ik",)
MAINLINE = ("mainline",)
NONE = ()


class QuantType(IntEnum):
    """ggml type ids (member names upper-case; the canonical printed name lives in the table)."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    Q4_0_4_4 = 31
    Q4_0_4_8 = 32
    Q4_0_8_8 = 33
    TQ1_0 = 34          # mainline only
    TQ2_0 = 35          # mainline only
    I2_S = 36           # ik_llama.cpp only
    MXFP4 = 39
    NVFP4 = 40          # mainline only
    Q1_0 = 41           # mainline Q1_0 == ik Q1_0_G128 (same layout)
    Q8_0_X4 = 97
    Q8_1_X4 = 98
    Q8_2_X4 = 99
    Q6_0 = 133
    IQ1_BN = 134
    IQ2_BN = 135
    Q8_K64 = 136
    IQ2_K = 137
    IQ3_K = 138
    IQ4_K = 139
    IQ5_K = 140
    IQ6_K = 141
    IQ4_KS = 144
    IQ2_KS = 145
    IQ4_KSS = 146
    Q8_K16 = 147
    Q8_K32 = 148
    Q8_KR8 = 149
    Q8_K128 = 150
    Q8_KV = 151
    IQ5_KS = 152
    IQ2_KT = 153
    IQ3_KT = 154
    IQ4_KT = 155
    IQ3_KS = 156
    IQ2_KL = 157
    IQ1_KT = 158
    Q4_0_R8 = 202
    Q5_0_R4 = 206
    Q8_0_R8 = 208
    Q2_K_R4 = 210
    Q3_K_R4 = 211
    Q4_K_R4 = 212
    Q5_K_R4 = 213
    Q6_K_R4 = 214
    IQ2_XXS_R4 = 216
    IQ2_XS_R4 = 217
    IQ3_XXS_R4 = 218
    IQ1_S_R4 = 219
    IQ4_NL_R4 = 220
    IQ3_S_R4 = 221
    IQ2_S_R4 = 222
    IQ4_XS_R8 = 223
    IQ1_M_R4 = 229
    BF16_R16 = 230
    Q6_0_R4 = 233
    IQ2_BN_R4 = 335
    IQ2_K_R4 = 337
    IQ3_K_R4 = 338
    IQ4_K_R4 = 339
    IQ5_K_R4 = 340
    IQ4_KS_R4 = 344
    IQ5_KS_R4 = 352
    Q8_K_R16 = 397
    Q8_KV_R8 = 398
    Q8_K_R8 = 399


@dataclass(frozen=True)
class TypeTraits:
    qtype: QuantType
    name: str                   # exactly as ggml_type_name prints it
    block_size: int             # elements per block
    type_size: int              # bytes per block (per-row equivalent for interleaved types)
    row_meta_size: int = 0      # bytes of per-row metadata in front of the blocks
    interleave_rows: int = 1    # rows stored together (4 for _r4, 8 for _r8, 16 for _r16)
    # interleaved types: the plain type whose rows ik repacks into this one (get_repack_info), and
    # which a matrix whose row count is not a multiple of interleave_rows is written as
    # (interleaved_properties) unless group_fallback names another.  iq1_s_r4 and iq1_m_r4 are
    # quantized on their own (their block is not their base's), so they are no repack (REPACKED_TYPE)
    base: QuantType | None = None
    group_fallback: QuantType | None = None
    quantized: bool = True      # ggml's is_quantized: block-scaled, not a plain number format
    in_files: bool = True       # False for activation-only formats (q8_K and friends)
    ftype: int | None = None    # LLAMA_FTYPE_MOSTLY_<type> written to general.file_type
    loads: tuple[str, ...] | None = None    # flavors whose llama.cpp loads it (PROJECTS); every row says
    # per flavor (fallback()): the type written instead where a row's length is not a multiple of
    # block_size (ik's change_type_if_necessary, mainline's tensor_type_fallback); none: f16 (plan.py)
    row_fallback: tuple[tuple[str, QuantType], ...] = ()
    # mainline ggml-cpu's vec_dot_type: the type a product rounds its float input to first (set for
    # the quantized types mainline loads and quantkit writes: runtime/activations.py imitates it)
    vec_dot_type: QuantType | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_fallback_for(self, flavor: str) -> QuantType | None:
        return dict(self.row_fallback).get(flavor)

    def row_size(self, n_per_row: int) -> int:
        if n_per_row % self.block_size:
            raise ValueError(
                f"row size ({n_per_row}) is not a multiple of {self.name} block size ({self.block_size})")
        return self.row_meta_size + self.type_size * (n_per_row // self.block_size)


T = QuantType
_Q = TypeTraits


def fallback(*, ik: QuantType | None = None, mainline: QuantType | None = None) -> tuple[tuple[str, QuantType], ...]:
    """A row's ``row_fallback``: the type each flavor falls back to (flavors not named have none)."""
    return tuple((flavor, t) for flavor, t in (("ik", ik), ("mainline", mainline)) if t is not None)


# Sizes are written as sums of the block struct fields (ggml-common.h), in struct order.
# fp16 d = 2, fp16 m/dmin = 2, QK_K//2 = 4-bit codes of a super-block, etc.
_TABLE: list[TypeTraits] = [
    _Q(T.F32, "f32", 1, 4, quantized=False, ftype=0, loads=BOTH),
    _Q(T.F16, "f16", 1, 2, quantized=False, ftype=1, loads=BOTH),
    _Q(T.BF16, "bf16", 1, 2, quantized=False, ftype=32, loads=BOTH),
    _Q(T.F64, "f64", 1, 8, quantized=False, loads=BOTH),
    _Q(T.I8, "i8", 1, 1, quantized=False, loads=BOTH),
    _Q(T.I16, "i16", 1, 2, quantized=False, loads=BOTH),
    _Q(T.I32, "i32", 1, 4, quantized=False, loads=BOTH),
    _Q(T.I64, "i64", 1, 8, quantized=False, loads=BOTH),
    # ---- legacy 32-blocks ----
    _Q(T.Q4_0, "q4_0", 32, 2 + 16, ftype=2, loads=BOTH, vec_dot_type=T.Q8_0),
    _Q(T.Q4_1, "q4_1", 32, 2 + 2 + 16, ftype=3, loads=BOTH, vec_dot_type=T.Q8_1),
    _Q(T.Q5_0, "q5_0", 32, 2 + 4 + 16, ftype=8, loads=BOTH, vec_dot_type=T.Q8_0),
    _Q(T.Q5_1, "q5_1", 32, 2 + 2 + 4 + 16, ftype=9, loads=BOTH, vec_dot_type=T.Q8_1),
    _Q(T.Q8_0, "q8_0", 32, 2 + 32, ftype=7, loads=BOTH, vec_dot_type=T.Q8_0),
    _Q(T.Q8_1, "q8_1", 32, 2 + 2 + 32, in_files=False, loads=NONE),
    _Q(T.Q6_0, "q6_0", 32, 2 + 8 + 16, ftype=135, loads=IK),
    _Q(T.IQ4_NL, "iq4_nl", 32, 2 + 16, ftype=25, loads=BOTH, vec_dot_type=T.Q8_0),
    _Q(T.MXFP4, "mxfp4", 32, 1 + 16, ftype=38, loads=BOTH),
    _Q(T.NVFP4, "nvfp4", 64, 4 + 32, loads=MAINLINE),
    _Q(T.Q1_0, "q1_0_g128", 128, 2 + 16, loads=BOTH),
    # ---- k-quants ----
    _Q(T.Q2_K, "q2_K", QK_K, QK_K // 16 + QK_K // 4 + 2 + 2, ftype=10, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.Q4_0)),
    _Q(T.Q3_K, "q3_K", QK_K, QK_K // 8 + QK_K // 4 + 12 + 2, ftype=12, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.Q4_0)),
    _Q(T.Q4_K, "q4_K", QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 2, ftype=15, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.Q5_0, mainline=T.Q5_0)),
    _Q(T.Q5_K, "q5_K", QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 8 + QK_K // 2, ftype=17, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.Q6_0, mainline=T.Q5_1)),
    _Q(T.Q6_K, "q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, ftype=18, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.Q8_0, mainline=T.Q8_0)),
    _Q(T.Q8_K, "q8_K", QK_K, 296, in_files=False, loads=NONE),   # fork size; mainline 292 (activation only)
    # ---- mainline i-quants ----
    _Q(T.IQ2_XXS, "iq2_xxs", QK_K, 2 + QK_K // 4, ftype=19, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ2_XS, "iq2_xs", QK_K, 2 + QK_K // 4 + QK_K // 32, ftype=20, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ3_XXS, "iq3_xxs", QK_K, 2 + QK_K // 4 + QK_K // 8, ftype=23, loads=BOTH, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ1_S, "iq1_s", QK_K, 2 + QK_K // 8 + QK_K // 16, ftype=24, loads=BOTH, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ3_S, "iq3_s", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4, ftype=26, loads=BOTH, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ2_S, "iq2_s", QK_K, 2 + QK_K // 4 + QK_K // 16, ftype=28, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ4_XS, "iq4_xs", QK_K, 2 + 2 + QK_K // 64 + QK_K // 2, ftype=30, loads=BOTH, vec_dot_type=T.Q8_K, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.IQ1_M, "iq1_m", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32, ftype=31, loads=BOTH, row_fallback=fallback(ik=T.IQ4_NL, mainline=T.IQ4_NL)),
    _Q(T.TQ1_0, "tq1_0", QK_K, (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64 + 2, ftype=36, loads=MAINLINE, row_fallback=fallback(mainline=T.Q4_0)),
    _Q(T.TQ2_0, "tq2_0", QK_K, 2 + QK_K // 4, ftype=37, loads=MAINLINE, row_fallback=fallback(mainline=T.Q4_0)),
    # ---- obsolete ARM repacks (still in the fork's enum) ----
    _Q(T.Q4_0_4_4, "q4_0_4x4", 32, 2 + 16, loads=IK),
    _Q(T.Q4_0_4_8, "q4_0_4x8", 32, 2 + 16, loads=IK),
    _Q(T.Q4_0_8_8, "q4_0_8x8", 32, 2 + 16, loads=IK),
    _Q(T.I2_S, "i2_s", 1, 1, loads=IK),
    # ---- ik_llama.cpp activation formats (never in files) ----
    _Q(T.Q8_0_X4, "q8_0_x4", 32, 2 + 32, in_files=False, loads=NONE),
    _Q(T.Q8_1_X4, "q8_1_x4", 32, 4 + 32, in_files=False, loads=NONE),
    _Q(T.Q8_2_X4, "q8_2_x4", 32, 4 + 32, in_files=False, loads=NONE),
    _Q(T.Q8_K64, "q8_K64", 64, 4 + 64, in_files=False, loads=NONE),
    _Q(T.Q8_K16, "q8_K16", 64, 64, row_meta_size=20, in_files=False, loads=NONE),
    _Q(T.Q8_K32, "q8_K32", QK_K, 296, in_files=False, loads=NONE),
    _Q(T.Q8_KR8, "q8_KR8", QK_K, 296, in_files=False, loads=NONE),
    _Q(T.Q8_K128, "q8_K128", 128, 4 + 128 + 8, in_files=False, loads=NONE),
    # ---- ik_llama.cpp ternary / bitnet ----
    _Q(T.IQ1_BN, "iq1_bn", 64, 13, row_meta_size=2, ftype=136, loads=IK),
    _Q(T.IQ2_BN, "iq2_bn", 64, 16, row_meta_size=4, ftype=137, loads=IK),
    # ---- IQK family: 256-blocks with non-linear value grids ----
    _Q(T.IQ2_K, "iq2_k", QK_K, 2 + 2 + QK_K // 32 + QK_K // 4, ftype=138, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ3_K, "iq3_k", QK_K, 2 + 2 + 2 + QK_K // 32 + QK_K // 4 + QK_K // 8, ftype=139, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ4_K, "iq4_k", QK_K, 2 + 2 + QK_K // 64 + QK_K // 32 + QK_K // 2, ftype=140, loads=IK, row_fallback=fallback(ik=T.Q5_0)),
    _Q(T.IQ5_K, "iq5_k", QK_K, 2 + 2 + QK_K // 64 + QK_K // 32 + QK_K // 2 + QK_K // 8, ftype=141, loads=IK, row_fallback=fallback(ik=T.Q6_0)),
    _Q(T.IQ6_K, "iq6_k", QK_K, 2 + 2 + QK_K // 16 + QK_K // 2 + QK_K // 4, ftype=142, loads=IK, row_fallback=fallback(ik=T.Q8_0)),
    _Q(T.IQ4_KS, "iq4_ks", QK_K, QK_K // 32 + QK_K // 2, row_meta_size=4, ftype=145, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ2_KS, "iq2_ks", QK_K, 2 + QK_K // 64 + QK_K // 4, row_meta_size=2, ftype=147, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ4_KSS, "iq4_kss", QK_K, QK_K // 2, row_meta_size=4, ftype=148, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.Q8_KV, "q8_KV", 32, 32, row_meta_size=8, ftype=149, loads=IK),
    _Q(T.IQ5_KS, "iq5_ks", QK_K, QK_K // 32 + QK_K // 2 + QK_K // 8, row_meta_size=4, ftype=150, loads=IK, row_fallback=fallback(ik=T.Q5_0)),
    _Q(T.IQ2_KT, "iq2_kt", QK_K, 68, row_meta_size=4, ftype=151, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    # Trellis and newer KS/KL types: sizes as ggml.c's type_traits give them (layouts not used here).
    _Q(T.IQ3_KT, "iq3_kt", QK_K, 100, row_meta_size=4, ftype=152, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ4_KT, "iq4_kt", QK_K, QK_K // 2, row_meta_size=4, ftype=153, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ3_KS, "iq3_ks", QK_K, 102, row_meta_size=2, ftype=154, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ2_KL, "iq2_kl", QK_K, 86, row_meta_size=2, ftype=155, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ1_KT, "iq1_kt", QK_K, 56, row_meta_size=4, ftype=156, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    # ---- row-interleaved CPU layouts ----
    _Q(T.Q4_0_R8, "q4_0_r8", 32, 2 + 16, interleave_rows=8, base=T.Q4_0, ftype=202, loads=IK),
    _Q(T.Q5_0_R4, "q5_0_r4", 32, 2 + 4 + 16, interleave_rows=4, base=T.Q5_0, ftype=208, loads=IK),
    _Q(T.Q8_0_R8, "q8_0_r8", 32, 2 + 32, interleave_rows=8, base=T.Q8_0, ftype=207, loads=IK),
    _Q(T.Q2_K_R4, "q2_k_r4", QK_K, 84, interleave_rows=4, base=T.Q2_K, ftype=210, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.Q3_K_R4, "q3_k_r4", QK_K, 110, interleave_rows=4, base=T.Q3_K, ftype=211, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.Q4_K_R4, "q4_k_r4", QK_K, 144, interleave_rows=4, base=T.Q4_K, ftype=214, loads=IK, row_fallback=fallback(ik=T.Q5_0)),
    _Q(T.Q5_K_R4, "q5_k_r4", QK_K, 176, interleave_rows=4, base=T.Q5_K, ftype=216, loads=IK, row_fallback=fallback(ik=T.Q6_0)),
    _Q(T.Q6_K_R4, "q6_k_r4", QK_K, 210, interleave_rows=4, base=T.Q6_K, ftype=218, loads=IK, row_fallback=fallback(ik=T.Q8_0)),
    _Q(T.IQ2_XXS_R4, "iq2_xxs_r4", QK_K, 66, interleave_rows=4, base=T.IQ2_XXS, ftype=219, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ2_XS_R4, "iq2_xs_r4", QK_K, 74, interleave_rows=4, base=T.IQ2_XS, ftype=220, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ3_XXS_R4, "iq3_xxs_r4", QK_K, 98, interleave_rows=4, base=T.IQ3_XXS, ftype=223, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ1_S_R4, "iq1_s_r4", 32, 6, row_meta_size=2, interleave_rows=4, base=T.IQ1_S, ftype=224, loads=IK),
    _Q(T.IQ4_NL_R4, "iq4_nl_r4", 32, 18, interleave_rows=4, base=T.IQ4_NL, ftype=225, loads=IK),
    _Q(T.IQ3_S_R4, "iq3_s_r4", QK_K, 110, interleave_rows=4, base=T.IQ3_S, ftype=226, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ2_S_R4, "iq2_s_r4", QK_K, 82, interleave_rows=4, base=T.IQ2_S, ftype=229, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ4_XS_R8, "iq4_xs_r8", QK_K, 136, interleave_rows=8, base=T.IQ4_XS, ftype=230, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ1_M_R4, "iq1_m_r4", 32, 7, row_meta_size=2, interleave_rows=4, base=T.IQ1_M, ftype=231, loads=IK),
    _Q(T.BF16_R16, "bf16_r16", 1, 2, interleave_rows=16, base=T.BF16, quantized=False, ftype=232, loads=IK),
    _Q(T.Q6_0_R4, "q6_0_r4", 32, 26, interleave_rows=4, base=T.Q6_0, ftype=335, loads=IK),
    _Q(T.IQ2_BN_R4, "iq2_bn_r4", 64, 16, row_meta_size=4, interleave_rows=4, base=T.IQ2_BN, ftype=337, loads=IK),
    _Q(T.IQ2_K_R4, "iq2_k_r4", QK_K, 76, interleave_rows=4, base=T.IQ2_K, ftype=338, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ3_K_R4, "iq3_k_r4", QK_K, 110, interleave_rows=4, base=T.IQ3_K, ftype=339, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ4_K_R4, "iq4_k_r4", QK_K, 144, interleave_rows=4, base=T.IQ4_K, ftype=340, loads=IK, row_fallback=fallback(ik=T.Q5_0)),
    _Q(T.IQ5_K_R4, "iq5_k_r4", QK_K, 176, interleave_rows=4, base=T.IQ5_K, ftype=341, loads=IK, row_fallback=fallback(ik=T.Q6_0)),
    _Q(T.IQ4_KS_R4, "iq4_ks_r4", QK_K, 136, row_meta_size=4, interleave_rows=4, base=T.IQ4_KS, ftype=345, loads=IK, row_fallback=fallback(ik=T.IQ4_NL)),
    _Q(T.IQ5_KS_R4, "iq5_ks_r4", QK_K, 168, row_meta_size=4, interleave_rows=4, base=T.IQ5_KS, ftype=350, loads=IK, row_fallback=fallback(ik=T.Q5_0)),
    _Q(T.Q8_K_R16, "q8_k_r16", QK_K, 258, interleave_rows=16, loads=IK),
    _Q(T.Q8_KV_R8, "q8_KV_r8", 32, 32, row_meta_size=4, interleave_rows=8, base=T.Q8_KV, ftype=398, loads=IK),
    _Q(T.Q8_K_R8, "q8_k_r8", QK_K, 258, interleave_rows=8, base=T.Q8_K, group_fallback=T.Q8_0, ftype=399, loads=IK, row_fallback=fallback(ik=T.Q8_0)),
]

TYPE_TRAITS: dict[QuantType, TypeTraits] = {}
for _t in _TABLE:
    assert _t.qtype not in TYPE_TRAITS, f"duplicate type {_t.qtype!r}"
    assert _t.loads is not None and set(_t.loads) <= set(PROJECTS), f"{_t.name}: declare who loads it"
    TYPE_TRAITS[_t.qtype] = _t
assert set(TYPE_TRAITS) == set(QuantType), "every QuantType needs a table row"

# plain type -> its interleaved variant, as ik's get_repack_info maps them (llama-quantize --repack, -rtr):
# every quantized interleaved type whose block is its base's.  bf16_r16 is left to repack.py (ik
# repacks bf16 and f16 into it only in AVX512-BF16 builds); mxfp4_r8 is not in the table (the
# wheel's ggml does not know it).
REPACKED_TYPE: dict[QuantType, QuantType] = {
    t.base: t.qtype for t in _TABLE
    if t.base is not None and t.quantized and TYPE_TRAITS[t.base].block_size == t.block_size}

_BY_NAME: dict[str, QuantType] = {t.name.lower(): t.qtype for t in _TABLE}
_BY_NAME["q1_0"] = T.Q1_0          # mainline's name for the same layout


def traits(qtype: QuantType | int) -> TypeTraits:
    """Traits of a type id; raises for ids no project defines."""
    t = TYPE_TRAITS.get(qtype)          # an int finds its member: IntEnum hashes and compares as int
    return t if t is not None else TYPE_TRAITS[QuantType(qtype)]


def is_known_type_id(type_id: int) -> bool:
    return type_id in QuantType._value2member_map_


def file_types() -> list[TypeTraits]:
    """The types a GGUF file can hold (activation-only formats left out), in table order."""
    return [t for t in _TABLE if t.in_files]


def loads(qtype: QuantType | int, flavor: str) -> bool:
    """Whether ``flavor``'s llama.cpp (PROJECTS) loads a file holding ``qtype``."""
    return flavor in traits(qtype).loads


def type_name_suggestion(text: str) -> str:
    """' (did you mean q4_K?)' for a mistyped type name, or ''."""
    hint = did_you_mean(text, {t.name: t.name for t in file_types()})
    return f" ({hint})" if hint else ""


def type_from_name(name: str) -> QuantType:
    """Accept a ggml type name case-insensitively (``Q4_K``, ``iq2_k_r4``); ValueError otherwise,
    naming the nearest type names."""
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown tensor type '{name}'{type_name_suggestion(name)}") from None


def type_name(qtype: QuantType | int) -> str:
    """Canonical printed name (``q4_K``, ``iq2_k_r4``)."""
    return traits(qtype).name


def tensor_nbytes(qtype: QuantType | int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml shape ``ne`` (ne[0] = row length) stored as ``qtype``."""
    t = traits(qtype)
    n_rows = 1
    for n in shape[1:]:
        n_rows *= n
    return n_rows * t.row_size(shape[0]) if shape else t.row_size(1)
