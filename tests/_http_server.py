"""Helpers for tests that start a k3serve server as a subprocess and talk to it over HTTP (not a test module:
tests/serve and tests/cluster import it, pytest puts tests/ on the path for them)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str = "the server") -> None:
    """Until `url`/health answers 200; fails with the process's stderr if it exits first."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{what} did not come up"
        time.sleep(0.2)


def stream_completion(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    """A greedy streamed completion; each data line's payload goes to `events`, a cut connection as 'cut: ...'."""
    body = {"model": "m", "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        events.append(f"cut: {type(exc).__name__}")
    finally:
        started.set()


def refused(url: str) -> bool:
    """Whether the server no longer accepts connections."""
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False
