"""Choosing a replica for each request: round-robin, least-load, power-of-two choices, and cache-aware.

Load is the number of requests a replica is serving now, as the front counts them (it is the only sender).

The cache-aware router keeps an approximate radix tree of the prompts each replica served, at the granularity of
the engine's prefix cache: a prompt is cut into blocks of `block_size` token ids, and block i is keyed by the chain
hash h_i = H(h_{i-1}, tokens of block i) with h_{-1} = H(tenant, cache_salt) (the engine's own
`prefix_cache.root_hash` / `chain_hash`, so tenants and salts never match each other). A key is a path from the
root of the radix tree; the tree stores, per key, the replicas that served it and when. It is approximate: it
never learns what a replica's prefix cache evicted, and it forgets its least recently used keys beyond
`max_keys`. The longest match of a replica is the number of leading blocks whose keys it holds.

Routing (the decision's reason in parentheses, exported by /metrics):
- the load is imbalanced, max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x min:
  the least-loaded replica ("imbalanced");
- else the replica with the longest match, ties to the less loaded ("prefix_match"), when it matches at least
  one block; else the least-loaded replica ("no_match").
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from k3serve.engine.prefix_cache import chain_hash, root_hash
from k3serve.errors import ConfigError

ROUTERS = ("round-robin", "least-load", "power-of-two", "cache-aware")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache-aware"
    block_size: int = 16  # token ids per radix-tree key (the engine's prefix-cache block size)
    balance_abs_threshold: int = 8  # requests: a smaller max-min spread counts as balanced (docs/CLUSTER.md)
    balance_rel_threshold: float = 1.5  # a max below this multiple of min counts as balanced
    max_keys: int = 1 << 16  # radix-tree keys kept (least recently used forgotten)
    seed: int = 0  # power-of-two's sampling

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ConfigError(f"unknown router {self.policy!r}; choose one of {', '.join(ROUTERS)}")
        if self.block_size < 1 or self.max_keys < 1:
            raise ConfigError("RouterConfig.block_size and max_keys must be positive")
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ConfigError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")


class Route(NamedTuple):
    replica: int
    reason: str  # round_robin, least_load, power_of_two, prefix_match, no_match, imbalanced
    matched_tokens: int  # cache-aware: the chosen replica's match in the tree (0 otherwise)


class PrefixTree:
    """The approximate radix tree over block chain-hashes (see the module docstring)."""

    def __init__(self, block_size: int, max_keys: int) -> None:
        self.block_size = block_size
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, dict[int, float]] = OrderedDict()  # key -> {replica: last use}

    def _path(self, tokens: list[int], tenant: str, cache_salt: str | None) -> list[bytes]:
        parent = root_hash(tenant, cache_salt)
        path = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = chain_hash(parent, tokens[start:start + self.block_size])
            path.append(parent)
        return path

    def match(self, tokens: list[int], tenant: str, cache_salt: str | None) -> dict[int, int]:
        """{replica: matched tokens} for every replica matching at least one block."""
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, key in enumerate(self._path(tokens, tenant, cache_salt), start=1):
            holders = self._keys.get(key)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth * self.block_size
        return matched

    def insert(self, tokens: list[int], tenant: str, cache_salt: str | None, replica: int) -> None:
        now = time.monotonic()
        for key in self._path(tokens, tenant, cache_salt):
            holders = self._keys.setdefault(key, {})
            holders[replica] = now
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache: drop it from every key."""
        for key in list(self._keys):
            holders = self._keys[key]
            holders.pop(replica, None)
            if not holders:
                del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)


class Router:
    """Picks a replica among the healthy ones; thread-safe. `begin`/`end` count each replica's load."""

    def __init__(self, config: RouterConfig, num_replicas: int) -> None:
        self.config = config
        self.num_replicas = num_replicas
        self.load = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self.tree = PrefixTree(config.block_size, config.max_keys)
        self._next = 0
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def choose(self, tokens: list[int], tenant: str, cache_salt: str | None,
               exclude: frozenset[int] = frozenset()) -> Route | None:
        """The replica for a request (its load is counted until `end`), or None when none is healthy."""
        with self._lock:
            candidates = [r for r in range(self.num_replicas) if self.healthy[r] and r not in exclude]
            if not candidates:
                return None
            route = self._choose(candidates, tokens, tenant, cache_salt)
            self.load[route.replica] += 1
            if self.config.policy == "cache-aware":
                self.tree.insert(tokens, tenant, cache_salt, route.replica)
            return route

    def _least_loaded(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda r: (self.load[r], r))

    def _choose(self, candidates: list[int], tokens: list[int], tenant: str, cache_salt: str | None) -> Route:
        policy = self.config.policy
        if policy == "round-robin":
            for _ in range(self.num_replicas):
                replica = self._next % self.num_replicas
                self._next += 1
                if replica in candidates:
                    return Route(replica, "round_robin", 0)
        if policy == "least-load":
            return Route(self._least_loaded(candidates), "least_load", 0)
        if policy == "power-of-two":
            pair = self._rng.sample(candidates, min(2, len(candidates)))
            return Route(self._least_loaded(pair), "power_of_two", 0)
        loads = [self.load[r] for r in candidates]
        low, high = min(loads), max(loads)
        if high - low > self.config.balance_abs_threshold and high > self.config.balance_rel_threshold * low:
            return Route(self._least_loaded(candidates), "imbalanced", 0)
        matches = {r: n for r, n in self.tree.match(tokens, tenant, cache_salt).items() if r in candidates}
        if not matches:
            return Route(self._least_loaded(candidates), "no_match", 0)
        best = max(matches.values())
        replica = self._least_loaded([r for r, n in matches.items() if n == best])
        return Route(replica, "prefix_match", best)

    def end(self, replica: int) -> None:
        with self._lock:
            self.load[replica] -= 1
            assert self.load[replica] >= 0

    def mark_down(self, replica: int) -> None:
        with self._lock:
            self.healthy[replica] = False

    def mark_up(self, replica: int, restarted: bool) -> None:
        with self._lock:
            self.healthy[replica] = True
            if restarted:
                self.tree.forget(replica)
