"""Calibration against the C engine's published runs: the trunk stream at the rate a run recorded, and the
upper memory-ladder rungs (the ones one device for every run missed) within 20% with that input."""

from __future__ import annotations

import pytest

from k3serve.sim.calibrate import LADDER, c_engine_run, calibrate_row, recorded_trunk_rate
from k3serve.sim.full import SimConfig, SimConfigError
from k3serve.sim.presets import c_engine


def test_recorded_rate_comes_from_the_run_report_or_the_io_share():
    assert recorded_trunk_rate(("report", 374.99, 138.40), 29.40, 0) == pytest.approx(2.709e9, rel=1e-3)
    # io_share: trunk bytes over the disk-wait share of the 8-step wall time
    assert recorded_trunk_rate(("io_share", 50.0), 10.0, 80e9) == pytest.approx(2e9)
    assert recorded_trunk_rate(None, 10.0, 80e9) is None


def test_a_slower_trunk_stream_costs_its_bytes_and_leaves_the_reads_alone():
    fast = c_engine_run(c_engine(), 64, 27, 23.59, trunk_rate=5.874e9)
    slow = c_engine_run(c_engine(), 64, 27, 23.59, trunk_rate=2.0e9)
    assert slow.totals["trunk_bytes"] == fast.totals["trunk_bytes"]
    assert slow.totals["expert_bytes"] == fast.totals["expert_bytes"]
    extra = fast.totals["trunk_bytes"] * (1 / 2.0e9 - 1 / 5.874e9) / 8
    assert slow.s_per_token - fast.s_per_token == pytest.approx(extra, rel=0.35)
    with pytest.raises(SimConfigError, match="trunk read rate"):
        SimConfig(machine=c_engine(), trunk_read_bytes_per_s=0.0)


def test_upper_ladder_rungs_within_20_percent_with_the_recorded_trunk_rate():
    upper = [row for row in LADDER if row[1] >= 128]
    for row in upper:
        r = calibrate_row(row, "flat", "as-recorded")
        assert abs(r.error) <= 0.20, r.line()
        assert r.trunk_rate < 3e9  # those runs' trunk stream ran at 1.5-2.7 GB/s by their own counters
    # with one device for every run the 192 GB rung is more than 20% fast: the recorded rate is what closes it
    assert calibrate_row(upper[1], "flat", "preset").error < -0.20
