"""The engine's RAM pools as `RamPool`s (engine/ram_controller.py), and `attach_ram_controller`, which puts them
under one budget on a running engine.

| pool        | unit                       | grows / shrinks                          | gain (a step more)              | loss (a step less)                    |
|-------------|----------------------------|------------------------------------------|---------------------------------|---------------------------------------|
| experts     | one slot (the blob stride) | `ExpertSlots.resize` (pages returned)    | ghost hits x blob bytes x read  | hits on the least-hit resident experts |
| checkpoints | one checkpoint slot        | `PrefixCache.resize_checkpoints` (evict) | recomputed positions x compute  | positions restored from the least-hit  |
| kv          | one attention block        | `BlockPool.withhold / give_back`         | preempted and ghost-block positions x compute (on a hybrid model with the checkpoints the ghost prefixes lack as companions) | cached-block reuse it would drop, and a preemption if the peak would not fit |

Seconds come from `Prices`: the measured read wait per byte of the expert store, and the measured compute time per
position (forward seconds less read wait, per batched token). The trunk and the I/O buffers stay where the
budget plan (stream/budget.py) put them: they are charged to the ledger as a fixed pool (`fixed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.ram_controller import ControllerConfig, PoolSignal, Prices, RamController, RamPool, RamPools
from k3serve.errors import ConfigError
from k3serve.stream.slots import ExpertSlots

if TYPE_CHECKING:
    from k3serve.engine.engine import LLMEngine


PREFIX_MEMORY = 4  # intervals a ghost prefix is remembered (it needs a checkpoint until its blocks hit again)
LOOKAHEAD_STEPS = 16  # a pool's gain is its best rate over 1, 2, 4 .. 16 steps more (caches have cliffs)


def best_gain_per_step(hits: list[tuple[int, float]], step_units: int) -> float:
    """`hits`: (depth, value) of shadow hits (a hit at depth d needs d more units). The gain of one step, as the
    best average over growing by 1, 2, 4 .. LOOKAHEAD_STEPS steps: a cache whose next step alone gains nothing
    may gain much from a few (the working set just past it), and moving one step at a time gets there."""
    best = 0.0
    steps = 1
    while steps <= LOOKAHEAD_STEPS:
        reach = steps * step_units
        best = max(best, sum(value for depth, value in hits if depth <= reach) / steps)
        steps *= 2
    return best


class FixedPool(RamPool):
    """Bytes the controller charges but never moves (globals, pinned trunk, trunk I/O buffers, state slots)."""

    def __init__(self, name: str, num_bytes: int) -> None:
        self.name = name
        self._bytes = num_bytes

    unit_bytes = property(lambda self: max(self._bytes, 1))
    size_bytes = property(lambda self: self._bytes)
    min_bytes = property(lambda self: self._bytes)
    max_bytes = property(lambda self: self._bytes)

    def resize(self, n_bytes: int) -> int:
        return self._bytes

    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        return PoolSignal()


class ExpertSlotsPool(RamPool):
    name = "experts"

    def __init__(self, slots: ExpertSlots, min_slots: int | None = None, max_slots: int | None = None,
                 ghost_slots: int | None = None) -> None:
        self.slots = slots
        self.cache = slots.cache
        self.min_slots = self.cache.top_k if min_slots is None else max(min_slots, self.cache.top_k)
        self.max_slots = self.cache.max_slots if max_slots is None else min(max_slots, self.cache.max_slots)
        if self.min_slots > self.max_slots:
            raise ConfigError(f"expert slots: floor {self.min_slots} above cap {self.max_slots}")
        self.cache.track_shadow(self.max_slots if ghost_slots is None else ghost_slots)

    unit_bytes = property(lambda self: self.slots.stride)
    size_bytes = property(lambda self: self.cache.num_slots * self.slots.stride)
    min_bytes = property(lambda self: self.min_slots * self.slots.stride)
    max_bytes = property(lambda self: self.max_slots * self.slots.stride)

    def resize(self, n_bytes: int) -> int:
        slots = max(self.min_slots, min(self.max_slots, n_bytes // self.slots.stride))
        return self.slots.resize(slots) * self.slots.stride

    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        step = max(1, step_bytes // self.slots.stride)
        depths, lost = self.cache.take_shadow(step)
        read = self.cache.store.expert_blob_size * prices.read_seconds_per_byte  # one miss's read
        return PoolSignal(best_gain_per_step([(d, 1) for d in depths], step) * read, lost * read)

    def check_integrity(self) -> None:
        self.cache.check_integrity()


class CheckpointPool(RamPool):
    name = "checkpoints"

    def __init__(self, prefix_cache: PrefixCache, min_checkpoints: int = 0) -> None:
        self.prefix_cache = prefix_cache
        self.min_checkpoints = min_checkpoints
        self.max_checkpoints = prefix_cache.store.num_slots
        prefix_cache.track_shadow(self.max_checkpoints)

    unit_bytes = property(lambda self: max(self.prefix_cache.checkpoint_bytes, 1))
    size_bytes = property(lambda self: self.prefix_cache.checkpoint_limit * self.prefix_cache.checkpoint_bytes)
    min_bytes = property(lambda self: self.min_checkpoints * self.prefix_cache.checkpoint_bytes)
    max_bytes = property(lambda self: self.max_checkpoints * self.prefix_cache.checkpoint_bytes)

    def resize(self, n_bytes: int) -> int:
        count = max(self.min_checkpoints, min(self.max_checkpoints, n_bytes // self.unit_bytes))
        return self.prefix_cache.resize_checkpoints(count) * self.prefix_cache.checkpoint_bytes

    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        step = max(1, step_bytes // self.unit_bytes)
        recurrences, lost = self.prefix_cache.take_shadow(step)
        gained = best_gain_per_step(recurrences, step)
        return PoolSignal(gained * prices.compute_seconds_per_token, lost * prices.compute_seconds_per_token)

    def check_integrity(self) -> None:
        self.prefix_cache.check_integrity()


class KVBlockPool(RamPool):
    """Attention blocks. The engine reports each step's preempted positions and block use (`note_step`)."""

    name = "kv"

    def __init__(self, blocks: BlockPool, block_bytes: int, min_blocks: int,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.blocks = blocks
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.track_block_shadow(blocks.num_blocks)
        self.block_bytes = max(block_bytes, 1)
        self.min_blocks = min(min_blocks, blocks.num_blocks)
        self.preempted_tokens = 0
        self.peak_in_use = 0
        self.peak_running = 0
        self.reused_block_tokens = 0  # positions restored from the prefix cache this interval
        self.recent_prefixes: dict[bytes, int] = {}  # ghost prefixes of the last PREFIX_MEMORY intervals -> last seen
        self._interval = 0

    unit_bytes = property(lambda self: self.block_bytes)
    size_bytes = property(lambda self: self.blocks.num_usable_blocks * self.block_bytes)
    min_bytes = property(lambda self: self.min_blocks * self.block_bytes)
    max_bytes = property(lambda self: self.blocks.num_blocks * self.block_bytes)

    def note_step(self, preempted_tokens: int, reused_block_tokens: int, num_running: int) -> None:
        self.preempted_tokens += preempted_tokens
        self.reused_block_tokens += reused_block_tokens
        in_use = self.blocks.num_usable_blocks - self.blocks.num_free_blocks  # referenced blocks
        if in_use >= self.peak_in_use:
            self.peak_in_use, self.peak_running = in_use, max(num_running, 1)

    def resize(self, n_bytes: int) -> int:
        target = max(self.min_blocks, min(self.blocks.num_blocks, n_bytes // self.block_bytes))
        usable = self.blocks.num_usable_blocks
        if target > usable:
            self.blocks.give_back(target - usable)
        elif target < usable:
            self.blocks.withhold(usable - target)
        return self.size_bytes

    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        k = max(1, step_bytes // self.block_bytes)
        cached = self.blocks.num_cached_blocks
        lost_tokens = self.reused_block_tokens * min(1.0, k / cached) if cached else 0.0
        if self.peak_in_use + k > self.blocks.num_usable_blocks:
            # the peak would not have fit: one sequence of the peak's mean length preempted and computed again
            lost_tokens += self.peak_in_use * self.blocks.block_size / self.peak_running
        shadow, prefixes = self.prefix_cache.take_block_shadow() if self.prefix_cache is not None else ([], set())
        self._interval += 1
        for prefix in prefixes:
            self.recent_prefixes[prefix] = self._interval
        for prefix in [p for p, seen in self.recent_prefixes.items() if self._interval - seen >= PREFIX_MEMORY]:
            del self.recent_prefixes[prefix]
        ghost_gain = best_gain_per_step(shadow, k)
        gained = self.preempted_tokens + ghost_gain
        companions: tuple[tuple[str, int], ...] = ()
        if ghost_gain > 0 and self.prefix_cache.needs_state and self.prefix_cache.store.num_slots:
            # hybrid: the ghost prefixes hit again only with a state checkpoint at each one's end, so a step of
            # blocks is priced, and moved, with the checkpoints the recent ghost prefixes lack (KV blocks and
            # checkpoints are complements): one per prefix, and one more for the one-shot prompt ends that pass
            # through the probation segment meanwhile
            lacking = len(self.recent_prefixes) + 1 - self.prefix_cache.checkpoint_limit
            if lacking > 0:
                companions = (("checkpoints", lacking * self.prefix_cache.checkpoint_bytes),)
        signal = PoolSignal(gained * prices.compute_seconds_per_token, lost_tokens * prices.compute_seconds_per_token,
                            companions)
        self.preempted_tokens = self.reused_block_tokens = 0
        self.peak_in_use = self.peak_running = 0
        return signal

    def check_integrity(self) -> None:
        self.blocks.check_integrity()


class EngineRamSteering:
    """What the engine calls after each step: feeds the KV pool its step, measures the prices, runs the
    controller."""

    def __init__(self, engine: LLMEngine, controller: RamController, kv: KVBlockPool | None) -> None:
        self.engine = engine
        self.controller = controller
        self.kv = kv
        self._source = engine.model.experts if hasattr(engine.model.experts, "local_stats") else None
        self._forward_seconds = 0.0
        self._tokens = 0
        self._wait_before = self._io_wait()
        prefix = engine.scheduler.prefix_cache
        self._hit_tokens = prefix._m_hit_tokens if prefix is not None else None
        self._hits_before = self._hit_tokens.value if self._hit_tokens is not None else 0.0

    def _io_wait(self) -> float:
        return self._source.local_stats().io_wait_seconds if self._source is not None else 0.0

    def after_step(self, preempted: list, seconds: float, num_tokens: int) -> None:
        wait = self._io_wait()
        self._forward_seconds += max(0.0, seconds - (wait - self._wait_before))
        self._wait_before = wait
        self._tokens += num_tokens
        if self.kv is not None:
            hits = self._hit_tokens.value if self._hit_tokens is not None else 0.0
            self.kv.note_step(sum(seq.num_tokens for seq in preempted), int(hits - self._hits_before),
                              len(self.engine.scheduler.running))
            self._hits_before = hits
        if (self.controller._num_steps + 1) % self.controller.config.interval_steps == 0:
            self.controller.set_prices(self.prices())
        self.controller.on_step()

    def prices(self) -> Prices:
        default = Prices()
        read = default.read_seconds_per_byte
        if self._source is not None:
            stats = self._source.local_stats()
            if stats.expert_bytes_read > 0 and stats.io_wait_seconds > 0:
                read = stats.io_wait_seconds / (stats.expert_bytes_read + stats.trunk_bytes_read)
        compute = self._forward_seconds / self._tokens if self._tokens else default.compute_seconds_per_token
        return Prices(read, compute)


def attach_ram_controller(engine: LLMEngine, budget_bytes: int, config: ControllerConfig = ControllerConfig(), *,
                          experts: tuple[int, int] | None = None, checkpoints: int | None = None,
                          kv_blocks: int | None = None, fixed_bytes: int = 0, enabled: bool = True) -> RamController:
    """Put the engine's pools under `budget_bytes`, starting at `experts` = (slots now, cap), `checkpoints` and
    `kv_blocks` (None: their current sizes), with `fixed_bytes` charged for what does not move (trunk, buffers).
    The controller then runs between the engine's steps (`LLMEngine.step`). Controlled with `enabled=False`,
    the pools are only sized (a fixed split, measured the same way)."""
    scheduler = engine.scheduler
    pools: list[RamPool] = [FixedPool("fixed", fixed_bytes)]
    kv_pool: KVBlockPool | None = None
    slots = getattr(engine.model.experts, "slots", None)
    if isinstance(slots, ExpertSlots):
        pool = ExpertSlotsPool(slots, max_slots=None if experts is None else experts[1])
        if experts is not None:
            pool.resize(experts[0] * slots.stride)
        pools.append(pool)
    if scheduler.prefix_cache is not None and scheduler.prefix_cache.store.num_slots:
        pool = CheckpointPool(scheduler.prefix_cache)
        if checkpoints is not None:
            pool.resize(checkpoints * pool.unit_bytes)
        pools.append(pool)
    layout = engine.model.cache_layout
    if layout.attention_layers:
        need = -(-engine.max_context // engine.config.block_size) + scheduler.watermark_blocks
        kv_pool = KVBlockPool(scheduler.blocks, engine.config.block_bytes(layout), need, scheduler.prefix_cache)
        if kv_blocks is not None:
            kv_pool.resize(kv_blocks * kv_pool.unit_bytes)
        pools.append(kv_pool)
    controller = RamController(RamPools(budget_bytes, pools), config, engine.metrics)
    if enabled:
        engine.ram_steering = EngineRamSteering(engine, controller, kv_pool)
    else:  # a fixed split: the engine as it runs without the controller, shadows off
        for pool in pools:
            if isinstance(pool, ExpertSlotsPool):
                pool.cache.track_shadow(0)
            elif isinstance(pool, CheckpointPool):
                pool.prefix_cache.track_shadow(0)
                pool.prefix_cache.track_block_shadow(0)
    return controller
