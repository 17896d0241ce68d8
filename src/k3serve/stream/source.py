"""The streaming weight source: the model's weights read from a packed store under a RAM budget.

Per forward step (one prefill or one decode):
- `begin_step` opens the step (retention is judged against it).
- `layer(l)` returns a pinned layer at once, or waits for the streamed layer that was read and built in the
  background while layer l-1 computed, and starts reading the next streamed layer.
- `prefetch(l + 1, guess)` (next-layer prefetch): the model's guess of layer l+1's experts (its router on layer l's
  hidden state, `peek_layer(l + 1)` giving the read-ahead layer) reads up to `prefetch_max` guessed experts into
  cold slots while layer l computes. A speculative load only takes a
  free slot or one holding an earlier guess that was never used: it never evicts a warm expert.
- `experts(l, ids)` serves the request from the expert cache: hits are used in place, misses are read in one
  offset-ordered, coalesced batch through the I/O pool, into slots freed by the cache policy.

The counters are `StreamStats` (model/expert_source.py), the options `StreamOptions` (stream/options.py) and the slots
`ExpertSlots` (stream/slots.py), all shared with the families' streaming experts (stream/family_source.py).

NOTE: the arrays returned by `experts()` are views of cache slots, valid until the next `experts()` call.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from typing import Sequence

import numpy as np

from k3serve.model.expert_source import SourceStats, StepReads, StreamStats, guess_priority
from k3serve.model.routing import Routing
from k3serve.model.weights import ExpertWeights, GlobalWeights, LayerWeights, WeightSource, build_globals, build_layer
from k3serve.stream.budget import BudgetPlan, plan_budget
from k3serve.stream.expert_cache import StoreCorruptError
from k3serve.stream.io import Extent, StripedIO, open_reader
from k3serve.stream.options import StreamOptions
from k3serve.stream.slots import ExpertSlots, aligned_buffer
from k3serve.stream.trace import TraceWriter, trace_meta
from k3serve.units import format_size
from k3serve.weights.store import PackedStore, TrunkBlob, expert_parts

logger = logging.getLogger(__name__)


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
        self.plan: BudgetPlan = plan_budget(store, options.ram_budget, options.pin_trunk_bytes,
                                            trunk_dtype=options.trunk_dtype)
        self._dtype = options.trunk_dtype
        self.counters = StreamStats()
        # one reader per store file; a striped store's has a queue of `queue_depth` workers per drive
        self.trunk_io = open_reader(store.trunk_files, store.trunk_stripe_chunk_bytes, options.io,
                                    options.queue_depth)
        self.expert_io = open_reader(store.expert_files, store.stripe_chunk_bytes, options.io, options.queue_depth)
        self._trunk_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3trunk")
        self._step = -1
        self._next_token = 0
        self._step_routing: dict[int, np.ndarray] = {}  # layer -> expert_ids [T, TOPK] of this step (charging)
        self._step_first_token = 0
        # best effort: a full disk stops the trace, never a request (TraceWriter)
        self.trace: TraceWriter | None = (
            TraceWriter(options.trace_out, trace_meta(config, store.expert_blob_size), best_effort=True)
            if options.trace_out else None)

        # trunk: globals and pinned layers now, one staging buffer for the streamed ones
        self._globals: GlobalWeights = build_globals(
            self._read_trunk_blob(store.globals, "globals", None).__getitem__, self._dtype)
        self._pinned: dict[int, LayerWeights] = {}
        for layer in self.plan.pinned_layers:
            arrays = self._read_trunk_blob(store.layers[layer], f"trunk layer {layer}", None)
            self._pinned[layer] = build_layer(config, layer, arrays.__getitem__, self._dtype)
        self._streamed = list(self.plan.streamed_layers)
        staging = max((store.layers[l].read_size for l in self._streamed), default=0)
        self._trunk_staging = aligned_buffer(staging) if self._streamed else None
        self._trunk_pending: tuple[int, Future] | None = None
        # without the read-ahead (a bf16 trunk in a tight budget) no second streamed layer may be held, so the
        # next-layer prefetch, which needs the next layer's router, is off too
        self._read_ahead = self.plan.trunk_read_ahead
        prefetch = options.prefetch != "none" and self._read_ahead
        if options.prefetch != "none" and not prefetch:
            logger.warning("next-layer prefetch is off: the budget has no room for a second streamed trunk layer")
        elif prefetch and self.plan.expert_slots <= config.num_experts_per_token:
            prefetch = False  # every slot holds an expert of the layer that runs: a guess has nowhere to land
            logger.warning("next-layer prefetch is off: the budget holds %d expert slots, all taken by the top-%d "
                           "experts of the layer that runs, so no guess has a slot to be read into (raise "
                           "--ram-budget by at least one expert, %d bytes)", self.plan.expert_slots,
                           config.num_experts_per_token, store.expert_stride)

        # expert slots: one arena, allocated once
        self._parts = expert_parts(config)
        self.slots: ExpertSlots[ExpertWeights] = ExpertSlots(
            store, self.expert_io, self.plan.expert_slots, options.cache, self.counters, self._weights_view,
            top_k=config.num_experts_per_token, prefetch=prefetch,
            prefetch_max=options.prefetch_max, profile=profile)
        self.expert_cache = self.slots.cache
        self.prefetch_max = self.expert_cache.prefetch_max
        logger.info("streaming source: %s", self.plan.lines()[0])

    # ---- WeightSource ------------------------------------------------------------------------------------------
    def global_weights(self) -> GlobalWeights:
        return self._globals

    def layer(self, layer: int) -> LayerWeights:
        if layer in self._pinned:
            return self._pinned[layer]
        weights = self._take_trunk(layer)
        following = self._next_streamed(layer) if self._read_ahead else None
        if following is not None:
            self._trunk_pending = (following, self._trunk_worker.submit(self._load_trunk_layer, following))
        return weights

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        return self.slots.request(layer, expert_ids)

    # ---- hooks the model calls ---------------------------------------------------------------------------------
    def supports_nested_forward(self) -> bool:
        return False  # the trunk read-ahead and the expert cache's retention follow one step at a time

    def begin_step(self, num_tokens: int) -> None:
        self._step += 1
        self.counters.steps += 1
        self.counters.tokens += num_tokens
        self._step_first_token = self._next_token
        self._next_token += num_tokens
        self._step_routing = {}
        self.expert_cache.begin_step()

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        if self.trace is not None:
            self.trace.write(self._step, self._step_first_token, layer, expert_ids)
        self._step_routing[layer] = expert_ids

    def step_reads(self) -> StepReads:
        return StepReads(list(self.expert_cache.step_misses), dict(self._step_routing))

    @property
    def prefetching(self) -> bool:
        return self.options.prefetch != "none" and self._read_ahead and self.prefetch_max != 0

    def prefetch(self, layer: int, guess: Routing) -> None:
        self.expert_cache.prefetch(layer, guess_priority(guess))

    def peek_layer(self, layer: int) -> LayerWeights:
        """The layer for the model's next-layer guess: pinned, or the read-ahead (waited for, not taken)."""
        return self._peek_trunk(layer)

    # ---- expert slots ------------------------------------------------------------------------------------------
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
            self.counters.io_wait_seconds += time.perf_counter() - started

    def _peek_trunk(self, layer: int) -> LayerWeights:
        if layer in self._pinned:
            return self._pinned[layer]
        if self._trunk_pending is None or self._trunk_pending[0] != layer:
            self._trunk_pending = (layer, self._trunk_worker.submit(self._load_trunk_layer, layer))
        started = time.perf_counter()
        try:
            return self._trunk_pending[1].result()
        finally:
            self.counters.io_wait_seconds += time.perf_counter() - started

    def _load_trunk_layer(self, layer: int) -> LayerWeights:
        arrays = self._read_trunk_blob(self.store.layers[layer], f"trunk layer {layer}", self._trunk_staging)
        return build_layer(self.config, layer, arrays.__getitem__, self._dtype)

    def _read_trunk_blob(self, blob: TrunkBlob, what: str, staging: mmap.mmap | None) -> dict[str, np.ndarray]:
        buffer = staging if staging is not None else aligned_buffer(blob.read_size)
        view = memoryview(buffer)[:blob.read_size]
        extent = Extent(blob.offset, view, blob.size, blob.crc32)
        failed = self.trunk_io.submit([extent])[id(extent)].result()
        if failed:
            self.counters.checksum_retries += 1
            logger.warning("checksum mismatch on %s at offset %d of %s: re-reading", what, blob.offset,
                           self.store.trunk_path)
            if self.trunk_io.read_now(extent):
                raise StoreCorruptError(f"{what} in {self.store.trunk_path} at offset {blob.offset} ({blob.size} "
                                        "bytes) failed its CRC-32 check twice; the store is corrupt: repack it")
        raw = np.frombuffer(buffer, dtype=np.uint8, count=blob.size)
        arrays = blob.decode(raw, keep_bf16=self._dtype == "bf16")
        del raw, view
        return arrays

    # ---- reporting ---------------------------------------------------------------------------------------------
    def resident_experts(self, layer: int) -> set[int]:
        """Experts of `layer` whose bytes are in a slot now (read and verified): what a cache-resident draft may
        route to without touching the disk (engine/drafters.py)."""
        return self.expert_cache.resident_experts(layer)

    def stats(self, timeout: float | None = None) -> SourceStats:
        return SourceStats(stream=self._stream_stats())

    def local_stats(self) -> StreamStats:
        return self._stream_stats()

    def _stream_stats(self) -> StreamStats:
        s = StreamStats(**{f.name: getattr(self.counters, f.name) for f in fields(self.counters)})
        s.expert_bytes_read = self.expert_io.counters.bytes_read
        s.trunk_bytes_read = self.trunk_io.counters.bytes_read
        s.num_reads = self.expert_io.counters.num_reads + self.trunk_io.counters.num_reads
        s.io_busy_seconds = self.expert_io.counters.busy_seconds + self.trunk_io.counters.busy_seconds
        return s

    def describe(self) -> str:
        o = self.options
        text = (f"io={o.io} qd={o.queue_depth} cache={o.cache} prefetch={o.prefetch} layout={self.store.layout} "
                f"slots={self.expert_cache.num_slots} pinned_layers={len(self._pinned)}/{self.config.num_layers}")
        if isinstance(self.expert_io, StripedIO):  # what each drive has served since the store was opened
            shares = [a.bytes_read + b.bytes_read for a, b in zip(self.expert_io.drive_counters(),
                                                                  self.trunk_io.drive_counters())]
            text += (f" drives={len(shares)} (qd {o.queue_depth} each; read "
                     f"{' / '.join(format_size(n) for n in shares)} since load)")
        return text

    def check_integrity(self) -> None:
        """Slot table, free list and cold set agree (tests call this after steps)."""
        self.expert_cache.check_integrity()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self._trunk_worker.shutdown(wait=True)
        self.trunk_io.close()
        self.expert_io.close()
