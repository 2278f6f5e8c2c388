"""Value tables that the formats (numpy), the kernels (numba) and the runtime all read: a leaf
module, so that no layer has to import another for them (issue 24 item 5: formats import kernels,
never the reverse), and each table is written once.

The non-linear value tables of ik_llama.cpp's IQK types (specs/ik-quants.md §0).  Each has a base
half and a "shifted" half (the ``extra`` bit of a sub-block selects the second half).
"""
from __future__ import annotations

import numpy as np

IQ2NL_VALUES = np.array([-31, -13, 1, 17, -26, -8, 6, 22], np.int8)
IQ3NL_VALUES = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], np.int8)
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                        -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], np.int8)
IQ5NL_VALUES = np.array([
    -126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
    -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
    -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
    1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123], np.int8)
IQ6NL_VALUES = np.array([
    -127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
    -51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5,
    -2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44,
    47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121,
    -126, -120, -114, -108, -103, -97, -92, -87, -83, -78, -73, -69, -65, -61, -57, -53,
    -50, -46, -43, -39, -36, -33, -30, -27, -24, -21, -18, -15, -12, -10, -7, -4,
    -1, 1, 4, 7, 10, 13, 15, 18, 21, 24, 28, 31, 34, 37, 41, 45,
    48, 52, 56, 60, 64, 69, 73, 78, 83, 88, 93, 99, 104, 110, 116, 122], np.int8)

#: IQ4_NL / IQ4_XS (kvalues_iq4nl): the base half of IQ4_K's table
IQ4NL_VALUES = IQ4K_VALUES[:16]

#: MXFP4 (kvalues_mxfp4): the E2M1 values doubled (the scale is half the E8M0 power of two);
#: code 8 is -0, stored as 0
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
#: E8M0 byte e -> 2^(e - 128) as float32 (GGML_E8M0_TO_FP32_HALF: bits (e - 1) << 23; e = 0, 1 the
#: subnormals 0x00200000 << e), the block scale MXFP4's values multiply
E8M0_HALF = np.array([0x00200000, 0x00400000] + [(e - 1) << 23 for e in range(2, 256)], np.uint32).view(np.float32)

#: IQ6_K's values are a cubic in the 6-bit code q, computed in float32:
#: A + q*(B + q*(-C + q*D)), plus 1 in a shifted sub-block
A_IQ6K, B_IQ6K, C_IQ6K, D_IQ6K = np.float32(-127.0), np.float32(6.2568), np.float32(0.11218), np.float32(0.0011972)

#: fp16 bit pattern -> float32 value, for the decoders (exact: every fp16 is a float32)
FP16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
