"""Graceful shutdown of `k3serve serve`: SIGTERM stops admission, drains in-flight requests, exits 0; a stream still
open when --shutdown-timeout runs out ends with its finish reason and an error event, and one log line."""

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
        else:  # cut at the timeout with an error event and a finish reason; the process still exits 0, promptly
            assert "[DONE]" not in events and not any(e.startswith("cut:") for e in events), events[-3:]
            finish = json.loads(events[-2])
            assert [c["finish_reason"] for c in finish["choices"]] == ["abort"]
            error = json.loads(events[-1])["error"]
            assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
            assert set(error) == {"message", "type", "param", "code"}
            assert time.time() - sent < timeout + 30
            err = proc.stderr.read()
            assert "Traceback" not in err and "cut 1 stream(s)" in err and "drained" not in err
            assert err.count("cut stream cmpl-") == 1  # one line per cut stream
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_drain_timeout_cuts_streams_and_whole_responses_in_openai_shape(caplog):
    """In process: a streamed chat completion gets its finish reason and an error event, a whole completion a 503,
    each with one log line and no traceback, once the drain time (1 s) runs out."""
    import httpx
    import uvicorn

    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.loading import load_model
    from k3serve.serve.api import create_app
    from k3serve.serve.shutdown import DrainingServer

    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=4096), stop_ids=loaded.stop_ids)
    app = create_app(engine, loaded.tokenizer, "m")
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), 1,
                            app.state.k3.cut_open_requests)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline
        time.sleep(0.05)
    body = {"model": "m", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    whole: list[httpx.Response] = []
    events: list[str] = []
    started = threading.Event()

    def stream_chat() -> None:
        chat = dict(body, messages=[{"role": "user", "content": "hi"}], stream=True, n=2)
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    clients = [threading.Thread(target=stream_chat),
               threading.Thread(target=lambda: whole.append(
                   httpx.post(url + "/v1/completions", json=dict(body, prompt="def f(x):"), timeout=120)))]
    with caplog.at_level("WARNING"):
        for client in clients:
            client.start()
        assert started.wait(60)
        time.sleep(0.5)  # the whole completion is under way too
        server.should_exit = True  # what SIGTERM does
        for client in clients:
            client.join(60)
        thread.join(60)
    assert server.num_cut == 2
    finish = json.loads(events[-2])
    assert sorted((c["index"], c["finish_reason"]) for c in finish["choices"]) == [(0, "abort"), (1, "abort")]
    assert json.loads(events[-1])["error"]["code"] == "server_shutting_down" and "[DONE]" not in events
    assert whole[0].status_code == 503
    assert whole[0].json()["error"]["code"] == "server_shutting_down"
    lines = [r for r in caplog.records if "cut" in r.getMessage()]
    assert len([r for r in lines if r.name == "k3serve.serve.api"]) == 2
    assert not any(r.exc_info for r in caplog.records)
