"""Streaming under a RAM budget: naive (mmap, no expert cache) vs the full stack (O_DIRECT, queue depth, best
policy, next-layer prefetch, co-activation layout), on any packed model; plus cache quality vs Belady, device
utilisation vs sequential O_DIRECT reads, and the trunk/expert split of a fixed budget.

    .venv/bin/python benchmarks/bench_stream.py                   # builds the fixture once (~5 min), then runs
    .venv/bin/python benchmarks/bench_stream.py --store DIR --trace FILE --budget 256M

Fixture (when --store is not given): a random K3 config from k3serve.weights.synthetic with wide experts
(LT = MI = 1536, 24 experts x 12 MoE layers, 3.76 MB per expert, ~1.08 GB expert store). ROUTING THERE IS
RANDOM, NOT LEARNED: caching and prefetch figures on it are a floor, not what a trained model gives.
Cold cache: /proc/sys/vm/drop_caches when writable (we say which), else posix_fadvise(DONTNEED) per file.
Prints one summary line and a JSON record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path


from k3serve.config import tiny_config
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.stream.budget import format_size, parse_size
from k3serve.stream.source import StreamOptions
from k3serve.weights.store import PackedStore

FIXTURE = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench"))
PROMPTS = [[1, 17, 99, 4, 250], [1, 3, 3, 120, 8]]


def bench_config():
    return dataclasses.replace(tiny_config(), num_experts=24, num_experts_per_token=4, latent_size=1536,
                               moe_intermediate_size=1536)


def build_fixture() -> tuple[Path, Path, Path]:
    from k3serve.stream.trace import read_trace
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.synthetic import write_random_checkpoint

    checkpoint, natural, coact = FIXTURE / "checkpoint", FIXTURE / "packed-natural", FIXTURE / "packed-coact"
    trace = FIXTURE / "routing.trace"
    if not (checkpoint / "config.json").exists():
        print("generating the random checkpoint (once)...", file=sys.stderr)
        write_random_checkpoint(bench_config(), checkpoint, seed=1, max_shard_bytes=512 << 20)
    if not (natural / "store.json").exists():
        pack_checkpoint(checkpoint, natural, progress=True)
    if not trace.exists():
        loaded = load_model(natural, stream=StreamOptions(ram_budget=None, trace_out=trace))
        for prompt in PROMPTS:
            generate(loaded.model, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        loaded.model.source.close()
    if not (coact / "store.json").exists():
        pack_checkpoint(checkpoint, coact, layout="coactivation", token_sets=read_trace(trace).token_sets(),
                        progress=True)
    return natural, coact, trace


def drop_caches(paths) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def run_once(store: Path, options: StreamOptions, tokens: int) -> dict:
    s = PackedStore(store)
    method = drop_caches([s.expert_path, s.trunk_path])
    loaded = load_model(store, stream=options)
    source = loaded.model.source
    total_s, total_tokens, outputs = 0.0, 0, []
    before = source.stream_stats()
    for prompt in PROMPTS:
        out, report = generate(loaded.model, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        total_s += report.prefill_seconds + report.decode_seconds
        total_tokens += len(out)
        outputs.append(out)
    stats = source.stream_stats().minus(before)
    source.close()
    return {"s_per_token": total_s / total_tokens, "bytes_per_token": stats.bytes_read / total_tokens,
            "reads_per_token": stats.num_reads / total_tokens, "retention": stats.retention,
            "io_wait_s": stats.io_wait_seconds, "wall_s": total_s, "bytes_read": stats.bytes_read,
            "io_busy_s": stats.io_busy_seconds, "slots": source.plan.expert_slots, "cold": method,
            "outputs": outputs}


def sequential_direct_mbps(path: Path, chunk: int = 8 << 20, limit: int = 1 << 30) -> float:
    import mmap
    drop_caches([path])
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, chunk)
    done, started = 0, time.perf_counter()
    while done < min(limit, os.path.getsize(path)):
        n = os.preadv(fd, [buffer], done)
        if n <= 0:
            break
        done += n
    os.close(fd)
    return done / 2**20 / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=Path, default=None, help="packed store for the naive runs")
    parser.add_argument("--store-full", type=Path, default=None, help="packed store (co-activation layout)")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--budget", default=None, help="default: expert store / 4.5")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--policy", default="lfu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.store is None:
        natural, coact, trace = build_fixture()
    else:
        natural, coact, trace = args.store, args.store_full or args.store, args.trace
    store = PackedStore(natural)
    budget = parse_size(args.budget) if args.budget else int(store.expert_store_bytes / 4.5)
    naive = StreamOptions(ram_budget=budget, io="mmap", cache="none", prefetch="none", queue_depth=1)
    full = StreamOptions(ram_budget=budget, io="direct", queue_depth=args.queue_depth, cache=args.policy,
                         prefetch="next-layer")
    runs: dict[str, list[dict]] = {"naive": [], "full": []}
    for _ in range(args.rounds):  # alternated: A B A B
        runs["naive"].append(run_once(natural, naive, args.tokens))
        runs["full"].append(run_once(coact, full, args.tokens))
    assert all(r["outputs"] == runs["naive"][0]["outputs"] for r in runs["naive"] + runs["full"]), \
        "streamed outputs differ between configurations"
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("s_per_token", "bytes_per_token", "reads_per_token",
                                                                "retention", "io_wait_s", "wall_s", "bytes_read")}
           for k, v in runs.items()}
    speedup = med["naive"]["s_per_token"] / med["full"]["s_per_token"]

    # cache quality: the same trace, capacity = the full stack's slots
    from k3serve.sim.cache_replay import replay_all
    from k3serve.stream.trace import read_trace
    t = read_trace(trace)
    capacity = runs["full"][0]["slots"]
    sim = {r.policy: r.bytes_per_token for r in replay_all(t.requests(), [capacity], t.num_tokens,
                                                           store.expert_blob_size, working_slots=4)}
    ratio_default = sim[args.policy] / sim["belady"] if sim["belady"] else float("nan")

    seq = sequential_direct_mbps(store.expert_path)
    full_mbps = med["full"]["bytes_read"] / 2**20 / max(med["full"]["io_wait_s"], 1e-9)
    utilisation = full_mbps / seq

    split = {}
    for pin in ("0", None):
        r = run_once(coact, dataclasses.replace(full, pin_trunk_bytes=parse_size(pin) if pin else None), args.tokens)
        split["no pinned trunk" if pin else "trunk first"] = r["s_per_token"]

    record = {"budget_bytes": budget, "expert_store_bytes": store.expert_store_bytes, "cold_cache": runs["naive"][0]["cold"],
              "median": med, "speedup": speedup, "sim_bytes_per_token": sim, "default_vs_belady": ratio_default,
              "capacity_slots": capacity, "sequential_direct_MBps": seq, "full_stack_MBps_during_io_wait": full_mbps,
              "device_utilisation": utilisation, "split_s_per_token": split, "cpu_count": os.cpu_count(),
              "rounds": args.rounds, "tokens_per_prompt": args.tokens, "policy": args.policy,
              "queue_depth": args.queue_depth}
    print(f"bench_stream: budget {format_size(budget)} for a {format_size(store.expert_store_bytes)} expert store: "
          f"naive {med['naive']['s_per_token']:.3f} s/token, full {med['full']['s_per_token']:.3f} s/token "
          f"({speedup:.2f}x); {args.policy} {ratio_default:.2f}x Belady bytes; device utilisation "
          f"{100 * utilisation:.0f}% of {seq:.0f} MB/s sequential O_DIRECT; cold cache via {record['cold_cache']}")
    for r in runs.values():
        for x in r:
            x.pop("outputs")
    record["runs"] = runs
    print(json.dumps(record, indent=1, default=float))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
