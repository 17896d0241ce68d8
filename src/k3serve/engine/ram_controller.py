"""One RAM budget, priced: a ledger of the RAM pools and a controller that moves bytes between them.

Every pool that holds bytes in RAM (expert slots, state checkpoints, attention blocks, ...) is a `RamPool`: its
size now, its floor and cap (the explicit flags), a unit (one slot, one block) and `resize(n_bytes)`, which grows
or shrinks it safely at a step boundary and returns the size it reached (a shrink may stop short: a block in use
cannot be taken). `RamPools` is the ledger: the pools, the budget, and the invariant

    sum(pool.size_bytes) <= budget_bytes        (after every move, and at every point inside one)

Each pool also reports, once per interval, what a step of `step_bytes` would have been worth (`PoolSignal`):
    gain_seconds   seconds a pool `step_bytes` larger would have saved in the interval (its ghost/shadow hits:
                   disk bytes not read, at the measured read rate; positions not recomputed, at the measured
                   compute rate; preemptions avoided)
    loss_seconds   seconds a pool `step_bytes` smaller would have cost (hits on its least-used units)
Divided by the step's MiB, these are marginal values in seconds per MiB per interval, comparable across pools.

The controller (`RamController.on_step`, called by the engine thread between steps) moves one step every
`interval_steps` steps from the cheapest pool (least loss per MiB) to the dearest (most gain per MiB), when

    gain(dearest) > (1 + hysteresis) * loss(cheapest) + min_gain_seconds_per_mib

and neither pool moved the other way within `cooldown_intervals` (no flapping). It shrinks the donor first and
grows the receiver by at most what was freed plus the ledger's headroom, so the budget holds at every point.

Complements: a signal may name `companions`, bytes other pools must grow by for its gain to be had (on a hybrid
model cached blocks hit only with a state checkpoint at their end). The gain is then priced per MiB of the step
plus the companions, a companion is never the donor, and one move grows both. A pool's loss is floored by its own
recent gain per MiB, decayed by `demand_decay` per interval: what a pool just grew for (a checkpoint hits only a
round after it is saved) is not given back before its hits can show. Every
move is a `RamMove` in `moves`, counted in `/metrics` (`ram_controller_moves`, `ram_pool_bytes{pool}`) and listed
in the run report (`lines()`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from k3serve.engine.metrics import Gauge, MetricsRegistry
from k3serve.errors import ConfigError
from k3serve.units import format_size

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class PoolSignal:
    """What one step of bytes was worth to a pool over the last interval (see the module docstring)."""

    gain_seconds: float = 0.0
    loss_seconds: float = 0.0
    # bytes other pools must grow by for the gain to be had (complements: on a hybrid model a cached prefix's
    # blocks hit only with a state checkpoint at their end); the gain is priced over the step plus these
    companions: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Prices:
    """Conversion of saved work to seconds, measured by the engine: reading a byte, computing a position."""

    read_seconds_per_byte: float = 1.0 / 1e9  # 1 GB/s until a read is measured
    compute_seconds_per_token: float = 1e-3


class RamPool(ABC):
    """A pool of RAM the controller may resize. Sizes are multiples of `unit_bytes`."""

    name: str = ""

    @property
    @abstractmethod
    def unit_bytes(self) -> int: ...

    @property
    @abstractmethod
    def size_bytes(self) -> int: ...

    @property
    @abstractmethod
    def min_bytes(self) -> int: ...

    @property
    @abstractmethod
    def max_bytes(self) -> int: ...

    @abstractmethod
    def resize(self, n_bytes: int) -> int:
        """Grow or shrink toward `n_bytes` (rounded down to units, clamped to [min, max]); returns the size
        reached. Only between engine steps."""

    @abstractmethod
    def take_signal(self, step_bytes: int, prices: Prices) -> PoolSignal:
        """The value of `step_bytes` more and less over the interval since the last call; starts a new interval."""

    def check_integrity(self) -> None:
        """The pool's own bookkeeping (tests call it after moves)."""


@dataclass(frozen=True)
class RamMove:
    step: int  # engine steps seen when the move was made
    donor: str  # "" when the bytes came from the ledger's headroom
    receiver: str  # "" when a donor freed less than one unit of the receiver: the bytes wait in the headroom
    num_bytes: int
    donor_loss_per_mib: float  # seconds per MiB per interval
    receiver_gain_per_mib: float
    companions: tuple[tuple[str, int], ...] = ()  # (pool, bytes) grown with the receiver, from the same donor

    def line(self) -> str:
        also = "".join(f" + {format_size(n)} {name}" for name, n in self.companions)
        return (f"step {self.step}: {format_size(self.num_bytes)} {self.donor or 'headroom'} -> "
                f"{self.receiver or 'headroom'}{also} "
                f"(gain {self.receiver_gain_per_mib:.4g} s/MiB > loss {self.donor_loss_per_mib:.4g} s/MiB)")


