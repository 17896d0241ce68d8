"""The full-scale simulator: a model of any size (the full K3: 93 layers x 896 experts x 16 active, 2.78T
parameters) run through k3serve's own streaming code against a machine model, on a discrete-event clock.

What is the engine's code, not a copy:
- the budget split (`k3serve.stream.budget.plan_budget`) over a virtual store with the model's exact blob sizes;
- the expert cache (`k3serve.stream.expert_cache.ExpertCache`: the policies of `stream/cache.py`, slot
  bookkeeping, cold-slot prefetch, honest retention counters);
- I/O coalescing (`k3serve.stream.io.coalesce`) and queue depth (one worker per queue slot);
- the expert file order (`k3serve.weights.layout.layer_order`: natural, frequency, co-activation).
What is replaced: every read costs `t(n, k)` from the machine's disk curve and every matrix product
max(bytes / bandwidth, FLOPs / FLOP rate) from its compute curve. The step loop mirrors `K3Model.forward` and
`StreamingSource` call for call: per layer, take the trunk (pinned, or wait for the read started one streamed
layer earlier, then start the next), attention, the next-layer prefetch hint (k3serve waits for the next
streamed trunk layer there, since the guess needs its router), routing, the expert request in groups of at
most `slots` experts in ascending id order, expert compute. Reads run on the device while the compute thread
advances the clock; a wait on a read is I/O time.

Two engine profiles:
- `k3serve`: the trunk widened to float32 in RAM (bf16 on disk), the `plan_budget` split, a widening pass per
  streamed layer on the trunk worker; `trunk_dtype="bf16"` is the engine's bf16 trunk (StreamOptions.trunk_dtype:
  held as stored, no widening; no read-ahead where the plan drops it); `trunk_dtype="q8_0"` / `"mxfp4"` is a store
  packed with `--trunk-precision` (its trunk matrices 34 / 17 bytes per 32 weights on disk and in RAM, multiplied
  from those bytes) run with a bf16 trunk dtype.
- `c-engine`: kimi-k3-in-c as published: bf16 trunk, a one-layer trunk ring, an LRU expert cache of a given
  size beside a given number of pinned layers, no prefetch, every expert read synchronous.

Figures per generated token: s/token (and tok/s for a batch), bytes and reads per token, retention, I/O wait vs
compute, and a per-layer timeline (mean seconds per step of trunk wait, compute and expert wait per layer).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from k3serve.config import K3Config, full_k3_config
from k3serve.errors import K3Error
from k3serve.sim.device import SimClock, SimCores, SimDevice, SimIOEngine, SimStripedIO, VirtualBuffer
from k3serve.sim.machine import ComputeModel, Machine
from k3serve.sim.routing import DEFAULT_RECALL, RoutingModel, RoutingStream, StepRouting, replay_steps, solve_skew
from k3serve.stream.budget import BudgetError, BudgetPlan, ViewSizes, minimum_budget_bytes, plan_budget
from k3serve.stream.trunk_spans import Span, head_chunks, piece_spans
from k3serve.units import format_size
from k3serve.stream.cache import POLICIES
from k3serve.stream.expert_cache import ExpertCache
from k3serve.stream.io import Extent
from k3serve.model.expert_source import StreamStats
from k3serve.weights.held import held_bytes, quantized_in_trunk, widened_bytes
from k3serve.weights.quantized import STORE_DTYPES, quantized_nbytes
from k3serve.weights import names
from k3serve.weights.layout import LAYOUTS, layer_order
from k3serve.weights.store import (ALIGNMENT, STORE_VERSION, TENSOR_ALIGNMENT, TensorEntry, align_up, expert_parts,
                                   follows_in_group, packed_specs, stripe_chunk_bytes, trunk_stripe_chunk_bytes)

logger = logging.getLogger(__name__)

ENGINES = ("k3serve", "c-engine")
# $ per machine-hour for the cost column: an assumed round figure for renting one box of the C engine's class (a
# many-core EPYC with a fast NVMe drive) by the hour; cost scales linearly, so rescale for another price
DEFAULT_PRICE_PER_HOUR = 1.0
# float32 / bf16: the engine's --trunk-dtype over a bf16 store; q8_0 / mxfp4: a store packed with --trunk-precision
# (its trunk matrices on disk and in RAM as Q8_0 / MXFP4 bytes, 34 / 17 per 32 weights), run with a bf16 trunk dtype
TRUNK_DTYPES = ("float32", "bf16", "q8_0", "mxfp4")


def engine_trunk_dtype(trunk_dtype: str) -> str:
    """The engine's StreamOptions.trunk_dtype a simulated trunk dtype runs with."""
    return "float32" if trunk_dtype == "float32" else "bf16"
ROUTINGS = ("skewed", "flat")


class SimConfigError(K3Error):
    """A simulation was asked for something the model, machine or engine cannot do."""


# ---- the virtual store -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VirtualBlob:
    offset: int
    size: int  # bytes on disk
    float32_bytes: int  # bytes once resident (float32, or bf16 for a bf16 trunk and the C engine)
    attention_bytes: int = 0  # resident bytes of the attention part (the rest is norms and the MLP trunk)
    params: int = 0
    attention_params: int = 0
    tensors: tuple = ()  # (name, stored dtype, shape) of each tensor: what the engine's accounting reads
    entries: tuple[TensorEntry, ...] = ()  # each tensor's place in the blob, as the store's index has it

    @property
    def read_size(self) -> int:
        return align_up(self.size)

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.entries if t.name == name)

    def widened_bytes(self, trunk_dtype: str = "bf16") -> int:
        return widened_bytes(self.tensors, trunk_dtype)

    def held_bytes(self, trunk_dtype: str = "float32") -> int:
        """The engine's own accounting of what the built weights hold (`k3serve.weights.held.held_bytes`)."""
        return held_bytes(self.tensors, trunk_dtype)


