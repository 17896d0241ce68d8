"""Hot loops: the fused MXFP4 dequantize-and-multiply of the routed experts, with its slow numpy twin.

Shape letters: T = tokens (rows of x), R = weight rows (outputs), C = weight columns (inputs), G = C / 32 scale
groups per row, RB = weight rows decoded per tile.

    y[t, r] = sum_c x[t, c] * W[r, c],   W[r, c] = E2M1[nibble(r, c)] * 2^(scales[r, c // 32] - 127)

(K3_SPEC section 4; `k3serve.weights.mxfp4` defines the format.) The fused kernel never builds the float
matrix: each parallel task decodes RB rows into a small float32 tile (RB * C * 4 bytes, L2-resident) through a
16-entry nibble table and one power-of-two multiplier per group, and then applies that tile to all T tokens,
so every weight byte is decoded once per call however large T is. Decoding is exact (a power of two times a
two-bit mantissa), so the only rounding is in the dot products.

Determinism. Work is split over weight rows only, and every output y[t, r] is one dot product of a decoded
row with x[t], always computed by the same compiled loop. The result therefore depends neither on the number of
threads nor on T or on the other tokens in the batch (a token gets the same bits alone or batched). The dot
loop is compiled with LLVM's `reassoc` flag only, so that it can be vectorized: its summation order is fixed by
the compiled code (it may differ between CPUs with different vector widths), and NaN/inf semantics and
rounding of each product are unchanged (no fast-math NaN assumptions, no FMA contraction). Small matrices run
the same tile code on one thread (no pool wake-up); the serial and parallel paths give identical bits.

TODO: at T = 1 the scalar nibble decode (~1.5 cycles per byte) is the bottleneck, not memory; numba does not
vectorize the table lookups. A SIMD decode (or int8 activations) is the next step if experts stay compute bound.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from k3serve.weights.mxfp4 import E2M1_VALUES, check_mxfp4_shapes, dequantize_mxfp4, scale_bytes_to_f32

GROUP_SIZE = 32
BYTES_PER_GROUP = GROUP_SIZE // 2
TILE_ROWS = 8  # RB: 8 rows of the full-model expert (C = 3584) decode to a 112 KiB tile
# Below this many weights (R * C) one thread is faster than waking the pool (the tiny model's 64x64 and
# 128x128 experts take microseconds); both paths run the same tile code and give the same bits.
PARALLEL_MIN_WEIGHTS = 2**17

_NIBBLE_VALUES = np.ascontiguousarray(E2M1_VALUES, dtype=np.float32)  # [16]
_SCALE_VALUES = scale_bytes_to_f32(np.arange(256, dtype=np.uint8))  # [256], byte 255 -> 0


@njit(cache=True, fastmath={"reassoc"})
def _dot(w: np.ndarray, x: np.ndarray) -> np.float32:
    """sum_k w[k] * x[k] in float32; `reassoc` lets LLVM vectorize the sum in a fixed, compiled order."""
    total = np.float32(0.0)
    for k in range(w.shape[0]):
        total += w[k] * x[k]
    return total


@njit(cache=True, fastmath=False)
def _matmul_tile(
    packed: np.ndarray,  # u8 [R, C/2]
    scales: np.ndarray,  # u8 [R, G]
    x: np.ndarray,  # f32 [T, C], C-contiguous
    nibble_values: np.ndarray,  # f32 [16]
    scale_values: np.ndarray,  # f32 [256]
    out: np.ndarray,  # f32 [T, R]
    tile: int,
    decoded: np.ndarray,  # f32 [RB, C] scratch
) -> None:
    """Decode weight rows [tile * RB, tile * RB + RB) into `decoded`, then write out[:, those rows]."""
    num_rows = packed.shape[0]
    num_groups = scales.shape[1]
    row_start = tile * TILE_ROWS
    tile_rows = min(TILE_ROWS, num_rows - row_start)
    for local_row in range(tile_rows):
        row = row_start + local_row
        for group in range(num_groups):
            multiplier = scale_values[scales[row, group]]
            col = group * GROUP_SIZE
            byte_index = group * BYTES_PER_GROUP
            for j in range(BYTES_PER_GROUP):
                byte = packed[row, byte_index + j]
                decoded[local_row, col + 2 * j] = nibble_values[byte & 15] * multiplier
                decoded[local_row, col + 2 * j + 1] = nibble_values[byte >> 4] * multiplier
    for token in range(x.shape[0]):
        x_row = x[token]  # [C]
        for local_row in range(tile_rows):
            out[token, row_start + local_row] = _dot(decoded[local_row], x_row)


@njit(cache=True, parallel=True, fastmath=False)
def _mxfp4_matmul_parallel(
    packed: np.ndarray,
    scales: np.ndarray,
    x: np.ndarray,
    nibble_values: np.ndarray,
    scale_values: np.ndarray,
    out: np.ndarray,
) -> None:
    num_tiles = (packed.shape[0] + TILE_ROWS - 1) // TILE_ROWS
    for tile in prange(num_tiles):
        decoded = np.empty((TILE_ROWS, 2 * packed.shape[1]), dtype=np.float32)  # [RB, C]
        _matmul_tile(packed, scales, x, nibble_values, scale_values, out, tile, decoded)


@njit(cache=True, fastmath=False)
def _mxfp4_matmul_serial(
    packed: np.ndarray,
    scales: np.ndarray,
    x: np.ndarray,
    nibble_values: np.ndarray,
    scale_values: np.ndarray,
    out: np.ndarray,
) -> None:
    num_tiles = (packed.shape[0] + TILE_ROWS - 1) // TILE_ROWS
    decoded = np.empty((TILE_ROWS, 2 * packed.shape[1]), dtype=np.float32)  # [RB, C]
    for tile in range(num_tiles):
        _matmul_tile(packed, scales, x, nibble_values, scale_values, out, tile, decoded)


@njit(cache=True, fastmath=False)
def _situ_glu_inplace(gate: np.ndarray, up: np.ndarray, beta: np.float32, linear_beta: np.float32) -> None:
    """gate <- beta tanh(gate/beta) sigmoid(gate) linear_beta tanh(up/linear_beta), elementwise, [T, MI]."""
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            sig = np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            gate[t, i] = beta * np.tanh(g / beta) * sig * (linear_beta * np.tanh(up[t, i] / linear_beta))


@njit(cache=True, fastmath=False)
def _expert_forward_serial(
    w1_packed: np.ndarray, w1_scales: np.ndarray,  # u8 [MI, LT/2], [MI, LT/32]
    w3_packed: np.ndarray, w3_scales: np.ndarray,  # u8 [MI, LT/2], [MI, LT/32]
    w2_packed: np.ndarray, w2_scales: np.ndarray,  # u8 [LT, MI/2], [LT, MI/32]
    z: np.ndarray,  # f32 [T, LT]
    beta: np.float32, linear_beta: np.float32,
    nibble_values: np.ndarray, scale_values: np.ndarray,
    out: np.ndarray,  # f32 [T, LT]
) -> None:
    num_tokens = z.shape[0]
    gate = np.empty((num_tokens, w1_packed.shape[0]), dtype=np.float32)  # [T, MI]
    up = np.empty((num_tokens, w3_packed.shape[0]), dtype=np.float32)  # [T, MI]
    _mxfp4_matmul_serial(w1_packed, w1_scales, z, nibble_values, scale_values, gate)
    _mxfp4_matmul_serial(w3_packed, w3_scales, z, nibble_values, scale_values, up)
    _situ_glu_inplace(gate, up, beta, linear_beta)
    _mxfp4_matmul_serial(w2_packed, w2_scales, gate, nibble_values, scale_values, out)


def mxfp4_expert_forward(
    w1: tuple[np.ndarray, np.ndarray], w3: tuple[np.ndarray, np.ndarray], w2: tuple[np.ndarray, np.ndarray],
    z: np.ndarray, beta: float, linear_beta: float,
) -> np.ndarray:
    """One routed expert, w2 SiTU-GLU(w1 z, w3 z), each matrix given as (packed, scales). z [T, LT] -> [T, LT].

    Small experts run as one compiled call (three fused matmuls and the activation, no Python in between);
    large ones use the parallel matmul three times. The path depends only on the expert's shape, so a given
    model always computes the same bits."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    (p1, s1), (p3, s3), (p2, s2) = w1, w3, w2
    rows, cols = _check_operands(p1, s1, z)
    if rows * cols >= PARALLEL_MIN_WEIGHTS:
        gate = mxfp4_matmul(p1, s1, z)
        up = mxfp4_matmul(p3, s3, z)
        _situ_glu_inplace(gate, up, np.float32(beta), np.float32(linear_beta))
        return mxfp4_matmul(p2, s2, gate)
    _check_operands(p3, s3, z)
    out = np.empty((z.shape[0], p2.shape[0]), dtype=np.float32)  # [T, LT]
    if z.shape[0]:
        _expert_forward_serial(p1, s1, p3, s3, p2, s2, z, np.float32(beta), np.float32(linear_beta),
                               _NIBBLE_VALUES, _SCALE_VALUES, out)
    return out


