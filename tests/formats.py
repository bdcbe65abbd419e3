"""Number formats written out from their definitions, shared by the byte-level tests.

e4m3fn (OCP FP8): 1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits, no infinities,
S.1111.111 = NaN. bf16: the top 16 bits of a float32. Nothing here calls torch's casts, so the
tests that use it check torch's and our rounding against the formats themselves.
"""

import struct

import numpy as np


def e4m3_table() -> np.ndarray:
    """float64 value of each of the 256 e4m3fn byte codes."""
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values[code] = np.nan
        elif exponent == 0:
            values[code] = sign * mantissa * 2.0**-9  # subnormal: 0.mmm * 2**(1 - 7)
        else:
            values[code] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return values


E4M3 = e4m3_table()
E4M3_NONNEG = E4M3[:0x7F]  # codes 0..126: 0, the subnormals, then normals up to 448, ascending


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """Nearest e4m3 code (uint8) of float64 values with |v| <= 448, ties to even; -tiny → -0."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(E4M3_NONNEG, a), 0, 0x7E)
    lo = np.clip(hi - 1, 0, 0x7E)
    d_lo, d_hi = a - E4M3_NONNEG[lo], E4M3_NONNEG[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # even code = even mantissa
    code = np.where(take_hi, hi, lo)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def e4m3_half_step(v: np.ndarray) -> np.ndarray:
    """Half the e4m3 spacing at |v|: 2**(floor(log2|v|) - 3) / 2 for normals, 2**-9 / 2 below."""
    a = np.abs(v)
    _, exp = np.frexp(np.maximum(a, 2.0**-6))  # a = m * 2**exp, m in [0.5, 1)
    step = np.where(a >= 2.0**-6, np.ldexp(1.0, exp - 1 - 3), 2.0**-9)
    return step / 2


def smallest_pow2_at_least(s: float) -> float:
    k = 0
    while 2.0**k < s:
        k += 1
    while 2.0 ** (k - 1) >= s:
        k -= 1
    return 2.0**k


def f32(v: float) -> float:
    """Round to float32 (division results rounded from float64 equal float32 division)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bf16_bits(v: np.ndarray) -> np.ndarray:
    """float32 values -> bf16 bit patterns, round to nearest even on the dropped 16 bits."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)