@dataclass(frozen=True)
class VirtualExpertIndex:
    order: tuple[int, ...]
    offsets: tuple[int, ...]
    crc32: tuple[int, ...]


class VirtualStore:
    """Everything `plan_budget` and `ExpertCache` read of a `PackedStore`, without the files."""

    def __init__(self, config: K3Config, orders: dict[int, Sequence[int]] | None = None,
                 trunk_dtype: str = "float32", layout: str = "natural") -> None:
        if trunk_dtype not in TRUNK_DTYPES:
            raise SimConfigError(f"trunk dtype must be one of {', '.join(TRUNK_DTYPES)}, got {trunk_dtype!r}")
        self.config = config
        self.layout = layout
        self.trunk_path = Path("<virtual trunk.bin>")
        self.expert_path = Path("<virtual experts.bin>")
        self.stripe_chunk_bytes = self.trunk_stripe_chunk_bytes = 0  # `pack --stripe`'s, by `--drives` (SimRun)
        self.expert_blob_size = sum(p.nbytes for p in expert_parts(config))
        self.expert_stride = align_up(self.expert_blob_size)
        wide = 4 if trunk_dtype == "float32" else 2
        quantized = STORE_DTYPES.get(trunk_dtype)
        self.adjacent_groups = True  # laid out as `k3serve pack` writes format 2 and later
        self.mxfp4_rows = True  # format 3: an MXFP4 trunk entry by rows (held as views)

        def stored(spec) -> tuple[str, int, int]:
            """(dtype, bytes on disk, bytes resident) of one tensor, as `pack --trunk-precision` writes it."""
            params = int(np.prod(spec.shape))
            if quantized and spec.dtype == "BF16" and quantized_in_trunk(spec.name, spec.shape):
                nbytes = quantized_nbytes(trunk_dtype, *spec.shape)
                return quantized, nbytes, nbytes
            return spec.dtype, params * (2 if spec.dtype == "BF16" else 4), params * (wide if spec.dtype == "BF16"
                                                                                      else 4)

        def blob(specs, offset: int) -> VirtualBlob:
            specs = packed_specs(specs, STORE_VERSION)
            kept = [stored(s) for s in specs]  # [(dtype, disk, resident)]
            entries, cursor, previous = [], 0, None
            for spec, (dtype, nbytes, _) in zip(specs, kept):  # as pack.py's _trunk_blob places them
                start = cursor if follows_in_group(previous, spec.name) else align_up(cursor, TENSOR_ALIGNMENT)
                entries.append(TensorEntry(spec.name, dtype, tuple(spec.shape), start, nbytes))
                cursor, previous = start + nbytes, spec.name
            attention = [i for i, s in enumerate(specs) if ".self_attn." in s.name]
            return VirtualBlob(offset, cursor, sum(k[2] for k in kept),
                               sum(kept[i][2] for i in attention), sum(int(np.prod(s.shape)) for s in specs),
                               sum(int(np.prod(specs[i].shape)) for i in attention),
                               tuple((s.name, k[0], tuple(s.shape)) for s, k in zip(specs, kept)), tuple(entries))

        self.globals = blob(names.global_specs(config), 0)
        offset = self.globals.read_size
        self.layers = []
        for layer in range(config.num_layers):
            b = blob(names.layer_trunk_specs(config, layer), offset)
            self.layers.append(b)
            offset += b.read_size
        self.experts: dict[int, VirtualExpertIndex] = {}
        position = 0
        ne = config.num_experts
        zeros = (0,) * ne
        for layer in config.moe_layer_ids:
            order = list(orders[layer]) if orders and layer in orders else list(range(ne))
            offsets = [0] * ne
            for rank, expert in enumerate(order):
                offsets[expert] = (position + rank) * self.expert_stride
            position += ne
            self.experts[layer] = VirtualExpertIndex(tuple(order), tuple(offsets), zeros)

    @classmethod
    def from_store(cls, store, trunk_dtype: str = "float32") -> VirtualStore:
        """The exact offsets and sizes of a real packed store (for checks against the live engine)."""
        self = cls.__new__(cls)
        self.config = store.config
        self.layout = store.layout
        self.trunk_path, self.expert_path = store.trunk_path, store.expert_path
        self.adjacent_groups = store.adjacent_groups
        self.mxfp4_rows = store.mxfp4_rows
        self.expert_blob_size, self.expert_stride = store.expert_blob_size, store.expert_stride

        def blob(b) -> VirtualBlob:
            resident = b.float32_bytes if trunk_dtype == "float32" else b.size
            width = 4 if trunk_dtype == "float32" else 2
            attention = [t for t in b.tensors if ".self_attn." in t.name]
            attention_bytes = sum(t.nbytes if t.dtype in STORE_DTYPES.values() else int(np.prod(t.shape)) * width
                                  for t in attention)
            params = sum(int(np.prod(t.shape)) for t in b.tensors)
            return VirtualBlob(b.offset, b.size, resident, attention_bytes, params,
                               sum(int(np.prod(t.shape)) for t in attention),
                               tuple((t.name, t.dtype, tuple(t.shape)) for t in b.tensors), tuple(b.tensors))

        self.globals = blob(store.globals)
        self.layers = [blob(b) for b in store.layers]
        self.experts = {l: VirtualExpertIndex(e.order, e.offsets, (0,) * len(e.offsets))
                        for l, e in store.experts.items()}
        self.stripe_chunk_bytes = store.stripe_chunk_bytes  # a striped store's own chunks (0: not striped)
        self.trunk_stripe_chunk_bytes = store.trunk_stripe_chunk_bytes
        return self

    @property
    def num_experts_total(self) -> int:
        return len(self.experts) * self.config.num_experts

    @property
    def trunk_bytes(self) -> int:
        return sum(b.size for b in self.layers)


