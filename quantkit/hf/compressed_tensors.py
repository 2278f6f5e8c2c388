"""compressed-tensors' ``pack-quantized`` int4 weights (Kimi-K2's routed experts), decoded exactly.

Kimi-K2 (Thinking, 2.5, 2.6) ships its routed experts quantized by llm-compressor, as its
config.json says::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                    "symmetric": true, "dynamic": false, "actorder": null, ...}}},
      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", ...]}

That one scheme is read; any other (other bits, group sizes, asymmetric zero points, activation or
kv-cache quantization, sparsity, transforms, several groups) is refused in one line. Which modules
are quantized is read from the tensors themselves, as convert_hf_to_gguf.py does: a Linear ``X``
stored as ``X.weight_packed`` instead of ``X.weight`` is (the ``ignore`` list only says which were
left alone). Per such Linear of HF shape (rows, cols)::

    X.weight_packed  I32       (rows, cols / 8)   column c of row r in bits 4*(c % 8) .. 4*(c % 8) + 3
                                                   of word c // 8, as the unsigned code q + 8
    X.weight_scale   BF16/F16/F32 (rows, cols / 32)  one scale per 32 consecutive columns
    X.weight_shape   I32/I64   (2,)               [rows, cols]

(compressed-tensors' ``pack_to_int32`` / ``unpack_from_int32``). The weight is ``q * scale`` with
q in [-8, 7]; every size is checked against config.json before anything is decoded.

Exactness. A 4-bit integer times a bfloat16 or float16 scale needs at most 11 + 3 significant bits,
so the float32 product is the exact value (compressed-tensors' own decompressor rounds it to the
scale's dtype; mainline convert_hf_to_gguf.py computes it in float32, as here). The decoded tensor
is therefore F32.

q4_0 without a loss (what published Kimi "Q4_X" quants are). A ggml ``block_q4_0`` is an fp16 ``d``
and 32 unsigned nibbles n decoding to ``d * (n - 8)``: exactly one int4 group, stored the same way
(n = q + 8), with elements j and j + 16 sharing byte j. So a group whose scale is exactly a
float16 is copied bit for bit: the nibbles as they are, the scale converted to fp16 without a
rounding. jukofyork's "Q4_X" patch to llama.cpp (``d = max / -7`` in quantize_row_q4_0_ref, the
reference quantizer used instead of ik's iqk_quantize_q4_0) recovers the same values (its d is
-scale where the group's extreme is positive) from the dequantized BF16 model only where a group's
largest |code| is 7 and every q * scale survived the rounding to BF16; copying holds for every group. A scale that is not exactly a
float16 (outside float16's range, or a float32 scale with more bits) is refused when a q4_0 block
is asked for it: q4_0 cannot hold that group losslessly, so the user chooses another type for it.
"""
from __future__ import annotations

import numpy as np

from ..errors import QuantkitError
from ..types import QuantType, traits
from .config import Fields, describe
from .lazy import Lazy, read_rows_at
from .safetensors import SafeTensor

GROUP = 32                  # the one group size read: a q4_0 block
PACK = 8                    # int4 codes per int32 word
SCALE_DTYPES = ("BF16", "F16", "F32")
SUFFIXES = ("_packed", "_scale", "_shape")
# the scheme's settings, as llm-compressor writes them for Kimi-K2: each present with this value
WEIGHT_SCHEME = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": True}
WEIGHT_OFF = ("dynamic", "actorder", "block_structure")     # false/null: no g_idx, static scales
SCHEME = "pack-quantized int4 weights, symmetric, in groups of 32 (Kimi-K2's)"


