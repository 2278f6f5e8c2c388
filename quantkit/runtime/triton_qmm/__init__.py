"""Fused Triton kernels for the torch backend: decode a tile of quantized weight rows in registers
and multiply it, never writing the decoded rows (issue 28, target 4).

    available() -> bool          triton importable, and a CUDA device or Triton's CPU interpreter
    supports(qtype) -> bool      a decoder exists for qtype (registry.DECODERS)
    qdecode(w, qtype, n_per_row) -> float32 (N, n_per_row)      equal to formats.dequantize bit for bit
    qmatmul(x, w, qtype) -> float32 (M, N)                      x (M, K) @ decoded(w)^T, fused
                                                                (decoded tiles, then a matmul,
                                                                above FUSED_BATCH tokens)

``w`` is the uint8 tensor (N, row_bytes) of a weight in its stored layout, on the device; ``x``
float32 activations there.  The kernels (template.py) take a per-type decoder (decoders.py: the
contract; legacy.py, kquants.py, ...: the decoders).

Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors, which is
how the tests check them where there is no GPU.  Triton reads the variable when a ``@triton.jit``
decorator runs, i.e. when this package's kernel modules are first imported: they are imported
lazily, on the first qdecode / qmatmul / supports call, so setting the variable any time before
that works (tests/test_triton_qmm.py sets it when pytest imports the test module, in every
pytest-xdist worker, before any test runs).  Nothing imports triton or torch until then.
"""
from __future__ import annotations

import os
from functools import lru_cache

from ...types import QuantType


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


@lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    """Whether the kernels can run: triton importable, and a CUDA device or the interpreter."""
    if not _triton_importable():
        return False
    if interpreting():
        return True
    import torch
    return torch.cuda.is_available()


def _decoders():
    from .registry import DECODERS
    return DECODERS


def supports(qtype) -> bool:
    """Whether qtype has a decoder here (False where triton is missing)."""
    if not _triton_importable():
        return False
    try:
        qtype = QuantType(qtype)
    except ValueError:
        return False
    return qtype in _decoders()


def _decoder(qtype):
    dec = _decoders().get(QuantType(qtype))
    if dec is None:
        raise ValueError(f"no Triton decoder for type {QuantType(qtype).name}")
    return dec


_TABLES: dict = {}


def _tables(qtype, dec, device):
    """The decoder's tables as float32 tensors on ``device`` (uploaded once), padded to two; an
    unused slot gets a one-element tensor (the kernels need a pointer)."""
    import numpy as np
    import torch
    key = (QuantType(qtype), str(device))
    hit = _TABLES.get(key)
    if hit is None:
        ts = [torch.from_numpy(np.ascontiguousarray(t, np.float32)).to(device) for t in dec.tables]
        while len(ts) < 2:
            ts.append(torch.zeros(1, dtype=torch.float32, device=device))
        hit = _TABLES[key] = tuple(ts)
    return hit


def _check_weights(w, dec, n_per_row: int) -> None:
    import torch
    if w.dtype != torch.uint8 or w.dim() != 2:
        raise ValueError(f"weights must be a 2-D uint8 tensor, got {w.dtype} {tuple(w.shape)}")
    if n_per_row <= 0 or n_per_row % dec.block_values:
        raise ValueError(f"row size {n_per_row} is not a positive multiple of {dec.block_values}")
    if w.shape[1] != dec.row_bytes(n_per_row):
        raise ValueError(f"{w.shape[1]} bytes per row, expected {dec.row_bytes(n_per_row)} for {n_per_row} values")


