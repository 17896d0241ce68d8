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

With a bf16 trunk on a format-2 store (`plan.trunk_views`, the memory floor, stream/trunk_spans.py) a streamed
layer is views of a staging ring buffer (the read-ahead goes to the other one), a dense layer's MLP is read in
pieces as the model reaches it (`PieceReader`), embedding rows are read per token (`EmbeddingReader`) and an
lm_head that is not pinned is read in row chunks through the ring (`HeadChunks`). A Q8_0 trunk (`pack
--trunk-precision q8_0|mxfp4`) is held so too: its matrices and fused groups are `QuantizedMatrix` views of the
same buffers. An MXFP4 trunk on a store of format 2 is not (an entry there is its nibbles, then its scales, so
neither a fused group nor a row is contiguous): it is built as copies, as a float32 or bf16 trunk on a format-1
store is.

NOTE: the arrays returned by `experts()` are views of cache slots, valid until the next `experts()` call; a
streamed layer's arrays (views mode) are valid until the layer after next is taken.
"""

from __future__ import annotations

import logging
import mmap
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from typing import Sequence

import numpy as np

from k3serve.model.expert_source import SourceStats, StepReads, StepTenants, StreamStats, guess_priority
from k3serve.model.routing import Routing
from k3serve.model.kernels import linear
from k3serve.model.weights import (DenseMLPPieces, ExpertWeights, GlobalWeights, LayerWeights, WeightSource,
                                   adjacent_quantized_view, adjacent_view, build_globals, build_layer,
                                   build_small_globals)
from k3serve.stream.budget import BudgetPlan, ViewSizes, plan_budget
from k3serve.stream.expert_cache import StoreCorruptError
from k3serve.stream.io import Extent, StripedIO, open_reader
from k3serve.stream.options import StreamOptions
from k3serve.stream.slots import ExpertSlots, aligned_buffer
from k3serve.stream.trace import TraceWriter, trace_meta
from k3serve.stream.trunk_spans import MLP_DOWN, MLP_GATE, MLP_UP, Span, head_chunks, piece_spans
from k3serve.units import format_size
from k3serve.weights import names
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.weights.store import PackedStore, TensorEntry, TrunkBlob, expert_parts

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
        self._tenants: StepTenants | None = None  # whose tokens the forwards compute (tenant shares)
        self._routing_ahead: tuple[int, np.ndarray] | None = None  # the layer about to ask for its experts
        # best effort: a full disk stops the trace, never a request (TraceWriter)
        self.trace: TraceWriter | None = (
            TraceWriter(options.trace_out, trace_meta(config, store.expert_blob_size), best_effort=True)
            if options.trace_out else None)

        # trunk: globals and pinned layers now, one staging buffer for the streamed ones (or, held as views, a
        # ring of one or two: stream/trunk_spans.py)
        self._views = self.plan.trunk_views
        self._ring = [aligned_buffer(self.plan.staging_bytes) for _ in range(self.plan.ring_buffers)]
        self._current = 0  # the ring buffer the layer being computed was read into
        self._trunk_pending: tuple[int, Future, int] | None = None  # (layer, its load, its ring buffer)
        self._embed_reads = [0, 0]  # bytes, reads of embedding rows (read on demand, views mode)
        # embedding rows: exactly their bytes through the page cache (pread needs no alignment), counted as rows
        self._row_io = open_reader(store.trunk_files, store.trunk_stripe_chunk_bytes, "pread", 1) \
            if self._views else None
        self._globals: GlobalWeights = self._build_globals() if self._views else build_globals(
            self._read_trunk_blob(store.globals, "globals", None).__getitem__, self._dtype)
        self._pinned: dict[int, LayerWeights] = {}
        for layer in self.plan.pinned_layers:
            arrays = self._read_trunk_blob(store.layers[layer], f"trunk layer {layer}", None)
            self._pinned[layer] = build_layer(config, layer, arrays.__getitem__, self._dtype, views=self._views)
        self._streamed = list(self.plan.streamed_layers)
        staging = max((store.layers[l].read_size for l in self._streamed), default=0)
        self._trunk_staging = aligned_buffer(staging) if self._streamed and not self._views else None
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
            self._start_load(following)
        return weights

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        ahead, self._routing_ahead = self._routing_ahead, None
        users = None
        if self._tenants is not None and ahead is not None and ahead[0] == layer:  # (a draft's forward notes none)
            users = self._tenants.users(ahead[1])
        return self.slots.request(layer, expert_ids, users)

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
        self.counters.routed_pairs += int(expert_ids.shape[0])
        self.counters.experts_kept += int(np.count_nonzero(expert_ids >= 0))
        if self.trace is not None:
            self.trace.write(self._step, self._step_first_token, layer, expert_ids)
        self._step_routing[layer] = expert_ids
        self._routing_ahead = (layer, expert_ids)

    def note_tenants(self, tenants: StepTenants | None) -> None:
        self._tenants = tenants
        self.expert_cache.set_tenant_shares(None if tenants is None else tenants.shares)

    def tenant_slots(self) -> dict[str, tuple[int, int]]:
        owned, quotas = self.expert_cache.owned_slots(), self.expert_cache.tenant_quotas()
        return {tenant: (owned.get(tenant, 0), quotas.get(tenant, 0)) for tenant in {*owned, *quotas}} \
            if quotas else {}

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

    def _other_buffer(self) -> int:
        """The ring buffer a read-ahead goes to: not the one the model computes from."""
        return (self._current + 1) % len(self._ring) if self._ring else 0

    def _start_load(self, layer: int) -> None:
        buffer = self._other_buffer()
        self._trunk_pending = (layer, self._trunk_worker.submit(self._load_trunk_layer, layer, buffer), buffer)

    def _take_trunk(self, layer: int) -> LayerWeights:
        pending, self._trunk_pending = self._trunk_pending, None
        started = time.perf_counter()
        try:
            if pending is not None:
                pending_layer, future, buffer = pending
                weights = future.result()
                if pending_layer == layer:
                    self._current = buffer
                    return weights
                del weights  # out-of-order request: drop the read-ahead, keep within the budget
            self._current = self._other_buffer()
            return self._load_trunk_layer(layer, self._current)
        finally:
            self.counters.io_wait_seconds += time.perf_counter() - started

    def _peek_trunk(self, layer: int) -> LayerWeights:
        if layer in self._pinned:
            return self._pinned[layer]
        started = time.perf_counter()
        try:
            if self._trunk_pending is None or self._trunk_pending[0] != layer:
                if self._trunk_pending is not None:
                    self._trunk_pending[1].result()  # its buffer is about to be read into again
                self._start_load(layer)
            assert self._trunk_pending is not None
            return self._trunk_pending[1].result()
        finally:
            self.counters.io_wait_seconds += time.perf_counter() - started

    def _load_trunk_layer(self, layer: int, buffer: int = 0) -> LayerWeights:
        blob = self.store.layers[layer]
        if not self._views:
            arrays = self._read_trunk_blob(blob, f"trunk layer {layer}", self._trunk_staging)
            return build_layer(self.config, layer, arrays.__getitem__, self._dtype)
        spans = piece_spans(blob.offset, blob.entries, blob.size)
        if len(spans) == 1:
            arrays = self._read_trunk_blob(blob, f"trunk layer {layer}", self._ring[buffer])
            return build_layer(self.config, layer, arrays.__getitem__, self._dtype, views=True)
        # a dense layer in three pieces through one buffer: the attention part now, the MLP as the model reaches it
        pieces = PieceReader(self, layer, spans, buffer)
        arrays = pieces.read(0)
        return build_layer(self.config, layer, arrays.__getitem__, self._dtype, views=True,
                           mlp=DenseMLPPieces(gate_up=pieces.gate_up, down=pieces.down))

    # ---- trunk held as views: globals, embedding rows, lm_head chunks, pieces ------------------------------------
    def _build_globals(self) -> GlobalWeights:
        g = self.store.globals
        sizes = ViewSizes(self.store)
        small = self._read_span(sizes.small_span, aligned_buffer(sizes.small_span.length), "globals")
        arrays = _shifted(g, [t for t in g.entries if t.name not in (names.EMBED, names.LM_HEAD)],
                          g.offset - sizes.small_span.start).decode(small, keep_bf16=True)
        head = g.tensor(names.LM_HEAD)
        embed = EmbeddingReader(self, g.offset, g.tensor(names.EMBED))
        lm_head: np.ndarray | QuantizedMatrix | HeadChunks
        if self.plan.head_pinned:
            raw = self._read_span(sizes.head_span, aligned_buffer(sizes.head_span.length), "lm_head")
            lm_head = stored_rows(head.dtype, raw[sizes.head_span.skip:sizes.head_span.skip + head.nbytes],
                                  head.shape)
        else:
            lm_head = HeadChunks(self, g.offset, head)
        return build_small_globals(arrays.__getitem__, embed, lm_head)

    def _read_span(self, span: Span, buffer: mmap.mmap, what: str) -> np.ndarray:
        """Read `span` of trunk.bin into the head of `buffer` -> u8 [span.length], a view of it (no checksum: a
        span is part of a blob; the caller checks what it can)."""
        extent = Extent(span.start, memoryview(buffer)[:span.length])
        self.trunk_io.submit([extent])[id(extent)].result()
        return np.frombuffer(buffer, dtype=np.uint8, count=span.length)

    def head_buffer(self) -> mmap.mmap:
        """The ring buffer a streamed lm_head is read through: not the one a pending read-ahead fills."""
        if self._trunk_pending is not None and len(self._ring) > 1:
            return self._ring[(self._trunk_pending[2] + 1) % len(self._ring)]
        return self._ring[self._current]

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
        s.trunk_bytes_read = self.trunk_io.counters.bytes_read + self._embed_reads[0]
        s.num_reads = self.expert_io.counters.num_reads + self.trunk_io.counters.num_reads + self._embed_reads[1]
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
        if self._row_io is not None:
            self._row_io.close()
        self._trunk_worker.shutdown(wait=True)
        self.trunk_io.close()
        self.expert_io.close()


def stored_rows(dtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | QuantizedMatrix:
    """raw u8 [rows * row bytes], whole rows of a bf16, Q8_0 or MXFP4 (laid out by rows, format 3) matrix [rows, C]
    -> a view of them: bf16 bits [rows, C] or a `QuantizedMatrix` (the formats whose rows are contiguous;
    `budget.builds_views`)."""
    if dtype in ("Q8_0", "MXFP4"):
        return QuantizedMatrix.from_bytes(dtype, raw, shape, rows=True)
    assert dtype == "BF16", f"rows of a {dtype} matrix are not held as views"
    rows, cols = shape
    return raw.view(np.uint16).reshape(rows, cols)


def _shifted(blob: TrunkBlob, tensors: Sequence[TensorEntry], shift: int) -> TrunkBlob:
    """`tensors` of `blob` placed in a buffer whose byte 0 is `shift` bytes before the blob (a span's start)."""
    moved = tuple(t._replace(offset=t.offset + shift) for t in tensors)
    return TrunkBlob(0, max(t.offset + t.nbytes for t in moved), 0, moved, blob.mxfp4_rows)


class PieceReader:
    """The pieces of one dense layer (stream/trunk_spans.py) read one after another into one ring buffer, the
    blob's CRC-32 run over them and checked at the last."""

    def __init__(self, source: StreamingSource, layer: int, spans: list[Span], buffer: int) -> None:
        self.source, self.layer, self.spans, self.buffer = source, layer, spans, buffer
        self.blob = source.store.layers[layer]
        self.crc = 0
        self.next_piece = 0

    def read(self, piece: int) -> dict[str, np.ndarray]:
        if piece != self.next_piece:
            raise RuntimeError(f"trunk layer {self.layer}: piece {piece} asked for before piece {self.next_piece}")
        span, blob = self.spans[piece], self.blob
        raw = self.source._read_span(span, self.source._ring[self.buffer], f"trunk layer {self.layer}")
        start = span.start + span.skip - blob.offset
        end = blob.size if piece == len(self.spans) - 1 else self.spans[piece + 1].start + \
            self.spans[piece + 1].skip - blob.offset
        self.crc = zlib.crc32(raw[span.skip:span.skip + end - start], self.crc)
        self.next_piece += 1
        if self.next_piece == len(self.spans) and self.crc != blob.crc32:
            raise StoreCorruptError(f"trunk layer {self.layer} in {self.source.store.trunk_path} at offset "
                                    f"{blob.offset} ({blob.size} bytes) failed its CRC-32 check; the store is "
                                    "corrupt: repack it")
        inside = [t for t in blob.entries if start <= t.offset < end]
        return _shifted(blob, inside, blob.offset - span.start).decode(raw, keep_bf16=True)

    def _waited(self, piece: int) -> dict[str, np.ndarray]:
        started = time.perf_counter()  # the model waits for this read (pieces after the first)
        try:
            return self.read(piece)
        finally:
            self.source.counters.io_wait_seconds += time.perf_counter() - started

    def gate_up(self) -> np.ndarray | QuantizedMatrix:
        arrays = self._waited(1)
        parts = [next(a for n, a in arrays.items() if key in n) for key in (MLP_GATE, MLP_UP)]
        fused = adjacent_quantized_view(parts) if isinstance(parts[0], QuantizedMatrix) else adjacent_view(parts)
        assert fused is not None, "a version-2 store packs gate and up back to back"
        return fused

    def down(self) -> np.ndarray | QuantizedMatrix:
        return next(a for n, a in self._waited(2).items() if MLP_DOWN in n)


class EmbeddingReader:
    """The embedding read on demand: `rows[ids]` reads each token's row, exactly its bytes (one read a token,
    repeats included, so the count is the simulator's; a striped store's reader may split a row over two drives,
    still counted as one), into a fresh [T, H] array: bf16 bits, or float32 decoded from a Q8_0 embedding's rows."""

    def __init__(self, source: StreamingSource, blob_offset: int, entry: TensorEntry) -> None:
        self.source, self.offset, self.dtype = source, blob_offset + entry.offset, entry.dtype
        self.shape = entry.shape
        self.row_bytes = entry.nbytes // entry.shape[0]

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((ids.shape[0], self.row_bytes), np.uint8)  # [T, row bytes]
        reader = self.source._row_io
        assert reader is not None
        for i, token in enumerate(ids.tolist()):
            if not 0 <= token < self.shape[0]:
                raise IndexError(f"token id {token} is outside the vocabulary of {self.shape[0]}")
            extent = Extent(self.offset + token * self.row_bytes, memoryview(out[i]).cast("B"))
            reader.submit([extent])[id(extent)].result()  # short reads retried, then a StoreIOError naming it
        self.source._embed_reads[0] += ids.shape[0] * self.row_bytes
        self.source._embed_reads[1] += ids.shape[0]
        rows = stored_rows(self.dtype, out.reshape(-1), (ids.shape[0], self.shape[1]))  # [T, H]
        return rows.dequantize() if isinstance(rows, QuantizedMatrix) else rows


class HeadChunks:
    """The lm_head streamed through the staging ring: row chunks read and multiplied one after another."""

    def __init__(self, source: StreamingSource, blob_offset: int, entry: TensorEntry) -> None:
        self.source, self.offset, self.dtype = source, blob_offset + entry.offset, entry.dtype
        self.shape = entry.shape
        self.row_bytes = entry.nbytes // entry.shape[0]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x [R, H] -> [R, V]."""
        source = self.source
        out = np.empty((x.shape[0], self.shape[0]), np.float32)  # [R, V]
        buffer = source.head_buffer()
        for first, end, span in head_chunks(self.offset, self.shape[0], self.row_bytes, source.plan.staging_bytes):
            started = time.perf_counter()
            raw = source._read_span(span, buffer, "lm_head")
            source.counters.io_wait_seconds += time.perf_counter() - started
            rows = stored_rows(self.dtype, raw[span.skip:span.skip + (end - first) * self.row_bytes],
                               (end - first, self.shape[1]))
            out[:, first:end] = linear(x, rows)
            del raw, rows
        return out
