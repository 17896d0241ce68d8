"""Scheduling under pressure: a randomized workload on a tiny block pool, with preemption, cancellation, n > 1
forks and shared prefixes. Every pool passes check_integrity() after every step, nothing leaks, and greedy requests
still produce exactly the tokens of a plain greedy loop."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.request import FinishReason
from k3serve.engine.sampling import SamplingParams


@pytest.mark.parametrize("seed, partial_blocks", [(0, True), (1, False)])
def test_random_workload_with_preemption_and_aborts(tiny_model, seed, partial_blocks):
    config = EngineConfig(block_size=4, num_blocks=20, max_batch_tokens=16, max_seqs=6, max_model_len=80,
                          num_state_checkpoints=6, checkpoint_partial_blocks=partial_blocks)
    engine = LLMEngine(tiny_model, config)
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, 256, size=10)]
    plan = []  # (arrival step, prompt, params, abort step or None)
    for i in range(28):
        own = [int(t) for t in rng.integers(3, 256, size=int(rng.integers(2, 26)))]
        prompt = (shared + own) if rng.random() < 0.5 else own
        greedy = rng.random() < 0.5
        params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=None if greedy else i,
                                max_tokens=int(rng.integers(1, 15)), ignore_eos=True,
                                n=2 if rng.random() < 0.15 else 1)
        arrival = int(rng.integers(0, 40))
        abort = arrival + int(rng.integers(0, 12)) if rng.random() < 0.2 else None
        plan.append((arrival, prompt, params, abort))
    ids: dict[int, str] = {}
    final = {}
    step = 0
    while step < 40 or engine.has_unfinished_requests():
        for i, (arrival, prompt, params, abort) in enumerate(plan):
            if arrival == step:
                ids[i] = engine.add_request(prompt, params)
            if abort == step and i in ids:
                engine.abort(ids[i])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        engine.check_integrity()
        step += 1
        assert step < 2000, "the workload does not drain"
    assert len(final) == len(plan)
    metrics = engine.metrics.snapshot()
    assert metrics["preemptions"] > 0, "the pool was meant to be too small"
    assert metrics["requests_finished_abort"] > 0
    for i, (_, prompt, params, abort) in enumerate(plan):
        out = final[ids[i]]
        assert len(out.outputs) == params.n
        for completion in out.outputs:
            if completion.finish_reason is FinishReason.ABORT:
                assert abort is not None
                continue
            assert completion.finish_reason is FinishReason.LENGTH
            assert len(completion.token_ids) == params.max_tokens
            if params.greedy:
                assert completion.token_ids == tiny_model.greedy(prompt, params.max_tokens)
    scheduler = engine.scheduler
    assert scheduler.blocks.num_used_blocks == 0 and scheduler.states.num_used_slots == 0
    scheduler.prefix_cache.clear()
    scheduler.check_integrity()
    assert scheduler.blocks.num_free_blocks == config.num_blocks and scheduler.prefix_cache.num_checkpoints == 0


def test_preempted_sequence_resumes_from_its_checkpoint(tiny_model, drive):
    """Preemption offers the sequence's KDA state to the prefix cache; re-admission restores it, so recompute
    costs fewer positions than without the cache, and the tokens are unchanged."""
    computed = {}
    for caching in (True, False):
        config = EngineConfig(block_size=4, num_blocks=15, max_batch_tokens=64, max_seqs=2, max_model_len=60,
                              enable_prefix_caching=caching)
        engine = LLMEngine(tiny_model, config)
        first = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=14, ignore_eos=True))
        second = engine.add_request(list(range(30, 45)), SamplingParams(max_tokens=20, ignore_eos=True))
        final = drive(engine)
        metrics = engine.metrics.snapshot()
        assert metrics["preemptions"] >= 1
        assert final[first].outputs[0].token_ids == tiny_model.greedy(list(range(3, 23)), 14)
        assert final[second].outputs[0].token_ids == tiny_model.greedy(list(range(30, 45)), 20)
        computed[caching] = metrics["computed_tokens"]
        if caching:
            assert metrics["prefix_cache_hits"] >= 1
    no_preemption = 20 + 15 + 13 + 19
    assert computed[True] == no_preemption < computed[False], "restored at the preemption point, nothing redone"