# ---- configuration and result ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimConfig:
    machine: Machine
    ram_bytes: int | None = 8 << 30  # None: unlimited
    model: K3Config | None = None  # None: the full K3
    engine: str = "k3serve"
    policy: str = "lfu"
    prefetch: str = "none"  # the engine's default (StreamOptions.prefetch)
    prefetch_max: int | None = None
    layout: str = "natural"
    pin_trunk_bytes: int | None = None
    queue_depth: int = 16
    trunk_dtype: str = "bf16"  # the engine's default (StreamOptions.trunk_dtype)
    batch: int = 1
    speculative: int = 0  # draft tokens per step per sequence (0: off); the cap when speculative_io_aware
    speculative_io_aware: bool = False  # choose k as --speculative-io-aware does (drive_run)
    acceptance: float = 0.7  # per draft token, when speculating
    tokens: int = 4  # decode steps measured
    warmup: int = 1  # decode steps run before measuring (the cache fills)
    prompt_tokens: int = 0  # a prefill step of this many positions per sequence first (0: none)
    count_prefill: bool = False  # include the prefill step (and weight loading) in the per-token figures
    routing: str = "skewed"
    routing_model: RoutingModel | None = None  # overrides `routing`
    replay: tuple[StepRouting, ...] | None = None  # steps of a recorded trace, replayed in order
    seed: int = 0
    store: VirtualStore | None = None  # a given store (e.g. a real store's exact layout)
    pinned_layers: int | None = None  # c-engine: layers pinned (largest first, as the budget splitter pins)
    cache_bytes: int | None = None  # c-engine: the expert cache size
    trunk_read_bytes_per_s: float | None = None  # the trunk stream's delivered rate where a run recorded it
    experts_kept: tuple[float, ...] = ()  # --expert-top-p: P(n experts kept), n = 1..TOPK (sim/routing.py)
    prefill_chunk: int | None = None  # prompt positions per prefill step and sequence (None: the whole prompt)
    price_per_hour: float = DEFAULT_PRICE_PER_HOUR  # $ per machine-hour, for the cost column
    drives: int = 1  # the store striped over this many drives of the machine's disk (`pack --stripe`)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SimConfigError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.policy not in POLICIES:
            raise SimConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.prefetch not in ("none", "next-layer"):
            raise SimConfigError(f"unknown prefetch {self.prefetch!r}; choose none or next-layer")
        if self.layout not in LAYOUTS:
            raise SimConfigError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.routing not in ROUTINGS:
            raise SimConfigError(f"unknown routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}")
        if self.ram_bytes is not None and self.ram_bytes <= 0:
            raise SimConfigError(f"RAM must be positive, got {self.ram_bytes}")
        for key, low in (("batch", 1), ("tokens", 1), ("queue_depth", 1), ("warmup", 0), ("speculative", 0),
                         ("prompt_tokens", 0), ("drives", 1)):
            if getattr(self, key) < low:
                raise SimConfigError(f"{key} must be >= {low}, got {getattr(self, key)}")
        if self.trunk_read_bytes_per_s is not None and not self.trunk_read_bytes_per_s > 0:
            raise SimConfigError(f"trunk read rate must be positive, got {self.trunk_read_bytes_per_s}")
        if self.speculative_io_aware and self.speculative < 1:
            raise SimConfigError("I/O-aware speculation needs a draft cap: speculative >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise SimConfigError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")
        if not self.price_per_hour >= 0:
            raise SimConfigError(f"price per hour must be >= 0, got {self.price_per_hour}")
        if not 0.0 <= self.acceptance < 1.0:
            raise SimConfigError(f"acceptance must be in [0, 1), got {self.acceptance}")
        if self.engine == "c-engine" and (self.pinned_layers is None or self.cache_bytes is None):
            raise SimConfigError("the c-engine profile needs its published split: --c-pinned and --c-cache "
                                 "(SimConfig.pinned_layers and cache_bytes)")

    @property
    def tokens_per_step(self) -> float:
        return self.tokens_per_window(self.speculative)

    def tokens_per_window(self, k: int) -> float:
        """Generated tokens per sequence per step: 1, or with k drafts accepted at rate a, (1 - a^(k+1)) / (1 - a)."""
        if not k:
            return 1.0
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class LayerTime:
    layer: int
    trunk_wait_s: float = 0.0
    expert_wait_s: float = 0.0
    compute_s: float = 0.0
    expert_reads: float = 0.0


