"""Hybrid prefix caching: a hit (MLA blocks + a KDA checkpoint at exactly that position) gives the same logits and
tokens as a miss; multi-turn, branch points, tenant isolation, the block-aligned mode's warning, eviction (LRU and
segmented LRU)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from k3serve.engine.config import PREFIX_CACHE_POLICIES, EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.prefix_cache import SegmentedLRU, StateCheckpoint, root_hash
from k3serve.errors import ConfigError
from k3serve.engine.sampling import SamplingParams
from k3serve.model.interface import ForwardItem

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [1, 17, 200, 45, 3, 99, 128, 7, 250, 64, 31, 5, 180, 77, 12, 240, 33, 90, 150, 2, 4, 66]


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _engine(model, **overrides) -> LLMEngine:
    settings = dict(block_size=4, num_blocks=128, max_batch_tokens=64, max_seqs=8, num_state_checkpoints=16)
    settings.update(overrides)
    return LLMEngine(model, EngineConfig(**settings))


def _tokens(engine, drive, prompt, params=GREEDY, **kwargs):
    request_id = engine.add_request(prompt, params, **kwargs)
    out = drive(engine)[request_id]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.mark.parametrize("prompt_len", [3, 8, 10], ids=["inside-first-block", "block-boundary", "partial-block"])
def test_a_hit_gives_the_same_logits_as_a_miss(tiny_model, drive, prompt_len):
    """Checkpoint at the prompt end: restored KDA state + shared full blocks + the tail rows it keeps."""
    engine = _engine(tiny_model)
    prompt = PROMPT[:prompt_len]
    _tokens(engine, drive, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler = engine.scheduler
    tokens = prompt + [9, 19, 29, 39, 49]
    hashes: list[bytes] = []
    root = root_hash("default", None)
    scheduler.prefix_cache.extend_hashes(root, tokens, hashes, len(tokens) // 4)
    match = scheduler.prefix_cache.match(root, tokens, hashes)
    assert match.num_tokens == prompt_len and len(match.block_ids) == prompt_len // 4
    cache = PagedSequenceCache(scheduler.blocks, scheduler.states)
    scheduler.prefix_cache.restore(match, cache)
    assert cache.num_tokens == prompt_len
    rest = np.asarray(tokens[prompt_len:])
    cache.reserve(len(rest))
    got = tiny_model.forward([ForwardItem(rest, cache, all_logits=True)]).logits[0]
    # the miss, computed the same way (the prompt in one forward, then the rest) on a contiguous cache
    dense = tiny_model.new_cache()
    tiny_model.forward([ForwardItem(np.asarray(prompt), dense)])
    want = tiny_model.forward([ForwardItem(rest, dense, all_logits=True)]).logits[0]
    assert _relative_rms(got, want) < 1e-6
    assert np.array_equal(got.argmax(1), want.argmax(1))
    full = tiny_model.logits(tokens)[prompt_len:]  # and one forward over everything: equal up to rounding
    assert _relative_rms(got, full) < 1e-4 and np.array_equal(got.argmax(1), full.argmax(1))
    cache.release()
    engine.check_integrity()


def test_engine_tokens_from_the_cache_equal_tokens_computed_from_scratch(tiny_model, drive):
    warm, cold = _engine(tiny_model), _engine(tiny_model, enable_prefix_caching=False)
    _tokens(warm, drive, PROMPT[:13])
    extended = PROMPT[:13] + [7, 7, 8]
    hit_tokens, cached = _tokens(warm, drive, extended)
    assert cached == 13
    assert hit_tokens == _tokens(cold, drive, extended)[0] == tiny_model.greedy(extended, 6)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=6, temperature=0.9, seed=3, n=2,
                                                            ignore_eos=True)], ids=["greedy", "seeded-n2"])
def test_an_exact_repeat_of_a_prompt_hits_whole_with_the_tokens_of_a_miss(tiny_model, drive, params):
    """The prompt-end checkpoint keeps the logits after the prompt, so the same prompt again restores every token
    and samples its first token without a forward (issue 32, item 13)."""
    warm, cold = _engine(tiny_model), _engine(tiny_model, enable_prefix_caching=False)
    prompt = PROMPT[:14]
    first_id = warm.add_request(prompt, params)
    first = drive(warm)[first_id]
    computed = warm.metrics.counter("computed_tokens").value
    again_id = warm.add_request(prompt, params)
    again = drive(warm)[again_id]
    cold_id = cold.add_request(prompt, params)
    miss = drive(cold)[cold_id]
    assert again.num_cached_tokens == len(prompt) and first.num_cached_tokens == 0
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs] \
        == [c.token_ids for c in miss.outputs]
    # no prompt position was computed again: only the decode steps after the first token (n completions)
    assert warm.metrics.counter("computed_tokens").value - computed == params.n * (params.max_tokens - 1)
    warm.check_integrity()


def test_a_repeat_of_a_prompt_from_another_tenant_does_not_hit(tiny_model, drive):
    engine = _engine(tiny_model)
    _tokens(engine, drive, PROMPT[:14], tenant="a")
    assert _tokens(engine, drive, PROMPT[:14], tenant="b")[1] == 0
    assert _tokens(engine, drive, PROMPT[:14], tenant="a")[1] == 14


def test_second_turn_hits_at_the_last_generated_token(tiny_model, drive):
    engine = _engine(tiny_model)
    first, cached = _tokens(engine, drive, PROMPT[:9])
    assert cached == 0
    second_prompt = PROMPT[:9] + first + [44, 55, 66]
    second, cached = _tokens(engine, drive, second_prompt)
    # the last generated token was sampled but never fed through the model: the state ends just before it
    assert cached == 9 + len(first) - 1
    assert second == tiny_model.greedy(second_prompt, 6)
    assert engine.metrics.snapshot()["prefix_cache_hit_tokens"] == cached


def test_a_branch_point_is_checkpointed_so_later_requests_hit_there(tiny_model, drive):
    engine = _engine(tiny_model)
    system = PROMPT[:13]  # shared by every request, not a block multiple
    cached = [_tokens(engine, drive, system + question)[1] for question in ([100, 101], [110, 111], [120, 121])]
    # 1st: nothing cached. 2nd: leaves the 1st one's tokens at 13, saves a checkpoint there. 3rd: hits it.
    assert cached == [0, 0, 13]


@pytest.mark.parametrize("policy", PREFIX_CACHE_POLICIES)
def test_tenants_and_salts_never_share_entries(tiny_model, drive, policy):
    engine = _engine(tiny_model, prefix_cache_policy=policy)
    prompt = PROMPT[:10]
    _tokens(engine, drive, prompt, tenant="a")
    longer = prompt + [3, 4]
    assert _tokens(engine, drive, longer, tenant="b")[1] == 0
    assert _tokens(engine, drive, longer, tenant="a", cache_salt="secret")[1] == 0
    assert _tokens(engine, drive, longer, tenant="a")[1] == 10


def test_block_aligned_mode_hits_only_at_block_boundaries(tiny_model, drive):
    engine = _engine(tiny_model, checkpoint_partial_blocks=False)
    _tokens(engine, drive, PROMPT[:10])
    tokens, cached = _tokens(engine, drive, PROMPT[:10] + [3, 4])
    assert cached == 8 and tokens == tiny_model.greedy(PROMPT[:10] + [3, 4], 6)


def test_caching_that_cannot_hit_says_so(tiny_model, drive, caplog):
    with caplog.at_level(logging.WARNING, logger="k3serve.engine.prefix_cache"):
        aligned = _engine(tiny_model, block_size=16, checkpoint_partial_blocks=False)
        for _ in range(2):
            assert _tokens(aligned, drive, PROMPT[:10])[1] == 0
    assert any("cannot hit" in r.message for r in caplog.records)
    snapshot = aligned.metrics.snapshot()
    assert snapshot["prefix_cache_cannot_hit"] == 1 and snapshot["prefix_cache_unhittable_requests"] == 2
    # the same short prompts do hit with partial-block checkpoints (the default)
    partial = _engine(tiny_model, block_size=16)
    _tokens(partial, drive, PROMPT[:10])
    assert _tokens(partial, drive, PROMPT[:10] + [5])[1] == 10
    assert partial.metrics.snapshot()["prefix_cache_cannot_hit"] == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3serve.engine.prefix_cache"):
        no_checkpoints = _engine(tiny_model, num_state_checkpoints=0)
    assert any("num_state_checkpoints = 0" in r.message for r in caplog.records)
    assert no_checkpoints.metrics.snapshot()["prefix_cache_cannot_hit"] == 1


def test_checkpoints_are_evicted_least_recently_used_and_with_their_blocks(tiny_model, drive):
    engine = _engine(tiny_model, num_state_checkpoints=2, prefix_cache_policy="lru")
    prefix_cache = engine.scheduler.prefix_cache
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    a, b = PROMPT[:5], PROMPT[5:11]
    _tokens(engine, drive, a, one_token)  # checkpoint at 5 (prompt end = after the last token)
    _tokens(engine, drive, b, one_token)  # checkpoint at 6: both slots used
    # a hit on a's checkpoint makes it the most recent; the new prompt end (6) then evicts b's, the oldest
    assert _tokens(engine, drive, a + [1], one_token)[1] == 5
    assert prefix_cache.checkpoint_positions() == [5, 6]
    assert _tokens(engine, drive, b + [1], one_token)[1] == 0, "b's checkpoint was the least recently used"
    engine.check_integrity()
    # dropping the cached blocks drops the checkpoints that sit on them: no hit without the MLA rows
    engine.scheduler.prefix_cache.clear()
    assert prefix_cache.num_checkpoints == 0 and engine.scheduler.blocks.num_cached_blocks == 0
    assert _tokens(engine, drive, a + [1], one_token)[1] == 0
    engine.check_integrity()


# ---- replacement policy -------------------------------------------------------------------------------------------
def _checkpoint(slot: int) -> StateCheckpoint:
    return StateCheckpoint(slot, b"", (), slot)


def test_segmented_lru_promotes_on_hit_demotes_beyond_capacity_and_evicts_probation_first():
    recency = SegmentedLRU(protected_capacity=2)
    for slot in range(4):
        recency.add(_checkpoint(slot))
    assert recency.victim().slot == 0
    recency.hit(0, fork=True)
    recency.hit(1, fork=True)
    assert list(recency.protected) == [0, 1] and list(recency.probation) == [2, 3]
    assert recency.victim().slot == 2, "eviction takes probation's least recent, not the older protected entries"
    recency.hit(2, fork=True)  # protected is over capacity: its least recent (0) goes back to probation's most recent
    assert list(recency.protected) == [1, 2] and list(recency.probation) == [3, 0]
    recency.touch(3)  # a re-save refreshes within the segment, it does not promote
    assert list(recency.probation) == [0, 3] and recency.victim().slot == 0
    recency.remove(0)
    recency.remove(3)
    assert recency.victim().slot == 1, "with probation empty the victim is protected's least recent"
    assert len(recency) == 2 and recency.get(2) is not None and recency.get(0) is None
    recency.add(_checkpoint(7))
    recency.add(_checkpoint(8))
    recency.hit(7, fork=False)  # a first hit that is no fork (a conversation's next turn) only refreshes it
    assert list(recency.probation) == [8, 7] and 7 not in recency.protected
    recency.hit(7, fork=False)  # a second hit protects it
    assert list(recency.protected) == [2, 7] and list(recency.probation) == [8, 1]


def test_segmented_lru_without_a_protected_segment_is_plain_lru():
    recency, order = SegmentedLRU(protected_capacity=0), []
    rng = np.random.default_rng(0)
    for step in range(200):
        slot = int(rng.integers(0, 6))
        if recency.get(slot) is None:
            if len(recency) == 4:
                victim = recency.victim().slot
                assert victim == order.pop(0), f"step {step}: not the least recently used"
                recency.remove(victim)
            recency.add(_checkpoint(slot))
        else:
            recency.hit(slot, fork=bool(rng.integers(0, 2)))
            order.remove(slot)
        order.append(slot)
        assert list(recency.probation) == order and not recency.protected


def _recurring_prefix_after_one_shots(model, engine, drive) -> int:
    """A system prompt recurs (the third request hits its branch-point checkpoint), then 12 one-shot prompts each
    save a prompt-end and a reply checkpoint (24 entries, 3x the capacity of 8); returns how many positions the
    next request that starts with the system prompt restores (its tokens checked against the plain model)."""
    system = PROMPT[:13]
    cached = [_tokens(engine, drive, system + question)[1] for question in ([100, 101], [110, 111], [120, 121])]
    assert cached == [0, 0, 13]
    rng = np.random.default_rng(1)
    for _ in range(12):
        _tokens(engine, drive, [int(t) for t in rng.integers(3, 250, 7)])
    assert engine.scheduler.prefix_cache.num_checkpoints == 8
    prompt = system + [130, 131]
    tokens, cached = _tokens(engine, drive, prompt)
    assert tokens == model.greedy(prompt, 6)
    return cached


def test_one_shot_checkpoints_evict_a_recurring_prefix_under_lru_but_not_under_slru(tiny_model, drive):
    lru = _engine(tiny_model, num_state_checkpoints=8, prefix_cache_policy="lru")
    assert _recurring_prefix_after_one_shots(tiny_model, lru, drive) == 0
    slru = _engine(tiny_model, num_state_checkpoints=8, prefix_cache_policy="slru")
    assert _recurring_prefix_after_one_shots(tiny_model, slru, drive) == 13
    protected = slru.scheduler.prefix_cache.num_protected_checkpoints
    assert protected >= 1 and slru.metrics.snapshot()["prefix_cache_protected_checkpoints"] == protected


def test_a_prefix_evicted_before_its_first_hit_is_protected_when_saved_again(tiny_model, drive):
    """A question on a 3-block system prompt saves a checkpoint at the prompt's end of block 3 (every 3 blocks);
    one-shot prompts evict it before the next question can hit. That next question computes the prefix again and
    saves the same checkpoint: under slru its key is among the recently evicted, so it goes straight to the
    protected segment and outlives the next one-shot prompts, and a third question hits; plain LRU loses it again."""
    system = PROMPT[:12]
    rng = np.random.default_rng(4)
    one_shots = [[int(t) for t in rng.integers(3, 250, 7)] for _ in range(4)]
    cached = {}
    for policy in PREFIX_CACHE_POLICIES:
        engine = _engine(tiny_model, num_state_checkpoints=5, prefix_cache_policy=policy, checkpoint_every_blocks=3)
        misses = [_tokens(engine, drive, system + [100, 101])[1]]
        for prompt in one_shots:  # 8 one-shot checkpoints against 5 slots
            _tokens(engine, drive, prompt)
        misses.append(_tokens(engine, drive, system + [110, 111])[1])
        for prompt in one_shots:
            _tokens(engine, drive, list(reversed(prompt)))
        prompt = system + [130, 131]
        tokens, cached[policy] = _tokens(engine, drive, prompt)
        assert misses == [0, 0] and tokens == tiny_model.greedy(prompt, 6)
        engine.check_integrity()
        recurring = engine.metrics.snapshot()["prefix_cache_checkpoints_recurring"]
        assert recurring == (1 if policy == "slru" else 0)
    assert cached == {"lru": 0, "slru": 12}


def _interleaved_chats(engine, drive, model) -> int:
    """Three conversations of four turns, their turns interleaved; returns the positions restored in all."""
    rng = np.random.default_rng(2)
    contexts = [[int(t) for t in rng.integers(3, 250, 6)] for _ in range(3)]
    total = 0
    for _ in range(4):
        for context in contexts:
            reply, cached = _tokens(engine, drive, context)
            assert reply == model.greedy(context, 6)
            total += cached
            context += reply + [int(t) for t in rng.integers(3, 250, 2)]
    return total


def test_multi_turn_chats_hit_under_slru_as_under_lru(tiny_model, drive):
    """A reply checkpoint is used once, by its conversation's next turn; protecting it on that hit would fill the
    protected segment with states no one will ask for again, and leave the next replies too few slots. So a first
    hit that is no fork (the turn leaves no cached path there) only refreshes it; a second protects it."""
    results = {}
    for policy in PREFIX_CACHE_POLICIES:
        engine = _engine(tiny_model, num_state_checkpoints=5, prefix_cache_policy=policy)
        results[policy] = _interleaved_chats(engine, drive, tiny_model)
        if policy == "slru":
            assert engine.scheduler.prefix_cache.num_protected_checkpoints == 0
    assert results["slru"] >= results["lru"] > 0


def test_a_reply_checkpoint_hit_twice_is_protected(tiny_model, drive):
    engine = _engine(tiny_model, num_state_checkpoints=8, prefix_cache_policy="slru")
    prefix_cache = engine.scheduler.prefix_cache
    reply, _ = _tokens(engine, drive, PROMPT[:9])
    for follow_up in ([44, 55], [66, 77]):  # two next turns after the same reply (a regenerated answer, a branch)
        assert _tokens(engine, drive, PROMPT[:9] + reply + follow_up)[1] == 9 + len(reply) - 1
    assert prefix_cache.num_protected_checkpoints == 1
    rng = np.random.default_rng(2)
    for _ in range(12):
        _tokens(engine, drive, [int(t) for t in rng.integers(3, 250, 7)])
    context = PROMPT[:9] + reply + [88, 99]
    tokens, cached = _tokens(engine, drive, context)
    assert cached == 9 + len(reply) - 1, "the protected reply checkpoint outlived 24 one-shot entries"
    assert tokens == tiny_model.greedy(context, 6)


@pytest.mark.parametrize("policy", PREFIX_CACHE_POLICIES)
def test_checkpoints_never_exceed_capacity_and_hits_equal_misses(tiny_model, drive, policy):
    """A seeded mix of recurring prefixes, multi-turn extensions and one-shots at a small capacity: every step keeps
    the segments within their sizes (check_integrity in `drive`), and every request's greedy tokens equal those of
    an engine without the cache."""
    engine = _engine(tiny_model, num_state_checkpoints=5, prefix_cache_policy=policy)
    cold = _engine(tiny_model, enable_prefix_caching=False)
    prefix_cache = engine.scheduler.prefix_cache
    rng = np.random.default_rng(3)
    prefixes = [[int(t) for t in rng.integers(3, 250, n)] for n in (6, 9, 13)]
    history: list[list[int]] = []
    total_cached = 0
    for _ in range(30):
        kind = rng.integers(0, 3)
        if kind == 0:
            prompt = prefixes[int(rng.integers(0, 3))] + [int(t) for t in rng.integers(3, 250, 3)]
        elif kind == 1 and history:
            prompt = history[int(rng.integers(0, len(history)))] + [int(t) for t in rng.integers(3, 250, 2)]
        else:
            prompt = [int(t) for t in rng.integers(3, 250, 5)]
        prompt = prompt[-40:]
        tokens, cached = _tokens(engine, drive, prompt)
        total_cached += cached
        assert tokens == _tokens(cold, drive, prompt)[0]
        assert prefix_cache.num_checkpoints <= 5
        assert prefix_cache.num_protected_checkpoints <= (4 if policy == "slru" else 0)
        history.append(prompt + tokens)
    assert total_cached > 0, "the workload must exercise hits"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="prefix_cache_policy"):
        EngineConfig(prefix_cache_policy="lfu")


@pytest.mark.parametrize("budget", [16, 64], ids=["chunked", "one-chunk"])
def test_a_request_waits_for_a_shared_prefix_a_running_one_is_computing(tiny_model, drive, budget):
    """Two requests with a 30-token common prefix arrive together. With prefix_wait_tokens the second waits while
    the first computes the prefix (its chunk stops where the two part, a checkpoint is saved there), then hits it;
    without it both compute the prefix. Tokens equal plain greedy either way."""
    system = PROMPT + PROMPT[:8]  # 30 tokens, not a block multiple
    prompts = [system + [100, 101, 102], system + [110, 111]]
    for wait, want in ((8, 30), (0, 0)):
        engine = _engine(tiny_model, max_batch_tokens=budget, prefix_wait_tokens=wait)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        outs = drive(engine)
        assert outs[ids[0]].num_cached_tokens == 0
        assert outs[ids[1]].num_cached_tokens == want
        for request_id, prompt in zip(ids, prompts):
            assert outs[request_id].outputs[0].token_ids == tiny_model.greedy(prompt, 6)
        assert engine.metrics.snapshot()["prefix_waits"] == (1 if wait else 0)


def test_no_wait_across_tenants_or_for_a_short_gain(tiny_model, drive):
    system = PROMPT + PROMPT[:8]
    engine = _engine(tiny_model, max_batch_tokens=16, prefix_wait_tokens=8)
    a = engine.add_request(system + [100, 101], GREEDY, tenant="a")
    b = engine.add_request(system + [110, 111], GREEDY, tenant="b")  # another tenant: never shares
    outs = drive(engine)
    assert outs[b].num_cached_tokens == 0 and engine.metrics.snapshot()["prefix_waits"] == 0
    engine = _engine(tiny_model, max_batch_tokens=16, prefix_wait_tokens=40)  # more than the 30 shared
    engine.add_request(system + [100, 101], GREEDY)
    second = engine.add_request(system + [110, 111], GREEDY)
    assert drive(engine)[second].num_cached_tokens == 0
    assert a in outs


def test_prefix_wait_tokens_is_checked():
    with pytest.raises(ConfigError):
        EngineConfig(prefix_wait_tokens=-1)