@njit(cache=True, fastmath=False)
def _expert_accumulate_serial(
    w1_packed: np.ndarray, w1_scales: np.ndarray,
    w3_packed: np.ndarray, w3_scales: np.ndarray,
    w2_packed: np.ndarray, w2_scales: np.ndarray,
    z: np.ndarray,  # f32 [T, LT] latent of every token in the batch
    tokens: np.ndarray,  # i64 [n] the rows of z routed to this expert, ascending
    token_weights: np.ndarray,  # f32 [n] their mixing weights
    beta: np.float32, linear_beta: np.float32,
    nibble_values: np.ndarray, scale_values: np.ndarray,
    mixed: np.ndarray,  # f32 [T, LT], accumulated in place
) -> None:
    num_routed = tokens.shape[0]
    gathered = np.empty((num_routed, z.shape[1]), dtype=np.float32)  # [n, LT]
    for i in range(num_routed):
        gathered[i] = z[tokens[i]]
    out = np.empty((num_routed, w2_packed.shape[0]), dtype=np.float32)  # [n, LT]
    _expert_forward_serial(w1_packed, w1_scales, w3_packed, w3_scales, w2_packed, w2_scales, gathered,
                           beta, linear_beta, nibble_values, scale_values, out)
    for i in range(num_routed):
        weight = token_weights[i]
        for j in range(out.shape[1]):
            mixed[tokens[i], j] += weight * out[i, j]


