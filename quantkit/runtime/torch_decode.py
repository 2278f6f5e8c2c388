"""Block decoders in torch: stored bytes on the device -> float32 rows on the device.

The torch backend (``ops_torch``) keeps weights in their quantized layout and decodes a tile of
rows right before each product, on whatever device the bytes live (CUDA, or the CPU in tests).
Each decoder takes ``b`` uint8 (n_rows, row_size) and returns float32 (n_rows, n_per_row); the
arithmetic follows ggml's dequantize_row_* (products in the same order: (d * scale) * q - m), so
the values equal the numba decoders' bit for bit, which the tests check type by type.

Interleaved types have no decoder here by design: they stay on the CPU (numba), as ik_llama.cpp
keeps them there.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats._kt_codebook import IQ4_KT_SECOND_OFFSET, OFFSET, SPECS, trellis_values
from ..formats.iq2kl import PAIRS
from ..formats.iq4kss import BASE as IQ4KSS_BASE
from ..formats.iq4kss import SHIFTED as IQ4KSS_SHIFTED
from ..tables import A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K, IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ4NL_VALUES, IQ5NL_VALUES
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
    return torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=device)


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


# ---- ik's IQK types (formats/iqk.py draws the layouts) ----

def _unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """(n, 64) -> (n, 256) 2-bit codes in Q2_K's layout: value 128 h + 32 s + l is
    qs[32 h + l] >> 2 s."""
    q = qs.long().reshape(-1, 2, 1, 32)
    return ((q >> (2 * torch.arange(4, device=qs.device)).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _unpack_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 32) -> (n, 256): value 32 j + k is bit j of qh[k]."""
    return ((qh.long()[:, None, :] >> torch.arange(8, device=qh.device).reshape(1, 8, 1)) & 1).reshape(-1, 256)


