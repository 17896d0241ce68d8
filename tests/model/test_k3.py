"""The whole model on the tiny oracle (K3_SPEC section 7, gate 2) and the batching invariants."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.interface import ForwardItem


# fp32 round-off between two orders of summation (chunked vs recurrent KDA, GEMM vs GEMV, batched vs alone)
# compounds over 13 layers whose activations reach the SiTU caps; measured errors are 0.5e-5 to 1.5e-5.
SAME_FUNCTION_RTOL = 5e-5


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


PROMPT = [1, 17, 200, 45, 3, 99, 128, 7, 250, 64, 31, 5, 180, 77, 12, 240, 33, 90, 150, 2, 4, 66, 111, 222,
          9, 19, 29, 39, 49, 59, 69, 79]  # 32 ids: 11 attention-residual blocks of three complete twice


def test_teacher_forced_argmax_matches_reference_at_every_position(tiny_model, tiny_reference):
    ours = tiny_model.logits(PROMPT, mode="full")
    ref = tiny_reference.forward(PROMPT)
    assert ours.shape == ref.shape == (32, 256)
    error = _relative_rms(ours, ref)
    assert error < 1e-4, f"relative RMS error {error:.2e}"
    assert np.array_equal(ours.argmax(1), ref.argmax(1)), "teacher forcing must match at 32/32 positions"


def test_greedy_20_tokens_match_reference_and_both_modes(tiny_model, tiny_reference):
    prompt = PROMPT[:7]
    ours = tiny_model.greedy(prompt, 20)
    assert ours == tiny_reference.greedy(prompt, 20)
    full = tiny_model.logits(prompt + ours, mode="full")
    incremental = tiny_model.logits(prompt + ours, mode="incremental")
    # the greedy tokens are the argmax of the previous position, in both modes
    assert list(full.argmax(1)[len(prompt) - 1:-1]) == ours
    assert list(incremental.argmax(1)[len(prompt) - 1:-1]) == ours
    error = _relative_rms(incremental, full)
    assert error < SAME_FUNCTION_RTOL, f"incremental vs full relative RMS {error:.2e}"


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunk_size_does_not_change_logits(tiny_dir, chunk_size):
    from k3serve.loading import load_model
    from k3serve.model.k3 import K3Model

    base = load_model(tiny_dir).model
    other = K3Model(base.source, chunk_size=chunk_size)
    ids = PROMPT * 2 + PROMPT[:11]  # 75 tokens: several chunks and a ragged last one
    assert _relative_rms(other.logits(ids), base.logits(ids)) < SAME_FUNCTION_RTOL


def test_batch_of_sequences_equals_each_alone(tiny_model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n) for n in (1, 15, 40, 7, 63)]
    alone = [tiny_model.logits(p) for p in prompts]
    caches = [tiny_model.new_cache() for _ in prompts]
    batch = tiny_model.forward([ForwardItem(p, c, all_logits=True) for p, c in zip(prompts, caches)])
    for a, b in zip(alone, batch.logits):
        assert a.shape == b.shape
        assert _relative_rms(b, a) < SAME_FUNCTION_RTOL
    # then a mixed step: some sequences decode one token, others prefill more, in one forward
    extra = [rng.integers(0, 256, size=n) for n in (1, 9, 1, 1, 30)]
    step = tiny_model.forward([ForwardItem(e, c, all_logits=True) for e, c in zip(extra, caches)])
    for p, e, got in zip(prompts, extra, step.logits):
        want = tiny_model.logits(np.concatenate([p, e]))[len(p):]
        assert _relative_rms(got, want) < SAME_FUNCTION_RTOL


def test_decode_steps_in_a_batch_equal_alone(tiny_model):
    prompts = [[5, 6, 7], [100, 101], [9] * 12]
    caches = [tiny_model.new_cache() for _ in prompts]
    tiny_model.forward([ForwardItem(np.array(p), c) for p, c in zip(prompts, caches)])
    tokens = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    for step in range(4):
        out = tiny_model.forward([ForwardItem(np.array([t[step]]), c) for t, c in zip(tokens, caches)])
        for p, t, got in zip(prompts, tokens, out.logits):
            want = tiny_model.logits(p + t[:step + 1])[-1:]
            assert _relative_rms(got, want) < SAME_FUNCTION_RTOL


def test_tiny_init_makes_the_router_bias_reorder_the_top_k(tiny_model):
    """The oracle's init must make the selection-only bias matter, or a bias bug would go unseen."""
    from k3serve.model.moe import route_scores
    from k3serve.model.ops import rms_norm, sigmoid

    config = tiny_model.config
    x = rms_norm(tiny_model.source.global_weights().embed, None, config.rms_norm_eps)  # [V, H] stand-in inputs
    changed = 0
    for layer in config.moe_layer_ids:
        w = tiny_model.source.layer(layer).mlp
        scores = sigmoid(x @ w.router.T)
        biased = route_scores(config, scores, w.router_bias).expert_ids
        unbiased = route_scores(config, scores, np.zeros_like(w.router_bias)).expert_ids
        changed += int(np.sum(np.any(np.sort(biased, 1) != np.sort(unbiased, 1), axis=1)))
    assert changed > 0.1 * len(x) * len(config.moe_layer_ids)


