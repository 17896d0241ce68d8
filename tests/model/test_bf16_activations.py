"""The opt-in bf16-activation path of bf16 weights (kernels section "bf16 weights x bf16 activations"): the
vdpbf16ps tiles against their numpy twin (activations rounded to bf16, products summed in float64), odd shapes and
token tails, NaN and inf, the switch and its fallback, and the float path unchanged while it is off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from k3serve.model import kernels
from k3serve.model.kernels import bf16_dot_reference, bf16_experts_run, bf16_linear, round_to_bf16, widen_bf16

needs_bf16 = pytest.mark.skipif(not kernels.BF16_DOT_AVAILABLE, reason="this CPU lacks AVX512_BF16 (the fallback "
                                "is tested below)")


def _bits(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return round_to_bf16(scale * rng.standard_normal(shape).astype(np.float32))


def _accumulation_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|kernel - twin| <= (roundings a sum meets) 2^-24 sum_c |w x|, [T, R]: every product is exact in float32; each
    of the C/32 vdpbf16ps steps adds two of them to a lane (two roundings, C/16 in all), the pairwise lane sum
    rounds 4 more times; 2 to spare."""
    C = w.shape[1]
    magnitude = np.abs(widen_bf16(round_to_bf16(x))).astype(np.float64) @ np.abs(widen_bf16(w)).astype(np.float64).T
    return (C / 16 + 4 + 2) * 2.0**-24 * magnitude + 1e-37  # + the flushed denormal products, at most


def test_rounding_is_to_nearest_even_and_keeps_nan_inf_and_denormals():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF800000, 0x7F800001,
                     0xFFC00000, 0x00008000, 0x00018000, 0x80000001, 0], np.uint32)
    expected = np.array([0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x0000, 0x0002, 0x8000, 0],
                        np.uint16)
    np.testing.assert_array_equal(round_to_bf16(bits.view(np.float32)), expected)
    x = np.random.default_rng(0).standard_normal((300, 700)).astype(np.float32)  # the parallel path
    np.testing.assert_array_equal(round_to_bf16(x), kernels._round_to_bf16_reference(x))
    assert np.all(np.abs(widen_bf16(round_to_bf16(x)) - x) <= np.abs(x) * 2.0**-8)


@needs_bf16
@pytest.mark.parametrize("rows, cols, tokens", [(1, 1, 1), (3, 31, 5), (7, 45, 6), (5, 64, 4), (65, 100, 9),
                                                (200, 200, 7), (2, 2048, 13)])
