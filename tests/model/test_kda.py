"""KDA: the chunked form equals the token-by-token recurrence, on odd lengths and with carried state."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.kda import KDAInputs, causal_conv, conv_step, kda_chunked, kda_recurrent, kda_step_batch
from k3serve.model.ops import l2_normalize


def _relative_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _inputs(rng, T, NH=3, D=16, strong_decay=False):
    q = l2_normalize(rng.normal(size=(T, NH, D)).astype(np.float32)) / np.float32(np.sqrt(D))
    k = l2_normalize(rng.normal(size=(T, NH, D)).astype(np.float32))
    v = rng.normal(size=(T, NH, D)).astype(np.float32)
    low = 5.0 if strong_decay else 0.5
    g = (-low * rng.uniform(size=(T, NH, D)) ** 2).astype(np.float32)
    beta = rng.uniform(size=(T, NH)).astype(np.float32)
    return KDAInputs(q, k, v, g, beta)


@pytest.mark.parametrize("T", [1, 15, 63, 300])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_equals_recurrence_with_carried_state(T, strong_decay):
    rng = np.random.default_rng(T)
    inputs = _inputs(rng, T, strong_decay=strong_decay)
    state = rng.normal(size=(3, 16, 16)).astype(np.float32)
    o_ref, s_ref = kda_recurrent(inputs, state)
    o, s = kda_chunked(inputs, state, chunk_size=32)
    assert _relative_rms(o, o_ref) < 2e-6, _relative_rms(o, o_ref)
    assert _relative_rms(s, s_ref) < 2e-6, _relative_rms(s, s_ref)


def test_splitting_a_sequence_carries_state_exactly():
    rng = np.random.default_rng(7)
    inputs = _inputs(rng, 100)
    state = np.zeros((3, 16, 16), np.float32)
    o_all, s_all = kda_chunked(inputs, state)
    first = KDAInputs(*(getattr(inputs, f)[:37] for f in ("q", "k", "v", "g", "beta")))
    second = KDAInputs(*(getattr(inputs, f)[37:] for f in ("q", "k", "v", "g", "beta")))
    o1, s1 = kda_chunked(first, state)
    o2, s2 = kda_chunked(second, s1)
    assert _relative_rms(np.concatenate([o1, o2]), o_all) < 2e-6
    assert _relative_rms(s2, s_all) < 2e-6


def test_batched_decode_step_equals_recurrence_per_sequence():
    rng = np.random.default_rng(11)
    B = 5
    steps = [_inputs(rng, 1) for _ in range(B)]
    states = rng.normal(size=(B, 3, 16, 16)).astype(np.float32)
    stack = lambda f: np.concatenate([getattr(s, f) for s in steps])  # noqa: E731
    o, new = kda_step_batch(stack("q"), stack("k"), stack("v"), stack("g"), stack("beta"), states)
    for b in range(B):
        o_ref, s_ref = kda_recurrent(steps[b], states[b])
        np.testing.assert_allclose(o[b], o_ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new[b], s_ref, rtol=1e-5, atol=1e-6)


def test_strong_decay_does_not_overflow():
    rng = np.random.default_rng(5)
    inputs = _inputs(rng, 64, strong_decay=True)
    inputs.g[:] = -5.0  # the floor: 64 tokens of e^-5 per step would overflow a naive exp(-b) factorisation
    o, s = kda_chunked(inputs, np.ones((3, 16, 16), np.float32), chunk_size=64)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    o_ref, _ = kda_recurrent(inputs, np.ones((3, 16, 16), np.float32))
    assert _relative_rms(o, o_ref) < 2e-6


def test_causal_conv_taps_run_oldest_to_newest_and_tail_carries():
    x = np.arange(1, 8, dtype=np.float32)[:, None]  # [7, 1]
    taps = np.array([[1.0, 10.0, 100.0, 1000.0]], np.float32)  # oldest ... newest
    out, tail = causal_conv(x, np.zeros((3, 1), np.float32), taps)
    # position 3 (value 4) sees 1, 2, 3, 4 with taps 1, 10, 100, 1000
    assert out[3, 0] == 1 * 1 + 2 * 10 + 3 * 100 + 4 * 1000
    assert out[0, 0] == 1000.0  # missing past inputs are zeros
    assert list(tail[:, 0]) == [5.0, 6.0, 7.0]
    a, tail_a = causal_conv(x[:4], np.zeros((3, 1), np.float32), taps)
    b, _ = causal_conv(x[4:], tail_a, taps)
    assert np.array_equal(np.concatenate([a, b]), out)


# --- the compiled token-by-token loop (model/delta_rule.py), the engine's path at every length


@pytest.mark.parametrize("T", [1, 5, 63, 300])
def test_compiled_delta_rule_equals_the_recurrence(T):
    from k3serve.model.delta_rule import delta_rule_segments

    rng = np.random.default_rng(10 + T)
    x = _inputs(rng, T, strong_decay=T == 63)
    state = rng.normal(size=(3, 16, 16)).astype(np.float32) * 0.3
    o_ref, s_ref = kda_recurrent(x, state)
    o, s = delta_rule_segments(x.q, x.k, x.v, x.g, x.beta, state[None], np.array([[0, T]]))
    assert _relative_rms(o, o_ref) < 1e-5 and _relative_rms(s[0], s_ref) < 1e-5
    assert o.dtype == s.dtype == np.float32


def test_the_delta_rule_warmup_compiles_what_the_engine_calls():
    """The loader's warm-up of the recurrence (delta_rule.warmup) leaves nothing for a first request to compile:
    both kernels' signatures are those `delta_rule_segments` calls them with (one token: serial; 700: parallel)."""
    from k3serve.model import delta_rule

    delta_rule.warmup()
    kernels = (delta_rule._segments_serial, delta_rule._segments_parallel)
    warmed = [list(kernel.signatures) for kernel in kernels]
    assert all(len(signatures) >= 1 for signatures in warmed)
    rng = np.random.default_rng(7)
    for T in (1, 700):  # 700 x 3 heads x 16 x 16 x 4 >= PARALLEL_MIN_WORK
        x = _inputs(rng, T, strong_decay=False)
        state = rng.normal(size=(3, 16, 16)).astype(np.float32) * 0.3
        delta_rule.delta_rule_segments(x.q, x.k, x.v, x.g, x.beta, state[None], np.array([[0, T]]))
    assert [list(kernel.signatures) for kernel in kernels] == warmed