def check_scheme(q: Fields) -> None:
    """Refuse every compressed-tensors configuration but Kimi-K2's weight-only int4 scheme."""
    def refuse(what: str):
        raise QuantkitError(f"{q.where}: quantization_config {what} is not supported (compressed-tensors: "
                            f"only {SCHEME})")

    fmt = q.raw.get("format")
    if fmt != "pack-quantized":
        refuse(f"format {describe(fmt)}")
    status = q.raw.get("quantization_status", "compressed")
    if status != "compressed":
        refuse(f"quantization_status {describe(status)}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.raw.get(key):
            refuse(f"{key} {describe(q.raw[key])}")
    groups = q.object("config_groups").raw
    if len(groups) != 1 or not isinstance(next(iter(groups.values())), dict):
        refuse(f"config_groups with {len(groups)} groups" if len(groups) != 1 else "config_groups")
    name, group = next(iter(groups.items()))
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            refuse(f"config_groups.{name}.{key} {describe(group[key])}")
    if group.get("format", fmt) != fmt:
        refuse(f"config_groups.{name}.format {describe(group['format'])}")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        refuse(f"config_groups.{name}.weights {describe(weights)}")
    for key, want in WEIGHT_SCHEME.items():
        got = weights.get(key)
        if got != want or type(got) is not type(want):
            refuse(f"config_groups.{name}.weights.{key} {describe(got)}")
    for key in WEIGHT_OFF:
        if weights.get(key):
            refuse(f"config_groups.{name}.weights.{key} {describe(weights[key])}")


def is_packed(tensors: dict[str, SafeTensor], name: str) -> bool:
    """Whether the Linear weight ``name`` (``....weight``) is stored pack-quantized."""
    return name.endswith(".weight") and name + "_packed" in tensors


def open_packed(tensors: dict[str, SafeTensor], name: str, shape: tuple[int, ...] | None, where) -> "PackedInt4":
    """The pack-quantized weight ``name`` of HF shape ``shape`` (what config.json implies), its three
    tensors checked against that shape and against each other before any is read."""
    packed, scale, stored_shape = (tensors.get(name + s) for s in SUFFIXES)
    what = f"{where}: pack-quantized '{name}'"
    if scale is None or stored_shape is None:
        raise QuantkitError(f"{what} has no {name + ('_scale' if scale is None else '_shape')}")
    if shape is None:
        shape = (packed.shape[0], packed.shape[-1] * PACK) if len(packed.shape) == 2 else tuple(packed.shape)
    if len(shape) != 2:
        raise QuantkitError(f"{what}: config.json implies shape {list(shape)}; only matrices are pack-quantized")
    rows, cols = shape
    if cols % GROUP:
        raise QuantkitError(f"{what}: rows of {cols} columns are not whole groups of {GROUP}")
    expect = {"_packed": (("I32",), (rows, cols // PACK)), "_scale": (SCALE_DTYPES, (rows, cols // GROUP)),
              "_shape": (("I32", "I64"), (2,))}
    for suffix, t in zip(SUFFIXES, (packed, scale, stored_shape)):
        dtypes, want = expect[suffix]
        if t.dtype not in dtypes or tuple(t.shape) != want:
            raise QuantkitError(f"{what}: '{name + suffix}' is {t.dtype} {list(t.shape)}; config.json's "
                                f"{list(shape)} needs {' or '.join(dtypes)} {list(want)}")
    stored = [int(v) for v in np.asarray(stored_shape.data).reshape(-1)]
    if stored != [rows, cols]:
        raise QuantkitError(f"{what}: '{name}_shape' says {stored} but config.json implies {[rows, cols]}")
    return PackedInt4(packed, scale)


def scales_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored scales (their raw bits) as float32: exact for every dtype read."""
    if dtype == "BF16":
        return (np.asarray(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(raw).astype(np.float32)


def packed_bytes(packed: np.ndarray) -> np.ndarray:
    """int32 words (n, cols / 8) as their bytes (n, cols / 2): the little-endian words as stored, so
    byte k holds column 2k in its low nibble and column 2k + 1 in its high one."""
    return np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """int32 words (n, cols / 8) as their unsigned 4-bit codes q + 8, (n, cols) uint8."""
    b = packed_bytes(packed)
    codes = np.empty((b.shape[0], 2 * b.shape[1]), np.uint8)
    np.bitwise_and(b, 0xF, out=codes[:, 0::2])
    np.right_shift(b, 4, out=codes[:, 1::2])
    return codes


CODE_VALUES = np.arange(-8, 8, dtype=np.float32)        # code q + 8 -> q


def decode(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(n, cols) codes and (n, cols / 32) float32 scales: the weights q * scale, float32."""
    n, cols = codes.shape
    x = CODE_VALUES[codes].reshape(n, cols // GROUP, GROUP)
    x *= scale[:, :, None]
    return x.reshape(n, cols)


def q4_0_rows(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """The q4_0 rows (n, cols / 32 * 18) uint8 holding exactly these groups, and None; or None and
    (row, group) of the first scale that is not exactly a float16.

    A group's 16 stored bytes b hold columns 2k, 2k + 1 in byte k; q4_0's byte j holds columns j and
    j + 16. So q4_0 byte 2k is (b[k] & 0xF) | (b[k + 8] << 4) and byte 2k + 1 is
    (b[k] >> 4) | (b[k + 8] & 0xF0): the nibbles move, none changes."""
    b = packed_bytes(packed)
    n, nb = b.shape[0], b.shape[1] // (GROUP // 2)
    with np.errstate(over="ignore", invalid="ignore"):
        d = scale.astype(np.float16)
    exact = (d.astype(np.float32) == scale) & np.isfinite(d)
    if not exact.all():
        row, group = np.argwhere(~exact)[0]
        return None, (int(row), int(group))
    lo, hi = b.reshape(n, nb, GROUP // 2)[:, :, :8], b.reshape(n, nb, GROUP // 2)[:, :, 8:]
    out = np.empty((n, nb, 2 + GROUP // 2), np.uint8)
    out[:, :, :2] = d.astype("<f2").view(np.uint8).reshape(n, nb, 2)
    out[:, :, 2::2] = (lo & 0xF) | (hi << 4)
    out[:, :, 3::2] = (lo >> 4) | (hi & 0xF0)
    return out.reshape(n, -1), None


class PackedInt4(Lazy):
    """A pack-quantized Linear weight: rows decoded to float32, or copied into q4_0 blocks."""

    exact_types = frozenset({QuantType.Q4_0})

    def __init__(self, packed: SafeTensor, scale: SafeTensor):
        self.packed, self.scale = packed, scale
        self.qtype = QuantType.F32
        self.n_rows, self.n_per_row = packed.shape[0], packed.shape[1] * PACK

    def _codes_scales(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (unpack_codes(read_rows_at(self.packed, index)),
                scales_f32(read_rows_at(self.scale, index), self.scale.dtype))

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        if not len(index):
            return np.empty((0, self.n_per_row), np.float32)
        return decode(*self._codes_scales(index))

    def take_exact(self, qtype: QuantType, index: np.ndarray, name: str, row_offset: int = 0) -> np.ndarray | None:
        if qtype != QuantType.Q4_0:
            return None
        index = np.asarray(index)
        if not len(index):
            return np.empty((0, traits(qtype).row_size(self.n_per_row)), np.uint8)
        scale = scales_f32(read_rows_at(self.scale, index), self.scale.dtype)
        blocks, bad = q4_0_rows(read_rows_at(self.packed, index), scale)
        if bad is not None:
            row, group = bad
            cols = f"{group * GROUP}-{group * GROUP + GROUP - 1}"
            raise QuantkitError(
                f"tensor '{name}': row {row_offset + int(index[row])}, columns {cols}: the int4 group scale "
                f"{float(scale[row, group])!r} of '{self.scale.name}' is not exactly a float16, so q4_0 cannot hold "
                "this group without a loss; give these tensors another type (q8_0, bf16, f32 ...)")
        return blocks
