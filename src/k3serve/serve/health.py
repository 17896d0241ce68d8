"""What /health says beyond "the engine runs": failures that are the server's fault, not one request's.

A request fails alone for reasons of its own (a grammar it broke, an engine error on its sequence), and the server
stays healthy. A corrupt expert store is different: every request whose tokens route to the bad blob fails its
CRC twice (`StoreCorruptError`), and it will keep failing until the store is repacked. `FailureWindow` keeps the
outcome of the last `window` finished requests; while any of them failed for a server-wide cause, `reason()`
says so and /health answers `{"status": "degraded", "reason": ...}` (serve/api.py). The window is counted in
requests, not seconds: once `window` requests in a row have finished without such a failure, health is ok again.
"""

from __future__ import annotations

import threading
from collections import deque

DEFAULT_WINDOW = 40

# error-message prefixes (the engine writes "TypeName: message") that a whole server, not one request, suffers,
# and what /health says about each
SERVER_FAULTS = {
    "StoreCorruptError": "the expert store is corrupt",
    "StoreIOError": "the expert store cannot be read",
}


def server_fault(error: str | None) -> str | None:
    """The SERVER_FAULTS key an output's error message starts with, or None (no error, or one request's own)."""
    if error is None:
        return None
    for name in SERVER_FAULTS:
        if error.startswith(name + ":") or f" {name}: " in error:
            return name
    return None


class FailureWindow:
    """The last `window` finished requests' server-wide faults (thread-safe: the engine thread, the event loop
    and Ray's callbacks all record)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._lock = threading.Lock()
        self._outcomes: deque[str | None] = deque(maxlen=window)
        self._last_message: dict[str, str] = {}

    def record(self, error: str | None) -> None:
        """One finished request: `error` is its output's error message (None: it succeeded)."""
        fault = server_fault(error)
        with self._lock:
            self._outcomes.append(fault)
            if fault is not None:
                self._last_message[fault] = error

    def reason(self) -> str | None:
        """Why the server is degraded (None: it is not), naming the cause, its count and its latest message."""
        with self._lock:
            counts: dict[str, int] = {}
            for fault in self._outcomes:
                if fault is not None:
                    counts[fault] = counts.get(fault, 0) + 1
            if not counts:
                return None
            total = len(self._outcomes)
            return "; ".join(f"{n} of the last {total} requests failed because {SERVER_FAULTS[fault]} "
                             f"({self._last_message[fault]})" for fault, n in counts.items())
