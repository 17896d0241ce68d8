"""The compiled trunk stages (model/fused_ops.py) against their numpy twins, bit for bit, on odd widths."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.attn_res import attn_res
from k3serve.model.fused_ops import (add_rms_norm, attn_res_norm, l2_normalize_into, rms_norm_into, route_top_k,
                                     shift_by_row_max, softmax_top_k)
from k3serve.model.ops import l2_normalize, rms_norm, softmax

# below 8 (plain sum), the 8-lane blocks with and without a tail, the first halving (129), K3 and real widths
WIDTHS = (1, 7, 8, 15, 63, 128, 129, 300, 1024, 2048, 7168)
EPS = 1e-6


def rms_norm_numpy(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`ops.rms_norm` before it ran the compiled stage."""
    variance = np.add.reduce(np.square(x), axis=-1, keepdims=True)
    np.true_divide(variance, x.shape[-1], out=variance)
    return x / np.sqrt(variance + np.float32(eps)) * weight


def l2_normalize_numpy(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def rows(seed: int, num_tokens: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((num_tokens, width)) * rng.uniform(0.01, 30.0)).astype(np.float32)  # [T, H]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("num_tokens", (1, 3))
def test_rms_norm_into_is_the_numpy_rms_norm_bit_for_bit(width, num_tokens):
    x, weight = rows(width, num_tokens, width), rows(width + 1, 1, width)[0]
    out = np.empty_like(x)
    rms_norm_into(x, weight, np.float32(EPS), out)
    np.testing.assert_array_equal(out, rms_norm_numpy(x, weight, EPS))
    rms_norm_into(x, weight, np.float32(EPS), x)  # in place
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_is_the_residual_add_then_the_norm(width):
    h, delta, weight = rows(1, 3, width), rows(2, 3, width), rows(3, 1, width)[0]
    expected_h = h + delta
    out = np.empty_like(h)
    add_rms_norm(h, delta, weight, np.float32(EPS), out)
    np.testing.assert_array_equal(h, expected_h)
    np.testing.assert_array_equal(out, rms_norm_numpy(expected_h, weight, EPS))


@pytest.mark.parametrize("width", (15, 128, 300))
@pytest.mark.parametrize("num_sources", (1, 2, 5))
def test_attn_res_norm_is_attn_res_then_the_norm(width, num_sources):
    sources = np.stack([rows(10 + s, 4, width) for s in range(num_sources)])  # [S, T, H]
    query, weight = rows(4, 1, width)[0], rows(5, 1, width)[0]
    h, x = np.empty((4, width), np.float32), np.empty((4, width), np.float32)
    attn_res_norm(sources, query, weight, np.float32(EPS), h, x)
    expected = attn_res(list(sources), query, EPS)
    np.testing.assert_array_equal(h, expected)
    np.testing.assert_array_equal(x, rms_norm_numpy(expected, weight, EPS))


def route_reference(scores: np.ndarray, bias: np.ndarray, top_k: int, renormalize: bool, scale: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The numpy router the compiled stage replaced: a stable descending sort of s + bias (NaN last), the chosen
    unbiased scores, renormalised, scaled."""
    biased = np.where(np.isnan(scores + bias), -np.inf, scores + bias)
    ids = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]  # [T, TOPK]
    chosen = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        chosen = chosen / np.sum(chosen, axis=1, keepdims=True)
    return ids, (chosen * np.float32(scale)).astype(np.float32)


@pytest.mark.parametrize("top_k", (1, 4, 8, 9))
@pytest.mark.parametrize("renormalize", (True, False))
def test_route_top_k_is_the_numpy_router(top_k, renormalize):
    rng = np.random.default_rng(top_k)
    scores = (1 / (1 + np.exp(-rng.standard_normal((7, 33))))).astype(np.float32)  # [T, NE]
    scores[1, 5:9] = scores[1, 20]  # ties: the lower id first
    bias = (rng.standard_normal(33) * 0.1).astype(np.float32)
    bias[2] = np.nan  # a NaN bias is never preferred to a number
    ids, weights = np.empty((7, top_k), np.int64), np.empty((7, top_k), np.float32)
    route_top_k(scores, bias, renormalize, np.float32(2.5), ids, weights)
    expected_ids, expected_weights = route_reference(scores, bias, top_k, renormalize, 2.5)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(weights, expected_weights)
    assert 2 not in ids


def test_route_top_k_all_nan_row_takes_the_lowest_ids():
    scores = np.full((1, 6), np.nan, np.float32)
    ids, weights = np.empty((1, 3), np.int64), np.empty((1, 3), np.float32)
    route_top_k(scores, np.zeros(6, np.float32), False, np.float32(1.0), ids, weights)
    np.testing.assert_array_equal(ids, [[0, 1, 2]])


def softmax_router_reference(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The numpy softmax router the compiled stages replaced (families/moe.py before issue 33)."""
    probs = softmax(logits, axis=-1)  # [T, NE]
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(probs, ids, axis=1)
    if normalize:
        chosen = chosen / np.sum(chosen, axis=1, keepdims=True)
    return ids, chosen.astype(np.float32)


@pytest.mark.parametrize("num_experts", (5, 64, 129, 512))
@pytest.mark.parametrize("normalize", (True, False))
def test_softmax_top_k_is_the_numpy_softmax_router(num_experts, normalize):
    logits = rows(num_experts, 6, num_experts)  # [T, NE]
    logits[2, 1:4] = logits[2, 0]  # ties: the lower id first
    top_k = min(8, num_experts)
    expected_ids, expected_weights = softmax_router_reference(logits, top_k, normalize)
    exps = logits.copy()
    shift_by_row_max(exps)
    np.exp(exps, out=exps)
    ids, weights = np.empty((6, top_k), np.int64), np.empty((6, top_k), np.float32)
    softmax_top_k(exps, normalize, ids, weights)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(weights, expected_weights)
    np.testing.assert_array_equal(exps, softmax(logits, axis=-1))  # the probabilities, left in place


def test_shift_by_row_max_propagates_nan_as_np_max():
    logits = np.array([[1.0, np.nan, 3.0], [2.0, 5.0, -1.0]], np.float32)
    shift_by_row_max(logits)
    assert np.isnan(logits[0]).all()
    np.testing.assert_array_equal(logits[1], [-3.0, 0.0, -6.0])


@pytest.mark.parametrize("width", WIDTHS)
def test_l2_normalize_into_is_the_numpy_line_bit_for_bit(width):
    x = rows(width, 3, width)
    out = np.empty_like(x)
    l2_normalize_into(x, np.float32(1e-6), out)
    np.testing.assert_array_equal(out, l2_normalize_numpy(x))


def test_ops_norms_on_strided_heads_keep_the_numpy_bits():
    """ops.rms_norm and ops.l2_normalize as the layers call them: [T, NH, D] views cut from a wider projection."""
    proj = rows(0, 5, 3 * 4 * 24).reshape(5, 3, 4, 24)  # [T, 3, NH, D]
    heads, weight = proj[:, 1], rows(1, 1, 24)[0]  # [T, NH, D], not contiguous
    np.testing.assert_array_equal(rms_norm(heads, weight, EPS), rms_norm_numpy(heads, weight, EPS))
    np.testing.assert_array_equal(l2_normalize(heads), l2_normalize_numpy(heads))
    np.testing.assert_array_equal(rms_norm(heads, None, EPS), heads / np.sqrt(
        np.add.reduce(np.square(heads), axis=-1, keepdims=True) / np.float32(24) + np.float32(EPS)))


def rotary_numpy(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """`Rotary.apply` before it ran the compiled call."""
    d = 2 * cos.shape[1]
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :d // 2], rot[..., d // 2:])
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


@pytest.mark.parametrize("interleaved", (False, True))
@pytest.mark.parametrize("rotary_dim", (8, 24))
def test_rotary_apply_is_the_numpy_rotary(interleaved, rotary_dim):
    """Rotary.apply (one compiled call, fused_ops.rotate_into) against its numpy lines, partial rotary included."""
    from k3serve.model.families.rope import rotary_from_config

    rotary = rotary_from_config({"rope_theta": 10000.0}, rotary_dim, 4096, interleaved=interleaved, where="test")
    cos, sin = rotary.cos_sin(np.array([0, 5, 17, 4000]))  # [T, d/2]
    x = rows(rotary_dim, 4 * 3, 24).reshape(4, 3, 24)  # [T, NH, D], D = 24 >= d
    np.testing.assert_array_equal(rotary.apply(x, cos, sin), rotary_numpy(x, cos, sin, interleaved))
    strided = rows(1, 4 * 3, 48).reshape(4, 3, 48)[:, :, 24:]  # a view, as latent attention passes its rope part
    np.testing.assert_array_equal(rotary.apply(strided, cos, sin), rotary_numpy(strided, cos, sin, interleaved))


def test_a_zero_denominator_gives_numpy_nan_not_an_exception():
    """Chosen router scores that underflowed to 0 renormalise to NaN, and RMSNorm of a zero row with eps 0 is NaN,
    as the numpy lines give (numba's default error model would raise ZeroDivisionError inside the step)."""
    scores = np.zeros((2, 6), np.float32)  # sigmoid of very negative logits
    ids, weights = np.empty((2, 3), np.int64), np.empty((2, 3), np.float32)
    route_top_k(scores, np.zeros(6, np.float32), True, np.float32(2.5), ids, weights)
    with np.errstate(invalid="ignore"):
        _, expected = route_reference(scores, np.zeros(6, np.float32), 3, True, 2.5)
        expected_norm = rms_norm_numpy(np.zeros((1, 8), np.float32), np.ones(8, np.float32), 0.0)
    np.testing.assert_array_equal(weights, expected)
    assert np.isnan(weights).all()
    out = np.empty((1, 8), np.float32)
    rms_norm_into(np.zeros((1, 8), np.float32), np.ones(8, np.float32), np.float32(0.0), out)
    np.testing.assert_array_equal(out, expected_norm)
    exps = np.zeros((1, 4), np.float32)  # every exp underflowed
    softmax_top_k(exps, True, np.empty((1, 2), np.int64), np.empty((1, 2), np.float32))
    assert np.isnan(exps).all()
