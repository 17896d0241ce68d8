"""`ClusterBackend`: N engine replicas (Ray actors) behind a router, as one `ServingBackend` for the HTTP API.

Faults. A replica that dies (its actor killed, its process gone) fails the calls in flight with a Ray actor error.
A request whose client has received no token yet is sent again, from the start, to another healthy replica: one
that had streamed nothing, and every non-streamed request (its client gets one whole response at the end, so
nothing it saw needs continuing). A streamed request whose client has received tokens ends with an error output
naming the replica (its text cannot be continued elsewhere without repeating it). The router stops choosing the
replica at once; Ray restarts it (`max_restarts`), and a monitor thread puts it back once it answers again, with its
entries in the radix tree forgotten (its cache restarted empty). The monitor also probes the healthy replicas, so
a replica that dies or restarts while idle is seen too. A replica that dies after its last restart is gone for
good: the log says so, and /health reports the fleet degraded (200, `{"status": "degraded", "reason"}`) while any
replica is down, and 503 once none is left. No request waits on a dead replica.
"""

from __future__ import annotations

import logging
import numbers
import threading
import uuid
from collections.abc import AsyncIterator, Iterable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from k3serve.cluster.replica import EngineReplica
from k3serve.cluster.spec import SINGLE_THREAD_ENV, ReplicaInfo, ReplicaSpec
from k3serve.cluster.router import Route, Router, RouterConfig
from k3serve.engine.fairness import TenantShare
from k3serve.engine.metrics import Counter, Gauge, MetricsRegistry
from k3serve.engine.request import CompletionOutput, FinishReason, RequestOutput, RequestSpec
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ContextLengthError, K3Error, RequestError
from k3serve.serve.health import FailureWindow

logger = logging.getLogger(__name__)

REPLICA_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
MONITOR_INTERVAL_SECONDS = 0.5
REPLICA_METRICS_TIMEOUT_SECONDS = 5.0
REPLICA_ENGINE_METRICS = frozenset((  # shown per replica at the front, beside a streaming replica's weights_*/expert_*
    "queue_length", "num_running", "kv_block_usage", "kv_blocks_cached", "state_slots_used",
    "prefix_cache_checkpoints", "prefix_cache_protected_checkpoints", "prefix_cache_hit_rate", "preemptions",
    "generation_tokens", "computed_tokens", "steps", "forward_failures"))
START_TIMEOUT_SECONDS = 600.0
DEAD_PROBES_FOR_GOOD = 2  # probes of a down replica in a row that Ray answers ActorDiedError: it will not restart
SHARES_TIMEOUT_SECONDS = 10.0  # a serving replica answers at once; one that does not is treated as down


