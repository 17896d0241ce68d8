"""The `ExpertSource` seam: where every model (K3 and each family) gets its routed experts, and the counters a
source keeps.

A model asks its source, per MoE layer and forward:
    experts(layer, ids)              -> the weights of those experts (a lazily loading source may reuse memory:
                                        values are read in ascending id order, each before the next lookup)
    stacked_experts(layer)           -> the layer's experts stacked for one compiled call, or None
    expert_outputs(layer, pairs, x)  -> y [N, W] for the (token, expert) pairs, computed by the source (the families'
                                        stores, expert parallelism's owners), or None: the model computes them
and around them the step's bookkeeping: `begin_step`, `note_routing`, and the next-layer guess. The guess is the
model's own (its next layer's router on the current hidden state); when the source is `prefetching` the model
hands it over with `prefetch(layer, guess)` and the source reads ahead in `guess_priority` order.
`stats()` returns one typed record (`SourceStats`): this process's reads and expert cache, and with expert
parallelism each owner's counters, the network's and the owners' restarts. Every verb has one signature; the
defaults are those of a source that holds everything in RAM, so the engine, the reports and the metrics call them
without probing.

K3's trunk (embeddings, per-layer attention and MLP weights) is a K3-only seam on top of this one
(`model/weights.py` `WeightSource`), read only by `K3Model`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import numpy as np

from k3serve.model.routing import ExpertPairs, Routing


@dataclass
class StreamStats:
    """The honest counters of a streaming source. A request is *retained* only if its expert was resident before
    the step began; an expert that a prefetch brought in during the step is a *prefetch hit*, never a retained one.
    Bytes and reads come from the I/O engines, so they count what was actually read."""

    steps: int = 0
    tokens: int = 0
    expert_requests: int = 0
    expert_retained: int = 0  # resident before the step that asked
    expert_prefetch_hits: int = 0  # brought in by a prefetch during the same step
    expert_misses: int = 0  # read on demand
    expert_evictions: int = 0  # experts dropped from their slot (to make room, or released by policy none)
    prefetch_issued: int = 0
    prefetch_wasted: int = 0  # guesses dropped without ever being used
    expert_bytes_read: int = 0
    trunk_bytes_read: int = 0
    num_reads: int = 0
    checksum_retries: int = 0
    io_wait_seconds: float = 0.0  # the compute thread blocked on reads
    io_busy_seconds: float = 0.0  # summed over I/O workers
    routed_pairs: int = 0  # (token, MoE layer) pairs routed
    experts_kept: int = 0  # experts those pairs kept (TOPK each, fewer under --expert-top-p)

    def minus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def plus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def bytes_read(self) -> int:
        return self.expert_bytes_read + self.trunk_bytes_read

    @property
    def mean_experts_kept(self) -> float:
        return self.experts_kept / self.routed_pairs if self.routed_pairs else float("nan")

    @property
    def retention(self) -> float:
        return self.expert_retained / self.expert_requests if self.expert_requests else float("nan")


@dataclass
class StepReads:
    """What the current forward read on demand, and the routing that asked for it: enough to charge each miss to
    the tokens routed to its expert (engine/io_usage.py)."""

    # (layer, expert, bytes, the (layer, expert) keys its slot evicted) for each expert read on demand
    misses: list[tuple[int, int, int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    routing: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> expert_ids [T, TOPK] of this forward


@dataclass(frozen=True)
class StepTenants:
    """Whose tokens the coming forward computes, and each tenant's share of the expert cache (the engine's
    --tenant-cache-shares; `ExpertSource.note_tenants`)."""

    tenants: tuple[str, ...]  # per sequence, in batch order
    num_tokens: tuple[int, ...]  # positions each sequence computes (its rows, in order)
    shares: Mapping[str, float]  # tenant -> fraction of the expert cache's warm slots (summing to at most 1)

    def users(self, expert_ids: np.ndarray) -> dict[int, tuple[str, ...]] | None:
        """expert_ids [T, TOPK] of one layer of this forward -> for each expert routed to, the tenants whose tokens
        routed there, most tokens first (ties by name); None when the routing does not cover the forward's rows."""
        if expert_ids.shape[0] != sum(self.num_tokens):
            return None
        names = sorted(set(self.tenants))
        index = {name: i for i, name in enumerate(names)}
        rows = np.repeat([index[t] for t in self.tenants], self.num_tokens)  # [T] tenant index per row
        pairs = expert_ids >= 0  # [T, TOPK]: -1 marks a slot --expert-top-p dropped
        experts = expert_ids[pairs]
        owners = np.broadcast_to(rows[:, None], expert_ids.shape)[pairs]
        width = len(names)
        counts = np.bincount(experts * width + owners, minlength=(int(experts.max(initial=0)) + 1) * width)
        counts = counts.reshape(-1, width)  # [E, tenants]
        users = {}
        for expert in np.flatnonzero(counts.any(axis=1)).tolist():
            row = counts[expert]
            users[expert] = tuple(names[i] for i in sorted(np.flatnonzero(row).tolist(), key=lambda i: (-row[i], i)))
        return users


