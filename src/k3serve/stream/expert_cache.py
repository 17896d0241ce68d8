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
- `set_tenant_shares(shares)` (--tenant-cache-shares): each warm slot counts in one tenant's share (it is *owned*):
  the tenant it was read for, or a later user of it that is further under its share; a tenant's share is that
  fraction of the warm slots. A miss read for a tenant at or over its share evicts one of
  its own experts (the policy's victim among them); a tenant under its share takes the policy's victim among the
  *pool*: experts no sharing tenant owns, and those of tenants over their share. So a tenant that floods the cache
  with misses recycles its own slots and never evicts another's experts within that one's share. Which bytes sit in
  which slot never changes what a load returns: outputs are identical with or without shares.

Honest counters (on the shared `StreamStats`): a request is *retained* only if its expert was resident before
the step began; an expert that a prefetch brought in during the step is a *prefetch hit*, never a retained one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future
from typing import Callable, Collection, Mapping, Protocol, Sequence

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
    __slots__ = ("index", "key", "future", "extent", "warm", "loaded_step", "prefetched", "owner")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: Key | None = None
        self.future: Future | None = None  # a read in flight (or done but not yet verified)
        self.extent: Extent | None = None
        self.warm = False  # demanded at least once since it was loaded
        self.loaded_step = -1
        self.prefetched = False
        self.owner: str | None = None  # the tenant whose share it counts in (tenant shares); None: no tenant's


class _OwnedBy:
    """A policy's `protected` keys for a victim drawn among some owners' keys only: it holds the keys protected and
    every key whose owner `allowed` rejects (policies only ask `key in protected`)."""

    def __init__(self, protected: Collection[Key], owner_of: Callable[[Key], str | None],
                 allowed: Callable[[str | None], bool]) -> None:
        self._protected, self._owner_of, self._allowed = protected, owner_of, allowed

    def __contains__(self, key: object) -> bool:
        return key in self._protected or not self._allowed(self._owner_of(key))


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
        self.top_k = top_k
        self._prefetch = prefetch
        self._limit = num_slots  # slots in use; `resize` moves it within [top_k, len(self._slots)]
        self._set_warm_capacity()
        # shadow counts (`track_shadow`): keys evicted lately, most recent last, and this interval's hits per key
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._ghost_capacity = 0
        self.ghost_hit_depths: list[int] = []  # per miss on a ghost: how many slots more would have made it a hit
        self.interval_hits: Counter = Counter()
        # tenant shares (`set_tenant_shares`): each tenant's fraction of the warm slots, and its warm slots now
        self._shares: dict[str, float] | None = None
        self._owned: Counter = Counter()

    def _set_warm_capacity(self) -> None:
        # guesses for the layer about to run and for the one after it live side by side: two layers' worth
        reserve = min(2 * self.prefetch_max, self._limit - self.top_k) if self._prefetch else 0
        self._warm_capacity = self._limit - max(reserve, 0)

    @property
    def num_slots(self) -> int:
        """Slots in use now (`resize` changes it); `max_slots` is the arena's."""
        return self._limit

    @property
    def max_slots(self) -> int:
        return len(self._slots)

    def slot_key(self, index: int) -> Key | None:
        return self._slots[index].key

    def begin_step(self) -> None:
        self._step += 1
        self.step_misses = []
        self._evicted = []

    # ---- demand loads ------------------------------------------------------------------------------------------
    def load(self, layer: int, group: Sequence[int], users: Mapping[int, Sequence[str]] | None = None
             ) -> list[int]:
        """Make experts `group` of `layer` resident (len(group) <= num_slots); returns their slot indices, hits
        first. Blocks until every read is done and verified. `users` (tenant shares): expert -> the tenants whose
        tokens routed to it; a miss is read for the one of them furthest under its share, and a hit passes to that
        one if it is further under its share than the owner (`_user`): an expert a light tenant shares with a flood
        counts in the light tenant's share, and a flood's hit never takes an expert out of another's share."""
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
                if self._ghost_capacity and key in self._ghost:
                    self._note_ghost_hit(key)
                continue
            if self._ghost_capacity:
                self.interval_hits[key] += 1
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
            if users is not None and users.get(expert):
                self._own(slot, self._user((*users[expert], slot.owner) if slot.owner else users[expert],
                                           slot.owner))
            hits.append(index)
        self.stats.expert_misses += len(misses)
        loading = []
        evictions: list[tuple] = []
        for expert in misses:
            first = len(self._evicted)
            tenants = users.get(expert) if users is not None else None
            tenant = self._user(tenants, None) if tenants else None
            index = self._take_slot(protected, tenant)
            evictions.append(tuple(self._evicted[first:]))
            slot = self._slots[index]
            self._assign(slot, (layer, expert), prefetched=False)
            slot.warm = True
            self._own(slot, tenant)
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
    def _take_slot(self, protected: set, tenant: str | None = None) -> int:
        while len(self._table) - len(self._cold) >= self._warm_capacity:  # keep the prefetch reserve cold
            victim = self._victim(protected, tenant)
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
        victim = self._victim(protected, tenant)
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

    def _victim(self, protected: Collection[Key], tenant: str | None) -> Key | None:
        """The policy's victim for a miss read for `tenant`: under tenant shares, one of its own experts when it
        holds its share or more, else one of the pool (no sharing tenant's, or an over-share tenant's); the policy's
        plain victim when neither has one to give (every candidate protected), or without shares."""
        if self._shares is None or tenant is None:
            return self.policy.victim(protected)
        quotas = self.tenant_quotas()
        if self._owned[tenant] >= quotas.get(tenant, 0):
            victim = self.policy.victim(_OwnedBy(protected, self._owner_of, lambda owner: owner == tenant))
            if victim is not None:
                return victim

        def in_pool(owner: str | None) -> bool:
            return owner is None or owner not in quotas or self._owned[owner] > quotas[owner]

        victim = self.policy.victim(_OwnedBy(protected, self._owner_of, in_pool))
        return victim if victim is not None else self.policy.victim(protected)

    def _user(self, tenants: Sequence[str], owner: str | None) -> str:
        """Of `tenants`, the one an expert counts for: the furthest under its share (the smallest fraction of its
        quota held; the current `owner` on a tie, then the first named); the first without shares."""
        if self._shares is None:
            return tenants[0]
        quotas = self.tenant_quotas()

        def held(tenant: str) -> tuple[float, bool]:
            quota = quotas.get(tenant, 0)
            fraction = self._owned[tenant] / quota if quota else float("inf")
            return fraction, tenant != owner

        return min(tenants, key=held)

    def _owner_of(self, key: Key) -> str | None:
        index = self._table.get(key)
        return self._slots[index].owner if index is not None else None

    def _own(self, slot: _Slot, tenant: str | None) -> None:
        if slot.owner == tenant:
            return
        if slot.owner is not None:
            self._owned[slot.owner] -= 1
            if not self._owned[slot.owner]:
                del self._owned[slot.owner]
        slot.owner = tenant
        if tenant is not None:
            self._owned[tenant] += 1

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
        self._own(slot, None)
        if slot.key is not None:
            self._table.pop(slot.key, None)
            self.policy.remove(slot.key)
            self.stats.expert_evictions += 1
            self._evicted.append(slot.key)
            if self._ghost_capacity:
                self._ghost[slot.key] = None
                self._ghost.move_to_end(slot.key)
                while len(self._ghost) > self._ghost_capacity:
                    self._ghost.popitem(last=False)
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

    # ---- resizing and shadow counts (the RAM controller, engine/ram_controller.py) -------------------------------
    def track_shadow(self, ghost_slots: int) -> None:
        """Remember the last `ghost_slots` evicted keys: a miss on one is a hit a cache that many slots larger would
        have had (exact for LRU; an estimate for the other policies). 0 turns the counting off."""
        self._ghost_capacity = max(0, ghost_slots)
        while len(self._ghost) > self._ghost_capacity:
            self._ghost.popitem(last=False)

    def _note_ghost_hit(self, key: Key) -> None:
        keys = list(self._ghost)
        self.ghost_hit_depths.append(len(keys) - keys.index(key))  # 1 = the latest eviction
        del self._ghost[key]

    def take_shadow(self, num_slots: int) -> tuple[list[int], float]:
        """(this interval's ghost-hit depths: a hit at depth d needs d more slots, hits `num_slots` fewer slots
        would have lost) since the last call, which starts a new interval. The loss counts recent hits (decayed by half per interval) on
        the `num_slots` resident keys hit least (those a smaller cache would have dropped)."""
        depths = self.ghost_hit_depths
        counts = sorted(self.interval_hits.get(key, 0) for key in self._table)
        # hit counts decay by half per interval (a reuse period longer than one interval is still seen); in a
        # steady state they sum to twice one interval's, hence the halving
        lost = sum(counts[:num_slots]) / 2
        self.ghost_hit_depths = []
        self.interval_hits = Counter({key: count / 2 for key, count in self.interval_hits.items()
                                      if count >= 0.125 and key in self._table})
        return depths, lost

    def resize(self, num_slots: int) -> int:
        """Use `num_slots` slots (clamped to [top_k, max_slots]); between steps only. A shrink drops unused guesses
        and the policy's victims until the rest fits, then copies the experts held in slots past the new end into
        free slots below it. Returns the slot count reached; the slots past it hold nothing (their pages may be
        returned to the OS by the owner)."""
        target = max(self.top_k, min(int(num_slots), len(self._slots)))
        if target >= self._limit:
            self._free = [i for i in range(target - 1, self._limit - 1, -1)] + self._free
            self._limit = target
            self._set_warm_capacity()
            return self._limit
        for index in list(self._cold):
            self._drop_guess(index)
            self._free.append(index)
        while len(self._table) > target:
            victim = self.policy.victim(())
            if victim is None:
                break
            index = self._table[victim]
            self._evict(index)
            self._free.append(index)
        target = max(target, len(self._table))
        low_free = sorted((i for i in self._free if i < target), reverse=True)
        for index in range(target, self._limit):
            slot = self._slots[index]
            if slot.key is None:
                continue
            assert slot.future is None, "a demand read is still in flight between steps"
            into = self._slots[low_free.pop()]
            self._slot_buffer(into.index)[:] = self._slot_buffer(index)
            into.key, into.warm, into.loaded_step, into.prefetched = slot.key, slot.warm, slot.loaded_step, False
            into.owner, slot.owner = slot.owner, None
            into.future = None
            into.extent = Extent(slot.extent.offset, self._slot_buffer(into.index), slot.extent.check_bytes,
                                 slot.extent.crc32, tag=into.index)
            self._table[slot.key] = into.index
            slot.key, slot.warm, slot.extent = None, False, None
        self._free = [i for i in low_free]
        self._limit = target
        self._active = []
        self._set_warm_capacity()
        return self._limit

    # ---- tenant shares (--tenant-cache-shares, engine/engine.py) ---------------------------------------------------
    def set_tenant_shares(self, shares: Mapping[str, float] | None) -> None:
        """Each sharing tenant's fraction of the warm slots (summing to at most 1), or None: one cache shared by
        all (the default; ownership is then neither kept nor consulted). Between steps, or before a forward."""
        if shares is None:
            self._shares = None
            return
        for tenant, share in shares.items():
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
                raise ValueError(f"tenant {tenant!r}'s expert cache share must be in (0, 1], got {share!r}")
        if sum(shares.values()) > 1 + 1e-9:
            raise ValueError(f"expert cache shares sum to {sum(shares.values())}, above 1")
        self._shares = dict(shares)

    def tenant_quotas(self) -> dict[str, int]:
        """Warm slots each sharing tenant may fill before its misses evict its own experts (empty without shares)."""
        if self._shares is None:
            return {}
        return {tenant: int(share * self._warm_capacity) for tenant, share in self._shares.items()}

    def owned_slots(self) -> dict[str, int]:
        """Warm slots per tenant they count for (kept while shares are on)."""
        return dict(self._owned)

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
        assert len(seen) + len(self._free) == self._limit, "a slot leaked"
        assert all(i < self._limit for i in seen | set(self._free)), "a slot past the limit is in use"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        for index in self._cold:
            assert self._slots[index].prefetched and index in seen
        owners = Counter(self._slots[i].owner for i in seen if self._slots[i].owner is not None)
        assert owners == +self._owned, ("tenant slot counts disagree with the slots", owners, self._owned)
        assert all(self._slots[i].owner is None for i in range(len(self._slots)) if i not in seen), \
            "a slot holding nothing has an owner"


def _slot_part(slot: _Slot, i: int) -> object:
    return slot.key[i] if slot.key else "?"
