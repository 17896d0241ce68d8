"""HTTP errors: every bad body gets a 4xx in OpenAI's shape and the same keep-alive connection then serves a
normal request; 404/405 too; a chat without max_tokens is capped; a non-streaming client that hangs up frees its
sequence within one engine step; /openapi.json declares the real request bodies."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.loading import load_model
from k3serve.serve.api import DEFAULT_CHAT_MAX_TOKENS, create_app
from k3serve.serve.errors import MAX_BODY_BYTES, MAX_JSON_DEPTH

MODEL = "k3-test"


@pytest.fixture(scope="module")
def served(run_server):
    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=512, max_seqs=16, max_batch_tokens=512,
                                                  kv_cache_bytes=32 << 20), stop_ids=loaded.stop_ids)
    app = create_app(engine, loaded.tokenizer, MODEL, default_max_tokens=8)
    with run_server(app) as url:
        yield url, engine


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def _nested(depth: int) -> bytes:
    return b'{"model": "k3-test", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_BODIES = [  # (endpoint, body, status, fragment of the message)
    (COMPLETIONS, b'{"model": "k3-test", "prompt": "abc\\ud800def", "max_tokens": 2}', 400, "surrogate"),
    (COMPLETIONS, b'{"model": "k3-test", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "surrogate"),
    (CHAT, b'{"model": "k3-test", "messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400, "surrogate"),
    (CHAT, b'{"model": "k3-test", "messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}', 400,
     "surrogate"),
    (COMPLETIONS, _nested(MAX_JSON_DEPTH + 5), 400, "nests"),
    (COMPLETIONS, _nested(200_000), 400, "nests"),
    (COMPLETIONS, _body(prompt="x", stream="yes"), 400, "stream"),
    (COMPLETIONS, _body(prompt="x", max_tokens="5"), 400, "max_tokens"),
    (COMPLETIONS, _body(prompt="x", max_tokens=2.5), 400, "max_tokens"),
    (COMPLETIONS, _body(prompt="x", stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, _body(messages=[{"role": "user", "content": None}]), 400, "content"),
    (CHAT, _body(messages=[{"role": "user", "content": "x"}], n=True), 400, "n"),
    (COMPLETIONS, b"\xff\xfe not utf-8", 400, "JSON"),
]


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("endpoint,body,status,fragment", BAD_BODIES,
                         ids=[f"{i}-{b[:40]!r}" for i, (_, b, _, _) in enumerate(BAD_BODIES)])
def test_a_bad_body_is_a_4xx_and_the_same_connection_then_serves(served, endpoint, body, status, fragment):
    url, engine = served
    with httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        bad = http.post(endpoint, content=body, headers={"content-type": "application/json"})
        assert bad.status_code == status, bad.text
        error = bad.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert fragment.lower() in error["message"].lower(), error
        good = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
        assert good.status_code == 200, good.text
        assert _local_port(good) == _local_port(bad), "the connection was dropped after the error"
    engine.check_integrity()


def test_a_body_over_the_cap_is_refused_before_it_is_read(served):
    url, engine = served
    before = engine.metrics.counter("requests_added").value
    big = _body(prompt="x" * (5 << 20))
    with httpx.Client(base_url=url, timeout=60) as http:
        response = http.post(COMPLETIONS, content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        assert str(MAX_BODY_BYTES) in response.json()["error"]["message"]
        assert http.post(COMPLETIONS, json={"model": MODEL, "prompt": "ok", "max_tokens": 1}).status_code == 200
    assert engine.metrics.counter("requests_added").value == before + 1


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("POST", "/nope", 404),
                                                ("GET", COMPLETIONS, 405), ("DELETE", "/v1/models", 405)])
def test_unknown_paths_and_methods_answer_in_openai_shape(served, method, path, status):
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        response = http.request(method, path)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["message"] and error["type"] in ("not_found_error", "invalid_request_error")
        assert "detail" not in response.json()
        assert http.get("/health").status_code == 200


def test_an_assistant_message_may_have_null_content(served):
    url, _ = served
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    response = httpx.post(url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text


def test_chat_without_max_tokens_stops_at_the_default_cap(served):
    url, _ = served
    response = httpx.post(url + CHAT, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"


def test_the_cli_default_cap_is_the_servers():
    from k3serve.cli.main import build_parser

    assert build_parser().parse_args(["serve"]).default_max_tokens == DEFAULT_CHAT_MAX_TOKENS


def test_a_non_streaming_client_that_hangs_up_frees_its_sequence_within_one_step(served):
    url, engine = served
    aborted = engine.metrics.counter("requests_finished_abort")
    steps = engine.metrics.counter("steps")
    generated = engine.metrics.counter("generation_tokens")
    before_aborted, before_generated = aborted.value, generated.value
    steps_at_abort: list[float] = []
    original_abort = engine.abort

    def recording_abort(request_id: str) -> None:
        steps_at_abort.append(steps.value)
        original_abort(request_id)

    engine.abort = recording_abort
    try:
        body = _body(prompt="while True:", max_tokens=400, temperature=0, ignore_eos=True)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 60
            while generated.value < before_generated + 3:  # it is generating: hang up now
                assert time.time() < deadline, "the request never started"
                time.sleep(0.01)
        deadline = time.time() + 30
        while engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests(), "the abandoned request kept running"
        steps_at_free = steps.value
    finally:
        engine.abort = original_abort
    assert aborted.value == before_aborted + 1, "the request must end as aborted"
    assert len(steps_at_abort) >= 1 and steps_at_free - steps_at_abort[0] <= 1, (steps_at_abort, steps_at_free)
    assert generated.value - before_generated < 400
    engine.check_integrity()


def test_openapi_declares_the_request_bodies(served):
    url, _ = served
    schema = httpx.get(url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert "400" in schema["paths"][path]["post"]["responses"]
    assert {"model", "prompt", "max_tokens", "stream"} <= set(components["CompletionRequest"]["properties"])
    assert set(components["CompletionRequest"]["required"]) == {"model", "prompt"}
    assert "ChatMessage" in components and "StreamOptions" in components