@njit(cache=True, parallel=True, fastmath=False)
def _experts_parallel(
    w1_packed: np.ndarray, w1_scales: np.ndarray,  # u8 [E, MI, LT/2], [E, MI, LT/32] stacked experts
    w3_packed: np.ndarray, w3_scales: np.ndarray,
    w2_packed: np.ndarray, w2_scales: np.ndarray,  # u8 [E, LT, MI/2], [E, LT, MI/32]
    z: np.ndarray,  # f32 [T, LT]
    tokens: np.ndarray,  # i64 [N] token rows grouped by expert (expert e owns starts[e]:ends[e])
    starts: np.ndarray, ends: np.ndarray,  # i64 [E]
    beta: np.float32, linear_beta: np.float32,
    nibble_values: np.ndarray, scale_values: np.ndarray,
    out: np.ndarray,  # f32 [N, LT] row i = the expert's output for tokens[i]
) -> None:
    for e in prange(starts.shape[0]):
        begin, end = starts[e], ends[e]
        gathered = np.empty((end - begin, z.shape[1]), dtype=np.float32)  # [n, LT]
        for i in range(end - begin):
            gathered[i] = z[tokens[begin + i]]
        _expert_forward_serial(w1_packed[e], w1_scales[e], w3_packed[e], w3_scales[e], w2_packed[e], w2_scales[e],
                               gathered, beta, linear_beta, nibble_values, scale_values, out[begin:end])


@njit(cache=True, fastmath=False)
def _accumulate_rows(out: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, mixed: np.ndarray) -> None:
    """mixed[tokens[i]] += token_weights[i] * out[i], in row order (experts ascending, as the serial path)."""
    for i in range(tokens.shape[0]):
        weight = token_weights[i]
        for j in range(out.shape[1]):
            mixed[tokens[i], j] += weight * out[i, j]


