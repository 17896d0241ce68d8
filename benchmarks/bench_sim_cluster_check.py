"""Predict, then measure: the simulator's cluster mode against bench_expert_parallel.py on this machine.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_sim_cluster_check.py --phase predict \
        --json docs/sim/cluster-predictions.json
    PYTHONPATH=src .venv/bin/python benchmarks/bench_sim_cluster_check.py --phase measure \
        --predictions docs/sim/cluster-predictions.json --json docs/sim/cluster-check.json

Workload: bench_expert_parallel.py's (its fixture, its held-out prompts, decode steps only, 256 MiB per node, O_DIRECT,
one compute thread per process): 1 node, and expert parallelism over 2 and 4 owners on one local Ray.

predict: (1) records the workload's routing (a resident run: routing depends on the text, not on the budget, and
expert parallelism gives the bits of one process); (2) measures the compute floor, the resident decode, as the one
figure the simulator is fit to (one scale on this machine's probe-cpu rates, as bench_sim_check.py); (3) measures
Ray's local calls (1, 2 and 4 calls in flight to as many actors, and one carrying 1 MiB: the call latency, the
front's overhead per call and the bytes/s of the "network", not fitted to the benchmark); (4) simulates the three runs by replaying the routing: 1 node through
`simulate`, the owners through `simulate_cluster` on one box (one disk: this machine's probed curve; the owners'
compute shares this machine's cores). measure: runs bench_expert_parallel.py and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_expert_parallel import measure, shards_for  # noqa: E402
from bench_sim_check import this_machine  # noqa: E402
from bench_stream import build_fixture, heldout_windows  # noqa: E402

BUDGET = "256M"
COUNTS = (2, 4)


def record_resident(packed: Path, prompts, decode: int, trace: Path, repeats: int) -> float:
    """Record the routing once; the resident decode's s/token, median of `repeats` fresh loads."""
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    times = []
    for i in range(repeats):
        loaded = load_model(packed, stream=StreamOptions(ram_budget=None, io="direct",
                                                         trace_out=trace if i == 0 else None))
        source = loaded.model.source
        try:
            result = measure(loaded.model, prompts, decode, lambda: [source.stats().stream])
        finally:
            source.close()
        times.append(result["seconds"] / result["tokens"])
    return statistics.median(times)


