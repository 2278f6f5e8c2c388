"""Block decoders in torch: stored bytes on the device -> float32 rows on the device.

The torch backend (``ops_torch``) keeps weights in their quantized layout and decodes a tile of
rows right before each product, on whatever device the bytes live (CUDA, or the CPU in tests).
Each decoder takes ``b`` uint8 (n_rows, row_size) and returns float32 (n_rows, n_per_row); the
arithmetic follows ggml's dequantize_row_* (products in the same order: (d * scale) * q - m), so
the values equal the numba decoders' bit for bit, which the tests check type by type.

Types without a decoder here stay on the CPU (numba), like ik_llama.cpp keeps interleaved ones.
"""
from __future__ import annotations

import torch

from ..formats.iq4 import KVALUES
from ..types import QuantType

T = QuantType


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block (n, 1) as float32."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _u32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint32 at byte ``at`` of every block, as int64 (n, 1)."""
    x = b[:, at:at + 4].long()
    return x[:, 0:1] | (x[:, 1:2] << 8) | (x[:, 2:3] << 16) | (x[:, 3:4] << 24)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: low nibbles first (values 0..15), then high nibbles (16..31)."""
    q = qs.long()
    return torch.cat([q & 0xF, q >> 4], dim=-1)


def _bits(x: torch.Tensor, n: int) -> torch.Tensor:
    """Bit j of x (n, 1) for j = 0..n-1 -> (n, n_bits)."""
    return (x >> torch.arange(n, device=x.device)) & 1


def _blocks(b: torch.Tensor, type_size: int) -> torch.Tensor:
    return b.reshape(-1, type_size)


# ---- legacy: blocks of 32 ----

def _q4_0(b):
    b = _blocks(b, 18)
    return (_nibbles(b[:, 2:18]) - 8).float() * _f16(b, 0)


def _q4_1(b):
    b = _blocks(b, 20)
    return _nibbles(b[:, 4:20]).float() * _f16(b, 0) + _f16(b, 2)


def _q5_0(b):
    b = _blocks(b, 22)
    q = _nibbles(b[:, 6:22]) | (_bits(_u32(b, 2), 32) << 4)
    return (q - 16).float() * _f16(b, 0)


def _q5_1(b):
    b = _blocks(b, 24)
    q = _nibbles(b[:, 8:24]) | (_bits(_u32(b, 4), 32) << 4)
    return q.float() * _f16(b, 0) + _f16(b, 2)


def _q8_0(b):
    b = _blocks(b, 34)
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q6_0(b):
    """ik's Q6_0: d[0:2] qh[2:10] qs[10:26]; value j < 16 takes bits 4-5 from qh[j % 8] at bit
    4 * (j // 8), value j + 16 at bit 4 * (j // 8) + 2."""
    b = _blocks(b, 26)
    qh, qs = b[:, 2:10].long(), b[:, 10:26].long()
    h = torch.cat([qh & 0xF, qh >> 4], dim=-1)                  # the 4 high bits of byte j's pair
    q = torch.cat([(qs & 0xF) | ((h << 4) & 0x30), (qs >> 4) | ((h << 2) & 0x30)], dim=-1)
    return (q - 32).float() * _f16(b, 0)


# ---- k-quants: super-blocks of 256 ----

def _scale_min_k4(s: torch.Tensor):
    """Q4_K/Q5_K's 8 6-bit (scale, min) pairs from 12 bytes s (n, 12) -> two (n, 8) tensors.
    j < 4: scale = s[j] & 63, min = s[j+4] & 63; j >= 4: the low 4 bits from s[j+4], the top 2
    from the spare bits 6-7 of s[j-4] (scale) and s[j] (min)."""
    s = s.long()
    lo = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    return lo, mn


def _q2_k(b):
    """block_q2_K { scales[16] @0; qs[64] @16; d @80; dmin @82 }: 16 groups of 16, group
    g = half * 8 + shift_index * 2 + (l >= 16) reads qs[half * 32 + l] >> (2 * shift_index)."""
    b = _blocks(b, 84)
    n = b.shape[0]
    sc = b[:, 0:16].long()
    qs = b[:, 16:80].long().reshape(n, 2, 1, 32)                    # (half, 1, l)
    q = (qs >> (2 * torch.arange(4, device=b.device)).reshape(1, 1, 4, 1)) & 3   # (n, half, shift, l)
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0xF).float()).reshape(n, 2, 4, 2, 1)
    ml = (dmin * (sc >> 4).float()).reshape(n, 2, 4, 2, 1)
    y = dl * q.reshape(n, 2, 4, 2, 16).float() - ml
    return y.reshape(n, 256)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """16 6-bit scales (minus 32) from 12 bytes: scale j's low 4 bits are nibble j of bytes 0..7
    (low nibbles for j < 8), its top 2 bits are bits 2 (j // 4) .. +1 of byte 8 + j % 4."""
    s = s.long()
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=-1)
    hi = (s[:, 8:12].unsqueeze(1) >> (2 * torch.arange(4, device=s.device)).reshape(1, 4, 1)) & 3   # (n, shift, byte)
    return (low | (hi.reshape(-1, 16) << 4)) - 32


