"""The MLA block pool: allocation, reference counts, copy-on-write, the hash index, LRU eviction, integrity."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.errors import IntegrityError, PoolExhaustedError
from k3serve.engine.paged_kv import BlockPool


def _pool(num_blocks: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size=2, num_layers=3, width=5)


def test_allocate_release_and_exhaustion():
    pool = _pool(3)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.num_free_blocks == 0
    with pytest.raises(PoolExhaustedError):
        pool.allocate()
    pool.release(blocks[1])
    assert pool.num_free_blocks == 1 and pool.allocate() == blocks[1]
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_shared_block_is_freed_by_its_last_holder_only():
    pool = _pool()
    block = pool.allocate()
    pool.acquire(block)
    pool.release(block)
    assert pool.ref_counts[block] == 1 and pool.num_free_blocks == 3
    pool.release(block)
    assert pool.num_free_blocks == 4
    with pytest.raises(IntegrityError):
        pool.release(block)


def test_copy_on_write_copies_every_layer_and_moves_the_reference():
    pool = _pool()
    block = pool.allocate()
    pool.storage[:, block] = np.arange(3 * 2 * 5, dtype=np.float32).reshape(3, 2, 5)
    pool.acquire(block)  # now shared by two holders
    copy = pool.copy_on_write(block)
    assert copy != block
    assert np.array_equal(pool.storage[:, copy], pool.storage[:, block])
    assert pool.ref_counts[block] == 1 and pool.ref_counts[copy] == 1
    pool.check_integrity({block: 1, copy: 1})


def test_hashed_blocks_are_cached_then_evicted_least_recent_first():
    pool = _pool(3)
    evicted = []
    pool.add_eviction_listener(evicted.append)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"A") and pool.register(b, b"B")
    assert not pool.register(pool.allocate(), b"A")  # a hash names one block; the duplicate stays unhashed
    pool.release(a)
    pool.release(b)
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 2 and pool.lookup(b"A") == a
    pool.acquire(b)  # a prefix hit revives a cached block
    assert pool.num_cached_blocks == 1
    pool.release(b)  # b is now the most recently used
    assert pool.allocate() == a and evicted == [b"A"] and pool.lookup(b"A") is None
    pool.check_integrity({a: 1, 2: 1})


def test_integrity_catches_a_leak_and_a_wrong_reference_count():
    pool = _pool()
    block = pool.allocate()
    with pytest.raises(IntegrityError):
        pool.check_integrity({})  # the block is held by nobody's table
    pool.ref_counts[block] = 0  # corrupt: unreferenced but neither free nor cached
    with pytest.raises(IntegrityError, match="leaked"):
        pool.check_integrity()
