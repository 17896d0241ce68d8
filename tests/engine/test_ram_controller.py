"""The RAM controller (engine/ram_controller.py) over synthetic pools: never over budget whatever the value signals,
caps respected, no flapping, every move logged; and the engine's pools (engine/ram_pools.py) resized under a
streaming model give exactly the tokens of a fixed split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.ram_controller import (ControllerConfig, PoolSignal, Prices, RamController, RamPool,
                                           RamPools)
from k3serve.engine.ram_pools import attach_ram_controller, best_gain_per_step
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError

KiB = 1 << 10


class SignalPool(RamPool):
    """A pool whose value signals come from a script; a shrink may stop short (`stuck` units cannot go)."""

    def __init__(self, name: str, unit: int, size: int, low: int, high: int, stuck: int = 0) -> None:
        self.name, self._unit, self._size, self._min, self._max = name, unit, size, low, high
        self.stuck = stuck
        self.signals: list[PoolSignal] = []

    unit_bytes = property(lambda self: self._unit)
    size_bytes = property(lambda self: self._size)
    min_bytes = property(lambda self: self._min)
    max_bytes = property(lambda self: self._max)

    def resize(self, n_bytes: int) -> int:
        target = max(self._min, min(self._max, n_bytes // self._unit * self._unit))
        if target < self._size:
            target = max(target, self._size - max(0, self._size - self._min - self.stuck * self._unit))
        self._size = target
        return self._size

    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        return self.signals.pop(0) if self.signals else PoolSignal()


def _pools(budget: int = 64 * KiB) -> tuple[RamPools, SignalPool, SignalPool, SignalPool]:
    a = SignalPool("a", 4 * KiB, 16 * KiB, 4 * KiB, 48 * KiB)
    b = SignalPool("b", 3 * KiB, 21 * KiB, 0, 60 * KiB, stuck=2)
    c = SignalPool("c", 8 * KiB, 16 * KiB, 8 * KiB, 32 * KiB)
    return RamPools(budget, [a, b, c]), a, b, c


signal = st.builds(PoolSignal, st.floats(0, 10, allow_nan=False), st.floats(0, 10, allow_nan=False),
                   st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 20 * KiB)), max_size=2).map(tuple))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(signal, signal, signal), min_size=1, max_size=40),
       st.integers(53, 80), st.integers(1, 20), st.floats(0, 2), st.integers(0, 3), st.integers(1, 4))
def test_never_over_budget_and_caps_respected_whatever_the_signals(script, budget_kib, step_kib, hysteresis,
                                                                   cooldown, max_steps):
    ledger, a, b, c = _pools(budget_kib * KiB)
    for i, pool in enumerate((a, b, c)):
        pool.signals = [row[i] for row in script]
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=step_kib * KiB,
                                                        hysteresis=hysteresis, cooldown_intervals=cooldown,
                                                        max_steps_per_move=max_steps))
    for _ in script:
        controller.on_step()
        ledger.check_integrity()  # sum <= budget and every pool within [min, max]
        assert ledger.total_bytes <= ledger.budget_bytes
    assert all(m.num_bytes > 0 for m in controller.moves)


def test_budget_below_the_starting_sizes_is_refused():
    with pytest.raises(ConfigError, match="over the budget"):
        _pools(budget=40 * KiB)


def test_moves_from_the_cheapest_to_the_dearest_and_logs_each_move():
    ledger, a, b, c = _pools(budget=53 * KiB)  # no headroom
    metrics = MetricsRegistry()
    controller = RamController(ledger, ControllerConfig(interval_steps=2, step_bytes=8 * KiB, hysteresis=0.5,
                                                        cooldown_intervals=0), metrics)
    a.signals = [PoolSignal(gain_seconds=4.0, loss_seconds=1.0)] * 4
    b.signals = [PoolSignal(gain_seconds=0.1, loss_seconds=0.1)] * 4
    c.signals = [PoolSignal(gain_seconds=0.5, loss_seconds=2.0)] * 4
    assert controller.on_step() is None  # not yet an interval
    move = controller.on_step()
    assert move is not None and (move.donor, move.receiver) == ("b", "a")
    # b gives at least the 8 KiB asked, in its units of 3 KiB (9); a grows 8; 1 KiB is left as headroom
    assert a.size_bytes == 24 * KiB and b.size_bytes == 12 * KiB and ledger.headroom_bytes == 1 * KiB
    assert move.num_bytes == 8 * KiB and ledger.total_bytes <= ledger.budget_bytes
    controller.on_step()
    controller.on_step()
    assert len(controller.moves) == 2
    assert metrics.counter("ram_controller_moves").value == 2
    assert metrics.gauge("ram_pool_bytes_a").value == a.size_bytes
    assert metrics.gauge("ram_pool_bytes_b").value == b.size_bytes
    lines = controller.lines()
    assert len(lines) == 3 and "b -> a" in lines[1]


def test_hysteresis_no_move_when_the_gain_does_not_beat_the_loss_by_the_margin():
    ledger, a, b, c = _pools(budget=53 * KiB)
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=8 * KiB, hysteresis=0.5))
    # a is only 40% dearer than b is cheap: inside the 50% band
    a.signals = [PoolSignal(1.4, 1.4)] * 5
    b.signals = [PoolSignal(1.0, 1.0)] * 5
    c.signals = [PoolSignal(1.2, 1.2)] * 5
    for _ in range(5):
        controller.on_step()
    assert controller.moves == []


def test_alternating_signals_do_not_flap():
    """Two pools whose values swap every interval: without cooldown bytes would go back and forth each time."""
    ledger, a, b, c = _pools(budget=53 * KiB)
    cooldown = 3
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=4 * KiB, hysteresis=0.2,
                                                        cooldown_intervals=cooldown))
    high, low = PoolSignal(5.0, 5.0), PoolSignal(0.5, 0.5)
    a.signals = [high if i % 2 == 0 else low for i in range(24)]
    c.signals = [low if i % 2 == 0 else high for i in range(24)]
    b.signals = [PoolSignal(10.0, 10.0)] * 24  # dear to lose: never the donor
    intervals: dict[str, list[tuple[int, str]]] = {}
    for interval in range(1, 25):
        move = controller.on_step()
        if move is not None:
            intervals.setdefault(move.donor, []).append((interval, "gave"))
            intervals.setdefault(move.receiver, []).append((interval, "received"))
    assert controller.moves, "the first signal should move something"
    for events in intervals.values():
        for (t1, e1), (t2, e2) in zip(events, events[1:]):
            if e1 != e2:  # a direction change only after the cooldown
                assert t2 - t1 > cooldown, events
    assert len(controller.moves) <= 24 // (cooldown + 1) + 1


def test_a_complement_is_priced_and_moved_with_the_receiver():
    """a's gain needs 8 KiB of c beside each 4 KiB step of a (blocks that hit only with a checkpoint): its gain per MiB
    is over 12 KiB, and one move takes both from the donor b."""
    ledger, a, b, c = _pools(budget=53 * KiB)  # no headroom
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=4 * KiB, hysteresis=0.0,
                                                        cooldown_intervals=0, demand_decay=0.0))
    a.signals = [PoolSignal(gain_seconds=4.0, companions=(("c", 8 * KiB), ("a", 4 * KiB)))]  # itself: ignored
    b.signals = [PoolSignal(loss_seconds=0.1)]
    c.signals = [PoolSignal(loss_seconds=5.0)]  # dear to lose: without the companion rule it could not grow
    move = controller.on_step()
    assert (move.donor, move.receiver, move.companions) == ("b", "a", (("c", 8 * KiB),))
    assert controller.last_values["a"].gain_per_mib == pytest.approx(4.0 / (12 / 1024))
    assert (a.size_bytes, b.size_bytes, c.size_bytes) == (20 * KiB, 9 * KiB, 24 * KiB)
    assert ledger.total_bytes <= ledger.budget_bytes and "+ 8.00 KiB c" in move.line()
    ledger.check_integrity()


def test_a_pool_that_just_grew_is_not_given_back_before_its_hits_show():
    """a grows for a gain, then shows neither gain nor loss for a while (a checkpoint hits a round after it is
    saved): its recent demand, decayed per interval, is its loss floor; with demand_decay 0 it is given back at once."""
    def run(decay: float) -> list[tuple[str, str]]:
        ledger, a, b, c = _pools(budget=53 * KiB)
        controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=8 * KiB, hysteresis=0.0,
                                                            cooldown_intervals=0, demand_decay=decay))
        a.signals = [PoolSignal(gain_seconds=4.0)] + [PoolSignal()] * 3
        b.signals = [PoolSignal(loss_seconds=0.1)] + [PoolSignal(loss_seconds=10.0)] * 3
        c.signals = [PoolSignal(loss_seconds=10.0)] + [PoolSignal(gain_seconds=0.5, loss_seconds=10.0)] * 3
        for _ in range(4):
            controller.on_step()
        return [(m.donor, m.receiver) for m in controller.moves]

    assert run(0.5) == [("b", "a")]  # a's floor: 4/8 KiB, halved each interval, stays above c's 0.5/8 KiB
    assert run(0.0)[:2] == [("b", "a"), ("a", "c")]


def test_headroom_is_spent_before_anything_is_taken():
    ledger, a, b, c = _pools(budget=61 * KiB)  # 8 KiB unspent
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=16 * KiB))
    a.signals = [PoolSignal(3.0, 3.0)]
    c.signals = [PoolSignal(0.0, 0.0)]  # free to give (b has nothing to give either, but its unit is 3 KiB)
    b.signals = [PoolSignal(0.0, 9.0)]
    move = controller.on_step()
    # the 8 KiB unspent go first, and the cheapest donor gives only the other 8 KiB of the step
    assert (move.donor, move.receiver, move.num_bytes) == ("c", "a", 16 * KiB)
    assert c.size_bytes == 8 * KiB and ledger.total_bytes == ledger.budget_bytes
    # with every other pool too dear to give, the headroom alone is spent
    ledger, a, b, c = _pools(budget=61 * KiB)
    controller = RamController(ledger, ControllerConfig(interval_steps=1, step_bytes=16 * KiB))
    a.signals = [PoolSignal(3.0, 3.0)]
    b.signals, c.signals = [PoolSignal(0.0, 9.0)], [PoolSignal(0.0, 9.0)]
    move = controller.on_step()
    assert (move.donor, move.receiver, move.num_bytes) == ("", "a", 8 * KiB)
    assert ledger.total_bytes == ledger.budget_bytes


def test_best_gain_per_step_sees_a_cliff_a_few_steps_away():
    hits = [(40, 1.0)] * 10  # every shadow hit needs 40 more units
    assert best_gain_per_step(hits, 8) == pytest.approx(10 / 8)  # reached at 8 steps: 10 hits / 8 steps
    assert best_gain_per_step([], 8) == 0.0
    assert best_gain_per_step([(1, 2.0), (200, 5.0)], 4) == 2.0


def test_controller_config_is_validated():
    with pytest.raises(ConfigError):
        ControllerConfig(interval_steps=0)
    with pytest.raises(ConfigError):
        ControllerConfig(hysteresis=-1)
    with pytest.raises(ConfigError, match="demand_decay"):
        ControllerConfig(demand_decay=1.0)


# ---- the engine's pools under a streaming model --------------------------------------------------------------
def _workload(rng: np.random.Generator) -> list[list[int]]:
    system = [int(t) for t in rng.integers(3, 256, 40)]
    prompts = [system + [int(t) for t in rng.integers(3, 256, int(n))] for n in rng.integers(2, 9, 6)]
    return prompts + [[int(t) for t in rng.integers(3, 256, 5)] for _ in range(4)]


def _run(engine: LLMEngine, prompts: list[list[int]], controller: RamController | None = None) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        if controller is not None:
            controller.pools.check_integrity()
    return [outputs[i] for i in ids]


def test_greedy_tokens_identical_with_the_controller_moving_ram(tiny_store):
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    prompts = _workload(np.random.default_rng(3))
    config = EngineConfig(max_seqs=4, num_blocks=96, block_size=8, num_state_checkpoints=8)
    fixed_model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="lru")).model
    fixed = LLMEngine(fixed_model, config, stop_ids=())
    attach_ram_controller(fixed, 8 << 20, experts=(4, 32), checkpoints=2, enabled=False)
    expected = _run(fixed, prompts)
    fixed_model.source.close()

    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="lru")).model
    engine = LLMEngine(model, config, stop_ids=())
    controller = attach_ram_controller(engine, 8 << 20, ControllerConfig(interval_steps=2, step_bytes=64 << 10,
                                                                         hysteresis=0.0, cooldown_intervals=0),
                                       experts=(4, 32), checkpoints=2)
    got = _run(engine, prompts, controller)
    model.source.close()
    assert got == expected
    assert controller.moves, "the controller should have moved RAM on this workload"
    assert controller.pools.total_bytes <= controller.pools.budget_bytes
    from k3serve.serve.metrics import render_metrics

    text = render_metrics(engine.metrics)[0].decode()  # what /metrics serves
    assert f"k3serve_ram_controller_moves_total {float(len(controller.moves))}" in text
    experts = controller.pools.pools["experts"].size_bytes
    assert any(line.startswith("k3serve_ram_pool_bytes_experts ") and float(line.split()[1]) == experts
               for line in text.splitlines())


def test_expert_slots_shrink_keeps_hot_experts_and_returns_to_identical_output(tiny_store):
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="lru")).model
    slots = model.experts.slots
    reference = model.greedy([1, 5, 9, 200, 17], 6)
    cache = slots.cache
    resident = {(l, e) for l in range(model.config.num_layers) for e in cache.resident_experts(l)}
    assert slots.resize(10) == 10
    cache.check_integrity()
    kept = {(l, e) for l in range(model.config.num_layers) for e in cache.resident_experts(l)}
    assert len(kept) == min(10, len(resident)) and kept <= resident  # copied down, not all dropped
    assert model.greedy([1, 5, 9, 200, 17], 6) == reference
    assert slots.resize(cache.max_slots) == cache.max_slots
    cache.check_integrity()
    assert model.greedy([1, 5, 9, 200, 17], 6) == reference
    model.source.close()


def test_prefix_checkpoints_and_kv_blocks_resize():
    from k3serve.engine.paged_kv import BlockPool

    pool = BlockPool(6, block_size=2, num_layers=1, width=3)
    used = pool.allocate()
    assert pool.withhold(10) == 5 and pool.num_free_blocks == 0 and pool.num_usable_blocks == 1
    pool.check_integrity({used: 1})
    assert pool.give_back(2) == 2 and pool.num_free_blocks == 2
    pool.check_integrity({used: 1})


@pytest.mark.parametrize("ghosts", [True, False])
def test_a_prompt_that_repeats_evicted_blocks_checkpoints_their_end(tiny_model, drive, ghosts):
    """With the KV pool's block ghosts on (the controller's), a prompt whose shared blocks were evicted saves a
    checkpoint where they end, so the next repeat hits there, a round earlier than without the ghosts."""
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=64, max_seqs=4,
                                                num_state_checkpoints=8))
    prefix_cache = engine.scheduler.prefix_cache
    prefix_cache.track_block_shadow(64 if ghosts else 0)
    system = [1, 17, 200, 45, 3, 99, 128, 7, 250, 64, 31, 5]  # three full blocks
    cached = []
    for i, question in enumerate(([100, 101], [110, 111], [120, 121])):
        request_id = engine.add_request(system + question, SamplingParams(max_tokens=2, ignore_eos=True))
        cached.append(drive(engine)[request_id].num_cached_tokens)
        if i == 0:
            assert engine.scheduler.blocks.evict_all_cached() > 0  # the first one's blocks leave the pool
        engine.check_integrity()
    assert cached == ([0, 0, 12] if ghosts else [0, 0, 0])


def test_a_kv_step_on_a_hybrid_model_brings_the_checkpoints_its_ghost_prefixes_lack(tiny_store):
    """KV blocks and checkpoints are complements: a block ghost hit is priced, and moved, with one checkpoint per
    recent ghost prefix (plus one) beyond those held."""
    from k3serve.engine.ram_pools import KVBlockPool
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="lru")).model
    engine = LLMEngine(model, EngineConfig(max_seqs=4, num_blocks=64, block_size=4, num_state_checkpoints=8),
                       stop_ids=())
    controller = attach_ram_controller(engine, 8 << 20, ControllerConfig(interval_steps=10_000),  # no decision
                                       experts=(8, 32), checkpoints=0)
    kv = controller.pools.pools["kv"]
    assert isinstance(kv, KVBlockPool)
    rng = np.random.default_rng(5)
    systems = [[int(t) for t in rng.integers(3, 256, 12)] for _ in range(2)]  # two prefixes of three blocks
    for system in systems:
        engine.add_request(system + [7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    _run(engine, [])
    kv.take_signal(controller.config.step_bytes, Prices())  # a new interval: nothing before counts
    assert engine.scheduler.blocks.evict_all_cached() > 0
    _run(engine, [system + [9, 10] for system in systems])  # both prefixes looked up again: ghost hits
    signal = kv.take_signal(controller.config.step_bytes, Prices())
    assert signal.gain_seconds > 0
    checkpoint_bytes = engine.scheduler.prefix_cache.checkpoint_bytes
    assert signal.companions == (("checkpoints", (2 + 1 - 0) * checkpoint_bytes),)  # 2 prefixes + 1, none held
    model.source.close()
