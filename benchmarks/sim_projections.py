"""Projections of the full K3 (2.78T) with k3serve's stack: RAM 8..128 GB, the C engine's machine and a laptop,
batch 1/8/32, speculation off/on, flat and skewed routing; plus the C engine calibration table and SVG plots.

    .venv/bin/python benchmarks/sim_projections.py --out docs/sim

Writes projections.json, calibration.json and the plots ladder.svg (s/token by RAM, both machines, k3serve with
the trunk as float32 and as bf16 (StreamOptions.trunk_dtype), the C engine's own policy), batch.svg (tok/s by
batch). Prints one summary line. Every figure is simulated (k3serve.sim.full); none is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RAMS_GB = (8, 10, 12, 16, 32, 64, 128)


def main() -> int:
    from k3serve.sim.calibrate import calibration, cold_token_figures, table_lines
    from k3serve.sim.full import SimConfig, minimum_ram, simulate
    from k3serve.sim.plot import line_chart
    from k3serve.sim.presets import c_engine_v1, laptop
    from k3serve.stream.budget import BudgetError

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/sim"))
    parser.add_argument("--tokens", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    reads, gb = cold_token_figures()
    tables = {f"{r}/{d}": calibration(r, d) for r in ("flat", "skewed") for d in ("as-recorded", "preset")}
    cal = {"cold_reads": reads, "cold_gb": gb,
           "rows": {r: [row.__dict__ | {"error": row.error} for row in rows] for r, rows in tables.items()}}
    (args.out / "calibration.json").write_text(json.dumps(cal, indent=1))
    for rows in tables.values():
        print("\n".join(table_lines(rows)), file=sys.stderr)

    machines = {"c-engine-v1": c_engine_v1, "laptop": laptop}
    records = []

    def run(**kw) -> dict:
        cfg = SimConfig(tokens=args.tokens, warmup=1, **kw)
        try:
            r = simulate(cfg)
        except BudgetError as exc:
            return {"error": str(exc).split(";")[0]}
        return {"s_per_token": r.s_per_token, "tok_per_s": r.tok_per_s, "bytes_per_token": r.bytes_per_token,
                "expert_bytes_per_token": r.expert_bytes_per_token, "trunk_bytes_per_token": r.trunk_bytes_per_token,
                "reads_per_token": r.reads_per_token, "io_seconds_per_token": r.io_seconds_per_token,
                "compute_seconds_per_token": r.compute_seconds_per_token, "retention": r.retention,
                "prefetch_hit_share": r.prefetch_hit_share, "floor_io_s_per_token": r.floor_io_s_per_token,
                "device_busy_share": r.device_busy_share, "pinned_layers": r.plan["pinned_layers"],
                "expert_slots": r.plan["expert_slots"]}

    for mname, make in machines.items():
        machine = make()
        for ram in RAMS_GB:
            for routing in ("flat", "skewed"):
                for dtype in ("float32", "bf16"):
                    for batch in (1, 8, 32):
                        for spec in (0, 3):
                            if batch > 1 and (dtype == "float32" or routing == "skewed"):
                                continue  # batch and speculation: the bf16 trunk, flat routing only
                            if spec and batch > 1:
                                continue
                            rec = {"machine": mname, "ram_gb": ram, "routing": routing, "trunk_dtype": dtype,
                                   "batch": batch, "speculative": spec, "engine": "k3serve"}
                            rec.update(run(machine=machine, ram_bytes=ram << 30, routing=routing, trunk_dtype=dtype,
                                           batch=batch, speculative=spec, policy="lfu", prefetch="next-layer"))
                            records.append(rec)
            # the C engine's own policy on the same machine: trunk first, a one-layer ring, LRU, no prefetch
            pinned = max(0, min(93, int((ram * 1e9 * 0.86 - 4.7e9 - 1.3e9) / (108.81e9 / 93))))
            cache = max(ram * 1e9 - 4.7e9 - 1.3e9 - pinned * 108.81e9 / 93, 16 * 17.6e6)
            rec = {"machine": mname, "ram_gb": ram, "routing": "flat", "trunk_dtype": "bf16", "batch": 1,
                   "speculative": 0, "engine": "c-engine"}
            rec.update(run(machine=machine, engine="c-engine", ram_bytes=int(ram * 1e9), pinned_layers=pinned,
                           cache_bytes=int(cache), routing="flat", prefetch="none", policy="lru"))
            records.append(rec)
    (args.out / "projections.json").write_text(json.dumps({"records": records,
                                                           "minimum_ram_float32": minimum_ram(),
                                                           "minimum_ram_bf16": minimum_ram(trunk_dtype="bf16")},
                                                          indent=1))

    def series(mname, engine, dtype, routing="flat", batch=1, spec=0, key="s_per_token"):
        return [(r["ram_gb"], r[key]) for r in records
                if r["machine"] == mname and r["engine"] == engine and r["trunk_dtype"] == dtype
                and r["routing"] == routing and r["batch"] == batch and r["speculative"] == spec and key in r]

    ladder = {}
    for mname in machines:
        ladder[f"{mname}: k3serve fp32"] = series(mname, "k3serve", "float32")
        ladder[f"{mname}: k3serve bf16"] = series(mname, "k3serve", "bf16")
        ladder[f"{mname}: C engine"] = series(mname, "c-engine", "bf16")
    (args.out / "ladder.svg").write_text(line_chart("full K3, batch 1, flat routing: s/token by RAM",
                                                    "RAM (GB)", "s/token", ladder,
                                                    dashed=[k for k in ladder if "C engine" in k]))
    batch_series = {}
    for mname in machines:
        for b in (1, 8, 32):
            batch_series[f"{mname}: batch {b}"] = series(mname, "k3serve", "bf16", batch=b, key="tok_per_s")
    (args.out / "batch.svg").write_text(line_chart("full K3, k3serve bf16 trunk, flat: tok/s by RAM and batch",
                                                   "RAM (GB)", "tok/s (all sequences)", batch_series))
    ok = sum(1 for r in records if "s_per_token" in r)
    print(f"sim_projections: {len(records)} configurations ({ok} run, {len(records) - ok} below the minimum RAM), "
          f"cold token {reads:.0f} reads / {gb:.2f} GB, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
