"""Row-interleaved ("_r4", "_r8", "_r16") layouts of ik_llama.cpp as pure bit shuffles, both ways.

ik's CPU kernels read N rows at once, so the repacked types store N consecutive rows of the plain
type together: the N row scales first (types with row meta), then, for every column block (a
super-block of 256 values, or 32 for the legacy types), the N rows' blocks merged into one
interleaved block (specs/ik-quants.md §10).  Nothing is re-quantized: every bit of the plain rows
lands somewhere in the interleaved group, so the transform is a fixed bit permutation per block.

Each layout below is written once, forwards, as numpy bit operations on (groups, N, block bytes).
The permutation is then measured by running that function on log2(bits) "bit-plane" probes (probe
p sets every input bit whose index has bit p set), checked to be a bijection, and compiled into
straight-line machine code for one column block (see "the kernel" below); the inverse
(``deinterleave``) is the inverse permutation.  So both directions are exact by
construction, and only the forward layouts need to be right, which the tests check against the C
library's own bytes.  One transform is not a bit move: the 7-bit sign fields of iq2_xxs_r4, iq2_xs_r4
and iq3_xxs_r4, which ik stores as prefix XORs; they are recoded in the plain rows before the
shuffle and after the unshuffle (``_SIGN_RECODE``, "sign recoding" below).

Notation used in the layouts: ``il32(L)`` puts the 4-bit codes of the 32 values of a block of
4 rows (k = 0..3) into 64 bytes: byte 4k+i holds codes i, i+8; byte 16+4k+i codes i+16, i+24;
byte 32+4k+i codes i+4, i+12; byte 48+4k+i codes i+20, i+28 (low nibble first).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types as nbt
from numba.extending import intrinsic

from .. import kernel_cache  # noqa: F401  (keys numba's cache on quantkit's sources)
from ..types import QuantType, traits

T = QuantType
U8 = np.uint8


# ---------------------------------------------------------------------------------- field helpers
def _nibbles_lo_hi(qs):
    """qs (..., 16) -> codes (..., 32): byte j = code j | code j+16 << 4."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def il32(L):
    """(G, 4, 32) 4-bit codes -> (G, 64) bytes, see the module docstring."""
    L = L & 0xF
    out = np.empty(L.shape[:-2] + (4, 4, 4), U8)                 # (part, k, i)
    for part, (a, b) in enumerate(((0, 8), (16, 24), (4, 12), (20, 28))):
        out[..., part, :, :] = L[..., :, a:a + 4] | (L[..., :, b:b + 4] << 4)
    return out.reshape(L.shape[:-2] + (64,))


def _scales_4bit(sl, n_sub):
    """scales[n_sub/2] nibble pairs -> (..., n_sub) 4-bit values (sub-block ib in nibble ib%2)."""
    return np.stack([sl & 0xF, sl >> 4], axis=-1).reshape(sl.shape[:-1] + (n_sub,))


def _u16(b):
    return b[..., 0].astype(np.uint16) | (b[..., 1].astype(np.uint16) << 8)


def _bits_to_bytes(bits):
    """(..., 8) 0/1, least significant bit first -> (...) bytes."""
    return np.packbits(bits.astype(U8), axis=-1, bitorder="little")[..., 0]


def _iqk_extra(extra16):
    """(G, 4) uint16 shift flags of 16 sub-blocks -> extra[8]: extra[k] bit ib = flag 2ib of row k,
    extra[k+4] bit ib = flag 2ib+1."""
    flags = (extra16[..., None] >> np.arange(16, dtype=np.uint16)) & 1         # (G, 4, 16)
    even = _bits_to_bytes(flags[..., 0::2])
    odd = _bits_to_bytes(flags[..., 1::2])
    return np.concatenate([even, odd], axis=-1)


def _slots(per_sub):
    """(G, 4, 16) per-row sub-block values -> (G, 64) by scale slot i = 8*ib + k + 4*h
    (sub-block 2ib+h of row k)."""
    g = per_sub.shape[0]
    v = per_sub.reshape(g, 4, 8, 2)                   # (G, k, ib, h)
    return v.transpose(0, 2, 3, 1).reshape(g, 64)    # slot = 8*ib + 4*h + k


def _q2k_codes(qs):
    """Q2_K-style 2-bit field qs (..., 64) -> (..., 256) codes."""
    q = qs.reshape(qs.shape[:-1] + (2, 1, 32))
    return ((q >> (2 * np.arange(4, dtype=U8)[:, None])) & 3).reshape(qs.shape[:-1] + (256,))


def _bit_codes(qh):
    """qh (..., 32): bit ib of byte k = bit of value 32*ib + k -> (..., 256)."""
    return ((qh[..., None, :] >> np.arange(8, dtype=U8)[:, None]) & 1).reshape(qh.shape[:-1] + (256,))


def _groups32(L):
    """(G, 4, 256) -> (G, 8, 4, 32): per 32-block ib, the 4 rows' codes."""
    return L.reshape(L.shape[0], 4, 8, 32).transpose(0, 2, 1, 3)