class ClusterBackend:
    """Starts `num_replicas` replicas of `spec` (Ray must be initialised) and routes requests to them."""

    def __init__(self, spec: ReplicaSpec, num_replicas: int, router: RouterConfig, max_restarts: int = 3,
                 max_attempts: int | None = None, cpus_per_replica: float = 1.0) -> None:
        self.spec = spec
        self.max_restarts = max_restarts
        self.speculative = spec.speculative
        self.metrics = MetricsRegistry()
        self.max_attempts = max_attempts if max_attempts is not None else num_replicas
        options = dict(num_cpus=cpus_per_replica, max_restarts=max_restarts, max_task_retries=0,
                       runtime_env={"env_vars": SINGLE_THREAD_ENV})
        self.actors = [EngineReplica.options(**options).remote(spec, i) for i in range(num_replicas)]
        try:
            self.infos: list[ReplicaInfo] = ray.get([a.info.remote() for a in self.actors],
                                                    timeout=START_TIMEOUT_SECONDS)
        except REPLICA_ERRORS as exc:
            self._kill_all()
            raise K3Error(f"a replica failed to start: {exc}") from None
        first = self.infos[0]
        self.max_context = first.max_context
        self.model_name = first.model_name
        self.router = Router(router if router.block_size == first.block_size else
                             RouterConfig(**{**router.__dict__, "block_size": first.block_size}), num_replicas)
        self._capacity: dict[float, tuple[int, int]] = {}
        self.generation = [0] * num_replicas  # incarnations: a failure seen by a request sent to an older one is old news
        self.pids = [info.pid for info in self.infos]  # each replica's current process: a new pid is a restart
        self.restarts = [0] * num_replicas  # restarts seen; a death after max_restarts of them is final
        self.gone = [False] * num_replicas  # died after its last restart: never probed or routed to again
        self._gone_why: dict[int, str] = {}
        self._dead_probes = [0] * num_replicas  # probes in a row that Ray answered "dead" (not "restarting")
        self._lock = threading.Lock()  # the fields above: the event loop (failures) and the monitor both write them
        self.shares: dict[str, TenantShare] = {}  # the tenants' current shares: a restarted replica gets them first
        self._shares_lock = threading.Lock()  # a reload and a restarted replica's return, one at a time
        self._stopping = threading.Event()
        self.failures = FailureWindow()  # the replicas' requests that failed for a server-wide cause (a bad store)
        m = self.metrics
        self._m_load = m.family(Gauge, "replica_load", "requests in flight, per replica", ("replica",))
        self._m_healthy = m.family(Gauge, "replica_healthy", "1 while the router sends to the replica", ("replica",))
        self._m_prompt = m.family(Counter, "replica_prompt_tokens", "prompt tokens served, per replica",
                                  ("replica",))
        self._m_cached = m.family(Counter, "replica_cached_prompt_tokens",
                                  "prompt tokens served by the replica's prefix cache", ("replica",))
        self._m_hit_rate = m.family(Gauge, "replica_prefix_hit_rate",
                                    "cached / all prompt tokens served, per replica", ("replica",))
        self._m_decisions = m.family(Counter, "router_decisions", "routing decisions, per reason", ("reason",))
        self._m_failures = m.family(Counter, "replica_failures", "replica deaths seen by the front", ("replica",))
        self._m_retries = m.counter("router_retries_total", "requests sent again after their replica died")
        self._m_lost = m.counter("router_lost_streams_total",
                                 "streamed requests ended with an error because their replica died")
        self._m_prefix_hit = m.counter("cluster_prefix_hit_tokens_total", "prompt tokens served from a prefix cache")
        self._m_prefix_all = m.counter("cluster_prompt_tokens_total", "prompt tokens served")
        self._m_cluster_hit_rate = m.gauge("cluster_prefix_hit_rate", "cached / all prompt tokens, all replicas")
        for replica in range(num_replicas):
            self._publish(replica)
        m.add_refresher(self._replica_engine_metrics)
        self._monitor = threading.Thread(target=self._watch, name="k3serve-cluster-monitor", daemon=True)
        self._monitor.start()

    # ---- ServingBackend ---------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stopping.is_set() and any(self.router.healthy)

    @property
    def degraded(self) -> str | None:
        reasons = []
        with self._lock:
            gone = [f"replica {r} {self._gone_why[r]}, gone for good" for r, g in enumerate(self.gone) if g]
            down = [r for r, healthy in enumerate(self.router.healthy) if not healthy and not self.gone[r]]
        serving = sum(self.router.healthy)
        reasons.extend(gone)
        if down:
            reasons.append(f"replica {', '.join(map(str, down))} is down until Ray restarts it")
        if reasons:
            reasons[-1] += f": {serving} of {len(self.actors)} replicas serve"
        failures = self.failures.reason()
        if failures is not None:
            reasons.append(failures)
        return "; ".join(reasons) if reasons else None

    def submit(self, spec: RequestSpec) -> ClusterStream:
        self._validate(spec.prompt_token_ids, spec.params)
        stream = ClusterStream(self, spec)  # the record travels to the replica as it is (stop strings and grammar
        stream.start(frozenset())           # as text, bound there to the replica's tokenizer)
        return stream

    def set_tenant_shares(self, shares: dict[str, TenantShare]) -> None:
        """All or nothing across the replicas. Every serving replica takes the shares, and every other one (down,
        restarting, or failing now) is out of the router until it has taken them (`_rejoin`). A replica that refuses
        them (its engine raises) undoes the change everywhere and this raises `K3Error` naming it."""
        with self._shares_lock:
            previous = self.shares
            live = [r for r in range(len(self.actors)) if self.router.healthy[r]]
            calls = {r: (self.generation[r], self.actors[r].set_tenant_shares.remote(shares)) for r in live}
            taken, refused = [], None
            for replica, (generation, ref) in calls.items():
                try:
                    ray.get(ref, timeout=SHARES_TIMEOUT_SECONDS)
                    taken.append(replica)
                except REPLICA_ERRORS as exc:  # dying: it takes them before it serves again
                    self._failed(replica, generation, exc)
                except GetTimeoutError:  # alive but not answering: out until it has taken them
                    logger.warning("replica %d did not take the tenant shares within %g s; the router leaves it out "
                                   "until it has", replica, SHARES_TIMEOUT_SECONDS)
                    with self._lock:
                        self.router.mark_down(replica)
                    self._publish(replica)
                except Exception as exc:  # noqa: BLE001 - the replica's engine refused them: undo below
                    refused = refused or (replica, exc)
            if refused is not None:
                for replica in taken:
                    try:
                        ray.get(self.actors[replica].set_tenant_shares.remote(previous),
                                timeout=SHARES_TIMEOUT_SECONDS)
                    except Exception as exc:  # noqa: BLE001 - out until it takes the current shares again
                        self._failed(replica, self.generation[replica], exc)
                replica, exc = refused
                raise K3Error(f"replica {replica} refused the tenant shares ({type(exc).__name__}: {exc}); "
                              "no replica uses them")
            self.shares = dict(shares)

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        if kv_share not in self._capacity:  # every replica has the same engine configuration
            self._capacity[kv_share] = ray.get(self.actors[0].share_capacity.remote(kv_share))
        return self._capacity[kv_share]

    def shutdown(self) -> None:
        self._stopping.set()
        self._monitor.join(5)
        self._kill_all()

    # ---- internals --------------------------------------------------------------------------------------------
    def _kill_all(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def _validate(self, prompt_token_ids: Iterable[int], params: SamplingParams) -> list[int]:
        """The checks a replica's engine makes at once (LLMEngine.make_request), made here as well so that a bad
        request is refused before it is routed; the replica checks again."""
        if isinstance(prompt_token_ids, (str, bytes)):
            raise RequestError("the prompt must be token ids (tokenize text first)")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt):
            raise RequestError("prompt token ids must be integers")
        prompt = [int(t) for t in prompt]
        vocab = self.infos[0].vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must lie in 0..{vocab - 1}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must lie in 0..{vocab - 1}")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(len(prompt), params.max_tokens, self.max_context)
        if params.n > self.infos[0].max_seqs:
            raise RequestError(f"n = {params.n} exceeds max_seqs = {self.infos[0].max_seqs}")
        return prompt

    def _route(self, stream: ClusterStream, exclude: frozenset[int]) -> Route | None:
        route = self.router.choose(list(stream.spec.prompt_token_ids), stream.spec.tenant, stream.spec.cache_salt,
                                   exclude)
        if route is not None:
            self._m_decisions.labels(route.reason).inc()
            self._publish(route.replica)
        return route

    def _finished(self, replica: int, output: RequestOutput | None) -> None:
        self.router.end(replica)
        self._publish(replica)
        if output is not None and output.error is None:
            label = str(replica)
            prompt, cached = len(output.prompt_token_ids), output.num_cached_tokens
            self._m_prompt.labels(label).inc(prompt)
            self._m_cached.labels(label).inc(cached)
            self._m_prefix_all.inc(prompt)
            self._m_prefix_hit.inc(cached)
            served = self._m_prompt.labels(label).value
            self._m_hit_rate.labels(label).set(self._m_cached.labels(label).value / served if served else 0.0)
            total = self._m_prefix_all.value
            self._m_cluster_hit_rate.set(self._m_prefix_hit.value / total if total else 0.0)

    def _failed(self, replica: int, generation: int, exc: BaseException) -> None:
        with self._lock:
            if generation != self.generation[replica] or self.gone[replica]:
                return  # sent before the last restart, or the final death is known: counted already
            if self.router.healthy[replica]:
                self._m_failures.labels(str(replica)).inc()
                if self.restarts[replica] >= self.max_restarts:
                    self.router.mark_down(replica)
                    self._gone_for_good(replica, f"died after its last restart ({self.restarts[replica]} of "
                                                 f"--max-restarts {self.max_restarts})")
                else:
                    logger.warning("replica %d died (%s); routing around it until Ray restarts it (restart %d of "
                                   "%d)", replica, type(exc).__name__, self.restarts[replica] + 1, self.max_restarts)
            self.router.mark_down(replica)
        self._publish(replica)

    def _gone_for_good(self, replica: int, why: str) -> None:
        """Under `self._lock`, the replica marked down: it is never probed or routed to again."""
        self.gone[replica] = True
        self._gone_why[replica] = why
        logger.error("replica %d %s: it is gone for good; %d of %d replicas serve", replica, why,
                     sum(self.router.healthy), len(self.actors))

    def _publish(self, replica: int) -> None:
        label = str(replica)
        self._m_load.labels(label).set(self.router.load[replica])
        self._m_healthy.labels(label).set(1.0 if self.router.healthy[replica] else 0.0)

    def _replica_engine_metrics(self, registry: MetricsRegistry) -> None:
        """Each healthy replica's own engine figures (REPLICA_ENGINE_METRICS, and a streaming replica's bytes read and
        expert cache), read from it at each /metrics scrape, as `replica_engine_<name>{replica}` gauges: they start
        again from zero when Ray restarts the replica."""
        live = [r for r in range(len(self.actors)) if self.router.healthy[r]]
        refs = [self.actors[r].metrics.remote() for r in live]
        for replica, ref in zip(live, refs):
            try:
                values = ray.get(ref, timeout=REPLICA_METRICS_TIMEOUT_SECONDS)
            except (GetTimeoutError, *REPLICA_ERRORS):
                continue  # a dying or busy replica keeps its last values
            for name, value in values.items():
                if name in REPLICA_ENGINE_METRICS or name.startswith(("weights_", "expert_")):
                    registry.family(Gauge, f"replica_engine_{name}", f"replica's {name} (its engine's own figure)",
                                    ("replica",)).labels(str(replica)).set(value)

    def _watch(self) -> None:
        """Probe every replica not gone for good, each interval: a healthy one that fails is marked down (it died
        while idle), one whose pid changed was restarted by Ray, and one marked down that answers is put back."""
        while not self._stopping.wait(MONITOR_INTERVAL_SECONDS):
            self._probe()

    def _probe(self) -> None:
        probes = {r: self.actors[r].info.remote() for r in range(len(self.actors)) if not self.gone[r]}
        for replica, ref in probes.items():
            try:
                info = ray.get(ref, timeout=MONITOR_INTERVAL_SECONDS * 4)
            except GetTimeoutError:
                self._dead_probes[replica] = 0
                continue  # busy, or still restarting
            except REPLICA_ERRORS as exc:
                if not isinstance(exc, ActorDiedError):
                    self._dead_probes[replica] = 0
                if self.router.healthy[replica]:
                    self._failed(replica, self.generation[replica], exc)
                elif isinstance(exc, ActorDiedError):  # a restarting actor is "unavailable"; "died" is final
                    self._dead_probes[replica] += 1
                    if self._dead_probes[replica] >= DEAD_PROBES_FOR_GOOD:
                        with self._lock:
                            if not self.gone[replica]:
                                self._gone_for_good(replica, "is dead and Ray will not restart it (its restarts "
                                                             "used up, or killed for good)")
                        self._publish(replica)
                continue  # still restarting (or out of restarts: it stays out)
            self._dead_probes[replica] = 0
            if info.pid != self.pids[replica] or not self.router.healthy[replica]:
                self._rejoin(replica, info)

    def _rejoin(self, replica: int, info: ReplicaInfo) -> None:
        """The replica answers with a new process (Ray restarted it, with no tenant shares), or again after it was
        marked down: send it the current shares, then put it back (a new process's cache empty). If it fails
        meanwhile it stays out, and the next probe tries again."""
        with self._shares_lock:  # no reload between the shares sent and the replica put back
            try:
                ray.get(self.actors[replica].set_tenant_shares.remote(self.shares),
                        timeout=MONITOR_INTERVAL_SECONDS * 4)
            except (GetTimeoutError, *REPLICA_ERRORS) as exc:
                logger.warning("replica %d answers but did not take the tenant shares (%s); it stays out for now",
                               replica, type(exc).__name__)
                with self._lock:
                    self.router.mark_down(replica)
                self._publish(replica)
                return
            if info.pid != self.pids[replica]:
                self._put_back(replica, info)
                return
            logger.warning("replica %d answers again (pid %d)", replica, info.pid)
            with self._lock:  # the same process: its cache is intact
                self.generation[replica] += 1
                self.router.mark_up(replica, restarted=False)
            self._publish(replica)

    def _put_back(self, replica: int, info: ReplicaInfo) -> None:
        with self._lock:
            if not self.router.healthy[replica]:
                logger.warning("replica %d is back (pid %d, restart %d of %d)", replica, info.pid,
                               self.restarts[replica] + 1, self.max_restarts)
            else:  # it died and came back between two probes, unseen by any request
                self._m_failures.labels(str(replica)).inc()
                logger.warning("replica %d was restarted by Ray (pid %d, restart %d of %d)", replica, info.pid,
                               self.restarts[replica] + 1, self.max_restarts)
            self.restarts[replica] += 1
            self.pids[replica] = info.pid
            self.generation[replica] += 1
            self.router.mark_up(replica, restarted=True)
        self._publish(replica)


