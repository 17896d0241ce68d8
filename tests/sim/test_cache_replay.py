"""Trace replay: Belady bounds every policy; hand-checked small cases."""

from __future__ import annotations

import random

from k3serve.sim.cache_replay import belady, replay, replay_all


def _requests(seed=0, steps=120, experts=16, top_k=3, layers=(1, 2, 3)):
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(experts)]  # skewed popularity
    out = []
    for step in range(steps):
        for layer in layers:
            chosen = set()
            while len(chosen) < top_k:
                chosen.add(rng.choices(range(experts), weights)[0])
            out.append((step, layer, sorted(chosen)))
    return out


def test_belady_is_a_lower_bound_on_misses():
    requests = _requests()
    for capacity in (3, 8, 20, 48):
        results = replay_all(requests, [capacity], tokens=120, expert_bytes=100, working_slots=3)
        best = next(r for r in results if r.policy == "belady")
        for r in results:
            assert r.misses >= best.misses, (r.policy, capacity)
            assert r.hits + r.misses == r.requests


def test_hand_checked_sequence():
    requests = [(0, 1, [1]), (1, 1, [2]), (2, 1, [3]), (3, 1, [1]), (4, 1, [2])]
    # capacity 2. LRU: 1, 2, 3 (evicts 1), 1 (evicts 2), 2 (evicts 3): 5 misses.
    # Belady at 3 evicts 2 (next use farther than 1's): 1 hits, 2 misses: 4 misses.
    assert replay(requests, "lru", 2, 5, 1).misses == 5
    assert belady(requests, 2, 5, 1).misses == 4
    assert replay(requests, "none", 2, 5, 1).hits == 0
