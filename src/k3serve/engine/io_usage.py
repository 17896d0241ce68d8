"""Charging a step's disk reads to the requests in it.

A batched forward reads each expert and trunk layer once for every token that needs it, so the bytes cannot be
split by who asked first. The rule: the step's counters (what the source read between the forward's start and its
end: bytes, on-demand expert reads, seconds the compute thread waited on them) are split by each sequence's share
of the step's tokens,
    x_i = X * n_i / sum_j n_j,
integer counts by largest remainder, so that the shares of bytes and misses add up to the step's totals exactly.
A sequence of 2,000 prefill tokens in a step with three decodes pays 2000/2003 of that step's reads. A step whose
routing is one tenant's domain and another's decodes thus charges them by size, not by whose tokens missed: the
per-expert split would need the model's routing per token, which the source does not see.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.model.expert_source import StreamStats


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


def _largest_remainder(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (integers that sum to `total`)."""
    whole = sum(weights)
    if whole == 0 or total == 0:
        return [0] * len(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[:total - sum(parts)]:
        parts[i] += 1
    return parts


def split_step(step: StreamStats, num_tokens: list[int]) -> list[IOUsage]:
    """The step's reads (`step`: the source's counters over one forward) charged to sequences that computed
    `num_tokens` positions each (see the module docstring)."""
    whole = sum(num_tokens)
    bytes_read = _largest_remainder(step.bytes_read, num_tokens)
    misses = _largest_remainder(step.expert_misses, num_tokens)
    return [IOUsage(b, m, step.io_wait_seconds * n / whole if whole else 0.0)
            for b, m, n in zip(bytes_read, misses, num_tokens)]
