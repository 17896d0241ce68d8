"""Calibration against kimi-k3-in-c's published K3 figures, with its machine and its policies.

Its protocol is reproduced: 8-token runs (`--gen 8 --incremental`) on a 5-token prompt, s/token averaged over all
eight steps, the first of which is the prefill and pays for loading the pinned trunk; the engine keeps the trunk
as bf16 with a one-layer read-ahead ring, pins whole layers, and gives the rest to an LRU expert cache; every
expert read is synchronous (no prefetch). The split per rung (pinned layers, cache size) is its published one.

Published figures (openchat-ai/kimi-k3-in-c README, docs/data/memory-ladder.tsv, trunk-cache-split.tsv,
papers/data/memory_ladder.tsv with its `io_share` column).

Two device inputs (docs/SIMULATOR.md, "Calibration"):
- `preset`: one device for every run, the `c-engine` preset (trunk reads at 5,874 MB/s, the rate its environment
  capture gives for real runs: "engine, trunk: 5373-6064 MB/s sustained").
- `as-recorded`: the trunk stream at the rate each run's own counters recorded, where they recorded one: the
  run report's "read N GB in T s" (both 128 GB runs), else the ladder's `io_share` (whole-run disk-wait share,
  which at 128 GB is 142.5 s of the run against the report's 138.4 s of trunk reads: the trunk stream's time), so
  rate = the simulated trunk bytes of the run / (io_share x the run's wall time). Expert reads keep the preset's
  curve. Rows with no per-run record keep the preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from k3serve.sim.full import SimConfig, SimResult, simulate
from k3serve.sim.machine import Machine
from k3serve.sim.presets import c_engine, c_engine_v1

GB = 1e9
LAYER_GB = 108.81 / 93

# (label, total GB, pinned layers, cache GB, published s/token, published expert GB read per token,
#  the run's record of its trunk stream: ("io_share", percent of wall) | ("report", GB, seconds) | None)
LADDER = (
    ("ladder 8 GB", 8, 0, 0.49, 32.69, 25.83, ("io_share", 57.3)),
    ("ladder 32 GB", 32, 11, 10.80, 31.44, 25.83, ("io_share", 53.6)),
    ("ladder 64 GB", 64, 27, 23.59, 28.60, 25.83, ("io_share", 53.6)),
    # its run report ("Measuring the measurement", run A): read 374.99 GB in 138.40 s; io_share 60.6%
    ("ladder 128 GB", 128, 60, 49.19, 29.40, 17.51, ("report", 374.99, 138.40)),
    ("ladder 192 GB", 192, 90, 77.00, 21.32, 16.65, ("io_share", 49.9)),
    ("ladder 224 GB", 224, 90, 108.98, 19.21, 14.53, ("io_share", 40.9)),
)
SPLIT = (
    # the same configuration as the 128 GB ladder rung, measured again in the split sweep (run B): identical
    # reads, binds and evictions, read 374.99 GB in 63.84 s (2.17x run A's device throughput)
    ("128 GB rung again (split sweep)", 128, 60, 49.19, 18.37, 17.51, ("report", 374.99, 63.84)),
    ("128 GB, trunk 12.3 / cache 110.7", 128, round(12.3 / LAYER_GB), 110.7, 28.38, 14.46, None),
    ("128 GB, trunk 110 / cache 13", 128, 90, 13.0, 16.80, 25.83, None),
)
TRUNK_RESIDENT = ("trunk resident (v1.0.0), 128 GB+", 128, 93, 13.0, 5.59, 25.83, None)
RUN_STEPS = 8  # the published runs' steps (the prefill step and seven decode steps)
DEVICES = ("as-recorded", "preset")


@dataclass
class CalibrationRow:
    label: str
    published_s: float
    simulated_s: float
    published_gb: float
    simulated_gb: float
    routing: str
    trunk_rate: float | None = None  # bytes/s the trunk stream was given (None: the preset's curve)

    @property
    def error(self) -> float:
        return self.simulated_s / self.published_s - 1

    def line(self) -> str:
        ok = "ok" if abs(self.error) <= 0.20 else "OFF"
        rate = f"{self.trunk_rate / 1e9:.2f}" if self.trunk_rate else "preset"
        return (f"{self.label:<36} {self.published_s:>8.2f} {self.simulated_s:>9.2f} {100 * self.error:>+7.1f}% {ok:>3}"
                f"   {self.published_gb:>7.2f} {self.simulated_gb:>7.2f}  {rate:>6}  {self.routing}")


def c_engine_run(machine: Machine, total_gb: float, pinned: int, cache_gb: float, routing: str = "flat",
                 seed: int = 0, steady: bool = False, trunk_rate: float | None = None) -> SimResult:
    """One run as the C engine measured it (or, with `steady`, its steady decode step alone)."""
    return simulate(SimConfig(
        machine=machine, engine="c-engine", ram_bytes=int(total_gb * GB), pinned_layers=pinned,
        cache_bytes=int(cache_gb * GB), policy="lru", prefetch="none", routing=routing, queue_depth=16,
        prompt_tokens=0 if steady else 5, tokens=3 if steady else 7, warmup=1 if steady else 0,
        count_prefill=not steady, seed=seed, trunk_read_bytes_per_s=trunk_rate))


def recorded_trunk_rate(record: tuple | None, published_s: float, simulated_trunk_bytes: float) -> float | None:
    """The trunk stream's rate in that run by its own counters: a run report's GB / s, or the ladder's io_share:
    rate = trunk bytes of the run / (io_share x wall), wall = published s/token x 8 steps. None: no record."""
    if record is None:
        return None
    if record[0] == "report":
        return record[1] * GB / record[2]
    return simulated_trunk_bytes / (record[1] / 100 * published_s * RUN_STEPS)


def cold_token_figures() -> tuple[float, float]:
    """Expert reads and GB per token with nothing cached (the published 1,472 and 25.83 GB)."""
    r = c_engine_run(c_engine(), 8, 0, 0.49, steady=True)
    return r.expert_requests_per_token, r.expert_bytes_per_token / GB


def calibrate_row(row: tuple, routing: str = "flat", device: str = "as-recorded") -> CalibrationRow:
    """One published run (a LADDER or SPLIT entry) beside the simulator's."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    label, total, pinned, cache, published, gb, record = row
    machine = c_engine()
    r = c_engine_run(machine, total, pinned, cache, routing)
    rate = None
    if device == "as-recorded":
        rate = recorded_trunk_rate(record, published, r.totals["trunk_bytes"])
        if rate is not None:
            r = c_engine_run(machine, total, pinned, cache, routing, trunk_rate=rate)
    steady = c_engine_run(machine, total, pinned, cache, routing, steady=True)
    return CalibrationRow(label, published, r.s_per_token, gb, steady.expert_bytes_per_token / GB, routing, rate)


