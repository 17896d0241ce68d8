"""The honest counters of a streaming source (`StreamStats`) and the run-report lines they print.

A request is *retained* only if its expert was resident before the step began; an expert that a prefetch brought
in during the step is a *prefetch hit*, never a retained one. Bytes and reads come from the I/O engines, so they
count what was actually read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from k3serve.stream.budget import BudgetPlan
from k3serve.units import format_size

@dataclass
class StreamStats:
    steps: int = 0
    tokens: int = 0
    expert_requests: int = 0
    expert_retained: int = 0  # resident before the step that asked
    expert_prefetch_hits: int = 0  # brought in by a prefetch during the same step
    expert_misses: int = 0  # read on demand
    expert_evictions: int = 0  # experts dropped from their slot (to make room, or released by policy none)
    prefetch_issued: int = 0
    prefetch_wasted: int = 0  # guesses dropped without ever being used
    expert_bytes_read: int = 0
    trunk_bytes_read: int = 0
    num_reads: int = 0
    checksum_retries: int = 0
    io_wait_seconds: float = 0.0  # the compute thread blocked on reads
    io_busy_seconds: float = 0.0  # summed over I/O workers

    def minus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def plus(self, other: StreamStats) -> StreamStats:
        return StreamStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def bytes_read(self) -> int:
        return self.expert_bytes_read + self.trunk_bytes_read

    @property
    def retention(self) -> float:
        return self.expert_retained / self.expert_requests if self.expert_requests else float("nan")


def stream_report_lines(stats: StreamStats, tokens: int, wall_seconds: float, plan: BudgetPlan,
                        peak_rss: int) -> list[str]:
    """Run-report lines for `tokens` generated tokens over `wall_seconds` (a decode phase)."""
    per = max(tokens, 1)
    mbps = stats.bytes_read / 2**20 / stats.io_wait_seconds if stats.io_wait_seconds > 0 else float("nan")
    served = stats.expert_retained + stats.expert_prefetch_hits
    lines = [
        f"disk read/token   {format_size(stats.bytes_read / per)} (experts {format_size(stats.expert_bytes_read / per)}"
        f", trunk {format_size(stats.trunk_bytes_read / per)}), {stats.num_reads / per:.1f} reads/token",
        f"effective read    {stats.bytes_read / 2**20 / wall_seconds if wall_seconds > 0 else float('nan'):.1f} MB/s"
        f" over the phase, {mbps:.1f} MB/s per second of I/O wait",
        f"retention         {100 * stats.retention:.1f}% of {stats.expert_requests} expert requests resident "
        f"before their step (+{stats.expert_prefetch_hits} prefetch hits; {served} served without a demand read)",
        f"prefetch          {stats.prefetch_issued} issued, {stats.prefetch_wasted} dropped unused",
        f"time split        I/O wait {stats.io_wait_seconds:.3f} s, compute {max(wall_seconds - stats.io_wait_seconds, 0):.3f} s",
    ]
    budget = "unlimited" if plan.budget_bytes is None else format_size(plan.budget_bytes)
    lines.append(f"memory            peak RSS {format_size(peak_rss)} vs RAM budget {budget} for weights "
                 f"(planned {format_size(plan.total_bytes)})")
    if stats.checksum_retries:
        lines.append(f"checksum retries  {stats.checksum_retries}")
    return lines
