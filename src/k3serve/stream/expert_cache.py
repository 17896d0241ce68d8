"""The expert cache: a fixed set of slots holding expert blobs, a replacement policy, demand loads and cold-slot
prefetch, over any I/O engine. No model math and no trunk: `StreamingSource` turns slots into weight views, and
the full-scale simulator (`k3serve.sim`) drives the very same object with an I/O engine whose reads cost
simulated time instead of bytes.

- `load(layer, ids)`: serve one group of a request (at most `num_slots` experts): hits are used in place, misses
  take slots freed by the policy and are read in one offset-ordered, coalesced batch; returns the slot indices.
- `prefetch(layer, guesses)`: read guessed experts of a later layer into cold slots only. A speculative load takes
  a free slot or one holding an earlier guess that was never used: it never evicts a warm expert. With prefetch
  on, 2 x `prefetch_max` slots are kept out of the warm set so that the guesses for the next layer find cold
  slots without dropping those for the layer about to run.
- `release()`: end of a request: a non-retaining policy (none) frees its slots.

Honest counters (on the shared `StreamStats`): a request is *retained* only if its expert was resident before
the step began; an expert that a prefetch brought in during the step is a *prefetch hit*, never a retained one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from typing import Callable, Protocol, Sequence

from k3serve.errors import CheckpointError, K3Error
from k3serve.stream.cache import make_policy
from k3serve.stream.io import Extent, StoreIOError

logger = logging.getLogger(__name__)

Key = tuple[int, int]  # (layer, expert)


class StoreCorruptError(CheckpointError):
    """A blob failed its checksum twice: the bytes on disk are wrong."""


class ExpertIO(Protocol):
    """What the cache needs of an I/O engine (`k3serve.stream.io.IOEngine` or the simulator's)."""

    def submit(self, extents: Sequence[Extent]) -> dict[int, Future]: ...

    def read_now(self, extent: Extent) -> list[Extent]: ...


class _Slot:
    __slots__ = ("index", "key", "future", "extent", "warm", "loaded_step", "prefetched")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: Key | None = None
        self.future: Future | None = None  # a read in flight (or done but not yet verified)
        self.extent: Extent | None = None
        self.warm = False  # demanded at least once since it was loaded
        self.loaded_step = -1
        self.prefetched = False


class ExpertCache:
    def __init__(self, store, io: ExpertIO, num_slots: int, policy: str, stats, *,
                 slot_buffer: Callable[[int], object], top_k: int, prefetch: bool = False,
                 prefetch_max: int | None = None, profile: Counter | None = None) -> None:
        """`store`: anything with `experts[layer].offsets / .crc32`, `expert_blob_size` and `expert_path` (a
        `PackedStore`, or the simulator's virtual store). `slot_buffer(i)`: the writable buffer of slot i (its
        length is the read length). `stats`: the `StreamStats` the counters go to."""
        self.store = store
        self.io = io
        self.stats = stats
        self.step_misses: list[tuple] = []  # (layer, expert, bytes, keys its slot evicted) read on demand this step
        self._evicted: list[Key] = []  # every key evicted this step, in order
        self._slot_buffer = slot_buffer
        self._slots = [_Slot(i) for i in range(num_slots)]
        self._table: dict[Key, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._cold: dict[int, None] = {}  # prefetched, never used, oldest first
        self._active: list[int] = []  # slots the current group uses
        self._step = -1
        self.policy = make_policy(policy, num_slots, profile, working_slots=top_k)
        self.prefetch_max = top_k if prefetch_max is None else prefetch_max
        # guesses for the layer about to run and for the one after it live side by side: two layers' worth
        reserve = min(2 * self.prefetch_max, num_slots - top_k) if prefetch else 0
        self._warm_capacity = num_slots - max(reserve, 0)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot_key(self, index: int) -> Key | None:
        return self._slots[index].key

    def begin_step(self) -> None:
        self._step += 1
        self.step_misses = []
        self._evicted = []

    # ---- demand loads ------------------------------------------------------------------------------------------
    def load(self, layer: int, group: Sequence[int]) -> list[int]:
        """Make experts `group` of `layer` resident (len(group) <= num_slots); returns their slot indices, hits
        first. Blocks until every read is done and verified."""
        self.release()
        protected = {(layer, e) for e in group}
        hits, misses = [], []
        for expert in group:
            key = (layer, expert)
            self.policy.count(key)
            self.stats.expert_requests += 1
            index = self._table.get(key)
            if index is None:
                misses.append(expert)
                continue
            slot = self._slots[index]
            if slot.loaded_step < self._step:
                self.stats.expert_retained += 1
            else:
                self.stats.expert_prefetch_hits += 1
            if slot.prefetched:
                slot.prefetched = False
                self._cold.pop(index, None)
                self.policy.admit(key)
            else:
                self.policy.touch(key)
            slot.warm = True
            hits.append(index)
        self.stats.expert_misses += len(misses)
        loading = []
        evictions: list[tuple] = []
        for expert in misses:
            first = len(self._evicted)
            index = self._take_slot(protected)
            evictions.append(tuple(self._evicted[first:]))
            slot = self._slots[index]
            self._assign(slot, (layer, expert), prefetched=False)
            slot.warm = True
            self.policy.admit(slot.key)
            loading.append(index)
        for index, evicted in zip(loading, evictions):
            self.step_misses.append((layer, self._slots[index].key[1], len(self._slots[index].extent.buffer),
                                     evicted))
        if loading:
            extents = [self._slots[i].extent for i in loading]
            started = time.perf_counter()
            futures = self.io.submit(extents)  # mmap mode copies right here, on this thread
            self.stats.io_wait_seconds += time.perf_counter() - started
            for index, extent in zip(loading, extents):
                self._slots[index].future = futures[id(extent)]
        used = hits + loading
        self._finish_reads(used)
        self._active = used
        return used

    def release(self) -> None:
        if not self.policy.retains:
            for index in self._active:
                slot = self._slots[index]
                if slot.key is not None and not slot.prefetched:
                    self._evict(index)
                    self._free.append(index)
        self._active = []

    # ---- prefetch ----------------------------------------------------------------------------------------------
    def prefetch(self, layer: int, guesses: Sequence[int]) -> int:
        """Start reading up to `prefetch_max` of `guesses` (best first) of `layer` into cold slots; returns the
        number of reads issued."""
        extents = []
        for expert in list(guesses)[:self.prefetch_max]:
            key = (layer, int(expert))
            if key in self._table:
                continue
            index = self._take_cold_slot(keep_layer=layer - 1)
            if index is None:
                break
            slot = self._slots[index]
            self._assign(slot, key, prefetched=True)
            extents.append(slot.extent)
        if extents:
            started = time.perf_counter()
            futures = self.io.submit(extents)
            self.stats.io_wait_seconds += time.perf_counter() - started
            for extent in extents:
                self._slots[extent.tag].future = futures[id(extent)]
                self._cold[extent.tag] = None  # only now: a slot must not be taken twice in one batch
            self.stats.prefetch_issued += len(extents)
        return len(extents)

    # ---- slots -------------------------------------------------------------------------------------------------
    def _take_slot(self, protected: set) -> int:
        while len(self._table) - len(self._cold) >= self._warm_capacity:  # keep the prefetch reserve cold
            victim = self.policy.victim(protected)
            if victim is None:
                break
            index = self._table[victim]
            self._evict(index)
            self._free.append(index)
        if self._free:
            return self._free.pop()
        for index in list(self._cold):
            slot = self._slots[index]
            if slot.key in protected:
                continue
            if slot.future is not None and not slot.future.done():
                continue
            self._drop_guess(index)
            return index
        victim = self.policy.victim(protected)
        if victim is None:
            # only guesses still in flight remain: wait for the oldest and reuse it
            for index in list(self._cold):
                if self._slots[index].key not in protected:
                    self._drop_guess(index)
                    return index
            raise RuntimeError("expert cache has no evictable slot (more experts requested than slots)")
        index = self._table[victim]
        self._evict(index)
        return index

    def _take_cold_slot(self, keep_layer: int) -> int | None:
        """A free slot, or one holding a finished guess that is not for `keep_layer` (the layer about to ask for
        its experts: dropping its guesses now would read them twice)."""
        if self._free:
            return self._free.pop()
        for index in list(self._cold):
            slot = self._slots[index]
            if slot.key is not None and slot.key[0] == keep_layer:
                continue
            if slot.future is None or slot.future.done():
                self._drop_guess(index)
                return index
        return None

    def _drop_guess(self, index: int) -> None:
        slot = self._slots[index]
        self._cold.pop(index, None)
        if slot.future is not None:
            try:
                slot.future.result()
            except K3Error:
                pass  # a guess that failed to read was never going to be used
            slot.future = None
        self.stats.prefetch_wasted += 1
        self._table.pop(slot.key, None)
        slot.key = None
        slot.prefetched = False

    def _evict(self, index: int) -> None:
        slot = self._slots[index]
        if slot.key is not None:
            self._table.pop(slot.key, None)
            self.policy.remove(slot.key)
            self.stats.expert_evictions += 1
            self._evicted.append(slot.key)
        slot.key = None
        slot.warm = False

    def _assign(self, slot: _Slot, key: Key, prefetched: bool) -> None:
        layer, expert = key
        index_entry = self.store.experts[layer]
        slot.key = key
        slot.prefetched = prefetched
        slot.warm = False
        slot.loaded_step = self._step
        slot.future = None
        slot.extent = Extent(int(index_entry.offsets[expert]), self._slot_buffer(slot.index),
                             self.store.expert_blob_size, int(index_entry.crc32[expert]), tag=slot.index)
        self._table[key] = slot.index

    def _finish_reads(self, indices: list[int]) -> None:
        started = time.perf_counter()
        try:
            for index in indices:
                slot = self._slots[index]
                if slot.future is None:
                    continue
                try:
                    failed = slot.future.result()
                except StoreIOError as exc:
                    where = f"layer {_slot_part(slot, 0)} expert {_slot_part(slot, 1)}"
                    self._discard_unverified(indices)
                    raise StoreIOError(f"{where}: {exc}") from exc
                slot.future = None
                if any(extent is slot.extent for extent in failed):
                    self.stats.checksum_retries += 1
                    logger.warning("checksum mismatch on layer %s expert %s at offset %d of %s: re-reading",
                                   *slot.key, slot.extent.offset, self._expert_file())
                    if self.io.read_now(slot.extent):
                        layer, expert = slot.key
                        offset = slot.extent.offset
                        self._discard(index)
                        raise StoreCorruptError(
                            f"expert blob of layer {layer} expert {expert} in {self._expert_file()} at offset "
                            f"{offset} ({self.store.expert_blob_size} bytes) failed its CRC-32 check twice; the "
                            "store is corrupt: repack it with `k3serve pack`")
        finally:
            self.stats.io_wait_seconds += time.perf_counter() - started

    def _expert_file(self) -> str:
        """The expert file for messages; a striped store's is virtual, so its drives' files are named too."""
        files = getattr(self.store, "expert_files", ())
        if len(files) > 1:
            return f"{self.store.expert_path} (striped over {', '.join(str(f) for f in files)})"
        return str(self.store.expert_path)

    def _discard_unverified(self, indices: list[int]) -> None:
        """A read failed: free every slot of this load whose read is not verified yet. A coalesced run shares one
        read, so its other slots failed too; kept, they would pass for resident and re-raise the old error on
        every later hit. Each read is waited for first, so no worker still writes into a freed slot."""
        for index in indices:
            slot = self._slots[index]
            if slot.future is None:
                continue
            try:
                slot.future.result()
            except K3Error:
                pass
            self._discard(index)

    def _discard(self, index: int) -> None:
        slot = self._slots[index]
        self._cold.pop(index, None)
        self._evict(index)
        slot.future = None
        self._free.append(index)

    # ---- reporting ---------------------------------------------------------------------------------------------
    def resident_experts(self, layer: int) -> set[int]:
        """Experts of `layer` whose bytes are in a slot now (read and verified)."""
        return {slot.key[1] for slot in self._slots
                if slot.key is not None and slot.key[0] == layer and slot.future is None}

    def num_resident(self) -> int:
        return len(self._table)

    def check_integrity(self) -> None:
        """Slot table, free list and cold set agree (tests call this after steps)."""
        seen = set()
        for key, index in self._table.items():
            assert self._slots[index].key == key, (key, index)
            seen.add(index)
        assert not (seen & set(self._free)), "a slot is both free and holding an expert"
        assert len(seen) + len(self._free) == len(self._slots), "a slot leaked"
        for index in self._cold:
            assert self._slots[index].prefetched and index in seen


def _slot_part(slot: _Slot, i: int) -> object:
    return slot.key[i] if slot.key else "?"
