"""Calibration against kimi-k3-in-c's published K3 figures, with its machine and its policies.

Its protocol is reproduced: 8-token runs (`--gen 8 --incremental`) on a 5-token prompt, s/token averaged over all
eight steps, the first of which is the prefill and pays for loading the pinned trunk; the engine keeps the trunk
as bf16 with a one-layer read-ahead ring, pins whole layers, and gives the rest to an LRU expert cache; every
expert read is synchronous (no prefetch). The split per rung (pinned layers, cache size) is its published one.

Published figures (openchat-ai/kimi-k3-in-c README, docs/data/memory-ladder.tsv, trunk-cache-split.tsv):
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.sim.full import SimConfig, SimResult, simulate
from k3serve.sim.machine import Machine
from k3serve.sim.presets import c_engine, c_engine_v1

GB = 1e9
LAYER_GB = 108.81 / 93

# (label, total GB, pinned layers, cache GB, published s/token, published expert GB read per token)
LADDER = (
    ("ladder 8 GB", 8, 0, 0.49, 32.69, 25.83),
    ("ladder 32 GB", 32, 11, 10.80, 31.44, 25.83),
    ("ladder 64 GB", 64, 27, 23.59, 28.60, 25.83),
    ("ladder 128 GB", 128, 60, 49.19, 29.40, 17.51),
    ("ladder 192 GB", 192, 90, 77.00, 21.32, 16.65),
    ("ladder 224 GB", 224, 90, 108.98, 19.21, 14.53),
)
SPLIT = (
    # the same configuration as the 128 GB ladder rung, measured again in the split sweep: identical reads,
    # 2.17x the device throughput (its "Measuring the measurement" section)
    ("128 GB rung again (split sweep)", 128, 60, 49.19, 18.37, 17.51),
    ("128 GB, trunk 12.3 / cache 110.7", 128, round(12.3 / LAYER_GB), 110.7, 28.38, 14.46),
    ("128 GB, trunk 110 / cache 13", 128, 90, 13.0, 16.80, 25.83),
)
TRUNK_RESIDENT = ("trunk resident (v1.0.0), 128 GB+", 128, 93, 13.0, 5.59, 25.83)


@dataclass
class CalibrationRow:
    label: str
    published_s: float
    simulated_s: float
    published_gb: float
    simulated_gb: float
    routing: str

    @property
    def error(self) -> float:
        return self.simulated_s / self.published_s - 1

    def line(self) -> str:
        ok = "ok" if abs(self.error) <= 0.20 else "OFF"
        return (f"{self.label:<36} {self.published_s:>8.2f} {self.simulated_s:>9.2f} {100 * self.error:>+7.1f}% {ok:>3}"
                f"   {self.published_gb:>7.2f} {self.simulated_gb:>7.2f}  {self.routing}")


def c_engine_run(machine: Machine, total_gb: float, pinned: int, cache_gb: float, routing: str = "flat",
                 seed: int = 0, steady: bool = False) -> SimResult:
    """One run as the C engine measured it (or, with `steady`, its steady decode step alone)."""
    return simulate(SimConfig(
        machine=machine, engine="c-engine", ram_bytes=int(total_gb * GB), pinned_layers=pinned,
        cache_bytes=int(cache_gb * GB), policy="lru", prefetch="none", routing=routing, queue_depth=16,
        prompt_tokens=0 if steady else 5, tokens=3 if steady else 7, warmup=1 if steady else 0,
        count_prefill=not steady, seed=seed))


def cold_token_figures() -> tuple[float, float]:
    """Expert reads and GB per token with nothing cached (the published 1,472 and 25.83 GB)."""
    r = c_engine_run(c_engine(), 8, 0, 0.49, steady=True)
    return r.expert_requests_per_token, r.expert_bytes_per_token / GB


def calibration(routing: str = "flat") -> list[CalibrationRow]:
    rows = []
    machine = c_engine()
    for label, total, pinned, cache, published, gb in LADDER + SPLIT:
        r = c_engine_run(machine, total, pinned, cache, routing)
        steady = c_engine_run(machine, total, pinned, cache, routing, steady=True)
        rows.append(CalibrationRow(label, published, r.s_per_token, gb, steady.expert_bytes_per_token / GB,
                                   routing))
    label, total, pinned, cache, published, gb = TRUNK_RESIDENT
    r = c_engine_run(c_engine_v1(), total, pinned, cache, routing, steady=True)
    rows.append(CalibrationRow(label + " (steady)", published, r.s_per_token, gb, r.expert_bytes_per_token / GB,
                               routing))
    return rows


def table_lines(rows: list[CalibrationRow]) -> list[str]:
    out = [f"{'figure':<36} {'C engine':>8} {'simulated':>9} {'error':>8}      {'GB read':>7} {'sim GB':>7}  routing",
           "(s/token: 8-token runs incl. the prefill step, as published; GB: expert bytes per steady decode step)"]
    out += [r.line() for r in rows]
    return out
