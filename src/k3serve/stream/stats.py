"""The run-report lines a streaming source's counters print (`StreamStats`, model/expert_source.py: retained
only if resident before the step began; a prefetch that arrived during the step is a prefetch hit, never a retained
one; bytes and reads as the I/O engines counted them)."""

from __future__ import annotations

from k3serve.model.expert_source import StreamStats
from k3serve.stream.budget import BudgetPlan
from k3serve.units import format_size


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
        f"experts kept      {stats.mean_experts_kept:.2f} per token and MoE layer",
        f"time split        I/O wait {stats.io_wait_seconds:.3f} s, compute {max(wall_seconds - stats.io_wait_seconds, 0):.3f} s",
    ]
    budget = "unlimited" if plan.budget_bytes is None else format_size(plan.budget_bytes)
    lines.append(f"memory            peak RSS {format_size(peak_rss)} vs RAM budget {budget} for weights "
                 f"(planned {format_size(plan.total_bytes)})")
    if stats.checksum_retries:
        lines.append(f"checksum retries  {stats.checksum_retries}")
    return lines
