"""The simulator's router mode: the cluster's routers (`cluster/router.py`, the real `Router`) in front of N
replicas whose prefix caches are modelled at the grain that decides a hybrid model's hits, so that a router's
prefix hit rate can be carried to more replicas, groups and cache sizes than this machine can run.

Workload: SGLang's generated-shared-prefix shape, as `benchmarks/bench_cluster.py --workload shared-prefix` sends
it: `groups` groups (one tenant each), each a system prompt of `system_tokens` and `per_group` questions of
`question_tokens`, all questions in one seeded random order, sent by `clients` closed-loop clients; each reply is
`reply_tokens` long.

A replica's prefix cache (engine/prefix_cache.py), reduced to what a hit here depends on:
- a hit needs a KDA state checkpoint at the system prompt's end (questions never share more than that), and it is
  a fork (the group's earlier question left the tree there), so under SLRU the first hit protects it;
- a request that missed saves that checkpoint (the engine's every-8-blocks target, when the system prompt is a
  multiple of 8 blocks, or its branch point once a second question arrives) as its prefill passes it, then one at
  its prompt's end, and one after its reply: the last two are never used again here;
- `checkpoints` slots, replaced by the engine's own `SegmentedLRU` (protected share `PROTECTED_FRACTION` under
  "slru", none under "lru"; under slru a checkpoint saved again while its key is among the last 2 x `checkpoints`
  evicted ones is protected at once, as the engine does);
- the attention blocks are assumed to outlive the checkpoints (the engine evicts a checkpoint when its blocks go,
  which only lowers both routers' rates).

Time: each replica runs its requests at once, sharing one processor (prefill `prefill_ms` per uncached prompt
token, then `decode_ms` per reply token); a request's checkpoints appear when its prefill ends. Routing sees the
same loads the front counts (requests in flight per replica). In-flight prefix sharing (`prefix_wait`, the
engine's `--prefix-wait-tokens`): a request that arrives while another of its group is still computing the system
prompt on that replica waits for it and then hits. Not modelled: the attention-block pool's own evictions, the
engine's batching, and the machine (replicas never share a CPU here). `benchmarks/bench_sim_router_check.py`
compares it with `bench_cluster.py`'s measured hit rates (docs/CLUSTER.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

import numpy as np

from k3serve.cluster.router import ROUTERS, Router, RouterConfig
from k3serve.engine.prefix_cache import (GHOSTS_PER_SLOT, PROTECTED_FRACTION, EvictedKeys, SegmentedLRU,
                                        StateCheckpoint)
from k3serve.errors import ConfigError

POLICIES = ("lru", "slru")


@dataclass(frozen=True)
class RouterSimConfig:
    replicas: int = 2
    router: str = "cache-aware"
    checkpoints: int = 8  # state checkpoint slots per replica
    policy: str = "slru"
    groups: int = 16
    per_group: int = 8
    system_tokens: int = 128
    question_tokens: int = 32
    reply_tokens: int = 24
    clients: int = 8
    block_size: int = 16
    vocab: int = 1032  # the embedded model's, which bench_cluster.py draws its token ids from
    balance_abs_threshold: int = RouterConfig.balance_abs_threshold
    balance_rel_threshold: float = RouterConfig.balance_rel_threshold
    prefix_wait: bool = True  # in-flight prefix sharing (the engine's --prefix-wait-tokens, on by default)
    recurring: bool = True  # slru's admission of re-saved checkpoints (False: as the engine was before it)
    # a lone request's cost per uncached prompt token and per reply token; with the ~4 requests a replica runs at
    # once in bench_cluster.py they give its measured TTFT (~60 ms for 160 tokens) and request time (~310 ms with
    # 24 reply tokens): most of a request is its reply, streamed token by token through Ray and the front
    prefill_ms: float = 0.1
    decode_ms: float = 2.7
    seed: int = 0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown prefix-cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        for name in ("replicas", "checkpoints", "groups", "per_group", "system_tokens", "question_tokens",
                     "clients", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.vocab < 4:
            raise ConfigError(f"vocab must be at least 4, got {self.vocab}")
        if self.reply_tokens < 0 or self.prefill_ms <= 0 or self.decode_ms < 0:
            raise ConfigError("reply-tokens and decode-ms must be >= 0, prefill-ms > 0")


@dataclass
class RouterSimResult:
    config: RouterSimConfig
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_per_replica: list[int] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttft_ms) if self.ttft_ms else float("nan")

    def as_dict(self) -> dict:
        return {"replicas": self.config.replicas, "router": self.config.router, "checkpoints": self.config.checkpoints,
                "policy": self.config.policy, "groups": self.config.groups, "per_group": self.config.per_group,
                "hit_rate": self.hit_rate, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "requests_per_replica": self.requests_per_replica, "decisions": self.decisions,
                "ttft_p50_ms": self.ttft_p50_ms}


class ReplicaCache:
    """One replica's state checkpoints: `capacity` slots under the engine's `SegmentedLRU`."""

    def __init__(self, capacity: int, policy: str, recurring: bool = True) -> None:
        self.capacity = capacity
        self.recency = SegmentedLRU(int(PROTECTED_FRACTION * capacity) if policy == "slru" else 0)
        self.index: dict[object, StateCheckpoint] = {}  # key -> checkpoint
        self._keys: dict[int, object] = {}  # slot -> key
        self._free = list(range(capacity))
        # the engine's recently evicted keys (slru; `recurring` False: the engine before 2026-12-05 23:30 UTC)
        self._ghosts = EvictedKeys(GHOSTS_PER_SLOT * capacity) if self.recency.protected_capacity and recurring \
            else None

    def admit(self, group: int) -> bool:
        """A request of `group` is admitted: a fork hit on its system prompt's checkpoint, or a miss."""
        checkpoint = self.index.get(("system", group))
        if checkpoint is None:
            return False
        self.recency.hit(checkpoint.slot, fork=True)
        return True

    def prefilled(self, group: int, request: int, hit: bool, system_tokens: int, prompt_tokens: int) -> None:
        """Its prefill ended: a miss saved the system prompt's state on the way, then every prompt's end is saved."""
        if not hit:
            self.save(("system", group), system_tokens)
        self.save(("prompt", request), prompt_tokens)

    def finished(self, request: int, position: int) -> None:
        """Its reply ended: the state after its last generated token is saved."""
        self.save(("reply", request), position)

    def save(self, key: object, position: int) -> None:
        existing = self.index.get(key)
        if existing is not None:  # the engine's save of an existing checkpoint only refreshes it
            self.recency.touch(existing.slot)
            return
        if not self._free:
            victim = self.recency.victim()
            self.recency.remove(victim.slot)
            evicted = self._keys.pop(victim.slot)
            del self.index[evicted]
            self._free.append(victim.slot)
            if self._ghosts is not None:
                self._ghosts.remember(evicted)
        slot = self._free.pop()
        checkpoint = StateCheckpoint(slot, b"", (), position)
        self.recency.add(checkpoint)
        self.index[key] = checkpoint
        self._keys[slot] = key
        if self._ghosts is not None and self._ghosts.recurs(key):
            self.recency.promote(slot)


