"""Hybrid prefix caching: a hit (MLA blocks + a KDA checkpoint at exactly that position) gives the same logits and
tokens as a miss; multi-turn, branch points, tenant isolation, the block-aligned mode's warning, eviction."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.prefix_cache import root_hash
from k3serve.engine.sampling import SamplingParams
from k3serve.model.k3 import ForwardItem

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


def test_tenants_and_salts_never_share_entries(tiny_model, drive):
    engine = _engine(tiny_model)
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
    engine = _engine(tiny_model, num_state_checkpoints=2)
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
