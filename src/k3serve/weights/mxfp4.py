"""MXFP4 (OCP microscaling FP4) quantization of the routed experts, exactly as K3_SPEC section 4.

Shape letters: R = rows of a matrix, C = columns (elements per row), G = C / 32 scale groups per row.

Storage of one [R, C] matrix:
    packed  uint8 [R, C/2]   byte j of a row holds element 2j in its LOW nibble and element 2j+1 in its HIGH nibble
    scales  uint8 [R, C/32]  one E8M0 exponent byte per 32 consecutive elements of a row

Decode: value = E2M1[nibble] * 2^(scale - 127), where E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6} and
bit 3 of the nibble is the sign. Scale byte 255 is NaN in the OCP standard; we decode it as 0 so that one bad
byte zeroes one group instead of poisoning a whole forward pass.

Encode, per 32-block: e = floor(log2(max|x|)) - 2, scale byte = e + 127 (clamped to [0, 254]); each x / 2^e
is rounded to the nearest E2M1 magnitude, ties to the SMALLER magnitude, clamped at 6; the sign goes into bit 3
(a value that rounds to zero is stored as +0). An all-zero block gets scale byte 0 and zero nibbles.

The fused dequantize-and-multiply kernel lives in `k3serve.model.kernels`; this module is the format.
"""

from __future__ import annotations

import numpy as np

from k3serve.config import MXFP4_GROUP_SIZE

GROUP_SIZE = MXFP4_GROUP_SIZE  # elements per scale byte
SCALE_BIAS = 127
NAN_SCALE = 255  # decoded as 0 (see module docstring)
MAX_SCALE = 254  # largest scale byte the encoder writes
SIGN_BIT = 0x8

# [16] float32, indexed by nibble: 0..7 positive magnitudes, 8..15 the same negated (8 is -0.0).
E2M1_VALUES: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
E2M1_VALUES.setflags(write=False)

# Midpoints between consecutive magnitudes. The magnitude index of v is the number of midpoints strictly
# below v: nearest magnitude, ties going to the smaller one, clamped at 6.
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)

# [256, 2] float32: byte -> (element 2j, element 2j+1) before scaling.
_BYTE_TO_PAIR = np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=1)


def mxfp4_nbytes(rows: int, cols: int) -> int:
    """Bytes of packed nibbles plus scale bytes for an MXFP4 [rows, cols] matrix."""
    if rows < 0 or cols < 0 or cols % GROUP_SIZE:
        raise ValueError(
            f"MXFP4 needs rows >= 0 and cols a non-negative multiple of {GROUP_SIZE}, got [{rows}, {cols}]"
        )
    return rows * cols // 2 + rows * cols // GROUP_SIZE


def scale_bytes_to_f32(scales: np.ndarray) -> np.ndarray:
    """Per-group float32 multipliers 2^(s - 127), with byte 255 mapped to 0. Exact (2^-127 is a float32
    subnormal)."""
    scales_u8 = np.asarray(scales, dtype=np.uint8)
    is_nan_scale = scales_u8 == NAN_SCALE
    exponents = np.where(is_nan_scale, 0, scales_u8.astype(np.int32) - SCALE_BIAS)  # 2^128 would overflow
    multipliers = np.ldexp(np.float32(1.0), exponents).astype(np.float32)
    multipliers[is_nan_scale] = 0.0
    return multipliers


def check_mxfp4_shapes(packed: np.ndarray, scales: np.ndarray) -> tuple[int, int]:
    """Validate a (packed, scales) pair and return (R, C)."""
    if packed.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"MXFP4 packed and scales must be 2-D, got shapes {packed.shape} and {scales.shape}")
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    rows, half_cols = packed.shape
    cols = 2 * half_cols
    if scales.shape != (rows, cols // GROUP_SIZE) or cols % GROUP_SIZE:
        raise ValueError(
            f"MXFP4 shapes disagree: packed {packed.shape} means [{rows}, {cols}] values, which needs "
            f"cols % {GROUP_SIZE} == 0 and scales [{rows}, {cols // GROUP_SIZE}], got scales {scales.shape}"
        )
    return rows, cols


def quantize_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float32 [R, C] matrix (C % 32 == 0) to (packed uint8 [R, C/2], scales uint8 [R, C/32])."""
    values = np.asarray(x, dtype=np.float32)
    if values.ndim != 2 or values.shape[1] % GROUP_SIZE:
        raise ValueError(f"quantize_mxfp4 needs a 2-D [R, C] array with C % {GROUP_SIZE} == 0, got {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("quantize_mxfp4 got NaN or inf values")
    rows, cols = values.shape
    groups = cols // GROUP_SIZE
    blocks = values.reshape(rows, groups, GROUP_SIZE)  # [R, G, 32]
    magnitudes = np.abs(blocks)  # [R, G, 32]
    block_max = magnitudes.max(axis=2, initial=0.0)  # [R, G]

    # frexp: block_max = m * 2^k with m in [0.5, 1), so floor(log2(block_max)) = k - 1 exactly (no log2 rounding).
    _, k = np.frexp(block_max)  # [R, G]
    scale_bytes = np.clip(k.astype(np.int32) - 1 - 2 + SCALE_BIAS, 0, MAX_SCALE)  # [R, G]
    scale_bytes[block_max == 0] = 0

    # |x| / 2^(byte - 127) as a multiply by 2^(127 - byte), which is a normal or subnormal float32 for every byte
    # in [0, 254]: exact except where the result is subnormal, far below the first midpoint 0.25.
    inverse_scales = np.ldexp(np.float32(1.0), SCALE_BIAS - scale_bytes).astype(np.float32)  # [R, G]
    scaled = magnitudes * inverse_scales[:, :, None]  # [R, G, 32]
    nibbles = np.zeros(scaled.shape, dtype=np.uint8)  # [R, G, 32]
    for midpoint in _E2M1_MIDPOINTS:
        nibbles += scaled > midpoint  # count midpoints strictly below: ties round to the smaller magnitude
    nibbles = nibbles.reshape(rows, cols)  # [R, C]
    negative = (values < 0) & (nibbles != 0)
    nibbles |= negative.astype(np.uint8) << 3

    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [R, C/2]
    return np.ascontiguousarray(packed, dtype=np.uint8), scale_bytes.astype(np.uint8)


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode (packed uint8 [R, C/2], scales uint8 [R, C/32]) to float32 [R, C]."""
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    rows, cols = check_mxfp4_shapes(packed, scales)
    values = _BYTE_TO_PAIR[packed].reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)  # [R, G, 32]
    values *= scale_bytes_to_f32(scales)[:, :, None]
    return values.reshape(rows, cols)
