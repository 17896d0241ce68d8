"""15. Cluster scheduling: which replica gets a request; the cache-aware router against round-robin."""

from __future__ import annotations

import numpy as np

from k3serve.cluster.router import ROUTERS, Router, RouterConfig
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.verdict import EVEN_BAND, judge

TENANT = "lab"


def workload(params, vocab: int) -> list[list[int]]:
    """`requests` prompts: one of `groups` shared prefixes (a system prompt, a conversation so far) + 16 distinct
    tokens, the groups interleaved at random (seeded)."""
    rng = np.random.default_rng(params["seed"])
    prefixes = [[int(t) for t in rng.integers(3, vocab, params["prefix_tokens"])] for _ in range(params["groups"])]
    order = rng.integers(0, params["groups"], params["requests"])
    return [prefixes[g] + [int(t) for t in rng.integers(3, vocab, 16)] for g in order]


def serve_with(model, policy: str, prompts: list[list[int]], params, cancel) -> dict:
    """Replicas as engines in this process (each its own prefix cache) behind the real router; requests arrive in
    waves of `wave` and each wave runs to completion. Cache hits and computed positions are exact; time is not a
    cluster's (the replicas share this CPU)."""
    replicas = params["replicas"]
    engines = [LLMEngine(model, EngineConfig(enable_prefix_caching=True, block_size=16, kv_cache_bytes=8 << 20,
                                             max_seqs=16)) for _ in range(replicas)]
    router = Router(RouterConfig(policy=policy, block_size=16, seed=params["seed"]), replicas)
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    served = [0] * replicas
    cached = prompt_positions = 0
    reasons: dict[str, int] = {}
    for start in range(0, len(prompts), params["wave"]):
        cancel.check()
        wave = prompts[start:start + params["wave"]]
        routes = []
        for prompt in wave:
            route = router.choose(prompt, TENANT, None)
            routes.append(route.replica)
            reasons[route.reason] = reasons.get(route.reason, 0) + 1
            engines[route.replica].add_request(prompt, sampling, tenant=TENANT)
            served[route.replica] += 1
            prompt_positions += len(prompt)
        while any(e.has_unfinished_requests() for e in engines):
            for engine in engines:
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            cached += out.num_cached_tokens
        for replica in routes:
            router.end(replica)
    computed = sum(e.metrics.counter("computed_tokens").value for e in engines)
    return {"hit_pct": 100 * cached / prompt_positions, "computed_per_request": computed / len(prompts),
            "max_over_mean_load": max(served) / (len(prompts) / replicas), "served": served, "reasons": reasons}


def requests_until_even(groups: int, replicas: int, prefix: int, distinct: int = 16) -> float:
    """The cold-miss model: cache-aware computes each group's prefix once, round-robin once per group and replica
    (no eviction). Over N requests, computed positions are N d + G P against N d + G R P; round-robin comes within
    EVEN_BAND of cache-aware once N >= G P (R - 1 - EVEN_BAND) / (EVEN_BAND d)."""
    return max(groups * prefix * (replicas - 1 - EVEN_BAND) / (EVEN_BAND * distinct), 0.0)


def routing_verdict(params, metrics: dict[str, float], baseline: dict[str, float]):
    even_at = requests_until_even(params["groups"], params["replicas"], params["prefix_tokens"])
    return judge(params["policy"], "round-robin", "computed_per_request", "prompt positions computed per request",
                 metrics["computed_per_request"], baseline["computed_per_request"], higher_is_better=False,
                 words=("fewer", "more"),
                 flips_when=f"round-robin catches up (within {EVEN_BAND:.0%}) only once every replica has seen every "
                            f"prefix: after about {even_at:,.0f} requests of {params['groups']} prefixes over "
                            f"{params['replicas']} replicas by the cold-miss model (now {params['requests']}), and "
                            "later when caches evict")


def run(params, progress, cancel, lab) -> LabResult:
    model = lab.loaded().model
    prompts = workload(params, model.config.vocab_size)
    policies = [params["policy"]] + [p for p in ROUTERS if p != params["policy"]
                                     and (params["all_policies"] or p == "round-robin")]
    results = {}
    for i, policy in enumerate(policies):
        progress(0.05 + 0.9 * i / len(policies), f"{policy}: {len(prompts)} requests over {params['replicas']} replicas")
        results[policy] = serve_with(model, policy, prompts, params, cancel)
    source = (f"{lab.model_name}: {params['replicas']} engine replicas in this process behind k3serve.cluster's "
              f"router; {params['requests']} requests, {params['groups']} shared prefixes of {params['prefix_tokens']} "
              f"tokens, waves of {params['wave']}; exact counts on this machine")
    names = [p for p in ROUTERS if p in results]
    figures = [
        Figure("Prompt positions served from a replica's prefix cache", "bar", True, source,
               [{"name": "hit %", "x": names, "y": [results[p]["hit_pct"] for p in names]}],
               y_label="prompt positions from cache (%)",
               highlight=params["policy"]),
        Figure("Requests per replica", "bar", True, source,
               [{"name": p, "x": [f"replica {r}" for r in range(params["replicas"])], "y": results[p]["served"]}
                for p in names], y_label="requests served (requests)"),
    ]
    keys = ("hit_pct", "computed_per_request", "max_over_mean_load")
    metrics = {k: float(results[params["policy"]][k]) for k in keys}
    baseline = {k: float(results["round-robin"][k]) for k in keys}
    labels = {"hit_pct": "prompt positions from the prefix cache (%)",
              "computed_per_request": "positions computed per request",
              "max_over_mean_load": "busiest replica's requests / mean"}
    verdict = routing_verdict(params, metrics, baseline)
    progress(1.0, "done")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(results[params["policy"]]["reasons"].items()))
    return LabResult(metrics, baseline, figures, labels, metrics_name=params["policy"], baseline_name="round-robin",
                     verdict=verdict,
                     notes=[f"{params['policy']} decisions: {reasons}",
                            "replicas are engines in one process here (no Ray): hits and computed positions are what "
                            "a cluster would see; time is not"],
                     related_commands=["k3serve cluster --help", "docs/CLUSTER.md"])


MODULE = LabModule(
    id="cluster_routing", number=15, title="Cluster scheduling: router policies",
    summary="Route requests to engine replicas: cache-aware routing against round-robin, least-load, power-of-two.",
    explanation=(
        "Each replica has its own prefix cache, so a request that shares a long prefix with earlier ones is cheap "
        "only on a replica that served them. Round-robin and least-load spread requests evenly and scatter prefixes; "
        "the cache-aware router keeps an approximate radix tree of block chain-hashes h_i = H(h_{i-1}, block i) per "
        "replica and sends a request to the replica with the longest match, unless the load is imbalanced (max - "
        "min > a threshold and max > 1.5 x min), then to the least loaded. Hit rate and computed positions follow."),
    params=(Param("policy", "choice", "cache-aware", "the router compared with round-robin", choices=ROUTERS),
            Param("replicas", "int", 4, "engine replicas", min=1, max=16),
            Param("groups", "int", 4, "distinct shared prefixes", min=1, max=64),
            Param("prefix_tokens", "int", 96, "shared prefix length", min=16, max=1024, unit="tokens"),
            Param("requests", "int", 12, "requests in all", min=1, max=256),
            Param("wave", "int", 4, "requests in flight together", min=1, max=64),
            Param("seed", "int", 0, "workload seed", min=0, max=2**31 - 1),
            Param("all_policies", "bool", False, "also run least-load and power-of-two (twice the time)")),
    kind="measured", run=run)