def test_batched_mla_decode_equals_each_sequence_alone(tiny_model):
    """One decode token per sequence, caches of different lengths: the batched MLA step equals mla_attend per
    sequence (the dense twin too)."""
    from k3serve.model.mla import mla_attend, mla_attend_reference, mla_decode_batch, mla_project

    config = tiny_model.config
    layer = config.full_attn_layers[0] - 1
    w = tiny_model.source.layer(layer).attention
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, config.hidden_size), dtype=np.float32)
    q, rows, gate = mla_project(config, w, x)
    caches = [np.concatenate([rng.standard_normal((n, rows.shape[1]), dtype=np.float32), rows[i:i + 1]])
              for i, n in enumerate((0, 3, 17, 40))]
    batched = mla_decode_batch(config, w, q, caches, gate)
    for i, cache in enumerate(caches):
        alone = mla_attend(config, w, q[i:i + 1], cache, gate[i:i + 1])
        assert _relative_rms(batched[i:i + 1], alone) < 1e-5
        assert _relative_rms(batched[i:i + 1], mla_attend_reference(config, w, q[i:i + 1], cache, gate[i:i + 1])) < 1e-5


def _cache_arrays(cache, layout) -> list[np.ndarray]:
    """Copies of every array a sequence's cache holds: recurrent states and conv tails, attention rows."""
    out = []
    for layer in layout.recurrent_shapes:
        out.extend(np.array(a) for a in cache.recurrent_state(layer))
    out.extend(np.array(cache.attention_rows(layer)) for layer in layout.row_widths)
    return out


def test_a_forward_nested_at_any_pause_point_leaves_both_exact(tiny_model):
    """The engine's step interruption runs a whole forward at a pause point of another one (after a layer's
    attention or after its MLP): both give bit-for-bit what they give alone, and the paused one's caches too."""
    from k3serve.model.interface import MIXER, MLP, pause_points

    layout = tiny_model.cache_layout
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, size=n) for n in (9, 30)]
    extra = [rng.integers(0, 256, size=n) for n in (1, 12)]  # a decode and a prefill chunk in one forward
    arrival = rng.integers(0, 256, size=7)

    def paused_batch(at_pause=None):
        caches = [tiny_model.new_cache() for _ in prompts]
        tiny_model.forward([ForwardItem(p, c) for p, c in zip(prompts, caches)])
        out = tiny_model.forward([ForwardItem(e, c, all_logits=True) for e, c in zip(extra, caches)],
                                 at_pause=at_pause)
        return out.logits, [a for c in caches for a in _cache_arrays(c, layout)]

    want_logits, want_caches = paused_batch()
    alone = tiny_model.forward([ForwardItem(arrival, tiny_model.new_cache(), all_logits=True)]).logits[0]
    points = pause_points(tiny_model.config.num_layers)
    assert len(points) == 2 * tiny_model.config.num_layers - 1 and points[:2] == [(0, MIXER), (0, MLP)]
    seen = []
    paused_batch(lambda layer, part: seen.append((layer, part)))
    assert seen == points  # every pause point, in order
    for point in points:
        nested = []

        def at_pause(layer: int, part: str, point=point, nested=nested) -> None:
            if (layer, part) == point:
                cache = tiny_model.new_cache()
                nested.append(tiny_model.forward([ForwardItem(arrival, cache, all_logits=True)]).logits[0])

        logits, caches = paused_batch(at_pause)
        assert len(nested) == 1 and np.array_equal(nested[0], alone), point
        assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits)), point
        assert all(np.array_equal(a, b) for a, b in zip(caches, want_caches)), point
