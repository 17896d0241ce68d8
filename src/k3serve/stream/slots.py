"""Expert slots as weights: one arena of 4 KiB-aligned slots, allocated once, each slot viewed as one expert's
weights, under an `ExpertCache`; and the request mapping that loads a layer's experts in groups that fit the slots.

Shared by every streaming source (K3's `StreamingSource` and the families' `StreamingExperts`): what differs is
only how a slot's bytes are viewed as weights (`view(blob) -> weights`, no copy).

NOTE: the values a request hands out are views of slots, valid until the next `request()` call; a request larger
than the slots is loaded group by group, in ascending expert id, so its values are read in that order, each before
the next lookup.
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Mapping
from typing import Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

from k3serve.stream.expert_cache import ExpertCache, ExpertIO

W = TypeVar("W")


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory, page-aligned (so O_DIRECT reads may land in it)."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))


class LayerExperts(Mapping, Generic[W]):
    """The experts of one request, loaded in groups that fit the slots, in ascending id order."""

    def __init__(self, slots: ExpertSlots[W], layer: int, ids: Sequence[int], generation: int,
                 users: Mapping[int, Sequence[str]] | None = None) -> None:
        self._slots = slots
        self.users = users  # expert -> tenants routed to it, most tokens first (tenant shares); None: not kept
        self.layer = layer
        self.ids = sorted(set(int(e) for e in ids))
        self._position = {e: i for i, e in enumerate(self.ids)}
        self.generation = generation
        self.loaded: dict[int, W] = {}

    def __getitem__(self, expert: int) -> W:
        expert = int(expert)
        if expert not in self.loaded:
            if expert not in self._position:
                raise KeyError(expert)
            self._slots.load_group(self, self._position[expert])
        return self.loaded[expert]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class ExpertSlots(Generic[W]):
    """`num_slots` slots of `store.expert_stride` bytes under an `ExpertCache` with `policy`."""

    def __init__(self, store, io: ExpertIO, num_slots: int, policy: str, stats, view: Callable[[np.ndarray], W], *,
                 top_k: int, prefetch: bool, prefetch_max: int | None, profile: Counter | None = None) -> None:
        self.stride = store.expert_stride
        self._arena = aligned_buffer(num_slots * self.stride)
        self._arena_view = memoryview(self._arena)
        arena = np.frombuffer(self._arena, dtype=np.uint8)
        self._weights = [view(arena[i * self.stride:(i + 1) * self.stride]) for i in range(num_slots)]
        self.cache = ExpertCache(store, io, num_slots, policy, stats, slot_buffer=self._slot_buffer, top_k=top_k,
                                 prefetch=prefetch, prefetch_max=prefetch_max, profile=profile)
        self._generation = 0

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    def resize(self, num_slots: int) -> int:
        """Use `num_slots` slots of the arena (`ExpertCache.resize`; between steps); the pages of the slots given up
        go back to the OS at once (MADV_REMOVE: they read as zeros if used again). Returns the slots in use."""
        before = self.cache.num_slots
        after = self.cache.resize(num_slots)
        self._generation += 1  # views handed out before the move are no longer valid
        # the arena is a shared anonymous mapping (shmem): MADV_REMOVE frees its pages, DONTNEED only unmaps them
        advice = getattr(mmap, "MADV_REMOVE", getattr(mmap, "MADV_DONTNEED", None))
        if after < before and advice is not None:
            self._arena.madvise(advice, after * self.stride, (before - after) * self.stride)
        return after

    def _slot_buffer(self, index: int) -> memoryview:
        return self._arena_view[index * self.stride:(index + 1) * self.stride]

    def request(self, layer: int, expert_ids: Sequence[int], users: Mapping[int, Sequence[str]] | None = None
                ) -> LayerExperts[W]:
        """The experts `expert_ids` of `layer`; the first group is loaded now, later ones on first lookup. `users`:
        the tenants each expert is read for (`ExpertCache.load`)."""
        self.cache.release()
        self._generation += 1
        request = LayerExperts(self, layer, expert_ids, self._generation, users)
        if request.ids:
            self.load_group(request, 0)
        return request

    def load_group(self, request: LayerExperts[W], start: int) -> None:
        if request.generation != self._generation:
            raise RuntimeError("expert weights from an earlier experts() call are no longer valid")
        request.loaded.clear()
        group = request.ids[start:start + self.cache.num_slots]
        used = self.cache.load(request.layer, group, request.users)
        request.loaded.update({self.cache.slot_key(i)[1]: self._weights[i] for i in used})
