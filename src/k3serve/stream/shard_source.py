"""The experts of one expert-store shard under a RAM budget: what an expert owner (k3serve.cluster.expert_parallel)
reads its weights through. No trunk and no model math.

The whole budget goes to expert slots (budget // blob stride, at least top-k, at most the shard's blobs), served by
the engine's own `ExpertSlots` and `ExpertCache` over the engine's own I/O pool, with the streaming source's honest counters
(`StreamStats`: retention counts an expert resident before the step that asked for it).

NOTE: like `StreamingSource.experts`, the arrays handed out are views of cache slots, valid until the next
`experts()` call (stream/slots.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from k3serve.errors import K3Error
from k3serve.model.expert_source import ExpertSource, SourceStats, StreamStats
from k3serve.model.weights import ExpertWeights
from k3serve.stream.budget import BudgetError
from k3serve.units import format_size
from k3serve.stream.cache import POLICIES
from k3serve.stream.io import IO_MODES, IOEngine
from k3serve.stream.slots import ExpertSlots
from k3serve.weights.shard import ExpertShard
from k3serve.weights.store import expert_parts


@dataclass(frozen=True)
class ShardOptions:
    ram_budget: int | None = None  # bytes for expert slots; None = every blob of the shard
    io: str = "pread"
    queue_depth: int = 16
    cache: str = "lru"

    def __post_init__(self) -> None:
        if self.io not in IO_MODES:
            raise K3Error(f"unknown --io {self.io!r}; choose one of {', '.join(IO_MODES)}")
        if self.cache not in POLICIES or self.cache == "pinned":
            raise K3Error(f"expert owners take --cache none, lru, lfu or s3fifo, got {self.cache!r}")
        if not 1 <= self.queue_depth <= 1024:
            raise K3Error(f"--queue-depth must be 1..1024, got {self.queue_depth}")
        if self.ram_budget is not None and self.ram_budget < 0:
            raise K3Error("an expert owner's RAM budget must be >= 0")


def shard_slots(shard: ExpertShard, ram_budget: int | None) -> int:
    """Expert slots a budget buys on `shard`: at least top-k (one token's experts), at most every blob."""
    top_k = shard.config.num_experts_per_token
    if ram_budget is None:
        return shard.num_experts_total
    slots = min(ram_budget // shard.expert_stride, shard.num_experts_total)
    if slots < top_k:
        minimum = top_k * shard.expert_stride
        raise BudgetError(f"an expert owner's RAM budget {format_size(ram_budget)} holds {slots} experts of "
                          f"{format_size(shard.expert_stride)}; it needs at least {top_k} (top-k): "
                          f"{minimum} bytes ({format_size(minimum)})")
    return int(slots)


class ShardExpertSource(ExpertSource):
    def __init__(self, shard: ExpertShard, options: ShardOptions = ShardOptions()) -> None:
        self.shard = shard
        self.options = options
        self.config = shard.config
        self.counters = StreamStats()
        self.io = IOEngine(shard.expert_path, options.io, options.queue_depth)
        parts = expert_parts(self.config)

        def view(blob: np.ndarray) -> ExpertWeights:
            arrays = {(p.matrix, p.part): blob[p.offset:p.offset + p.nbytes].reshape(p.shape) for p in parts}
            return ExpertWeights(
                w1_packed=arrays["w1", "weight_packed"], w1_scales=arrays["w1", "weight_scale"],
                w3_packed=arrays["w3", "weight_packed"], w3_scales=arrays["w3", "weight_scale"],
                w2_packed=arrays["w2", "weight_packed"], w2_scales=arrays["w2", "weight_scale"])

        self.slots: ExpertSlots[ExpertWeights] = ExpertSlots(
            shard, self.io, shard_slots(shard, options.ram_budget), options.cache, self.counters, view,
            top_k=self.config.num_experts_per_token, prefetch=False, prefetch_max=None)

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def cache_bytes(self) -> int:
        return self.num_slots * self.shard.expert_stride

    def begin_step(self, num_tokens: int) -> None:
        self.counters.steps += 1
        self.counters.tokens += num_tokens
        self.slots.cache.begin_step()

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        """The requested experts of `layer` (all owned by this shard), loaded in groups of `num_slots`."""
        foreign = [int(e) for e in expert_ids if not self.shard.owns(int(e))]
        if foreign or layer not in self.shard.experts:
            raise K3Error(f"shard {self.shard.shard} ({self.shard.path}) does not hold layer {layer} experts "
                          f"{foreign or list(expert_ids)}")
        return self.slots.request(layer, expert_ids)

    def resident_experts(self, layer: int) -> set[int]:
        return self.slots.cache.resident_experts(layer)

    def stats(self, timeout: float | None = None) -> SourceStats:
        return SourceStats(stream=self._stream_stats())

    def local_stats(self) -> StreamStats:
        return self._stream_stats()

    def _stream_stats(self) -> StreamStats:
        s = StreamStats(**{f.name: getattr(self.counters, f.name) for f in fields(self.counters)})
        s.expert_bytes_read = self.io.counters.bytes_read
        s.num_reads = self.io.counters.num_reads
        s.io_busy_seconds = self.io.counters.busy_seconds
        return s

    def check_integrity(self) -> None:
        self.slots.cache.check_integrity()

    def close(self) -> None:
        self.io.close()