def qdecode(w, qtype, n_per_row: int):
    """uint8 (N, row_bytes) -> float32 (N, n_per_row), on w's device."""
    import torch
    import triton
    from .template import decode_kernel
    dec = _decoder(qtype)
    _check_weights(w, dec, n_per_row)
    w = w.contiguous()
    n = w.shape[0]
    out = torch.empty((n, n_per_row), dtype=torch.float32, device=w.device)
    if n == 0:
        return out
    t0, t1 = _tables(qtype, dec, w.device)
    bn = 16
    decode_kernel[(triton.cdiv(n, bn), n_per_row // dec.block_values)](
        w, out, t0, t1, n, w.shape[1], n_per_row,
        DECODE=dec.fn, QK=dec.block_values, BLOCK_BYTES=dec.block_bytes, META=dec.row_meta_bytes, BN=bn,
        enable_fp_fusion=False)     # no fused multiply-adds on a GPU: (d * scale) * q - m rounds as ggml's
    return out


# at most this many tokens go through the per-token kernel (weights read once per token); more
# through tl.dot tiles
FEW_TOKENS = 4
# above this many tokens: tiles of rows decoded (qdecode), then a float32 matmul (cuBLAS on CUDA).
# On an H200 (bench/gpu_kernels.py, 28672 x 8192, 512 tokens) that took 5.1-5.8 ms a type (about
# 46 TFLOP/s) where the tl.dot kernel took 12-135 ms: its IEEE float32 tl.dot does not use the
# tensor cores
FUSED_BATCH = 16
DECODED_TILE_VALUES = 1 << 26          # values of one decoded tile (256 MB of float32)


def tiles(block_values: int, m: int) -> dict:
    """The launch geometry of qmatmul for m tokens: BN rows (BM tokens) per program, NB blocks of a
    row per step of the per-token kernel, warps.  The per-token geometry is the fastest that
    bench/gpu_kernels.py --sweep measured on an H200 (a 28672 x 8192 weight, GB/s of weights read):
    q8_0 1697 at BN 16 / NB 8 / 4 warps (1082 at the earlier BN 32 / NB 1), f16 473 (236); q4_K 436
    at BN 4 / NB 4 / 4 warps (297 at BN 8 / NB 1; 8 warps were slower for every 256-value type),
    iq4_k 396 (262), iq2_xxs 93 (84).  The tl.dot geometry keeps both kernels of the legacy and
    k-quant types at <= 128 registers (per-token) and without spills (tl.dot, but for IQ4_XS's few
    hundred bytes), in < 100 KB of shared memory (bench/triton_compile.py)."""
    if block_values > 32:
        return dict(BN=4, NB=4, num_warps=4) if m <= FEW_TOKENS else dict(BM=16, BN=16, num_warps=8)
    if m <= FEW_TOKENS:
        return dict(BN=16, NB=8, num_warps=4)
    return dict(BM=16, BN=64, num_warps=4)              # FEW_TOKENS < m <= FUSED_BATCH


def qmatmul(x, w, qtype):
    """x float32 (M, K) @ decode(w)^T -> float32 (M, N): fused (the decoded rows stay in registers)
    up to FUSED_BATCH tokens, decoded tiles of rows and a float32 matmul above."""
    import torch
    import triton
    from .template import qmm_kernel, qmv_kernel
    dec = _decoder(qtype)
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D, got shape {tuple(x.shape)}")
    m, k = x.shape
    _check_weights(w, dec, k)
    x = x.to(torch.float32).contiguous()
    w = w.contiguous()
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if m > FUSED_BATCH:
        tile = max(1, DECODED_TILE_VALUES // k)
        if n <= tile:
            return x @ qdecode(w, qtype, k).T
        for r0 in range(0, n, tile):
            out[:, r0:r0 + tile] = x @ qdecode(w[r0:r0 + tile], qtype, k).T
        return out
    t0, t1 = _tables(qtype, dec, w.device)
    # fused multiply-adds allowed: the products agree to summation-order tolerance, not bit for bit
    geometry = dict(DECODE=dec.fn, QK=dec.block_values, BLOCK_BYTES=dec.block_bytes, META=dec.row_meta_bytes,
                    enable_fp_fusion=True)
    tile = tiles(dec.block_values, m)
    if m <= FEW_TOKENS:
        qmv_kernel[(triton.cdiv(n, tile["BN"]), m)](x, w, out, t0, t1, n, k, w.shape[1], x.stride(0),
                                                    out.stride(0), **tile, **geometry)
    else:
        qmm_kernel[(triton.cdiv(n, tile["BN"]), triton.cdiv(m, tile["BM"]))](
            x, w, out, t0, t1, m, n, k, w.shape[1], x.stride(0), out.stride(0), **tile, **geometry)
    return out