@dataclass
class NetworkStats:
    """Expert parallelism's calls from the front to the expert owners (cluster/expert_parallel.py)."""

    calls: int = 0
    layers: int = 0  # MoE layer passes that called owners
    bytes_sent: int = 0  # array payloads to the owners
    bytes_received: int = 0  # array payloads back
    wait_seconds: float = 0.0  # the front blocked on owner calls
    per_owner_calls: list[int] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        return self.bytes_sent + self.bytes_received


@dataclass(frozen=True)
class SourceStats:
    """What a source read and kept. A resident source has none of it (`SourceStats()`)."""

    stream: StreamStats | None = None  # this process's reads and expert cache; None when nothing streams here
    owners: tuple[StreamStats, ...] = ()  # expert parallelism: each owner's counters since it last (re)started
    network: NetworkStats | None = None  # expert parallelism: the front's calls to the owners
    owner_restarts: tuple[int, ...] = ()  # expert parallelism: times each owner died and was restarted


def guess_priority(guess: Routing) -> list[int]:
    """The experts a next-layer guess names (expert_ids [T, TOPK], weights [T, TOPK]), each once, best first: by
    the largest weight any token gave it, then by id. The order a source reads ahead in."""
    best: dict[int, float] = {}
    for e, w in zip(guess.expert_ids.ravel().tolist(), guess.weights.ravel().tolist()):
        if e >= 0:  # -1: a slot --expert-top-p dropped
            best[e] = max(best.get(e, float("-inf")), w)
    return sorted(best, key=lambda e: (-best[e], e))


class ExpertSource(ABC):
    """Where a model gets its routed experts. Implementations must return identical values for identical requests.

    `experts` is required; every other verb has the default of a source that holds everything in RAM, and a source
    overrides the ones it offers (see the module docstring)."""

    plan: Any = None  # a streaming source's RAM budget plan (stream/budget.py); None when everything is resident

    @abstractmethod
    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Any]:
        """The requested experts. A plain dict means every value stays valid at once; any other Mapping may load
        lazily and reuse memory, so its values are read in ascending id order, each before the next lookup."""

    def stacked_experts(self, layer: int) -> Any:
        """Every expert of `layer` stacked for one compiled call (K3: model/kernels.py `StackedExperts`); None when
        the source hands experts out one by one."""
        return None

    def expert_outputs(self, layer: int, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray | None:
        """y [N, W]: every (token, expert) pair's output on x [T, D] (rows in `pairs` order), computed by the
        source, or None: the model computes them from `experts()` / `stacked_experts()`."""
        return None

    def begin_step(self, num_tokens: int) -> None:
        """A forward over `num_tokens` positions starts (step boundaries for traces and counters)."""

    @property
    def prefetching(self) -> bool:
        """Whether `prefetch` reads ahead (a model computes its next-layer guess only then)."""
        return False

    def prefetch(self, layer: int, guess: Routing) -> None:
        """The model's guess of `layer`'s experts per token (its router on the previous layer's hidden state):
        they may be read ahead, in `guess_priority` order."""

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        """expert_ids [T, TOPK] that `layer` routed to (routing traces), before it asks for their `experts`."""

    def note_tenants(self, tenants: StepTenants | None) -> None:
        """Whose tokens the coming forwards compute and the tenants' shares of the expert cache (the engine's
        --tenant-cache-shares); None: one cache shared by all. A source without an expert cache ignores it."""

    def tenant_slots(self) -> dict[str, tuple[int, int]]:
        """Under expert cache shares (`note_tenants`): tenant -> (warm slots it owns, slots its share allows);
        empty otherwise."""
        return {}

    def supports_nested_forward(self) -> bool:
        """Whether a forward may run at a pause point of another one (nothing held belongs to one step)."""
        return True

    def resident_experts(self, layer: int) -> set[int] | None:
        """Experts of `layer` in RAM now (a cache-resident draft routes among them); None = all of them."""
        return None

    def stats(self, timeout: float | None = None) -> SourceStats:
        """The counters (`SourceStats`); `timeout` bounds a remote owner's answer (expert parallelism)."""
        return SourceStats()

    def local_stats(self) -> StreamStats | None:
        """This process's read counters, without asking anyone else (the engine reads them around every forward
        to charge each request its step's bytes); None when nothing streams here."""
        return None

    def step_reads(self) -> StepReads | None:
        """The experts the forward in progress (or just ended) read on demand, with its routing per layer; None
        when the source does not record them (the step's reads are then charged by token share)."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def check_integrity(self) -> None:
        """Internal tables consistent (tests call this after steps)."""

    def close(self) -> None:
        """Release threads and files."""
