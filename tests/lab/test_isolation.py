"""The budget-isolation experiment (engine/isolation.py) on the model clock, which makes it deterministic: a
flooding tenant starves a light one under FCFS and not under fair scheduling, at the same total work; with step
interruption the light tenant's first token no longer waits for the forward in flight. The model clock advances at
every pause point of a forward by that part's measured share (`PauseSplit`)."""

from __future__ import annotations

import dataclasses

import pytest

import numpy as np

from k3serve.lab.isolation import IsolationConfig, PauseSplit, measure_pause_split, run_isolation, summary
from k3serve.errors import ConfigError

# the embedded model's 8 layers (ms): KDA mixers cost more than MLA ones (layers 3 and 7), layer 0's MLP is dense
SPLIT = PauseSplit((1, 256), ((0.19, 0.15, 0.15, 0.11, 0.16, 0.15, 0.15, 0.11),
                              (6.7, 7.2, 6.9, 2.8, 6.9, 7.2, 7.6, 2.8)),
                   ((0.06, 0.17, 0.14, 0.15, 0.14, 0.14, 0.15, 0.22), (0.86, 6.2, 6.0, 6.4, 6.4, 6.7, 6.4, 6.3)))
CONFIG = IsolationConfig(num_flood=6, flood_prompt_tokens=40, flood_max_tokens=8, light_prompt_tokens=6,
                         light_max_tokens=2, light_interval_s=0.02, duration_s=0.3, max_batch_tokens=32,
                         max_seqs=12, clock="model", step_cost=(0.002, 0.0003), pause_split=SPLIT)


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
    with pytest.raises(ConfigError, match="pause split record"):
        PauseSplit.from_dict({"lengths": [1, 256], "mixer": [[0.1]]})
    with pytest.raises(ConfigError, match="one time >= 0 per layer"):
        PauseSplit((1, 256), ((0.1,), (0.2, 0.3)), ((0.1,), (0.2,)))
    short = PauseSplit((1, 256), ((0.1,), (0.2,)), ((0.1,), (0.2,)))
    with pytest.raises(ConfigError, match="measured on 1 layers"):
        run_isolation(model, "fair", dataclasses.replace(CONFIG, pause_split=short))


def test_pause_split_shares_come_from_each_parts_fitted_cost(model):
    fixed, per_token = SPLIT.shares
    assert fixed.shape == per_token.shape == (16,)
    assert fixed.sum() == pytest.approx(1) and per_token.sum() == pytest.approx(1)
    assert per_token[2 * 3] == pytest.approx((2.8 - 0.11) / 255 / (sum(SPLIT.seconds(1) - SPLIT.seconds(0)) / 255))
    assert per_token[2 * 6] > per_token[2 * 3]  # a KDA mixer over an MLA one
    assert PauseSplit.from_dict(SPLIT.as_dict()) == SPLIT
    measured = measure_pause_split(model, lengths=(1, 8), repeats=1)
    assert measured.num_layers == model.config.num_layers == 8
    assert all(np.all(share >= 0) and share.sum() == pytest.approx(1) for share in measured.shares)


def test_a_finer_pause_split_shortens_the_wait_for_the_part_in_flight(model):
    """The same run with each layer's whole cost advanced after its MLP (the mixer's share 0): B then waits for
    the rest of a whole layer rather than of a part."""
    whole = PauseSplit((1, 256), ((0.0,) * 8, (0.0,) * 8),
                       tuple(tuple(m + p for m, p in zip(mixer, mlp)) for mixer, mlp in zip(SPLIT.mixer, SPLIT.mlp)))
    config = dataclasses.replace(CONFIG, step_interruption=True)
    parts = run_isolation(model, "fair", config)
    layers = run_isolation(model, "fair", dataclasses.replace(config, pause_split=whole))
    assert parts.light_ttft_p99 < layers.light_ttft_p99
