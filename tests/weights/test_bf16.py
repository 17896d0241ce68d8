"""bf16 conversion: round-to-nearest-even on the bit level, NaN/inf, exhaustive exactness of widening."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.weights.bf16 import bf16_bits_to_f32, f32_to_bf16_bits, round_to_bf16


def _f32(bits: list[int]) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize(
    ("f32_bits", "bf16_bits"),
    [
        (0x3F808000, 0x3F80),  # 1 + 2^-8: tie between 1.0 (even) and 1 + 2^-7 -> down
        (0x3F818000, 0x3F82),  # tie between 0x3F81 (odd) and 0x3F82 (even) -> up
        (0x3F808001, 0x3F81),  # just above the tie -> up
        (0x3F807FFF, 0x3F80),  # just below the tie -> down
        (0xBF808000, 0xBF80),  # negative tie -> even magnitude
        (0xBF818000, 0xBF82),
        (0x7F7FFFFF, 0x7F80),  # largest float32 rounds up into +inf
        (0x7F7F7FFF, 0x7F7F),  # stays the largest finite bf16
        (0x00008000, 0x0000),  # subnormal tie -> even (zero)
        (0x00018000, 0x0002),  # subnormal tie -> even (up)
        (0x80000000, 0x8000),  # -0.0 keeps its sign
        (0x7F800000, 0x7F80),  # +inf
        (0xFF800000, 0xFF80),  # -inf
    ],
)
def test_round_to_nearest_even_bit_patterns(f32_bits: int, bf16_bits: int) -> None:
    got = int(f32_to_bf16_bits(_f32([f32_bits]))[0])
    assert got == bf16_bits, f"0x{f32_bits:08X} -> 0x{got:04X}, want 0x{bf16_bits:04X}"


def test_nan_stays_nan_even_with_low_payload() -> None:
    # A NaN whose payload lives only in the low 16 bits would become inf under naive rounding.
    nans = _f32([0x7F800001, 0xFF800001, 0x7FC00000, 0x7FFFFFFF])
    bits = f32_to_bf16_bits(nans)
    widened = bf16_bits_to_f32(bits)
    assert np.all(np.isnan(widened)), [hex(b) for b in bits]
    assert list(np.signbit(widened)) == [False, True, False, False]


def test_widening_is_exact_for_every_bf16_pattern() -> None:
    all_bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)  # [65536]
    widened = bf16_bits_to_f32(all_bits)
    assert widened.dtype == np.float32
    assert np.array_equal(widened.view(np.uint32), all_bits.astype(np.uint32) << 16)
    back = f32_to_bf16_bits(widened)
    finite_or_inf = ~np.isnan(widened)
    assert np.array_equal(back[finite_or_inf], all_bits[finite_or_inf])
    assert np.all(np.isnan(bf16_bits_to_f32(back[~finite_or_inf])))


def test_rounding_picks_the_nearest_neighbour() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20_000) * np.exp2(rng.integers(-60, 60, 20_000))).astype(np.float32)
    rounded = round_to_bf16(x).astype(np.float64)
    truncated_bits = x.view(np.uint32) & np.uint32(0xFFFF0000)
    below = truncated_bits.view(np.float32).astype(np.float64)  # toward zero
    above = (truncated_bits + np.uint32(0x10000)).view(np.float32).astype(np.float64)  # away from zero
    x64 = x.astype(np.float64)
    best = np.minimum(np.abs(x64 - below), np.abs(x64 - above))
    assert np.all(np.abs(x64 - rounded) == best)
    assert np.all((rounded == below) | (rounded == above))


def test_round_to_bf16_is_idempotent_and_keeps_shape() -> None:
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    once = round_to_bf16(x)
    assert once.shape == (2, 3, 4) and once.dtype == np.float32
    assert np.array_equal(round_to_bf16(once), once)
    assert np.all(once.view(np.uint32) & np.uint32(0xFFFF) == 0)


def test_bits_to_f32_rejects_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="uint16"):
        bf16_bits_to_f32(np.zeros(3, dtype=np.int32))
