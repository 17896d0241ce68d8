"""benchmarks/bench_region_start.py: each setting's child reports the policy it ran under and the serial and
parallel calls' times, and the record names the region's start as their difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_region_start.py"


def test_the_region_start_benchmark_runs_each_setting_under_its_policy(tmp_path):
    out = tmp_path / "record.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(BENCH), "--rounds", "1", "--calls", "20", "--settings",
                           "default;passive:K3SERVE_WAIT_POLICY=passive", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record == json.loads(done.stdout.strip().splitlines()[-1])
    settings = record["settings"]
    assert settings["default"]["policy"] == "adaptive" and settings["passive"]["policy"] == "passive"
    assert settings["passive"]["keepers"] == 0 and settings["passive"]["env"] == {"K3SERVE_WAIT_POLICY": "passive"}
    for figures in settings.values():
        assert all(figures[name] > 0 for name in ("serial_us", "parallel_us", "serial_us_after_gap",
                                                   "parallel_us_after_gap"))
        assert figures["start_us"] == figures["parallel_us"] - figures["serial_us"]
