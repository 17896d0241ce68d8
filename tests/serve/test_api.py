"""The HTTP server end to end, with the official openai client, on the embedded model over loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from _http_server import free_port
from openai import BadRequestError, NotFoundError, OpenAI

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.loading import load_model
from k3serve.serve.api import create_app

MODEL = "k3-test"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server():
    loaded = load_model(None)
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_seqs=256, max_batch_tokens=1024,
                          kv_cache_bytes=64 << 20)
    engine = LLMEngine(loaded.model, config, stop_ids=loaded.stop_ids)
    app = create_app(engine, loaded.tokenizer, MODEL)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine, loaded.tokenizer
    uv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="test-key", max_retries=0, timeout=60)


def test_models_health_and_metrics(server, client):
    url, _, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="import os", max_tokens=3, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("k3serve_http_requests_total", "k3serve_prefix_cache_hit_tokens_total"):
        assert name in text
    assert "k3serve_ttft_seconds_bucket{le=" in text and "k3serve_ttft_seconds_count" in text
    assert "kv_blocks" in text


def test_completion_streamed_equals_not_streamed(client):
    kwargs = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0, ignore_eos=True)
    whole = client.completions.create(**{k: v for k, v in kwargs.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].finish_reason == "length"
    chunks = client.completions.create(**{k: v for k, v in kwargs.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True}, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and streamed


def test_chat_streamed_and_usage(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        elif chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # the extension fields (engine/io_usage.py), streamed or not; a resident model reads nothing
    for one in (whole.usage, usage):
        assert {k: one.model_extra[k] for k in ("bytes_read", "expert_misses", "io_wait_ms")} == \
            {"bytes_read": 0, "expert_misses": 0, "io_wait_ms": 0.0}


def test_seeded_sampling_and_n(client):
    args = dict(model=MODEL, prompt="class Foo:", max_tokens=8, temperature=0.8, seed=42, n=2)
    first = client.completions.create(**args)
    second = client.completions.create(**args)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert sorted(c.index for c in first.choices) == [0, 1]


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt="for i in", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    cut = client.completions.create(model=MODEL, prompt="for i in", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == base[:base.find(stop)]
    assert cut.finish_reason == "stop"


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "bogus": 1}).encode(), 400, "unknown field"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -5}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}).encode(), 400, "context"),
    (json.dumps({"model": MODEL, "prompt": list(range(MAX_MODEL_LEN + 5)), "max_tokens": 1}).encode(), 400,
     "context"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (b'{"model": "k3-test", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "stop": ["a"] * 40}).encode(), 400, "stop"),
    (json.dumps({"model": MODEL, "prompt": [5, 99999]}).encode(), 400, "token"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, fragment):
    url, _, _ = server
    endpoint = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = httpx.post(url + endpoint, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment.lower() in error["message"].lower()
    assert error["type"] in ("invalid_request_error", "not_found_error") or status == 404
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_one_model_by_id_and_an_unknown_id_is_a_404_in_openai_shape(server, client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "k3serve"
    with pytest.raises(NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and "no-such-model" in info.value.body["message"]
    response = httpx.get(server[0] + "/v1/models/org/no-such-model")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_no_op_openai_fields_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt="x = ", max_tokens=2, temperature=0, best_of=1,
                                    suffix=None, logit_bias={})
    assert out.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logit_bias={})
    assert chat.usage.completion_tokens >= 1


@pytest.mark.parametrize("endpoint, fields, fragment", [
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "return x"}, "suffix"),
    ("completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("chat", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18 C"}]},
     "tool_call_id"),
])
def test_unsupported_openai_values_are_a_clear_400(server, endpoint, fields, fragment):
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(fields)
    response = httpx.post(server[0] + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions"),
                          json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=2)
    with pytest.raises(BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, top_p=0)


def test_200_concurrent_streaming_clients_each_get_their_own_answer(server):
    url, engine, tokenizer = server
    prompts = [f"value_{i} = " for i in range(50)]
    expected = {}
    for prompt in prompts:  # the answer each prompt gets when it runs alone
        response = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        expected[prompt] = response.json()["choices"][0]["text"]

    async def one_client(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, done = "", False
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert done, "every stream ends with [DONE]"
        return text

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one_client(http, prompts[i % 50]) for i in range(200)))

    results = asyncio.run(run_all())
    mismatched = [i for i, text in enumerate(results) if text != expected[prompts[i % 50]]]
    assert not mismatched, f"{len(mismatched)} of 200 clients got another answer, e.g. client {mismatched[0]}"
    engine.check_integrity()


def test_a_client_that_disconnects_mid_stream_cancels_its_request(server):
    url, engine, _ = server
    aborted = engine.metrics.counter("requests_finished_abort")
    before = aborted.value
    body = {"model": MODEL, "prompt": "while True:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    deadline = time.time() + 20
    while engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests(), "the abandoned request kept running"
    assert aborted.value == before + 1, "the request must end as aborted, not run to max_tokens"
    engine.check_integrity()
