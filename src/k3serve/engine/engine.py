"""The serving engine: `LLMEngine` (add_request / step / abort, thread-safe submission) and the offline `LLM`.

One `step()` is: take in what other threads submitted or cancelled; let the scheduler pick sequences and token
counts under the budget; run ONE batched forward over all of them (every matmul and every expert read serves the
whole batch); sample a token for each sequence whose tokens are all computed; apply stop conditions; free what
finished; stream a `RequestOutput` for every request that changed.

Failure isolation: a bad request raises `RequestError` in `add_request` and never enters the engine. An exception
while post-processing one sequence (sampling, the stop hook, a callback) fails only its request. If the batched
forward itself raises, every sequence in it is reset to be recomputed and marked suspect; suspects then run one per
step, and one that fails alone is failed with an error output. The engine keeps going either way.

Step interruption (`EngineConfig.step_interruption`, fair/priority scheduling): at every pause point of a forward
(after each layer's attention and after each layer's MLP or MoE, `model.interface.pause_points`) the engine looks at what
was submitted meanwhile. If the policy lets an arrival interrupt (its tenant ranks no worse than every other tenant
in the forward), the scheduler admits it (`schedule_urgent`) and it runs a whole forward of its own, is sampled and
streamed, and then the paused forward resumes. Such arrivals found at a step boundary run in a step of their own
ahead of the running sequences. The paused sequences are untouched (their caches are not shared with the arrivals),
at most one such forward runs inside a step, and aborts and tenant changes still wait for the step boundary. A light
tenant's first token then waits for one part of one layer of the forward in flight instead of all of it, at the cost
of one more forward's fixed overhead per interruption. It needs a model whose weights allow a nested forward
(`supports_nested_forward`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.errors import IntegrityError
from k3serve.engine.fairness import TenantShare
from k3serve.engine.io_usage import PollutionLedger, split_step
from k3serve.engine.engine_metrics import EngineMetrics
from k3serve.engine.expert_batching import PredictionQuality
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.prefix_cache import root_hash
from k3serve.engine.request import (CompletionOutput, FinishReason, Request, RequestOutput, RequestSpec, Sequence,
                                    StopHook)
from k3serve.engine.sampling import Sampler, SamplingParams, token_logprob, validate_prompt
from k3serve.engine.speculative import DrafterFactory, SequenceSpeculation, SpeculativeConfig
from k3serve.engine.verification import num_to_emit, verify
from k3serve.model.rollback import RollbackCache
from k3serve.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from k3serve.engine.source_metrics import watch_source
from k3serve.errors import ConfigError, ContextLengthError, RequestError
from k3serve.model.expert_source import StepTenants, StreamStats
from k3serve.model.interface import MLP, ForwardItem, Model

if TYPE_CHECKING:
    from k3serve.engine.constraints import OutputConstraint
    from k3serve.loading import LoadedModel

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over one `Model` (model/interface.py: K3 or any family; the pools follow its
    `cache_layout`). `add_request` and `abort` may be called from any thread; `step`
    from one thread at a time (the engine loop)."""

    def __init__(self, model: Model, config: EngineConfig | None = None, stop_ids: Iterable[int] | None = None,
                 metrics: MetricsRegistry | None = None, speculative: SpeculativeConfig | None = None,
                 drafters: DrafterFactory | None = None,
                 on_pause: Callable[[int, int, str], None] | None = None,
                 model_identity: str | None = None) -> None:
        """`on_pause(num_positions, layer, part)` is called at every pause point of every forward the engine runs
        and once more at its end (layer num_layers - 1, part MLP) (instruments: the isolation experiment's model
        clock, engine/isolation.py). `model_identity` (the store's or checkpoint's checksum,
        `loading.model_identity`) keys the prefix cache's disk tier (`config.prefix_cache_dir`)."""
        self.model = model
        self.on_pause = on_pause
        self.speculative = speculative  # the server default; a request may choose its own or none
        self.drafters = drafters if drafters is not None else DrafterFactory(model)
        self.model_config = model.config
        self.config = config if config is not None else EngineConfig()
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self.stop_ids = frozenset(self.model_config.eos_token_ids if stop_ids is None else stop_ids)
        if self.config.step_interruption == "auto":  # on wherever it can help: a ranked policy, a nestable model
            self.config = dataclasses.replace(self.config, step_interruption=self.config.scheduling != "fcfs"
                                              and model.supports_nested_forward)
        if self.config.step_interruption and not model.supports_nested_forward:
            raise ConfigError("step_interruption needs a model whose weights allow a forward inside "
                              "another (resident K3 weights; not a streaming or traced source, not a family model)")
        self.scheduler = Scheduler(self.config, model.cache_layout, self.metrics, model_identity)
        self._paused: SchedulerOutput | None = None  # the forward paused for an urgent one (step interruption)
        self._urgent_outputs: list[RequestOutput] = []  # outputs of the urgent forward inside this step
        self.max_context = min(self.config.max_model_len, self.scheduler.capacity_tokens)
        self._lock = threading.Lock()
        self._incoming: list[Request] = []
        self._aborts: list[str] = []
        self._new_shares: dict[str, TenantShare] | None = None  # set_tenant_shares, applied at the next step
        self._live_ids: set[str] = set()  # submitted and not yet finished (guarded by _lock)
        self._requests: dict[str, Request] = {}  # live requests the engine thread has taken in
        self._pollution = PollutionLedger()  # who evicted each expert (charge='io')
        self._cache_sharers: dict[str, float] = {}  # tenant -> when it last had work (tenant_cache_shares)
        self.prediction_quality = PredictionQuality()  # --batch-by-experts: previous step's experts vs the next's
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.figures = EngineMetrics(self.metrics, self.scheduler.blocks.num_blocks, self.scheduler.states.num_slots)
        watch_source(self.metrics, model.experts)  # bytes read, expert cache (streaming, EP)
        # the source's counters at the last charge: reads that complete between two forwards (the trunk's read-ahead
        # of the next step's first layer) are charged to the next forward, the one that uses them
        self._io_mark: StreamStats | None = model.experts.local_stats() if model.experts is not None else None
        self.ram_steering = None  # one RAM budget over the pools, moved between steps (engine/ram_pools.py)

    # ---- submission (any thread) ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Iterable[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, tenant: str = "default", cache_salt: str | None = None,
                    stop_hook: StopHook | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    speculative: SpeculativeConfig | bool | str | None = None, grammar: OutputConstraint | None = None
                    ) -> str:
        """Queue a request and return its id. Raises `RequestError` (and queues nothing) if it is invalid.

        `on_output` is called from the engine thread with every `RequestOutput` of this request (streaming);
        `stop_hook` sees each completion's generated ids after every token and may finish it. `speculative`:
        None = the engine's default, False = off, True = the default or `SpeculativeConfig()`, a drafter name =
        that default with this drafter, or a config. `grammar` (engine/constraints.py `OutputConstraint`: a grammar,
        or token healing's spelling of the prompt's tail) constrains every completion's tokens; a grammar allows an
        end-of-sequence id only once its document is complete, so with one (`ends_on_eos`) that id always ends the
        completion, `ignore_eos` or not (nothing may follow the document)."""
        return self.enqueue(self.make_request(prompt_token_ids, params, request_id=request_id, tenant=tenant,
                                               cache_salt=cache_salt, stop_hook=stop_hook, on_output=on_output,
                                               speculative=speculative, grammar=grammar))

    def submit(self, spec: RequestSpec, *, request_id: str | None = None, stop_hook: StopHook | None = None,
               on_output: Callable[[RequestOutput], None] | None = None,
               constraint: OutputConstraint | None = None) -> str:
        """Queue the request `spec` describes, with what the calling process binds to it: the stop hook of its stop
        strings and the constraint of its grammar (both over that process's tokenizer), and where outputs go."""
        return self.add_request(spec.prompt_token_ids, spec.params, request_id=request_id, tenant=spec.tenant,
                                cache_salt=spec.cache_salt, stop_hook=stop_hook, on_output=on_output,
                                speculative=spec.speculative, grammar=constraint)

    def make_request(self, prompt_token_ids: Iterable[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, tenant: str = "default", cache_salt: str | None = None,
                     stop_hook: StopHook | None = None,
                     on_output: Callable[[RequestOutput], None] | None = None,
                     speculative: SpeculativeConfig | bool | str | None = None,
                     grammar: OutputConstraint | None = None) -> Request:
        """Validate and build a request without queueing it (`add_request` = this + queueing). Raises
        `RequestError`. The id is checked for duplicates, and assigned if None, when it is queued."""
        prompt = validate_prompt(prompt_token_ids, self.model_config.vocab_size)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # re-check: a frozen dataclass can still have been altered
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must lie in 0..{vocab - 1}")
        if len(prompt) >= self.max_context:  # a longer max_tokens is cut to the context; one token must fit
            raise ContextLengthError(len(prompt), params.max_tokens, self.max_context)
        if params.n > self.config.max_seqs:
            raise RequestError(f"n = {params.n} exceeds max_seqs = {self.config.max_seqs}")
        if not isinstance(tenant, str) or not tenant:
            raise RequestError(f"tenant must be a non-empty string, got {tenant!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        for name, hook in (("stop_hook", stop_hook), ("on_output", on_output)):
            if hook is not None and not callable(hook):
                raise RequestError(f"{name} must be callable")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        ends_on_eos = grammar is not None and grammar.ends_on_eos
        stop_ids = params.stop_set(self.stop_ids) | (frozenset(self.stop_ids) if ends_on_eos else frozenset())
        request = Request(request_id or "", prompt, params, tenant, cache_salt, root_hash(tenant, cache_salt),
                          stop_ids, stop_hook, on_output)
        request.speculative = self._speculative_for(speculative)
        max_total = min(len(prompt) + params.max_tokens, self.max_context)
        for index in range(params.n):
            rng = np.random.default_rng([params.seed, index]) if index and params.seed is not None else None
            sampler = Sampler(params, rng, None if grammar is None else grammar.constraint())
            request.sequences.append(Sequence(next(self._seq_ids), request, index, sampler, max_total))
        request.pending_forks = request.sequences[1:]
        return request

    def _speculative_for(self, choice: SpeculativeConfig | bool | str | None) -> SpeculativeConfig | None:
        """A request's speculation, resolved once against the engine's default (see `add_request`)."""
        if choice is None:
            return self.speculative
        if choice is False:
            return None
        default = self.speculative if self.speculative is not None else SpeculativeConfig()
        if choice is True:
            return default
        if isinstance(choice, str):
            choice = dataclasses.replace(default, drafter=choice)  # SpeculativeConfig checks the name
        if not isinstance(choice, SpeculativeConfig):
            raise RequestError(f"speculative must be a SpeculativeConfig, a drafter name or a bool, got "
                               f"{type(choice).__name__}")
        self.drafters.check(choice)
        return choice

    def enqueue(self, request: Request) -> str:
        """Queue a request built by `make_request`; returns its id. Raises `RequestError` on a duplicate id."""
        with self._lock:
            if not request.request_id:
                request.request_id = f"req-{next(self._request_ids)}"
                while request.request_id in self._live_ids:
                    request.request_id = f"req-{next(self._request_ids)}"
            elif request.request_id in self._live_ids:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self._live_ids.add(request.request_id)
            self._incoming.append(request)
        self.figures.request_added(request)
        return request.request_id

    def set_tenant_shares(self, shares: dict[str, TenantShare]) -> None:
        """Replace the tenants' weights, priorities and KV shares (any thread; applied at the next step). Running
        and queued requests carry on; tenants not named get the default share."""
        for name, share in shares.items():
            if not isinstance(name, str) or not isinstance(share, TenantShare):
                raise RequestError("tenant shares must map tenant names to TenantShare")
        with self._lock:
            self._new_shares = dict(shares)

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        """(running sequences, cached positions) a KV share allows at admission: a request needing more can only
        run while its tenant runs nothing else."""
        max_seqs, max_blocks = self.scheduler.share_limits(kv_share)
        return max_seqs, max_blocks * self.config.block_size

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone). Takes effect at the next step; unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._aborts or self._live_ids)

    @property
    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._live_ids)

    # ---- the step (engine thread) ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision, one batched forward, sampling and bookkeeping. Returns the outputs of every
        request that changed (each also went to its `on_output`)."""
        started = time.perf_counter()
        touched: dict[str, Request] = {}
        self._urgent_outputs = []
        self._take_submissions(touched)
        decision = SchedulerOutput()
        if self.config.step_interruption and self.scheduler.waiting:  # arrivals that may interrupt go first, alone
            decision = self.scheduler.schedule_urgent({seq.request.tenant for seq in self.scheduler.running})
        if decision.empty:
            self._propose_drafts()
            decision = self.scheduler.schedule()
        if not decision.empty:
            self._run(decision, touched)
            self.figures.forward_ran(time.perf_counter() - started, decision.num_batched_tokens)
        for seq in [s.seq for s in decision.scheduled] + decision.preempted:
            if seq.speculation is not None:
                seq.speculation.draft = None
        self._update_gauges()
        if self.ram_steering is not None:  # between steps: no view of a slot or block is held now
            self.ram_steering.after_step(decision.preempted, time.perf_counter() - started,
                                         decision.num_batched_tokens)
        return self._urgent_outputs + self._emit(touched)

    def _take_submissions(self, touched: dict[str, Request]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, []
            shares, self._new_shares = self._new_shares, None
        if shares is not None:
            self.scheduler.policy.set_shares(shares)
        self._take_new_requests()
        for request_id in aborts:
            request = self._requests.get(request_id)
            if request is not None and not request.finished:
                request.pending_forks = []
                for seq in request.sequences:
                    self._finish(seq, FinishReason.ABORT)
                touched[request_id] = request

    def _take_new_requests(self) -> None:
        """Queue what other threads submitted."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for request in incoming:
            self._requests[request.request_id] = request
            self.scheduler.add(request.sequences[0])

    def _at_pause(self, decision: SchedulerOutput) -> Callable[[int, str], None]:
        """The model's pause hook for `decision`'s forward: the observer, then (step interruption) at most one
        urgent forward for arrivals the policy lets interrupt this one."""
        interrupted = False

        def hook(layer: int, part: str) -> None:
            nonlocal interrupted
            if self.on_pause is not None:
                self.on_pause(decision.num_batched_tokens, layer, part)
            if not self.config.step_interruption or interrupted or self._paused is not None:
                return
            with self._lock:
                arrived = bool(self._incoming)
            if arrived:
                interrupted = self._run_urgent(decision)

        return hook

    def _run_urgent(self, paused: SchedulerOutput) -> bool:
        """Queue the arrivals and run one forward for those allowed to interrupt `paused` (which waits at a pause
        point); their outputs are streamed now and returned with this step's. Whether a forward ran."""
        self._take_new_requests()
        decision = self.scheduler.schedule_urgent({s.seq.request.tenant for s in paused.scheduled})
        if decision.empty:
            return False
        touched: dict[str, Request] = {}
        self._paused = paused
        try:
            self._run(decision, touched)
        finally:
            self._paused = None
        self.figures.forward_ran(None, decision.num_batched_tokens)
        self._urgent_outputs.extend(self._emit(touched))
        return True

    def _propose_drafts(self) -> None:
        """Drafts for every running sequence that is about to decode and speculates (engine/speculative.py)."""
        for seq in self.scheduler.running:
            spec = seq.speculation
            if spec is not None:
                spec.draft = None
            config = seq.request.speculative
            if config is None or seq.num_uncomputed_tokens != 1 or seq.suspect or seq.is_finished \
                    or (spec is not None and spec.stopped):
                continue
            if spec is None:
                spec = seq.speculation = SequenceSpeculation(config, self.drafters.create(config))
            try:
                draft = spec.propose(seq.token_ids, seq.num_remaining_tokens, seq.sampler)
            except Exception:  # noqa: BLE001 - a drafter's failure costs speculation, not the request
                logger.exception("drafter failed for %s; it decodes without drafts", seq)
                spec.stop()
                continue
            if len(draft):
                spec.draft = draft

    def _run(self, decision: SchedulerOutput, touched: dict[str, Request]) -> None:
        whole = [s for s in decision.scheduled if s.num_new_tokens == 0]  # admitted whole from the prefix cache
        if whole:
            self._sample_cached(whole, touched)
            decision = SchedulerOutput([s for s in decision.scheduled if s.num_new_tokens], decision.preempted)
            if decision.empty:
                return
        items = []
        windows: list[RollbackCache | None] = []
        for s in decision.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            ids = seq.token_ids[start:start + s.num_new_tokens - s.num_draft_tokens] \
                + seq.draft_tokens[:s.num_draft_tokens]
            if s.num_draft_tokens:
                window = RollbackCache(seq.cache, seq.speculation.config.rollback)
                window.begin_window()
                items.append(ForwardItem(np.asarray(ids, np.int64), window, all_logits=True))
            else:
                window = None
                items.append(ForwardItem(np.asarray(ids, np.int64), seq.cache))
            windows.append(window)
        source = self.model.experts
        before = (self._io_mark or source.local_stats()) if source is not None else None
        io_aware = self._io_aware_window(decision)
        if source is not None:  # (None also clears shares an earlier engine on this model set)
            source.note_tenants(self._step_tenants(decision) if self.config.tenant_cache_shares else None)
        try:
            if self.on_pause is None and not self.config.step_interruption:
                result = self.model.forward(items)
            else:
                result = self.model.forward(items, at_pause=self._at_pause(decision))
        except Exception as exc:  # noqa: BLE001 - isolate, never kill the loop
            self._charge_io(decision, before)
            self._forward_failed(decision, exc, touched)
            return
        self._charge_io(decision, before)
        if self.config.batch_by_experts and source is not None:
            self._record_predictions(decision)
        if self.on_pause is not None:  # the last layer's MLP and the logits (no pause point there)
            self.on_pause(decision.num_batched_tokens, self.model_config.num_layers - 1, MLP)
        if io_aware is not None and before is not None:  # the bytes this window (or decode step) read
            read = source.local_stats().bytes_read - before.bytes_read
            io_aware.length.observe_step(decision.num_batched_tokens, read)
        self.figures.computed.inc(decision.num_batched_tokens)
        now = time.perf_counter()
        for scheduled, logits, window in zip(decision.scheduled, result.logits, windows):
            self._process(scheduled, logits, window, now, touched)

    def _record_predictions(self, decision: SchedulerOutput) -> None:
        """Each sequence's last token's experts in this forward, per MoE layer ([L, TOPK]): the prediction of its
        next step's (--batch-by-experts). A decode's new routing is scored against the old prediction first
        (`prediction_quality`). Nothing is recorded when the source keeps no step routing (resident experts)."""
        reads = self.model.experts.step_reads()
        if reads is None or not reads.routing:
            return
        ends = np.cumsum([s.num_new_tokens for s in decision.scheduled]) - 1  # [S] each sequence's last row
        rows = [reads.routing[layer] for layer in sorted(reads.routing)]  # L x [T, TOPK]
        if any(r.shape[0] != ends[-1] + 1 for r in rows):
            return
        stacked = np.stack(rows, axis=1)  # [T, L, TOPK]
        for scheduled, end in zip(decision.scheduled, ends):
            current = stacked[end].copy()  # [L, TOPK]
            previous = scheduled.seq.predicted_experts
            if previous is not None and scheduled.num_new_tokens == 1 and previous.shape == current.shape:
                self.prediction_quality.observe(previous, current)
            scheduled.seq.predicted_experts = current

    def _step_tenants(self, decision: SchedulerOutput) -> StepTenants:
        """The forward's rows by tenant, and the expert cache shares: every tenant with work now or within
        `tenant_cache_hold_s` (so a tenant between two requests keeps its experts) gets weight / sum of weights."""
        now = time.perf_counter()
        for tenant in self.scheduler.active_tenants():
            self._cache_sharers[tenant] = now
        hold = self.config.tenant_cache_hold_s
        self._cache_sharers = {t: at for t, at in self._cache_sharers.items() if now - at <= hold}
        weights = {t: self.scheduler.policy.share(t).weight for t in self._cache_sharers}
        whole = sum(weights.values())
        return StepTenants(tuple(s.seq.request.tenant for s in decision.scheduled),
                           tuple(s.num_new_tokens for s in decision.scheduled),
                           {t: w / whole for t, w in weights.items()})

    def _io_aware_window(self, decision: SchedulerOutput) -> SequenceSpeculation | None:
        """The speculation of the step's one sequence when it measures what its windows read (--speculative-io-aware)
        and this step is a decode or a verify window of it; else None."""
        if len(decision.scheduled) != 1:
            return None
        s = decision.scheduled[0]
        spec = s.seq.speculation
        if spec is None or not spec.config.io_aware or s.num_new_tokens != s.num_draft_tokens + 1:
            return None
        return spec

    def _charge_io(self, decision: SchedulerOutput, before: StreamStats | None) -> None:
        """Charge the reads of the forward that just ran (the source's counters since `before`) to its requests: a
        miss to the tokens routed to its expert, the rest by share of the tokens (engine/io_usage.py), in their
        usage and the per-tenant series; with `charge='io'`, each tenant's virtual counter pays for the waits it caused
        (a miss on an expert another tenant's read evicted is that tenant's: `PollutionLedger`)."""
        if before is None:
            return
        now = self.model.experts.local_stats()
        self._io_mark = now
        try:
            self._charge_io_of_step(decision, now.minus(before))
        except Exception:  # noqa: BLE001 - accounting never fails a request or the loop
            logger.exception("charging a step's reads to its requests failed; this step's I/O goes uncharged")

    def _charge_io_of_step(self, decision: SchedulerOutput, step: StreamStats) -> None:
        source = self.model.experts
        separation = self.scheduler.io_separation
        num_tokens = [s.num_new_tokens for s in decision.scheduled]
        if not (step.bytes_read or step.expert_misses or step.io_wait_seconds):
            if separation is not None:  # a step without reads lowers its tenants' miss rates
                for scheduled in decision.scheduled:
                    separation.observe(scheduled.seq.request.tenant, 0, scheduled.num_new_tokens)
            return
        reads = source.step_reads()
        for scheduled, share in zip(decision.scheduled, split_step(step, num_tokens, reads)):
            request = scheduled.seq.request
            request.io.add(share)
            self.figures.io_charged(request.tenant, share)
            if separation is not None:
                separation.observe(request.tenant, share.expert_misses, scheduled.num_new_tokens)
        if self.config.tenant_cache_shares:
            slots = source.tenant_slots()
            self.figures.expert_slots(slots)
            if separation is not None:
                separation.note_cache_shares(slots)
        if self.scheduler.policy.io_cost:  # --charge io bills each miss to its cause (engine/io_usage.py)
            tenants = [s.seq.request.tenant for s in decision.scheduled]
            for tenant, seconds in self._pollution.causes(step, reads, num_tokens, tenants).items():
                self.scheduler.policy.charge_io(tenant, seconds)
                self.figures.io_caused(tenant, seconds)

    def _sample_cached(self, scheduled: list[ScheduledSequence], touched: dict[str, Request]) -> None:
        """Sequences the prefix cache restored whole, with the logits after their last token: they sample from those
        (the same logits a forward would give) and decode from the next step on."""
        now = time.perf_counter()
        for s in scheduled:
            logits, s.seq.cached_logits = s.seq.cached_logits, None
            if logits is not None:
                self._process(s, logits[None], None, now, touched)

    def _process(self, scheduled: ScheduledSequence, logits: np.ndarray, window: RollbackCache | None, now: float,
                 touched: dict[str, Request]) -> None:
        """One scheduled sequence after its forward (logits [t, V]): verify a window or sample; a failure here fails
        only its request."""
        request = scheduled.seq.request
        if request.finished:
            return
        try:
            if window is not None:
                self._after_verify(scheduled, logits, window, now, touched)
            else:
                self._after_forward(scheduled, logits[-1], now, touched)
        except Exception as exc:  # noqa: BLE001
            logger.exception("request %s failed while processing its step", request.request_id)
            self._fail(request, exc, touched)

    def _after_forward(self, scheduled: ScheduledSequence, logits: np.ndarray, now: float,
                       touched: dict[str, Request]) -> None:
        seq = scheduled.seq
        completes = scheduled.completes
        self.scheduler.after_forward(seq, scheduled.num_new_tokens, logits=logits)
        seq.suspect = False
        if not completes:
            return
        request = seq.request
        touched[request.request_id] = request
        sampled = [(seq, seq.sampler.sample(logits))]
        if request.pending_forks and seq.index == 0:  # n > 1: the prompt is done, fork the other completions
            forks, request.pending_forks = request.pending_forks, []
            for child in forks:
                if self.scheduler.fork(seq, child):
                    sampled.append((child, child.sampler.sample(logits)))
                else:
                    self.scheduler.add(child)  # no seat or slot now: it will prefill the prompt itself
        for target, token in sampled:
            self._append(target, token, now, logits)

    def _after_verify(self, scheduled: ScheduledSequence, logits: np.ndarray, window: RollbackCache, now: float,
                      touched: dict[str, Request]) -> None:
        """A speculative window ran: verify the drafts, roll the state back to the kept positions, emit."""
        seq, request, k = scheduled.seq, scheduled.seq.request, scheduled.num_draft_tokens
        spec = seq.speculation
        assert spec is not None  # a verify window runs only on a sequence with a draft
        draft = spec.take_draft(k)
        result = verify(logits, draft, seq.sampler)
        m = num_to_emit(result.tokens, seq.num_output_tokens, seq.num_remaining_tokens, request.stop_ids, request.stop_hook,
                        seq.output_token_ids)
        spec.stats.recorded_bytes += window.recorded_bytes
        rollback_started = time.perf_counter()
        window.commit(m)  # the last confirmed token and the first m - 1 emitted ones stay in the state
        spec.stats.rollback_seconds += time.perf_counter() - rollback_started
        self.scheduler.after_forward(seq, m, pending_tokens=list(result.tokens[:m - 1]))
        seq.suspect = False
        spec.record(k, result.num_accepted, m)
        self.figures.spec_window(k, result.num_accepted)
        touched[request.request_id] = request
        for row, token in enumerate(result.tokens[:m]):
            self._append(seq, token, now, logits[row])
            if seq.is_finished:
                break

    def _append(self, seq: Sequence, token: int, now: float, logits: np.ndarray) -> None:
        """Add a sampled token (from logits [V]) to the sequence: grammar, logprobs, counters, stop conditions."""
        request = seq.request
        seq.sampler.accept(token)
        if request.params.logprobs is not None:
            seq.logprobs.append(token_logprob(logits, token, request.params.logprobs))
        seq.token_ids.append(token)
        self.figures.token(request, seq, now)
        self.scheduler.policy.charge_output(request.tenant)
        if request.first_token_time is None:
            request.first_token_time = now
        seq.last_token_time = now
        reason = None
        if token in request.stop_ids:
            reason = FinishReason.STOP
        elif seq.num_remaining_tokens <= 0:
            reason = FinishReason.LENGTH
        elif request.stop_hook is not None and request.stop_hook(seq.output_token_ids):
            reason = FinishReason.STOP
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.speculation is not None and not seq.speculation.stopped:
            seq.speculation.stop()
        self.scheduler.finish(seq, save_state=reason in (FinishReason.STOP, FinishReason.LENGTH))
        seq.finish_reason = reason
        request = seq.request
        if request.finished:
            self.figures.request_finished(_request_reason(request), time.perf_counter() - request.arrival_time)
            self._requests.pop(request.request_id, None)
            with self._lock:
                self._live_ids.discard(request.request_id)

    def _fail(self, request: Request, exc: BaseException, touched: dict[str, Request]) -> None:
        request.error = f"{type(exc).__name__}: {exc}"
        request.pending_forks = []
        for seq in request.sequences:
            self._finish(seq, FinishReason.ERROR)
        touched[request.request_id] = request

    def _forward_failed(self, decision: SchedulerOutput, exc: BaseException, touched: dict[str, Request]) -> None:
        """The batched forward raised: its partial writes cannot be trusted. Alone: fail that request. In a batch:
        recompute every member, one per step, to find the culprit."""
        self.figures.forward_failures.inc()
        alone = len(decision.scheduled) == 1
        logger.error("a forward over %d sequences failed: %s: %s", len(decision.scheduled), type(exc).__name__, exc)
        for scheduled in decision.scheduled:
            seq = scheduled.seq
            if seq.is_finished:
                continue
            if alone:
                self._fail(seq.request, exc, touched)
            else:
                self.scheduler.reset_for_recompute(seq)
                seq.suspect = True

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every live request (the engine loop hit an error it cannot attribute); returns their outputs."""
        touched: dict[str, Request] = {}
        self._take_submissions(touched)
        for request in list(self._requests.values()):
            self._fail(request, RuntimeError(message), touched)
        self._update_gauges()
        return self._emit(touched)

    # ---- outputs and metrics --------------------------------------------------------------------------------
    def _emit(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            completions = []
            for seq in request.sequences:
                generated = seq.output_token_ids
                completions.append(CompletionOutput(seq.index, generated, generated[seq.num_emitted:],
                                                    seq.finish_reason,
                                                    None if request.params.logprobs is None else list(seq.logprobs)))
                seq.num_emitted = len(generated)
            ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
            out = RequestOutput(request.request_id, list(request.prompt_token_ids), completions, request.finished,
                                request.error, request.num_cached_tokens, ttft, request.io.bytes_read,
                                request.io.expert_misses, 1000.0 * request.io.io_wait_seconds)
            outputs.append(out)
            if request.on_output is not None:
                try:
                    request.on_output(out)
                except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
                    logger.exception("the output callback of request %s raised", request.request_id)
        return outputs

    def _update_gauges(self) -> None:
        self.figures.update(self.scheduler, self.kv_waste_fraction())

    def kv_waste_fraction(self) -> float:
        """Allocated but unfilled positions over allocated positions, across running sequences' block tables."""
        allocated = filled = 0
        for seq in self.scheduler.running:
            allocated += len(seq.cache.block_table) * self.config.block_size
            filled += seq.cache.num_tokens
        return 1.0 - filled / allocated if allocated else 0.0

    def check_integrity(self) -> None:
        """Every pool and cache consistent, and every queued sequence belongs to a live request."""
        self.scheduler.check_integrity()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if self._requests.get(seq.request.request_id) is not seq.request or seq.is_finished:
                raise IntegrityError(f"{seq} is queued but its request is not live")


