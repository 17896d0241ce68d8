"""`PagedSequenceCache` against `DenseSequenceCache`: same logits through prefill chunks, decode steps, block
boundaries and forks (copy-on-write)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.state_pool import StatePool
from k3serve.model.k3 import k3_cache_layout
from k3serve.model.interface import ForwardItem


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _pools(config, num_blocks: int = 64, block_size: int = 4, slots: int = 4):
    blocks = BlockPool(num_blocks, block_size, len(config.mla_layer_ids), config.mla_cache_width)
    return blocks, StatePool(k3_cache_layout(config), slots)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_cache_matches_dense_through_chunks_and_decodes(tiny_model, block_size):
    config = tiny_model.config
    blocks, states = _pools(config, block_size=block_size)
    rng = np.random.default_rng(block_size)
    ids = rng.integers(0, 256, size=40)
    # the same schedule for both: two uneven prefill chunks, then single-token decodes
    pieces = [ids[:7], ids[7:30]] + [ids[i:i + 1] for i in range(30, 40)]
    dense, paged = tiny_model.new_cache(), PagedSequenceCache(blocks, states)
    for piece in pieces:
        paged.reserve(len(piece))
        want = tiny_model.forward([ForwardItem(piece, dense, all_logits=True)]).logits[0]
        got = tiny_model.forward([ForwardItem(piece, paged, all_logits=True)]).logits[0]
        assert _relative_rms(got, want) < 1e-6
        assert np.array_equal(got.argmax(1), want.argmax(1))
    assert paged.num_tokens == 40 and len(paged.block_table) == -(-40 // block_size)
    for layer in config.mla_layer_ids:
        assert np.array_equal(paged.attention_rows(layer), dense.attention_rows(layer))
    paged.release()
    blocks.check_integrity({})
    states.check_integrity([])


def test_unreserved_appends_allocate_by_themselves(tiny_model):
    config = tiny_model.config
    blocks, states = _pools(config, block_size=5)
    ids = np.arange(3, 26)
    dense, paged = tiny_model.new_cache(), PagedSequenceCache(blocks, states)
    want = tiny_model.forward([ForwardItem(ids, dense)]).logits[0]
    got = tiny_model.forward([ForwardItem(ids, paged)]).logits[0]
    assert _relative_rms(got, want) < 1e-6 and len(paged.block_table) == 5


def test_forks_share_blocks_and_copy_the_partial_one_on_write(tiny_model):
    config = tiny_model.config
    blocks, states = _pools(config, block_size=4)
    prompt = np.array([1, 17, 200, 45, 3, 99, 128, 7, 250, 64])  # 10 tokens: 2 full blocks + 2 rows
    parent = PagedSequenceCache(blocks, states)
    tiny_model.forward([ForwardItem(prompt, parent)])
    child = parent.fork()
    assert child.block_table == parent.block_table and child.slot != parent.slot
    assert all(blocks.ref_counts[b] == 2 for b in parent.block_table)
    assert child.num_blocks_to_reserve(1) == 1  # the shared partial block must be copied
    for cache, continuation in ((parent, [5, 6, 7]), (child, [200, 9, 31])):
        for token in continuation:
            cache.reserve(1)
            got = tiny_model.forward([ForwardItem(np.array([token]), cache)]).logits[0]
        want = tiny_model.logits(np.concatenate([prompt, continuation]))[-1:]
        assert _relative_rms(got, want) < 1e-5, "a fork must not see its sibling's writes"
    assert parent.block_table[:2] == child.block_table[:2], "full blocks stay shared"
    assert parent.block_table[2] != child.block_table[2], "the partial block was copied on write"
    blocks.check_integrity(Counter(parent.block_table + child.block_table))
    parent.release()
    child.release()
    blocks.check_integrity({})
    states.check_integrity([])
