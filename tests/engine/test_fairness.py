"""Scheduling between tenants (engine/fairness.py): VTC's service-gap bound on a randomized workload, admission
order, counter lifting, KV shares, preemption of over-share tenants and of lower priority classes, a randomized
workload under every policy that keeps every pool consistent and every greedy output exact, and step interruption
(arrivals submitted at a pause point of a forward, after a layer's attention or its MLP, run first, with the same
outputs)."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.fairness import FairPolicy, TenantShare, make_policy
from k3serve.engine.request import FinishReason
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.model.interface import MIXER, MLP

COST = 2.0


def _random_requests(rng, count: int) -> list[tuple[list[int], int]]:
    return [([int(t) for t in rng.integers(3, 256, size=int(rng.integers(1, 21)))], int(rng.integers(1, 11)))
            for _ in range(count)]


def _max_service_gap(tiny_model, scheduling: str, weights: dict[str, float], seed: int) -> tuple[float, float]:
    """Both tenants backlogged from the start; returns (largest weighted service gap while both still had queued
    sequences, the VTC bound 2 (L_in + cost M) / min w)."""
    config = EngineConfig(block_size=4, num_blocks=12, max_batch_tokens=24, max_seqs=4, max_model_len=64,
                          enable_prefix_caching=False, scheduling=scheduling, output_cost=COST)
    engine = LLMEngine(tiny_model, config)
    engine.set_tenant_shares({t: TenantShare(weight=w) for t, w in weights.items()})
    rng = np.random.default_rng(seed)
    owner = {}
    prompts = {}
    for tenant in weights:  # tenant "a" queues all of its requests first
        for prompt, max_tokens in _random_requests(rng, 20):
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant)
            owner[rid], prompts[rid] = tenant, len(prompt)
    service = dict.fromkeys(weights, 0.0)
    gap = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tenant = owner[out.request_id]
            new = len(out.outputs[0].new_token_ids)
            if new and len(out.outputs[0].token_ids) == new:  # first token: the prompt was served
                service[tenant] += prompts[out.request_id]
            service[tenant] += COST * new
        engine.check_integrity()
        backlogged = {s.request.tenant for s in engine.scheduler.waiting}
        if backlogged != set(weights):
            break
        a, b = (service[t] / weights[t] for t in weights)
        gap = max(gap, abs(a - b))
    max_input = 20
    capacity = config.num_blocks * config.block_size
    return gap, 2 * (max_input + COST * capacity) / min(weights.values())


@pytest.mark.parametrize("seed, weights", [(0, {"a": 1.0, "b": 1.0}), (1, {"a": 1.0, "b": 2.0})])
def test_vtc_keeps_the_service_gap_of_backlogged_tenants_bounded(tiny_model, seed, weights):
    gap, bound = _max_service_gap(tiny_model, "fair", weights, seed)
    assert gap <= bound, f"weighted service gap {gap} exceeds VTC's bound {bound}"
    unfair, _ = _max_service_gap(tiny_model, "fcfs", weights, seed)
    assert unfair > bound, "the workload does not separate FCFS from VTC: the bound test would prove nothing"


def test_fair_admits_a_newcomer_before_the_flooding_tenants_backlog(tiny_model):
    first_token_step = {}
    for scheduling in ("fcfs", "fair"):
        config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=16, max_seqs=2, max_model_len=64,
                              enable_prefix_caching=False, scheduling=scheduling)
        engine = LLMEngine(tiny_model, config)
        for i in range(6):
            engine.add_request(list(range(3 + i, 15 + i)), SamplingParams(max_tokens=4, ignore_eos=True),
                               tenant="flood")
        engine.step()
        light = engine.add_request([7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True), tenant="light")
        step = 1
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.request_id == light and out.outputs[0].token_ids and scheduling not in first_token_step:
                    first_token_step[scheduling] = step
            engine.check_integrity()
    assert first_token_step["fair"] < first_token_step["fcfs"] - 3, first_token_step


def test_a_tenant_that_becomes_active_is_lifted_to_the_smallest_active_counter():
    policy = make_policy("fair")
    assert isinstance(policy, FairPolicy)
    policy.charge_prompt("a", 100)
    policy.charge_prompt("b", 40)
    policy.activate("c", {"a", "b"})  # idle newcomer: no banked credit
    assert policy.counter("c") == 40
    policy.charge_output("c", 10)  # cost 2 per output token
    assert policy.counter("c") == 60
    policy.activate("a", {"b", "c"})  # already above the floor: unchanged
    assert policy.counter("a") == 100
    policy.activate("d", set())  # nobody active: the largest counter
    assert policy.counter("d") == 100
    policy.set_shares({"e": TenantShare(weight=4.0)})
    policy.charge_prompt("e", 100)
    assert policy.counter("e") == 25


def test_bad_policy_and_share_values_are_refused():
    with pytest.raises(ConfigError, match="scheduling"):
        EngineConfig(scheduling="lottery")
    with pytest.raises(ConfigError, match="weight"):
        TenantShare(weight=0)
    with pytest.raises(ConfigError, match="kv_share"):
        TenantShare(kv_share=1.5)


def test_a_tenant_at_its_share_waits_while_others_are_admitted(tiny_model, drive):
    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=64, max_seqs=4, max_model_len=64,
                          scheduling="fair")
    engine = LLMEngine(tiny_model, config)
    engine.set_tenant_shares({"capped": TenantShare(kv_share=0.5)})
    for i in range(4):
        engine.add_request(list(range(3 + i, 9 + i)), SamplingParams(max_tokens=6, ignore_eos=True), tenant="capped")
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        most = max(most, sum(s.request.tenant == "capped" for s in engine.scheduler.running))
    assert most == 2  # half of the 4 seats, although the other seats stayed idle


def test_under_memory_pressure_the_tenant_over_its_share_is_preempted_first(tiny_model):
    preempted = {}
    for shares in ({}, {"big": TenantShare(kv_share=0.5)}):
        config = EngineConfig(block_size=4, num_blocks=10, max_batch_tokens=32, max_seqs=4, max_model_len=40,
                              scheduling="fair", admission_watermark=0.0)
        engine = LLMEngine(tiny_model, config)
        engine.set_tenant_shares(shares)
        big = engine.add_request(list(range(3, 11)), SamplingParams(max_tokens=18, ignore_eos=True), tenant="big")
        for _ in range(12):  # "big" alone grows to 20 positions, 5 blocks: over half the pool
            engine.step()
        small = engine.add_request(list(range(30, 38)), SamplingParams(max_tokens=14, ignore_eos=True),
                                   tenant="small")
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            engine.check_integrity()
        assert final[big].outputs[0].token_ids == _greedy(tiny_model, range(3, 11), 18)
        assert final[small].outputs[0].token_ids == _greedy(tiny_model, range(30, 38), 14)
        preempted[bool(shares)] = _preemptions_by_tenant(engine)
    assert preempted[False]["small"] > 0 and preempted[False].get("big", 0) == 0  # newest first without shares
    assert preempted[True]["big"] > 0 and preempted[True].get("small", 0) == 0  # the over-share tenant first


_GREEDY: dict[tuple, list[int]] = {}


def _greedy(model, prompt, num_tokens: int) -> list[int]:
    key = (tuple(prompt), num_tokens)
    if key not in _GREEDY:
        _GREEDY[key] = model.greedy(list(prompt), num_tokens)
    return _GREEDY[key]


def _preemptions_by_tenant(engine: LLMEngine) -> dict[str, int]:
    return dict(engine.scheduler.preemptions_by_tenant)


def test_a_higher_priority_class_preempts_a_lower_one(tiny_model):
    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=32, max_seqs=2, max_model_len=64,
                          scheduling="priority")
    engine = LLMEngine(tiny_model, config)
    engine.set_tenant_shares({"batch": TenantShare(priority=0), "interactive": TenantShare(priority=10)})
    low = [engine.add_request(list(range(3 + i, 10 + i)), SamplingParams(max_tokens=20, ignore_eos=True),
                              tenant="batch") for i in range(2)]
    for _ in range(3):
        engine.step()
    high = engine.add_request([40, 41, 42], SamplingParams(max_tokens=3, ignore_eos=True), tenant="interactive")
    final, order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
                order.append(out.request_id)
        engine.check_integrity()
    assert order[0] == high  # it did not wait for a seat
    assert _preemptions_by_tenant(engine) == {"batch": 1}
    for i, rid in enumerate(low):
        assert final[rid].outputs[0].finish_reason is FinishReason.LENGTH
        assert final[rid].outputs[0].token_ids == _greedy(tiny_model, range(3 + i, 10 + i), 20)


@pytest.mark.parametrize("scheduling", ["fair", "priority"])
def test_random_multi_tenant_workload_stays_consistent_and_exact(tiny_model, scheduling):
    config = EngineConfig(block_size=4, num_blocks=20, max_batch_tokens=16, max_seqs=5, max_model_len=80,
                          num_state_checkpoints=6, scheduling=scheduling)
    engine = LLMEngine(tiny_model, config)
    engine.set_tenant_shares({"a": TenantShare(weight=2.0, priority=1, kv_share=0.5),
                              "b": TenantShare(weight=1.0, priority=0, kv_share=0.75)})
    rng = np.random.default_rng(7)
    plan = []
    for i in range(16):
        prompt = [int(t) for t in rng.integers(3, 256, size=int(rng.integers(2, 24)))]
        params = SamplingParams(max_tokens=int(rng.integers(1, 10)), ignore_eos=True,
                                n=2 if rng.random() < 0.15 else 1)
        plan.append((int(rng.integers(0, 20)), prompt, params, "abc"[int(rng.integers(0, 3))],
                     int(rng.integers(1, 10)) if rng.random() < 0.15 else None))
    ids, final, step = {}, {}, 0
    while step < 20 or engine.has_unfinished_requests():
        for i, (arrival, prompt, params, tenant, abort_after) in enumerate(plan):
            if arrival == step:
                ids[i] = engine.add_request(prompt, params, tenant=tenant)
            if abort_after is not None and arrival + abort_after == step:
                engine.abort(ids[i])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
        step += 1
        assert step < 3000, "the workload does not drain"
    assert len(final) == len(plan)
    assert engine.metrics.snapshot()["preemptions"] > 0, "the pool was meant to be too small"
    for i, (_, prompt, params, _, _) in enumerate(plan):
        for completion in final[ids[i]].outputs:
            if completion.finish_reason is FinishReason.ABORT:
                continue
            assert completion.token_ids == _greedy(tiny_model, prompt, params.max_tokens)
    assert engine.scheduler.blocks.num_used_blocks == 0 and engine.scheduler.states.num_used_slots == 0


def test_per_tenant_metrics(tiny_model, drive):
    from k3serve.serve.metrics import render_metrics

    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=32, max_model_len=64, scheduling="fair"))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), tenant="alice")
    engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True), tenant="bob")
    engine.step()
    drive(engine)
    snap = engine.metrics.snapshot()
    assert snap["tenant_requests"] == {"alice": 1.0, "bob": 1.0}
    assert snap["tenant_prompt_tokens"] == {"alice": 3.0, "bob": 2.0}
    assert snap["tenant_generation_tokens"] == {"alice": 3.0, "bob": 2.0}
    assert snap["tenant_ttft_seconds"]["alice"]["count"] == 1
    assert snap["tenant_queue_seconds"]["bob"]["count"] == 1
    assert snap["tenant_virtual_counter"]["alice"] == pytest.approx(3 + COST * 3)  # prompt, then 3 outputs
    text = render_metrics(engine.metrics)[0].decode()
    assert 'k3serve_tenant_requests_total{tenant="alice"} 1.0' in text
    assert 'k3serve_tenant_ttft_seconds_bucket{le="+Inf",tenant="bob"} 1.0' in text


def test_which_arrivals_may_interrupt_a_forward():
    fair = make_policy("fair")
    fair.charge_prompt("flood", 500)
    fair.activate("light", {"flood"})  # lifted to the flood's counter: a tie goes first
    assert fair.interrupts("light", {"flood"})
    assert fair.interrupts("light", {"flood", "light"})  # its own sequences in flight do not count
    assert not fair.interrupts("light", {"light"}) and not fair.interrupts("light", set())  # nobody to pass
    fair.charge_prompt("light", 1)
    assert not fair.interrupts("light", {"flood"})  # now ranked behind
    assert not make_policy("fcfs").interrupts("light", {"flood"})
    priority = make_policy("priority")
    priority.set_shares({"low": TenantShare(priority=0), "high": TenantShare(priority=1)})
    priority.charge_prompt("high", 1000)
    assert priority.interrupts("high", {"low"}) and not priority.interrupts("low", {"high"})


def _interrupted_workload(tiny_model, scheduling: str, seed: int) -> tuple[LLMEngine, dict, list, set]:
    """Requests of three tenants submitted at pause points of forwards in flight (after a layer's attention or its
    MLP), as a server thread would, in a pool small enough to preempt; integrity checked after every step. Returns
    the engine, the final outputs, the plan and the parts of a layer at which a forward was interrupted."""
    config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=20, max_seqs=5, max_model_len=80,
                          num_state_checkpoints=6, scheduling=scheduling, step_interruption=True)
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(24):
        prompt = [int(t) for t in rng.integers(3, 256, size=int(rng.integers(2, 24)))]
        params = SamplingParams(max_tokens=int(rng.integers(1, 10)), ignore_eos=True,
                                n=2 if rng.random() < 0.15 else 1)
        plan.append((int(rng.integers(1, 240)), prompt, params, "abc"[int(rng.integers(0, 3))]))
    pauses = [0]
    ids: dict[int, str] = {}
    end = (tiny_model.config.num_layers - 1, MLP)  # the engine's call at the end of every forward
    last = [end]
    interrupted_after: set[str] = set()

    def on_pause(num_positions: int, layer: int, part: str) -> None:
        if (layer, part) == (0, MIXER) and last[0] != end:  # a forward began inside another: interrupted there
            interrupted_after.add(last[0][1])
        last[0] = (layer, part)
        pauses[0] += 1
        for i, (arrival, prompt, params, tenant) in enumerate(plan):
            if arrival == pauses[0]:
                ids[i] = engine.add_request(prompt, params, tenant=tenant)

    engine = LLMEngine(tiny_model, config, on_pause=on_pause)
    engine.set_tenant_shares({"a": TenantShare(weight=2.0, priority=1), "b": TenantShare(weight=1.0)})
    final = {}
    engine.add_request(list(range(3, 27)), SamplingParams(max_tokens=30, ignore_eos=True), tenant="a")
    steps = 0
    while len(ids) < len(plan) or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            on_pause(0, *end)  # idle: time passes without forwards
        steps += 1
        assert steps < 3000, "the workload does not drain"
    return engine, final, [(ids[i], prompt, params) for i, (_, prompt, params, _) in enumerate(plan)], \
        interrupted_after


@pytest.mark.parametrize("scheduling, seed", [("fair", 0), ("priority", 5)])
def test_interrupted_forwards_keep_every_output_exact(tiny_model, scheduling, seed):
    engine, final, plan, interrupted_after = _interrupted_workload(tiny_model, scheduling, seed)
    snap = engine.metrics.snapshot()
    assert interrupted_after == {MIXER, MLP}, "forwards must be interrupted inside layers and between them"
    assert snap["preemptions"] > 0, "the pool was meant to be too small"
    assert len(final) == len(plan) + 1
    for rid, prompt, params in plan:
        for completion in final[rid].outputs:
            assert completion.token_ids == _greedy(tiny_model, prompt, params.max_tokens)
    assert engine.scheduler.blocks.num_used_blocks == 0 and engine.scheduler.states.num_used_slots == 0


def test_fcfs_never_interrupts_and_unsupported_models_are_refused(tiny_model, tiny_dir):
    from k3serve.model.k3 import K3Model
    from k3serve.stream.trace import TracedSource

    engine, final, plan, _ = _interrupted_workload(tiny_model, "fcfs", 3)
    assert engine.metrics.snapshot()["step_interruptions"] == 0 and len(final) == len(plan) + 1
    traced = K3Model(TracedSource(tiny_model.source, None))  # a step-by-step recorder cannot nest forwards
    with pytest.raises(ConfigError, match="step_interruption"):
        LLMEngine(traced, EngineConfig(scheduling="fair", step_interruption=True))


def test_auto_step_interruption_is_on_under_a_ranked_policy_where_the_model_can_nest(tiny_model):
    from k3serve.model.k3 import K3Model
    from k3serve.stream.trace import TracedSource

    def resolved(model, scheduling: str) -> bool:
        return LLMEngine(model, EngineConfig(scheduling=scheduling, step_interruption="auto")).config.step_interruption

    traced = K3Model(TracedSource(tiny_model.source, None))  # cannot nest: auto turns it off, no error
    assert resolved(tiny_model, "fair") is True and resolved(tiny_model, "priority") is True
    assert resolved(tiny_model, "fcfs") is False and resolved(traced, "fair") is False
    with pytest.raises(ConfigError, match="step_interruption must be true, false or 'auto'"):
        EngineConfig(step_interruption="sometimes")

