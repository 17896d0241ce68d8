"""Streaming under a RAM budget: naive (mmap, no expert cache) vs the full stack (O_DIRECT, queue depth, a cache
policy, next-layer prefetch, co-activation layout), on a model with learned routing; plus cache quality vs Belady,
a policy / prefetch sweep, device utilisation vs sequential O_DIRECT reads, and the trunk/expert budget split.

    .venv/bin/python benchmarks/bench_stream.py --json out.json      # builds the fixture once, then runs

Fixture: the shipped trained model (docs/MODEL.md) with every expert widened 16x in its units and 32x in its latent
(--inner/--latent)
by exact duplication (k3serve.weights.widen: the same function, so the same learned routing), packed natural and
co-activation. The co-activation layout, the pinned profile and the Belady replay use a routing trace recorded on
held-out stdlib code and prose; the timed prompts are other held-out windows.

The same machine for both: each run is a fresh process confined to a cgroup-v1 memory limit of budget + overhead
(page cache included), so the naive run's page cache gets the same RAM as the full stack's expert cache, as on a
machine with that much memory. Without a writable memory cgroup the runs are unconfined and the report says so.
Cold cache: /proc/sys/vm/drop_caches before every run (else posix_fadvise DONTNEED; the report says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIXTURE_ROOT = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench-trained"))
CGROUP = Path("/sys/fs/cgroup/memory/k3bench")


# ------------------------------------------------------------------------------------------------ fixture
def heldout_windows(tokenizer, count: int, length: int, skip: int = 0) -> list[list[int]]:
    """Alternating held-out code and prose windows of `length` tokens, from window index `skip` on."""
    from k3serve.training.corpus import build_corpus

    corpus = build_corpus()
    streams = [tokenizer.encode("".join(corpus.heldout_code)), tokenizer.encode("".join(corpus.heldout_prose))]
    out = []
    for i in range(skip, skip + count):
        ids = streams[i % 2]
        start = (i // 2) * length
        out.append([tokenizer.bos_id] + ids[start:start + length - 1])
    return out


def build_fixture(source_model: Path | None, inner: int, latent: int) -> dict:
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import default_model_dir, load_model
    from k3serve.stream.options import StreamOptions
    from k3serve.stream.trace import read_trace
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.widen import widen_experts

    src = source_model or default_model_dir()
    # one folder per (source checkpoint, widening): a retrained model never reuses a stale fixture
    key = hashlib.sha256((Path(src) / "SHA256SUMS").read_bytes()).hexdigest()[:12]
    folder = FIXTURE_ROOT / f"{key}-x{inner}-x{latent}"
    checkpoint, natural, coact = folder / "checkpoint", folder / "packed-natural", folder / "packed-coact"
    trace = folder / "routing.trace"
    folder.mkdir(parents=True, exist_ok=True)
    if not (checkpoint / "config.json").exists():
        print(f"widening {src} x{inner} units x{latent} latent (once)...", file=sys.stderr)
        widen_experts(src, checkpoint, inner=inner, latent=latent, progress=True)
    if not (natural / "store.json").exists():
        pack_checkpoint(checkpoint, natural, progress=True)
    loaded = load_model(natural, stream=StreamOptions(ram_budget=None))
    tokenizer = loaded.tokenizer
    loaded.model.source.close()
    if not trace.exists():
        loaded = load_model(natural, stream=StreamOptions(ram_budget=None, trace_out=trace))
        for window in heldout_windows(tokenizer, 8, 96):  # prefill 96 tokens + decode 8, per window
            generate(loaded.model, window, SamplingParams(max_tokens=8, ignore_eos=True))
        loaded.model.source.close()
    if not (coact / "store.json").exists():
        pack_checkpoint(checkpoint, coact, layout="coactivation", token_sets=read_trace(trace).token_sets(),
                        progress=True)
    prompts = heldout_windows(tokenizer, 2, 24, skip=40)  # not the trace's windows
    return {"natural": natural, "coact": coact, "trace": trace, "prompts": prompts, "source_model": str(src)}


# ------------------------------------------------------------------------------------------------ one run
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


def worker(spec: dict) -> dict:
    """Runs in the confined child: load under the options, generate on every prompt, report."""
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    options = StreamOptions(**{k: (Path(v) if k in ("cache_profile", "trace_out") and v else v)
                               for k, v in spec["options"].items()})
    loaded = load_model(spec["store"], stream=options)
    source = loaded.model.source
    # decode only (as the run report does): the first token comes out of the prefill, whose reads are counted apart
    decode_s, decode_steps, prefill_s, outputs = 0.0, 0, 0.0, []
    decode_stats = prefill_stats = None
    for prompt in spec["prompts"]:
        before = source.stats().stream
        marks = []
        out, report = generate(loaded.model, prompt, SamplingParams(max_tokens=spec["tokens"], ignore_eos=True),
                               on_token=lambda _t: marks.append(source.stats().stream) if not marks else None)
        after = source.stats().stream
        prefill_s += report.prefill_seconds
        decode_s += report.decode_seconds
        decode_steps += len(out) - 1
        p, d = marks[0].minus(before), after.minus(marks[0])
        prefill_stats = p if prefill_stats is None else prefill_stats.plus(p)
        decode_stats = d if decode_stats is None else decode_stats.plus(d)
        outputs.append(out)
    source.close()
    import resource
    return {"s_per_token": decode_s / decode_steps, "bytes_per_token": decode_stats.bytes_read / decode_steps,
            "reads_per_token": decode_stats.num_reads / decode_steps, "retention": decode_stats.retention,
            "io_wait_s": decode_stats.io_wait_seconds, "wall_s": decode_s, "bytes_read": decode_stats.bytes_read,
            "io_busy_s": decode_stats.io_busy_seconds, "prefill_s": prefill_s,
            "prefetch_hit_share": decode_stats.expert_prefetch_hits / max(decode_stats.expert_requests, 1),
            "prefetch_wasted": decode_stats.prefetch_wasted, "prefetch_issued": decode_stats.prefetch_issued,
            "prefill_bytes": prefill_stats.bytes_read, "slots": source.plan.expert_slots,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "outputs": outputs}


def cgroup_ready(limit: int) -> bool:
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
        return int((CGROUP / "memory.limit_in_bytes").read_text()) >= limit - 4096
    except OSError:
        return False


def run_once(store: Path, options, prompts, tokens: int, confine: int | None) -> dict:
    from k3serve.weights.store import PackedStore

    s = PackedStore(store)
    cold = drop_caches([s.expert_path, s.trunk_path])
    spec = {"store": str(store), "options": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in dataclasses.asdict(options).items()},
            "prompts": prompts, "tokens": tokens}
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    if confine is not None:
        if not cgroup_ready(confine):
            raise RuntimeError("memory cgroup not writable")
        command = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cold"] = cold
    return result


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


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help="trained checkpoint to widen (default: embedded)")
    parser.add_argument("--inner", type=int, default=16, help="widen expert units by this power of two")
    parser.add_argument("--latent", type=int, default=32, help="widen the MoE latent by this power of two")
    parser.add_argument("--budget", default=None, help="default: expert store / 4.5")
    parser.add_argument("--overhead", default="512M", help="cgroup limit = budget + this (interpreter, activations)")
    parser.add_argument("--no-confine", action="store_true", help="do not use a memory cgroup")
    parser.add_argument("--tokens", type=int, default=16, help="generated per prompt; figures are per decode step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--policy", default="lfu")
    parser.add_argument("--sweep", action="store_true", help="also run every policy and prefetch off (one round)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--prepare", action="store_true", help="only build the fixture (untimed), then exit")
    args = parser.parse_args()
    if args.worker is not None:
        result = worker(json.loads(args.worker))
        print(json.dumps(result))
        return 0

    from k3serve.sim.cache_replay import replay_all
    from k3serve.units import format_size, parse_size
    from k3serve.stream.options import StreamOptions
    from k3serve.stream.trace import read_trace
    from k3serve.weights.store import PackedStore

    fx = build_fixture(args.model, args.inner, args.latent)
    if args.prepare:
        print(f"fixture ready: {fx['natural'].parent}", file=sys.stderr)
        return 0
    natural, coact, trace, prompts = fx["natural"], fx["coact"], fx["trace"], fx["prompts"]
    store = PackedStore(natural)
    budget = parse_size(args.budget) if args.budget else int(store.expert_store_bytes / 4.5)
    limit = None if args.no_confine else budget + parse_size(args.overhead)
    if limit is not None and not cgroup_ready(limit):
        print("no writable memory cgroup: runs are NOT confined (naive gets the whole page cache)", file=sys.stderr)
        limit = None
    naive = StreamOptions(ram_budget=budget, io="mmap", cache="none", prefetch="none", queue_depth=1)
    full = StreamOptions(ram_budget=budget, io="direct", queue_depth=args.queue_depth, cache=args.policy,
                         prefetch="next-layer", cache_profile=trace if args.policy == "pinned" else None)
    runs: dict[str, list[dict]] = {"naive": [], "full": []}
    for _ in range(args.rounds):  # alternated: A B A B
        runs["naive"].append(run_once(natural, naive, prompts, args.tokens, limit))
        runs["full"].append(run_once(coact, full, prompts, args.tokens, limit))
        print(f"round: naive {runs['naive'][-1]['s_per_token']:.3f} s/token, full "
              f"{runs['full'][-1]['s_per_token']:.3f} s/token", file=sys.stderr)
    reference = runs["naive"][0]["outputs"]
    assert all(r["outputs"] == reference for r in runs["naive"] + runs["full"]), "streamed outputs differ"
    keys = ("s_per_token", "bytes_per_token", "reads_per_token", "retention", "io_wait_s", "wall_s", "bytes_read",
            "prefill_s", "prefill_bytes", "prefetch_hit_share",
            "peak_rss_mb")
    med = {k: {m: statistics.median(r[m] for r in v) for m in keys} for k, v in runs.items()}
    speedup = med["naive"]["s_per_token"] / med["full"]["s_per_token"]

    sweep = {}
    if args.sweep:
        for policy in ("none", "lru", "lfu", "s3fifo", "pinned"):
            for prefetch in ("none", "next-layer"):
                options = dataclasses.replace(full, cache=policy, prefetch=prefetch,
                                              cache_profile=trace if policy == "pinned" else None)
                r = run_once(coact, options, prompts, args.tokens, limit)
                assert r["outputs"] == reference
                sweep[f"{policy}/{prefetch}"] = {m: r[m] for m in ("s_per_token", "bytes_per_token", "retention",
                                                                   "prefetch_hit_share")}
                print(f"sweep {policy:>7} prefetch {prefetch:>10}: {r['s_per_token']:.3f} s/token, "
                      f"{r['bytes_per_token'] / 2**20:.1f} MiB/token, retention {100 * r['retention']:.1f}%",
                      file=sys.stderr)

    t = read_trace(trace)
    capacity = runs["full"][0]["slots"]
    sim = {r.policy: r.bytes_per_token for r in replay_all(t.requests(), [capacity], t.num_tokens,
                                                           store.expert_blob_size, working_slots=4)}
    ratio_default = sim[args.policy] / sim["belady"] if sim["belady"] else float("nan")

    seq = sequential_direct_mbps(store.expert_path)
    # average read throughput over the whole decode wall time (compute included): a lower bound on the device's
    # throughput while reads are in flight. (bytes / I/O-wait time overstates it: reads overlap compute.)
    full_mbps = med["full"]["bytes_read"] / 2**20 / max(med["full"]["wall_s"], 1e-9)
    utilisation = full_mbps / seq
    # the compute floor: the same model and prompts with every expert resident once read (no budget, unconfined)
    resident = run_once(coact, StreamOptions(ram_budget=None, io="pread", queue_depth=args.queue_depth, cache="lfu"),
                        prompts, args.tokens, None)
    assert resident["outputs"] == reference

    split = {}
    for pin in ("0", None):
        r = run_once(coact, dataclasses.replace(full, pin_trunk_bytes=parse_size(pin) if pin else None), prompts,
                     args.tokens, limit)
        split["no pinned trunk" if pin else "trunk first"] = r["s_per_token"]

    record = {"fixture": {k: str(v) for k, v in fx.items() if k != "prompts"}, "widen": [args.inner, args.latent],
              "budget_bytes": budget, "expert_store_bytes": store.expert_store_bytes,
              "expert_blob_bytes": store.expert_blob_size, "confined_to_bytes": limit,
              "cold_cache": runs["naive"][0]["cold"], "median": med, "speedup": speedup, "sweep": sweep,
              "sim_bytes_per_token": sim, "default_vs_belady": ratio_default, "capacity_slots": capacity,
              "sequential_direct_MBps": seq, "full_stack_MBps_over_decode_wall": full_mbps,
              "resident_floor_s_per_token": resident["s_per_token"],
              "best_possible_speedup": med["naive"]["s_per_token"] / resident["s_per_token"],
              "device_utilisation": utilisation, "split_s_per_token": split, "cpu_count": os.cpu_count(),
              "rounds": args.rounds, "tokens_per_prompt": args.tokens, "prompt_tokens": [len(p) for p in prompts],
              "policy": args.policy, "queue_depth": args.queue_depth}
    print(f"bench_stream: budget {format_size(budget)} for a {format_size(store.expert_store_bytes)} expert store "
          f"({'confined to ' + format_size(limit) if limit else 'unconfined'}): naive "
          f"{med['naive']['s_per_token']:.3f} s/token, full {med['full']['s_per_token']:.3f} s/token "
          f"({speedup:.2f}x; all resident {resident['s_per_token']:.3f}); {args.policy} {ratio_default:.2f}x Belady "
          f"bytes; device utilisation {100 * utilisation:.0f}% of {seq:.0f} MiB/s sequential O_DIRECT; cold cache "
          f"via {record['cold_cache']}")
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
