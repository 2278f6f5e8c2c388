"""ctypes access to the reference implementation shipped in the PyPI wheel ``ik-llama-cpp-python``.

Tests compare quantkit against the real ik_llama.cpp code: type traits, row sizes, dequantization,
``ggml_quantize_chunk`` (with and without an imatrix), the ``llama-quantize`` executable and model
logits.  Everything is skip-friendly: :func:`load_ggml` returns None when the wheel is absent.

Facts about the wheel (0.1.5) that this module relies on:

* ``ik_llama_cpp/lib/libggml.so`` is loaded here; ``libllama.so`` and ``bin/llama-quantize`` link
  a second, byte-for-byte-equivalent copy ``ik_llama_cpp_python.libs/libggml-<hash>.so`` (auditwheel).
  The two copies keep separate global state, so this module initializes its own copy.
* ``ggml_type_traits_t`` is 128 bytes (``ggml_internal_get_type_traits`` copies 0x80 bytes and
  asserts ``type < GGML_TYPE_COUNT`` = 400, aborting the process otherwise).
* The installed ``include/ggml.h`` declares ``ggml_quantize_chunk`` with 7 arguments, current
  ik_llama.cpp sources with 8 (``const quantize_user_data *``).  We always pass 8 with a NULL last
  argument: on x86-64 SysV the 7th and 8th arguments travel on the stack and the caller pops
  them, so this is correct for both declarations.
* ``GGML_ASSERT`` failures abort the whole interpreter, so every wrapper checks its inputs first.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np

GGML_TYPE_COUNT = 400   # ik_llama.cpp's enum ggml_type ends at Q8_K_R8 = 399


# ---- wheel layout ----

def wheel_dir() -> Path | None:
    """``site-packages/ik_llama_cpp`` or None when the wheel is not installed."""
    spec = importlib.util.find_spec("ik_llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def llama_quantize_bin() -> Path | None:
    """Path of the wheel's ``llama-quantize`` executable (None if absent or not runnable)."""
    d = wheel_dir()
    if d is None:
        return None
    exe = d / "bin" / "llama-quantize"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return None
    return exe


def llama_quantize_runs() -> bool:
    """True when ``llama-quantize --help`` starts (it exits 1 after printing its usage)."""
    exe = llama_quantize_bin()
    if exe is None:
        return False
    try:
        r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "usage:" in (r.stdout + r.stderr)


# ---- ctypes declarations (include/ggml.h of the wheel) ----

_to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
_from_float_t = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64)


class GGMLTypeTraits(ctypes.Structure):
    """``ggml_type_traits_t`` (128 bytes on x86-64)."""
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
        ("from_float_to_mat", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
        ("ncols", ctypes.c_int64),
        ("gemv", ctypes.c_void_p),
        ("gemm", ctypes.c_void_p),
        ("row_meta_size", ctypes.c_int64),
    ]


assert ctypes.sizeof(GGMLTypeTraits) == 128


