"""Q8_0 (llama.cpp / GGUF) quantization of dense trunk matrices: the format, its encoder and its decoder.

Shape letters: R = rows of a matrix, C = columns (elements per row), G = C / 32 blocks per row.

Storage of one [R, C] matrix, llama.cpp's `block_q8_0` laid out row by row (the bytes of a GGUF Q8_0 tensor):
    blocks  uint8 [R, G * 34]   block g of a row is 34 bytes at 34 g: an IEEE half scale d (2 bytes, little
                                endian), then 32 int8 values q
Decode: value = float32(d) * q, exact in float32 (an 11-bit mantissa times an 8-bit integer).

Encode, per 32-block (llama.cpp's `quantize_row_q8_0_ref`): d = max|x| / 127, q = roundf(x / d) (ties away from
zero; computed as x * (1 / d) in float32), d stored rounded to half. An all-zero block has d = 0 and q = 0.
34 bytes per 32 weights = 8.5 bits per weight.

Activations are quantized the same way (`quantize_rows`), one row at a time, when the kernel computes a Q8_0 x
Q8_0 dot (`k3serve.model.kernels.q8_0_matmul`); their scales stay float32 values of halves.
"""

from __future__ import annotations

import numpy as np

GROUP_SIZE = 32
BLOCK_BYTES = 2 + GROUP_SIZE  # f16 scale + 32 int8
MAX_INT = 127


def q8_0_nbytes(rows: int, cols: int) -> int:
    """Bytes of a Q8_0 [rows, cols] matrix (34 per 32 weights)."""
    if rows < 0 or cols < 0 or cols % GROUP_SIZE:
        raise ValueError(f"Q8_0 needs rows >= 0 and cols a non-negative multiple of {GROUP_SIZE}, got [{rows}, {cols}]")
    return rows * (cols // GROUP_SIZE) * BLOCK_BYTES


def _round_away(values: np.ndarray) -> np.ndarray:
    """C's roundf: nearest integer, ties away from zero (numpy's rint rounds ties to even)."""
    return np.copysign(np.floor(np.abs(values) + np.float32(0.5)), values)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] (C % 32 == 0) -> (q int8 [R, C], d float32 [R, G]): llama.cpp's encoder, the scales d kept
    as float32 values of their half rounding (the values the decoder multiplies by)."""
    values = np.asarray(x, dtype=np.float32)
    if values.ndim != 2 or values.shape[1] % GROUP_SIZE:
        raise ValueError(f"Q8_0 needs a 2-D [R, C] array with C % {GROUP_SIZE} == 0, got {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("Q8_0 quantization got NaN or inf values")
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)  # [R, G, 32]
    scales = np.abs(blocks).max(axis=2, initial=0.0) / np.float32(MAX_INT)  # [R, G]
    with np.errstate(divide="ignore"):
        inverse = np.where(scales > 0, np.float32(1.0) / scales, np.float32(0.0)).astype(np.float32)  # [R, G]
    q = _round_away(blocks * inverse[:, :, None]).astype(np.int8).reshape(rows, cols)  # [R, C]
    return q, scales.astype(np.float16).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [R, C] -> Q8_0 blocks uint8 [R, G * 34] (see the module docstring)."""
    q, scales = quantize_rows(x)
    rows, cols = q.shape
    groups = cols // GROUP_SIZE
    blocks = np.empty((rows, groups, BLOCK_BYTES), np.uint8)  # [R, G, 34]
    blocks[:, :, :2] = scales.astype("<f2").view(np.uint8).reshape(rows, groups, 2)
    blocks[:, :, 2:] = q.view(np.uint8).reshape(rows, groups, GROUP_SIZE)
    return blocks.reshape(rows, groups * BLOCK_BYTES)


def split_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks uint8 [R, G * 34] -> (q int8 [R, C], d float32 [R, G]), fresh arrays."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    if blocks.ndim != 2 or blocks.shape[1] % BLOCK_BYTES:
        raise ValueError(f"Q8_0 blocks must be uint8 [R, G * {BLOCK_BYTES}], got {blocks.shape}")
    rows, groups = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES
    view = blocks.reshape(rows, groups, BLOCK_BYTES)  # [R, G, 34]
    scales = np.ascontiguousarray(view[:, :, :2]).view("<f2").reshape(rows, groups).astype(np.float32)
    q = np.ascontiguousarray(view[:, :, 2:]).view(np.int8).reshape(rows, groups * GROUP_SIZE)
    return q, scales


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks uint8 [R, G * 34] -> float32 [R, C], exact."""
    q, scales = split_q8_0(blocks)
    rows, cols = q.shape
    return (q.reshape(rows, -1, GROUP_SIZE).astype(np.float32) * scales[:, :, None]).reshape(rows, cols)
