"""The engine's figures, in one object: what `LLMEngine` counts as it runs (requests, tokens, latencies, steps,
speculation) and the gauges of its pools, kept in the one metrics registry (engine/metrics.py) that the run report,
`/metrics`, the benchmarks and the lab read. The engine calls one verb per event; nothing else writes these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3serve.engine.io_usage import IOUsage
from k3serve.engine.metrics import Counter, Gauge, Histogram, MetricsRegistry
from k3serve.engine.request import FinishReason, Request, Sequence

if TYPE_CHECKING:
    from k3serve.engine.scheduler import Scheduler

GAUGES = (
    ("queue_length", "sequences waiting"), ("num_running", "sequences running"),
    ("kv_blocks_used", "attention blocks referenced by running sequences"), ("kv_blocks_total", "attention blocks"),
    ("kv_block_usage", "fraction of attention blocks referenced"), ("kv_blocks_cached", "unreferenced prefix blocks"),
    ("kv_waste_fraction", "allocated but unfilled positions in running sequences' blocks"),
    ("state_slots_used", "recurrent state slots in use"), ("state_slots_total", "recurrent state slots"),
    ("prefix_cache_checkpoints", "state checkpoints held"),
    ("prefix_cache_protected_checkpoints", "state checkpoints in slru's protected segment (recurring)"),
    ("prefix_cache_hit_rate", "positions restored / positions looked up"),
)


class EngineMetrics:
    def __init__(self, registry: MetricsRegistry, num_blocks: int, num_slots: int) -> None:
        m = self.registry = registry
        self.added = m.counter("requests_added", "requests accepted by add_request")
        self.finished = {reason: m.counter(f"requests_finished_{reason.value}", f"requests finished: {reason.value}")
                         for reason in FinishReason}
        self.generated = m.counter("generation_tokens", "tokens generated")
        self.prompt = m.counter("prompt_tokens", "prompt tokens of accepted requests")
        self.computed = m.counter("computed_tokens", "positions run through the model (prefill + decode)")
        self.steps = m.counter("steps", "engine steps that ran a forward")
        self.forward_failures = m.counter("forward_failures", "batched forwards that raised")
        self.interruptions = m.counter("step_interruptions", "forwards paused at a pause point for an urgent one")
        self.ttft = m.histogram("ttft_seconds", "arrival to first token")
        self.itl = m.histogram("inter_token_latency_seconds", "time between consecutive tokens of a sequence")
        self.e2e = m.histogram("e2e_latency_seconds", "arrival to last output")
        self.step_seconds = m.histogram("step_seconds", "duration of steps that ran a forward")
        self.batch = m.histogram("batch_tokens", "tokens per forward")
        self.spec_windows = m.counter("spec_windows", "speculative verify windows (with at least one draft)")
        self.spec_drafted = m.counter("spec_draft_tokens", "draft tokens verified")
        self.spec_accepted = m.counter("spec_accepted_tokens", "draft tokens accepted")
        self.gauges = {name: m.gauge(name, help) for name, help in GAUGES}
        self.gauges["kv_blocks_total"].set(num_blocks)
        self.gauges["state_slots_total"].set(num_slots)
        self.tenant_requests = m.family(Counter, "tenant_requests", "requests accepted, per tenant", ("tenant",))
        self.tenant_prompt = m.family(Counter, "tenant_prompt_tokens", "prompt tokens accepted, per tenant",
                                      ("tenant",))
        self.tenant_generated = m.family(Counter, "tenant_generation_tokens", "tokens generated, per tenant",
                                         ("tenant",))
        self.tenant_ttft = m.family(Histogram, "tenant_ttft_seconds", "arrival to first token, per tenant", ("tenant",))
        self.tenant_bytes_read = m.family(Counter, "tenant_bytes_read",
                                          "bytes read from the store, charged to the tenant's requests by their "
                                          "share of each step's tokens (engine/io_usage.py)", ("tenant",))
        self.tenant_expert_misses = m.family(Counter, "tenant_expert_misses",
                                             "on-demand expert reads charged to the tenant, as tenant_bytes_read",
                                             ("tenant",))
        self.tenant_io_wait = m.family(Counter, "tenant_io_wait_seconds",
                                       "seconds of the compute thread's wait on reads charged to the tenant",
                                       ("tenant",))
        self.tenant_io_caused = m.family(Counter, "tenant_io_wait_caused_seconds",
                                         "--charge io: seconds of waiting on reads billed to the tenant's virtual "
                                         "counter (a miss on an expert another tenant's read evicted is that "
                                         "tenant's)", ("tenant",))
        self.tenant_expert_slots = m.family(Gauge, "tenant_expert_slots",
                                            "--tenant-cache-shares: expert cache slots counted in the tenant's share",
                                            ("tenant",))
        self.tenant_expert_slot_share = m.family(Gauge, "tenant_expert_slot_share",
                                                 "--tenant-cache-shares: slots the tenant's share allows before its "
                                                 "misses evict its own experts", ("tenant",))
        self.tenant_counter = m.family(Gauge, "tenant_virtual_counter",
                                       "the scheduler's virtual token counter (weighted service received), per tenant",
                                       ("tenant",))

    def request_added(self, request: Request) -> None:
        self.added.inc()
        self.prompt.inc(len(request.prompt_token_ids))
        self.tenant_requests.labels(request.tenant).inc()
        self.tenant_prompt.labels(request.tenant).inc(len(request.prompt_token_ids))

    def forward_ran(self, seconds: float | None, num_tokens: int) -> None:
        """A step's forward over `num_tokens` positions (`seconds` the whole step; None for an urgent forward
        inside a step, which is counted as an interruption)."""
        if seconds is None:
            self.interruptions.inc()
        else:
            self.steps.inc()
            self.step_seconds.observe(seconds)
        self.batch.observe(num_tokens)

    def io_charged(self, tenant: str, usage: IOUsage) -> None:
        """A request of `tenant` was charged `usage` (its share of a step's reads)."""
        self.tenant_bytes_read.labels(tenant).inc(usage.bytes_read)
        self.tenant_expert_misses.labels(tenant).inc(usage.expert_misses)
        self.tenant_io_wait.labels(tenant).inc(usage.io_wait_seconds)

    def expert_slots(self, slots: dict[str, tuple[int, int]]) -> None:
        for tenant, (owned, quota) in slots.items():
            self.tenant_expert_slots.labels(tenant).set(owned)
            self.tenant_expert_slot_share.labels(tenant).set(quota)

    def io_caused(self, tenant: str, seconds: float) -> None:
        """--charge io billed `seconds` of waiting on reads to `tenant`."""
        self.tenant_io_caused.labels(tenant).inc(seconds)

    def spec_window(self, num_drafted: int, num_accepted: int) -> None:
        self.spec_windows.inc()
        self.spec_drafted.inc(num_drafted)
        self.spec_accepted.inc(num_accepted)

    def token(self, request: Request, seq: Sequence, now: float) -> None:
        """A token was appended to `seq` at `now` (its first token times the request's TTFT)."""
        self.generated.inc()
        self.tenant_generated.labels(request.tenant).inc()
        if request.first_token_time is None:
            self.ttft.observe(now - request.arrival_time)
            self.tenant_ttft.labels(request.tenant).observe(now - request.arrival_time)
        if seq.last_token_time is not None:
            self.itl.observe(now - seq.last_token_time)

    def request_finished(self, reason: FinishReason, seconds: float) -> None:
        self.finished[reason].inc()
        self.e2e.observe(seconds)

    def update(self, scheduler: Scheduler, kv_waste_fraction: float) -> None:
        """The pools' gauges after a step."""
        s, g = scheduler, self.gauges
        g["queue_length"].set(len(s.waiting))
        g["num_running"].set(len(s.running))
        used = s.blocks.num_used_blocks
        g["kv_blocks_used"].set(used)
        g["kv_block_usage"].set(used / s.blocks.num_blocks)
        g["kv_blocks_cached"].set(s.blocks.num_cached_blocks)
        g["kv_waste_fraction"].set(kv_waste_fraction)
        g["state_slots_used"].set(s.states.num_used_slots)
        for tenant, value in list(s.policy.counters.items()):
            self.tenant_counter.labels(tenant).set(value)
        if s.prefix_cache is not None:
            g["prefix_cache_checkpoints"].set(s.prefix_cache.num_checkpoints)
            g["prefix_cache_protected_checkpoints"].set(s.prefix_cache.num_protected_checkpoints)
            queried = self.registry.counter("prefix_cache_query_tokens").value
            hit = self.registry.counter("prefix_cache_hit_tokens").value
            g["prefix_cache_hit_rate"].set(hit / queried if queried else 0.0)
