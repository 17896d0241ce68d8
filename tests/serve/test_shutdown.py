"""Graceful shutdown of `k3serve serve`: SIGTERM stops admission, drains in-flight requests, exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from _http_server import free_port, refused, stream_completion, wait_healthy


def _start(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "serve", "--port", str(port), "--no-lab",
                             "--served-model-name", "m", *extra], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120)
    return proc, url


@pytest.mark.parametrize("timeout, max_tokens, drained", [(60, 300, True), (1, 4000, False)])
def test_sigterm_drains_in_flight_requests_then_exits_0(timeout, max_tokens, drained):
    proc, url = _start("--shutdown-timeout", str(timeout), "--max-model-len", "4096")
    try:
        events: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=stream_completion, args=(url, max_tokens, events, started))
        client.start()
        assert started.wait(60) and events, "no first chunk"
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        deadline = time.time() + 30
        while not refused(url):  # admission stops: the listener is closed while the stream still runs
            assert time.time() < deadline, "the server still accepts connections after SIGTERM"
            time.sleep(0.1)
        client.join(120)
        assert proc.wait(90) == 0, proc.stderr.read()
        if drained:
            assert events[-1] == "[DONE]", events[-3:]
            usage = json.loads(events[-2])["usage"]
            assert usage["completion_tokens"] == max_tokens  # the whole request was served after SIGTERM
            assert "shut down" in proc.stderr.read()
        else:
            assert "[DONE]" not in events  # cut at the timeout, and the process still exits 0, promptly
            assert time.time() - sent < timeout + 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