@dataclass
class SimResult:
    config: dict
    plan: dict
    s_per_token: float
    tok_per_s: float
    bytes_per_token: float
    expert_bytes_per_token: float
    trunk_bytes_per_token: float
    reads_per_token: float
    expert_requests_per_token: float
    io_seconds_per_token: float
    compute_seconds_per_token: float
    retention: float
    prefetch_hit_share: float
    prefetch_wasted_per_token: float
    device_busy_share: float
    floor_io_s_per_token: float  # bytes that must move / the device's best bandwidth for these requests
    floor_compute_s_per_token: float
    step_seconds: list[float]
    timeline: list[LayerTime] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    experts_kept_per_token: float = 0.0  # mean experts per (token, MoE layer): TOPK, fewer under top-p
    dollars_per_million_tokens: float = 0.0  # s/token x price per hour / 3600 x 1e6
    prefill: dict = field(default_factory=dict)  # the prompt's steps: tokens, steps, expert bytes, seconds
    speculation: dict = field(default_factory=dict)  # speculative_io_aware: the chosen k and the measured cost

    def to_dict(self) -> dict:
        out = asdict(self)
        out["timeline"] = [asdict(t) for t in self.timeline]
        return out

    def lines(self) -> list[str]:
        p = self.plan
        return [
            f"plan              {p['summary']}",
            f"time/token        {self.s_per_token:.3f} s ({self.tok_per_s:.3f} tok/s); I/O wait "
            f"{self.io_seconds_per_token:.3f} s, compute {self.compute_seconds_per_token:.3f} s",
            f"read/token        {format_size(self.bytes_per_token)} (experts {format_size(self.expert_bytes_per_token)}"
            f", trunk {format_size(self.trunk_bytes_per_token)}), {self.reads_per_token:.1f} reads",
            f"retention         {100 * self.retention:.1f}% resident before their step; prefetch served "
            f"{100 * self.prefetch_hit_share:.1f}%, {self.prefetch_wasted_per_token:.1f} guesses wasted/token",
            f"device            busy {100 * self.device_busy_share:.0f}% of the time"
            + (f" (each of {self.config['drives']} drives, on average)" if self.config.get("drives", 1) > 1 else ""),
            f"floors            I/O {self.floor_io_s_per_token:.3f} s/token (bytes that must move at the best "
            f"bandwidth), compute {self.floor_compute_s_per_token:.3f} s/token",
            f"experts           {self.experts_kept_per_token:.2f} per token and MoE layer",
            f"cost              ${self.dollars_per_million_tokens:,.0f} per million tokens at "
            f"${self.config['price_per_hour']:g}/hour",
        ] + self.prefill_lines() + ([f"speculation       I/O-aware: k = {self.speculation['chosen_k']} (measured "
                                     f"position cost {self.speculation['measured_position_cost']:.3f}), "
                                     f"{self.speculation['tokens_per_step']:.2f} tokens/step"]
                                    if self.speculation else [])

    def prefill_lines(self) -> list[str]:
        p = self.prefill
        if not p:
            return []
        return [f"prefill           {p['tokens']} prompt tokens in {p['steps']} steps of <= {p['chunk']} positions: "
                f"experts {format_size(p['expert_bytes_per_token'])}/token, {p['s_per_token']:.3f} s/token"]

    def timeline_lines(self, every: int = 1) -> list[str]:
        out = [f"{'layer':>5} {'trunk wait':>10} {'expert wait':>11} {'compute':>9} {'reads':>7}  (s per step)"]
        for t in self.timeline[::every]:
            out.append(f"{t.layer:>5} {t.trunk_wait_s:>10.4f} {t.expert_wait_s:>11.4f} {t.compute_s:>9.4f} "
                       f"{t.expert_reads:>7.1f}")
        return out


# ---- the run ---------------------------------------------------------------------------------------------------
def default_routing(config: K3Config, kind: str) -> RoutingModel:
    """flat (uniform popularity, no reuse: the C engine's 0% retention), or skewed as fit from the shipped trained
    model (docs/MODEL.md: top-10% share 17%, reuse 9% at chance 6.25%). Both keep the measured next-layer recall
    of the engine's guess (65%): balancing flattens usage over tokens, not the layer-to-layer predictability."""
    ne, k = config.num_experts, config.num_experts_per_token
    if kind == "flat":
        return RoutingModel(ne, k, recall=DEFAULT_RECALL, name="flat")
    chance = 4 / 64
    return RoutingModel(ne, k, skew=solve_skew(0.17, ne), reuse=(0.09 - chance) / (1 - chance),
                        recall=DEFAULT_RECALL, name="skewed")


class ExpertWork:
    """One process's routed-expert work as `ExpertSlots.request` and the model's per-expert loop do it: a layer's
    distinct experts in ascending id, in groups of at most `slots`; each group's reads (the cache's, on `io`),
    then its compute, on `clock`. The single-box run and every cluster owner use it."""

    def __init__(self, config: K3Config, compute: ComputeModel, clock: SimClock, io: SimIOEngine,
                 cache: ExpertCache, expert_blob_size: int, cores: SimCores | None = None) -> None:
        """`cores`: shared with other processes on the machine (None: this process has its own)."""
        self.config, self.compute, self.clock, self.io = config, compute, clock, io
        self.cache, self.expert_blob_size, self.cores = cache, expert_blob_size, cores

    def serve(self, layer: int, rows_of: dict[int, int], note: Callable[..., None]) -> None:
        """rows_of: expert id -> rows (tokens) routed to it. `note(layer, expert_wait=, reads=, compute=)` takes
        each group's I/O wait, reads and compute seconds."""
        c = self.config
        ids = sorted(rows_of)
        self.cache.release()
        slots = self.cache.num_slots
        for start in range(0, len(ids), slots):
            group = ids[start:start + slots]
            before_wait, before_reads = self.clock.io_wait, self.io.counters.num_reads
            self.cache.load(layer, group)
            note(layer, expert_wait=self.clock.io_wait - before_wait, reads=self.io.counters.num_reads - before_reads)
            flops = sum(2 * 3 * c.moe_intermediate_size * c.latent_size * rows_of[e] for e in group)
            seconds = self.compute.expert_seconds(len(group) * self.expert_blob_size, flops)
            if self.cores is None:
                self.clock.advance(seconds)
            else:
                self.cores.run(self.clock, seconds)
            note(layer, compute=seconds)


