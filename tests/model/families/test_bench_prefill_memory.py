"""benchmarks/bench_prefill_memory.py on the smoke fixture: it loads as the peers benchmark loads, runs one prompt,
and names each layer part's largest transient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_prefill_memory.py"


def test_the_prefill_memory_benchmark_names_each_part_and_the_high_water_marks(tmp_path):
    out = tmp_path / "record.json"
    env = {**os.environ, "K3BENCH_DIR": str(tmp_path / "bench"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(BENCH), "--target", "qwen3_next", "--size", "smoke", "--tokens", "300",
                           "--precision", "int8", "--json", str(out), "--profile", "5"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["trunk_precision"] == "q8_0" and record["tokens"] == 300
    parts = record["part_peak_mib"]
    assert set(parts) == {"GatedDeltaNet", "GQAAttention", "MoEBlock"}, parts  # qwen3_next's layer parts
    assert all(mib > 0 for mib in parts.values())
    assert record["forward_peak_mib"] >= max(parts.values())
    assert record["hwm_after_prefill_mib"] >= record["hwm_after_load_mib"] > 0
    assert "GatedDeltaNet" in done.stdout and record == json.loads(done.stdout.strip().splitlines()[-1])
    assert record["prefill_tok_s"] > 0 and len(record["profile_top"]) == 5  # --profile: where the time goes
    assert all(row["seconds"] >= 0 and ":" in row["function"] for row in record["profile_top"])