def _unpack_nibbles_64(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) -> (n, 256): chunk c of 64 values from bytes 32 c.., low nibbles then high ones."""
    q = qs.long().reshape(-1, 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(-1, 256)


def _unpack_nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16 k) -> (n, 32 k): per 16 bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    return _nibbles(qs.reshape(-1, 16)).reshape(n, -1)


def _unpack_6bit_scales(sh: torch.Tensor, sl: torch.Tensor) -> torch.Tensor:
    """16 scales 0..63: the low 4 bits nibble ib % 2 of sl[ib // 2], the top 2 bits
    bits 2 (ib % 4) of sh[ib // 4]."""
    ib = torch.arange(16, device=sh.device)
    lo = (sl.long()[:, ib // 2] >> (4 * (ib % 2))) & 0xF
    hi = (sh.long()[:, ib // 4] >> (2 * (ib % 4))) & 3
    return lo | (hi << 4)


def _table(values, device) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)


def _shift_bits(extra: torch.Tensor, n_sub: int, first: int = 0) -> torch.Tensor:
    """Bits first .. first + n_sub - 1 of extra (n, 1) -> (n, n_sub)."""
    return (extra >> (first + torch.arange(n_sub, device=extra.device))) & 1


def _u16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at:at + 1].long() | (b[:, at + 1:at + 2].long() << 8)


def _scaled16(dl: torch.Tensor, values: torch.Tensor, q: torch.Tensor, shift: torch.Tensor, per_shift: int):
    """(d * ls) per 16-value sub-block times T[q + per_shift * shift]: dl, shift (n, 16), q (n, 256)."""
    v = values[q + per_shift * shift.repeat_interleave(16, dim=1)]
    return dl.repeat_interleave(16, dim=1) * v


def _iq3_k(b):
    """{ d @0; extra u16 @2; signs u16 @4; scales_l[8] @6 (|ls| = 2 m + 1); qs[64] @14; qh[32] @78 }."""
    b = _blocks(b, 110)
    ib = torch.arange(16, device=b.device)
    mag = (b[:, 6 + ib // 2].long() >> (4 * (ib % 2))) & 0xF
    ls = (2 * mag + 1) * (1 - 2 * _shift_bits(_u16(b, 4), 16))
    q = _unpack_2bit(b[:, 14:78]) | (_unpack_bits(b[:, 78:110]) << 2)
    return _scaled16(_f16(b, 0) * ls.float(), _table(IQ3NL_VALUES, b.device), q, _shift_bits(_u16(b, 2), 16), 8)


def _iq4_k(b):
    """{ d @0; extra u16 @2; scales_h[4] @4; scales_l[8] @8; qs[128] @16 (IQ4_NL's nibble order) }."""
    b = _blocks(b, 144)
    ls = _unpack_6bit_scales(b[:, 4:8], b[:, 8:16]) - 32
    q = _unpack_nibbles_32(b[:, 16:144])
    return _scaled16(_f16(b, 0) * ls.float(), _table(IQ4K_VALUES, b.device), q, _shift_bits(_u16(b, 2), 16), 16)


def _iq5_k(b):
    """{ d @0; extra u16 @2; scales_h[4] @4; scales_l[8] @8; qs[128] @16; qh[32] @144 }."""
    b = _blocks(b, 176)
    ls = _unpack_6bit_scales(b[:, 4:8], b[:, 8:16]) - 32
    q = _unpack_nibbles_64(b[:, 16:144]) | (_unpack_bits(b[:, 144:176]) << 4)
    return _scaled16(_f16(b, 0) * ls.float(), _table(IQ5NL_VALUES, b.device), q, _shift_bits(_u16(b, 2), 16), 32)


def _iq6_k(b):
    """{ d @0; extra u16 @2; int8 scales[16] @4; qs[128] @20; qh[64] @148 }, decoded as the C
    to_float does: a cubic in the 6-bit code, plus the sub-block's shift bit."""
    b = _blocks(b, 212)
    ls = b[:, 4:20].contiguous().view(torch.int8).float()
    q = (_unpack_nibbles_64(b[:, 20:148]) | (_unpack_2bit(b[:, 148:212]) << 4)).float()
    shift = _shift_bits(_u16(b, 2), 16).float().repeat_interleave(16, dim=1)
    v = (A_IQ6K + q * (B_IQ6K + q * (-C_IQ6K + q * D_IQ6K))) + shift
    return (_f16(b, 0) * ls).repeat_interleave(16, dim=1) * v


def _row_scaled(b, n_per_row, meta: int, block: int):
    """Rows that start with a scale: (the scale as float32 (n_rows, 1), blocks (n_rows * n_sb, block))."""
    n_rows = b.shape[0]
    d = b[:, 0:meta].contiguous().view(torch.float32 if meta == 4 else torch.float16).float()
    return d, b[:, meta:].reshape(n_rows * (n_per_row // 256), block)


def _iq45_ks(b, n_per_row, five_bits: bool):
    """IQ4_KS / IQ5_KS: a float32 row scale, then blocks { scales[8] (odd 7-bit scale << 1 |
    shift bit); qs[128] (IQ4_KS: IQ4_NL's nibble order, IQ5_KS: 64-value chunks); IQ5_KS qh[32] }."""
    d, blk = _row_scaled(b, n_per_row, 4, 168 if five_bits else 136)
    n_rows, n_sb = b.shape[0], n_per_row // 256
    s = blk[:, :8].long()
    dl = d.repeat_interleave(n_sb, dim=0) * ((s & 254) - 127).float()                  # (n_rows n_sb, 8)
    if five_bits:
        q = _unpack_nibbles_64(blk[:, 8:136]) | (_unpack_bits(blk[:, 136:168]) << 4)
        values, per_shift = _table(IQ5NL_VALUES, b.device), 32
    else:
        q = _unpack_nibbles_32(blk[:, 8:136])
        values, per_shift = _table(IQ4K_VALUES, b.device), 16
    v = values[q.reshape(-1, 8, 32) + per_shift * (s & 1)[:, :, None]]
    return (dl[:, :, None] * v).reshape(n_rows, n_per_row)


def _iq3_ks(b, n_per_row):
    """An fp16 row scale, then blocks { extra u16 (bits 0-7: scale bit 4, 8-15: shift bits);
    scales[4] @2 (block ib: nibble ib // 4 of byte ib % 4); qs[64] @6; qh[32] @70 }."""
    d, blk = _row_scaled(b, n_per_row, 2, 102)
    n_rows, n_sb = b.shape[0], n_per_row // 256
    extra = _u16(blk, 0)
    ib = torch.arange(8, device=b.device)
    lo = (blk[:, 2 + ib % 4].long() >> (4 * (ib // 4))) & 0xF
    ls = (lo | (_shift_bits(extra, 8) << 4)) - 16
    q = (_unpack_2bit(blk[:, 6:70]) | (_unpack_bits(blk[:, 70:102]) << 2)).reshape(-1, 8, 32)
    v = _table(IQ3NL_VALUES, b.device)[q + 8 * _shift_bits(extra, 8, 8)[:, :, None]]
    dl = d.repeat_interleave(n_sb, dim=0) * ls.float()
    return (dl[:, :, None] * v).reshape(n_rows, n_per_row)


def _iq2_k(b):
    """{ d @0; extra u16 @2; scales[8] @4 (4 bits, minus 8); qs[64] @12 (Q2_K's 2-bit layout) }."""
    b = _blocks(b, 76)
    ib = torch.arange(16, device=b.device)
    ls = ((b[:, 4 + ib // 2].long() >> (4 * (ib % 2))) & 0xF) - 8
    return _scaled16(_f16(b, 0) * ls.float(), _table(IQ2NL_VALUES, b.device), _unpack_2bit(b[:, 12:76]),
                     _shift_bits(_u16(b, 2), 16), 4)


def _iq2_ks(b, n_per_row):
    """An fp16 row scale, then blocks { extra u16 @0 (bits 0-7: shift bits, 8-15: scale bit 4);
    scales[4] @2 (block ib: nibble ib % 2 of byte ib // 2); qs[64] @6 }: 8 blocks of 32."""
    d, blk = _row_scaled(b, n_per_row, 2, 70)
    n_rows, n_sb = b.shape[0], n_per_row // 256
    extra = _u16(blk, 0)
    ib = torch.arange(8, device=b.device)
    lo = (blk[:, 2 + ib // 2].long() >> (4 * (ib % 2))) & 0xF
    ls = (lo | (_shift_bits(extra, 8, 8) << 4)) - 16
    q = _unpack_2bit(blk[:, 6:70]).reshape(-1, 8, 32)
    v = _table(IQ2NL_VALUES, b.device)[q + 4 * _shift_bits(extra, 8)[:, :, None]]
    dl = d.repeat_interleave(n_sb, dim=0) * ls.float()
    return (dl[:, :, None] * v).reshape(n_rows, n_per_row)


def _iq2_kl(b, n_per_row):
    """An fp16 row scale, then blocks { scales_h u16 @0 (2 bits per block); scales_l[4] @2 (block ib:
    nibble ib // 4 of byte ib % 4); qs[64] @6; qh[16] @70 }: 5-bit codes of value pairs."""
    d, blk = _row_scaled(b, n_per_row, 2, 86)
    n_rows, n_sb = b.shape[0], n_per_row // 256
    ib = torch.arange(8, device=b.device)
    uls = ((blk[:, 2 + ib % 4].long() >> (4 * (ib // 4))) & 0xF) | (((_u16(blk, 0) >> (2 * ib)) & 3) << 4)
    qs = blk[:, 6:70].long().reshape(-1, 4, 16)
    lo = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 16)
    hi = (blk[:, None, 70:86].long() >> ib[None, :, None]) & 1
    pairs = torch.tensor(PAIRS, dtype=torch.float32, device=b.device)[lo | (hi << 4)]     # (.., 8, 16, 2)
    dl = d.repeat_interleave(n_sb, dim=0) * (uls - 32).float()
    return (dl[:, :, None, None] * pairs).reshape(n_rows, n_per_row)


def _iq4_kss(b, n_per_row):
    """A float32 row scale, then per 32 values 8 u16 words: bit 0 of word k is bit k of the block's
    scale byte, bits 1-15 hold the 4 codes of 8 values, xor-folded (a ^= a >> 1 undoes it)."""
    n_rows = b.shape[0]
    d, blk = _row_scaled(b, n_per_row, 4, 128)
    w = (blk.contiguous().view(torch.int16).long() & 0xFFFF).reshape(-1, 8)   # (n_rows n_blocks, 8)
    ls = ((w & 1) << torch.arange(8, device=b.device)).sum(dim=1)
    a = w & 0xFFFE
    a = a ^ (a >> 1)
    qs = torch.stack([a & 0xFF, a >> 8], dim=-1).reshape(-1, 16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1)
    base, shifted = (torch.tensor(t, dtype=torch.float32, device=b.device) for t in (IQ4KSS_BASE, IQ4KSS_SHIFTED))
    v = torch.where((ls & 1)[:, None] == 1, shifted[q], base[q])
    n_blocks = n_per_row // 32
    dl = d.repeat_interleave(n_blocks, dim=0).reshape(-1) * ((ls & 254) - 127).float()
    return (dl[:, None] * v).reshape(n_rows, n_per_row)


# ---- trellis (IQn_KT): a float32 row scale, then 256-value blocks of 8 sub-blocks of 32 ----
#
# A code selects a group of 8 (IQ4_KT: 4) integer values made by a hash; those values are a fixed
# table per type (2^bits x group, formats._kt_codebook.trellis_values), uploaded once per device,
# so decoding is bit extraction, one gather and one product: value = (d * scale) * table[code].

_TRELLIS_TABLES: dict = {}


def _trellis_table(name: str, device, offset: int | None = None) -> torch.Tensor:
    key = (name, str(device), offset)
    if key not in _TRELLIS_TABLES:
        spec = SPECS[name]
        values = trellis_values(np.arange(1 << spec.num_bits), spec.group, spec.is_abs,
                                OFFSET if offset is None else offset)
        _TRELLIS_TABLES[key] = torch.from_numpy(values).to(device)
    return _TRELLIS_TABLES[key]


def _kt_scales(b, n_per_row, block: int):
    """(d per block (n_blocks, 1), blocks (n_blocks, block)): the row scale repeated per block."""
    d, blk = _row_scaled(b, n_per_row, 4, block)
    return d.repeat_interleave(n_per_row // 256, dim=0), blk.long()


def _nibble_scales(s: torch.Tensor) -> torch.Tensor:
    """4 bytes -> the 8 sub-block nibbles: sub-block ib is nibble ib // 4 of byte ib % 4."""
    return torch.cat([s & 0xF, s >> 4], dim=1)


def _iq1_kt(b, n_per_row):
    """56 B: sh[8] | ql[32] | qh[16]; code (ib, j) = ql[4ib+j] | nibble ib//4 of qh[4(ib%4)+j] << 8
    | bit 4+j of sh[ib] << 12; scale IQ4_K table[sh & 15]."""
    d, blk = _kt_scales(b, n_per_row, 56)
    dev = b.device
    sh, ql, qh = blk[:, :8], blk[:, 8:40].reshape(-1, 8, 4), blk[:, 40:56]
    ib, j = torch.arange(8, device=dev)[:, None], torch.arange(4, device=dev)[None, :]
    hi = (qh[:, 4 * (ib % 4) + j] << (8 - 4 * (ib // 4))) & 0xF00
    codes = ql | hi | ((sh[:, :, None] << (8 - j)) & 0x1000)
    sl = d * _table(IQ4K_VALUES[:16], dev)[sh & 0xF]
    return sl[:, :, None, None] * _trellis_table("iq1_kt", dev)[codes]


def _iq23_kt(b, n_per_row, name: str):
    """scales[4] | 16-bit codes[32] (| qh[32] signs for IQ3_KT: bit ib of qh[j] negates value j
    of sub-block ib); IQ2_KT's scale is the IQ4_K table entry, IQ3_KT's the nibble itself."""
    three = name == "iq3_kt"
    d, blk = _kt_scales(b, n_per_row, 100 if three else 68)
    dev = b.device
    codes = (blk[:, 4:68:2] | (blk[:, 5:68:2] << 8)).reshape(-1, 8, 4)
    nib = _nibble_scales(blk[:, :4])
    sl = d * (nib.float() if three else _table(IQ4K_VALUES[:16], dev)[nib])
    v = (sl[:, :, None, None] * _trellis_table(name, dev)[codes]).reshape(-1, 8, 32)
    if three:
        neg = ((blk[:, None, 68:100] >> torch.arange(8, device=dev)[None, :, None]) & 1).bool()
        v = torch.where(neg, -v, v)
    return v


def _iq4_kt(b, n_per_row):
    """128 B: 8 uint32 words (bit 0: second table, bits 1-7: scale + 64, bits 8+3j..: code bits
    12-14 of group j) | ql[64] (code bits 0-7) | qh[32] (bits 8-11 of group g in nibble g//32 of
    qh[g%32]); 15-bit codes of 4 values."""
    d, blk = _kt_scales(b, n_per_row, 128)
    dev = b.device
    head = torch.cat([_u32(blk, 4 * ib) for ib in range(8)], dim=1)                  # (n, 8)
    g = torch.arange(64, device=dev)
    low = (blk[:, 32 + g] | ((blk[:, 96 + g % 32] << (8 - 4 * (g // 32))) & 0xF00)).reshape(-1, 8, 8)
    codes = low | (((head[:, :, None] >> (8 + 3 * torch.arange(8, device=dev))) & 7) << 12)
    first = _trellis_table("iq4_kt", dev, OFFSET)[codes]
    second = _trellis_table("iq4_kt", dev, IQ4_KT_SECOND_OFFSET)[codes]
    v = torch.where((head & 1).bool()[:, :, None, None], second, first)
    sl = d * (((head & 0xFF) >> 1) - 64).float()
    return sl[:, :, None, None] * v


# decoders that need the row length (row-scaled types)
ROW_DECODERS = {
    T.IQ4_KS: lambda b, n: _iq45_ks(b, n, False), T.IQ5_KS: lambda b, n: _iq45_ks(b, n, True),
    T.IQ3_KS: _iq3_ks, T.IQ2_KS: _iq2_ks, T.IQ2_KL: _iq2_kl, T.IQ4_KSS: _iq4_kss,
    T.IQ1_KT: _iq1_kt, T.IQ2_KT: lambda b, n: _iq23_kt(b, n, "iq2_kt"),
    T.IQ3_KT: lambda b, n: _iq23_kt(b, n, "iq3_kt"), T.IQ4_KT: _iq4_kt,
}

DECODERS = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q6_0: _q6_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: lambda b: _q45_k(b, False), T.Q5_K: lambda b: _q45_k(b, True),
    T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
    T.IQ2_K: _iq2_k, T.IQ3_K: _iq3_k, T.IQ4_K: _iq4_k, T.IQ5_K: _iq5_k, T.IQ6_K: _iq6_k,
}


def can_decode(qtype) -> bool:
    qtype = QuantType(qtype)
    return qtype in DECODERS or qtype in ROW_DECODERS or qtype in (T.F32, T.F16, T.BF16)


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
    if qtype in ROW_DECODERS:
        return ROW_DECODERS[qtype](b, n_per_row).reshape(n_rows, n_per_row)
    return DECODERS[qtype](b).reshape(n_rows, n_per_row)
