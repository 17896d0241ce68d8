"""The compiled router selection and pair grouping against their definitions: a stable descending sort's first
TOPK (ties to the lower id) and a stable sort of the pairs by expert."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.moe import top_k_rows
from k3serve.errors import ConfigError
from k3serve.model.routing import ExpertTopP, KeptExperts, Routing, keep_top_p, pairs_by_expert


def _top_k(biased: np.ndarray, top_k: int) -> np.ndarray:
    ids = np.empty((biased.shape[0], top_k), np.int64)
    top_k_rows(np.ascontiguousarray(biased, dtype=np.float32), ids)
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_top_k_is_a_stable_descending_sort_with_ties_to_the_lower_id(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        T, NE = int(rng.integers(1, 20)), int(rng.integers(2, 80))
        top_k = int(rng.integers(1, min(NE, 16) + 1))
        biased = rng.standard_normal((T, NE)).astype(np.float32)
        if seed % 2:
            biased = np.round(biased * 2) / 2  # many ties
            biased[biased == 0] = -0.0
        want = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
        np.testing.assert_array_equal(_top_k(biased, top_k), want)


def test_top_k_puts_nan_last_in_id_order():
    biased = np.array([[np.nan, 0.5, np.nan, 0.1, np.nan]], np.float32)
    np.testing.assert_array_equal(_top_k(biased, 4), [[1, 3, 0, 2]])


def test_pairs_by_expert_is_a_stable_sort_by_expert():
    rng = np.random.default_rng(7)
    for _ in range(300):
        T, NE = int(rng.integers(1, 30)), int(rng.integers(1, 40))
        top_k = int(rng.integers(1, NE + 1))
        ids = np.stack([rng.permutation(NE)[:top_k] for _ in range(T)])
        pairs = pairs_by_expert(ids)
        order = np.argsort(ids.ravel(), kind="stable")
        needed, starts = np.unique(ids.ravel()[order], return_index=True)
        np.testing.assert_array_equal(pairs.order, order)
        np.testing.assert_array_equal(pairs.expert_ids, needed)
        np.testing.assert_array_equal(pairs.starts, starts)
        np.testing.assert_array_equal(pairs.ends, np.append(starts[1:], ids.size))
        np.testing.assert_array_equal(pairs.tokens, order // top_k)


# ---- --expert-top-p (model/routing.py keep_top_p) ---------------------------------------------------------------
def _top_p_twin(ids: np.ndarray, weights: np.ndarray, top_p: float, min_kept: int, renormalize: bool):
    """The rule one row at a time in plain Python: sort by weight (stable), keep until the share reaches P."""
    out_ids = np.full_like(ids, -1)
    out_w = np.zeros_like(weights)
    for t in range(ids.shape[0]):
        row = [(float(w), j) for j, w in enumerate(weights[t])]
        ranked = sorted(range(len(row)), key=lambda j: (-row[j][0], j))
        total = sum(w for w, _ in row)
        share, n = 0.0, 0
        for j in ranked:
            if n >= min_kept and share >= top_p:
                break
            share += row[j][0] / total
            n += 1
        kept = sorted(ranked[:n])
        for slot, j in enumerate(kept):
            out_ids[t, slot] = ids[t, j]
            w = weights[t, j]
            if renormalize and n < len(row):
                w = w * total / sum(weights[t, k] for k in kept)
            out_w[t, slot] = w
    return out_ids, out_w


@pytest.mark.parametrize("top_p,min_kept,renormalize", [(0.5, 1, True), (0.7, 2, True), (0.9, 1, False),
                                                        (0.3, 3, True), (0.999, 1, True)])
def test_top_p_matches_its_numpy_twin_and_keeps_the_minimum(top_p, min_kept, renormalize):
    rng = np.random.default_rng(11)
    for _ in range(50):
        T, top_k = int(rng.integers(1, 12)), int(rng.integers(1, 17))
        ids = np.stack([rng.permutation(64)[:top_k] for _ in range(T)]).astype(np.int64)
        weights = rng.random((T, top_k)).astype(np.float32) ** 3
        weights /= weights.sum(axis=1, keepdims=True)
        got = keep_top_p(Routing(ids, weights), ExpertTopP(top_p, min_kept), renormalize)
        want_ids, want_w = _top_p_twin(ids, weights, top_p, min_kept, renormalize)
        np.testing.assert_array_equal(got.expert_ids, want_ids)
        np.testing.assert_allclose(got.weights, want_w, rtol=1e-6, atol=0)
        kept = np.sum(got.expert_ids >= 0, axis=1)
        assert np.all(kept >= min(min_kept, top_k))
        # the kept share reaches P (before renormalising), or the row kept everything
        share = np.array([weights[t][np.isin(ids[t], got.expert_ids[t])].sum() for t in range(T)])
        assert np.all((share >= top_p - 1e-6) | (kept == top_k))
        if renormalize:
            np.testing.assert_allclose(got.weights.sum(axis=1), weights.sum(axis=1), rtol=1e-5)


def test_top_p_one_returns_the_routing_itself_and_bad_knobs_are_refused():
    routing = Routing(np.array([[3, 1]]), np.array([[0.9, 0.1]], np.float32))
    assert keep_top_p(routing, ExpertTopP(1.0, 1), True) is routing
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(top_p=0.5, min_kept=0)):
        with pytest.raises(ConfigError, match="expert-top-p"):
            ExpertTopP(**bad)


def test_pairs_skip_dropped_slots():
    ids = np.array([[4, 2, -1], [2, -1, -1], [0, 4, 2]])
    pairs = pairs_by_expert(ids)
    np.testing.assert_array_equal(pairs.expert_ids, [0, 2, 4])
    np.testing.assert_array_equal(ids.ravel()[pairs.order], [0, 2, 2, 2, 4, 4])
    np.testing.assert_array_equal(pairs.tokens, [2, 0, 1, 2, 0, 2])
    with pytest.raises(ValueError, match=">= 0"):
        pairs_by_expert(np.array([[0, -2]]))


def test_k3_top_p_one_is_bit_identical_and_fewer_experts_change_the_logits(tiny_dir):
    from k3serve.loading import load_model

    tokens = [1, 5, 9, 200, 17, 3, 44, 8]
    plain = load_model(tiny_dir).model.logits(tokens)
    every = load_model(tiny_dir, expert_top_p=ExpertTopP(1.0, 1)).model.logits(tokens)
    np.testing.assert_array_equal(every, plain)
    all_kept = load_model(tiny_dir, expert_top_p=ExpertTopP(0.3, 2)).model  # min 2 = TOPK: every slot kept
    np.testing.assert_array_equal(all_kept.logits(tokens), plain)
    assert all_kept.kept_experts.histogram() == {2: all_kept.kept_experts.num_pairs}
    fewer = load_model(tiny_dir, expert_top_p=ExpertTopP(0.6, 1)).model
    logits = fewer.logits(tokens)
    assert not np.array_equal(logits, plain)
    counts = fewer.kept_experts.counts  # [TOPK + 1]
    assert counts[0] == 0 and counts[1] > 0 and counts.sum() == len(tokens) * len(fewer.config.moe_layer_ids)
    assert 1.0 < fewer.kept_experts.mean < 2.0


def test_kept_experts_counts_the_kept_slots_of_each_row():
    """KeptExperts.add (one compiled call) against numpy's bincount of the kept slots per row."""
    rng = np.random.default_rng(3)
    kept = KeptExperts(4)
    expected = np.zeros(5, np.int64)
    for _ in range(5):
        ids = rng.integers(0, 9, size=(7, 4))
        ids[rng.random((7, 4)) < 0.3] = -1  # dropped slots
        kept.add(ids)
        expected += np.bincount(np.sum(ids >= 0, axis=1), minlength=5)
    np.testing.assert_array_equal(kept.counts, expected)
    assert kept.num_pairs == 35
