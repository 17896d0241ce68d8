"""Family experts at each precision: bf16 kept as bf16, int8 and MXFP4 in one fused call, against float32."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.families.experts import (DENSE_KERNEL_MAX_TOKENS, BF16Expert, FloatExpert, QuantizedExpert,
                                            pack_expert)


def _bf16_round(w: np.ndarray) -> np.ndarray:
    return ((w.astype(np.float32).view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)


def _matrices(seed: int, hidden: int = 64, inner: int = 96):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((inner, hidden)).astype(np.float32) / 8 for _ in range(2))
    return gate, up, rng.standard_normal((hidden, inner)).astype(np.float32) / 8


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


@pytest.mark.parametrize("tokens", [1, 5, DENSE_KERNEL_MAX_TOKENS + 3])
def test_bf16_weights_stay_bf16_and_compute_the_same(tokens):
    gate, up, down = (_bf16_round(m) for m in _matrices(1))
    expert = pack_expert(gate, up, down, "native")
    assert isinstance(expert, BF16Expert) and expert.gate_up.dtype == np.uint16
    float_expert = FloatExpert(np.concatenate([gate, up]), down)
    assert expert.nbytes * 2 == float_expert.nbytes  # half the bytes of the float32 copy, and no such copy held
    x = np.random.default_rng(2).standard_normal((tokens, 64)).astype(np.float32)
    assert _relative_rms(expert(x), float_expert(x)) < 1e-5


def test_float32_weights_stay_float32():
    assert isinstance(pack_expert(*_matrices(3), "native"), FloatExpert)


@pytest.mark.parametrize("precision", ["int8", "mxfp4"])
def test_quantized_expert_fused_call_matches_dequantized_float(precision):
    expert = pack_expert(*_matrices(4), precision)
    assert isinstance(expert, QuantizedExpert)
    dequantized = FloatExpert(np.concatenate([expert.gate.dequantize(), expert.up.dequantize()]),
                              expert.down.dequantize())
    for tokens in (1, 4, DENSE_KERNEL_MAX_TOKENS + 1):
        x = np.random.default_rng(tokens).standard_normal((tokens, 64)).astype(np.float32)
        assert _relative_rms(expert(x), dequantized(x)) < 1e-5, f"{precision}, {tokens} tokens"
