"""MXFP4 format (K3_SPEC section 4): nibble positions, scales, rounding rule, clamping, exactness, error bound."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.weights.mxfp4 import E2M1_VALUES, dequantize_mxfp4, mxfp4_nbytes, quantize_mxfp4


def _block(values: dict[int, float], width: int = 32) -> np.ndarray:
    row = np.zeros((1, width), dtype=np.float32)
    for index, value in values.items():
        row[0, index] = value
    return row


def test_e2m1_table() -> None:
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES.dtype == np.float32 and E2M1_VALUES.shape == (16,)
    assert list(E2M1_VALUES[:8]) == magnitudes
    assert list(E2M1_VALUES[8:]) == [-m for m in magnitudes]
    assert np.signbit(E2M1_VALUES[8])


def test_element_zero_is_the_low_nibble() -> None:
    # max 4 -> e = floor(log2 4) - 2 = 0 -> scale byte 127; element 0 = 4 (nibble 6), element 1 = 1 (nibble 2).
    packed, scales = quantize_mxfp4(_block({0: 4.0, 1: 1.0, 3: -3.0}))
    assert scales.tolist() == [[127]]
    assert packed.shape == (1, 16) and packed.dtype == np.uint8
    assert packed[0, 0] == 0x26, hex(packed[0, 0])  # swapped order would give 0x62
    assert packed[0, 1] == 0xD0, hex(packed[0, 1])  # element 3 = -3 -> nibble 8 | 5 in the high nibble
    assert np.all(packed[0, 2:] == 0)


def test_dequantize_reads_low_nibble_first() -> None:
    packed = np.zeros((1, 16), dtype=np.uint8)
    packed[0, 0] = 0x26
    packed[0, 15] = 0x9F  # element 30 = -6, element 31 = -0.5
    values = dequantize_mxfp4(packed, np.array([[128]], dtype=np.uint8))  # scale 2
    assert values[0, :2].tolist() == [8.0, 2.0]
    assert values[0, 30:].tolist() == [-12.0, -1.0]
    assert np.all(values[0, 2:30] == 0)


def test_each_group_has_its_own_scale() -> None:
    row = _block({0: 4.0, 32: 0.25, 33: 0.0625}, width=64)
    packed, scales = quantize_mxfp4(row)
    assert scales.tolist() == [[127, 127 - 4]]  # floor(log2 0.25) - 2 = -4
    assert np.array_equal(dequantize_mxfp4(packed, scales), row)


def test_scale_255_zeroes_only_its_group() -> None:
    rng = np.random.default_rng(0)
    packed, scales = quantize_mxfp4(rng.standard_normal((3, 96)).astype(np.float32))
    before = dequantize_mxfp4(packed, scales)
    scales[1, 1] = 255
    after = dequantize_mxfp4(packed, scales)
    assert np.all(after[1, 32:64] == 0) and np.any(before[1, 32:64] != 0)
    untouched = np.ones(after.shape, dtype=bool)
    untouched[1, 32:64] = False
    assert np.array_equal(after[untouched], before[untouched])
    assert np.all(np.isfinite(after))


def test_ties_go_to_the_smaller_magnitude() -> None:
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    smaller = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    values = {0: 4.0}  # fixes e = 0
    for i, m in enumerate(midpoints):
        values[1 + i] = m
        values[9 + i] = -m
        values[17 + i] = float(np.nextafter(np.float32(m), np.float32(10)))  # just above: rounds up
    got = dequantize_mxfp4(*quantize_mxfp4(_block(values)))[0]
    assert got[1:8].tolist() == smaller
    assert got[9:16].tolist() == [-s for s in smaller]
    assert got[17:24].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_clamp_at_six() -> None:
    # max 7.9 -> e = 0, so 7.9 and 6.5 (and -7) clamp to the largest magnitude, 6.
    got = dequantize_mxfp4(*quantize_mxfp4(_block({0: 7.9, 1: 6.5, 2: -7.0, 3: 5.5})))[0]
    assert got[:4].tolist() == [6.0, 6.0, -6.0, 6.0]


def test_values_on_the_grid_round_trip_exactly() -> None:
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(16, 48), dtype=np.uint8)  # [16, 96]
    scales = rng.integers(100, 150, size=(16, 3), dtype=np.uint8)
    grid = dequantize_mxfp4(packed, scales)
    again = dequantize_mxfp4(*quantize_mxfp4(grid))
    assert np.array_equal(again, grid)


def test_error_bound_on_random_data() -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 256)) * np.exp2(rng.integers(-8, 8, (64, 1)))).astype(np.float32)
    packed, scales = quantize_mxfp4(x)
    y = dequantize_mxfp4(packed, scales)
    relative_rms = float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))
    assert relative_rms < 0.13, f"relative RMS error {relative_rms:.4f}"
    # Per element: half a grid step (at most 1 * 2^e), or up to 2 * 2^e where values above 6 * 2^e clamp.
    step = np.exp2(scales.astype(np.float64) - 127).repeat(32, axis=1)
    assert np.all(np.abs(y - x) <= 2 * step)


def test_all_zero_block_and_signs() -> None:
    row = _block({32: -1.0, 33: 2.0, 34: -0.01, 35: -0.0}, width=64)
    packed, scales = quantize_mxfp4(row)
    assert scales[0, 0] == 0 and np.all(packed[0, :16] == 0)
    assert packed[0, 16] == 0x6C  # max 2 -> e = -1: -1 -> -2 (8 | 4), +2 -> 4 (6)
    assert packed[0, 17] == 0x00  # -0.01 rounds to zero, stored as +0; -0.0 also +0
    got = dequantize_mxfp4(packed, scales)
    assert got[0, 32:36].tolist() == [-1.0, 2.0, 0.0, 0.0]


def test_tiny_values_clamp_scale_to_zero() -> None:
    _, scales = quantize_mxfp4(_block({0: 1e-39}))
    assert scales[0, 0] == 0


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="C % 32"):
        quantize_mxfp4(np.zeros((2, 48), dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(np.full((1, 32), np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(np.zeros((2, 16), dtype=np.uint8), np.zeros((2, 2), dtype=np.uint8))


def test_nbytes_matches_the_released_expert_size() -> None:
    # K3_SPEC section 1: w1, w3 [3072, 3584] and w2 [3584, 3072] take 17,547,264 bytes together.
    per_expert = 2 * mxfp4_nbytes(3072, 3584) + mxfp4_nbytes(3584, 3072)
    assert per_expert == 17_547_264
    packed, scales = quantize_mxfp4(np.ones((3, 64), dtype=np.float32))
    assert packed.nbytes + scales.nbytes == mxfp4_nbytes(3, 64)
