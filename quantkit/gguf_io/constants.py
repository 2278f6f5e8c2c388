"""GGUF container constants (ggml/src/gguf.cpp, docs/gguf.md)."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 63          # GGML_MAX_NAME is 64 including the NUL

KEY_ALIGNMENT = "general.alignment"
KEY_ARCHITECTURE = "general.architecture"
KEY_FILE_TYPE = "general.file_type"
KEY_QUANT_VERSION = "general.quantization_version"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"
SPLIT_KEYS = (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS)

# <prefix>-00001-of-00003.gguf (llama_split_path)
SPLIT_NAME_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format of each scalar type, little-endian
SCALAR_FORMAT: dict[ValueType, str] = {
    ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
    ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d",
}
SCALAR_SIZE = {t: struct.calcsize(f) for t, f in SCALAR_FORMAT.items()}
# numpy dtype of each scalar type, for arrays of numbers
SCALAR_DTYPE: dict[ValueType, str] = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4", ValueType.BOOL: "?",
    ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8",
}


class StringArray(list):
    """A string array as a file stores it: a list of the strings, which also keeps the array's
    encoded items (each string's u64 length and UTF-8 bytes) and the strings they encode, so that
    a writer copies a vocabulary it did not change (100k+ strings: ~50 ms to encode again) as
    those bytes.  Change it freely: :meth:`encoded_if_unchanged` then answers None."""

    def __init__(self, strings: list[str], encoded: bytes):
        super().__init__(strings)
        self._encoded, self._read = encoded, tuple(strings)

    def encoded_if_unchanged(self) -> bytes | None:
        """The encoded items, if the list still holds the strings they encode (None otherwise)."""
        return self._encoded if tuple(self) == self._read else None


@dataclass(frozen=True)
class MetaValue:
    """A metadata value with its exact GGUF type (the C loader rejects a u32 key stored as i32).

    For arrays ``value`` is a list (strings) or a numpy array (numbers) and ``elem_type`` is set.
    """
    vtype: ValueType
    value: Any
    elem_type: ValueType | None = None

    def to_python(self):
        if self.vtype == ValueType.ARRAY and self.elem_type == ValueType.ARRAY:
            return [v.to_python() for v in self.value]
        if self.vtype == ValueType.ARRAY and self.elem_type != ValueType.STRING:
            return self.value.tolist()
        return self.value


def split_shard_name(prefix: str, shard_no: int, n_shards: int) -> str:
    """``prefix-00001-of-00003.gguf`` for shard_no 0 of 3 (llama_split_path)."""
    return f"{prefix}-{shard_no + 1:05d}-of-{n_shards:05d}.gguf"


def pad_to(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
