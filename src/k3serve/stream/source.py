"""The streaming weight source: the model's weights read from a packed store under a RAM budget.

Per forward step (one prefill or one decode):
- `begin_step` opens the step (retention is judged against it).
- `layer(l)` returns a pinned layer at once, or waits for the streamed layer that was read and built in the
  background while layer l-1 computed, and starts reading the next streamed layer.
- `prefetch_hint(l, h)` (next-layer prefetch): runs layer l+1's router on layer l's hidden state and reads up
  to `prefetch_max` guessed experts into cold slots while layer l computes. A speculative load only takes a
  free slot or one holding an earlier guess that was never used: it never evicts a warm expert.
- `experts(l, ids)` serves the request from the expert cache: hits are used in place, misses are read in one
  offset-ordered, coalesced batch through the I/O pool, into slots freed by the cache policy.

Honest counters. A request is *retained* only if its expert was resident before the step began; an expert that
a prefetch brought in during the step is a *prefetch hit*, never a retained one. Bytes and reads come from the
I/O engines, so they count what was actually read.

NOTE: the arrays returned by `experts()` are views of cache slots, valid until the next `experts()` call.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from k3serve.errors import K3Error
from k3serve.model.weights import ExpertWeights, GlobalWeights, LayerWeights, WeightSource, build_globals, build_layer
from k3serve.stream.budget import BudgetPlan, format_size, plan_budget
from k3serve.stream.cache import POLICIES
from k3serve.stream.expert_cache import ExpertCache, StoreCorruptError
from k3serve.stream.io import IO_MODES, Extent, IOEngine
from k3serve.stream.trace import TraceWriter, trace_meta
from k3serve.weights.store import PackedStore, TrunkBlob, expert_parts

logger = logging.getLogger(__name__)

PREFETCH_MODES = ("none", "next-layer")


@dataclass(frozen=True)
class StreamOptions:
    ram_budget: int | None = None  # bytes; None = unlimited
    io: str = "pread"
    queue_depth: int = 16
    cache: str = "lru"
    prefetch: str = "none"
    prefetch_max: int | None = None  # guesses per layer; None = TOPK
    pin_trunk_bytes: int | None = None  # cap on pinned trunk; None = as much as the budget allows
    cache_profile: Path | None = None  # a routing trace: the pinned policy's popularity profile
    trace_out: Path | None = None

    def __post_init__(self) -> None:
        if self.io not in IO_MODES:
            raise K3Error(f"unknown --io {self.io!r}; choose one of {', '.join(IO_MODES)}")
        if self.cache not in POLICIES:
            raise K3Error(f"unknown --cache {self.cache!r}; choose one of {', '.join(POLICIES)}")
        if self.prefetch not in PREFETCH_MODES:
            raise K3Error(f"unknown --prefetch {self.prefetch!r}; choose one of {', '.join(PREFETCH_MODES)}")
        if self.queue_depth < 1 or self.queue_depth > 1024:
            raise K3Error(f"--queue-depth must be 1..1024, got {self.queue_depth}")
        if self.prefetch_max is not None and self.prefetch_max < 0:
            raise K3Error("--prefetch-max must be >= 0")
        if self.cache == "pinned" and self.cache_profile is None:
            raise K3Error("--cache pinned needs --cache-profile TRACE (a routing trace written by --trace-out)")


@dataclass
class StreamStats:
    steps: int = 0
    tokens: int = 0
    expert_requests: int = 0
    expert_retained: int = 0  # resident before the step that asked
    expert_prefetch_hits: int = 0  # brought in by a prefetch during the same step
    expert_misses: int = 0  # read on demand
    prefetch_issued: int = 0
    prefetch_wasted: int = 0  # guesses dropped without ever being used
    expert_bytes_read: int = 0
    trunk_bytes_read: int = 0
    num_reads: int = 0
    checksum_retries: int = 0
    io_wait_seconds: float = 0.0  # the compute thread blocked on reads
    io_busy_seconds: float = 0.0  # summed over I/O workers

    def minus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def plus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def bytes_read(self) -> int:
        return self.expert_bytes_read + self.trunk_bytes_read

    @property
    def retention(self) -> float:
        return self.expert_retained / self.expert_requests if self.expert_requests else float("nan")


class _LayerExperts(Mapping):
    """The experts of one request, loaded in groups that fit the slots, in ascending id order."""

    def __init__(self, source: StreamingSource, layer: int, ids: Sequence[int], generation: int) -> None:
        self._source = source
        self.layer = layer
        self.ids = sorted(set(int(e) for e in ids))
        self._position = {e: i for i, e in enumerate(self.ids)}
        self.generation = generation
        self.loaded: dict[int, ExpertWeights] = {}

    def __getitem__(self, expert: int) -> ExpertWeights:
        expert = int(expert)
        if expert not in self.loaded:
            if expert not in self._position:
                raise KeyError(expert)
            self._source._load_group(self, self._position[expert])
        return self.loaded[expert]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))


class StreamingSource(WeightSource):
    def __init__(self, store: PackedStore, options: StreamOptions = StreamOptions()) -> None:
        self.store = store
        self.options = options
        self.config = config = store.config
        profile = None
        if options.cache_profile is not None:
            from k3serve.stream.trace import check_trace_model, read_trace

            trace = read_trace(options.cache_profile)
            check_trace_model(trace, config, options.cache_profile, "--cache-profile")
            profile = trace.popularity()
        self.plan: BudgetPlan = plan_budget(store, options.ram_budget, options.pin_trunk_bytes)
        self.stats = StreamStats()
        self.trunk_io = IOEngine(store.trunk_path, options.io, options.queue_depth)
        self.expert_io = IOEngine(store.expert_path, options.io, options.queue_depth)
        self._trunk_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3trunk")
        self._step = -1
        self._next_token = 0
        self._step_first_token = 0
        self._generation = 0
        self._current: _LayerExperts | None = None
        self.trace: TraceWriter | None = (TraceWriter(options.trace_out, trace_meta(config, store.expert_blob_size))
                                          if options.trace_out else None)

        # trunk: globals and pinned layers now, one staging buffer for the streamed ones
        self._globals: GlobalWeights = build_globals(self._read_trunk_blob(store.globals, "globals", None).__getitem__)
        self._pinned: dict[int, LayerWeights] = {}
        for layer in self.plan.pinned_layers:
            arrays = self._read_trunk_blob(store.layers[layer], f"trunk layer {layer}", None)
            self._pinned[layer] = build_layer(config, layer, arrays.__getitem__)
        self._streamed = list(self.plan.streamed_layers)
        staging = max((store.layers[l].read_size for l in self._streamed), default=0)
        self._trunk_staging = _aligned_buffer(staging) if self._streamed else None
        self._trunk_pending: tuple[int, Future] | None = None

        # expert slots: one arena, allocated once
        self._parts = expert_parts(config)
        self._stride = store.expert_stride
        num_slots = self.plan.expert_slots
        self._arena = _aligned_buffer(num_slots * self._stride)
        self._arena_view = memoryview(self._arena)
        arena = np.frombuffer(self._arena, dtype=np.uint8)
        self._slot_weights = [self._weights_view(arena[i * self._stride:(i + 1) * self._stride])
                              for i in range(num_slots)]
        self.expert_cache = ExpertCache(
            store, self.expert_io, num_slots, options.cache, self.stats, slot_buffer=self._slot_view,
            top_k=config.num_experts_per_token, prefetch=options.prefetch != "none",
            prefetch_max=options.prefetch_max, profile=profile)
        self.prefetch_max = self.expert_cache.prefetch_max
        logger.info("streaming source: %s", self.plan.lines()[0])

    def _slot_view(self, index: int) -> memoryview:
        return self._arena_view[index * self._stride:(index + 1) * self._stride]

    # ---- WeightSource ------------------------------------------------------------------------------------------
    def global_weights(self) -> GlobalWeights:
        return self._globals

    def layer(self, layer: int) -> LayerWeights:
        if layer in self._pinned:
            return self._pinned[layer]
        weights = self._take_trunk(layer)
        following = self._next_streamed(layer)
        if following is not None:
            self._trunk_pending = (following, self._trunk_worker.submit(self._load_trunk_layer, following))
        return weights

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        self.expert_cache.release()
        self._generation += 1
        request = _LayerExperts(self, layer, expert_ids, self._generation)
        if request.ids:
            self._load_group(request, 0)
        return request

    # ---- hooks the model calls ---------------------------------------------------------------------------------
    def begin_step(self, num_tokens: int) -> None:
        self._step += 1
        self.stats.steps += 1
        self.stats.tokens += num_tokens
        self._step_first_token = self._next_token
        self._next_token += num_tokens
        self.expert_cache.begin_step()

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        if self.trace is not None:
            self.trace.write(self._step, self._step_first_token, layer, expert_ids)

    def prefetch_hint(self, layer: int, hidden: np.ndarray) -> None:
        """hidden [T, H]: layer `layer`'s input to its post-attention norm."""
        nxt = layer + 1
        if self.options.prefetch == "none" or self.prefetch_max == 0 or nxt >= self.config.num_layers \
                or self.config.is_dense(nxt):
            return
        from k3serve.model.moe import guess_next_layer
        per_token, scores = guess_next_layer(self.config, self._peek_trunk(nxt), hidden)  # [T, TOPK], [T, NE]
        best = scores.max(axis=0)  # [NE]
        guesses = sorted(set(int(e) for e in per_token.ravel()), key=lambda e: (-best[e], e))
        self.expert_cache.prefetch(nxt, guesses)

    # ---- expert cache ------------------------------------------------------------------------------------------
    def _load_group(self, request: _LayerExperts, start: int) -> None:
        if request.generation != self._generation:
            raise RuntimeError("expert weights from an earlier experts() call are no longer valid")
        request.loaded.clear()
        group = request.ids[start:start + self.expert_cache.num_slots]
        used = self.expert_cache.load(request.layer, group)
        request.loaded.update({self.expert_cache.slot_key(i)[1]: self._slot_weights[i] for i in used})

    def _weights_view(self, blob: np.ndarray) -> ExpertWeights:
        views = {(p.matrix, p.part): blob[p.offset:p.offset + p.nbytes].reshape(p.shape) for p in self._parts}
        return ExpertWeights(
            w1_packed=views["w1", "weight_packed"], w1_scales=views["w1", "weight_scale"],
            w3_packed=views["w3", "weight_packed"], w3_scales=views["w3", "weight_scale"],
            w2_packed=views["w2", "weight_packed"], w2_scales=views["w2", "weight_scale"],
        )

    # ---- trunk -------------------------------------------------------------------------------------------------
    def _next_streamed(self, layer: int) -> int | None:
        if not self._streamed:
            return None
        later = [l for l in self._streamed if l > layer]
        return later[0] if later else self._streamed[0]

    def _take_trunk(self, layer: int) -> LayerWeights:
        pending, self._trunk_pending = self._trunk_pending, None
        started = time.perf_counter()
        try:
            if pending is not None:
                pending_layer, future = pending
                weights = future.result()
                if pending_layer == layer:
                    return weights
                del weights  # out-of-order request: drop the read-ahead, keep within the budget
            return self._load_trunk_layer(layer)
        finally:
            self.stats.io_wait_seconds += time.perf_counter() - started

    def _peek_trunk(self, layer: int) -> LayerWeights:
        if layer in self._pinned:
            return self._pinned[layer]
        if self._trunk_pending is None or self._trunk_pending[0] != layer:
            self._trunk_pending = (layer, self._trunk_worker.submit(self._load_trunk_layer, layer))
        started = time.perf_counter()
        try:
            return self._trunk_pending[1].result()
        finally:
            self.stats.io_wait_seconds += time.perf_counter() - started

    def _load_trunk_layer(self, layer: int) -> LayerWeights:
        arrays = self._read_trunk_blob(self.store.layers[layer], f"trunk layer {layer}", self._trunk_staging)
        return build_layer(self.config, layer, arrays.__getitem__)

    def _read_trunk_blob(self, blob: TrunkBlob, what: str, staging: mmap.mmap | None) -> dict[str, np.ndarray]:
        buffer = staging if staging is not None else _aligned_buffer(blob.read_size)
        view = memoryview(buffer)[:blob.read_size]
        extent = Extent(blob.offset, view, blob.size, blob.crc32)
        failed = self.trunk_io.submit([extent])[id(extent)].result()
        if failed:
            self.stats.checksum_retries += 1
            logger.warning("checksum mismatch on %s at offset %d of %s: re-reading", what, blob.offset,
                           self.store.trunk_path)
            if self.trunk_io.read_now(extent):
                raise StoreCorruptError(f"{what} in {self.store.trunk_path} at offset {blob.offset} ({blob.size} "
                                        "bytes) failed its CRC-32 check twice; the store is corrupt: repack it")
        raw = np.frombuffer(buffer, dtype=np.uint8, count=blob.size)
        arrays = blob.decode(raw)
        del raw, view
        return arrays

    # ---- reporting ---------------------------------------------------------------------------------------------
    def resident_experts(self, layer: int) -> set[int]:
        """Experts of `layer` whose bytes are in a slot now (read and verified): what a cache-resident draft may
        route to without touching the disk (engine/drafters.py)."""
        return self.expert_cache.resident_experts(layer)

    def stream_stats(self) -> StreamStats:
        s = StreamStats(**{f.name: getattr(self.stats, f.name) for f in fields(self.stats)})
        s.expert_bytes_read = self.expert_io.counters.bytes_read
        s.trunk_bytes_read = self.trunk_io.counters.bytes_read
        s.num_reads = self.expert_io.counters.num_reads + self.trunk_io.counters.num_reads
        s.io_busy_seconds = self.expert_io.counters.busy_seconds + self.trunk_io.counters.busy_seconds
        return s

    def describe(self) -> str:
        o = self.options
        return (f"io={o.io} qd={o.queue_depth} cache={o.cache} prefetch={o.prefetch} layout={self.store.layout} "
                f"slots={self.expert_cache.num_slots} pinned_layers={len(self._pinned)}/{self.config.num_layers}")

    def check_integrity(self) -> None:
        """Slot table, free list and cold set agree (tests call this after steps)."""
        self.expert_cache.check_integrity()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self._trunk_worker.shutdown(wait=True)
        self.trunk_io.close()
        self.expert_io.close()


