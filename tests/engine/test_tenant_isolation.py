"""Prefix-cache isolation between tenants: a tenant never restores another tenant's MLA blocks or KDA checkpoints,
and another tenant's earlier prompt changes nothing in the work (hence the time) that yours costs."""

from __future__ import annotations

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams

PROMPT = [5, 9, 14, 3, 77, 120, 8, 8, 31, 64, 200, 12, 7, 19, 44, 90, 101, 6]  # 18 tokens: 4 full blocks + 2
QUERY = PROMPT + [50, 51]  # extends PROMPT, whose end alice's first request checkpointed
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _engine(tiny_model) -> LLMEngine:
    return LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8, max_model_len=64,
                                              num_state_checkpoints=8, scheduling="fair"))


def _run(engine: LLMEngine, prompt: list[int], tenant: str) -> dict:
    """Run one request alone; returns what its cost is made of: the batch sizes of its steps, the positions
    computed, the steps to its first token, the cache hits, and its tokens."""
    snap = engine.metrics.snapshot()
    request_id = engine.add_request(prompt, PARAMS, tenant=tenant)
    batches, first_token_step, final = [], None, None
    while engine.has_unfinished_requests():
        before = engine.metrics.counter("computed_tokens").value
        for out in engine.step():
            if first_token_step is None and out.outputs[0].token_ids:
                first_token_step = len(batches)
            if out.finished:
                final = out
        batches.append(engine.metrics.counter("computed_tokens").value - before)
        engine.check_integrity()
    after = engine.metrics.snapshot()
    return {"batches": batches, "first_token_step": first_token_step,
            "computed": after["computed_tokens"] - snap["computed_tokens"],
            "hit_tokens": after["prefix_cache_hit_tokens"] - snap["prefix_cache_hit_tokens"],
            "hits": after["prefix_cache_hits"] - snap["prefix_cache_hits"],
            "cached_tokens": final.num_cached_tokens, "tokens": final.outputs[0].token_ids}


def test_a_tenant_never_hits_another_tenants_blocks_or_checkpoints(tiny_model):
    engine = _engine(tiny_model)
    _run(engine, PROMPT, "alice")
    assert engine.scheduler.prefix_cache.num_checkpoints > 0 and engine.scheduler.blocks.num_cached_blocks >= 4
    bob = _run(engine, QUERY, "bob")
    assert bob["hits"] == 0 and bob["hit_tokens"] == 0 and bob["cached_tokens"] == 0
    assert bob["computed"] == len(QUERY) + PARAMS.max_tokens - 1  # every position computed again
    alice = _run(engine, QUERY, "alice")  # alice's entries were there all along: she hits them
    assert alice["hits"] == 1 and alice["cached_tokens"] == len(PROMPT) and alice["tokens"] == bob["tokens"]


def test_another_tenants_prompt_does_not_make_yours_faster(tiny_model):
    """Timing side channel: the schedule of bob's request (steps, batch sizes, positions computed, steps to the
    first token) is identical whether alice sent the same prompt before or a different one, so no clock can tell
    them apart. The same measure does show alice's own repeat getting cheaper, so it would catch a shared hit."""
    other = [t + 1 for t in PROMPT]
    primed, unprimed = _engine(tiny_model), _engine(tiny_model)
    _run(primed, PROMPT, "alice")
    _run(unprimed, other, "alice")
    bob_after_same = _run(primed, QUERY, "bob")
    bob_after_other = _run(unprimed, QUERY, "bob")
    for key in ("batches", "first_token_step", "computed", "tokens"):
        assert bob_after_same[key] == bob_after_other[key], key
    alice_again = _run(primed, QUERY, "alice")
    assert alice_again["computed"] < bob_after_same["computed"]
    assert alice_again["first_token_step"] < bob_after_same["first_token_step"]