def _pack2(L, order):
    """(G, 8, 4, 32) 2-bit codes -> (G, 8, 32): byte 4k+i (+16) = codes i+order[0..3] (+16) << 2j."""
    out = np.zeros(L.shape[:2] + (2, 4, 4), U8)        # (ib, half, k, i)
    for half in range(2):
        for j, off in enumerate(order):
            out[:, :, half] |= (L[:, :, :, 16 * half + off:16 * half + off + 4] & 3) << (2 * j)
    return out.reshape(L.shape[:2] + (32,))


def _pack_bit(L, bit, order):
    """(G, 8, 4, 32) codes -> (G, 8, 16): byte 4k+i bit b = bit ``bit`` of code i + order[b]."""
    out = np.zeros(L.shape[:2] + (4, 4), U8)
    for b, off in enumerate(order):
        out |= ((L[:, :, :, off:off + 4] >> bit) & 1) << b
    return out.reshape(L.shape[:2] + (16,))


# ---------------------------------------------------------------------------------- layouts
# Each takes the plain blocks of one column block of a row group, (G, N, block bytes), and returns
# the interleaved block, (G, N * block bytes).

def _iq4_nl_r4(b):
    L = _nibbles_lo_hi(b[..., 2:18])
    return np.concatenate([b[..., :2].reshape(len(b), 8), il32(L)], axis=1)


def _q4_0_r8(b):
    qs = b[..., 2:18].reshape(len(b), 8, 4, 4).transpose(0, 2, 1, 3).reshape(len(b), 128)
    return np.concatenate([b[..., :2].reshape(len(b), 16), qs], axis=1)


def _q8_0_r8(b):
    parts = [b[..., 2 + 16 * h:18 + 16 * h].reshape(len(b), 8, 4, 4).transpose(0, 2, 1, 3).reshape(len(b), 128)
             for h in range(2)]
    return np.concatenate([b[..., :2].reshape(len(b), 16)] + parts, axis=1)


def _mxfp4_r8(b):
    """block_mxfp4_r8 { e[8]; qs[128] }: qs[32 l + 4 k + i] = row k's qs[4 l + i] (repack_mxfp4)."""
    qs = b[..., 1:17].reshape(len(b), 8, 4, 4).transpose(0, 2, 1, 3).reshape(len(b), 128)
    return np.concatenate([b[..., 0], qs], axis=1)


def _iq4_ks_r4(b):
    L = _nibbles_lo_hi(b[..., 8:136].reshape(len(b), 4, 8, 16))                  # (G, 4, 8, 32)
    qs = il32(L.transpose(0, 2, 1, 3))                                             # (G, 8, 64)
    scales = b[..., :8].transpose(0, 2, 1).reshape(len(b), 32)                    # 4*ib + k
    return np.concatenate([scales, qs.reshape(len(b), 512)], axis=1)


def _iq2_k_r4(b):
    g = len(b)
    s4 = _scales_4bit(b[..., 4:12], 16)                                            # (G, 4, 16)
    slots = _slots(s4)
    scales = slots[:, :32] | (slots[:, 32:] << 4)
    L = _groups32(_q2k_codes(b[..., 12:76]))
    qs = _pack2(L, (0, 4, 8, 12)).reshape(g, 256)
    return np.concatenate([b[..., :2].reshape(g, 8), _iqk_extra(_u16(b[..., 2:4])), scales, qs], axis=1)


def _iq3_k_r4(b):
    g = len(b)
    mag = _slots(_scales_4bit(b[..., 6:14], 16))
    signs = _slots((_u16(b[..., 4:6])[..., None] >> np.arange(16, dtype=np.uint16)) & 1).astype(U8)
    scales_l = mag[:, :32] | (mag[:, 32:] << 4)
    scales_h = _bits_to_bytes(signs.reshape(g, 8, 8).transpose(0, 2, 1))        # byte i%8, bit i/8
    L = _groups32(_q2k_codes(b[..., 14:78]) | (_bit_codes(b[..., 78:110]) << 2))
    qs = _pack2(L, (0, 4, 8, 12)).reshape(g, 256)
    qh = _pack_bit(L, 2, (0, 4, 8, 12, 16, 20, 24, 28)).reshape(g, 128)
    return np.concatenate([b[..., :2].reshape(g, 8), _iqk_extra(_u16(b[..., 2:4])), scales_h, scales_l, qs, qh],
                          axis=1)


def _iqk_6bit_scales(sh, sl):
    """IQ4_K/IQ5_K scales_h[4], scales_l[8] of 4 rows -> (scales_h[16], scales_l[32]) by slot."""
    lo = _slots(_scales_4bit(sl, 16))
    hi = _slots(((sh[..., None] >> (2 * np.arange(4, dtype=U8))) & 3).reshape(sh.shape[:-1] + (16,)))
    scales_l = lo[:, :32] | (lo[:, 32:] << 4)
    scales_h = hi[:, :16] | (hi[:, 16:32] << 2) | (hi[:, 32:48] << 4) | (hi[:, 48:] << 6)
    return scales_h, scales_l


def _iq4_k_r4(b):
    g = len(b)
    sh, sl = _iqk_6bit_scales(b[..., 4:8], b[..., 8:16])
    L = _nibbles_lo_hi(b[..., 16:144].reshape(g, 4, 8, 16)).transpose(0, 2, 1, 3)
    return np.concatenate([b[..., :2].reshape(g, 8), _iqk_extra(_u16(b[..., 2:4])), sh, sl,
                           il32(L).reshape(g, 512)], axis=1)


