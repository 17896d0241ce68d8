"""Paged memory for the attention layers: a pool of fixed-size blocks of cache rows, shared by reference count.

Every attention layer caches one row per position (W values, from the model's `CacheLayout`: the normed latent plus
k_rope for MLA, keys and values for GQA). A block holds `block_size` positions of every attention layer, so one
block id in a sequence's block table addresses the same positions in all attention layers. A block is in exactly one of three states:
    free       ref count 0, no hash                        (reusable at once)
    cached     ref count 0, hash registered, LRU ordered   (holds a reusable prefix; evicted when space runs out)
    in use     ref count >= 1                              (in one or more block tables; may also be hashed)
A full block's content is immutable, so several sequences may share it; a partial block that is shared (a forked
sequence) is copied before it is written (copy-on-write, see `paged_cache.PagedSequenceCache`).

Shapes: LA attention layers, NB blocks, BS block size, W row width.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Mapping

import numpy as np

from k3serve.engine.errors import IntegrityError, PoolExhaustedError

EvictionListener = Callable[[bytes], None]


class BlockPool:
    """Blocks of attention cache rows with reference counts and a hash index of cached (reusable) blocks."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, width: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = np.empty((max(num_layers, 1), num_blocks, block_size, width), np.float32)  # [LA,NB,BS,W]
        self.storage.fill(0.0)  # touch every page now: no page faults (or huge-page zeroing) in the decode path
        self.ref_counts = np.zeros(num_blocks, np.int32)  # [NB]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref count 0 and hashed; first = least recent
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._eviction_listeners: list[EvictionListener] = []

    # ---- counts ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix reuse."""
        return len(self._cached)

    @property
    def num_hashed_blocks(self) -> int:
        return len(self._block_of)

    # ---- allocation and reference counts --------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self) -> int:
        """A block with ref count 1. Takes a free block, else evicts the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
        else:
            raise PoolExhaustedError(f"all {self.num_blocks} attention cache blocks are in use")
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Take one more reference to a block (sharing, or reusing a cached block)."""
        if self.ref_counts[block] == 0:
            if block not in self._cached:
                raise IntegrityError(f"block {block} is free; only in-use or cached blocks can be shared")
            del self._cached[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero a hashed block becomes cached (most recent), an unhashed one free."""
        if self.ref_counts[block] <= 0:
            raise IntegrityError(f"block {block} released more times than acquired")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self._hash_of[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def copy_on_write(self, block: int) -> int:
        """A private copy of a shared block (its rows in every layer); the caller's reference moves to the copy."""
        copy = self.allocate()
        self.storage[:, copy] = self.storage[:, block]
        self.release(block)
        return copy

    # ---- the hash index (prefix caching) --------------------------------------------------------------------
    def register(self, block: int, block_hash: bytes) -> bool:
        """Index a full, in-use block under its chained hash. False if that hash already names another block
        (the first one stays; this block is then freed normally)."""
        if block_hash in self._block_of or self._hash_of[block] is not None:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of[block]

    def is_cached(self, block: int) -> bool:
        """Unreferenced but kept (taking it removes it from what allocation can evict)."""
        return block in self._cached

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Called with the hash of every block whose cached content is dropped, while `lookup` still finds the
        block and its rows are intact (the prefix cache's disk tier writes them out)."""
        self._eviction_listeners.append(listener)

    def _unregister(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is None:
            return
        for listener in self._eviction_listeners:  # before the index forgets it: `lookup` still finds its rows
            listener(block_hash)
        self._hash_of[block] = None
        del self._block_of[block_hash]

    def evict_all_cached(self) -> int:
        """Drop every cached block (a cache reset); returns how many were dropped."""
        count = len(self._cached)
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
            self._free.append(block)
        return count

    # ---- checks ---------------------------------------------------------------------------------------------
    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Every block in exactly one state, the hash index consistent both ways, and, when `expected_refs`
        (block -> number of block tables holding it) is given, ref counts equal to it exactly."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise IntegrityError("a block is on the free list twice")
        free_set, cached_set = set(free), set(self._cached)
        if free_set & cached_set:
            raise IntegrityError(f"blocks both free and cached: {sorted(free_set & cached_set)[:8]}")
        for block in range(self.num_blocks):
            refs = int(self.ref_counts[block])
            if refs < 0:
                raise IntegrityError(f"block {block} has a negative ref count {refs}")
            in_free, in_cached = block in free_set, block in cached_set
            if refs > 0 and (in_free or in_cached):
                raise IntegrityError(f"block {block} is in use ({refs} refs) but also listed free or cached")
            if refs == 0 and not (in_free or in_cached):
                raise IntegrityError(f"block {block} has no references and is neither free nor cached: leaked")
            if in_free and self._hash_of[block] is not None:
                raise IntegrityError(f"free block {block} still carries a hash")
            if in_cached and self._hash_of[block] is None:
                raise IntegrityError(f"cached block {block} has no hash")
        for block_hash, block in self._block_of.items():
            if self._hash_of[block] != block_hash:
                raise IntegrityError(f"hash index points at block {block}, which carries another hash")
        if sum(h is not None for h in self._hash_of) != len(self._block_of):
            raise IntegrityError("blocks carry hashes that the index does not know")
        if expected_refs is not None:
            for block in range(self.num_blocks):
                want = expected_refs.get(block, 0)
                if int(self.ref_counts[block]) != want:
                    raise IntegrityError(
                        f"block {block} has ref count {int(self.ref_counts[block])} but {want} block tables hold it"
                    )
