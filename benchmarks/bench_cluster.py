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

Workload `--workload shared-prefix` (SGLang's generated-shared-prefix benchmark, scaled down): --groups prefix
groups (one tenant each), each with its own --system-tokens system prompt and --per-group questions of
--question-tokens ids; all questions in one seeded random order, sent by --clients closed-loop clients, each reply
--reply-tokens greedy tokens. Runs: cache-aware and round-robin over --replicas replicas, and cache-aware over 1.

--prefix-cache-policy lru slru runs every one of those runs under each replacement policy of the replicas' prefix
caches (alternated within a round) and reports each policy's figures; --no-single leaves out the 1-replica run.

Prints the machine, one summary line per policy, and a JSON record on the last line.

    python benchmarks/bench_cluster.py [--rounds 2] [--quick]
    python benchmarks/bench_cluster.py --workload shared-prefix [--replicas 2] [--state-checkpoints 16]
        [--prefix-cache-policy lru slru] [--no-single]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.cluster.backend import ClusterBackend
from k3serve.cluster.router import RouterConfig
from k3serve.cluster.runtime import start_ray
from k3serve.cluster.spec import ReplicaSpec
from k3serve.engine.config import PREFIX_CACHE_POLICIES, EngineConfig
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.sim.router import shared_prefix_workload
from k3serve.engine.request import RequestSpec



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


def shared_prefix_requests(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int]]]:
    """SGLang's generated-shared-prefix shape, scaled down: --groups groups (one tenant each), each with a system
    prompt of --system-tokens ids and --per-group questions of --question-tokens ids; (tenant, prompt) for every
    question, in a seeded random order (groups interleave, as independent users' requests do). The simulator's
    router mode draws the same workload (`k3serve.sim.router.shared_prefix_workload`)."""
    return [(f"group{group}", prompt) for group, prompt in shared_prefix_workload(
        args.groups, args.per_group, args.system_tokens, args.question_tokens, vocab, args.seed)]