def shared_prefix_workload(groups: int, per_group: int, system_tokens: int, question_tokens: int, vocab: int,
                           seed: int) -> list[tuple[int, list[int]]]:
    """(group, prompt token ids) for every question, in one seeded random order: what bench_cluster.py sends and
    what the simulator routes."""
    rng = np.random.default_rng(seed)
    requests = []
    for group in range(groups):
        system = rng.integers(3, vocab, system_tokens).tolist()
        for _ in range(per_group):
            requests.append((group, system + rng.integers(3, vocab, question_tokens).tolist()))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def shared_prefix_requests(config: RouterSimConfig) -> list[tuple[int, list[int]]]:
    c = config
    return shared_prefix_workload(c.groups, c.per_group, c.system_tokens, c.question_tokens, c.vocab, c.seed)


def simulate_router(config: RouterSimConfig) -> RouterSimResult:
    """Route the workload through the real router over modelled replicas (see the module docstring)."""
    c = config
    router = Router(RouterConfig(policy=c.router, block_size=c.block_size,
                                 balance_abs_threshold=c.balance_abs_threshold,
                                 balance_rel_threshold=c.balance_rel_threshold, seed=c.seed), c.replicas)
    caches = [ReplicaCache(c.checkpoints, c.policy, c.recurring) for _ in range(c.replicas)]
    result = RouterSimResult(c, requests_per_replica=[0] * c.replicas)
    requests = shared_prefix_requests(c)
    prompt_len = c.system_tokens + c.question_tokens
    # processor sharing per replica: each active request has work left (ms of a lone processor)
    active: list[dict[int, list]] = [{} for _ in range(c.replicas)]  # replica -> {request: [work_left, phase]}
    sent = 0
    info: dict[int, tuple[int, float]] = {}  # request -> (group, submit time)
    last_update = [0.0] * c.replicas
    waiting: list[dict[int, list[int]]] = [{} for _ in range(c.replicas)]  # replica -> {computing: [waiters]}

    def advance(replica: int, until: float) -> None:
        jobs = active[replica]
        if jobs:
            share = (until - last_update[replica]) / len(jobs)
            for job in jobs.values():
                job[0] -= share
        last_update[replica] = until

    def submit(at: float) -> None:
        nonlocal sent
        group, prompt = requests[sent]
        request = sent
        sent += 1
        route = router.choose(prompt, f"group{group}", None)
        result.decisions[route.reason] = result.decisions.get(route.reason, 0) + 1
        replica = route.replica
        result.requests_per_replica[replica] += 1
        advance(replica, at)
        info[request] = (group, at)
        result.prompt_tokens += prompt_len
        computing = [r for r, job in active[replica].items() if job[1] == "prefill" and not job[2]
                     and info[r][0] == group]
        if c.prefix_wait and computing and ("system", group) not in caches[replica].index:
            waiting[replica].setdefault(computing[0], []).append(request)  # in-flight sharing: wait for its state
            return
        start(replica, request, group)

    def start(replica: int, request: int, group: int) -> None:
        hit = caches[replica].admit(group)
        cached = c.system_tokens if hit else 0
        result.cached_tokens += cached
        active[replica][request] = [(prompt_len - cached) * c.prefill_ms, "prefill", hit]

    for _ in range(min(c.clients, len(requests))):
        submit(0.0)
    while any(active):
        # the next job to finish its phase, over all replicas
        best = None
        for replica, jobs in enumerate(active):
            if not jobs:
                continue
            request, job = min(jobs.items(), key=lambda item: (item[1][0], item[0]))
            finish = last_update[replica] + max(job[0], 0.0) * len(jobs)
            if best is None or finish < best[0]:
                best = (finish, replica, request)
        now, replica, request = best
        advance(replica, now)
        job = active[replica][request]
        group, submitted = info[request]
        cache = caches[replica]
        if job[1] == "prefill":
            cache.prefilled(group, request, job[2], c.system_tokens, prompt_len)
            for waiter in waiting[replica].pop(request, []):
                start(replica, waiter, group)
            result.ttft_ms.append(now - submitted)
            job[0], job[1] = c.reply_tokens * c.decode_ms, "decode"
            if job[0] > 0:
                continue
        if c.reply_tokens:
            cache.finished(request, prompt_len + c.reply_tokens - 1)
        del active[replica][request]
        router.end(replica)
        if sent < len(requests):
            submit(now)
    return result


