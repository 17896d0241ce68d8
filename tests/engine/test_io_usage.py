"""Disk reads charged to the requests that caused them: each step's bytes, expert misses and I/O wait split by the
sequences' shares of its tokens, summing to the source's totals; per-tenant series; `charge='io'` advances the
virtual counter by disk seconds."""

from __future__ import annotations

import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.fairness import make_policy
from k3serve.engine.io_usage import PollutionLedger, split_step
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.loading import load_model
import numpy as np

from k3serve.model.expert_source import StepReads, StreamStats
from k3serve.serve.metrics import render_metrics
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions

PROMPTS = {"a": [1, 5, 9, 200, 17, 33, 4, 90, 12], "b": [250, 3, 3, 71, 8], "c": [42, 43, 44, 45, 46, 47, 48]}


@pytest.mark.parametrize("tokens", [[1], [3, 1, 1], [2000, 1, 1, 1], [7, 0, 5], [1, 1, 1]])
def test_a_steps_reads_are_split_by_token_share_and_sum_exactly(tokens):
    step = StreamStats(expert_bytes_read=1_000_003, trunk_bytes_read=17, expert_misses=11, io_wait_seconds=0.3)
    shares = split_step(step, tokens)
    assert sum(s.bytes_read for s in shares) == step.bytes_read
    assert sum(s.expert_misses for s in shares) == step.expert_misses
    assert sum(s.io_wait_seconds for s in shares) == pytest.approx(step.io_wait_seconds)
    for share, n in zip(shares, tokens):
        assert abs(share.bytes_read - step.bytes_read * n / sum(tokens)) < 1
        assert abs(share.expert_misses - step.expert_misses * n / sum(tokens)) < 1


def test_a_miss_is_charged_to_the_tokens_routed_to_its_expert():
    """Sequence 0 (3 tokens) alone routes to expert 5; one token of each routes to expert 7; sequence 2 (2 tokens)
    routes to resident experts only and pays none of the misses, only its token share of the trunk bytes."""
    routing = np.array([[5, 1], [5, 7], [2, 5], [7, 1], [3, 1], [1, 2], [3, 2]])  # [T=7, TOPK=2]
    reads = StepReads([(4, 5, 8192, ()), (4, 7, 8192, ())], {4: routing})
    step = StreamStats(expert_bytes_read=2 * 8192, trunk_bytes_read=700, expert_misses=2, io_wait_seconds=0.2)
    a, b, c = split_step(step, [3, 2, 2], reads)
    # misses: a 1 + 1/2, b 1/2, c 0; bytes: 12288 + 300, 4096 + 200, 0 + 200
    assert (a.expert_misses, b.expert_misses, c.expert_misses) == (2, 0, 0)
    assert (a.bytes_read, b.bytes_read, c.bytes_read) == (12288 + 300, 4096 + 200, 200)
    assert a.io_wait_seconds + b.io_wait_seconds + c.io_wait_seconds == pytest.approx(0.2)
    assert c.io_wait_seconds == pytest.approx(0.2 * 200 / (2 * 8192 + 700))


def test_without_the_routing_a_step_is_charged_by_token_share():
    step = StreamStats(expert_bytes_read=8192, expert_misses=1, io_wait_seconds=0.1)
    reads = StepReads([(4, 5, 8192, ())], {})  # the layer's routing was not recorded
    assert [s.bytes_read for s in split_step(step, [1, 3], reads)] == [2048, 6144]


def test_charge_io_bills_a_miss_on_an_expert_another_tenant_evicted_to_that_tenant():
    ledger = PollutionLedger()
    # step 1: M's tokens load expert 5 of layer 4, whose slot held H's expert 9 (evicted); a cold miss: M's
    step = StreamStats(expert_bytes_read=8192, trunk_bytes_read=8192, expert_misses=1, io_wait_seconds=0.2)
    reads = StepReads([(4, 5, 8192, ((4, 9),))], {4: np.array([[5, 1], [2, 3]])})
    assert ledger.causes(step, reads, [1, 1], ["M", "H"]) == pytest.approx({"M": 0.1 + 0.05, "H": 0.05})
    # step 2: H alone misses expert 9 again (evicting expert 1): M's read caused it, M pays the miss's share
    reads = StepReads([(4, 9, 8192, ((4, 1),))], {4: np.array([[9, 2]])})
    assert ledger.causes(step, reads, [1], ["H"]) == pytest.approx({"M": 0.1, "H": 0.1})
    # step 3: H misses expert 1, which H's own read evicted: H's; the ledger forgets what it billed
    reads = StepReads([(4, 1, 8192, ())], {4: np.array([[1, 2]])})
    assert ledger.causes(step, reads, [1], ["H"]) == pytest.approx({"H": 0.2})
    assert len(ledger) == 0


