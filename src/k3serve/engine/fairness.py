"""Scheduling policies between tenants: which waiting sequence is admitted next, which running prefill chunks wait
for it, and which running sequence is preempted when memory runs out. The scheduler asks; the policy decides.

Every policy keeps a Virtual Token Counter per tenant (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, section 4), so `/metrics` shows it whichever policy runs:

    c_u += n_in / w_u              when a sequence of tenant u is first admitted (n_in: prompt positions it computes,
                                   i.e. not served by the prefix cache)
    c_u += cost * n_out / w_u      for every generated token (`output_cost`, 2 by default as in the paper)
    c_u += io_cost * t / w_u       for every step's t seconds of waiting on reads charged to u's requests (by their
                                   share of the step's tokens, engine/io_usage.py), with `charge='io'` only
    c_u  = max(c_u, min_{v in A} c_v)   when u becomes active (A: tenants with queued or running sequences; with A
                                   empty, the largest counter), so an idle tenant banks no credit

- `fcfs`: the oldest waiting sequence first; preempt the most recently admitted running one.
- `fair` (VTC): admit from the active tenant with the smallest counter (its oldest sequence). It is
  work-conserving: a tenant that cannot use capacity never holds it back from the others. Running prefill chunks
  of tenants whose counter is above the smallest waiting counter go after the admissions in the step's token
  budget (they get what is left, so nothing idles).
- `priority`: strict classes (a larger `priority` is more important), VTC within a class; a waiting sequence that
  finds no seat, state slot or blocks preempts a running sequence of a lower class.

With `EngineConfig.step_interruption`, `fair` and `priority` also let a new arrival interrupt a forward in flight
(after a layer's attention or its MLP) when its tenant ranks no worse than every other tenant in that forward
(`interrupts`): a tenant that was idle is lifted to the smallest active counter, so it ties and goes first. `fcfs`
never interrupts.

Against the paper's reference code (the authors' S-LoRA router): the charges are the same (prompt tokens x 1 and
output tokens x 2, over the weight), except that prompt positions served by the prefix cache are not charged, and a
lift looks at every tenant with a queued or running sequence where the paper's queue holds only waiting requests;
with continuous batching a tenant whose requests all run is still being served, so it still sets the floor.

I/O-heavy tenants in steps of their own (`IOSeparation`, `EngineConfig.defer_io_heavy`, with `charge='io'`): each
tenant's recent expert misses per computed position are kept (decayed by `decay` per step it runs in). Who is heavy:
- under expert cache shares (`note_cache_shares`), a tenant at or over its share whose rate is `floor` or more (its
  working set is larger than its share, so it keeps reading); one within its share is light whatever its rate, since
  its experts are kept and its misses are cold ones that pass (a first request's). The rate alone cannot tell them
  apart: a flood's large prefill chunks share each read among many positions (about 1 miss per position in
  bench_tenant_io), as few as a light tenant's first, cold request;
- without shares, a tenant whose rate is at least `ratio` times the lightest's with work (and `floor` above it);
- a tenant not measured yet (no step run) beside measured ones: heavy until its first step says otherwise. When
  every tenant with work is new (a start), the one with the fewest positions to compute runs first, alone.
When the tenants with work include heavy and light ones, a step takes either group, never both: the light first, the
heavy once they have waited `max_wait` steps in a row (then the light wait one). So a light tenant's step reads only
its own misses, and no tenant waits more than `max_wait` steps in a row. And while a light tenant has had work within
the last `hold_s` seconds, a step of heavy tenants only computes at most `max_heavy_tokens` positions: the step in
flight when the light tenant's next request arrives, which it must wait for, stays short (the heavy tenant pays in
more, smaller steps).

Shares: a tenant's `kv_share` caps the MLA blocks and KDA state slots its running sequences hold when it is
admitted (it may grow past the cap while it runs, and a tenant with nothing running is always admitted if the
pool can hold it, so a cap never deadlocks). Under memory pressure the victim is a sequence of a tenant over its
share (the most over) first; then the policy's own order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from k3serve.engine.request import Sequence
from k3serve.errors import ConfigError

SCHEDULING_POLICIES = ("fcfs", "fair", "priority")
DEFAULT_OUTPUT_COST = 2.0  # the paper's w_q / w_p: an output token costs twice an input token


@dataclass(frozen=True)
class TenantShare:
    """What the engine knows of a tenant: its weight and priority class, and its share of blocks and slots."""

    weight: float = 1.0
    priority: int = 0
    kv_share: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight) or self.weight <= 0:
            raise ConfigError(f"TenantShare.weight must be a positive number, got {self.weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"TenantShare.priority must be an integer, got {self.priority!r}")
        if isinstance(self.kv_share, bool) or not isinstance(self.kv_share, (int, float)) \
                or not 0 < self.kv_share <= 1:
            raise ConfigError(f"TenantShare.kv_share must be in (0, 1], got {self.kv_share!r}")


DEFAULT_SHARE = TenantShare()


@dataclass
class TenantUsage:
    """Blocks and state slots a tenant's running sequences hold (a block shared by two of them counts twice)."""

    num_seqs: int = 0
    num_blocks: int = 0


