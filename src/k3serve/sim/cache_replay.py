"""Replaying a routing trace against expert-cache policies, with Belady's offline optimum as the bound.

A trace's requests (step, layer, union of experts) are replayed in order against a cache of `capacity` experts.
Rules match the live source: a request's experts are protected while it is served; a request larger than the
cache is served in groups of `capacity` in ascending id order. Retention = hits / requests (a hit is an expert
resident before the request); bytes read = misses x the expert blob size.

Belady (MIN): on a miss with a full cache, evict the resident expert whose next request is farthest in the
future (never requested again first). It minimises misses for a demand-paged cache and so bounds every policy.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from k3serve.stream.cache import make_policy

Request = tuple[int, int, list[int]]  # (step, layer, sorted expert ids)
NEVER = float("inf")


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int
    requests: int
    hits: int
    misses: int
    tokens: int
    expert_bytes: int

    @property
    def retention(self) -> float:
        return self.hits / self.requests if self.requests else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.misses * self.expert_bytes / max(self.tokens, 1)


def _groups(requests: Sequence[Request], capacity: int) -> list[list[tuple[int, int]]]:
    out = []
    for _, layer, ids in requests:
        for start in range(0, len(ids), capacity):
            out.append([(layer, e) for e in ids[start:start + capacity]])
    return out


def replay(requests: Sequence[Request], policy_name: str, capacity: int, tokens: int, expert_bytes: int,
           profile: Counter | None = None, working_slots: int = 1) -> ReplayResult:
    if policy_name == "belady":
        return belady(requests, capacity, tokens, expert_bytes)
    policy = make_policy(policy_name, capacity, profile, working_slots=working_slots)
    resident: set = set()
    hits = misses = 0
    for group in _groups(requests, capacity):
        protected = set(group)
        for key in group:
            policy.count(key)
            if key in resident:
                hits += 1
                policy.touch(key)
                continue
            misses += 1
            if len(resident) >= capacity:
                victim = policy.victim(protected)
                assert victim is not None
                resident.discard(victim)
                policy.remove(victim)
            resident.add(key)
            policy.admit(key)
        if not policy.retains:
            for key in group:
                resident.discard(key)
                policy.remove(key)
    return ReplayResult(policy_name, capacity, hits + misses, hits, misses, tokens, expert_bytes)


def belady(requests: Sequence[Request], capacity: int, tokens: int, expert_bytes: int) -> ReplayResult:
    groups = _groups(requests, capacity)
    accesses = [(g, key) for g, group in enumerate(groups) for key in group]
    next_use: list[float] = [NEVER] * len(accesses)
    last_seen: dict = {}
    for i in range(len(accesses) - 1, -1, -1):
        key = accesses[i][1]
        next_use[i] = last_seen.get(key, NEVER)
        last_seen[key] = accesses[i][0]
    resident: dict = {}  # key -> its next use (group index)
    heap: list = []  # (-next use, key): lazily invalidated
    hits = misses = 0
    i = 0
    for g, group in enumerate(groups):
        protected = set(group)
        for key in group:
            nxt = next_use[i]
            i += 1
            if key in resident:
                hits += 1
            else:
                misses += 1
                if len(resident) >= capacity:
                    skipped = []
                    while True:
                        negative, victim = heapq.heappop(heap)
                        if resident.get(victim) != -negative:
                            continue
                        if victim in protected:
                            skipped.append((negative, victim))
                            continue
                        break
                    for entry in skipped:
                        heapq.heappush(heap, entry)
                    del resident[victim]
            resident[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    return ReplayResult("belady", capacity, hits + misses, hits, misses, tokens, expert_bytes)


def replay_all(requests: Sequence[Request], capacities: Sequence[int], tokens: int, expert_bytes: int,
               policies: Sequence[str] = ("none", "lru", "lfu", "s3fifo", "pinned", "belady"),
               working_slots: int = 1) -> list[ReplayResult]:
    """Every policy at every capacity; pinned takes its hot set from the same trace (an oracle profile)."""
    profile: Counter = Counter()
    for _, layer, ids in requests:
        profile.update((layer, e) for e in ids)
    return [replay(requests, p, c, tokens, expert_bytes, profile, working_slots)
            for c in capacities for p in policies]
