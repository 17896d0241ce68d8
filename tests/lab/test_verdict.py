"""Verdicts: the wording of won / lost / even, the sweep crossing, and each module's break-even model solved back
(at the flip point the module's own model gives a tie)."""

from __future__ import annotations

import math

import pytest

from k3serve.lab.verdict import crossing, gain, judge


def test_won_lost_and_even_follow_the_metrics_direction():
    faster = judge("Batching", "one at a time", "tok_per_s", "tokens per second", 300.0, 100.0, higher_is_better=True,
                   flips_when="it wins from 2 requests on")
    assert faster.outcome == "won" and faster.factor == pytest.approx(3.0)
    assert faster.sentence == ("Batching won here: 3.00x more tokens per second than one at a time. It wins from 2 "
                               "requests on.")
    slower = judge("Prefetch", "no prefetch", "ms", "time per token", 10.0, 8.0, higher_is_better=False)
    assert slower.outcome == "lost" and slower.factor == pytest.approx(0.8)
    assert slower.sentence.startswith("Prefetch lost here: 1.25x more time per token than no prefetch.")
    tie = judge("A", "B", "x", "reads", 1.02, 1.0, higher_is_better=True)
    assert tie.outcome == "even" and "even" in tie.sentence
    lower_is_better_zero = judge("A", "B", "x", "bytes", 0.0, 5.0, higher_is_better=False)
    assert lower_is_better_zero.outcome == "won" and math.isnan(lower_is_better_zero.factor)
    assert math.isnan(gain(float("nan"), 1.0, True))
    assert judge("k3serve at 8 GiB", "C", "s", "time", float("nan"), 3.0, False).outcome == "even"


def test_a_flip_clause_keeps_a_lower_case_name():
    verdict = judge("A", "B", "x", "time", 2.0, 1.0, higher_is_better=False, flips_when="k3serve fits from 24 GiB")
    assert verdict.sentence.endswith("than B. k3serve fits from 24 GiB.")


def test_crossing_interpolates_the_first_sign_change_and_skips_gaps():
    xs = [1, 2, 4, 8]
    assert crossing(xs, [5, 4, 2, 1], [3, 3, 3, 3], higher_is_better=True) == pytest.approx(3.0)
    assert crossing(xs, [5, 4, 2, 1], [3, 3, 3, 3], higher_is_better=False) == pytest.approx(3.0)
    assert crossing(xs, [9, 9, 9, 9], [1, 2, 3, 4], higher_is_better=True) is None
    assert crossing(xs, [None, 4, None, 1], [3, 3, 3, 3], higher_is_better=True) == pytest.approx(2 + 6 * 1 / 3)


def test_speculative_break_even_acceptance_pays_exactly_for_the_window():
    from k3serve.lab.modules.speculative import break_even_acceptance, tokens_per_window

    for cost, drafts in ((2.06, 3.2), (1.5, 4.0), (3.9, 4.0)):
        flip = break_even_acceptance(cost, drafts)
        assert 0 < flip < 1 and tokens_per_window(flip, drafts) == pytest.approx(cost, rel=1e-9)
    assert break_even_acceptance(0.9, 4.0) == 0.0
    assert break_even_acceptance(5.0, 4.0) is None
    assert tokens_per_window(1.0, 4.0) == 5.0 and tokens_per_window(0.0, 4.0) == 1.0


def test_prefetch_break_even_latency_ties_the_two_time_models():
    from k3serve.lab.modules.prefetch import break_even_read_ms, read_ms_here

    off = {"ms_per_token": 9.0, "io_wait_ms_per_token": 3.0, "demand_misses_per_token": 24.0}
    on = {"ms_per_token": 10.0, "io_wait_ms_per_token": 1.5, "demand_misses_per_token": 12.0}
    here, flip = read_ms_here(off), break_even_read_ms(on, off)
    assert flip > here  # prefetch loses here, so it needs slower reads to win

    def time(run: dict, latency: float) -> float:  # the module's model: the rest + demand reads x latency
        return run["ms_per_token"] - run["demand_misses_per_token"] * here + run["demand_misses_per_token"] * latency

    assert time(on, here) == on["ms_per_token"] and time(off, here) == off["ms_per_token"]
    assert time(on, flip) == pytest.approx(time(off, flip))
    assert break_even_read_ms({**on, "demand_misses_per_token": 30.0}, off) is None
    assert break_even_read_ms({**on, "ms_per_token": 1.0}, off) == 0.0


def test_recurrent_state_break_even_context_is_where_the_hybrid_meets_mha():
    from k3serve.config import full_k3_config
    from k3serve.lab.modules.recurrent_state import break_even_context, per_sequence_bytes

    config = full_k3_config()
    flip = break_even_context(config, 2)
    below, above = per_sequence_bytes(config, int(flip), 2), per_sequence_bytes(config, int(flip) + 1, 2)
    assert below["hybrid_bytes"] > below["all_mha_bytes"] and above["hybrid_bytes"] < above["all_mha_bytes"]


def test_cluster_routing_cold_miss_model_is_even_at_its_break_even():
    from k3serve.lab.modules.cluster_routing import requests_until_even

    groups, replicas, prefix, distinct = 4, 4, 96, 16
    n = requests_until_even(groups, replicas, prefix, distinct)
    ratio = (n * distinct + groups * replicas * prefix) / (n * distinct + groups * prefix)
    assert ratio == pytest.approx(1.05)
    assert requests_until_even(4, 1, 96) == 0.0  # one replica: round-robin is cache-aware
