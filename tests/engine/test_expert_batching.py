"""Decode batches chosen by shared experts: the greedy rule against its set-based twin, the rank tiers, the
starved and the unknown forced in; in the engine, the starvation bound, the fairness tiers, identical greedy
outputs with and without the flag, and fewer experts read per step on a streamed model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.expert_batching import (Candidate, PredictionQuality, choose_by_experts,
                                            choose_by_experts_reference, union_size)
from k3serve.engine.fairness import TenantShare
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.loading import load_model
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions


def _random_candidates(rng: np.random.Generator, n: int, num_layers: int, top_k: int, num_experts: int,
                       num_ranks: int = 1) -> list[Candidate]:
    out = []
    for _ in range(n):
        predicted = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers)])
        if rng.random() < 0.1:
            predicted[0, -1] = -1  # a dropped slot (--expert-top-p)
        unknown = rng.random() < 0.1
        out.append(Candidate(None if unknown else predicted, (int(rng.integers(num_ranks)),) if num_ranks > 1
                             else (), starved=bool(rng.random() < 0.1)))
    order = sorted(range(n), key=lambda i: out[i].rank)  # the policy's order: rank first
    return [out[i] for i in order]


@pytest.mark.parametrize("seed", range(40))
def test_greedy_matches_its_twin(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 20)), int(rng.integers(1, 9))
    candidates = _random_candidates(rng, n, int(rng.integers(1, 4)), int(rng.integers(1, 4)),
                                    int(rng.integers(4, 12)), num_ranks=int(rng.integers(1, 4)))
    chosen = choose_by_experts(candidates, k)
    assert chosen == choose_by_experts_reference(candidates, k)
    assert len(chosen) == min(n, k) and len(set(chosen)) == len(chosen)


def test_greedy_picks_the_overlapping_cluster_and_beats_the_baseline():
    # two clusters of experts; the baseline (first 4) mixes them, the rule takes the 4 that share experts
    a, b = np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])
    predicted = [a, b, a, b, a, b, a]
    candidates = [Candidate(p) for p in predicted]
    chosen = choose_by_experts(candidates, 4)
    assert chosen == [0, 2, 4, 6]
    assert union_size([predicted[i] for i in chosen]) == 4 < union_size(predicted[:4]) == 8
    # on small cases the greedy union is never above the baseline's and close to the best subset's
    rng = np.random.default_rng(7)
    for _ in range(20):
        cands = _random_candidates(rng, 8, 2, 2, 6)
        cands = [Candidate(c.predicted if c.predicted is not None else np.array([[0, 1], [0, 1]])) for c in cands]
        greedy = union_size([cands[i].predicted for i in choose_by_experts(cands, 4)])
        best = min(union_size([cands[i].predicted for i in subset]) for subset in itertools.combinations(range(8), 4))
        assert best <= greedy <= best + 2


def test_starved_and_unknown_go_first_then_the_rank_tiers():
    x, y = np.array([[0, 1]]), np.array([[2, 3]])
    candidates = [Candidate(x, (0,)), Candidate(y, (0,)), Candidate(x, (1,)), Candidate(y, (1,), starved=True),
                  Candidate(None, (1,)), Candidate(x, (1,))]
    # forced: the starved (3) and the unknown (4); the better tier (0, 1) whole; then nothing left of 4 seats
    assert choose_by_experts(candidates, 4) == [0, 1, 3, 4]
    # 5 seats: in the open tier (rank 1) both 2 and 5 add nothing to the union (x is in): the earlier, 2
    assert choose_by_experts(candidates, 5) == [0, 1, 2, 3, 4]
    # a worse tier never goes before a better one: 1 seat among two tiers takes from rank 0
    assert choose_by_experts([Candidate(y, (1,)), Candidate(x, (0,))][::-1], 1) == [0]


def test_prediction_quality_counts_the_overlap_of_consecutive_steps():
    quality = PredictionQuality()
    quality.observe(np.array([[0, 1, 2], [3, 4, 5]]), np.array([[0, 1, 7], [8, 9, -1]]))
    assert (quality.hits, quality.pairs) == (2, 5) and quality.overlap == pytest.approx(0.4)


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="max_decode_seqs"):
        EngineConfig(max_decode_seqs=0)
    with pytest.raises(ConfigError, match="batch_by_experts_max_wait"):
        EngineConfig(batch_by_experts_max_wait=-1)
    with pytest.raises(ConfigError, match="batch_by_experts"):
        EngineConfig(batch_by_experts="yes")
    with pytest.raises(ConfigError, match="needs max_decode_seqs"):
        EngineConfig(batch_by_experts=True)


# ---- in the engine, on a streamed tiny model ---------------------------------------------------------------------
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, 250, 5 + i % 4)] for i in range(10)]


@pytest.fixture(scope="module")
def streamed(tiny_store):
    loaded = load_model(tiny_store.path, stream=StreamOptions(ram_budget=minimum_budget_bytes(tiny_store),
                                                              cache="lru", io="pread"))
    yield loaded.model
    loaded.model.source.close()


def _serve(model, config: EngineConfig, tenants: list[str] | None = None, shares=None, max_tokens: int = 6):
    """Run the prompts; per request its tokens, and per step the decodes it ran, the expert pairs the step's
    routing needed and the sequences left out."""
    engine = LLMEngine(model, config, stop_ids=())
    if shares:
        engine.set_tenant_shares(shares)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              tenant=tenants[i] if tenants else "default") for i, p in enumerate(PROMPTS)]
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        ready = [s for s in engine.scheduler.running if s.num_uncomputed_tokens == 1]
        waits = {s.seq_id: s.num_passed_over for s in ready}
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        reads = model.experts.step_reads()
        steps.append((ready, waits, sum(len(np.unique(r[r >= 0])) for r in reads.routing.values())))
    return engine, [tokens[i] for i in ids], steps


BASE = dict(block_size=4, num_blocks=256, max_seqs=10, max_decode_seqs=3)


def test_outputs_are_the_same_with_and_without_the_flag(streamed):
    _, plain, _ = _serve(streamed, EngineConfig(**BASE))
    engine, by_experts, _ = _serve(streamed, EngineConfig(**BASE, batch_by_experts=True))
    _, unlimited, _ = _serve(streamed, EngineConfig(block_size=4, num_blocks=256, max_seqs=10))
    assert by_experts == plain == unlimited
    assert engine.prediction_quality.pairs > 0 and 0 <= engine.prediction_quality.overlap <= 1


@pytest.mark.parametrize("max_wait", [0, 1, 3])
def test_no_decode_is_passed_over_more_than_max_wait_steps(streamed, max_wait):
    engine, _, steps = _serve(streamed, EngineConfig(**BASE, batch_by_experts=True,
                                                     batch_by_experts_max_wait=max_wait), max_tokens=10)
    worst = max(max(waits.values(), default=0) for _, waits, _ in steps)
    assert worst <= max_wait
    if max_wait:  # the bound was reached: the rule did pass decodes over
        assert worst == max_wait
    if max_wait == 0:  # no deviation allowed: the baseline's batches
        _, _, plain = _serve(streamed, EngineConfig(**BASE), max_tokens=10)
        assert [u for *_, u in steps] == [u for *_, u in plain]


def test_the_flag_reads_fewer_expert_pairs_per_step_than_the_baseline(streamed):
    _, _, plain = _serve(streamed, EngineConfig(**BASE), max_tokens=10)
    _, _, by_experts = _serve(streamed, EngineConfig(**BASE, batch_by_experts=True, batch_by_experts_max_wait=8),
                              max_tokens=10)
    assert sum(u for *_, u in by_experts) < sum(u for *_, u in plain)


def test_a_better_ranked_tenant_is_never_left_out_for_a_worse_one(streamed):
    tenants = ["a" if i % 2 else "b" for i in range(len(PROMPTS))]
    config = EngineConfig(**BASE, scheduling="fair", batch_by_experts=True, batch_by_experts_max_wait=100)
    engine = LLMEngine(streamed, config, stop_ids=())
    engine.set_tenant_shares({"a": TenantShare(weight=4.0), "b": TenantShare(weight=1.0)})
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True), tenant=tenants[i])
    scheduler, policy = engine.scheduler, engine.scheduler.policy
    schedule = scheduler.schedule
    checked = []

    def watched():
        ready = [s for s in scheduler.running if s.num_uncomputed_tokens == 1]
        ranks = {s.seq_id: policy.rank(s.request.tenant) for s in ready}
        decision = schedule()
        ran = {s.seq.seq_id for s in decision.scheduled if s.seq.seq_id in ranks}
        left = set(ranks) - ran
        if ran and left:
            assert max(ranks[i] for i in ran) <= min(ranks[i] for i in left)
            checked.append(len(left))
        return decision

    scheduler.schedule = watched
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert checked


def _batches(model, config: EngineConfig) -> list[list[int]]:
    """The ready decodes each step ran (by seq_id), and the engine checked after every step."""
    engine = LLMEngine(model, config, stop_ids=())
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True))
    schedule, batches = engine.scheduler.schedule, []

    def watched():
        decision = schedule()
        batches.append(sorted(s.seq.seq_id for s in decision.scheduled if s.num_new_tokens == 1))
        return decision

    engine.scheduler.schedule = watched
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    return batches


def test_without_step_routing_the_flag_keeps_the_default_order(tiny_model):
    # resident experts record no routing: every prediction is unknown, and the unknown go in order
    assert _batches(tiny_model, EngineConfig(**BASE, batch_by_experts=True)) == _batches(tiny_model, EngineConfig(**BASE))