async def run_shared_prefix(backend: ClusterBackend, requests, reply_tokens: int, clients: int) -> dict[str, float]:
    """`clients` closed-loop clients take the requests in order, each sending its next when its last is answered."""
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0, "generated": 0, "errors": 0}
    reasons: dict[str, int] = {}
    queue = list(reversed(requests))

    async def client() -> None:
        while queue:
            tenant, prompt = queue.pop()
            start = time.perf_counter()
            stream = backend.submit(RequestSpec(tuple(prompt), params, tenant=tenant))
            first, final = None, None
            async for output in stream:
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - start
                final = output
            reasons[stream.route.reason] = reasons.get(stream.route.reason, 0) + 1
            if final.error is not None:
                totals["errors"] += 1
                continue
            ttfts.append(first)
            totals["prompt"] += len(final.prompt_token_ids)
            totals["cached"] += final.num_cached_tokens
            totals["generated"] += len(final.outputs[0].token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    return {"hit_rate": totals["cached"] / totals["prompt"], "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p99": float(np.percentile(ttfts, 99)), "tokens_per_s": totals["generated"] / elapsed,
            "seconds": elapsed, "requests": len(ttfts), "errors": totals["errors"],
            "prompt_tokens": totals["prompt"], "cached_tokens": totals["cached"], "reasons": reasons}


async def run_workload(backend: ClusterBackend, work, reply_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0, "generated": 0, "errors": 0}

    async def conversation(tenant: str, system: list[int], turns: list[list[int]]) -> None:
        context = list(system)
        for user in turns:
            context += user
            start = time.perf_counter()
            stream = backend.submit(RequestSpec(tuple(context), params, tenant=tenant))
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
    parser.add_argument("--workload", choices=("chat", "shared-prefix"), default="chat")
    parser.add_argument("--groups", type=int, default=16, help="shared-prefix: prefix groups (one tenant each)")
    parser.add_argument("--per-group", type=int, default=8, help="shared-prefix: questions per group")
    parser.add_argument("--question-tokens", type=int, default=32, help="shared-prefix: question length")
    parser.add_argument("--clients", type=int, default=8, help="shared-prefix: closed-loop clients")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--balance-abs-threshold", type=int, default=RouterConfig.balance_abs_threshold)
    parser.add_argument("--balance-rel-threshold", type=float, default=RouterConfig.balance_rel_threshold)
    parser.add_argument("--prefix-cache-policy", nargs="+", choices=PREFIX_CACHE_POLICIES,
                        default=[EngineConfig.prefix_cache_policy],
                        help="the replicas' checkpoint replacement; several: each run under each, alternated")
    parser.add_argument("--prefix-wait-tokens", type=int, default=EngineConfig.prefix_wait_tokens,
                        help="the replicas' in-flight prefix sharing threshold (0: off)")
    parser.add_argument("--no-single", action="store_true", help="leave out the cache-aware run on 1 replica")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.turns = 1, 3
    specs = {policy: ReplicaSpec(model=None, stream=None, speculative=None, engine=EngineConfig(
        max_model_len=1024, max_seqs=16, max_batch_tokens=512, kv_cache_bytes=32 << 20,
        num_state_checkpoints=args.state_checkpoints, checkpoint_every_blocks=args.checkpoint_every_blocks,
        prefix_cache_policy=policy, prefix_wait_tokens=args.prefix_wait_tokens)) for policy in args.prefix_cache_policy}
    print(f"machine: {describe_host()}")
    n = args.replicas
    start_ray(None, num_cpus=max(n, 2), replicas=n)
    import ray

    routes = (("cache-aware", n), ("round-robin", n)) + ((("cache-aware", 1),) if not args.no_single else ())
    runs = [(router, count, policy) for policy in specs for router, count in routes]
    results: dict[str, list[dict]] = {f"{router}x{count}/{policy}": [] for router, count, policy in runs}
    try:
        for round_index in range(args.rounds):
            for router, replicas, policy in runs:
                config = RouterConfig(policy=router, balance_abs_threshold=args.balance_abs_threshold,
                                      balance_rel_threshold=args.balance_rel_threshold)
                backend = ClusterBackend(specs[policy], replicas, config)
                try:
                    vocab = backend.infos[0].vocab_size
                    if args.workload == "chat":
                        result = asyncio.run(run_workload(backend, conversations(args, vocab), args.reply_tokens))
                    else:
                        result = asyncio.run(run_shared_prefix(backend, shared_prefix_requests(args, vocab),
                                                               args.reply_tokens, args.clients))
                finally:
                    backend.shutdown()
                key = f"{router}x{replicas}/{policy}"
                results[key].append(result)
                print(f"round {round_index + 1} {key:20s}: hit rate {result['hit_rate']:.3f}  TTFT p50 "
                      f"{result['ttft_p50'] * 1e3:7.1f} ms p99 {result['ttft_p99'] * 1e3:7.1f} ms  "
                      f"{result['tokens_per_s']:6.1f} tok/s  ({result['requests']} requests, "
                      f"{result['errors']} errors, {result['seconds']:.1f} s) {result.get('reasons', '')}", flush=True)
    finally:
        ray.shutdown()
    medians = {key: {field: statistics.median(r[field] for r in runs_) for field in runs_[0] if field != "reasons"}
               for key, runs_ in results.items()}
    ratios = {}
    for policy in specs:
        ca_key, rr_key, one_key = (f"{router}x{count}/{policy}"
                                   for router, count in (("cache-aware", n), ("round-robin", n), ("cache-aware", 1)))
        hit_ratios = [ca["hit_rate"] / max(rr["hit_rate"], 1e-9) for ca, rr in zip(results[ca_key], results[rr_key])]
        miss_ratios = [(1 - rr["hit_rate"]) / max(1 - ca["hit_rate"], 1e-9)
                       for ca, rr in zip(results[ca_key], results[rr_key])]
        speedups = [many["tokens_per_s"] / one["tokens_per_s"]
                    for many, one in zip(results[ca_key], results.get(one_key, []))]
        ratios[policy] = {"hit_rate_ratio": statistics.median(hit_ratios),
                          "computed_prompt_ratio": statistics.median(miss_ratios),
                          "throughput_ratio_vs_1": statistics.median(speedups) if speedups else None}
        ca, rr = medians[ca_key], medians[rr_key]
        single = f"; {n} replicas / 1: {ratios[policy]['throughput_ratio_vs_1']:.2f}x tokens/s" if speedups else ""
        print(f"summary ({args.workload}, {n} replicas, {args.state_checkpoints} checkpoints, {policy}): prefix hit "
              f"rate cache-aware {ca['hit_rate']:.3f} vs round-robin {rr['hit_rate']:.3f} "
              f"({ratios[policy]['hit_rate_ratio']:.2f}x, target >= 3x; prompt tokens computed: round-robin "
              f"{ratios[policy]['computed_prompt_ratio']:.2f}x cache-aware's); TTFT p50/p99 cache-aware "
              f"{ca['ttft_p50'] * 1e3:.0f}/{ca['ttft_p99'] * 1e3:.0f} ms vs round-robin {rr['ttft_p50'] * 1e3:.0f}/"
              f"{rr['ttft_p99'] * 1e3:.0f} ms{single}")
    # what the replicas' prefix caches did that earlier records' did not (benchmarks/bench_sim_router_check.py)
    features = {"recurring_admission": True}
    print(json.dumps({"benchmark": "cluster", "args": vars(args), "engine_features": features,
                      "machine": describe_host(), "medians": medians, "ratios": ratios, "runs": results}))


if __name__ == "__main__":
    main()
