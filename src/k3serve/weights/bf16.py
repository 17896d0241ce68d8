"""bfloat16 <-> float32 conversion on raw bit patterns (numpy has no bf16 dtype).

bf16 is the top 16 bits of an IEEE float32: 1 sign bit, 8 exponent bits, 7 mantissa bits. Widening is exact
(append 16 zero bits). Narrowing rounds the dropped 16 bits to nearest, ties to even (RNE):

    bits16 = (bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16

which carries into the exponent when the mantissa overflows (so the largest finite values round to inf, as
RNE requires) and leaves +-inf unchanged. NaN needs its own branch: the sum above could carry a NaN with a
small payload into inf, so a NaN keeps its sign and top payload bits and gets the quiet bit set.

Trunk matrices of the released checkpoint are bf16; the reference computes in float32 from bf16-rounded
weights, so `round_to_bf16` is how test fixtures are made to match a checkpoint bit for bit.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

_QUIET_NAN_BIT = np.uint32(0x0040)  # bit 6 of the bf16 pattern: the top mantissa bit


def f32_to_bf16_bits(x: ArrayLike) -> np.ndarray:
    """Round float32 values to bf16 (nearest, ties to even) and return the bit patterns as uint16.

    Inputs of another float dtype are first converted to float32 (a float64 input is therefore rounded twice;
    pass float32 when that matters). NaN stays NaN (sign kept, quiet bit set), +-inf stays +-inf.
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = x32.view(np.uint32)  # same shape as x
    rounding_bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    rounded = ((bits + rounding_bias) >> np.uint32(16)).astype(np.uint16)
    is_nan = np.isnan(x32)
    if np.any(is_nan):
        nan_bits = ((bits >> np.uint32(16)) | _QUIET_NAN_BIT).astype(np.uint16)
        rounded = np.where(is_nan, nan_bits, rounded)
    return rounded


def bf16_bits_to_f32(bits: ArrayLike) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32, exactly. Returns a fresh array of the same shape."""
    bits16 = np.asarray(bits)
    if bits16.dtype != np.uint16:
        raise ValueError(f"bf16 bit patterns must be uint16, got {bits16.dtype}")
    widened = bits16.astype(np.uint32) << np.uint32(16)  # fresh, contiguous
    return widened.view(np.float32)


def round_to_bf16(x: ArrayLike) -> np.ndarray:
    """float32 values rounded (RNE) to the nearest bf16 value, returned as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))