def test_bf16_linear_matches_its_twin_and_each_token_has_its_own_bits(rows, cols, tokens):
    rng = np.random.default_rng(rows * 1000 + cols)
    w, x = _bits(rng, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    y = bf16_linear(x, w)  # [T, R]
    assert y.dtype == np.float32 and y.shape == (tokens, rows)
    assert np.all(np.abs(y - bf16_dot_reference(w, x)) <= _accumulation_bound(w, x))
    for t in range(tokens):  # a token in a 4-token tile, in the tail or alone: the same bits
        np.testing.assert_array_equal(bf16_linear(x[t:t + 1], w)[0], y[t])
    serial, parallel = np.empty_like(y), np.empty_like(y)
    kernels._bf16_linear_serial(w, round_to_bf16(x), serial)
    kernels._bf16_linear_parallel(w, round_to_bf16(x), parallel)
    np.testing.assert_array_equal(serial, y)
    np.testing.assert_array_equal(parallel, y)


@needs_bf16
def test_exact_when_every_sum_is_exact():
    """Small integers: every product and partial sum is exact in float32, so the kernel equals the twin exactly."""
    rng = np.random.default_rng(3)
    w = round_to_bf16(rng.integers(-8, 9, (9, 77)).astype(np.float32))
    x = rng.integers(-8, 9, (6, 77)).astype(np.float32)
    np.testing.assert_array_equal(bf16_linear(x, w), bf16_dot_reference(w, x).astype(np.float32))


@needs_bf16
def test_nan_and_inf_reach_only_their_outputs():
    rng = np.random.default_rng(4)
    w, x = _bits(rng, 6, 70), rng.standard_normal((7, 70)).astype(np.float32)
    clean = bf16_linear(x, w)
    x[2, 33] = np.nan
    w = w.copy()
    w[4, 65] = 0x7F80  # +inf, in the masked last step
    y = bf16_linear(x, w)
    assert np.all(np.isnan(y[2]))
    assert np.all(~np.isfinite(y[:, 4])) and np.all(np.isinf(np.delete(y[:, 4], 2)))
    others = np.delete(np.delete(y, 2, axis=0), 4, axis=1)
    np.testing.assert_array_equal(others, np.delete(np.delete(clean, 2, axis=0), 4, axis=1))


def _experts_twin(gate_up: np.ndarray, down: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One bf16 expert on the bf16-activation path in float64: (y [T, H], the bound on |kernel - y|): the hidden
    row is rounded to bf16 as the kernel rounds it, and may round to the neighbouring bf16 value where the kernel's
    float32 gate and up differ from the twin's, so the bound adds one bf16 step of each hidden value on top of the
    accumulation bounds."""
    width = down.shape[1]
    h = bf16_dot_reference(gate_up, x)  # [T, 2I]
    gate, up = h[:, :width], h[:, width:]
    hidden = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)  # [T, I]
    y = bf16_dot_reference(down, hidden)  # [T, H]
    h_bound = _accumulation_bound(gate_up, x)  # [T, 2I]
    slope = 1.2 * (np.abs(up) + np.abs(gate)) + 1e-30  # |d hidden / d gate| + |d hidden / d up| <= 1.1 (|up| + |g|)
    # [T, I]: the float32 gate and up, SiLU in float32, then one bf16 step (at most 2^-7 of the value) if the
    # rounding goes the other way
    hidden_error = slope * np.maximum(h_bound[:, :width], h_bound[:, width:]) + (2.0**-7 + 2.0**-20) * np.abs(hidden)
    w_down = np.abs(widen_bf16(down)).astype(np.float64)
    return y, _accumulation_bound(down, hidden) + hidden_error @ w_down.T


@needs_bf16
@pytest.mark.parametrize("hidden_size, inner", [(64, 32), (70, 45), (2048, 96)])
def test_bf16_experts_match_their_twin_on_odd_group_sizes(hidden_size, inner):
    rng = np.random.default_rng(hidden_size + inner)
    num_experts, sizes = 4, [1, 4, 7, 9]  # a token tail of 1, a full tile, 4 + 3, 8 + 1
    gate_up, down = _bits(rng, num_experts, 2 * inner, hidden_size, scale=0.3), _bits(rng, num_experts, hidden_size,
                                                                                       inner, scale=0.3)
    x = rng.standard_normal((12, hidden_size)).astype(np.float32)
    expert_ids = np.array([2, 0, 3, 1])
    ends = np.cumsum(sizes)
    starts = ends - sizes
    tokens = rng.integers(0, x.shape[0], ends[-1])  # [N]: a token may reach several experts
    y = bf16_experts_run(gate_up, down, expert_ids, x, tokens, starts, ends)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        np.testing.assert_array_equal(bf16_experts_run(gate_up, down, expert_ids, x, tokens, starts, ends), y)
    finally:
        numba.set_num_threads(threads)
    for k, e in enumerate(expert_ids):
        rows = slice(starts[k], ends[k])
        twin, bound = _experts_twin(gate_up[e], down[e], x[tokens[rows]])
        assert np.all(np.abs(y[rows] - twin) <= bound), (k, np.max(np.abs(y[rows] - twin)))
        for n in range(starts[k], ends[k]):  # each (token, expert) pair has the same bits alone
            alone = bf16_experts_run(gate_up, down, expert_ids[k:k + 1], x, tokens[n:n + 1], np.zeros(1, np.int64),
                                     np.ones(1, np.int64))
            np.testing.assert_array_equal(alone[0], y[n])


@needs_bf16
def test_the_switch_routes_bf16_linear_and_experts_and_off_keeps_the_float_bits(monkeypatch):
    from k3serve.model.families.experts import run_experts
    from k3serve.model.routing import ExpertPairs

    rng = np.random.default_rng(5)
    w, x = _bits(rng, 40, 96), rng.standard_normal((40, 96)).astype(np.float32)
    gate_up, down = _bits(rng, 3, 64, 96, scale=0.3), _bits(rng, 3, 96, 32, scale=0.3)
    sizes = np.array([2, 5, 70])  # on the float path: the row dot, the float tile, BLAS
    ends = np.cumsum(sizes)
    starts, ids, tokens = ends - sizes, np.array([1, 0, 2]), rng.integers(0, 40, ends[-1])
    pairs = ExpertPairs(ids, starts, ends, tokens, np.arange(ends[-1]))
    stacked = (gate_up, None, down, None)

    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", "f32")
    for T in (3, 8, 40):  # the float row-dot tiles below 32 tokens, BLAS on a float32 copy from 32
        before = np.empty((T, 40), np.float32)
        if T < kernels.BF16_KERNEL_MAX_TOKENS:
            kernels._bf16_matmul_serial(w, x[:T], before)
        else:
            before = x[:T] @ widen_bf16(w).T
        np.testing.assert_array_equal(kernels.linear(x[:T], w), before)
    float_experts = run_experts("dense", stacked, pairs, x)
    np.testing.assert_array_equal(float_experts[starts[0]:ends[0]], kernels.dense_experts_run(
        *stacked, ids[:1], x, tokens, starts[:1], ends[:1])[starts[0]:ends[0]])

    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", "bf16")
    every = bf16_linear(x, w)  # [40, 40]
    for T in (1, 3, 8, 40):  # every T on the bf16 path, with each token's bits as in the whole batch
        np.testing.assert_array_equal(kernels.linear(x[:T], w), every[:T])
    bf16_experts = run_experts("dense", stacked, pairs, x)
    np.testing.assert_array_equal(bf16_experts, bf16_experts_run(gate_up, down, ids, x, tokens, starts, ends))
    np.testing.assert_array_equal(kernels.dense_experts_tiled(*stacked, ids, x, tokens, starts, ends), bf16_experts)
    for k in range(3):  # the row dot's 2 tokens, the float tile's 5 and BLAS's 70: all moved
        assert not np.array_equal(bf16_experts[starts[k]:ends[k]], float_experts[starts[k]:ends[k]])

    monkeypatch.setattr(kernels, "BF16_DOT_AVAILABLE", False)  # switched on, but the CPU lacks the instruction
    np.testing.assert_array_equal(kernels.linear(x, w), x @ widen_bf16(w).T)
    np.testing.assert_array_equal(run_experts("dense", stacked, pairs, x), float_experts)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        bf16_linear(x, w)


def test_the_setting_falls_back_to_f32_with_a_warning(caplog):
    setting = kernels._bf16_activations_setting
    with caplog.at_level(logging.WARNING, logger="k3serve.model.kernels"):
        assert setting("bf16", False) == "f32"
        assert "lacks" in caplog.text
        caplog.clear()
        assert setting("fp8", True) == "f32"
        assert "known: f32, bf16" in caplog.text
        caplog.clear()
        assert setting(" BF16 ", True) == "bf16" and setting("", True) == "f32" and setting("f32", True) == "f32"
        assert caplog.text == ""


def test_the_environment_switch_is_read_at_import_and_refused_without_the_instruction():
    """K3SERVE_BF16_ACTIVATIONS=bf16 turns the path on at import; numba told to compile for a generic CPU (no
    AVX512_BF16) logs why and stays on f32."""
    code = "from k3serve.model import kernels; print(kernels.BF16_ACTIVATIONS, kernels.bf16_activations_on())"
    env = {**os.environ, "K3SERVE_BF16_ACTIVATIONS": "bf16"}
    native = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert native.returncode == 0, native.stderr
    assert native.stdout.split() == (["bf16", "True"] if kernels.BF16_DOT_AVAILABLE else ["f32", "False"])
    generic = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, "NUMBA_CPU_NAME": "generic"})
    assert generic.returncode == 0, generic.stderr
    assert generic.stdout.split() == ["f32", "False"] and "lacks" in generic.stderr


def test_bad_operands_are_refused():
    w = np.zeros((4, 32), np.uint16)
    with pytest.raises(ValueError):
        bf16_linear(np.zeros((2, 31), np.float32), w)
    with pytest.raises(ValueError):
        bf16_linear(np.zeros((2, 32), np.float32), w.astype(np.float32))
    with pytest.raises(ValueError):
        bf16_experts_run(np.zeros((1, 8, 32), np.uint16), np.zeros((1, 32, 5), np.uint16), np.zeros(1, np.int64),
                         np.zeros((2, 32), np.float32), np.zeros(2, np.int64), np.zeros(1, np.int64),
                         np.full(1, 2, np.int64))
