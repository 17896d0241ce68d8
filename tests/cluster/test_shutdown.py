"""Graceful shutdown of `k3serve cluster`: SIGTERM stops admission, lets the replica finish the in-flight stream,
stops the replicas and the local Ray, exits 0 (the same drain as `k3serve serve`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

from _http_server import free_port, refused, stream_completion, wait_healthy


def _front_streaming(max_tokens: int, *flags: str) -> tuple[subprocess.Popen, str, threading.Thread, list[str]]:
    """A one-replica cluster front, healthy, with one completion of `max_tokens` streaming from it (first chunk in)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "cluster", "--replicas", "1", "--num-cpus", "1",
                             "--port", str(port), "--served-model-name", "m", *flags],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180, "the cluster front")
        events: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=stream_completion, args=(url, max_tokens, events, started))
        client.start()
        assert started.wait(60) and events, "no first chunk"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url, client, events


def test_sigterm_drains_the_cluster_front_then_exits_0():
    proc, url, client, events = _front_streaming(200, "--shutdown-timeout", "60")
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while not refused(url):
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


def test_the_cluster_front_cuts_a_stream_at_the_shutdown_timeout_like_serve():
    """Parity with `serve` (tests/serve/test_shutdown.py): a stream still open when --shutdown-timeout runs out
    ends with finish_reason "abort" and an SSE error event, one log line, no traceback, exit 0."""
    proc, _, client, events = _front_streaming(4000, "--shutdown-timeout", "1", "--max-model-len", "4096")
    try:
        proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert proc.wait(90) == 0, proc.stderr.read()
        assert "[DONE]" not in events and not any(e.startswith("cut:") for e in events), events[-3:]
        assert [c["finish_reason"] for c in json.loads(events[-2])["choices"]] == ["abort"]
        error = json.loads(events[-1])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        err = proc.stderr.read()
        assert "Traceback" not in err and "cut 1 stream(s)" in err and err.count("cut stream cmpl-") == 1, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