class _InitParams(ctypes.Structure):
    """``struct ggml_init_params``."""
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class GGML:
    """The wheel's libggml.so with the few entry points the tests need."""

    def __init__(self, path: Path):
        self.path = path
        lib = self.lib = ctypes.CDLL(str(path))
        lib.ggml_internal_get_type_traits.argtypes = [ctypes.c_int]
        lib.ggml_internal_get_type_traits.restype = GGMLTypeTraits
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_type_name.argtypes = [ctypes.c_int]
        lib.ggml_type_name.restype = ctypes.c_char_p
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        lib.ggml_validate_row_data.restype = ctypes.c_bool
        lib.ggml_init.argtypes = [_InitParams]
        lib.ggml_init.restype = ctypes.c_void_p
        lib.ggml_free.argtypes = [ctypes.c_void_p]
        lib.ggml_free.restype = None
        for name in ("ggml_cpu_has_fma", "ggml_cpu_has_f16c", "ggml_cpu_has_avx2", "ggml_cpu_has_avx512"):
            getattr(lib, name).restype = ctypes.c_int
        # ggml_init fills the fp16 -> fp32 lookup table (ggml_table_f32_f16) that GGML_FP16_TO_FP32
        # uses in builds without F16C intrinsics, and the GELU/SiLU tables; the context is not needed.
        ctx = lib.ggml_init(_InitParams(1024, None, True))
        if not ctx:
            raise RuntimeError(f"{path}: ggml_init failed")
        lib.ggml_free(ctx)
        self._traits: dict[int, GGMLTypeTraits | None] = {}

    # ---- traits ----
    def type_traits(self, type_id: int) -> GGMLTypeTraits | None:
        """The C traits of a type id, or None for ids the library does not define."""
        type_id = int(type_id)
        if type_id not in self._traits:
            t = None
            if 0 <= type_id < GGML_TYPE_COUNT:
                t = self.lib.ggml_internal_get_type_traits(type_id)
                if not t.type_name or t.blck_size <= 0:
                    t = None
            self._traits[type_id] = t
        return self._traits[type_id]

    def knows(self, type_id: int) -> bool:
        return self.type_traits(type_id) is not None

    def type_name(self, type_id: int) -> str:
        return self._need(type_id).type_name.decode()

    def row_size(self, type_id: int, n: int) -> int:
        t = self._need(type_id)
        if n % t.blck_size:
            raise ValueError(f"row size ({n}) is not a multiple of {t.type_name.decode()} block size "
                             f"({t.blck_size})")
        return int(self.lib.ggml_row_size(int(type_id), int(n)))

    def requires_imatrix(self, type_id: int) -> bool:
        return bool(self.lib.ggml_quantize_requires_imatrix(int(type_id)))

    def cpu_flags(self) -> dict[str, int]:
        """What the library was built for / detected: ``{"fma": 1, "f16c": 1, ...}``."""
        return {n: int(getattr(self.lib, f"ggml_cpu_has_{n}")()) for n in ("fma", "f16c", "avx2", "avx512")}

    def _need(self, type_id: int) -> GGMLTypeTraits:
        t = self.type_traits(type_id)
        if t is None:
            raise ValueError(f"ggml type id {type_id} is unknown to {self.path}")
        return t

    # ---- conversion ----
    def to_float(self, type_id: int, data: bytes | np.ndarray, n_elements: int,
                 n_per_row: int | None = None) -> np.ndarray:
        """Dequantize ``n_elements`` values with the type's ``to_float``, one row per call.

        ``n_per_row`` defaults to ``n_elements`` (a single row).  Row-interleaved types need whole
        groups of ``interleave`` rows per call, so those are converted a group at a time.
        """
        t = self._need(type_id)
        if int(type_id) == 0:       # f32 has no to_float: the bytes are the values
            return np.frombuffer(bytes(data), np.float32, count=n_elements).copy()
        if not t.to_float:
            raise ValueError(f"{t.type_name.decode()} has no to_float")
        n_per_row = n_elements if n_per_row is None else n_per_row
        if n_per_row <= 0 or n_elements % n_per_row:
            raise ValueError(f"{n_elements} elements do not split into rows of {n_per_row}")
        n_rows = n_elements // n_per_row
        row_bytes = self.row_size(type_id, n_per_row)
        buf = np.frombuffer(bytes(data) if not isinstance(data, np.ndarray) else data.tobytes(), np.uint8)
        if buf.size != n_rows * row_bytes:
            raise ValueError(f"{t.type_name.decode()}: {n_rows} rows of {n_per_row} need "
                             f"{n_rows * row_bytes} bytes, got {buf.size}")
        group = _interleave_rows(t.type_name.decode())
        if n_rows % group:
            raise ValueError(f"{t.type_name.decode()} converts groups of {group} rows, got {n_rows} rows")
        fn = _to_float_t(t.to_float)
        out = np.empty(n_elements, np.float32)
        src0, dst0 = buf.ctypes.data, out.ctypes.data
        for r in range(0, n_rows, group):
            dst = ctypes.cast(dst0 + 4 * r * n_per_row, ctypes.POINTER(ctypes.c_float))
            fn(src0 + r * row_bytes, dst, group * n_per_row)
        return out

    def quantize_chunk(self, type_id: int, x: np.ndarray, imatrix: np.ndarray | None = None) -> bytes:
        """``ggml_quantize_chunk(type, x, dst, 0, nrows, n_per_row, imatrix, NULL)`` on a 2-D array."""
        t = self._need(type_id)
        name = t.type_name.decode()
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2:
            raise ValueError(f"expected a 2-D array (rows, n_per_row), got shape {x.shape}")
        nrows, n_per_row = x.shape
        if n_per_row % t.blck_size:
            raise ValueError(f"row size ({n_per_row}) is not a multiple of {name} block size ({t.blck_size})")
        if nrows % _interleave_rows(name):
            raise ValueError(f"{name} needs a multiple of {_interleave_rows(name)} rows, got {nrows}")
        if imatrix is None and self.requires_imatrix(type_id):
            raise ValueError(f"{name} cannot be quantized without an imatrix")
        imat_p = None
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
            if imatrix.size != n_per_row:
                raise ValueError(f"imatrix has {imatrix.size} values, rows have {n_per_row}")
            imat_p = imatrix.ctypes.data
        out = np.zeros(nrows * self.row_size(type_id, n_per_row), np.uint8)
        n = self.lib.ggml_quantize_chunk(int(type_id), x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row,
                                         imat_p, None)
        if n != out.size:
            raise RuntimeError(f"ggml_quantize_chunk({name}) wrote {n} bytes, expected {out.size}")
        return out.tobytes()

    def validate_row_data(self, type_id: int, data: bytes) -> bool:
        buf = np.frombuffer(data, np.uint8)
        return bool(self.lib.ggml_validate_row_data(int(type_id), buf.ctypes.data, buf.size))


