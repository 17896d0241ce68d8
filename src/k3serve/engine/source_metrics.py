"""/metrics for the weights: what a streaming source read and kept (`k3serve serve --ram-budget`), and with expert
parallelism (`k3serve cluster --expert-parallel N`) each owner's cache and the calls' network bytes.

The counters live in the sources and come out of `ExpertSource.stats()` as one `SourceStats` record; they are
copied into the engine's registry when someone reads it (`MetricsRegistry.add_refresher`), not on every step. A
resident model reads nothing and exports none of these.
"""

from __future__ import annotations

from k3serve.engine.metrics import Counter, Gauge, MetricsRegistry
from k3serve.model.expert_source import ExpertSource, SourceStats

# StreamStats field -> (metric, help)
STREAM_COUNTERS = {
    "expert_bytes_read": ("weights_expert_bytes_read", "bytes of routed experts read from the store"),
    "trunk_bytes_read": ("weights_trunk_bytes_read", "bytes of trunk layers read from the store"),
    "num_reads": ("weights_reads", "reads issued to the store"),
    "expert_requests": ("expert_requests", "routed experts a step asked for"),
    "expert_retained": ("expert_retained", "expert requests resident before their step began"),
    "expert_prefetch_hits": ("expert_prefetch_hits", "expert requests served by a prefetch of the same step"),
    "expert_misses": ("expert_misses", "expert requests read on demand"),
    "expert_evictions": ("expert_evictions", "experts dropped from their cache slot"),
    "prefetch_issued": ("expert_prefetch_issued", "experts read ahead on the router's guess"),
    "prefetch_wasted": ("expert_prefetch_wasted", "read-ahead experts dropped unused"),
    "checksum_retries": ("weights_checksum_retries", "reads repeated after a CRC mismatch"),
    "io_wait_seconds": ("weights_io_wait_seconds", "seconds the compute thread waited on reads"),
}
OWNER_GAUGES = {  # an owner's counters start again with each incarnation, so they are gauges
    "expert_bytes_read": ("expert_owner_bytes_read", "expert bytes an owner read, since it (re)started"),
    "expert_requests": ("expert_owner_requests", "expert requests an owner served, since it (re)started"),
    "expert_retained": ("expert_owner_retained", "an owner's expert requests resident before their step"),
    "expert_misses": ("expert_owner_misses", "an owner's expert requests read on demand"),
}
NETWORK_COUNTERS = {
    "calls": ("expert_parallel_calls", "calls from the front to expert owners"),
    "bytes_sent": ("expert_parallel_bytes_sent", "array bytes the front sent to expert owners"),
    "bytes_received": ("expert_parallel_bytes_received", "array bytes expert owners sent back"),
    "wait_seconds": ("expert_parallel_wait_seconds", "seconds the front waited on expert owners"),
}
OWNER_STATS_TIMEOUT_SECONDS = 5.0


def watch_source(registry: MetricsRegistry, source: ExpertSource | None) -> None:
    """Export `source`'s counters (`ExpertSource.stats()`) from `registry` at each read; a resident source has
    none and exports nothing. Nothing is asked at construction (an expert-parallel source asks its owners)."""
    if source is None:
        return

    def weights_metrics(reg: MetricsRegistry) -> None:
        stats = source.stats(timeout=OWNER_STATS_TIMEOUT_SECONDS)
        if stats.stream is not None:
            for field, (name, help) in STREAM_COUNTERS.items():
                reg.counter(name, help).advance_to(getattr(stats.stream, field))
            reg.gauge("expert_retention", "retained / all expert requests since start").set(
                stats.stream.expert_retained / stats.stream.expert_requests if stats.stream.expert_requests else 0.0)
        if stats.network is not None:
            _owners(reg, stats)

    registry.add_refresher(weights_metrics)


def _owners(reg: MetricsRegistry, stats: SourceStats) -> None:
    for field, (name, help) in NETWORK_COUNTERS.items():
        reg.counter(name, help).advance_to(getattr(stats.network, field))
    restarts = reg.family(Counter, "expert_owner_restarts", "times an owner died and Ray restarted it", ("owner",))
    for owner, count in enumerate(stats.owner_restarts):
        restarts.labels(str(owner)).advance_to(count)
    families = {field: reg.family(Gauge, name, help, ("owner",)) for field, (name, help) in OWNER_GAUGES.items()}
    retention = reg.family(Gauge, "expert_owner_retention", "an owner's retained / all expert requests", ("owner",))
    for owner, owner_stats in enumerate(stats.owners):
        for field, family in families.items():
            family.labels(str(owner)).set(getattr(owner_stats, field))
        retention.labels(str(owner)).set(owner_stats.retention if owner_stats.expert_requests else 0.0)
