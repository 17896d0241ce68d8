"""Replicas on a local Ray behind the router (k3serve.cluster): cache-aware vs round-robin, and 2 replicas vs 1.

Workload (deterministic, --seed; defaults in brackets): --tenants tenants, each with its own system prompt of --system-tokens token
ids; each tenant holds --conversations conversations of --turns turns. Turn k's prompt is the system prompt,
then every earlier user message and reply, then a new user message of --user-tokens ids; each reply is
--reply-tokens greedy tokens. All conversations run at once (closed loop: a conversation sends its next turn when
the previous one is answered), so about tenants x conversations requests are in flight.

Each run starts fresh replicas (empty prefix caches) on one local Ray (2 CPUs, one thread per replica) and sends
the whole workload through `ClusterBackend` (the HTTP front's backend; HTTP itself is left out: it is the same for
every router). Runs alternate per round: cache-aware (2 replicas), round-robin (2 replicas), and 1 replica.
Reported, medians over rounds: the prefix hit rate (prompt tokens served from a replica's prefix cache / all
prompt tokens, as the replicas' engines report them), TTFT p50 / p99 (submit to first token, at the front),
generated tokens per second; the cache-aware / round-robin hit-rate ratio (target >= 3) and the 2 / 1 replica
throughput ratio, each taken per round.

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_cluster.py [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from k3serve.cluster.backend import ClusterBackend
from k3serve.cluster.router import RouterConfig
from k3serve.cluster.runtime import start_ray
from k3serve.cluster.spec import ReplicaSpec
from k3serve.engine.config import EngineConfig
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host

RUNS = (("cache-aware", 2), ("round-robin", 2), ("cache-aware", 1))


def conversations(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int], list[list[int]]]]:
    """(tenant, system prompt, user messages per turn) per conversation."""
    rng = np.random.default_rng(args.seed)
    out = []
    for tenant in range(args.tenants):
        system = rng.integers(3, vocab, args.system_tokens).tolist()
        for _ in range(args.conversations):
            turns = [rng.integers(3, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
            out.append((f"tenant{tenant}", system, turns))
    return out


async def run_workload(backend: ClusterBackend, work, reply_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0, "generated": 0, "errors": 0}

    async def conversation(tenant: str, system: list[int], turns: list[list[int]]) -> None:
        context = list(system)
        for user in turns:
            context += user
            start = time.perf_counter()
            stream = backend.submit(context, params, tenant=tenant, cache_salt=None, stop=[], speculative=None)
            first = None
            final = None
            async for output in stream:
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - start
                final = output
            if final.error is not None:
                totals["errors"] += 1
                return
            ttfts.append(first)
            totals["prompt"] += len(final.prompt_token_ids)
            totals["cached"] += final.num_cached_tokens
            totals["generated"] += len(final.outputs[0].token_ids)
            context += final.outputs[0].token_ids

    start = time.perf_counter()
    await asyncio.gather(*(conversation(*c) for c in work))
    elapsed = time.perf_counter() - start
    return {"hit_rate": totals["cached"] / totals["prompt"], "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p99": float(np.percentile(ttfts, 99)), "tokens_per_s": totals["generated"] / elapsed,
            "seconds": elapsed, "requests": len(ttfts), "errors": totals["errors"],
            "prompt_tokens": totals["prompt"], "cached_tokens": totals["cached"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=3, help="per tenant")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-checkpoints", type=int, default=16,
                        help="KDA state checkpoints per replica: the prefix cache's capacity in entries (about half "
                             "the workload's live prefixes: the regime where routing matters)")
    parser.add_argument("--checkpoint-every-blocks", type=int, default=8,
                        help="also checkpoint every N blocks of prefill (8 x 16 = the system prompt's end)")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 conversations per tenant, 3 turns")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.turns = 1, 3
    engine = EngineConfig(max_model_len=1024, max_seqs=16, max_batch_tokens=512, kv_cache_bytes=32 << 20,
                          num_state_checkpoints=args.state_checkpoints,
                          checkpoint_every_blocks=args.checkpoint_every_blocks)
    spec = ReplicaSpec(model=None, stream=None, engine=engine, speculative=None)
    print(f"machine: {describe_host()}")
    start_ray(None, num_cpus=2, replicas=2)
    import ray

    results: dict[str, list[dict[str, float]]] = {f"{router}x{n}": [] for router, n in RUNS}
    try:
        for round_index in range(args.rounds):
            for router, replicas in RUNS:
                backend = ClusterBackend(spec, replicas, RouterConfig(policy=router))
                try:
                    work = conversations(args, backend.infos[0].vocab_size)
                    result = asyncio.run(run_workload(backend, work, args.reply_tokens))
                finally:
                    backend.shutdown()
                key = f"{router}x{replicas}"
                results[key].append(result)
                print(f"round {round_index + 1} {key:15s}: hit rate {result['hit_rate']:.3f}  TTFT p50 "
                      f"{result['ttft_p50'] * 1e3:7.1f} ms p99 {result['ttft_p99'] * 1e3:7.1f} ms  "
                      f"{result['tokens_per_s']:6.1f} tok/s  ({result['requests']} requests, "
                      f"{result['errors']} errors, {result['seconds']:.1f} s)", flush=True)
    finally:
        ray.shutdown()
    medians = {key: {field: statistics.median(r[field] for r in runs) for field in runs[0]}
               for key, runs in results.items()}
    hit_ratios = [ca["hit_rate"] / max(rr["hit_rate"], 1e-9)
                  for ca, rr in zip(results["cache-awarex2"], results["round-robinx2"])]
    miss_ratios = [(1 - rr["hit_rate"]) / max(1 - ca["hit_rate"], 1e-9)
                   for ca, rr in zip(results["cache-awarex2"], results["round-robinx2"])]
    speedups = [two["tokens_per_s"] / one["tokens_per_s"]
                for two, one in zip(results["cache-awarex2"], results["cache-awarex1"])]
    ca, rr = medians["cache-awarex2"], medians["round-robinx2"]
    print(f"summary: prefix hit rate cache-aware {ca['hit_rate']:.3f} vs round-robin {rr['hit_rate']:.3f} "
          f"({statistics.median(hit_ratios):.2f}x, target >= 3x; prompt tokens computed: round-robin "
          f"{statistics.median(miss_ratios):.2f}x cache-aware's); TTFT p50/p99 cache-aware "
          f"{ca['ttft_p50'] * 1e3:.0f}/{ca['ttft_p99'] * 1e3:.0f} ms vs round-robin {rr['ttft_p50'] * 1e3:.0f}/"
          f"{rr['ttft_p99'] * 1e3:.0f} ms; 2 replicas / 1: {statistics.median(speedups):.2f}x tokens/s")
    print(json.dumps({"benchmark": "cluster", "args": vars(args), "machine": describe_host(), "medians": medians,
                      "hit_rate_ratio": statistics.median(hit_ratios),
                      "computed_prompt_ratio": statistics.median(miss_ratios), "throughput_ratio_2_vs_1":
                      statistics.median(speedups), "runs": results}))


if __name__ == "__main__":
    main()