class SimRun:
    """One simulated process: its store, plan, clock, device, trunk stream and expert cache, stepping as
    `K3Model.forward` over `StreamingSource` does (the cluster mode's front overrides `routed_experts`)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        config = cfg.model or (cfg.store.config if cfg.store is not None else full_k3_config())
        self.config = config
        self.routing = cfg.routing_model or default_routing(config, cfg.routing)
        if cfg.experts_kept:
            self.routing = replace(self.routing, kept=tuple(cfg.experts_kept))
        if self.routing.num_experts != config.num_experts or self.routing.top_k != config.num_experts_per_token:
            raise SimConfigError(f"routing model is {self.routing.num_experts} experts top-{self.routing.top_k}, "
                                 f"the model {config.num_experts} top-{config.num_experts_per_token}")
        self.stream = RoutingStream(self.routing, config.moe_layer_ids, cfg.seed)
        self._replay = list(cfg.replay) if cfg.replay is not None else None
        self.store = cfg.store or self._build_store()
        self.machine = cfg.machine
        self.clock = SimClock()
        self.devices = [SimDevice(cfg.machine.disk) for _ in range(cfg.drives)]
        self.device = self.devices[0]
        self.stats = StreamStats()
        self.plan = self._plan()
        qd = cfg.queue_depth
        if cfg.drives == 1:
            self.expert_io = SimIOEngine("experts", self.clock, self.device, qd)
            self.trunk_io = SimIOEngine("trunk", self.clock, self.device, qd, rate=cfg.trunk_read_bytes_per_s)
        else:  # as `pack --stripe`: both files over every drive, a queue per drive and file
            largest = max(b.read_size for b in self.store.layers)
            expert_chunk = self.store.stripe_chunk_bytes or stripe_chunk_bytes(self.store.expert_stride, cfg.drives)
            trunk_chunk = self.store.trunk_stripe_chunk_bytes or trunk_stripe_chunk_bytes(largest, cfg.drives)
            self.expert_io = SimStripedIO("experts", self.clock, self.devices, qd, expert_chunk)
            self.trunk_io = SimStripedIO("trunk", self.clock, self.devices, qd, trunk_chunk,
                                         rate=cfg.trunk_read_bytes_per_s)
        # as StreamingSource: no next-layer prefetch when the plan has no room for a second streamed layer
        prefetch = cfg.engine == "k3serve" and cfg.prefetch != "none" and self.plan.trunk_read_ahead
        profile = self._profile() if cfg.policy == "pinned" else None
        self.cache = ExpertCache(self.store, self.expert_io, self.plan.expert_slots,
                                 cfg.policy if cfg.engine == "k3serve" else "lru", self.stats,
                                 slot_buffer=lambda _i: VirtualBuffer(self.store.expert_stride),
                                 top_k=config.num_experts_per_token, prefetch=prefetch,
                                 prefetch_max=cfg.prefetch_max, profile=profile)
        self.prefetch_on = prefetch and self.cache.prefetch_max > 0
        self.experts = ExpertWork(config, cfg.machine.compute, self.clock, self.expert_io, self.cache,
                                  self.store.expert_blob_size)
        self.pinned = set(self.plan.pinned_layers)
        self.streamed = list(self.plan.streamed_layers)
        self.pending: tuple[int, float] | None = None  # (layer, time its weights are ready)
        # the trunk held as views (StreamingSource with a bf16 trunk on a format-2 store): pieces, lm_head chunks,
        # embedding rows on demand (stream/trunk_spans.py)
        self.views = cfg.engine == "k3serve" and self.plan.trunk_views
        self.sizes = ViewSizes(self.store) if self.views else None
        self.timeline = [LayerTime(l) for l in range(config.num_layers)]
        self.measuring = False
        self.prefill: dict = {}
        self.chosen_draft_length: int | None = None  # speculative_io_aware: the k chosen
        self.measured_position_cost: float | None = None

    # -- setup
    def _build_store(self) -> VirtualStore:
        cfg, config = self.cfg, self.config
        dtype = "bf16" if cfg.engine == "c-engine" else cfg.trunk_dtype
        orders = None
        if cfg.layout != "natural":
            sample = RoutingStream(self.routing, config.moe_layer_ids, cfg.seed + 7919)
            token_sets: dict[int, list] = {l: [] for l in config.moe_layer_ids}
            for _ in range(64):
                step = sample.step(list(range(4)))
                for l, rows in step.experts.items():
                    token_sets[l].extend([e for e in row if e >= 0] for row in rows.tolist())
            orders = {l: layer_order(cfg.layout, config.num_experts, token_sets[l]) for l in config.moe_layer_ids}
        return VirtualStore(config, orders, dtype, cfg.layout)

    def _profile(self) -> Counter:
        sample = RoutingStream(self.routing, self.config.moe_layer_ids, self.cfg.seed + 104729)
        counts: Counter = Counter()
        for _ in range(64):
            for l, rows in sample.step([0]).experts.items():
                counts.update((l, int(e)) for e in rows.ravel() if e >= 0)
        return counts

    def _plan(self) -> BudgetPlan:
        cfg, store = self.cfg, self.store
        if cfg.engine == "c-engine":
            layers = range(self.config.num_layers)
            by_size = sorted(layers, key=lambda l: (-store.layers[l].float32_bytes, l))
            pinned = sorted(by_size[:cfg.pinned_layers])
            streamed = [l for l in layers if l not in pinned]
            ring = max((store.layers[l].read_size for l in streamed), default=0)
            slots = min(store.num_experts_total, cfg.cache_bytes // store.expert_stride)
            if slots < self.config.num_experts_per_token:
                raise BudgetError(f"cache of {format_size(cfg.cache_bytes)} holds {slots} experts, fewer than one "
                                  f"token's {self.config.num_experts_per_token}")
            return BudgetPlan(None if cfg.ram_bytes is None else cfg.ram_bytes, store.globals.size,
                              tuple(pinned), sum(store.layers[l].float32_bytes for l in pinned), tuple(streamed),
                              ring, int(slots), store.expert_stride)
        try:
            return plan_budget(store, cfg.ram_bytes, cfg.pin_trunk_bytes,
                               trunk_dtype=engine_trunk_dtype(cfg.trunk_dtype))
        except BudgetError as exc:
            message = str(exc).replace("--ram-budget", "--ram")
            hint = ""
            if cfg.trunk_dtype == "float32":  # the other floor: the trunk held as its stored bf16
                floor = minimum_budget_bytes(store, trunk_dtype="bf16")
                hint = (f"; --trunk-dtype bf16 runs from {format_size(floor)} ({floor} bytes)"
                        + (", still above this --ram" if cfg.ram_bytes is not None and cfg.ram_bytes < floor else ""))
            raise BudgetError(f"{message} (simulated {self.config.num_layers}-layer model, trunk held as "
                              f"{cfg.trunk_dtype}){hint}; the floors are in docs/SIMULATOR.md") from exc

    # -- trunk, as StreamingSource.layer / _take_trunk / _peek_trunk do it
    def _spans(self, layer: int) -> list[Span]:
        blob = self.store.layers[layer]
        return piece_spans(blob.offset, blob.entries, blob.size)

    def _read_span(self, span: Span) -> float:
        extent = Extent(span.start, VirtualBuffer(span.length))
        return self.trunk_io.submit([extent])[id(extent)].end

    def _trunk_read(self, layer: int) -> float:
        blob = self.store.layers[layer]
        if self.views:
            return self._read_span(self._spans(layer)[0])
        extent = Extent(blob.offset, VirtualBuffer(blob.read_size))
        future = self.trunk_io.submit([extent])[id(extent)]
        widen = 0.0
        if self._wide():
            widen = blob.float32_bytes / self.machine.compute.widen_bytes_per_s
        return future.end + widen

    def _next_streamed(self, layer: int) -> int | None:
        if not self.streamed:
            return None
        later = [l for l in self.streamed if l > layer]
        return later[0] if later else self.streamed[0]

    def _take_trunk(self, layer: int) -> None:
        if layer in self.pinned:
            return
        pending, self.pending = self.pending, None
        before = self.clock.now
        if pending is not None and pending[0] == layer:
            self.clock.wait_until(pending[1])
        else:
            if pending is not None:
                self.clock.wait_until(pending[1])  # the engine waits for a read-ahead it then drops
            self.clock.wait_until(self._trunk_read(layer))
        following = self._next_streamed(layer) if self.plan.trunk_read_ahead else None
        if following is not None:
            self.pending = (following, self._trunk_read(following))
        self._note(layer, trunk_wait=self.clock.now - before)

    def _peek_trunk(self, layer: int) -> None:
        if layer in self.pinned:
            return
        before = self.clock.now
        if self.pending is None or self.pending[0] != layer:
            self.pending = (layer, self._trunk_read(layer))
        self.clock.wait_until(self.pending[1])
        self._note(layer - 1, trunk_wait=self.clock.now - before)

    def _note(self, layer: int, trunk_wait: float = 0.0, expert_wait: float = 0.0, compute: float = 0.0,
              reads: float = 0.0) -> None:
        if self.measuring:
            t = self.timeline[layer]
            t.trunk_wait_s += trunk_wait
            t.expert_wait_s += expert_wait
            t.compute_s += compute
            t.expert_reads += reads

    def _compute(self, layer: int, seconds: float) -> None:
        self.clock.advance(seconds)
        self._note(layer, compute=seconds)

    # -- one forward step over `positions` (the sequence of each position)
    def step(self, positions: list[int], routing: StepRouting, logit_rows: int) -> None:
        c, m = self.config, self.machine.compute
        T = len(positions)
        self.stats.steps += 1
        self.stats.tokens += T
        self.cache.begin_step()
        if self.views:  # one embedding row a token, read on demand, exactly its bytes
            row = self.store.globals.tensor(names.EMBED)
            for _ in range(T):
                extent = Extent(self.store.globals.offset + row.offset, VirtualBuffer(row.nbytes // row.shape[0]))
                self.clock.wait_until(self.trunk_io.submit([extent])[id(extent)].end)
        for layer in range(c.num_layers):
            self._take_trunk(layer)
            blob = self.store.layers[layer]
            attn_params = blob.attention_params
            self._compute(layer, m.layer_overhead_s + T * m.attention_s_per_token_layer
                          + m.dense_seconds(blob.attention_bytes, 2 * attn_params * T))
            nxt = layer + 1
            if self.prefetch_on and nxt < c.num_layers and not c.is_dense(nxt):
                self._peek_trunk(nxt)
                self.cache.prefetch(nxt, routing.guesses.get(nxt, []))
            mlp_bytes = blob.float32_bytes - blob.attention_bytes
            mlp_params = blob.params - attn_params
            mlp_seconds = m.dense_seconds(mlp_bytes, 2 * mlp_params * T)
            later = self._spans(layer)[1:] if self.views and layer not in self.pinned else []
            if later:  # a dense layer's gate+up, then down, read into the same buffer as the model reaches them
                for span, share in zip(later, (2 / 3, 1 / 3)):
                    before = self.clock.now
                    self.clock.wait_until(self._read_span(span))
                    self._note(layer, trunk_wait=self.clock.now - before)
                    self._compute(layer, mlp_seconds * share)
            else:
                self._compute(layer, mlp_seconds)
            if c.is_dense(layer):
                continue
            self.routed_experts(layer, routing.experts[layer])
        head = self.store.globals.float32_bytes / 2  # embed and lm_head: the lm_head is half the globals
        head_seconds = m.dense_seconds(head, 2 * (self.store.globals.params / 2) * logit_rows)
        if self.views and not self.plan.head_pinned:  # read in row chunks through the ring, each multiplied
            sizes = self.sizes
            assert sizes is not None
            chunks = head_chunks(sizes.head_span.start + sizes.head_span.skip, sizes.head_rows,
                                 sizes.head_row_bytes, self.plan.staging_bytes)
            for first, end, span in chunks:
                before = self.clock.now
                self.clock.wait_until(self._read_span(span))
                self._note(c.num_layers - 1, trunk_wait=self.clock.now - before)
                self._compute(c.num_layers - 1, head_seconds * (end - first) / sizes.head_rows)
        else:
            self._compute(c.num_layers - 1, head_seconds)

    def routed_experts(self, layer: int, rows: np.ndarray) -> None:
        """rows [T, TOPK]: the layer's routed experts, here (the cluster mode sends them to their owners)."""
        needed, counts = np.unique(rows[rows >= 0], return_counts=True)  # -1: a slot top-p dropped
        self.experts.serve(layer, dict(zip((int(e) for e in needed), (int(n) for n in counts))), self._note)

    def _wide(self) -> bool:
        return self.cfg.engine == "k3serve" and self.cfg.trunk_dtype == "float32"

    def load_weights(self) -> None:
        """Globals and pinned layers, read once before the first step (as StreamingSource.__init__)."""
        if self.views:  # the small globals, the lm_head when pinned (never the embedding)
            sizes = self.sizes
            assert sizes is not None
            spans = [sizes.small_span] + ([sizes.head_span] if self.plan.head_pinned else [])
            extents = [Extent(sp.start, VirtualBuffer(sp.length)) for sp in spans]
        else:
            extents = [Extent(self.store.globals.offset, VirtualBuffer(self.store.globals.read_size))]
        extents += [Extent(self.store.layers[l].offset, VirtualBuffer(self.store.layers[l].read_size))
                    for l in self.plan.pinned_layers]
        for extent in extents:
            future = self.trunk_io.submit([extent])[id(extent)]
            self.clock.wait_until(future.end)

    def next_routing(self, positions: list[int]) -> StepRouting:
        if self._replay is not None:
            if not self._replay:
                raise SimConfigError("the replayed trace has fewer steps than the simulation asks for")
            return self._replay.pop(0)
        return self.stream.step(positions)

    def choose_draft_length(self) -> int:
        """k as `--speculative-io-aware` picks it (engine/speculative.py's AdaptiveDraftLength, its own code): one
        step of one position and one window of 1 + cap positions per sequence give b1 and m from the bytes read;
        best_k weighs them against the configured acceptance."""
        from k3serve.engine.speculative import AdaptiveDraftLength, SpeculativeConfig

        cfg = self.cfg
        length = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=cfg.speculative, io_aware=True))
        for k in (0, cfg.speculative):
            positions = [s for s in range(cfg.batch) for _ in range(k + 1)]
            before = self.snapshot()
            self.step(positions, self.next_routing(positions), len(positions))
            after = self.snapshot()
            length.observe_step(k + 1, int(after[3] - before[3] + after[4] - before[4]))
        self.chosen_draft_length = length.best_k(cfg.acceptance)
        self.measured_position_cost = length.cost
        return self.chosen_draft_length

    def snapshot(self) -> tuple:
        return (self.clock.now, self.clock.io_wait, self.clock.compute, self.expert_io.counters.bytes_read,
                self.trunk_io.counters.bytes_read, self.expert_io.counters.num_reads + self.trunk_io.counters.num_reads,
                self.stats.expert_requests, self.stats.expert_retained, self.stats.expert_prefetch_hits,
                self.stats.prefetch_wasted, sum(d.busy_seconds for d in self.devices) / len(self.devices))