class ClusterStream:
    """One request's outputs from its replica, sent again from the start elsewhere if the replica dies before its
    client has seen a token (`streamed=False`: the client sees only the final output, so always)."""

    def __init__(self, backend: ClusterBackend, spec: RequestSpec) -> None:
        self.request_id = uuid.uuid4().hex
        self.backend = backend
        self.spec = spec  # spec.streamed False: the client gets one whole response, so a retry can start over
        self.finished = False
        self.last: RequestOutput | None = None
        self.route: Route | None = None
        self._generator = None
        self._counted = False  # the current route's load is counted in the router
        self._aborted = False
        self._tried: set[int] = set()

    def start(self, exclude: frozenset[int]) -> bool:
        """Send the request to a replica not in `exclude`; False when no healthy replica is left."""
        route = self.backend._route(self, exclude)
        if route is None:
            return False
        self.route, self._counted = route, True
        self._generation = self.backend.generation[route.replica]
        self._tried.add(route.replica)
        actor = self.backend.actors[route.replica]
        self._generator = actor.generate.options(num_returns="streaming").remote(self.spec)
        return True

    def _release(self, output: RequestOutput | None) -> None:
        if self._counted:
            self._counted = False
            self.backend._finished(self.route.replica, output)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while True:
            if self._generator is None:
                yield self._end("no healthy replica is left to serve the request")
                return
            streamed = False
            try:
                async for ref in self._generator:
                    output: RequestOutput = await ref
                    streamed = streamed or any(c.token_ids for c in output.outputs)  # by this replica
                    self.last = output
                    if output.finished:
                        self.backend.failures.record(output.error)
                        self.finished = True
                        self._release(output)
                    yield output
                    if output.finished:
                        return
                yield self._end("the replica ended the request without a final output")  # cancelled
                return
            except REPLICA_ERRORS as exc:
                replica = self.route.replica
                self.backend._failed(replica, self._generation, exc)
                self._release(None)
                if self._aborted:
                    yield self._end("aborted")
                    return
                if streamed and self.spec.streamed:
                    self.backend._m_lost.inc()
                    yield self._end(f"replica {replica} died after streaming tokens; the request cannot continue "
                                    "elsewhere without repeating them")
                    return
                if len(self._tried) >= self.backend.max_attempts or not self.start(frozenset(self._tried)):
                    self._generator = None
                    yield self._end(f"replica {replica} died and no other replica could take the request")
                    return
                self.backend._m_retries.inc()
                if streamed:  # its client has received nothing: what the dead replica generated is dropped
                    self.last = None
                logger.info("request %s sent again, from the start, to replica %d", self.request_id,
                            self.route.replica)
            finally:
                if self._aborted or self.finished:
                    self._release(self.last if self.finished else None)

    def _end(self, message: str) -> RequestOutput:
        """The final error output after the request could not finish."""
        self.finished = True
        self._release(None)
        previous = self.last.outputs if self.last is not None else []
        tokens = {c.index: c.token_ids for c in previous}
        outputs = [CompletionOutput(i, tokens.get(i, []), [], FinishReason.ERROR) for i in range(self.spec.params.n)]
        final = RequestOutput(self.request_id, list(self.spec.prompt_token_ids), outputs, finished=True, error=message)
        self.last = final
        return final

    def abort(self) -> None:
        if self.finished or self._aborted:
            return
        self._aborted = True
        if self._generator is not None:
            try:
                ray.cancel(self._generator)
            except Exception:  # noqa: BLE001 - already finished or its replica is gone: nothing left to cancel
                logger.debug("cancel of %s failed", self.request_id, exc_info=True)
        self._release(None)
