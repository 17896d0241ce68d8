"""The router simulator (`k3serve sim router`, sim/router.py) against bench_cluster.py's measured prefix hit rates.

For every record of `bench_cluster.py --workload shared-prefix` in docs/cluster/ (or the files given), the
simulator runs the record's configuration on the same workload order (its seed) and prints the measured and
simulated hit rates of cache-aware and round-robin, and their ratio. Nothing is fitted to these hit rates: the
simulator's only timing constants come from the measured TTFT and request time (sim/router.py). A record made before
the prefix cache admitted re-saved checkpoints as recurring (no "engine_features" in it) is simulated without that.

    python benchmarks/bench_sim_router_check.py [RECORD.json ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from k3serve.sim.router import RouterSimConfig, simulate_router

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "cluster"


def shared_prefix_records(paths: list[Path]) -> list[tuple[Path, dict]]:
    out = []
    for path in paths:
        record = json.loads(path.read_text())
        if record.get("benchmark") == "cluster" and record["args"].get("workload") == "shared-prefix":
            out.append((path, record))
    return out


def compare(record: dict) -> list[dict]:
    a = record["args"]
    rows = []
    for policy in a["prefix_cache_policy"]:
        measured = {}
        for router in ("cache-aware", "round-robin"):
            runs = record["runs"].get(f"{router}x{a['replicas']}/{policy}")
            if runs:
                measured[router] = statistics.median(r["hit_rate"] for r in runs)
        if len(measured) < 2:
            continue
        simulated = {router: simulate_router(RouterSimConfig(
            replicas=a["replicas"], router=router, checkpoints=a["state_checkpoints"], policy=policy,
            groups=a["groups"], per_group=a["per_group"], system_tokens=a["system_tokens"],
            question_tokens=a["question_tokens"], reply_tokens=a["reply_tokens"], clients=a["clients"],
            balance_abs_threshold=a["balance_abs_threshold"], balance_rel_threshold=a["balance_rel_threshold"],
            prefix_wait=a.get("prefix_wait_tokens", 32) > 0, seed=a["seed"],
            recurring=record.get("engine_features", {}).get("recurring_admission", False))).hit_rate
            for router in measured}
        rows.append({"replicas": a["replicas"], "per_group": a["per_group"], "checkpoints": a["state_checkpoints"],
                     "policy": policy, "rounds": a["rounds"], "measured": measured, "simulated": simulated})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="*", type=Path, help="bench_cluster.py JSON records (default: docs/cluster)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    paths = args.records or sorted([*RECORDS.glob("shared_prefix_*.json"), *RECORDS.glob("recurring_*.json")])
    rows = []
    print(f"{'record':<34} {'R':>2} {'q':>2} {'C':>3} {'policy':>6}  {'measured CA / RR (ratio)':>26}  "
          f"{'simulated CA / RR (ratio)':>26}")
    for path, record in shared_prefix_records(paths):
        for row in compare(record):
            m, s = row["measured"], row["simulated"]
            rows.append({"record": path.name, **row})
            pair = [f"{h['cache-aware']:>8.3f} / {h['round-robin']:.3f} ({h['cache-aware'] / h['round-robin']:.2f}x)"
                    for h in (m, s)]
            print(f"{path.name:<34} {row['replicas']:>2} {row['per_group']:>2} {row['checkpoints']:>3} "
                  f"{row['policy']:>6}  {pair[0]}  {pair[1]}")
    errors = [abs(r["simulated"][k] - r["measured"][k]) for r in rows for k in r["measured"]]
    if errors:
        print(f"mean absolute error of the simulated hit rates: {statistics.mean(errors):.3f} "
              f"(largest {max(errors):.3f}) over {len(errors)} hit rates")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
