"""Expert parallelism on a local Ray: the experts of every MoE layer split over 2 and 4 owners, each under the same
RAM budget as one node, against that one node (k3serve.cluster.expert_parallel).

Fixture: bench_stream.py's widened trained model (every expert 16x in its units, 32x in its latent: 448 experts of
3.2 MiB, a 1.4 GiB expert store; the same function and the same learned routing as the shipped model), packed
natural, and shards i/2 and i/4 of it (`k3serve pack --shard`), built once under $K3BENCH_DIR.

Runs, alternated per round, each from a cold start (fresh processes and caches), with O_DIRECT reads (--io):
- 1 node: one process streams trunk and experts under --budget (`--ram-budget`).
- EP x N: the front holds the trunk (every layer pinned; it reads no expert) and N owner actors (one logical CPU and
  one thread each) hold shard i/N of the experts, each under --budget for its expert cache.
Every process computes with one thread (this machine has 2 cores for all of them: s/token here is a one-box
stand-in for N boxes, with the calls' cost and none of a real network's latency).

Workload: --prompts held-out windows of --prompt-tokens tokens, one after another; each is prefilled, then
--decode greedy tokens are decoded one by one. Figures are over the decode steps only (the prefill counted apart):
s/token (wall time of a decode step, calls included), expert bytes read per token and retention per node (a
request is retained only if its expert was resident before the step), network payload bytes per token (latent
rows out, expert rows back; Ray's own framing not counted), and the front's time waiting on owner calls.
Medians over rounds; ratios to the 1-node run of the same round.

    PYTHONPATH=src python benchmarks/bench_expert_parallel.py [--rounds 2] [--budget 256M]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_stream import FIXTURE_ROOT, build_fixture, heldout_windows  # noqa: E402

from k3serve.host import describe_host  # noqa: E402
from k3serve.units import format_size, parse_size  # noqa: E402


def shards_for(packed: Path, count: int) -> list[Path]:
    from k3serve.weights.shard import ShardSpec, is_expert_shard, pack_shard

    paths = [packed.parent / f"shards-of-{count}" / f"shard-{i}" for i in range(count)]
    for i, path in enumerate(paths):
        if not is_expert_shard(path):
            print(f"packing shard {i}/{count} (once)...", file=sys.stderr)
            pack_shard(packed, path, ShardSpec(i, count))
    return paths


def measure(model, prompts: list[list[int]], decode: int, snapshot) -> dict:
    """Prefill each prompt, then decode `decode` greedy tokens; counters and time over the decode steps only."""
    from k3serve.model.interface import ForwardItem

    seconds, tokens, deltas = 0.0, 0, None
    for prompt in prompts:
        cache = model.new_cache()
        logits = model.forward([ForwardItem(np.asarray(prompt, np.int64), cache)]).logits[0][-1]
        before = snapshot()
        start = time.perf_counter()
        for _ in range(decode):
            token = int(np.argmax(logits))
            logits = model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]
        seconds += time.perf_counter() - start
        tokens += decode
        after = snapshot()
        delta = [a.minus(b) if hasattr(a, "minus") else a - b for a, b in zip(after, before)]
        deltas = delta if deltas is None else [d.plus(e) if hasattr(d, "plus") else d + e
                                               for d, e in zip(deltas, delta)]
    return {"seconds": seconds, "tokens": tokens, "deltas": deltas}


def node_record(stats, tokens: int) -> dict:
    return {"expert_bytes_per_token": stats.expert_bytes_read / tokens,
            "trunk_bytes_per_token": stats.trunk_bytes_read / tokens,
            "retention": stats.retention if stats.expert_requests else None,
            "expert_requests_per_token": stats.expert_requests / tokens}


def run_single(packed: Path, budget: int, io: str, prompts, decode: int) -> dict:
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    loaded = load_model(packed, stream=StreamOptions(ram_budget=budget, io=io))
    source = loaded.model.source
    try:
        result = measure(loaded.model, prompts, decode, lambda: [source.stats().stream])
    finally:
        source.close()
    tokens = result["tokens"]
    (stats,) = result["deltas"]
    return {"s_per_token": result["seconds"] / tokens, "nodes": [node_record(stats, tokens)],
            "expert_slots": [source.slots.num_slots], "network_bytes_per_token": 0.0, "wait_share": 0.0}


def run_ep(packed: Path, shards: list[Path], budget: int, io: str, prompts, decode: int) -> dict:
    from k3serve.cluster.expert_actors import load_expert_parallel
    from k3serve.cluster.expert_parallel import trunk_budget
    from k3serve.stream.options import StreamOptions
    from k3serve.stream.shard_source import ShardOptions
    from k3serve.weights.store import PackedStore

    store = PackedStore(packed)
    ep = load_expert_parallel(packed, shards, StreamOptions(ram_budget=trunk_budget(store), io=io),
                              ShardOptions(ram_budget=budget, io=io))
    source = ep.source
    net = source.network

    def snapshot():
        return [source.inner.stats().stream, *source.stats().owners, net.bytes_total, net.wait_seconds, net.calls]

    try:
        result = measure(ep.loaded.model, prompts, decode, snapshot)
    finally:
        source.close()
    tokens = result["tokens"]
    front, *rest = result["deltas"]
    owners, (net_bytes, wait, calls) = rest[:-3], rest[-3:]
    return {"s_per_token": result["seconds"] / tokens, "front": node_record(front, tokens),
            "nodes": [node_record(s, tokens) for s in owners], "expert_slots": [i.slots for i in source.infos],
            "network_bytes_per_token": net_bytes / tokens, "calls_per_token": calls / tokens,
            "wait_share": wait / result["seconds"]}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", default="256M", help="RAM budget per node (the 1-node run: trunk + experts; "
                                                        "an owner: its expert cache)")
    parser.add_argument("--owners", default="2,4", help="owner counts to run")
    parser.add_argument("--io", default="direct", choices=("pread", "direct"))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--decode", type=int, default=16)
    args = parser.parse_args()
    budget = parse_size(args.budget)
    counts = [int(c) for c in args.owners.split(",")]

    import numba
    from threadpoolctl import threadpool_limits

    numba.set_num_threads(1)  # one thread per node, the front included (the owners: one each, by their env)
    threadpool_limits(limits=1)
    fixture = build_fixture(None, 16, 32)
    packed = fixture["natural"]
    shards = {n: shards_for(packed, n) for n in counts}
    from k3serve.tokenizer import Tokenizer

    prompts = heldout_windows(Tokenizer.from_dir(packed), args.prompts, args.prompt_tokens, skip=60)
    print(f"machine: {describe_host()}")
    from k3serve.cluster.runtime import start_ray

    start_ray(None, num_cpus=max(counts), replicas=max(counts))
    import ray

    runs = ["1 node"] + [f"EP x{n}" for n in counts]
    results: dict[str, list[dict]] = {name: [] for name in runs}
    try:
        for round_index in range(args.rounds):
            for name in runs:
                if name == "1 node":
                    record = run_single(packed, budget, args.io, prompts, args.decode)
                else:
                    n = int(name.split("x")[1])
                    record = run_ep(packed, shards[n], budget, args.io, prompts, args.decode)
                results[name].append(record)
                nodes = record["nodes"]
                per_node = " ".join(format_size(n["expert_bytes_per_token"]) for n in nodes)
                retention = " ".join(_ratio(n["retention"]) for n in nodes)
                print(f"round {round_index + 1} {name:7s}: {record['s_per_token']:.3f} s/token, expert bytes/token "
                      f"per node {per_node}, retention {retention}, network "
                      f"{format_size(record['network_bytes_per_token'])}/token, waiting on owners "
                      f"{100 * record['wait_share']:.0f}%", flush=True)
    finally:
        ray.shutdown()

    def med(name: str, key) -> float:
        return statistics.median(key(r) for r in results[name])

    summary = {}
    for name in runs:
        summary[name] = {
            "s_per_token": med(name, lambda r: r["s_per_token"]),
            "s_per_token_vs_1_node": statistics.median(
                r["s_per_token"] / one["s_per_token"] for r, one in zip(results[name], results["1 node"])),
            "expert_bytes_per_token_per_node": [statistics.median(r["nodes"][i]["expert_bytes_per_token"]
                                                                  for r in results[name])
                                                for i in range(len(results[name][0]["nodes"]))],
            "expert_bytes_per_token_all_nodes": med(name, lambda r: sum(n["expert_bytes_per_token"]
                                                                        for n in r["nodes"])),
            "retention_per_node": [_median_or_none([r["nodes"][i]["retention"] for r in results[name]])
                                   for i in range(len(results[name][0]["nodes"]))],
            "expert_slots_per_node": results[name][0]["expert_slots"],
            "network_bytes_per_token": med(name, lambda r: r["network_bytes_per_token"]),
            "wait_share": med(name, lambda r: r["wait_share"]),
        }
    one = summary["1 node"]
    parts = [f"1 node {one['s_per_token']:.3f} s/token, {format_size(one['expert_bytes_per_token_all_nodes'])}/token "
             f"read, retention {_ratio(one['retention_per_node'][0])}"]
    for name in runs[1:]:
        s = summary[name]
        parts.append(f"{name} {s['s_per_token']:.3f} s/token ({s['s_per_token_vs_1_node']:.2f}x), "
                     f"{format_size(s['expert_bytes_per_token_all_nodes'])}/token read in all, retention "
                     f"{'/'.join(_ratio(r) for r in s['retention_per_node'])}, network "
                     f"{format_size(s['network_bytes_per_token'])}/token")
    print(f"summary (budget {format_size(budget)} per node, {args.io}): " + "; ".join(parts))
    print(json.dumps({"benchmark": "expert_parallel", "args": vars(args), "machine": describe_host(),
                      "fixture": str(packed), "fixture_root": str(FIXTURE_ROOT), "summary": summary,
                      "runs": results}))


if __name__ == "__main__":
    main()