@dataclass(frozen=True)
class RatioRow:
    """cache-aware against a baseline router on one configuration, over several workload seeds."""

    config: RouterSimConfig  # the cache-aware run's (seed: the first)
    baseline: str
    cache_aware: list[float]  # hit rate per seed
    other: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b if b else float("inf") for a, b in zip(self.cache_aware, self.other)]

    def as_dict(self) -> dict:
        c = self.config
        return {"replicas": c.replicas, "per_group": c.per_group, "groups": c.groups, "checkpoints": c.checkpoints,
                "policy": c.policy, "baseline": self.baseline, "hit_rate_cache_aware": self.cache_aware,
                "hit_rate_baseline": self.other, "ratios": self.ratios,
                "ratio_median": statistics.median(self.ratios)}


def ratio_row(config: RouterSimConfig, baseline: str = "round-robin", seeds: int = 5) -> RatioRow:
    """Cache-aware / `baseline` prefix hit rate on `config`'s shape for workload seeds config.seed .. + seeds - 1."""
    ca, other = [], []
    for seed in range(config.seed, config.seed + seeds):
        ca.append(simulate_router(replace(config, router="cache-aware", seed=seed)).hit_rate)
        other.append(simulate_router(replace(config, router=baseline, seed=seed)).hit_rate)
    return RatioRow(replace(config, router="cache-aware"), baseline, ca, other)