def _interleave_rows(name: str) -> int:
    for suffix, n in (("_r16", 16), ("_r8", 8), ("_r4", 4)):
        if name.lower().endswith(suffix):
            return n
    return 1


@lru_cache(maxsize=None)
def load_ggml() -> GGML | None:
    """The wheel's libggml.so wrapped once per process, or None when the wheel is not installed."""
    d = wheel_dir()
    if d is None:
        return None
    path = d / "lib" / "libggml.so"
    if not path.is_file():
        return None
    try:
        return GGML(path)
    except OSError:
        return None


# module-level conveniences (tests call these after skipping when load_ggml() is None)

def type_traits(type_id: int) -> GGMLTypeTraits | None:
    return _lib().type_traits(type_id)


def row_size(type_id: int, n: int) -> int:
    return _lib().row_size(type_id, n)


def to_float(type_id: int, data: bytes, n_elements: int, n_per_row: int | None = None) -> np.ndarray:
    return _lib().to_float(type_id, data, n_elements, n_per_row)


def quantize_chunk(type_id: int, x2d: np.ndarray, imatrix: np.ndarray | None = None) -> bytes:
    return _lib().quantize_chunk(type_id, x2d, imatrix)


def _lib() -> GGML:
    lib = load_ggml()
    if lib is None:
        raise RuntimeError("ik-llama-cpp-python is not installed (pip install ik-llama-cpp-python)")
    return lib


# ---- model evaluation through the wheel's llama API ----

_log_cb = None      # keeps the no-op logger alive for the life of the process


def _silence_llama(C) -> None:
    """Route libllama's (and its ggml copy's) log output to a no-op callback, once."""
    global _log_cb
    if _log_cb is not None:
        return
    proto = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    _log_cb = proto(lambda level, text, user: None)
    fn = C._lib.llama_log_set
    fn.argtypes = [proto, ctypes.c_void_p]
    fn.restype = None
    fn(_log_cb, None)


