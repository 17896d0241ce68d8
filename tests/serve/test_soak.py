"""The CI soak: benchmarks/soak.py for 2 minutes, as issue 19 asks (the long run and its figures are in
docs/RELIABILITY.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_mixed_traffic_loses_nothing_and_keeps_every_pool_whole():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    record = soak.run_soak(seconds=120, clients=4, window=30, warmup=20)
    assert record["sent"] > 0 and record["completed"] > 0
    assert record["lost"] == 0 and record["failed"] == 0, record["errors"]
    assert record["integrity_checks"] > 0 and record["integrity_failures"] == 0, record["first_integrity_failure"]
    assert not record["unfinished_after_drain"]