class RamPools:
    """The ledger: the pools under one budget."""

    def __init__(self, budget_bytes: int, pools: list[RamPool]) -> None:
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ConfigError(f"RAM pools need distinct names, got {names}")
        self.budget_bytes = budget_bytes
        self.pools = {p.name: p for p in pools}
        if self.total_bytes > budget_bytes:
            raise ConfigError(f"the RAM pools start at {format_size(self.total_bytes)}, over the budget "
                              f"{format_size(budget_bytes)}: {self.describe()}")

    @property
    def total_bytes(self) -> int:
        return sum(p.size_bytes for p in self.pools.values())

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    def describe(self) -> str:
        return ", ".join(f"{p.name} {format_size(p.size_bytes)}" for p in self.pools.values())

    def check_integrity(self) -> None:
        total = self.total_bytes
        if total > self.budget_bytes:
            raise AssertionError(f"RAM pools hold {total} bytes, over the budget {self.budget_bytes}")
        for pool in self.pools.values():
            if not pool.min_bytes <= pool.size_bytes <= pool.max_bytes:
                raise AssertionError(f"pool {pool.name} at {pool.size_bytes} bytes, outside its caps "
                                     f"[{pool.min_bytes}, {pool.max_bytes}]")
            pool.check_integrity()


@dataclass(frozen=True)
class ControllerConfig:
    interval_steps: int = 8  # engine steps between decisions
    step_bytes: int = 4 * MiB  # bytes moved at most per decision (rounded to each pool's unit)
    hysteresis: float = 0.5  # the receiver's gain must beat the donor's loss by this fraction
    min_gain_seconds_per_mib: float = 0.0  # and by this margin (seconds per MiB per interval)
    cooldown_intervals: int = 3  # a pool that gave may not receive (and one that received may not give) for this long
    max_steps_per_move: int = 1  # a gain k times the bar moves min(k, this) steps at once (1: one step a decision)
    # a pool's loss is at least its recent gain, decayed by this factor per interval (0: off): what a pool just grew
    # for keeps it from being given back before its first hits show (a checkpoint hits a round after it is saved)
    demand_decay: float = 0.5

    def __post_init__(self) -> None:
        for name in ("interval_steps", "step_bytes", "max_steps_per_move"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ControllerConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.cooldown_intervals, bool) or not isinstance(self.cooldown_intervals, int) \
                or self.cooldown_intervals < 0:
            raise ConfigError(f"ControllerConfig.cooldown_intervals must be an integer >= 0, "
                              f"got {self.cooldown_intervals!r}")
        if isinstance(self.demand_decay, bool) or not isinstance(self.demand_decay, (int, float)) \
                or not 0 <= self.demand_decay < 1:
            raise ConfigError(f"ControllerConfig.demand_decay must be a number in [0, 1), got {self.demand_decay!r}")
        for name in ("hysteresis", "min_gain_seconds_per_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"ControllerConfig.{name} must be a number >= 0, got {value!r}")


@dataclass
class _Valuation:
    gain_per_mib: float  # -inf: cannot grow
    loss_per_mib: float  # +inf: cannot shrink
    companions: tuple[tuple[str, int], ...] = ()  # bytes other pools grow by with one step of this one


class RamController:
    """Moves RAM between the ledger's pools at step boundaries (see the module docstring)."""

    def __init__(self, pools: RamPools, config: ControllerConfig = ControllerConfig(),
                 metrics: MetricsRegistry | None = None) -> None:
        self.pools = pools
        self.config = config
        self.prices = Prices()
        self.moves: list[RamMove] = []
        self.last_values: dict[str, _Valuation] = {}
        self._num_steps = 0
        self._interval = 0
        self._gave_at: dict[str, int] = {}  # pool -> interval it last gave
        self._received_at: dict[str, int] = {}
        self._demand: dict[str, float] = {}  # pool -> its recent gain per MiB, decayed (the loss floor)
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self._m_moves = self.metrics.counter("ram_controller_moves", "moves of RAM between pools")
        self._m_moved = self.metrics.counter("ram_controller_moved_bytes", "bytes moved between pools")
        self._m_budget = self.metrics.gauge("ram_budget_bytes", "the RAM budget the pools share")
        self._m_budget.set(pools.budget_bytes)
        self._m_sizes = {name: self.metrics.gauge(f"ram_pool_bytes_{name}", f"bytes held by the {name} pool")
                         for name in pools.pools}
        self._update_gauges()

    def _update_gauges(self) -> None:
        for name, gauge in self._m_sizes.items():
            gauge.set(self.pools.pools[name].size_bytes)

    def set_prices(self, prices: Prices) -> None:
        self.prices = prices

    def on_step(self) -> RamMove | None:
        """Call once per engine step, between steps; decides every `interval_steps` steps."""
        self._num_steps += 1
        if self._num_steps % self.config.interval_steps:
            return None
        return self.decide()

    def _value(self, pool: RamPool) -> _Valuation:
        unit = pool.unit_bytes
        step = max(unit, self.config.step_bytes // unit * unit)
        signal = pool.take_signal(step, self.prices)
        companions = tuple((name, n) for name, n in signal.companions if name in self.pools.pools and name != pool.name and n > 0)
        mib = (step + sum(n for _, n in companions)) / MiB
        can_grow = pool.size_bytes + unit <= pool.max_bytes
        can_shrink = pool.size_bytes - unit >= pool.min_bytes
        gain = signal.gain_seconds / mib
        demand = max(gain, self._demand.get(pool.name, 0.0) * self.config.demand_decay)
        self._demand[pool.name] = demand
        loss = max(signal.loss_seconds / (step / MiB), demand)
        return _Valuation(gain if can_grow else float("-inf"), loss if can_shrink else float("inf"), companions)

    def decide(self) -> RamMove | None:
        """One decision: value every pool, and move one step from the cheapest to the dearest when it pays."""
        self._interval += 1
        values = {name: self._value(pool) for name, pool in self.pools.pools.items()}
        self.last_values = values
        cooldown = self.config.cooldown_intervals
        receivers = [n for n, v in values.items() if v.gain_per_mib > float("-inf")
                     and self._interval - self._gave_at.get(n, -cooldown - 1) > cooldown]
        if not receivers:
            return None
        receiver = max(receivers, key=lambda n: (values[n].gain_per_mib, n))
        gain = values[receiver].gain_per_mib
        if gain <= self.config.min_gain_seconds_per_mib:
            return None
        pool = self.pools.pools[receiver]
        step = max(pool.unit_bytes, self.config.step_bytes // pool.unit_bytes * pool.unit_bytes)
        companions = values[receiver].companions
        headroom = self.pools.headroom_bytes
        # unspent budget goes first, at no loss; a donor gives only what it lacks of a whole step
        if headroom >= step + sum(n for _, n in companions):
            return self._move("", receiver, step, float("nan"), gain, companions)
        donors = [n for n, v in values.items() if n != receiver and v.loss_per_mib < float("inf")
                  and n not in dict(companions)
                  and self._interval - self._received_at.get(n, -cooldown - 1) > cooldown]
        donor = min(donors, key=lambda n: (values[n].loss_per_mib, n)) if donors else ""
        loss = values[donor].loss_per_mib if donor else float("inf")
        bar = (1 + self.config.hysteresis) * loss + self.config.min_gain_seconds_per_mib
        if not gain > bar:
            if headroom >= pool.unit_bytes:
                return self._move("", receiver, min(step, headroom), float("nan"), gain, companions)
            return None
        # a wide margin moves more at once (up to max_steps_per_move steps): twice the bar, two steps, ...
        most = self.config.max_steps_per_move
        steps = most if bar <= 0 or gain >= most * bar else max(1, int(gain / bar))
        return self._move(donor, receiver, steps * step, loss, gain, tuple((n, steps * b) for n, b in companions))

    def _move(self, donor: str, receiver: str, num_bytes: int, loss: float, gain: float,
              companions: tuple[tuple[str, int], ...] = ()) -> RamMove | None:
        """Move `num_bytes` from `donor` (or the headroom) to `receiver`, and the companions' bytes with them (the
        donor gives for both; each grows by at most what is unspent, so the budget holds at every point)."""
        pools = self.pools.pools
        freed = 0
        extra = sum(n for _, n in companions)
        ask = num_bytes + extra - self.pools.headroom_bytes
        if donor and ask > 0:
            before = pools[donor].size_bytes
            freed = before - pools[donor].resize(before - ask)
            if freed <= 0:
                return None
        elif donor:  # the headroom covers the step after all
            donor, loss = "", float("nan")
        give = min(num_bytes, self.pools.headroom_bytes)
        before = pools[receiver].size_bytes
        grown = pools[receiver].resize(before + give) - before
        with_receiver = []
        for name, n in companions:  # grown after the receiver: the receiver's step comes first
            before_companion = pools[name].size_bytes
            added = pools[name].resize(before_companion + min(n, self.pools.headroom_bytes)) - before_companion
            if added > 0:
                self._received_at[name] = self._interval
                with_receiver.append((name, added))
        assert self.pools.total_bytes <= self.pools.budget_bytes
        if grown <= 0:
            if not donor:
                return None
            # the donor stopped short of one receiver unit: its bytes wait in the headroom for the next decision
            receiver, grown = "", freed
        move = RamMove(self._num_steps, donor, receiver, grown, loss, gain, tuple(with_receiver))
        self.moves.append(move)
        if donor:
            self._gave_at[donor] = self._interval
        if receiver:
            self._received_at[receiver] = self._interval
        self._m_moves.inc()
        self._m_moved.inc(max(grown + sum(n for _, n in with_receiver), freed))
        self._update_gauges()
        logger.info("RAM controller: %s", move.line())
        return move

    def lines(self) -> list[str]:
        """For the run report: the pools now and every move."""
        out = [f"RAM pools         {format_size(self.pools.total_bytes)} of {format_size(self.pools.budget_bytes)}: "
               f"{self.pools.describe()}; {len(self.moves)} moves"]
        out += [f"  move            {m.line()}" for m in self.moves]
        return out
