"""Streaming for the families (Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE, Qwen3-Next): the routed experts are
read from a family store (`k3serve.weights.family_store`) through the same expert slots, cache policies, I/O
engines and next-layer prefetch as K3's streaming source, under a RAM budget; the trunk (attention, recurrent
mixers, routers, shared experts, dense layers, embeddings) stays resident.

`StreamingExperts` stands where the resident `ExpertStore` stands in a `FamilyModel` (both are an `ExpertSource`,
model/expert_source.py), so the model's code does not change: its MoE blocks ask for a
layer's experts at once, hits are used in place and misses are read in one offset-ordered, coalesced batch. A slot
is viewed as the very expert the resident loader builds at the store's precision (bf16, float32, int8 or MXFP4;
`k3serve.model.families.expert_blobs`), so streamed greedy tokens equal resident ones.

Budget: the whole trunk is charged (as float32, what the model holds) and the rest goes to expert slots
(`plan_resident_trunk`); the trunk is not streamed layer by layer as K3's is. Not offered for the families:
`--pin-trunk` (the trunk is always pinned), `--cache pinned` and `--trace-out` (routing traces are K3's format).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Sequence

import numpy as np

from k3serve.errors import UsageError
from k3serve.model.families.expert_blobs import BlobPart, view_expert
from k3serve.model.families.experts import Expert, outputs_one_by_one
from k3serve.model.expert_source import ExpertSource, SourceStats, StreamStats, guess_priority
from k3serve.model.routing import ExpertPairs, Routing
from k3serve.stream.budget import BudgetPlan, plan_resident_trunk
from k3serve.stream.io import IOEngine
from k3serve.stream.options import StreamOptions
from k3serve.stream.slots import ExpertSlots
from k3serve.weights.family_store import FamilyStore
from k3serve.weights.safetensors_io import SafetensorsIndex

logger = logging.getLogger(__name__)


def trunk_float32_bytes(trunk: Path) -> tuple[int, dict[int, int]]:
    """(globals, {layer: bytes}) of the trunk once widened to float32, from the trunk file's header."""
    globals_bytes, layers = 0, {}
    with SafetensorsIndex.open(trunk) as index:
        for name in index:
            nbytes = int(np.prod(index.info(name).shape)) * 4
            if name.startswith("model.layers."):
                layer = int(name.split(".")[2])
                layers[layer] = layers.get(layer, 0) + nbytes
            else:
                globals_bytes += nbytes
    return globals_bytes, layers


class StreamingExperts(ExpertSource):
    """A family model's routed experts, streamed from `store` under `options` (see the module docstring)."""

    plan: BudgetPlan

    def __init__(self, store: FamilyStore, options: StreamOptions, num_layers: int) -> None:
        for flag, used in (("--pin-trunk", options.pin_trunk_bytes is not None),
                           ("--cache pinned", options.cache == "pinned"),
                           ("--trace-out", options.trace_out is not None)):
            if used:
                raise UsageError(f"{store.path} is a {store.model_type} store: {flag} applies to K3 stores only "
                                 "(a family store keeps its trunk resident and streams its experts)")
        self.store = store
        self.options = options
        self.precision = store.precision
        globals_bytes, layers = trunk_float32_bytes(store.trunk_path)
        self.plan = plan_resident_trunk(options.ram_budget, globals_bytes,
                                        [layers.get(l, 0) for l in range(num_layers)], store.expert_stride,
                                        store.num_experts_total, store.top_k)
        self.counters = StreamStats()
        self.expert_io = IOEngine(store.expert_path, options.io, options.queue_depth)
        parts = [BlobPart.from_json(p) for p in store.parts_json]
        kind = store.kind
        self.slots: ExpertSlots[Expert] = ExpertSlots(
            store, self.expert_io, self.plan.expert_slots, options.cache, self.counters,
            lambda blob: view_expert(kind, parts, blob), top_k=store.top_k, prefetch=options.prefetch != "none",
            prefetch_max=options.prefetch_max)
        self._prefetching = options.prefetch != "none" and self.slots.cache.prefetch_max > 0
        logger.info("streaming experts: %s", self.plan.lines()[0])

    # ---- what the MoE blocks ask -------------------------------------------------------------------------------
    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]:
        """The experts of `layer` as views of slots, valid until the next `experts`; read in ascending id order."""
        return self.slots.request(layer, expert_ids)

    def get(self, layer: int, expert: int) -> Expert:
        return self.experts(layer, [expert])[int(expert)]

    def expert_outputs(self, layer: int, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray:
        """As `ExpertStore.expert_outputs`, one expert at a time over the slots (the same bits)."""
        return outputs_one_by_one(self.experts(layer, pairs.expert_ids), pairs, x)

    def begin_step(self, num_tokens: int) -> None:
        self.counters.steps += 1
        self.counters.tokens += num_tokens
        self.slots.cache.begin_step()

    @property
    def prefetching(self) -> bool:
        return self._prefetching

    def prefetch(self, layer: int, guess: Routing) -> None:
        """Read guessed experts of `layer` (`guess_priority` order) into cold slots while the current layer
        computes."""
        self.slots.cache.prefetch(layer, guess_priority(guess))

    # ---- the rest of the `ExpertSource` seam -------------------------------------------------------------------
    def resident_experts(self, layer: int) -> set[int]:
        return self.slots.cache.resident_experts(layer)

    def stats(self, timeout: float | None = None) -> SourceStats:
        return SourceStats(stream=self._stream_stats())

    def local_stats(self) -> StreamStats:
        return self._stream_stats()

    def _stream_stats(self) -> StreamStats:
        s = StreamStats(**{f.name: getattr(self.counters, f.name) for f in fields(self.counters)})
        s.expert_bytes_read = self.expert_io.counters.bytes_read
        s.num_reads = self.expert_io.counters.num_reads
        s.io_busy_seconds = self.expert_io.counters.busy_seconds
        return s

    def describe(self) -> str:
        o = self.options
        return (f"io={o.io} qd={o.queue_depth} cache={o.cache} prefetch={o.prefetch} layout={self.store.layout} "
                f"experts={self.precision} slots={self.slots.num_slots} trunk=resident")

    def check_integrity(self) -> None:
        self.slots.cache.check_integrity()

    def close(self) -> None:
        self.expert_io.close()
