"""The opt-in MXFP4 x int8 path (`kernels.mxfp4_matmul_q8`, `mxfp4_experts_run(activations="q8")`) on every
instruction set this CPU has for it (AVX-512 VNNI, AVX2): equal to its exact twin (Q8_0-quantized activations times
the dequantized weights, in float64) on odd group counts and 255 scales, its error against the float path reported
and bounded, and refused clearly on an instruction set without it."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model import kernels
from k3serve.model.ops import situ_glu
from k3serve.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4



def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2) / np.mean(np.asarray(want, np.float64) ** 2)))


def _dequantized_activations(x: np.ndarray) -> np.ndarray:
    """What the int8 path multiplies: x through Q8_0 and back, float64 [T, C]."""
    q, d = kernels.quantize_activations(x)  # [T, C], [T, G]
    return (q.reshape(x.shape[0], -1, 32).astype(np.float64) * d[:, :, None]).reshape(x.shape)


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
@pytest.mark.parametrize(("rows", "cols", "num_tokens"), [(1, 32, 1), (7, 96, 2), (9, 160, 3), (37, 3584, 1),
                                                          (20, 2080, 2)])
def test_q8_matmul_equals_its_exact_twin(isa: str, rows: int, cols: int, num_tokens: int) -> None:
    """1 to 4 groups in the last VNNI step (the masked tail), 255-scale groups; against float64 of the same
    quantized inputs the only error is float32 summation."""
    rng = np.random.default_rng(rows + cols)
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(116, 127, size=(rows, cols // 32), dtype=np.uint8)
    scales.reshape(-1)[1::5] = 255
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    got = kernels.mxfp4_matmul_q8(packed, scales, x, isa=isa)
    twin = _dequantized_activations(x) @ dequantize_mxfp4(packed, scales).T.astype(np.float64)  # [T, R]
    assert got.shape == (num_tokens, rows) and got.dtype == np.float32
    assert _relative_rms(got, twin) < 1e-6
    # against the float path: Q8_0 activations cost ~0.5% relative RMS over many dots (llama.cpp's mxfp4 x q8_0
    # error); a single dot can be off by a few %
    error = _relative_rms(got, kernels.mxfp4_matmul_reference(packed, scales, x).astype(np.float64))
    assert 1e-4 < error < 5e-2, error


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
@pytest.mark.parametrize(("latent", "inter"), [(64, 96), (256, 160)])
def test_q8_experts_equal_their_twin_and_stay_near_the_float_path(isa: str, latent: int, inter: int) -> None:
    rng = np.random.default_rng(latent + inter)
    mats = [[quantize_mxfp4((s * rng.normal(size=shape)).astype(np.float32)) for s, shape in
             ((2.0, (inter, latent)), (20.0, (inter, latent)), (0.1, (latent, inter)))] for _ in range(4)]
    stacked = tuple(np.stack([m[i][part] for m in mats]) for i in range(3) for part in range(2))
    expert_ids, tokens = np.array([1, 3], np.int64), np.array([0, 2, 1], np.int64)
    starts, ends = np.array([0, 2], np.int64), np.array([2, 3], np.int64)
    z = rng.normal(size=(3, latent)).astype(np.float32)
    got = kernels.mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0, isa=isa,
                                    activations="q8")
    float_path = kernels.mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0,
                                           activations="f32")
    zq = _dequantized_activations(z)
    for k, e in enumerate(expert_ids):
        w1, w3, w2 = (dequantize_mxfp4(*m).astype(np.float64) for m in mats[e])
        pair = tokens[starts[k]:ends[k]]
        hidden = situ_glu((zq[pair] @ w1.T).astype(np.float32), (zq[pair] @ w3.T).astype(np.float32), 4.0, 25.0)
        want = _dequantized_activations(hidden) @ w2.T  # [n, LT]
        # a hidden value on a rounding edge may quantize one step apart from the twin's: a small tolerance
        assert _relative_rms(got[starts[k]:ends[k]], want) < 1e-3
    assert 1e-4 < _relative_rms(got, float_path.astype(np.float64)) < 5e-2


def test_unknown_activations_are_refused() -> None:
    stacked = kernels.stack_expert(*[(np.zeros((32, 16), np.uint8), np.full((32, 1), 127, np.uint8))] * 3)
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="activations"):
        kernels.mxfp4_experts_run(stacked, one, np.ones((1, 32), np.float32), one, one, np.ones(1, np.int64), 4.0,
                                  25.0, activations="int4")


def test_instruction_set_without_the_int8_path_is_refused() -> None:
    with pytest.raises(ValueError, match="int8 path"):
        kernels.mxfp4_matmul_q8(np.zeros((1, 16), np.uint8), np.full((1, 1), 127, np.uint8),
                                np.ones((1, 32), np.float32), isa="portable")


def test_int8_instruction_sets_agree_closely() -> None:
    """AVX-512 and AVX2 group the lanes differently (other float bits), but sum the same exact int32 group sums."""
    if len(kernels.Q8_ISAS) < 2:
        assert kernels.Q8_ISAS in ((), ("avx2",)), kernels.Q8_ISAS
        return
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, size=(33, 1120), dtype=np.uint8)  # [33, 2240]: 70 groups, a 2-group tail
    scales = rng.integers(116, 127, size=(33, 70), dtype=np.uint8)
    x = rng.standard_normal((2, 2240)).astype(np.float32)
    wide, narrow = (kernels.mxfp4_matmul_q8(packed, scales, x, isa=isa) for isa in ("avx512", "avx2"))
    assert _relative_rms(wide, narrow.astype(np.float64)) < 1e-6