def simulate(cfg: SimConfig) -> SimResult:
    """Run `cfg` and return per-token figures (decode steps after `warmup`, or every step with count_prefill)."""
    run = SimRun(cfg)
    return run_result(run, *drive_run(run))


def drive_run(run: SimRun) -> tuple[list[float], list[float], float]:
    """Load the weights and run the steps; returns the snapshot deltas over what is measured, the measured steps'
    seconds and the tokens they generated."""
    cfg = run.cfg
    spec = cfg.speculative
    decode_positions = [s for s in range(cfg.batch) for _ in range(spec + 1)]
    replaying = cfg.replay is not None
    if cfg.speculative_io_aware and (replaying or cfg.count_prefill):
        raise SimConfigError("I/O-aware speculation is simulated on synthetic routing, decode steps measured")
    end_override: list[float] = []
    if cfg.count_prefill:
        run.measuring = True
    start = run.snapshot()
    run.load_weights()
    if replaying:
        # every step of the trace, in order; measured: all of them (count_prefill) or the decode steps only (one
        # position each), as the run report and the streaming benchmark count them
        totals = [0.0] * len(start)
        step_times = []
        for _ in range(len(cfg.replay)):
            routing = run.next_routing([])
            measured = cfg.count_prefill or routing.num_positions == 1
            run.measuring = measured
            before = run.snapshot()
            run.step([0] * routing.num_positions, routing, 1)
            if measured:
                step_times.append(run.clock.now - before[0])
                totals = [t + b - a for t, a, b in zip(totals, before, run.snapshot())]
        if cfg.count_prefill:
            totals = [b - a for a, b in zip(start, run.snapshot())]  # the weight loading too
        start, end_override = [0.0] * len(start), totals
        tokens = float(len(step_times))
    else:
        if cfg.prompt_tokens:
            before = run.snapshot()
            chunk = cfg.prefill_chunk or cfg.prompt_tokens
            steps = 0
            for begin in range(0, cfg.prompt_tokens, chunk):
                positions = [s for s in range(cfg.batch) for _ in range(min(chunk, cfg.prompt_tokens - begin))]
                run.step(positions, run.next_routing(positions), cfg.batch)
                steps += 1
            after = run.snapshot()
            prompt = cfg.batch * cfg.prompt_tokens
            run.prefill = {"tokens": prompt, "steps": steps, "chunk": chunk, "expert_bytes": after[3] - before[3],
                           "expert_bytes_per_token": (after[3] - before[3]) / prompt,
                           "trunk_bytes": after[4] - before[4], "seconds": after[0] - before[0],
                           "s_per_token": (after[0] - before[0]) / prompt}
        for _ in range(cfg.warmup if not cfg.count_prefill else 0):
            run.step(decode_positions, run.next_routing(decode_positions), len(decode_positions))
        if cfg.speculative_io_aware:
            spec = run.choose_draft_length()
            decode_positions = [s for s in range(cfg.batch) for _ in range(spec + 1)]
        if not cfg.count_prefill:
            run.measuring = True
            start = run.snapshot()
        step_times = []
        for _ in range(cfg.tokens):
            t0 = run.clock.now
            run.step(decode_positions, run.next_routing(decode_positions), len(decode_positions))
            step_times.append(run.clock.now - t0)
        tokens = cfg.batch * cfg.tokens * cfg.tokens_per_window(spec)
        if cfg.count_prefill and cfg.prompt_tokens:
            tokens += cfg.batch  # the prefill step yields each sequence's first token
    end = end_override if replaying else run.snapshot()
    return [b - a for a, b in zip(start, end)], step_times, tokens