def _iq5_k_r4(b):
    g = len(b)
    sh, sl = _iqk_6bit_scales(b[..., 4:8], b[..., 8:16])
    q = b[..., 16:144].reshape(g, 4, 4, 1, 32)
    lo = np.concatenate([q & 0xF, q >> 4], axis=3).reshape(g, 4, 256)
    L = _groups32(lo | (_bit_codes(b[..., 144:176]) << 4))
    qh = _pack_bit(L, 4, (0, 8, 16, 24, 4, 12, 20, 28)).reshape(g, 128)
    return np.concatenate([b[..., :2].reshape(g, 8), _iqk_extra(_u16(b[..., 2:4])), sh, sl,
                           il32(L).reshape(g, 512), qh], axis=1)


def _q4_k_r4(b):
    g = len(b)
    sh, sl = _k4_r4_scales(b[..., 4:16])
    q = b[..., 16:144].reshape(g, 4, 4, 1, 32)
    L = np.concatenate([q & 0xF, q >> 4], axis=3).reshape(g, 4, 8, 32).transpose(0, 2, 1, 3)
    d = np.concatenate([b[..., 0:2].reshape(g, 8), b[..., 2:4].reshape(g, 8)], axis=1)
    return np.concatenate([d, sh, sl, il32(L).reshape(g, 512)], axis=1)