def test_compiled_delta_rule_bits_do_not_depend_on_the_split_the_batch_or_the_threads():
    """One call, two calls, token by token, inside a batch with other sequences, serial or parallel, and a replayed
    rollback trajectory: the same bits (prefix-cache hits and speculative rollback rely on it)."""
    from k3serve.model import delta_rule
    from k3serve.model.replay import delta_rule_trajectory

    rng = np.random.default_rng(7)
    x = _inputs(rng, 40)
    state = rng.normal(size=(3, 16, 16)).astype(np.float32) * 0.3
    run = delta_rule.delta_rule_segments
    o_all, s_all = run(x.q, x.k, x.v, x.g, x.beta, state[None], np.array([[0, 40]]))
    o1, s1 = run(x.q[:17], x.k[:17], x.v[:17], x.g[:17], x.beta[:17], state[None], np.array([[0, 17]]))
    o2, s2 = run(x.q[17:], x.k[17:], x.v[17:], x.g[17:], x.beta[17:], s1, np.array([[0, 23]]))
    assert np.array_equal(np.concatenate([o1, o2]), o_all) and np.array_equal(s2, s_all)
    s = state[None]
    for t in range(40):
        o_t, s = run(x.q[t:t + 1], x.k[t:t + 1], x.v[t:t + 1], x.g[t:t + 1], x.beta[t:t + 1], s, np.array([[0, 1]]))
        assert np.array_equal(o_t[0], o_all[t])
    assert np.array_equal(s, s_all)
    # a batch: sequence 0 is the 40 tokens above, sequence 1 five other tokens from another state
    y = _inputs(rng, 5)
    cat = [np.concatenate([getattr(x, f), getattr(y, f)]) for f in ("q", "k", "v", "g", "beta")]
    other = rng.normal(size=(3, 16, 16)).astype(np.float32)
    for minimum in (delta_rule.PARALLEL_MIN_WORK, 0):  # serial, then forced parallel
        delta_rule.PARALLEL_MIN_WORK, saved = minimum, delta_rule.PARALLEL_MIN_WORK
        try:
            o_b, s_b = run(*cat, np.stack([state, other]), np.array([[0, 40], [40, 45]]))
        finally:
            delta_rule.PARALLEL_MIN_WORK = saved
        assert np.array_equal(o_b[:40], o_all) and np.array_equal(s_b[0], s_all[0])
    states = delta_rule_trajectory(x.k, x.v, x.g, x.beta, state, keep_all=True)
    assert np.array_equal(states[-1], s_all[0]) and np.array_equal(states[16], s1[0])
    assert np.array_equal(delta_rule_trajectory(x.k, x.v, x.g, x.beta, state, 17), s1[0])


@pytest.mark.parametrize("kernel_size", (1, 2, 4))
def test_conv_step_is_one_token_of_causal_conv(kernel_size):
    rng = np.random.default_rng(kernel_size)
    channels = 37
    tail = rng.standard_normal((kernel_size - 1, channels)).astype(np.float32)  # [K-1, C]
    taps = rng.standard_normal((channels, kernel_size)).astype(np.float32)  # [C, K]
    x = rng.standard_normal((1, channels)).astype(np.float32)  # [1, C]
    expected, expected_tail = causal_conv(x, tail, taps)
    out, new_tail = np.empty(channels, np.float32), np.empty_like(tail)
    conv_step(tail, x[0], taps, out, new_tail)
    np.testing.assert_array_equal(out, expected[0])
    np.testing.assert_array_equal(new_tail, expected_tail)
