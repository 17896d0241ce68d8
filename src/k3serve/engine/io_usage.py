"""Charging a step's disk reads to the requests that caused them.

A batched forward reads each expert and trunk layer once for every token that needs it. The rule, per forward
(the source's counters between its start and its end):
  - an expert read on demand (a miss) is charged to the tokens routed to that expert in that layer in this forward,
    split equally among them, so each sequence pays (its tokens routed there) / (all tokens routed there) of the
    miss and of its bytes. A sequence whose tokens hit resident experts pays nothing for another's misses in the
    same step. This needs the source's record of the step (`ExpertSource.step_reads`: the misses and the routing
    per layer); a source without one (families, shards, expert parallelism) is charged by the next rule;
  - every other byte (trunk layers streamed, experts read ahead on a guess, checksum retries) is charged by token
    share: sequence i pays n_i / sum_j n_j of it (n: positions it computed in the forward);
  - the seconds the compute thread waited on reads are charged in proportion to the bytes charged.
That is what the request's usage and the tenant's series show: the reads its tokens asked for. What `charge='io'`
bills to the virtual counter differs in one case (`PollutionLedger`): a miss on an expert that a read for another
tenant evicted is billed to that tenant.
Integer counts (bytes, misses) are rounded by largest remainder, so the charges of a step add up to its totals
exactly.

Shapes: T tokens of the forward (the sequences' tokens concatenated in batch order), TOPK experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.expert_source import StepReads, StreamStats


@dataclass
class IOUsage:
    """Disk reads charged to one request (or one sequence's share of one step)."""

    bytes_read: int = 0
    expert_misses: int = 0
    io_wait_seconds: float = 0.0

    def add(self, other: IOUsage) -> None:
        self.bytes_read += other.bytes_read
        self.expert_misses += other.expert_misses
        self.io_wait_seconds += other.io_wait_seconds


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (integers that sum to `total`; ties to the earlier index)."""
    whole = float(sum(weights))
    if whole <= 0 or total == 0:
        return [0] * len(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[:total - sum(parts)]:
        parts[i] += 1
    return parts


def miss_routers(reads: StepReads, num_tokens: list[int]) -> list[np.ndarray] | None:
    """For each miss of the step, each sequence's share of the tokens routed to its expert ([S] floats summing to
    1), or None when the routing does not cover the step."""
    bounds = np.cumsum([0] + num_tokens)  # sequence i owns rows bounds[i]:bounds[i + 1]
    nonempty = np.asarray(num_tokens) > 0
    shares = []
    for layer, expert, _, _ in reads.misses:
        routing = reads.routing.get(layer)
        if routing is None or routing.shape[0] != bounds[-1] or not len(num_tokens):
            return None
        routed = np.any(routing == expert, axis=1)  # [T]
        counts = np.where(nonempty, np.add.reduceat(routed.astype(np.int64), bounds[:-1]), 0)  # [S]
        if counts.sum() == 0:
            return None
        shares.append(counts / counts.sum())
    return shares


def _miss_weights(reads: StepReads, num_tokens: list[int]) -> tuple[np.ndarray, int] | None:
    """(each sequence's share of the step's misses [S] (floats summing to the number of misses), the bytes of
    those misses), or None when the routing does not cover the step."""
    routers = miss_routers(reads, num_tokens)
    if routers is None:
        return None
    return np.sum(routers, axis=0), sum(miss[2] for miss in reads.misses)


def split_step(step: StreamStats, num_tokens: list[int], reads: StepReads | None = None) -> list[IOUsage]:
    """The step's reads (`step`: the source's counters over one forward; `reads`: its misses and routing, when the
    source records them) charged to sequences that computed `num_tokens` positions each (see the module
    docstring)."""
    weights = _miss_weights(reads, num_tokens) if reads is not None and reads.misses else None
    if weights is None or weights[1] > step.bytes_read or len(reads.misses) != step.expert_misses:
        miss_shares, miss_bytes = [float(n) for n in num_tokens], 0  # token share for everything
        misses = largest_remainder(step.expert_misses, miss_shares)
    else:
        miss_shares, miss_bytes = weights[0].tolist(), weights[1]
        misses = largest_remainder(step.expert_misses, miss_shares)
    other = largest_remainder(step.bytes_read - miss_bytes, [float(n) for n in num_tokens])
    charged = [o + b for o, b in zip(other, largest_remainder(miss_bytes, miss_shares))]
    total = sum(charged)
    waits = [step.io_wait_seconds * b / total if total else step.io_wait_seconds * n / max(sum(num_tokens), 1)
             for b, n in zip(charged, num_tokens)]
    return [IOUsage(b, m, w) for b, m, w in zip(charged, misses, waits)]


class PollutionLedger:
    """Who caused each miss, for `charge='io'`: a miss on an expert that a read for another tenant evicted is that
    tenant's doing (it polluted the shared expert cache), not the doing of the tenant whose tokens then routed to
    it. The ledger remembers, for every expert evicted by an on-demand read, the tenants whose tokens routed to
    the expert that read loaded (their shares); a later miss on the evicted expert is charged to them, and any
    other miss (a cold one) to the tenants routed to it. At most one entry per expert of the store.

    Per step, the seconds the compute thread waited on reads are split as bytes are: a miss's share
    (its bytes / the step's bytes) to its cause, the rest by token share."""

    def __init__(self) -> None:
        self._evicted_by: dict[tuple[int, int], dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._evicted_by)

    def causes(self, step: StreamStats, reads: StepReads | None, num_tokens: list[int], tenants: list[str]
               ) -> dict[str, float]:
        """Seconds of waiting on reads each tenant caused in this step (`tenants[i]` ran sequence i)."""
        caused: dict[str, float] = {}
        total_bytes, wait = step.bytes_read, step.io_wait_seconds
        routers = miss_routers(reads, num_tokens) if reads is not None and reads.misses else None
        miss_bytes = sum(miss[2] for miss in reads.misses) if routers is not None else 0
        if routers is None or not total_bytes or miss_bytes > total_bytes:
            routers, miss_bytes = [], 0
        for (layer, expert, nbytes, evicted), shares in zip(reads.misses if routers else [], routers):
            by_tenant: dict[str, float] = {}
            for tenant, share in zip(tenants, shares.tolist()):
                if share:
                    by_tenant[tenant] = by_tenant.get(tenant, 0.0) + share
            cause = self._evicted_by.pop((layer, expert), by_tenant)
            for tenant, share in cause.items():
                caused[tenant] = caused.get(tenant, 0.0) + wait * nbytes / total_bytes * share
            for key in evicted:
                self._evicted_by[key] = by_tenant
        rest = wait * (total_bytes - miss_bytes) / total_bytes if total_bytes else wait
        whole = sum(num_tokens)
        for tenant, n in zip(tenants, num_tokens):
            caused[tenant] = caused.get(tenant, 0.0) + (rest * n / whole if whole else 0.0)
        return caused
