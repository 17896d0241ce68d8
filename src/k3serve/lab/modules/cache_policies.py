"""5. Expert cache policies (none, LRU, LFU, S3-FIFO, pinned) against Belady on a recorded routing trace."""

from __future__ import annotations

from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.verdict import judge
from k3serve.sim.cache_replay import replay_all

POLICIES = ("none", "lru", "lfu", "s3fifo", "pinned", "belady")


def limits(lab) -> dict[str, tuple[int, int]]:
    config = lab.config
    return {"capacity": (1, len(config.moe_layer_ids) * config.num_experts), "tokens": (16, lab.trace_tokens)}


ONLINE = ("lru", "lfu", "s3fifo", "pinned")  # what a server can run (none keeps nothing; Belady needs the future)


def policy_verdict(policy: str, capacity: int, sweep: list[int], rows: dict):
    """The chosen policy against the best other online policy at this capacity, and the capacity in the retention
    sweep where that comparison reverses."""
    others = [p for p in ONLINE if p != policy]

    def rival(c: int) -> str:
        return min(others, key=lambda p: rows[(p, c)].misses)

    best = rival(capacity)
    chosen_misses, rival_misses = rows[(policy, capacity)].misses, rows[(best, capacity)].misses
    ahead = chosen_misses <= rival_misses
    flip = next((c for c in sweep if (rows[(policy, c)].misses <= rows[(rival(c), c)].misses) != ahead), None)
    belady = chosen_misses / max(rows[("belady", capacity)].misses, 1)
    if flip is None:
        where = (f"no other online policy beats it at any capacity swept ({sweep[0]} to {sweep[-1]} slots)" if ahead
                 else f"it trails at every capacity swept ({sweep[0]} to {sweep[-1]} slots)")
    elif ahead:
        where = f"{rival(flip)} beats it at {flip} slots (the retention sweep)"
    else:
        where = f"it beats every other online policy at {flip} slots (the retention sweep)"
    return judge(policy, f"the best other online policy ({best})", "misses", "misses (disk reads)", chosen_misses,
                 rival_misses, higher_is_better=False, words=("fewer", "more"),
                 flips_when=f"{where}; Belady's offline optimum misses {belady:.2f}x less than {policy} at {capacity} "
                            "slots")


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.05, "recording (or reading) the routing trace")
    requests, tokens = lab.token_requests(params["tokens"])
    config = lab.config
    total = len(config.moe_layer_ids) * config.num_experts
    top_k = config.num_experts_per_token
    capacity = params["capacity"]
    if capacity > total:  # NOTE: validate() with the lab refuses these already (`limits`)
        raise LabParamError("capacity", f"must be <= {total} (every expert of every MoE layer), got {capacity}")
    if tokens < params["tokens"]:
        raise LabParamError("tokens", f"must be <= {tokens} (the routing trace's length), got {params['tokens']}")
    sweep = sorted({max(top_k, int(total * f)) for f in (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)} | {capacity})
    rows = {}
    for i, c in enumerate(sweep):
        cancel.check()
        progress(0.1 + 0.85 * i / len(sweep), f"replaying {tokens} tokens at {c} slots")
        for r in replay_all(requests, [c], tokens, config.expert_bytes, POLICIES, working_slots=top_k):
            rows[(r.policy, c)] = r
    chosen, best = rows[(params["policy"], capacity)], rows[("belady", capacity)]
    source = (f"exact replay of the cache policies (k3serve.stream.cache) on a routing trace of {lab.model_name} "
              f"recorded on this machine ({tokens} held-out tokens, one request per token and layer)")
    figures = [
        Figure(f"Expert bytes read per token at {capacity} slots ({capacity / total:.0%} of the experts)", "bar", False,
               source, [{"name": "KiB per token", "x": list(POLICIES),
                         "y": [rows[(p, capacity)].bytes_per_token / 1024 for p in POLICIES]}],
               y_label="expert bytes read per token (KiB/token)", highlight=params["policy"]),
        Figure("Retention vs cache size", "line", False, source,
               [{"name": p, "x": sweep, "y": [100 * rows[(p, c)].retention for c in sweep]} for p in POLICIES],
               x_label="cache capacity (slots)", y_label="retention (%)", highlight=params["policy"]),
    ]
    metrics = {"retention_pct": 100 * chosen.retention, "bytes_per_token": chosen.bytes_per_token,
               "misses": float(chosen.misses), "vs_belady": chosen.misses / max(best.misses, 1)}
    baseline = {"retention_pct": 100 * best.retention, "bytes_per_token": best.bytes_per_token,
                "misses": float(best.misses), "vs_belady": 1.0}
    labels = {"retention_pct": "retention (% of expert requests already resident)",
              "bytes_per_token": "expert bytes read per token", "misses": "misses (reads)",
              "vs_belady": "misses / Belady's misses"}
    verdict = policy_verdict(params["policy"], capacity, sweep, rows)
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name=f"{params['policy']}", verdict=verdict,
                     baseline_name="Belady (offline optimum)",
                     notes=[f"{params['policy']} misses {metrics['vs_belady']:.2f}x as often as Belady at {capacity} "
                            f"of {total} expert slots; none (no retention) reads every request."],
                     related_commands=[f"k3serve routing-stats --tokens {tokens} --trace-out routing.trace",
                                       f"k3serve sim cache routing.trace --capacity {capacity}"])


MODULE = LabModule(
    id="cache_policies", number=5, title="Expert cache policies vs Belady",
    summary="Replay a routing trace recorded from the model against every cache policy and the offline optimum.",
    explanation=(
        "Under a RAM budget only some experts fit in memory; each miss is a disk read of one expert blob. LRU keeps "
        "what was used recently, LFU what was used often, S3-FIFO filters one-hit experts through a small probation "
        "queue, pinned keeps a fixed hot set from a profile. Belady's MIN evicts the expert whose next use is "
        "farthest in the future: it needs the future, so it is the bound no online policy beats. "
        "bytes/token = misses x expert_bytes / tokens; retention = hits / requests."),
    params=(Param("capacity", "int", 96, "expert slots in RAM (all MoE layers together; at most all of them)",
                  min=1, max=100000),
            Param("policy", "choice", "lfu", "the policy compared with Belady", choices=POLICIES[:-1]),
            Param("tokens", "int", 1024, "trace tokens replayed (at most the trace's)", min=16, max=100000,
                  unit="tokens")),
    kind="both", run=run, limits=limits)
