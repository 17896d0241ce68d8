"""Per-tenant expert cache shares (`ExpertCache.set_tenant_shares`, --tenant-cache-shares): a tenant at or over its
share evicts only its own experts, a flood's reads and hits never take an expert out of another tenant's share, and
every slot still holds the bytes of the expert it is keyed by."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from k3serve.model.expert_source import StepTenants
from k3serve.stream.expert_cache import ExpertCache
from k3serve.model.expert_source import StreamStats

NUM_LAYERS, NUM_EXPERTS, BLOB = 4, 64, 16


class _Reads:
    """Reads that complete at once and write each blob's offset into it (so a slot shows whose bytes it holds)."""

    def __init__(self) -> None:
        self.num_reads = 0

    def submit(self, extents):
        futures = {}
        for extent in extents:
            extent.buffer[:8] = extent.offset.to_bytes(8, "little")
            future = Future()
            future.set_result([])
            futures[id(extent)] = future
            self.num_reads += 1
        return futures

    def read_now(self, extent):
        raise AssertionError("no checksum fails here")


def _offset(layer: int, expert: int) -> int:
    return (layer * NUM_EXPERTS + expert) * BLOB


def _cache(num_slots: int, policy: str = "lru") -> ExpertCache:
    store = SimpleNamespace(
        experts=[SimpleNamespace(offsets=np.array([_offset(l, e) for e in range(NUM_EXPERTS)]),
                                 crc32=np.zeros(NUM_EXPERTS, np.uint32)) for l in range(NUM_LAYERS)],
        expert_blob_size=0, expert_path="experts.bin")
    arena = bytearray(num_slots * BLOB)
    view = memoryview(arena)
    cache = ExpertCache(store, _Reads(), num_slots, policy, StreamStats(),
                        slot_buffer=lambda i: view[i * BLOB:(i + 1) * BLOB], top_k=2)
    cache.arena = view  # for the bytes check
    return cache


def _load(cache: ExpertCache, tenant: str, layer: int, experts: list[int]) -> list[tuple]:
    """One group loaded for `tenant`; returns the keys evicted. Checks each slot holds its expert's bytes."""
    cache.begin_step()
    used = cache.load(layer, sorted(experts), {e: (tenant,) for e in experts})
    for index in used:
        key = cache.slot_key(index)
        assert int.from_bytes(cache.arena[index * BLOB:index * BLOB + 8], "little") == _offset(*key)
    cache.check_integrity()
    return [key for miss in cache.step_misses for key in miss[3]]


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo"])
def test_a_flood_never_evicts_a_tenant_within_its_share_and_recycles_its_own(policy):
    """H reuses 8 experts (its share: 10 slots of 20); M reads random other experts of every layer (a shared one
    is the next test's). With shares, no read
    for M evicts an expert H owns, M never holds more than the slots H leaves, and after its first pass H always
    hits. Without shares (the same trace, LRU), M evicts H's experts and H misses again."""
    rng = np.random.default_rng(0)
    light = [(l, e) for l in range(2) for e in (3, 7, 11, 19)]  # H's working set: 8 experts
    trace = []
    for step in range(400):
        if step % 10 == 0:
            trace += [("H", l, [e for (layer, e) in light if layer == l]) for l in range(2)]
        trace.append(("M", int(rng.integers(NUM_LAYERS)), sorted(set(rng.integers(32, NUM_EXPERTS, 2).tolist()))))

    def run(shares):
        cache = _cache(20, policy)
        cache.set_tenant_shares(shares)
        h_misses_after_warmup = 0
        for number, (tenant, layer, experts) in enumerate(trace):
            owned_by_h = {key for key in light if cache._owner_of(key) == "H"}
            before = cache.stats.expert_misses
            evicted = _load(cache, tenant, layer, experts)
            if shares is not None and tenant == "M":
                assert not owned_by_h & set(evicted), f"load {number}: M's read evicted H's experts {evicted}"
                assert cache.owned_slots().get("M", 0) <= 20 - cache.owned_slots().get("H", 0)
            if tenant == "H" and number > 10:
                h_misses_after_warmup += cache.stats.expert_misses - before
        return cache, h_misses_after_warmup

    shared, h_misses = run({"H": 0.5, "M": 0.5})
    assert h_misses == 0
    assert shared.owned_slots()["H"] == len(light) and shared.tenant_quotas() == {"H": 10, "M": 10}
    if policy == "lru":  # the same trace without shares: M's reads keep evicting H's experts
        assert run(None)[1] > 20


def test_a_tenant_over_its_share_evicts_its_own_least_recent_expert_not_an_older_one_of_another():
    cache = _cache(8)
    cache.set_tenant_shares({"H": 0.5, "M": 0.5})  # 4 slots each
    _load(cache, "H", 0, [1, 2])  # the oldest keys in the LRU order are H's
    _load(cache, "M", 1, [1, 2, 3, 4])
    _load(cache, "M", 1, [5, 6])  # M at its share fills the last free slots: nothing evicted
    assert cache.owned_slots() == {"H": 2, "M": 6}
    assert _load(cache, "M", 1, [7]) == [(1, 1)]  # plain LRU would evict (0, 1), H's
    assert _load(cache, "H", 0, [3]) == [(1, 2)]  # H under its share takes one of M's (M is over its share)
    assert cache.owned_slots() == {"H": 3, "M": 5}
    cache.set_tenant_shares(None)  # one shared cache again: the plain LRU victim
    assert _load(cache, "M", 2, [9]) == [(0, 1)]


def test_a_flood_hitting_an_expert_of_a_light_tenant_leaves_it_in_the_light_tenants_share():
    cache = _cache(8)
    cache.set_tenant_shares({"H": 0.5, "M": 0.5})
    _load(cache, "M", 0, [1, 2, 3, 4, 5])  # M over its share
    _load(cache, "H", 1, [1])
    cache.begin_step()
    cache.load(1, [1, 2], {1: ("M",), 2: ("M", "H")})  # M hits H's expert; a shared miss counts for H (under)
    assert cache._owner_of((1, 1)) == "H" and cache._owner_of((1, 2)) == "H"
    cache.check_integrity()


def test_shares_survive_a_resize_and_are_checked():
    cache = _cache(12)
    cache.set_tenant_shares({"H": 0.25, "M": 0.75})
    _load(cache, "H", 0, [1, 2, 3])
    _load(cache, "M", 1, [4, 5, 6, 7, 8, 9])
    cache.resize(6)  # the RAM controller's shrink: evictions and moves keep the owner counts exact
    cache.check_integrity()
    assert sum(cache.owned_slots().values()) == cache.num_resident() == 6
    assert cache.tenant_quotas() == {"H": 1, "M": 4}
    with pytest.raises(ValueError, match="above 1"):
        cache.set_tenant_shares({"H": 0.6, "M": 0.6})
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        cache.set_tenant_shares({"H": 0.0})


def test_step_tenants_name_each_experts_users_most_tokens_first():
    step = StepTenants(("M", "H", "M"), (2, 1, 1), {"H": 0.5, "M": 0.5})
    routing = np.array([[5, 1], [5, 7], [7, 5], [1, -1]])  # [T=4, TOPK=2] (rows M M H M); -1: dropped by top-p
    assert step.users(routing) == {1: ("M",), 5: ("M", "H"), 7: ("H", "M")}  # 7: a tie, by name
    assert step.users(routing[:3]) is None  # not this forward's rows
