"""The compiled router selection and pair grouping against their definitions: a stable descending sort's first
TOPK (ties to the lower id) and a stable sort of the pairs by expert."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.moe import top_k_rows
from k3serve.model.routing import pairs_by_expert


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
    with pytest.raises(ValueError, match=">= 0"):
        pairs_by_expert(np.array([[0, -1]]))