class IkSession:
    """One model file loaded by the wheel's llama API with one context, fed token batches through
    its KV cache (CPU, flash attention off: the wheel's IQK flash-attention path asserts on CPUs
    without AVX-VNNI)."""

    def __init__(self, model_path: str | os.PathLike, n_ctx: int, n_threads: int = 4):
        from ik_llama_cpp import _ctypes_api as C
        from ik_llama_cpp._internals import IkContext, IkModel

        self.C = C
        _silence_llama(C)
        self.model = IkModel(str(model_path), use_mmap=True, n_gpu_layers=0)
        try:
            self.n_vocab = self.model.n_vocab
            self.ctx = IkContext(self.model, n_ctx=max(32, (n_ctx + 31) // 32 * 32), n_threads=n_threads,
                                 flash_attn=False)
        except BaseException:
            self.model.close()
            raise
        self.n_past = 0

    def decode(self, tokens: list[int], all_positions: bool = False) -> np.ndarray:
        """Feed ``tokens`` at the next positions: logits (n_tokens, n_vocab), or (n_vocab,) of the
        last token."""
        C, n = self.C, len(tokens)
        if not tokens:
            raise ValueError("no tokens")
        batch = C.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, tok in enumerate(tokens):
                if not 0 <= tok < self.n_vocab:
                    raise ValueError(f"token {tok} is outside the vocabulary ({self.n_vocab})")
                batch.token[i] = tok
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if (all_positions or i == n - 1) else 0
            ret = self.ctx.decode(batch)
            if ret != 0:
                raise RuntimeError(f"llama_decode returned {ret}")
        finally:
            C.llama_batch_free(batch)
        self.n_past += n
        rows = range(n) if all_positions else [n - 1]
        out = np.empty((len(rows), self.n_vocab), np.float32)
        for k, i in enumerate(rows):
            p = self.ctx.get_logits(i)
            if not p:
                raise RuntimeError(f"no logits for position {i}")
            out[k] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
        return out if all_positions else out[0]

    def close(self) -> None:
        try:
            self.ctx.close()
        finally:
            self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def ik_logits(model_path: str | os.PathLike, tokens: list[int], *, all_positions: bool = False,
              n_threads: int = 4) -> np.ndarray:
    """Logits of ik_llama.cpp for one sequence: (n_vocab,) for the last position, or (n_tokens, n_vocab),
    with ``n_ctx`` just large enough for the tokens."""
    if not tokens:
        raise ValueError("no tokens")
    with IkSession(model_path, len(tokens), n_threads) as s:
        return s.decode(list(tokens), all_positions)


def ik_greedy(model_path: str | os.PathLike, tokens: list[int], n: int, n_threads: int = 4) -> list[int]:
    """ik_llama.cpp's greedy continuation of ``tokens``: the prompt in one batch, then each chosen
    token fed alone through the KV cache (as llama-cli generates)."""
    out = []
    with IkSession(model_path, len(tokens) + n, n_threads) as s:
        logits = s.decode(list(tokens))
        for i in range(n):
            out.append(int(np.argmax(logits)))
            if i + 1 < n:
                logits = s.decode(out[-1:])
    return out


class IkVocab:
    """ik_llama.cpp's tokenizer of one model file, loaded once (``vocab_only``) for many calls.

    Wraps ``llama_tokenize``, ``llama_token_to_piece``, ``llama_detokenize``, ``llama_token_get_attr``
    and ``llama_token_is_eog`` of the wheel's libllama (ik_llama.cpp takes the model pointer where
    mainline takes the vocab, except in ``llama_detokenize``).
    """

    def __init__(self, model_path: str | os.PathLike):
        from ik_llama_cpp import _ctypes_api as C

        _silence_llama(C)
        C.llama_backend_init()
        params = C.llama_model_default_params()
        params.vocab_only = True
        params.use_mmap = True
        self._C, self._lib = C, C._lib
        self._model = C.llama_model_load_from_file(str(model_path).encode("utf-8"), params)
        if not self._model:
            raise RuntimeError(f"ik_llama.cpp cannot load the vocabulary of {model_path}")
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab = C.llama_vocab_n_tokens(self._vocab)
        lib = self._lib
        lib.llama_detokenize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                         ctypes.c_char_p, ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
        lib.llama_detokenize.restype = ctypes.c_int32
        lib.llama_token_get_attr.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.llama_token_get_attr.restype = ctypes.c_int

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = False) -> list[int]:
        """``llama_tokenize(text, add_special=add_bos, parse_special=special)``."""
        data = text.encode("utf-8")
        n = self._C.llama_tokenize(self._model, data, len(data), None, 0, add_bos, special)
        buf = (self._C.llama_token * max(1, abs(n)))()
        n = self._C.llama_tokenize(self._model, data, len(data), buf, len(buf), add_bos, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """``llama_token_to_piece(token, lstrip=0, special)`` as raw bytes."""
        buf = ctypes.create_string_buffer(256)
        n = self._C.llama_token_to_piece(self._model, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._C.llama_token_to_piece(self._model, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> bytes:
        """``llama_detokenize`` as raw bytes."""
        arr = (ctypes.c_int32 * max(1, len(tokens)))(*tokens)
        size = 64 + 8 * len(tokens)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_detokenize(self._vocab, arr, len(tokens), buf, size, remove_special,
                                           unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def attr(self, token: int) -> int:
        """``llama_token_get_attr``: the LLAMA_TOKEN_ATTR_* bits."""
        return int(self._lib.llama_token_get_attr(self._model, token))

    def is_eog(self, token: int) -> bool:
        return bool(self._C.llama_token_is_eog(self._model, token))

    def close(self) -> None:
        if self._model:
            self._C.llama_free_model(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def ik_tokenize(model_path: str | os.PathLike, text: str, *, add_bos: bool = True,
                special: bool = False) -> list[int]:
    """Tokens of ``text`` with the model's own tokenizer (vocab-only load); ``special`` parses
    control-token texts such as ``<|im_start|>`` (``parse_special``)."""
    with IkVocab(model_path) as vocab:
        return vocab.tokenize(text, add_bos=add_bos, special=special)


def ik_unicode_flags():
    """ik_llama.cpp's ``unicode_cpt_flags_from_cpt(cpt)`` as a python function returning the flag bits
    (``unicode_cpt_flags::as_uint``: category bits 0x01..0x80, 0x100 whitespace, then lower/upper/nfd),
    or None when the wheel or the symbol is missing.

    The function is C++ (``unicode.h``) but exported from libllama.so under its Itanium-mangled name;
    the 2-byte bitfield struct it returns travels in a register on x86-64, hence ``c_uint16``.
    """
    if wheel_dir() is None:
        return None
    try:
        from ik_llama_cpp import _ctypes_api as C
        fn = C._lib._Z26unicode_cpt_flags_from_cptj
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint32]
    fn.restype = ctypes.c_uint16
    return fn
