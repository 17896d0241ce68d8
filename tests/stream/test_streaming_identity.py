"""Invariant 3: streaming output equals resident output byte for byte, at every budget, policy, layout, I/O
mode, queue depth and prefetch setting; greedy and seeded sampling; tiny oracle and embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions

IDS = [1, 5, 9, 200, 17, 3, 88, 41, 2, 250, 7]


@pytest.fixture(scope="module")
def resident(tiny_model):
    return {
        "full": tiny_model.logits(IDS),
        "incremental": tiny_model.logits(IDS, mode="incremental"),
        "greedy": generate(tiny_model, IDS[:4], SamplingParams(max_tokens=10, ignore_eos=True))[0],
        "sampled": generate(tiny_model, IDS[:4], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10,
                                                                ignore_eos=True))[0],
    }


def _budgets(store):
    minimum = minimum_budget_bytes(store)
    return {"minimum": minimum, "middle": minimum + 40 * store.expert_stride + 400_000, "unlimited": None}


CASES = [
    # (budget, cache, io, queue depth, prefetch)
    ("minimum", "none", "mmap", 1, "none"),
    ("minimum", "lru", "pread", 1, "next-layer"),
    ("minimum", "s3fifo", "direct", 16, "next-layer"),
    ("middle", "lru", "direct", 16, "none"),
    ("middle", "lfu", "pread", 4, "next-layer"),
    ("middle", "s3fifo", "mmap", 1, "next-layer"),
    ("middle", "pinned", "direct", 32, "next-layer"),
    ("middle", "none", "pread", 16, "next-layer"),
    ("unlimited", "lru", "pread", 8, "next-layer"),
    ("unlimited", "lfu", "direct", 2, "none"),
]


@pytest.mark.parametrize("layout", ["natural", "coactivation"])
@pytest.mark.parametrize("budget,cache,io,depth,prefetch", CASES)
def test_streaming_matches_resident_bytes(resident, tiny_store, tiny_store_coactivation, tiny_trace, layout,
                                          budget, cache, io, depth, prefetch):
    store = tiny_store if layout == "natural" else tiny_store_coactivation
    options = StreamOptions(ram_budget=_budgets(store)[budget], trunk_dtype="float32", cache=cache, io=io, queue_depth=depth,
                            prefetch=prefetch, cache_profile=tiny_trace if cache == "pinned" else None)
    model = load_model(store.path, stream=options).model
    source = model.source
    assert np.array_equal(model.logits(IDS), resident["full"])
    source.check_integrity()
    assert np.array_equal(model.logits(IDS, mode="incremental"), resident["incremental"])
    assert generate(model, IDS[:4], SamplingParams(max_tokens=10, ignore_eos=True))[0] == resident["greedy"]
    sampled = generate(model, IDS[:4], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10,
                                                      ignore_eos=True))[0]
    assert sampled == resident["sampled"]
    source.check_integrity()
    stats = source.stats().stream
    assert stats.expert_requests == stats.expert_retained + stats.expert_prefetch_hits + stats.expert_misses
    if budget != "unlimited":
        assert source.plan.total_bytes <= options.ram_budget
    source.close()


def test_embedded_model_streams_byte_identically():
    from k3serve.loading.streaming import default_packed_dir
    from k3serve.weights.store import PackedStore

    resident = load_model(None).model
    store = PackedStore(default_packed_dir())
    budget = minimum_budget_bytes(store) + 8 * store.expert_stride
    streamed = load_model(None, stream=StreamOptions(ram_budget=budget, trunk_dtype="float32", io="direct", cache="s3fifo",
                                                     prefetch="next-layer")).model
    assert streamed.source.plan.pinned_layers != tuple(range(8)), "the budget must force trunk streaming"
    prompt = [1, 40, 41, 300, 7]
    for params in (SamplingParams(max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=12, ignore_eos=True)):
        assert generate(streamed, prompt, params)[0] == generate(resident, prompt, params)[0]
    assert np.array_equal(streamed.logits(prompt), resident.logits(prompt))
    streamed.source.close()


def test_a_prefetched_expert_is_never_counted_as_retained(tiny_store):
    model = load_model(tiny_store.path, stream=StreamOptions(cache="none", trunk_dtype="float32", prefetch="next-layer",
                                                             prefetch_max=8)).model
    model.logits([1])  # one step from an empty cache
    stats = model.source.stats().stream
    assert stats.expert_retained == 0
    assert stats.expert_prefetch_hits > 0  # the guesses (all experts of the next layer) were used
    assert stats.expert_misses + stats.expert_prefetch_hits == stats.expert_requests


def test_top_p_streams_byte_identically_and_its_prefetch_guesses_only_kept_experts(tiny_dir, tiny_store):
    from k3serve.model.routing import ExpertTopP

    limit = ExpertTopP(0.6, 1)
    prompt = [1, 5, 9, 200, 17, 3, 44, 8, 90, 12]
    want = load_model(tiny_dir, expert_top_p=limit).model.logits(prompt)
    budget = minimum_budget_bytes(tiny_store) + 8 * tiny_store.expert_stride
    issued = {}
    for top_p in (limit, None):
        options = StreamOptions(ram_budget=budget, trunk_dtype="float32", cache="lru", prefetch="next-layer")
        model = load_model(tiny_store.path, stream=options, expert_top_p=top_p).model
        if top_p is not None:
            np.testing.assert_array_equal(model.logits(prompt), want)
        before = model.source.stats().stream.prefetch_issued
        model.greedy(prompt[:2], 10)  # one-token steps: a decode guess names a token's experts, at most TOPK
        issued[top_p is None] = model.source.stats().stream.prefetch_issued - before
        model.source.close()
    assert 0 < issued[False] < issued[True]  # fewer guesses once top-p trims them
