"""The metrics registry."""

from __future__ import annotations

import math

import pytest

from k3serve.engine.metrics import MetricsRegistry


def test_counters_gauges_histograms_and_snapshot():
    registry = MetricsRegistry()
    registry.counter("tokens").inc(3)
    registry.counter("tokens").inc()
    registry.gauge("queue").set(7)
    for value in range(1, 101):
        registry.histogram("ttft").observe(value)
    snap = registry.snapshot()
    assert snap["tokens"] == 4 and snap["queue"] == 7
    assert snap["ttft"]["count"] == 100 and snap["ttft"]["p50"] == pytest.approx(50.5)
    assert snap["ttft"]["p99"] == pytest.approx(99.01)
    assert math.isnan(registry.histogram("empty").summary()["p50"])
    with pytest.raises(ValueError):
        registry.counter("tokens").inc(-1)
    with pytest.raises(TypeError):
        registry.gauge("tokens")


def test_histogram_buckets_are_cumulative_and_end_at_the_count():
    from k3serve.engine.metrics import MetricsRegistry

    histogram = MetricsRegistry().histogram("ttft_seconds")
    for value in (0.0005, 0.003, 0.003, 0.2, 100.0):
        histogram.observe(value)
    buckets = dict(histogram.cumulative_buckets())
    assert buckets[0.001] == 1 and buckets[0.005] == 3 and buckets[0.25] == 4 and buckets[60.0] == 4
    assert buckets[float("inf")] == histogram.count == 5


def test_refreshers_run_before_a_read_and_a_failing_one_is_skipped():
    registry = MetricsRegistry()
    kept = {"bytes": 10}
    registry.add_refresher(lambda reg: reg.counter("bytes_read").advance_to(kept["bytes"]))

    def broken(reg):
        raise RuntimeError("owner unreachable")

    registry.add_refresher(broken)
    assert registry.snapshot()["bytes_read"] == 10
    kept["bytes"] = 25
    assert registry.snapshot()["bytes_read"] == 25
    kept["bytes"] = 5  # a total kept elsewhere that went down (a restarted process) never lowers a counter
    assert registry.snapshot()["bytes_read"] == 25