class SchedulingPolicy:
    """Counters, shares and the three decisions. Subclasses differ only in `rank` (lower is served first) and in
    which running sequences a waiting one may displace."""

    name = "fcfs"
    interrupting = False  # whether an arrival may interrupt a forward in flight (`interrupts`)

    def __init__(self, output_cost: float = DEFAULT_OUTPUT_COST, io_cost: float = 0.0) -> None:
        if isinstance(output_cost, bool) or not isinstance(output_cost, (int, float)) or not output_cost >= 0:
            raise ConfigError(f"output_cost must be a number >= 0, got {output_cost!r}")
        if isinstance(io_cost, bool) or not isinstance(io_cost, (int, float)) or not io_cost >= 0:
            raise ConfigError(f"io_cost must be a number >= 0, got {io_cost!r}")
        self.output_cost = float(output_cost)
        self.io_cost = float(io_cost)  # tokens one second of waiting on the disk costs (0: disk time is free)
        self.shares: dict[str, TenantShare] = {}
        self.counters: dict[str, float] = {}

    # ---- tenants and counters -------------------------------------------------------------------------------
    def set_shares(self, shares: dict[str, TenantShare]) -> None:
        """Replace every tenant's share (a reloaded tenants file); tenants not named get the default."""
        self.shares = dict(shares)

    def share(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant, DEFAULT_SHARE)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def activate(self, tenant: str, active: set[str]) -> None:
        """`tenant` had nothing queued or running and now has: lift its counter (no banked credit)."""
        others = [self.counters.get(t, 0.0) for t in active if t != tenant]
        if others:
            floor = min(others)
        else:
            floor = max(self.counters.values(), default=0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge_prompt(self, tenant: str, num_tokens: int) -> None:
        self.counters[tenant] = self.counter(tenant) + num_tokens / self.share(tenant).weight

    def charge_output(self, tenant: str, num_tokens: int = 1) -> None:
        self.counters[tenant] = self.counter(tenant) + self.output_cost * num_tokens / self.share(tenant).weight

    def charge_io(self, tenant: str, seconds: float) -> None:
        """`seconds` of the compute thread's wait on reads, charged to `tenant` (engine/io_usage.py): with
        `charge='io'` they cost io_cost tokens each."""
        if self.io_cost and seconds:
            self.counters[tenant] = self.counter(tenant) + self.io_cost * seconds / self.share(tenant).weight

    # ---- decisions ------------------------------------------------------------------------------------------
    def rank(self, tenant: str) -> tuple:
        """Service order between tenants: lower first. FCFS: no preference (queue order decides)."""
        return ()

    def pick_waiting(self, waiting: Iterable[Sequence], blocked: set[str]) -> Sequence | None:
        """The next sequence to admit: the best-ranked tenant's oldest queued sequence (queue order among equal
        ranks), skipping tenants in `blocked` (at their share this step)."""
        best: Sequence | None = None
        best_key: tuple | None = None
        seen: set[str] = set()
        for seq in waiting:
            tenant = seq.request.tenant
            if tenant in blocked or tenant in seen:
                continue
            seen.add(tenant)
            key = self.rank(tenant)
            if best_key is None or key < best_key:
                best, best_key = seq, key
        return best

    def defers(self, seq: Sequence, best_waiting: Sequence | None) -> bool:
        """Whether running `seq`'s prefill chunk goes after the admission of `best_waiting` (it still gets the
        budget left over). Decodes never wait: they are one token each and hold memory."""
        if best_waiting is None or seq.num_uncomputed_tokens <= 1:
            return False
        return self.rank(best_waiting.request.tenant) < self.rank(seq.request.tenant)

    def interrupts(self, tenant: str, in_flight: set[str]) -> bool:
        """Whether a waiting sequence of `tenant` may run while a forward over the tenants `in_flight` (other than
        `tenant`) is paused: it ranks no worse than every one of them. Never under fcfs."""
        others = in_flight - {tenant}
        return self.interrupting and bool(others) and self.rank(tenant) <= min(self.rank(t) for t in others)

    def victim(self, running: list[Sequence], usage: dict[str, TenantUsage], limits: dict[str, tuple[int, int]]
               ) -> Sequence:
        """The running sequence to preempt when memory runs out: over-share tenants first (most over), then the
        policy's victim order. `limits`: tenant -> (max seqs, max blocks)."""
        order = {id(seq): index for index, seq in enumerate(running)}  # admission order: the last is the newest
        return max(running, key=lambda s: (_over_share(s.request.tenant, usage, limits), self._victim_key(s),
                                           order[id(s)]))

    def _victim_key(self, seq: Sequence) -> tuple:
        return ()  # FCFS: the most recently admitted

    def displaces(self, waiting: Sequence, running: list[Sequence], usage: dict[str, TenantUsage],
                  limits: dict[str, tuple[int, int]]) -> Sequence | None:
        """A running sequence that `waiting` (which cannot be admitted for lack of a seat, slot or blocks) may
        preempt, or None: one of a tenant over its share while `waiting`'s tenant is within its own."""
        tenant = waiting.request.tenant
        if _over_share(tenant, usage, limits) > 0:
            return None
        over = [s for s in running if _over_share(s.request.tenant, usage, limits) > 0]
        return self.victim(over, usage, limits) if over else None


class FairPolicy(SchedulingPolicy):
    name = "fair"
    interrupting = True

    def rank(self, tenant: str) -> tuple:
        return (self.counter(tenant),)

    def _victim_key(self, seq: Sequence) -> tuple:
        return (self.counter(seq.request.tenant),)  # the largest counter's most recently admitted


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    interrupting = True

    def rank(self, tenant: str) -> tuple:
        return (-self.share(tenant).priority, self.counter(tenant))

    def _victim_key(self, seq: Sequence) -> tuple:
        return (-self.share(seq.request.tenant).priority, self.counter(seq.request.tenant))

    def displaces(self, waiting: Sequence, running: list[Sequence], usage: dict[str, TenantUsage],
                  limits: dict[str, tuple[int, int]]) -> Sequence | None:
        level = self.share(waiting.request.tenant).priority
        lower = [s for s in running if self.share(s.request.tenant).priority < level]
        if lower:
            return self.victim(lower, usage, limits)
        return super().displaces(waiting, running, usage, limits)


class IOSeparation:
    """Which tenants' work waits this step so that I/O-heavy and light tenants run in separate steps (see the
    module docstring)."""

    def __init__(self, max_heavy_tokens: int | None = None, ratio: float = 4.0, floor: float = 0.25,
                 decay: float = 0.8, max_wait: int = 1, hold_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ratio > 1 or not floor >= 0 or not 0 <= decay < 1 or isinstance(max_wait, bool) or max_wait < 1:
            raise ConfigError(f"IOSeparation needs ratio > 1, floor >= 0, decay in [0, 1) and max_wait >= 1, got "
                              f"{ratio!r}, {floor!r}, {decay!r}, {max_wait!r}")
        if max_heavy_tokens is not None and (isinstance(max_heavy_tokens, bool) or max_heavy_tokens < 1):
            raise ConfigError(f"IOSeparation.max_heavy_tokens must be a positive integer or None, got "
                              f"{max_heavy_tokens!r}")
        self.ratio, self.floor, self.decay, self.max_wait = ratio, floor, decay, max_wait
        self.max_heavy_tokens, self.hold_s, self._clock = max_heavy_tokens, hold_s, clock
        self._seen: dict[str, float] = {}  # tenant -> when it last had work
        self._at_share: set[str] | None = None  # under expert cache shares: tenants at or over theirs
        self._misses: dict[str, float] = {}
        self._positions: dict[str, float] = {}
        self.num_waited: dict[str, int] = {}  # steps in a row each tenant's work waited for another group
        self.num_separated_steps = 0  # steps that left a group out

    def observe(self, tenant: str, misses: int, positions: int) -> None:
        """A step computed `positions` positions of `tenant`'s, whose tokens asked for `misses` expert reads."""
        self._misses[tenant] = self._misses.get(tenant, 0.0) * self.decay + misses
        self._positions[tenant] = self._positions.get(tenant, 0.0) * self.decay + positions

    def rate(self, tenant: str) -> float:
        """Recent expert misses per computed position (0 for a tenant not seen yet)."""
        positions = self._positions.get(tenant, 0.0)
        return self._misses[tenant] / positions if positions else 0.0

    def note_cache_shares(self, slots: dict[str, tuple[int, int]]) -> None:
        """tenant -> (expert cache slots owned, its share's slots) after a step (`ExpertSource.tenant_slots`);
        empty: no shares, the rates alone decide."""
        self._at_share = {t for t, (owned, quota) in slots.items() if owned >= quota} if slots else None

    def _heavy(self, tenants: set[str]) -> set[str]:
        measured = {t for t in tenants if t in self._positions}
        new = tenants - measured if measured else set()  # beside measured tenants, a new one is heavy
        if self._at_share is not None:
            return new | {t for t in measured if t in self._at_share and self.rate(t) >= self.floor}
        lightest = min((self.rate(t) for t in measured), default=0.0)
        return new | {t for t in measured if self.rate(t) >= self.ratio * lightest
                      and self.rate(t) - lightest >= self.floor}

    def left_out(self, tenants: Mapping[str, int]) -> set[str]:
        """Of the tenants with work now (tenant -> positions it has to compute), those whose work waits this step
        (empty: one step for all)."""
        now = self._clock()
        for tenant in tenants:
            self._seen[tenant] = now
        if len(tenants) < 2:
            return set()
        names = set(tenants)
        if not any(t in self._positions for t in names):  # a start (lasts one step): the least work first, alone
            return names - {min(names, key=lambda t: (tenants[t], t))}
        heavy = self._heavy(names)
        if not heavy or heavy == names:
            return set()
        if any(self.num_waited.get(t, 0) >= self.max_wait for t in heavy):
            return names - heavy
        return heavy

    def step_tokens(self, tenants: set[str]) -> int | None:
        """The positions a step running `tenants` may compute: `max_heavy_tokens` when every one of them is heavy
        and a light tenant had work within `hold_s` seconds; None (the engine's budget) otherwise."""
        if self.max_heavy_tokens is None or not tenants:
            return None
        now = self._clock()
        around = {t for t, at in self._seen.items() if now - at <= self.hold_s} | tenants
        heavy = self._heavy(around)
        return self.max_heavy_tokens if tenants <= heavy and around - heavy else None

    def ran(self, ran: set[str], waited: set[str]) -> None:
        """The step ran the tenants `ran`; `waited` had work left out."""
        for tenant in ran:
            self.num_waited.pop(tenant, None)
        for tenant in waited - ran:
            self.num_waited[tenant] = self.num_waited.get(tenant, 0) + 1
        self.num_separated_steps += bool(waited - ran)


def make_policy(name: str, output_cost: float = DEFAULT_OUTPUT_COST, io_cost: float = 0.0) -> SchedulingPolicy:
    classes = {"fcfs": SchedulingPolicy, "fair": FairPolicy, "priority": PriorityPolicy}
    if name not in classes:
        raise ConfigError(f"scheduling must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
    return classes[name](output_cost, io_cost)


def _over_share(tenant: str, usage: dict[str, TenantUsage], limits: dict[str, tuple[int, int]]) -> float:
    """How far a tenant is over its share (0 when within): the larger of its seat and block overshoot ratios."""
    held = usage.get(tenant)
    if held is None or tenant not in limits:
        return 0.0
    max_seqs, max_blocks = limits[tenant]
    return max(0.0, held.num_seqs / max_seqs - 1, held.num_blocks / max_blocks - 1)
