"""Graceful shutdown: the uvicorn server whose drain, when `--shutdown-timeout` runs out, ends every request still
open with an error instead of cancelling its task.

On SIGTERM uvicorn closes the listener and waits for in-flight requests. When `drain_seconds` pass with requests
still open, `on_timeout` (the app's `ServerState.cut_open_requests`) ends each one: a stream gets an SSE error event
and a chunk with finish_reason "abort" for every choice left open, then `[DONE]`; a whole (non-streamed) response
gets a 503 in OpenAI's error shape; the server logs one line per cut request. uvicorn's own cancel, which
killed each stream's task with one traceback apiece and no word to the client, stays only as a backstop
`CUT_GRACE_SECONDS` later.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

import uvicorn

logger = logging.getLogger(__name__)

CUT_GRACE_SECONDS = 10.0  # after the cut, how long uvicorn still waits before cancelling what is left


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` that calls `on_timeout()` (which ends the open requests and returns how many) once
    `drain_seconds` of its graceful shutdown have passed. `num_cut` is that number afterwards (0: drained)."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float, on_timeout: Callable[[], int]) -> None:
        config.timeout_graceful_shutdown = int(drain_seconds + CUT_GRACE_SECONDS)
        super().__init__(config)
        self.drain_seconds, self.on_timeout = drain_seconds, on_timeout
        self.num_cut = 0

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_seconds, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut(self) -> None:
        self.num_cut = self.on_timeout()
        if self.num_cut:
            logger.warning("shutdown timeout (%g s) reached: cut %d open request(s)", self.drain_seconds,
                           self.num_cut)