def mxfp4_experts_accumulate(
    experts: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]],
    z: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, token_weights: np.ndarray,
    beta: float, linear_beta: float, mixed: np.ndarray,
) -> None:
    """Several small routed experts of one layer at once, spread over the cores: expert k owns rows
    starts[k]:ends[k] of `tokens` / `token_weights`. Bit-identical to calling `mxfp4_expert_accumulate` per expert
    in the given order: each expert's rows are computed by the same serial code, and the weighted sums are added
    afterwards in that order."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    stacked = [np.stack([expert[m][part] for expert in experts]) for m in range(3) for part in range(2)]
    out = np.empty((tokens.shape[0], stacked[4].shape[1]), dtype=np.float32)  # [N, LT]
    _experts_parallel(*stacked, z, tokens, starts, ends, np.float32(beta), np.float32(linear_beta),
                      _NIBBLE_VALUES, _SCALE_VALUES, out)
    _accumulate_rows(out, tokens, token_weights, mixed)


def mxfp4_expert_accumulate(
    w1: tuple[np.ndarray, np.ndarray], w3: tuple[np.ndarray, np.ndarray], w2: tuple[np.ndarray, np.ndarray],
    z: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, beta: float, linear_beta: float,
    mixed: np.ndarray,
) -> None:
    """mixed[tokens] += token_weights * expert(z[tokens]) for one routed expert, in one compiled call for small
    experts. Each token's result is the same bits as `mxfp4_expert_forward` on that token alone, weighted and
    added in float32, so the batch composition never changes a token's output."""
    (p1, s1), (p3, s3), (p2, s2) = w1, w3, w2
    rows, cols = check_mxfp4_shapes(p1, s1)
    if rows * cols >= PARALLEL_MIN_WEIGHTS or not (z.flags.c_contiguous and mixed.flags.c_contiguous):
        y = mxfp4_expert_forward(w1, w3, w2, z[tokens], beta, linear_beta)
        mixed[tokens] += token_weights[:, None] * y
        return
    _expert_accumulate_serial(p1, s1, p3, s3, p2, s2, z, tokens, token_weights, np.float32(beta),
                              np.float32(linear_beta), _NIBBLE_VALUES, _SCALE_VALUES, mixed)


def _check_operands(packed: np.ndarray, scales: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    rows, cols = check_mxfp4_shapes(packed, scales)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}] to multiply an MXFP4 [{rows}, {cols}] matrix, got {x.shape}")
    return rows, cols


def mxfp4_matmul(
    packed: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """x @ dequantize_mxfp4(packed, scales).T without building the float matrix.

    packed u8 [R, C/2], scales u8 [R, C/32], x float32 [T, C] (other layouts/dtypes are converted) -> [T, R].
    `out`, if given, must be a C-contiguous float32 [T, R] array and is filled and returned.
    """
    packed = np.ascontiguousarray(packed)
    scales = np.ascontiguousarray(scales)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = _check_operands(packed, scales, x)
    num_tokens = x.shape[0]
    if out is None:
        out = np.empty((num_tokens, rows), dtype=np.float32)  # [T, R]
    elif out.shape != (num_tokens, rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous float32 [{num_tokens}, {rows}] array, got {out.dtype} {out.shape}"
        )
    if num_tokens == 0 or rows == 0:
        return out
    kernel = _mxfp4_matmul_parallel if rows * cols >= PARALLEL_MIN_WEIGHTS else _mxfp4_matmul_serial
    kernel(packed, scales, x, _NIBBLE_VALUES, _SCALE_VALUES, out)
    return out


def mxfp4_matmul_reference(packed: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The slow twin of `mxfp4_matmul`: dequantize to float32 [R, C], then one numpy matmul. -> f32 [T, R]."""
    x = np.asarray(x, dtype=np.float32)
    _check_operands(np.asarray(packed), np.asarray(scales), x)
    return x @ dequantize_mxfp4(packed, scales).T  # [T, R]


def warmup() -> None:
    """Compile (or load from numba's cache) every kernel of this module on tiny inputs."""
    packed = np.zeros((3, BYTES_PER_GROUP), dtype=np.uint8)  # [3, 16]
    scales = np.full((3, 1), 127, dtype=np.uint8)  # [3, 1]
    x = np.ones((2, GROUP_SIZE), dtype=np.float32)  # [2, 32]
    out = np.empty((2, 3), dtype=np.float32)  # [2, 3]
    for kernel in (_mxfp4_matmul_serial, _mxfp4_matmul_parallel):
        kernel(packed, scales, x, _NIBBLE_VALUES, _SCALE_VALUES, out)
    square = (np.zeros((32, 16), np.uint8), np.full((32, 1), 127, np.uint8))  # a [32, 32] matrix
    mxfp4_expert_forward(square, square, square, np.ones((2, 32), np.float32), 4.0, 25.0)
    mxfp4_expert_accumulate(square, square, square, np.ones((2, 32), np.float32), np.array([1], np.int64),
                            np.ones(1, np.float32), 4.0, 25.0, np.zeros((2, 32), np.float32))
    mxfp4_experts_accumulate([(square, square, square)] * 2, np.ones((2, 32), np.float32),
                             np.array([0, 1], np.int64), np.array([0, 1], np.int64), np.array([1, 2], np.int64),
                             np.ones(2, np.float32), 4.0, 25.0, np.zeros((2, 32), np.float32))