def _request_reason(request: Request) -> FinishReason:
    """A finished request's reason: error or abort if any completion had it, else that of completion 0."""
    reasons = [s.finish_reason for s in request.sequences]
    for reason in (FinishReason.ERROR, FinishReason.ABORT):
        if reason in reasons:
            return reason
    return reasons[0] or FinishReason.STOP


class LLM:
    """Offline generation over an `LLMEngine`: submit a list of prompts, step until all are done."""

    def __init__(self, model: Model | LoadedModel | str | Path | None = None,
                 config: EngineConfig | None = None) -> None:
        from k3serve.loading import LoadedModel, load_model

        if model is None or isinstance(model, (str, Path)):
            loaded = load_model(model)
        elif isinstance(model, LoadedModel):
            loaded = model
        else:  # a Model without its tokenizer: token ids in and out
            self.tokenizer = None
            self.engine = LLMEngine(model, config)
            return
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(loaded.model, config, stop_ids=loaded.stop_ids)

    def generate(self, prompts: list[int] | list[list[int]] | str | list[str],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Final outputs in prompt order. A bad prompt raises `RequestError` before any is submitted."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self._encode(p) for p in prompts]
        all_params = params if isinstance(params, list) else [params] * len(ids)
        if len(all_params) != len(ids):
            raise RequestError(f"{len(all_params)} sampling parameter sets for {len(ids)} prompts")
        requests = [self.engine.make_request(prompt, p) for prompt, p in zip(ids, all_params)]  # all valid first
        request_ids = [self.engine.enqueue(request) for request in requests]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in request_ids]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give token ids")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)
