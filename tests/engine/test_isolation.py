"""The budget-isolation experiment (engine/isolation.py) on the model clock, which makes it deterministic: a
flooding tenant starves a light one under FCFS and not under fair scheduling, at the same total work; with step
interruption the light tenant's first token no longer waits for the forward in flight."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.engine.isolation import IsolationConfig, run_isolation, summary
from k3serve.errors import ConfigError

CONFIG = IsolationConfig(num_flood=6, flood_prompt_tokens=40, flood_max_tokens=8, light_prompt_tokens=6,
                         light_max_tokens=2, light_interval_s=0.02, duration_s=0.3, max_batch_tokens=32,
                         max_seqs=12, clock="model", step_cost=(0.002, 0.0003))


@pytest.fixture(scope="module")
def model():
    from k3serve.loading import load_model

    return load_model(None).model  # the embedded model: a few ms per step


def test_fair_scheduling_protects_the_light_tenant_at_equal_throughput(model):
    results = {mode: run_isolation(model, mode, CONFIG) for mode in ("alone", "fcfs", "fair")}
    alone, fcfs, fair = results["alone"], results["fcfs"], results["fair"]
    assert alone.light_unserved == 0 and fair.light_unserved <= 1  # at most one, arrived during the last forward
    assert fair.light_ttft_p99 < fcfs.light_ttft_p99 / 3
    assert alone.light_ttft_p99 <= fair.light_ttft_p99
    assert fair.computed_tokens_per_s == pytest.approx(fcfs.computed_tokens_per_s, rel=0.05)  # work-conserving
    ratios = summary(results)
    assert ratios["fcfs_p99_over_alone"] > ratios["fair_p99_over_alone"] > 1
    again = run_isolation(model, "fair", CONFIG)
    assert again == fair  # the model clock makes a run reproducible


def test_step_interruption_lets_the_light_tenant_pass_the_forward_in_flight(model):
    plain = run_isolation(model, "fair", CONFIG)
    config = dataclasses.replace(CONFIG, step_interruption=True)
    alone, fcfs, fair = (run_isolation(model, mode, config) for mode in ("alone", "fcfs", "fair"))
    assert fcfs == run_isolation(model, "fcfs", CONFIG)  # fcfs never interrupts: the switch changes nothing
    assert alone == run_isolation(model, "alone", CONFIG)  # nothing to interrupt when B runs alone
    assert fair.light_unserved == 0
    assert fair.light_ttft_p50 <= 1.5 * alone.light_ttft_p50 < plain.light_ttft_p50
    assert fair.light_ttft_p99 < plain.light_ttft_p99 / 2
    assert fair.computed_tokens_per_s < plain.computed_tokens_per_s  # each interruption adds a forward's fixed cost


def test_bad_settings_are_refused(model):
    with pytest.raises(ConfigError, match="clock"):
        IsolationConfig(clock="sundial")
    with pytest.raises(ConfigError, match="max_seqs"):
        IsolationConfig(num_flood=64, max_seqs=64)
    with pytest.raises(ConfigError, match="mode"):
        run_isolation(model, "lottery", CONFIG)
