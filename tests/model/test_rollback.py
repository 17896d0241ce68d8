"""Speculative rollback: snapshot restore == projection replay == never having fed the rejected positions."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.state_pool import StatePool
from k3serve.model.interface import ForwardItem
from k3serve.model.rollback import (KIMI_LINEAR_SHAPES, RecurrentShapes, RollbackCache, rollback_storage)
from k3serve.config import full_k3_config

PROMPT = [5, 17, 33, 17, 200, 9, 81, 3, 64, 120, 7]
WINDOW = [44, 91, 12, 250, 6, 77]  # T = 6: the last confirmed token and 5 drafts


def _prefilled(model, cache):
    model.forward([ForwardItem(np.array(PROMPT), cache)])
    return cache


def _kda_states(model, cache):
    return {l: tuple(a.copy() for a in cache.recurrent_state(l)) for l in model.config.kda_layer_ids}


@pytest.mark.parametrize("num_kept", range(1, len(WINDOW) + 1))
def test_snapshot_and_projection_restore_the_same_state(tiny_model, num_kept):
    model = tiny_model
    restored = {}
    for method in ("snapshot", "projection"):
        cache = RollbackCache(_prefilled(model, model.new_cache()), method)
        cache.begin_window()
        model.forward([ForwardItem(np.array(WINDOW), cache, all_logits=True)])
        cache.commit(num_kept)
        assert cache.num_tokens == len(PROMPT) + num_kept
        restored[method] = (_kda_states(model, cache.inner), cache)
    # plain: feed only the kept positions, one decode step each
    plain = _prefilled(model, model.new_cache())
    for token in WINDOW[:num_kept]:
        model.forward([ForwardItem(np.array([token]), plain)])
    expected = _kda_states(model, plain)
    snap, proj = restored["snapshot"][0], restored["projection"][0]
    for layer in model.config.kda_layer_ids:
        np.testing.assert_allclose(proj[layer][0], snap[layer][0], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(proj[layer][1], snap[layer][1])  # conv tail: copied inputs, exact
        np.testing.assert_allclose(proj[layer][0], expected[layer][0], rtol=0, atol=1e-4)  # chunked vs step bits
        np.testing.assert_allclose(proj[layer][1], expected[layer][1], rtol=0, atol=1e-4)  # batched matmul bits
    for layer in model.config.mla_layer_ids:
        np.testing.assert_allclose(restored["projection"][1].attention_rows(layer), plain.attention_rows(layer), rtol=0, atol=1e-4)
    # and the next step's logits agree
    nxt = np.array([101])
    got = model.forward([ForwardItem(nxt, restored["projection"][1].inner)]).logits[0]
    want = model.forward([ForwardItem(nxt, plain)]).logits[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["snapshot", "projection"])
def test_rollback_on_paged_cache_frees_the_rejected_blocks(tiny_model, method):
    config = tiny_model.config
    blocks = BlockPool(16, 4, len(config.mla_layer_ids), config.mla_cache_width)
    states = StatePool(tiny_model.cache_layout, 2)
    inner = PagedSequenceCache(blocks, states)
    _prefilled(tiny_model, inner)  # 11 positions: 3 blocks of 4
    inner.reserve(len(WINDOW))  # up to 17 positions: 5 blocks
    assert len(inner.block_table) == 5
    cache = RollbackCache(inner, method)
    cache.begin_window()
    tiny_model.forward([ForwardItem(np.array(WINDOW), cache, all_logits=True)])
    cache.commit(2)
    assert inner.num_tokens == 13 and len(inner.block_table) == 4
    inner.check_integrity()
    blocks.check_integrity({b: 1 for b in inner.block_table})
    dense = _prefilled(tiny_model, tiny_model.new_cache())
    for token in WINDOW[:2]:
        tiny_model.forward([ForwardItem(np.array([token]), dense)])
    for layer in config.kda_layer_ids:
        np.testing.assert_allclose(inner.recurrent_state(layer)[0], dense.recurrent_state(layer)[0], atol=1e-5)


def test_storage_ratio_matches_the_kimi_linear_arithmetic():
    # ANCHORS: bf16, T = 4: 4 x 20 MiB = 80 MiB of snapshots vs 20 + 4 x 0.47 = 21.9 MiB (~27%)
    s = rollback_storage(KIMI_LINEAR_SHAPES, 4, 2, accounting="anchor")
    assert s.snapshot_bytes == 80 * 2**20
    assert abs(s.projection_bytes / 2**20 - 21.875) < 1e-9
    assert 0.27 < 1 / s.ratio < 0.28
    # with everything k3serve actually keeps (conv tails, beta, pre-conv inputs) the ratio is lower, still ~T
    ours = rollback_storage(KIMI_LINEAR_SHAPES, 4, 2)
    assert 3.0 < ours.ratio < s.ratio
    full = RecurrentShapes.of("K3", full_k3_config())
    assert full.num_kda_layers == 69
    assert rollback_storage(full, 1, 4).ratio < 1 < rollback_storage(full, 2, 4).ratio