def calibration(routing: str = "flat", device: str = "as-recorded",
                progress: Callable[[int, int, str], None] | None = None) -> list[CalibrationRow]:
    """Every published run beside the simulator's; `progress(done, total, label)` hears of each row (the whole
    takes seconds)."""
    runs = LADDER + SPLIT
    rows = []
    for number, row in enumerate(runs, start=1):
        rows.append(calibrate_row(row, routing, device))
        if progress is not None:
            progress(number, len(runs) + 1, row[0])
    label, total, pinned, cache, published, gb, _ = TRUNK_RESIDENT
    r = c_engine_run(c_engine_v1(), total, pinned, cache, routing, steady=True)
    rows.append(CalibrationRow(label + " (steady)", published, r.s_per_token, gb, r.expert_bytes_per_token / GB,
                               routing))
    if progress is not None:
        progress(len(rows), len(rows), label + " (steady)")
    return rows


def table_lines(rows: list[CalibrationRow]) -> list[str]:
    out = [f"{'figure':<36} {'C engine':>8} {'simulated':>9} {'error':>8}      {'GB read':>7} {'sim GB':>7}  "
           f"{'trunk':>6}  routing",
           "(s/token: 8-token runs incl. the prefill step, as published; GB: expert bytes per steady decode step; "
           "trunk: GB/s of the trunk stream as the run recorded it, or the preset's curve)"]
    out += [r.line() for r in rows]
    return out