def stream_report_lines(stats: StreamStats, tokens: int, wall_seconds: float, plan: BudgetPlan,
                        peak_rss: int) -> list[str]:
    """Run-report lines for `tokens` generated tokens over `wall_seconds` (a decode phase)."""
    per = max(tokens, 1)
    mbps = stats.bytes_read / 2**20 / stats.io_wait_seconds if stats.io_wait_seconds > 0 else float("nan")
    served = stats.expert_retained + stats.expert_prefetch_hits
    lines = [
        f"disk read/token   {format_size(stats.bytes_read / per)} (experts {format_size(stats.expert_bytes_read / per)}"
        f", trunk {format_size(stats.trunk_bytes_read / per)}), {stats.num_reads / per:.1f} reads/token",
        f"effective read    {stats.bytes_read / 2**20 / wall_seconds if wall_seconds > 0 else float('nan'):.1f} MB/s"
        f" over the phase, {mbps:.1f} MB/s per second of I/O wait",
        f"retention         {100 * stats.retention:.1f}% of {stats.expert_requests} expert requests resident "
        f"before their step (+{stats.expert_prefetch_hits} prefetch hits; {served} served without a demand read)",
        f"prefetch          {stats.prefetch_issued} issued, {stats.prefetch_wasted} dropped unused",
        f"time split        I/O wait {stats.io_wait_seconds:.3f} s, compute {max(wall_seconds - stats.io_wait_seconds, 0):.3f} s",
    ]
    budget = "unlimited" if plan.budget_bytes is None else format_size(plan.budget_bytes)
    lines.append(f"memory            peak RSS {format_size(peak_rss)} vs RAM budget {budget} for weights "
                 f"(planned {format_size(plan.total_bytes)})")
    if stats.checksum_retries:
        lines.append(f"checksum retries  {stats.checksum_retries}")
    return lines
