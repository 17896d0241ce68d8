"""Expert cache replacement policies, shared by the live streaming source and the trace simulator.

A policy sees keys (layer, expert) enter (`admit`), get hit (`touch`) and leave (`remove`), and names a victim
when the cache is full (`victim`), never one of the `protected` keys (those the current request is using).
The slot bookkeeping (which bytes live where, cold and warm slots, prefetch) is the owner's; a policy only
orders keys.

- none:    nothing is retained between requests (every request reads its experts).
- lru:     least recently used.
- lfu:     least frequently used, counting every request seen (counts survive eviction, so popularity is
           learned), ties broken by recency.
- s3fifo:  S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%) filters one-hit wonders, a main FIFO with
           reinsertion keeps keys hit while resident, a ghost FIFO remembers recent evictions from the small queue.
- pinned:  a static hot set (the most requested keys of a profile) is never evicted; other keys pass through
           the remaining slots first-in first-out.
Belady (the offline optimum) needs the future and lives in `k3serve.sim.cache_replay`.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from typing import Collection, Hashable, Iterable

Key = Hashable
POLICIES = ("none", "lru", "lfu", "s3fifo", "pinned")


class CachePolicy(ABC):
    name: str = ""
    retains: bool = True  # False: the owner drops every key after its request

    @abstractmethod
    def admit(self, key: Key) -> None: ...

    @abstractmethod
    def touch(self, key: Key) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def victim(self, protected: Collection[Key]) -> Key | None: ...

    def count(self, key: Key) -> None:
        """Every request for `key`, hit or miss (before admit/touch); frequency policies learn from it."""


class NoCache(CachePolicy):
    name, retains = "none", False

    def __init__(self) -> None:
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def admit(self, key: Key) -> None:
        self._keys[key] = None

    def touch(self, key: Key) -> None:
        pass

    def remove(self, key: Key) -> None:
        self._keys.pop(key, None)

    def victim(self, protected: Collection[Key]) -> Key | None:
        return next((k for k in self._keys if k not in protected), None)


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def admit(self, key: Key) -> None:
        self._order[key] = None

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Collection[Key]) -> Key | None:
        return next((k for k in self._order if k not in protected), None)


class LFUPolicy(CachePolicy):
    name = "lfu"

    def __init__(self) -> None:
        self._frequency: Counter = Counter()
        self._clock = itertools.count()
        self._stamp: dict[Key, int] = {}
        self._heap: list[tuple[int, int, Key]] = []

    def count(self, key: Key) -> None:
        self._frequency[key] += 1

    def _push(self, key: Key) -> None:
        stamp = next(self._clock)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (self._frequency[key], stamp, key))

    def admit(self, key: Key) -> None:
        self._push(key)

    def touch(self, key: Key) -> None:
        self._push(key)

    def remove(self, key: Key) -> None:
        self._stamp.pop(key, None)

    def victim(self, protected: Collection[Key]) -> Key | None:
        skipped = []
        found = None
        while self._heap:
            frequency, stamp, key = heapq.heappop(self._heap)
            if self._stamp.get(key) != stamp:
                continue  # stale entry
            if key in protected:
                skipped.append((frequency, stamp, key))
                continue
            found = key
            heapq.heappush(self._heap, (frequency, stamp, key))  # the owner calls remove() next
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._stamp)


class S3FIFOPolicy(CachePolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        self.capacity = max(1, capacity)
        self.small_target = max(1, int(round(self.capacity * small_fraction)))
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._frequency: dict[Key, int] = {}

    def admit(self, key: Key) -> None:
        self._frequency[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Key) -> None:
        self._frequency[key] = min(self._frequency.get(key, 0) + 1, 3)

    def remove(self, key: Key) -> None:
        if self._small.pop(key, 0) is None:
            self._ghost[key] = None
            while len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)
        self._main.pop(key, None)
        self._frequency.pop(key, None)

    def victim(self, protected: Collection[Key]) -> Key | None:
        # bounded passes: every reinsertion lowers a frequency or moves a key from small to main
        for _ in range(4 * (len(self._small) + len(self._main)) + 1):
            if self._small and (len(self._small) >= self.small_target or not self._main):
                key = next((k for k in self._small if k not in protected), None)
                if key is not None:
                    if self._frequency.get(key, 0) > 0:
                        del self._small[key]
                        self._frequency[key] = 0
                        self._main[key] = None
                        continue
                    return key
            key = next((k for k in self._main if k not in protected), None)
            if key is None:
                return next((k for k in self._small if k not in protected), None)
            if self._frequency.get(key, 0) > 0:
                self._frequency[key] -= 1
                self._main.move_to_end(key)
                continue
            return key
        return next((k for k in itertools.chain(self._main, self._small) if k not in protected), None)


class PinnedPolicy(CachePolicy):
    name = "pinned"

    def __init__(self, hot: Iterable[Key]) -> None:
        self.hot = frozenset(hot)
        self._transient: OrderedDict[Key, None] = OrderedDict()
        self._pinned: set[Key] = set()

    def admit(self, key: Key) -> None:
        if key in self.hot:
            self._pinned.add(key)
        else:
            self._transient[key] = None

    def touch(self, key: Key) -> None:
        pass

    def remove(self, key: Key) -> None:
        self._transient.pop(key, None)
        self._pinned.discard(key)

    def victim(self, protected: Collection[Key]) -> Key | None:
        key = next((k for k in self._transient if k not in protected), None)
        if key is None:  # only when the hot set was sized too large for the slots
            key = next((k for k in self._pinned if k not in protected), None)
        return key


def hot_set(counts: Counter, capacity: int) -> list[Key]:
    """The `capacity` most requested keys (ties: smaller key first)."""
    return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:max(capacity, 0)]]


def make_policy(name: str, capacity: int, profile: Counter | None = None, working_slots: int = 0) -> CachePolicy:
    """`profile`: request counts per key (for pinned); `working_slots` stay free of pinned keys."""
    if name == "none":
        return NoCache()
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "s3fifo":
        return S3FIFOPolicy(capacity)
    if name == "pinned":
        if profile is None:
            raise ValueError("the pinned policy needs a profile: --cache-profile TRACE (written by --trace-out)")
        return PinnedPolicy(hot_set(profile, capacity - working_slots))
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