def _q3_k(b):
    """block_q3_K { hmask[32] @0; qs[64] @32; scales[12] @96; d @108 }."""
    b = _blocks(b, 110)
    n = b.shape[0]
    sc = _q3_k_scales(b[:, 96:108]).float()
    qs = b[:, 32:96].long().reshape(n, 2, 1, 32)
    shifts = (2 * torch.arange(4, device=b.device)).reshape(1, 1, 4, 1)
    low = (qs >> shifts) & 3                                               # (n, half, shift, l)
    hm = b[:, 0:32].long().reshape(n, 1, 1, 32)
    bit = (hm >> (torch.arange(8, device=b.device).reshape(1, 2, 4, 1))) & 1
    q = low - 4 * (1 - bit)
    dl = (_f16(b, 108) * sc).reshape(n, 2, 4, 2, 1)
    return (dl * q.reshape(n, 2, 4, 2, 16).float()).reshape(n, 256)


def _q45_k(b, high_bits: bool):
    """Q4_K { d @0; dmin @2; scales[12] @4; qs[128] @16 } and Q5_K (qh[32] @16, qs @48): 4 chunks
    of 64, the low nibbles of qs[32 c .. 32 c + 31] then the high ones, with scale pairs 2c, 2c+1."""
    size = 176 if high_bits else 144
    b = _blocks(b, size)
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, size - 128:size].long().reshape(n, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=2)                          # (n, chunk, nibble, l)
    if high_bits:
        qh = b[:, 16:48].long().reshape(n, 1, 1, 32)
        q = q + 16 * ((qh >> torch.arange(8, device=b.device).reshape(1, 4, 2, 1)) & 1)
    d, dmin = _f16(b, 0), _f16(b, 2)
    dl = (d * sc.float()).reshape(n, 4, 2, 1)
    ml = (dmin * mn.float()).reshape(n, 4, 2, 1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q6_k(b):
    """block_q6_K { ql[128] @0; qh[64] @128; int8 scales[16] @192; d @208 }: two halves of 128;
    in half h, value 32 k + l (k = 0..3) has low bits from ql[64 h + l + 32 (k & 1)] (nibble k >> 1)
    and high bits (qh[32 h + l] >> 2k) & 3, with scale 8 h + 2 k + l // 16."""
    b = _blocks(b, 210)
    n = b.shape[0]
    ql = b[:, 0:128].long().reshape(n, 2, 2, 32)                          # (half, l or l + 32, l)
    qh = b[:, 128:192].long().reshape(n, 2, 1, 32)
    low = torch.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    high = (qh >> (2 * torch.arange(4, device=b.device)).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)) - 32                                           # (n, half, k, l)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_f16(b, 208) * sc).reshape(n, 2, 4, 2, 1)
    return (dl * q.reshape(n, 2, 4, 2, 16).float()).reshape(n, 256)


# ---- non-linear 4-bit ----

def _iq4_table(device):
    return torch.tensor(KVALUES, dtype=torch.float32, device=device)


def _iq4_nl(b):
    b = _blocks(b, 18)
    return _iq4_table(b.device)[_nibbles(b[:, 2:18])] * _f16(b, 0)


def _iq4_xs(b):
    """block_iq4_xs { d @0; scales_h u16 @2; scales_l[4] @4; qs[128] @8 }: 8 blocks of 32, block
    ib's 6-bit scale = nibble ib of scales_l | bits 2 ib .. +1 of scales_h << 4, minus 32."""
    b = _blocks(b, 136)
    n = b.shape[0]
    sl = b[:, 4:8].long()
    low = torch.stack([sl & 0xF, sl >> 4], dim=-1).reshape(n, 8)
    sh = b[:, 2:3].long() | (b[:, 3:4].long() << 8)
    high = (sh >> (2 * torch.arange(8, device=b.device))) & 3
    dl = (_f16(b, 0) * ((low | (high << 4)) - 32).float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * _iq4_table(b.device)[q]).reshape(n, 256)


DECODERS = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q6_0: _q6_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: lambda b: _q45_k(b, False), T.Q5_K: lambda b: _q45_k(b, True),
    T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}


def can_decode(qtype) -> bool:
    return QuantType(qtype) in DECODERS or QuantType(qtype) in (T.F32, T.F16, T.BF16)


def decode(b: torch.Tensor, qtype, n_per_row: int) -> torch.Tensor:
    """uint8 (n_rows, row_size) of ``qtype`` -> float32 (n_rows, n_per_row), on b's device."""
    qtype = QuantType(qtype)
    n_rows = b.shape[0]
    if qtype == T.F32:
        return b.contiguous().view(torch.float32).reshape(n_rows, n_per_row)
    if qtype == T.F16:
        return b.contiguous().view(torch.float16).float().reshape(n_rows, n_per_row)
    if qtype == T.BF16:
        return b.contiguous().view(torch.bfloat16).float().reshape(n_rows, n_per_row)
    return DECODERS[qtype](b).reshape(n_rows, n_per_row)
