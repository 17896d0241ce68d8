"""What the HTTP API serves from: the `ServingBackend` protocol, and `LocalBackend`, one engine in this process.

The API (serve/api.py) knows only this protocol, so one app serves a single engine (`k3serve serve`) or replicas
behind a router (`k3serve cluster`, k3serve.cluster.backend). A backend takes validated requests and returns
`OutputStream`s: async iterables of `RequestOutput`, ending with the one whose `finished` is True.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from k3serve.engine.background import EngineRunner, RequestStream
from k3serve.engine.engine import LLMEngine
from k3serve.engine.fairness import TenantShare
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.constraints import bound_grammar
from k3serve.engine.request import RequestOutput, RequestSpec
from k3serve.serve.health import FailureWindow
from k3serve.serve.text import stop_hook_for
from k3serve.tokenizer import Tokenizer


@runtime_checkable
class OutputStream(Protocol):
    """The outputs of one request. `last` is the latest output received (its token counts give the usage)."""

    finished: bool
    last: RequestOutput | None

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None:
        """Cancel the request (the client went away); a final output with reason 'abort' may follow."""


@runtime_checkable
class ServingBackend(Protocol):
    """Engines behind the API. `max_context`: prompt + generated tokens allowed; `speculative`: the default
    SpeculativeConfig (None: off); `metrics`: the registry /metrics renders."""

    max_context: int
    speculative: object | None
    metrics: MetricsRegistry

    @property
    def alive(self) -> bool:
        """False when requests can no longer be served (/health answers 503)."""

    @property
    def degraded(self) -> str | None:
        """Why requests are served only in part (/health answers 200 with status "degraded" and this reason), or
        None when all is well."""

    def submit(self, spec: RequestSpec) -> OutputStream:
        """Queue the request `spec` describes (engine/request.py: built once by the API, passed down unchanged);
        raises `RequestError` at once if it is invalid. The backend binds the stop strings and the grammar to its own
        tokenizer; a request that is not `streamed` (one whole response at the end) may be started over elsewhere
        when its engine fails midway."""

    def set_tenant_shares(self, shares: dict[str, TenantShare]) -> None: ...

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        """(running sequences, cached positions) a KV share allows (LLMEngine.share_capacity)."""

    def shutdown(self) -> None: ...


class LocalBackend:
    """One `LLMEngine` on its background thread (`EngineRunner`), in this process."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.runner = EngineRunner(engine)
        self._tokenizer = tokenizer
        self.max_context = engine.max_context
        self.speculative = engine.speculative
        self.metrics = engine.metrics
        self.failures = FailureWindow()

    @property
    def alive(self) -> bool:
        return self.runner.alive

    @property
    def degraded(self) -> str | None:
        return self.failures.reason()

    def submit(self, spec: RequestSpec) -> TrackedStream:
        stream = self.runner.submit(spec, stop_hook=stop_hook_for(self._tokenizer, list(spec.stop)),
                                    constraint=bound_grammar(spec.grammar, self._tokenizer))
        return TrackedStream(stream, self.failures)

    def set_tenant_shares(self, shares: dict[str, TenantShare]) -> None:
        self.engine.set_tenant_shares(shares)

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        return self.engine.share_capacity(kv_share)

    def shutdown(self) -> None:
        self.runner.shutdown()


class TrackedStream:
    """A `RequestStream` whose final output is recorded in a `FailureWindow` as its consumer reads it."""

    def __init__(self, stream: RequestStream, failures: FailureWindow) -> None:
        self.stream, self._failures = stream, failures
        self.request_id = stream.request_id

    @property
    def finished(self) -> bool:
        return self.stream.finished

    @property
    def last(self) -> RequestOutput | None:
        return self.stream.last

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        async for output in self.stream:
            if output.finished:
                self._failures.record(output.error)
            yield output

    def abort(self) -> None:
        self.stream.abort()