def _q6_k_codes(b):
    """Q6_K blocks (..., 210) -> (..., 256) 6-bit codes."""
    ql = b[..., :128].reshape(b.shape[:-1] + (2, 2, 32))       # (half, 32-offset, l)
    qh = b[..., 128:192].reshape(b.shape[:-1] + (2, 1, 32))
    lo = np.stack([ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    hi = (qh >> (2 * np.arange(4, dtype=U8)[:, None])) & 3
    return (lo | (hi << 4)).reshape(b.shape[:-1] + (256,))


def _q6_k_r4(b):
    g = len(b)
    L = _groups32(_q6_k_codes(b))
    sc = b[..., 192:208].reshape(g, 4, 8, 2).transpose(0, 2, 3, 1).reshape(g, 64)   # 8ib + 4h + k
    hi = L >> 4
    qh = np.zeros((g, 8, 2, 4, 4), U8)
    for half in range(2):
        for j, off in enumerate((0, 8, 4, 12)):
            qh[:, :, half] |= hi[:, :, :, 16 * half + off:16 * half + off + 4] << (2 * j)
    return np.concatenate([b[..., 208:210].reshape(g, 8), sc, qh.reshape(g, 256), il32(L).reshape(g, 512)],
                          axis=1)


def _bf16_r16(b):
    return b.reshape(len(b), -1)


def _q5_0_codes(b):
    qh = b[..., 2:6]
    bits = np.unpackbits(qh, axis=-1, bitorder="little")                     # (..., 32): bit e of code e
    return _nibbles_lo_hi(b[..., 6:22]) | (bits << 4)


def _q6_0_codes(b):
    qh = b[..., 2:10]
    h = np.concatenate([qh & 0xF, qh >> 4], axis=-1)                         # 4-bit pair of qs byte j
    qs = b[..., 10:26]
    return np.concatenate([(qs & 0xF) | ((h << 4) & 0x30), (qs >> 4) | ((h << 2) & 0x30)], axis=-1)


_IL32_PAIRS = ((0, 8), (16, 24), (4, 12), (20, 28))


def _q5_0_r4(b):
    g = len(b)
    L = _q5_0_codes(b)                                                       # (G, 4, 32)
    qh = np.zeros((g, 4, 4), U8)                                             # (k, i)
    for part, (a, c) in enumerate(_IL32_PAIRS):
        qh |= (((L[..., a:a + 4] >> 4) & 1) << part) | (((L[..., c:c + 4] >> 4) & 1) << (4 + part))
    return np.concatenate([b[..., :2].reshape(g, 8), qh.reshape(g, 16), il32(L)], axis=1)


def _q6_0_r4(b):
    g = len(b)
    L = _q6_0_codes(b)
    qh = np.zeros((g, 2, 4, 4), U8)                                          # (part % 2, k, i)
    for part, (a, c) in enumerate(_IL32_PAIRS):
        qh[:, part % 2] |= ((L[..., a:a + 4] >> 4) << (2 * (part // 2))) | ((L[..., c:c + 4] >> 4) << (4 + 2 * (part // 2)))
    return np.concatenate([b[..., :2].reshape(g, 8), qh.reshape(g, 32), il32(L)], axis=1)


def _q2_k_r4(b):
    g = len(b)
    L = _groups32(_q2k_codes(b[..., 16:80]))
    scales = b[..., :16].transpose(0, 2, 1).reshape(g, 64)                   # 4*ib + k
    d = np.concatenate([b[..., 80:82].reshape(g, 8), b[..., 82:84].reshape(g, 8)], axis=1)
    return np.concatenate([d, scales, _pack2(L, (0, 4, 8, 12)).reshape(g, 256)], axis=1)


def _q3_k_scales(s):
    """Q3_K's 12 scale bytes (..., 12) -> (..., 16) 6-bit scales."""
    lo = np.concatenate([s[..., 0:4] & 0xF, s[..., 4:8] & 0xF, s[..., 0:4] >> 4, s[..., 4:8] >> 4], axis=-1)
    hi = np.concatenate([(s[..., 8:12] >> (2 * j)) & 3 for j in range(4)], axis=-1)
    return lo | (hi << 4)


def _sixbit_by_slot(v16):
    """(G, 4, 16) 6-bit values of 16-value sub-blocks -> scales_h[16], scales_l[32] by slot
    is = 8*ib + k + 4*h (Q3_K_R4, IQ4_XS_R8 style)."""
    lo = _slots(v16 & 0xF)
    hi = _slots(v16 >> 4)
    return hi[:, :16] | (hi[:, 16:32] << 2) | (hi[:, 32:48] << 4) | (hi[:, 48:] << 6), lo[:, :32] | (lo[:, 32:] << 4)


def _q3_k_r4(b):
    g = len(b)
    L = _groups32(_q2k_codes(b[..., 32:96]) | (_bit_codes(b[..., 0:32]) << 2))
    sh, sl = _sixbit_by_slot(_q3_k_scales(b[..., 96:108]))
    return np.concatenate([b[..., 108:110].reshape(g, 8), sh, sl, _pack_bit(L, 2, (0, 4, 8, 12, 16, 20, 24, 28))
                           .reshape(g, 128), _pack2(L, (0, 4, 8, 12)).reshape(g, 256)], axis=1)


def _k4_scales(sc):
    """Q4_K/Q5_K 12 scale bytes (G, 4, 12) -> (scale, min) (G, 4, 8) 6-bit each (get_scale_min_k4)."""
    scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    return scale, mins


def _k4_r4_scales(sc):
    g = len(sc)
    scale, mins = _k4_scales(sc)
    scale, mins = scale.transpose(0, 2, 1).reshape(g, 32), mins.transpose(0, 2, 1).reshape(g, 32)   # 4*ib + k
    h = (scale >> 4) | ((mins >> 4) << 2)
    return h[:, :16] | (h[:, 16:] << 4), (scale & 0xF) | ((mins & 0xF) << 4)


def _q5_k_r4(b):
    g = len(b)
    q = b[..., 48:176].reshape(g, 4, 4, 1, 32)
    lo = np.concatenate([q & 0xF, q >> 4], axis=3).reshape(g, 4, 256)
    L = _groups32(lo | (_bit_codes(b[..., 16:48]) << 4))
    sh, sl = _k4_r4_scales(b[..., 4:16])
    d = np.concatenate([b[..., 0:2].reshape(g, 8), b[..., 2:4].reshape(g, 8)], axis=1)
    return np.concatenate([d, sh, sl, _pack_bit(L, 4, (0, 8, 4, 12, 16, 24, 20, 28)).reshape(g, 128),
                           il32(L).reshape(g, 512)], axis=1)


def _iq4_xs_r8(b):
    g = len(b)
    sl4 = _scales_4bit(b[..., 4:8], 8)                                       # (G, 8, 8) low 4 bits
    sh2 = (_u16(b[..., 2:4])[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    i_sl = sl4.transpose(0, 2, 1).reshape(g, 64)                             # i = 8*ib + k
    i_sh = sh2.astype(U8).transpose(0, 2, 1).reshape(g, 64)
    scales_l = i_sl[:, :32] | (i_sl[:, 32:] << 4)
    scales_h = i_sh[:, :16] | (i_sh[:, 16:32] << 2) | (i_sh[:, 32:48] << 4) | (i_sh[:, 48:] << 6)
    L = _nibbles_lo_hi(b[..., 8:136].reshape(g, 8, 8, 16)).transpose(0, 2, 1, 3)   # (G, ib, k, 32)
    qs = np.empty((g, 8, 4, 8, 4), U8)                                       # (ib, part, k, i)
    for part, (a, c) in enumerate(((0, 4), (8, 12), (16, 20), (24, 28))):
        qs[:, :, part] = L[..., a:a + 4] | (L[..., c:c + 4] << 4)
    return np.concatenate([b[..., :2].reshape(g, 16), scales_h, scales_l, qs.reshape(g, 1024)], axis=1)


def _iq5_ks_r4(b):
    g = len(b)
    q = b[..., 8:136].reshape(g, 4, 4, 1, 32)
    lo = np.concatenate([q & 0xF, q >> 4], axis=3).reshape(g, 4, 256)
    L = _groups32(lo | (_bit_codes(b[..., 136:168]) << 4))
    scales = b[..., :8].transpose(0, 2, 1).reshape(g, 32)
    return np.concatenate([scales, il32(L).reshape(g, 512), _pack_bit(L, 4, (0, 8, 16, 24, 4, 12, 20, 28))
                           .reshape(g, 128)], axis=1)


def _iq2_bn_r4(b):
    """repack_iq2_bn: 2-bit codes; bits 2j..2j+1 of byte 4k + i + 16l = bits 2l..2l+1 of row k's
    qs[i + 4j] (i, j, l < 4): value i + 4j + 16l of row k."""
    g = len(b)
    out = np.zeros((g, 4, 4, 4), U8)                                        # (l, k, i)
    for l in range(4):
        for j in range(4):
            out[:, l] |= ((b[..., 4 * j:4 * j + 4] >> (2 * l)) & 3) << (2 * j)
    return out.reshape(g, 64)


def _iq3_xxs_r4(b):
    """(the 7-bit sign fields recoded first: _SIGN_RECODE)"""
    g = len(b)
    w = b[..., 66:98].reshape(g, 4, 8, 4).astype(np.uint32)
    w = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)             # (G, k, ib)
    j = np.arange(4, dtype=np.uint32)
    sas = (((w[..., None] >> (7 * j)) & 127) << 1) | ((w[..., None] >> (28 + j)) & 1)    # (G, k, ib, j)
    qs = b[..., 2:66].reshape(g, 4, 8, 8).transpose(0, 2, 1, 3).reshape(g, 256)       # 32 ib + 8 k + i
    return np.concatenate([b[..., :2].reshape(g, 8), sas.transpose(0, 2, 1, 3).reshape(g, 128).astype(U8), qs],
                          axis=1)


def _iq3_s_r4(b):
    g = len(b)
    qs = b[..., 2:66].reshape(g, 4, 8, 2, 4).transpose(0, 2, 4, 3, 1).reshape(g, 256)  # 32 ib + 8 i + 4 h + k
    qh = b[..., 66:74].transpose(0, 2, 1).reshape(g, 32)                                 # 4 ib + k
    # signs[16 ib + 4 k + i] bit 2 j + h = bit 4 h + i of the plain signs[4 ib + j] of row k
    bits = (b[..., 74:106, None] >> np.arange(8, dtype=U8)) & 1                          # (G, k, 4 ib + j, 4 h + i)
    bits = bits.reshape(g, 4, 8, 4, 2, 4).transpose(0, 2, 1, 5, 3, 4)                   # (G, ib, k, i, j, h)
    signs = _bits_to_bytes(bits.reshape(g, 8, 4, 4, 8)).reshape(g, 128)
    # scale nibble 8 ib + 4 h + k (byte n % 16, high nibble from n = 16) = nibble h of scales[ib] of row k
    sc = b[..., 106:110]
    nib = np.stack([sc & 0xF, sc >> 4], axis=-1).transpose(0, 2, 3, 1).reshape(g, 32)
    return np.concatenate([b[..., :2].reshape(g, 8), qs, qh, signs, nib[:, :16] | (nib[:, 16:] << 4)], axis=1)


def _iq2_xxs_r4(b):
    """d[4] | sas[128] | qs[128]: 32-block ib of row k: its 4 grid-index bytes at qs[16ib + 4k..],
    its sign/scale word as 4 bytes at sas[16ib + 4k..], byte l = the 7 sign bits of group l << 1 |
    bit l of the 4-bit scale (the sign bits recoded first: _SIGN_RECODE)."""
    g = len(b)
    q = b[..., 2:].reshape(g, 4, 8, 8)                                       # (G, k, ib, byte)
    w = q[..., 4].astype(np.uint32) | (q[..., 5].astype(np.uint32) << 8) | (q[..., 6].astype(np.uint32) << 16) \
        | (q[..., 7].astype(np.uint32) << 24)
    sas = np.stack([(((w >> (7 * l)) & 127) << 1) | ((w >> (28 + l)) & 1) for l in range(4)], axis=-1).astype(U8)
    return np.concatenate([b[..., :2].reshape(g, 8), sas.transpose(0, 2, 1, 3).reshape(g, 128),
                           q[..., :4].transpose(0, 2, 1, 3).reshape(g, 128)], axis=1)


def _iq2_xs_r4(b):
    """d[4] | u16 qs[128]: group i of 32-block ib of row k at 16ib + 4k + i | scales[32]: 4ib + k."""
    g = len(b)
    qs = b[..., 2:66].reshape(g, 4, 8, 8).transpose(0, 2, 1, 3).reshape(g, 256)
    return np.concatenate([b[..., :2].reshape(g, 8), qs, b[..., 66:74].transpose(0, 2, 1).reshape(g, 32)], axis=1)


def _iq2_s_r4(b):
    """d[4] | qs[128] | qh[32] | signs[128] | scales[32]: byte i of 32-block ib of row k at 16ib + 4k
    + i (qs, signs), its qh and scale byte at 4ib + k."""
    g = len(b)

    def by_block(a, n):
        return a.reshape(g, 4, 8, n).transpose(0, 2, 1, 3).reshape(g, 32 * n)
    return np.concatenate([b[..., :2].reshape(g, 8), by_block(b[..., 2:34], 4), by_block(b[..., 66:74], 1),
                           by_block(b[..., 34:66], 4), by_block(b[..., 74:82], 1)], axis=1)


# ---------------------------------------------------------------------------------- sign recoding
# ik's repack of IQ2_XXS, IQ2_XS and IQ3_XXS stores a group's 7 sign bits s as scrambled_sign(s): bit j =
# s_0 ^ ... ^ s_j (its _r4 decoders' ``a ^= a >> 1`` gives back the 8 signs with the parity bit).
# That is not a bit permutation, so interleave recodes the sign fields of (a copy of) the plain rows
# first and then moves bits; deinterleave moves bits and then decodes them.

def _prefix_xor(bits: int) -> np.ndarray:
    s = np.arange(1 << bits)
    out = np.zeros_like(s)
    for j in range(bits):
        out |= (np.bitwise_xor.reduce([(s >> i) & 1 for i in range(j + 1)], axis=0)) << j
    return out.astype(np.uint32)


_SCRAMBLE = _prefix_xor(7)
_UNSCRAMBLE = np.argsort(_SCRAMBLE).astype(np.uint32)


def _recode_sign_words(block_bytes: int, first: int, stride: int):
    """A recoder of the uint32 words at bytes ``first + stride i`` (i < 8) of every block whose bits
    0-27 are four 7-bit sign fields (IQ2_XXS: bytes 4-7 of each 8 after d; IQ3_XXS: the 8 words
    after the grid indices); bits 28-31 (the scale) stay."""
    at = first + stride * np.arange(8)[:, None] + np.arange(4)                  # (word, byte)

    def recode(rows, table):
        blk = rows.reshape(-1, block_bytes)
        q = blk[:, at].astype(np.uint32)
        w = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
        new = w & np.uint32(0xF0000000)
        for l in range(4):
            new |= table[(w >> (7 * l)) & 127] << (7 * l)
        blk[:, at] = (new[..., None] >> np.arange(0, 32, 8, dtype=np.uint32)).astype(U8)
    return recode


def _recode_iq2_xs(rows, table):
    """The 7 sign bits (bits 9-15) of every uint16 qs entry through ``table``."""
    q = rows.reshape(-1, 74)[:, 2:66]
    v = q[:, 0::2].astype(np.uint32) | (q[:, 1::2].astype(np.uint32) << 8)
    new = (v & 511) | (table[v >> 9] << 9)
    q[:, 0::2] = (new & 255).astype(U8)
    q[:, 1::2] = (new >> 8).astype(U8)


_SIGN_RECODE = {T.IQ2_XXS_R4: _recode_sign_words(66, 6, 8), T.IQ2_XS_R4: _recode_iq2_xs,
                T.IQ3_XXS_R4: _recode_sign_words(98, 66, 4)}


@dataclass(frozen=True)
class Layout:
    rows: int                       # N rows per group (types.py's interleave_rows)
    block_values: int               # values per column block
    forward: Callable[[np.ndarray], np.ndarray]


_FORWARD: dict[QuantType, Callable[[np.ndarray], np.ndarray]] = {
    T.IQ4_NL_R4: _iq4_nl_r4, T.Q4_0_R8: _q4_0_r8, T.Q8_0_R8: _q8_0_r8, T.IQ4_KS_R4: _iq4_ks_r4,
    T.IQ2_K_R4: _iq2_k_r4, T.IQ3_K_R4: _iq3_k_r4, T.IQ4_K_R4: _iq4_k_r4, T.IQ5_K_R4: _iq5_k_r4,
    T.Q4_K_R4: _q4_k_r4, T.Q6_K_R4: _q6_k_r4, T.BF16_R16: _bf16_r16, T.Q5_0_R4: _q5_0_r4,
    T.Q6_0_R4: _q6_0_r4, T.Q2_K_R4: _q2_k_r4, T.Q3_K_R4: _q3_k_r4, T.Q5_K_R4: _q5_k_r4,
    T.IQ4_XS_R8: _iq4_xs_r8, T.IQ5_KS_R4: _iq5_ks_r4,
    T.IQ2_BN_R4: _iq2_bn_r4,
    T.IQ3_XXS_R4: _iq3_xxs_r4, T.IQ3_S_R4: _iq3_s_r4,
    T.MXFP4_R8: _mxfp4_r8,
    T.IQ2_XXS_R4: _iq2_xxs_r4, T.IQ2_XS_R4: _iq2_xs_r4, T.IQ2_S_R4: _iq2_s_r4,
}
# A column block is one block of the base type (types.py's base), except that bf16_r16 interleaves
# pairs of values (ik needs ne0 % 2 == 0), where bf16's block is one value.
_COLUMN_BLOCK = {T.BF16_R16: 2}
LAYOUTS: dict[QuantType, Layout] = {
    qtype: Layout(traits(qtype).interleave_rows, _COLUMN_BLOCK.get(qtype, traits(traits(qtype).base).block_size),
                  forward)
    for qtype, forward in _FORWARD.items()}


def supports(qtype) -> bool:
    return QuantType(qtype) in LAYOUTS


# ---------------------------------------------------------------------------------- permutations
@lru_cache(maxsize=None)
def _bit_permutation(qtype: QuantType) -> np.ndarray:
    """perm[k] = the input bit that output bit k of one block comes from (LSB-first bit order)."""
    lay = LAYOUTS[qtype]
    base = traits(qtype).base
    block_bytes = traits(base).type_size * lay.block_values // traits(base).block_size
    n_bytes = lay.rows * block_bytes
    n_bits = 8 * n_bytes
    idx = np.arange(n_bits)
    perm = np.zeros(n_bits, np.int64)
    for p in range(max(1, int(n_bits - 1).bit_length())):
        bits = ((idx >> p) & 1).astype(U8)
        probe = np.packbits(bits.reshape(-1, 8), axis=1, bitorder="little").reshape(1, lay.rows, block_bytes)
        out = np.asarray(lay.forward(probe), U8).reshape(-1)
        if out.size != n_bytes:
            raise AssertionError(f"{qtype!r}: layout writes {out.size} bytes, expected {n_bytes}")
        perm |= np.unpackbits(out, bitorder="little").astype(np.int64) << p
    if not np.array_equal(np.sort(perm), idx):
        raise AssertionError(f"{qtype!r}: the layout is not a bit permutation")
    return perm


# ---------------------------------------------------------------------------------- the kernel
# A layout's bit permutation is compiled into straight-line machine code for one column block:
# every output chunk (8, 4 or 1 consecutive bytes whose bits come alike from consecutive source
# bytes) is a few loads, shifts, masks and ORs and one store, with constant offsets.  The chunk list
# is built from the permutation at compile time and emitted as LLVM IR by an intrinsic
# (``_column_block``), so numba's typing never sees thousands of statements; a generic interpreter
# of the same moves ran 3-5x slower (it loops over short moves), and numba-generated Python for it
# took up to 15 s to compile per layout.
#
#   plain side:   row k's block at  plain + k*row_size   (k < N; offsets within the block)
#   packed side:  the interleaved block at  packed        (offsets 0 .. N*blk-1)
#
# A chunk: (width, dst (k, offset), [(src (k, offset), shift, mask, dst_shift), ...]); k = -1 on the
# packed side.  Every source run lies inside one byte, so a width-W integer op treats each of its W
# bytes alike (masks repeated per byte), on any alignment.

_WIDTHS = (8, 4, 1)


@dataclass(frozen=True)
class Chunk:
    width: int
    dst: tuple[int, int]
    runs: tuple[tuple[tuple[int, int], int, int, int], ...]


def _runs(src_byte, src_bit):
    """Maximal runs of consecutive bits from one source byte in one output byte:
    (source byte, source shift, mask, destination shift)."""
    runs, k = [], 0
    while k < 8:
        e = k + 1
        while e < 8 and src_byte[e] == src_byte[k] and src_bit[e] == src_bit[e - 1] + 1:
            e += 1
        runs.append((int(src_byte[k]), int(src_bit[k]), (1 << (e - k)) - 1, k))
        k = e
    return runs


@lru_cache(maxsize=None)
def chunks(qtype: QuantType, inverse: bool) -> tuple[Chunk, ...]:
    """The output chunks of one column block of ``qtype`` (plain -> interleaved, or back)."""
    n = LAYOUTS[qtype].rows
    perm = _bit_permutation(qtype)
    blk = perm.size // 8 // n
    if inverse:
        perm = np.argsort(perm)

    def plain(b):
        return (b // blk, b % blk)

    def packed(b):
        return (-1, b)

    dst_at, src_at = (plain, packed) if inverse else (packed, plain)
    n_bytes = perm.size // 8
    src_byte = perm.reshape(n_bytes, 8) // 8
    src_bit = perm.reshape(n_bytes, 8) % 8
    per_byte = [[(src_at(b), sh, mask, ds) for b, sh, mask, ds in _runs(src_byte[j], src_bit[j])]
                for j in range(n_bytes)]

    def alike(j, t):
        """Output byte j+t is byte j's pattern moved t bytes along (same rows)."""
        if dst_at(j + t) != (dst_at(j)[0], dst_at(j)[1] + t) or len(per_byte[j + t]) != len(per_byte[j]):
            return False
        return all(q[1:] == r[1:] and q[0] == (r[0][0], r[0][1] + t) for q, r in zip(per_byte[j + t], per_byte[j]))

    out, j = [], 0
    while j < n_bytes:
        width = next(w for w in _WIDTHS if w == 1 or (j + w <= n_bytes and all(alike(j, t) for t in range(1, w))))
        out.append(Chunk(width, dst_at(j), tuple(tuple(r) for r in per_byte[j])))
        j += width
    return tuple(out)


def _key(qtype: QuantType, inverse: bool) -> int:
    return 2 * int(qtype) + int(inverse)


def _from_key(key: int) -> tuple[QuantType, bool]:
    return QuantType(key // 2), bool(key % 2)


@intrinsic
def _column_block(typingctx, src, dst, plain, packed, row_size, key):
    """One column block of the layout ``key`` (a literal: 2*qtype + inverse) from src to dst, plain
    side at byte offset ``plain`` (row 0; row k at + k*row_size), packed side at ``packed``."""
    if not isinstance(key, nbt.IntegerLiteral):
        return None
    qtype, inverse = _from_key(key.literal_value)
    sig = nbt.void(src, dst, plain, packed, row_size, key)

    def codegen(context, builder, signature, args):
        src_v, dst_v, plain_v, packed_v, row_v, _ = args
        i64 = ir.IntType(64)
        rows = LAYOUTS[qtype].rows
        src_data = context.make_array(signature.args[0])(context, builder, src_v).data
        dst_data = context.make_array(signature.args[1])(context, builder, dst_v).data

        def bases(data, plain_side):
            if not plain_side:
                return {-1: builder.gep(data, [packed_v])}
            return {k: builder.gep(data, [builder.add(plain_v, builder.mul(ir.Constant(i64, k), row_v))])
                    for k in range(rows)}

        src_base = bases(src_data, not inverse)
        dst_base = bases(dst_data, inverse)
        loaded = {}                     # one load per source word: runs often share one

        def load(at, width):
            if (at, width) not in loaded:
                ty = ir.IntType(8 * width)
                ptr = builder.bitcast(builder.gep(src_base[at[0]], [ir.Constant(i64, at[1])]), ty.as_pointer())
                loaded[at, width] = builder.load(ptr, align=1)
            return loaded[at, width]

        for c in chunks(qtype, inverse):
            ty = ir.IntType(8 * c.width)
            rep = int.from_bytes(b"\x01" * c.width, "little")
            value = None
            for at, shift, mask, dst_shift in c.runs:
                v = load(at, c.width)
                if mask != 255:
                    if shift:
                        v = builder.lshr(v, ir.Constant(ty, shift))
                    v = builder.and_(v, ir.Constant(ty, mask * rep))
                    if dst_shift:
                        v = builder.shl(v, ir.Constant(ty, dst_shift))
                value = v if value is None else builder.or_(value, v)
            ptr = builder.bitcast(builder.gep(dst_base[c.dst[0]], [ir.Constant(i64, c.dst[1])]), ty.as_pointer())
            builder.store(value, ptr, align=1)
        return context.get_dummy_value()
    return sig, codegen


# One thread, without the GIL: callers run chunks side by side on their own threads (quantkit
# repack's workers).  A numba parallel loop here made its OpenMP threads spin at every chunk's end,
# taking the CPU from the threads that read and write.
@njit(cache=True, nogil=True)
def _run_layout(src, dst, n_groups, n, row_size, meta, n_cb, key):
    """Row groups of n rows: the n row metas (meta bytes each, first in the packed group) and n_cb
    column blocks of the layout ``key`` (blk bytes per row per block).  Offsets into src and dst
    are the same: both layouts fill a group's n*row_size bytes."""
    blk = (row_size - meta) // n_cb
    inverse = key % 2 == 1
    group_bytes = n * row_size
    for g in range(n_groups):
        base = g * group_bytes
        for k in range(n):
            for i in range(meta):
                plain_at = np.uintp(base + k * row_size + i)
                packed_at = np.uintp(base + k * meta + i)
                if inverse:
                    dst[plain_at] = src[packed_at]
                else:
                    dst[packed_at] = src[plain_at]
        for cb in range(n_cb):
            _column_block(src, dst, base + meta + cb * blk, base + n * meta + cb * n * blk, row_size, key)


def _check(rows: np.ndarray, qtype, n_per_row: int):
    lay = LAYOUTS.get(QuantType(qtype))
    if lay is None:
        raise NotImplementedError(f"the {traits(qtype).name} layout is not implemented")
    if n_per_row % lay.block_values:
        raise ValueError(f"rows of {n_per_row} are not a multiple of {lay.block_values}")
    if rows.shape[0] % lay.rows:
        raise ValueError(f"{traits(qtype).name} needs a multiple of {lay.rows} rows, got {rows.shape[0]}")
    row_size = traits(qtype).row_size(n_per_row)
    if rows.ndim != 2 or rows.shape[1] != row_size:      # the kernel checks no bounds
        raise ValueError(f"rows of {n_per_row} {traits(qtype).name} values are {row_size} bytes, got shape {rows.shape}")
    return lay


_ENTRY: dict[int, Callable] = {}
_BYTES = nbt.Array(nbt.uint8, 1, "C")


def _layout_kernel(key: int) -> Callable:
    """_run_layout compiled (or loaded from numba's cache) for the literal ``key``, and called
    directly: the dispatcher would type a plain-int call first, and the layout needs the literal.
    The direct call checks no types, so the caller passes C-contiguous uint8 arrays (dst writable)."""
    fn = _ENTRY.get(key)
    if fn is None:
        sig = (_BYTES, _BYTES, nbt.int64, nbt.int64, nbt.int64, nbt.int64, nbt.int64, nbt.literal(key))
        _run_layout.compile(sig)
        fn = _ENTRY[key] = _run_layout.overloads[sig].entry_point
    return fn


def _regroup(rows: np.ndarray, qtype, n_per_row: int, inverse: bool, out: np.ndarray | None) -> np.ndarray:
    lay = _check(rows, qtype, n_per_row)
    qtype = QuantType(qtype)
    recode = _SIGN_RECODE.get(qtype)
    src = np.ascontiguousarray(rows, U8)
    dst = np.empty_like(src) if out is None else out
    if dst.shape != src.shape or dst.dtype != U8 or not dst.flags.writeable:
        raise ValueError("out must be a writable uint8 array shaped like rows")
    if recode is not None and not inverse:
        src = src.copy()                # the caller's rows stay as they are
        recode(src, _SCRAMBLE)
    key = _key(qtype, inverse)
    args = (src.reshape(-1), dst.reshape(-1), src.shape[0] // lay.rows, lay.rows, src.shape[1],
            traits(qtype).row_meta_size, n_per_row // lay.block_values, key)
    _layout_kernel(key)(*args)
    if recode is not None and inverse:
        recode(dst, _UNSCRAMBLE)
    return dst


def interleave(rows: np.ndarray, qtype, n_per_row: int, out: np.ndarray | None = None) -> np.ndarray:
    """Plain rows (n_rows, row_size) of ``qtype``'s base type -> rows of ``qtype`` (same shape).
    Groups of N consecutive rows; the caller keeps groups inside one matrix (expert)."""
    return _regroup(rows, qtype, n_per_row, False, out)


def deinterleave(rows: np.ndarray, qtype, n_per_row: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of the interleaved ``qtype`` -> the plain rows they came from, bit for bit."""
    return _regroup(rows, qtype, n_per_row, True, out)