def run_result(run: SimRun, d: list[float], step_times: list[float], tokens: float) -> SimResult:
    cfg, c = run.cfg, run.config
    seconds, io_wait, compute, expert_bytes, trunk_bytes, reads, requests, retained, pf_hits, wasted, busy = d[:11]
    per = max(tokens, 1e-9)
    steps_measured = max(len(step_times), 1)
    for t in run.timeline:
        for key in ("trunk_wait_s", "expert_wait_s", "compute_s", "expert_reads"):
            setattr(t, key, getattr(t, key) / steps_measured)
    drives = cfg.drives  # a striped read is a share of 1/drives on each drive, all at once
    best_expert_bw = drives * max(run.machine.disk.bandwidth(run.store.expert_stride // drives, q)
                                  for q in run.machine.disk.queue_depths)
    best_trunk_bw = drives * max(run.machine.disk.bandwidth(max(b.read_size for b in run.store.layers) // drives, q)
                                 for q in run.machine.disk.queue_depths)
    floor_io = expert_bytes / best_expert_bw + trunk_bytes / best_trunk_bw
    plan = run.plan
    summary = (f"{cfg.engine}: {len(plan.pinned_layers)}/{c.num_layers} trunk layers pinned "
               f"({format_size(plan.pinned_trunk_bytes)}), trunk buffers {format_size(plan.trunk_stream_bytes)}, "
               f"{plan.expert_slots} expert slots ({format_size(plan.expert_cache_bytes)}), globals "
               f"{format_size(plan.globals_bytes)}")
    config_record = {k: v for k, v in asdict(cfg).items() if k not in ("machine", "store", "replay", "model",
                                                                        "routing_model")}
    config_record.update(machine=cfg.machine.name, routing_model=asdict(run.routing),
                         model_layers=c.num_layers, model_experts=c.num_experts)
    return SimResult(
        config=config_record,
        plan={"summary": summary, "pinned_layers": len(plan.pinned_layers), "expert_slots": plan.expert_slots,
              "pinned_trunk_bytes": plan.pinned_trunk_bytes, "trunk_stream_bytes": plan.trunk_stream_bytes,
              "expert_cache_bytes": plan.expert_cache_bytes, "globals_bytes": plan.globals_bytes,
              "total_bytes": plan.total_bytes, "trunk_dtype": plan.trunk_dtype,
              "trunk_read_ahead": plan.trunk_read_ahead},
        s_per_token=seconds / per, tok_per_s=per / seconds if seconds > 0 else math.inf,
        bytes_per_token=(expert_bytes + trunk_bytes) / per, expert_bytes_per_token=expert_bytes / per,
        trunk_bytes_per_token=trunk_bytes / per, reads_per_token=reads / per,
        expert_requests_per_token=requests / per,
        io_seconds_per_token=io_wait / per, compute_seconds_per_token=compute / per,
        retention=retained / requests if requests else float("nan"),
        prefetch_hit_share=pf_hits / requests if requests else 0.0,
        prefetch_wasted_per_token=wasted / per,
        device_busy_share=min(busy / seconds, 1.0) if seconds > 0 else 0.0,
        floor_io_s_per_token=floor_io / per, floor_compute_s_per_token=compute / per,
        step_seconds=step_times, timeline=run.timeline,
        experts_kept_per_token=run.routing.mean_kept if cfg.replay is None else float("nan"),
        dollars_per_million_tokens=seconds / per * cfg.price_per_hour / 3600 * 1e6, prefill=run.prefill,
        speculation={} if run.chosen_draft_length is None else {
            "chosen_k": run.chosen_draft_length, "measured_position_cost": run.measured_position_cost,
            "tokens_per_step": cfg.tokens_per_window(run.chosen_draft_length)},
        totals={"expert_bytes": run.expert_io.counters.bytes_read, "trunk_bytes": run.trunk_io.counters.bytes_read,
                "num_reads": run.expert_io.counters.num_reads + run.trunk_io.counters.num_reads,
                "expert_requests": run.stats.expert_requests, "tokens": tokens, "seconds": seconds},
    )


def replay_config(trace, machine: Machine, recall: float | None = None, seed: int = 0,
                  guesses: dict | None = None, **kwargs) -> SimConfig:
    """A SimConfig that replays a recorded k3serve trace step by step (prefill steps run; measured only with
    count_prefill); `guesses`: the prefetch guesses the engine issued, {(step, layer): ranked experts}."""
    return SimConfig(machine=machine, replay=tuple(replay_steps(trace, recall, seed, guesses)), seed=seed, **kwargs)


def minimum_ram(config: K3Config | None = None, trunk_dtype: str = "float32") -> int:
    """The smallest --ram k3serve's budget splitter accepts for the model (one layer and top-k slots)."""
    store = VirtualStore(config or full_k3_config(), trunk_dtype=trunk_dtype)
    return minimum_budget_bytes(store, trunk_dtype=engine_trunk_dtype(trunk_dtype))


__all__ = ["SimConfig", "SimResult", "LayerTime", "VirtualStore", "simulate", "replay_config", "minimum_ram",
           "default_routing", "ALIGNMENT"]
