"""An ASGI app served by uvicorn on a background thread at a free loopback port (tests, benchmarks, the lab)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve_in_thread(app, *, lifespan: str = "auto", start_timeout: float = 30.0,
                    stop_timeout: float = 30.0) -> Iterator[str]:
    """Yield the base URL (`http://127.0.0.1:PORT`) while `app` serves; stop it on exit.

    Raises `TimeoutError` if uvicorn has not started within `start_timeout` seconds."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start on 127.0.0.1:{port} within {start_timeout:.0f} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
