"""The engine on a background thread, for servers: submit from any thread, consume outputs sync or async.

    runner = EngineRunner(LLMEngine(model, config))
    stream = runner.submit(RequestSpec(tuple(prompt_ids), SamplingParams(max_tokens=64)))   # RequestError if invalid
    async for out in stream:            # or: for out in stream (blocking)
        send(out.outputs[0].new_token_ids)
    ...
    stream.abort()                      # client disconnected
    runner.shutdown()

The engine thread calls `RequestStream.put`; an asyncio consumer is woken with `loop.call_soon_threadsafe`, so the
event loop never blocks on the engine and the engine never waits for a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from k3serve.engine.engine import LLMEngine
from k3serve.engine.request import RequestOutput, RequestSpec, StopHook

if TYPE_CHECKING:
    from k3serve.engine.constraints import OutputConstraint

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request, in order, ending with the one whose `finished` is True."""

    def __init__(self, runner: EngineRunner) -> None:
        self.request_id = ""
        self._runner = runner
        self._items: deque[RequestOutput] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.finished = False
        self.last: RequestOutput | None = None  # the latest output put (its token counts give the usage)

    def put(self, output: RequestOutput) -> None:
        """Engine thread: append an output and wake the consumer."""
        with self._cond:
            self._items.append(output)
            self.last = output
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Blocking: the next output, or None after `timeout` seconds without one."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                return None
            return self._take()

    def _take(self) -> RequestOutput:
        output = self._items.popleft()
        self.finished = self.finished or output.finished
        return output

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self.get()
            assert output is not None
            yield output
            if output.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate_async()

    async def _iterate_async(self) -> AsyncIterator[RequestOutput]:
        event = asyncio.Event()
        with self._cond:
            self._loop, self._event = asyncio.get_running_loop(), event
        while True:
            with self._cond:
                output = self._take() if self._items else None
                if output is None:
                    event.clear()
            if output is None:
                await event.wait()
                continue
            yield output
            if output.finished:
                return

    def abort(self) -> None:
        """Cancel the request (the client went away). A final output with reason 'abort' follows."""
        self._runner.abort(self.request_id)


class EngineRunner:
    """Runs `engine.step()` on a daemon thread while there is work; sleeps when idle."""

    def __init__(self, engine: LLMEngine, idle_timeout: float = 0.5) -> None:
        self.engine = engine
        self._idle_timeout = idle_timeout
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="k3serve-engine", daemon=True)
        self._thread.start()

    def submit(self, spec: RequestSpec, *, request_id: str | None = None, stop_hook: StopHook | None = None,
               constraint: OutputConstraint | None = None) -> RequestStream:
        """Queue the request `spec` describes (`LLMEngine.submit`); raises `RequestError` at once if it is invalid."""
        if self._stopping:
            raise RuntimeError("the engine runner is shut down")
        stream = RequestStream(self)
        stream.request_id = self.engine.submit(spec, request_id=request_id, stop_hook=stop_hook,
                                               on_output=stream.put, constraint=constraint)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self._idle_timeout)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
                if not outputs and not self.engine.scheduler.running:
                    self._wake.wait(0.001)  # queued work that cannot start yet: do not spin
            except Exception as exc:  # noqa: BLE001 - a bug in the engine itself: fail everyone, keep serving
                logger.exception("engine step failed; failing every live request")
                try:
                    self.engine.fail_all(f"engine error: {type(exc).__name__}: {exc}")
                except Exception:  # noqa: BLE001
                    logger.exception("could not fail the live requests")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still live get a final error output."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # a step is still running: touching the engine now would race with it
            logger.warning("the engine thread did not stop within %.1f s; live requests were not failed", timeout)
            return
        self.engine.fail_all("the engine was shut down")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