@pytest.fixture(scope="module")
def streamed(tiny_store):
    loaded = load_model(tiny_store.path, stream=StreamOptions(ram_budget=minimum_budget_bytes(tiny_store),
                                                              cache="lru", io="pread"))
    yield loaded.model
    loaded.model.source.close()


def _serve(model, config: EngineConfig, drive):
    engine = LLMEngine(model, config)
    before = model.experts.local_stats()
    ids = {engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), tenant=tenant): tenant
           for tenant, prompt in PROMPTS.items()}
    finals = drive(engine)
    return engine, {ids[r]: out for r, out in finals.items()}, model.experts.local_stats().minus(before)


def test_usage_fields_sum_to_the_sources_reads(streamed, tiny_store, drive):
    engine, outputs, total = _serve(streamed, EngineConfig(block_size=4, num_blocks=64, max_seqs=4), drive)
    assert total.bytes_read > 0 and total.expert_misses > 0
    # every byte is charged to the forward that uses it, a read-ahead that completes between two forwards to the
    # next; only the trunk's read-ahead after the last forward (of a step that never came) can be left uncharged
    uncharged = total.bytes_read - sum(o.bytes_read for o in outputs.values())
    assert 0 <= uncharged <= max(blob.read_size for blob in tiny_store.layers)
    assert sum(o.expert_misses for o in outputs.values()) == total.expert_misses
    assert sum(o.io_wait_ms for o in outputs.values()) == pytest.approx(1000 * total.io_wait_seconds)
    assert all(o.bytes_read > 0 for o in outputs.values())
    text = render_metrics(engine.metrics)[0].decode()
    family = engine.figures.tenant_bytes_read
    assert {t: family.labels(t).value for t in PROMPTS} == {t: outputs[t].bytes_read for t in PROMPTS}
    assert engine.figures.tenant_expert_misses.labels("a").value == outputs["a"].expert_misses
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("k3serve_tenant_")}
    for tenant in PROMPTS:
        assert series[f'k3serve_tenant_bytes_read_total{{tenant="{tenant}"}}'] == outputs[tenant].bytes_read
        assert series[f'k3serve_tenant_expert_misses_total{{tenant="{tenant}"}}'] == outputs[tenant].expert_misses


def test_charge_io_advances_the_virtual_counter_by_disk_seconds(streamed, drive):
    base = dict(block_size=4, num_blocks=64, max_seqs=4, scheduling="fair")
    tokens_engine, tokens_out, _ = _serve(streamed, EngineConfig(**base), drive)
    io_engine, io_out, total = _serve(streamed, EngineConfig(**base, charge="io", io_cost=5000.0), drive)
    caused = {tenant: io_engine.figures.tenant_io_caused.labels(tenant).value for tenant in PROMPTS}
    assert sum(caused.values()) == pytest.approx(total.io_wait_seconds)  # every second of waiting is billed
    assert not any(tokens_engine.figures.tenant_io_caused.labels(t).value for t in PROMPTS)
    for tenant in PROMPTS:
        extra = io_engine.scheduler.policy.counter(tenant) - tokens_engine.scheduler.policy.counter(tenant)
        # the same tokens, plus 5000 tokens per second of waiting caused (lifts at activation may move the floor)
        assert caused[tenant] > 0 and extra == pytest.approx(5000.0 * caused[tenant], rel=0.3) and extra > 0


def test_charge_io_is_checked():
    with pytest.raises(ConfigError, match="charge"):
        EngineConfig(charge="bytes")
    with pytest.raises(ConfigError, match="io_cost"):
        EngineConfig(io_cost=-1.0)
    policy = make_policy("fair", io_cost=100.0)
    policy.charge_io("t", 0.5)
    assert policy.counter("t") == 50.0
    free = make_policy("fair")
    free.charge_io("t", 0.5)
    assert free.counter("t") == 0.0


def test_a_failure_while_charging_reads_loses_no_request(streamed, drive, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("accounting bug")

    monkeypatch.setattr("k3serve.engine.engine.split_step", broken)
    engine, outputs, total = _serve(streamed, EngineConfig(block_size=4, num_blocks=64, max_seqs=4), drive)
    assert total.bytes_read > 0
    assert set(outputs) == set(PROMPTS)
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 4 for o in outputs.values())
    assert all(o.bytes_read == 0 for o in outputs.values())  # uncharged, and said so in the log
    assert "goes uncharged" in caplog.text
