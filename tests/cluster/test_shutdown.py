"""Graceful shutdown of `k3serve cluster`: SIGTERM stops admission, lets the replica finish the in-flight stream,
stops the replicas and the local Ray, exits 0 (the same drain as `k3serve serve`)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
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


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_sigterm_drains_the_cluster_front_then_exits_0():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "cluster", "--replicas", "1", "--num-cpus", "1",
                             "--port", str(port), "--served-model-name", "m", "--shutdown-timeout", "60"],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the cluster front did not come up"
            time.sleep(0.3)
        events: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=_stream, args=(url, 200, events, started))
        client.start()
        assert started.wait(60) and events, "no first chunk"
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while not _refused(url):
            assert time.time() < deadline, "the front still accepts connections after SIGTERM"
            time.sleep(0.1)
        client.join(120)
        assert proc.wait(90) == 0, proc.stderr.read()
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 200
        assert "shut down" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
