"""A tenant whose prompts miss the expert cache beside one whose prompts hit: expert cache shares per tenant
(--tenant-cache-shares) and I/O-heavy tenants in steps of their own (--defer-io-heavy). Outputs stay those of the
engine without them, the usage ledger stays exact, and no tenant waits more than one step in a row."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.fairness import IOSeparation
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.loading import load_model
from k3serve.serve.metrics import render_metrics
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions

LIGHT = [7, 8, 9, 10, 11]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heavy_and_light_tenants_alternate_and_neither_waits_more_than_max_wait():
    separation = IOSeparation(max_heavy_tokens=16, clock=_Clock())
    separation.observe("M", 300, 100)  # 3 misses per position
    separation.observe("H", 1, 100)
    waited = {"H": 0, "M": 0}
    for _ in range(20):
        out = separation.left_out({"H": 8, "M": 300})
        assert len(out) == 1  # never both in one step, never a step for nobody
        ran = {"H", "M"} - out
        separation.ran(ran, out)
        for tenant in ("H", "M"):
            waited[tenant] = waited[tenant] + 1 if tenant in out else 0
            assert waited[tenant] <= separation.max_wait
    assert separation.num_separated_steps == 20
    # alone, M's steps are kept short while H had work within hold_s, and not after
    assert separation.left_out({"M": 300}) == set() and separation.step_tokens({"M"}) == 16
    assert separation.step_tokens({"H"}) is None
    separation._clock.now += separation.hold_s + 1
    separation.left_out({"M": 300})
    assert separation.step_tokens({"M"}) is None  # H is gone: M's steps are whole again
    shared = IOSeparation(max_heavy_tokens=16)
    shared.observe("M", 300, 100)
    shared.note_cache_shares({"M": (112, 112)})
    assert shared.left_out({"M": 300}) == set() and shared.step_tokens({"M"}) is None  # no light tenant came
    # tenants that all look alike share steps
    even = IOSeparation()
    even.observe("A", 10, 100)
    even.observe("B", 12, 100)
    assert even.left_out({"A": 5, "B": 500}) == set()


def test_a_start_runs_the_least_work_alone_and_a_newcomer_waits_until_measured():
    start = IOSeparation(max_heavy_tokens=16)
    assert start.left_out({"H": 8, "M": 1024}) == {"M"}  # nobody measured: H's 8 positions first, alone
    start.ran({"H"}, {"M"})
    start.observe("H", 2, 8)  # H's first step
    assert start.left_out({"H": 1, "M": 1024}) == {"H"}  # M, new beside measured H, is heavy and has waited once
    assert start.step_tokens({"M"}) == 16  # and its first step is short while H is around
    start.ran({"M"}, {"H"})
    start.observe("M", 300, 16)
    assert start.left_out({"H": 1, "M": 1008}) == {"M"}


def test_under_shares_only_a_tenant_at_its_share_is_heavy():
    separation = IOSeparation()
    separation.observe("H", 200, 8)  # a cold first request: 25 misses per position
    separation.observe("M", 100, 100)
    assert separation.left_out({"H": 1, "M": 8}) == {"H"}  # by the rates alone, H looks heavy
    separation.note_cache_shares({"H": (40, 224), "M": (112, 112)})
    assert separation.left_out({"H": 1, "M": 8}) == {"M"}  # H is within its share: its misses were cold ones
    separation.note_cache_shares({"H": (224, 224), "M": (112, 112)})
    assert separation.left_out({"H": 1, "M": 8}) == set()  # both at their share: one step for all


def test_the_switches_are_checked():
    with pytest.raises(ConfigError, match="charge='io'"):
        EngineConfig(defer_io_heavy=True, scheduling="fair")
    with pytest.raises(ConfigError, match="charge='io'"):
        EngineConfig(defer_io_heavy=True, charge="io")  # fcfs
    with pytest.raises(ConfigError, match="tenant_cache_hold_s"):
        EngineConfig(tenant_cache_shares=True, tenant_cache_hold_s=-1)
    with pytest.raises(ConfigError, match="io_heavy_step_tokens"):
        EngineConfig(io_heavy_step_tokens=0)
    with pytest.raises(ConfigError, match="max_wait"):
        IOSeparation(max_wait=0)


@pytest.fixture(scope="module")
def streamed(tiny_store):
    budget = minimum_budget_bytes(tiny_store, min_slots=24)
    loaded = load_model(tiny_store.path, stream=StreamOptions(ram_budget=budget, cache="lru", io="pread"))
    yield loaded.model
    loaded.model.source.close()


def _serve(model, drive, **switches):
    """H sends the same short prompt 6 times, M 4 random prompts; returns (engine, outputs by (tenant, i), the
    source's reads, every step's (tenants with work, tenants run))."""
    config = EngineConfig(block_size=4, num_blocks=256, max_seqs=16, max_batch_tokens=24, scheduling="fair",
                          charge="io", **switches)
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(3)
    ids = {}
    for i in range(4):
        prompt = rng.integers(1, 250, 20).tolist()
        ids[engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), tenant="M")] = ("M", i)
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        with_work = {s.request.tenant for s in [*engine.scheduler.running, *engine.scheduler.waiting]}
        decision = schedule()
        steps.append((with_work, {s.seq.request.tenant for s in decision.scheduled}))
        if len(steps) % 3 == 0 and sum(1 for v in ids.values() if v[0] == "H") < 6:
            ids[engine.add_request(LIGHT, SamplingParams(max_tokens=3, ignore_eos=True), tenant="H")] = \
                ("H", sum(1 for v in ids.values() if v[0] == "H"))
        return decision

    engine.scheduler.schedule = recording
    before = model.experts.local_stats()
    finals = drive(engine)
    outputs = {ids[r]: out for r, out in finals.items()}
    return engine, outputs, model.experts.local_stats().minus(before), steps


def test_shares_and_separate_steps_keep_outputs_and_the_ledger_exact_and_starve_no_one(streamed, drive):
    """The same requests with both switches and without: the same tokens, every miss charged to some request,
    per-tenant slot series in /metrics, and (with the switches) I/O-heavy M and light H in separate steps, each
    waiting at most one step in a row."""
    _, plain, _, _ = _serve(streamed, drive)
    engine, isolated, total, steps = _serve(streamed, drive, tenant_cache_shares=True, defer_io_heavy=True,
                                            io_heavy_step_tokens=8)
    assert len(plain) == len(isolated) == 10
    assert {k: o.outputs[0].token_ids for k, o in isolated.items()} == \
        {k: o.outputs[0].token_ids for k, o in plain.items()}
    assert sum(o.expert_misses for o in isolated.values()) == total.expert_misses > 0
    caused = sum(engine.figures.tenant_io_caused.labels(t).value for t in ("H", "M"))
    assert caused == pytest.approx(total.io_wait_seconds)  # the pollution ledger bills every second of waiting
    assert engine.scheduler.io_separation.num_separated_steps > 0
    waited = {"H": 0, "M": 0}
    for with_work, ran in steps:
        for tenant in waited:
            waited[tenant] = waited[tenant] + 1 if tenant in with_work - ran else 0
            assert waited[tenant] <= 1, f"{tenant} waited {waited[tenant]} steps in a row"
    text = render_metrics(engine.metrics)[0].decode()
    assert 'k3serve_tenant_expert_slot_share{tenant="H"}' in text and 'k3serve_tenant_expert_slots{tenant="M"}' in text
    streamed.experts.check_integrity()