def measure_ray_calls(calls: int = 40) -> dict:
    """Ray's local calls to actors of one CPU and one thread each (as expert owners): the round trip of n calls in
    flight at once to n actors, each carrying 24 KiB out and a small reply (n = 1, 2, 4; what a MoE layer issues),
    fits t(n) = latency + n x overhead; bytes/s from one call carrying 1 MiB against one carrying 24 KiB. Medians."""
    import ray

    from k3serve.cluster.spec import SINGLE_THREAD_ENV

    @ray.remote
    class Echo:
        def run(self, x: np.ndarray) -> np.ndarray:
            return x[:16]

    actors = [Echo.options(num_cpus=1, runtime_env={"env_vars": SINGLE_THREAD_ENV}).remote() for _ in range(4)]

    def timed(n: int, nbytes: int) -> float:
        x = np.zeros(nbytes // 4, np.float32)
        ray.get([a.run.remote(x) for a in actors[:n]])
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get([a.run.remote(x) for a in actors[:n]])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    counts = (1, 2, 4)
    together = [timed(n, 24 << 10) for n in counts]
    large = timed(1, 1 << 20)
    for actor in actors:
        ray.kill(actor)
    overhead, latency = np.polyfit(counts, together, 1)
    return {"call_latency_s": max(float(latency), 0.0), "call_overhead_s": max(float(overhead), 0.0),
            "bytes_per_s": ((1 << 20) - (24 << 10)) / max(large - together[0], 1e-9),
            "calls_in_flight": list(counts), "round_trip_s": together, "one_call_1MiB_s": large}


def predict(args, packed: Path, prompts) -> dict:
    from k3serve.cluster.expert_parallel import trunk_budget
    from k3serve.cluster.runtime import start_ray
    from k3serve.sim.cluster import ClusterConfig, simulate_cluster
    from k3serve.sim.full import VirtualStore, replay_config, simulate
    from k3serve.sim.machine import NetworkModel
    from k3serve.units import parse_size
    from k3serve.stream.trace import read_trace
    from k3serve.weights.store import PackedStore

    import ray

    work = packed.parent / "sim-cluster-check"
    work.mkdir(exist_ok=True)
    trace_path = work / "routing.trace"
    resident = record_resident(packed, prompts, args.decode, trace_path, args.resident_repeats)
    start_ray(None, num_cpus=max(COUNTS), replicas=max(COUNTS))
    try:
        ray_call = measure_ray_calls()
    finally:
        ray.shutdown()
    network = NetworkModel(bytes_per_s=ray_call["bytes_per_s"], call_latency_s=ray_call["call_latency_s"],
                           call_overhead_s=ray_call["call_overhead_s"])
    store = PackedStore(packed)
    trace = read_trace(trace_path)
    virtual = VirtualStore.from_store(store)
    budget = parse_size(BUDGET)
    cores = os.cpu_count() or 1

    def one_node(machine, ram):
        return simulate(replay_config(trace, machine, store=virtual, ram_bytes=ram, policy="lru", prefetch="none",
                                      queue_depth=16))

    scale = 1.0
    for _ in range(4):  # one compute scale: the simulated resident decode takes the measured time
        scale *= resident / one_node(this_machine(args.disk, args.cpu, None, scale), None).s_per_token
    machine = this_machine(args.disk, args.cpu, None, scale)
    single = one_node(machine, budget)
    runs = {"1 node": {"s_per_token": single.s_per_token, "expert_bytes_per_token_per_node":
                       [single.expert_bytes_per_token], "retention_per_node": [single.retention],
                       "network_bytes_per_token": 0.0, "expert_slots_per_node": [single.plan["expert_slots"]]}}
    for n in COUNTS:
        front = replay_config(trace, machine, store=virtual, ram_bytes=trunk_budget(store), prefetch="none",
                              queue_depth=16)
        r = simulate_cluster(ClusterConfig(front, n, budget, network, node_policy="lru", node_queue_depth=16,
                                           one_box=True, one_box_cores=cores))
        runs[f"EP x{n}"] = {"s_per_token": r.s_per_token,
                            "expert_bytes_per_token_per_node": [x.expert_bytes_per_token for x in r.nodes],
                            "retention_per_node": [x.retention for x in r.nodes],
                            "network_bytes_per_token": r.network_bytes_per_token,
                            "expert_slots_per_node": [x.slots for x in r.nodes],
                            "owner_wait_s_per_token": r.owner_wait_seconds_per_token,
                            "network_s_per_token": r.network_seconds_per_token}
    for name, run in runs.items():
        run["s_per_token_vs_1_node"] = run["s_per_token"] / runs["1 node"]["s_per_token"]
        print(f"predict {name:7s}: {run['s_per_token']:.3f} s/token ({run['s_per_token_vs_1_node']:.2f}x), expert "
              f"MiB/token per node {' '.join(f'{b / 2**20:.1f}' for b in run['expert_bytes_per_token_per_node'])}, "
              f"retention {' '.join(f'{x:.2f}' for x in run['retention_per_node'])}, network "
              f"{run['network_bytes_per_token'] / 1024:.0f} KiB/token", file=sys.stderr)
    return {"budget": BUDGET, "decode": args.decode, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "compute_scale": scale, "resident_measured_s_per_token": resident, "ray_call": ray_call,
            "cores": cores, "runs": runs}


def compare(predicted: dict, measured: dict) -> dict:
    rows = {}
    for name, p in predicted["runs"].items():
        m = measured["summary"][name]
        rows[name] = {
            "predicted_s": p["s_per_token"], "measured_s": m["s_per_token"],
            "predicted_ratio": p["s_per_token_vs_1_node"], "measured_ratio": m["s_per_token_vs_1_node"],
            "ratio_error": p["s_per_token_vs_1_node"] / m["s_per_token_vs_1_node"] - 1,
            "s_error": p["s_per_token"] / m["s_per_token"] - 1,
            "predicted_bytes_per_node": p["expert_bytes_per_token_per_node"],
            "measured_bytes_per_node": m["expert_bytes_per_token_per_node"],
            "bytes_error": [a / b - 1 if b else 0.0 for a, b in zip(p["expert_bytes_per_token_per_node"],
                                                                  m["expert_bytes_per_token_per_node"])],
            "predicted_retention": p["retention_per_node"], "measured_retention": m["retention_per_node"],
            "predicted_network": p["network_bytes_per_token"], "measured_network": m["network_bytes_per_token"],
        }
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("predict", "measure"), required=True)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="measure: bench_expert_parallel.py rounds")
    parser.add_argument("--resident-repeats", type=int, default=3)
    parser.add_argument("--disk", type=Path, default=Path("docs/sim/this-machine-disk.json"))
    parser.add_argument("--cpu", type=Path, default=Path("docs/sim/this-machine-cpu.json"))
    parser.add_argument("--predictions", type=Path, default=Path("docs/sim/cluster-predictions.json"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    if args.phase == "measure":
        predicted = json.loads(args.predictions.read_text())
        command = [sys.executable, str(Path(__file__).parent / "bench_expert_parallel.py"), "--rounds",
                   str(args.rounds), "--budget", predicted["budget"], "--owners", ",".join(map(str, COUNTS)),
                   "--io", "direct", "--prompts", str(predicted["prompts"]), "--prompt-tokens",
                   str(predicted["prompt_tokens"]), "--decode", str(predicted["decode"])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        sys.stderr.write(done.stderr[-2000:])
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("{")), file=sys.stderr)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        rows = compare(predicted, measured)
        for name, r in rows.items():
            print(f"{name:7s}: s/token predicted {r['predicted_s']:.3f} measured {r['measured_s']:.3f} "
                  f"({100 * r['s_error']:+.1f}%); vs 1 node predicted {r['predicted_ratio']:.2f}x measured "
                  f"{r['measured_ratio']:.2f}x ({100 * r['ratio_error']:+.1f}%); bytes per node "
                  f"{' '.join(f'{100 * e:+.1f}%' for e in r['bytes_error'])}")
        args.json.write_text(json.dumps({"command": command, "predictions": str(args.predictions), "rows": rows,
                                         "measured": measured["summary"], "machine": measured["machine"]},
                                        indent=1))
        return 0

    import numba
    from threadpoolctl import threadpool_limits

    from k3serve.tokenizer import Tokenizer

    numba.set_num_threads(1)  # as bench_expert_parallel.py: one compute thread per process
    threadpool_limits(limits=1)
    fixture = build_fixture(None, 16, 32)
    packed = fixture["natural"]
    for n in COUNTS:
        shards_for(packed, n)
    prompts = heldout_windows(Tokenizer.from_dir(packed), args.prompts, args.prompt_tokens, skip=60)
    args.json.write_text(json.dumps(predict(args, packed, prompts), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
