"""Predict, then measure: the simulator against the live streaming engine on this machine.

    .venv/bin/python benchmarks/bench_sim_check.py --phase predict --json docs/sim/predictions.json
    .venv/bin/python benchmarks/bench_sim_check.py --phase measure --predictions docs/sim/predictions.json \
        --json docs/sim/check.json

Workload: bench_stream.py's fixture (the trained model with widened experts, co-activation layout) and its two
timed prompts, 16 tokens each; figures per decode step, as that benchmark reports them. Grid: three RAM budgets,
two cache policies (lru, lfu), full stack otherwise (O_DIRECT, queue depth 16, next-layer prefetch), at two
emulated device speeds (cgroup-v1 blkio read_bps_device, benchmarks/throttle.py).

predict: (1) records the workload's routing and the prefetch guesses the engine issues (resident run: routing
and guesses depend on the text, not on the budget); (2) measures the compute floor (a resident, unthrottled
decode, a fresh process: the one figure the simulator is fit to, as one scale on this machine's probe-cpu
rates); (3) simulates every grid point by replaying the routing through the simulator with this machine's
probed disk curve capped at the emulated speed. measure: runs every grid point for real, throttled, in a fresh
process each with cold caches, and compares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

BUDGETS = ("160M", "320M", "640M")
POLICIES = ("lru", "lfu")
SPEEDS = ("100M", "400M")  # emulated device read bytes/s


def record(fx: dict, tokens: int, out: Path) -> tuple[Path, Path]:
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    trace, guesses_path = out / "check.trace", out / "check-guesses.json"
    loaded = load_model(fx["coact"], stream=StreamOptions(ram_budget=None, io="pread", prefetch="next-layer",
                                                          trace_out=trace))
    source = loaded.model.source
    steps = {"n": -1}
    guesses: list = []
    begin, prefetch = source.begin_step, source.expert_cache.prefetch

    def counting_begin(n: int) -> None:
        steps["n"] += 1
        begin(n)

    def recording_prefetch(layer: int, ranked) -> int:
        guesses.append([steps["n"], layer, [int(e) for e in ranked]])
        return prefetch(layer, ranked)

    source.begin_step, source.expert_cache.prefetch = counting_begin, recording_prefetch
    for prompt in fx["prompts"]:
        generate(loaded.model, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    source.close()
    guesses_path.write_text(json.dumps(guesses))
    return trace, guesses_path


def this_machine(disk_json: Path, cpu_json: Path, bps: int | None, scale: float):
    from k3serve.sim.machine import ComputeModel, DiskModel, Machine

    raw = json.loads(disk_json.read_text())
    rows = tuple(tuple(min(v, bps) if bps else v for v in row) for row in raw["throughput"])
    disk = DiskModel(tuple(raw["sizes"]), tuple(raw["queue_depths"]), rows)
    c = json.loads(cpu_json.read_text())["compute"]
    compute = ComputeModel(
        dense_bytes_per_s=c["dense_bytes_per_s"] / scale, dense_flops=c["dense_flops"] / scale,
        expert_bytes_per_s=c["expert_bytes_per_s"] / scale, expert_flops=c["expert_flops"] / scale,
        attention_s_per_token_layer=c["attention_s_per_token_layer"] * scale,
        layer_overhead_s=c["layer_overhead_s"] * scale, widen_bytes_per_s=c["widen_bytes_per_s"] / scale)
    return Machine(f"this-machine@{bps or 'raw'}", disk, compute, "probed", "probe-disk / probe-cpu")


def simulate_point(store, trace, guesses, machine, budget: int | None, policy: str):
    from k3serve.sim.full import VirtualStore, replay_config, simulate

    return simulate(replay_config(trace, machine, guesses=guesses, store=VirtualStore.from_store(store),
                                  ram_bytes=budget, policy=policy, prefetch="next-layer", queue_depth=16))


def main() -> int:
    from bench_stream import build_fixture, run_once

    from k3serve.units import parse_size
    from k3serve.stream.options import StreamOptions
    from k3serve.stream.trace import read_trace
    from k3serve.weights.store import PackedStore

    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("predict", "measure"), required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--disk", type=Path, default=Path("docs/sim/this-machine-disk.json"))
    parser.add_argument("--cpu", type=Path, default=Path("docs/sim/this-machine-cpu.json"))
    parser.add_argument("--predictions", type=Path, default=Path("docs/sim/predictions.json"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--speeds", default=",".join(SPEEDS), help="measure only these emulated speeds")
    args = parser.parse_args()

    fx = build_fixture(None, 16, 32)
    store = PackedStore(fx["coact"])
    work = Path(fx["coact"]).parent / "sim-check"
    work.mkdir(exist_ok=True)

    if args.phase == "predict":
        trace_path, guesses_path = record(fx, args.tokens, work)
        trace = read_trace(trace_path)
        guesses = {(s, l): g for s, l, g in json.loads(guesses_path.read_text())}
        resident = run_once(fx["coact"], StreamOptions(ram_budget=None, io="direct", queue_depth=16, cache="lfu",
                                                       prefetch="next-layer"), fx["prompts"], args.tokens, None)
        scale = 1.0
        for _ in range(4):  # fit one compute scale so the simulated resident run takes the measured time
            sim = simulate_point(store, trace, guesses, this_machine(args.disk, args.cpu, None, scale), None, "lfu")
            scale *= resident["s_per_token"] / sim.s_per_token
        sim = simulate_point(store, trace, guesses, this_machine(args.disk, args.cpu, None, scale), None, "lfu")
        points = []
        for speed in SPEEDS:
            machine = this_machine(args.disk, args.cpu, parse_size(speed), scale)
            for budget in BUDGETS:
                for policy in POLICIES:
                    r = simulate_point(store, trace, guesses, machine, parse_size(budget), policy)
                    points.append({"speed": speed, "budget": budget, "policy": policy,
                                   "s_per_token": r.s_per_token, "bytes_per_token": r.bytes_per_token,
                                   "reads_per_token": r.reads_per_token, "retention": r.retention,
                                   "io_seconds_per_token": r.io_seconds_per_token,
                                   "compute_seconds_per_token": r.compute_seconds_per_token})
                    print(f"predict {speed}/s {budget} {policy}: {r.s_per_token:.3f} s/token, "
                          f"{r.bytes_per_token / 2**20:.1f} MiB/token", file=sys.stderr)
        record_out = {"compute_scale": scale, "resident_measured_s_per_token": resident["s_per_token"],
                      "resident_simulated_s_per_token": sim.s_per_token, "tokens": args.tokens,
                      "prompt_tokens": [len(p) for p in fx["prompts"]], "points": points}
        args.json.write_text(json.dumps(record_out, indent=1))
        return 0

    from throttle import Throttle

    predicted = json.loads(args.predictions.read_text())
    rows = []
    for p in predicted["points"]:
        if p["speed"] not in args.speeds.split(","):
            continue
        options = StreamOptions(ram_budget=parse_size(p["budget"]), io="direct", queue_depth=16, cache=p["policy"],
                                prefetch="next-layer")
        with Throttle(store.expert_path, parse_size(p["speed"]), None) as throttle:
            import bench_stream
            original = bench_stream.subprocess.run

            def throttled(command, **kwargs):
                return original(throttle.wrap(command), **kwargs)

            bench_stream.subprocess.run = throttled
            try:
                m = run_once(fx["coact"], options, fx["prompts"], args.tokens, None)
            finally:
                bench_stream.subprocess.run = original
        row = {**{k: p[k] for k in ("speed", "budget", "policy")},
               "predicted_s": p["s_per_token"], "measured_s": m["s_per_token"],
               "predicted_bytes": p["bytes_per_token"], "measured_bytes": m["bytes_per_token"],
               "s_error": p["s_per_token"] / m["s_per_token"] - 1,
               "bytes_error": p["bytes_per_token"] / m["bytes_per_token"] - 1,
               "measured_retention": m["retention"], "predicted_retention": p["retention"],
               "predicted_io_s": p["io_seconds_per_token"],
               "measured_io_wait_s": m["io_wait_s"] / max(m["wall_s"] / m["s_per_token"], 1),
               "measured_compute_s": m["s_per_token"] - m["io_wait_s"] / max(m["wall_s"] / m["s_per_token"], 1),
               "predicted_compute_s": p["compute_seconds_per_token"]}
        rows.append(row)
        print(f"{p['speed']}/s {p['budget']} {p['policy']}: predicted {p['s_per_token']:.3f} measured "
              f"{m['s_per_token']:.3f} s/token ({100 * row['s_error']:+.1f}%); bytes {100 * row['bytes_error']:+.1f}%"
              f"; I/O wait predicted {p['io_seconds_per_token']:.3f} measured {row['measured_io_wait_s']:.3f} s/token",
              file=sys.stderr)
    args.json.write_text(json.dumps({"rows": rows, "predictions": str(args.predictions)}, indent=1))
    worst_s = max(abs(r["s_error"]) for r in rows)
    worst_b = max(abs(r["bytes_error"]) for r in rows)
    print(f"bench_sim_check: {len(rows)} points, worst s/token error {100 * worst_s:.1f}% (target 25%), worst "
          f"bytes/token error {100 * worst_b:.1f}% (target 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
