"""logprobs, response_format, tools / tool_choice and /tokenize, /detokenize with the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.request import CompletionOutput, FinishReason, RequestOutput
from k3serve.errors import RequestError
from k3serve.loading import load_model
from k3serve.serve.api import create_app
from k3serve.serve.structured import OutputPlan, parse_tool_calls, plan_output

MODEL = "k3-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "units": {"enum": ["metric", "imperial"]}},
                   "required": ["city", "units"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(run_server):
    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=512, max_seqs=16, kv_cache_bytes=16 << 20),
                       stop_ids=loaded.stop_ids)
    with run_server(create_app(engine, loaded.tokenizer, MODEL)) as url:
        yield url, engine, loaded.tokenizer


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="k", max_retries=0, timeout=120)


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs is not None for e in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    reply = client.completions.create(**kwargs)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(len(top) <= 2 and max(top.values()) >= lp for top, lp in zip(logprobs.top_logprobs,
                                                                             logprobs.token_logprobs))
    streamed = [t for chunk in client.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs is not None for t in choice.logprobs.tokens]
    assert streamed == logprobs.tokens


def test_response_format_json_object_and_json_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":  # an open-ended object may run past max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")
    schema = WEATHER["function"]["parameters"]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.8, seed=3,
                      response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        else:
            reply = client.chat.completions.create(**kwargs)
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        value = json.loads(text)
        assert reason == "stop" and value["city"] in ("Paris", "Oslo") and value["units"] in ("metric", "imperial")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_parsed_by_the_client(client, choice):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                           tool_choice=choice, parallel_tool_calls=False, max_tokens=80,
                                           temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and isinstance(arguments["utc"], bool)
    else:
        assert call.function.name in ("get_weather", "get_time") and arguments
    # the history round-trips through the template (streaming: test_a_streamed_forced_tool_call_*)
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}])
    assert follow.choices[0].message.role == "assistant"


def test_parallel_required_calls_and_auto_parsing():
    plan = plan_output(None, [WEATHER, CLOCK], "required", True)
    assert plan.schema["type"] == "array" and plan.forced_tools
    calls = parse_tool_calls('[{"name":"get_time","arguments":{"utc":true}},'
                             '{"name":"get_weather","arguments":{"city":"Oslo","units":"metric"}}]', plan)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "units": "metric"}
    auto = plan_output(None, [WEATHER], None, True)
    assert auto.parse_tools and auto.schema is None and "get_weather" in auto.tool_prompt
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}</tool_call>'
    assert parse_tool_calls(text, auto)[0]["function"]["name"] == "get_weather"
    assert parse_tool_calls("It is sunny. " + text, auto) is None  # prose around a call stays content
    assert parse_tool_calls("no call here", auto) is None
    assert parse_tool_calls(text, OutputPlan()) is None


def test_structured_output_errors_are_400s(client):
    with pytest.raises(BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    with pytest.raises(BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(BadRequestError, match="schema"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    with pytest.raises(BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="required")
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices


def test_a_json_schema_format_without_its_schema_is_a_400_naming_the_field(server):
    url = server[0]
    for json_schema in ({"name": "x"}, {"name": "x", "schema": None}):
        response = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": json_schema}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "response_format.json_schema.schema is missing" in error["message"]
        assert error["param"] == "response_format.json_schema" and error["type"] == "invalid_request_error"
    with pytest.raises(RequestError, match="json_schema.schema is missing"):
        plan_output({"type": "json_schema", "json_schema": {"name": "x"}}, None, None, True)


def test_tokenize_and_detokenize_as_vllm(server):
    url, engine, tokenizer = server
    body = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "def f(x):", "return_token_strs": True})
    assert body.status_code == 200, body.text
    data = body.json()
    assert data["tokens"] == [tokenizer.bos_id] + tokenizer.encode("def f(x):")
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == engine.max_context
    assert "".join(data["token_strs"][1:]) == "def f(x):"
    plain = httpx.post(url + "/tokenize", json={"prompt": "def f(x):", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode("def f(x):") and plain["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "def f(x):"}
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    bare = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and chat["count"] > bare["count"]
    for path, bad in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": MESSAGES}),
                      ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": "x"}),
                      ("/tokenize", {"model": "other", "prompt": "a"})):
        response = httpx.post(url + path, json=bad)
        assert response.status_code in (400, 404) and "error" in response.json(), (path, bad, response.text)


def _accumulate(chunks) -> tuple[list[dict], str | None, str | None, int]:
    """A client's view of a streamed reply: (tool calls by index, content, last finish_reason, number of chunks
    that carried arguments), with each call's first delta checked against OpenAI's shape."""
    calls: dict[int, dict] = {}
    content, reason, argument_chunks = None, None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in calls:  # the first delta of a call names it, with empty arguments
                    assert call.id.startswith("call_") and call.type == "function" and call.function.name
                    assert call.function.arguments == ""
                    calls[call.index] = {"id": call.id, "type": call.type, "name": call.function.name,
                                         "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
                    argument_chunks += 1
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], content, reason, argument_chunks


def _as_plain(calls) -> list[dict]:
    return [{"type": c.type, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


@pytest.mark.parametrize("parallel", [False, True])
def test_a_streamed_forced_tool_call_arrives_in_pieces_equal_to_the_whole_reply(client, parallel):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, max_tokens=140,
                  tool_choice="required" if parallel else {"type": "function", "function": {"name": "get_weather"}},
                  parallel_tool_calls=parallel)
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls, content, reason, argument_chunks = _accumulate(chunks)
    assert [{k: c[k] for k in ("type", "name", "arguments")} for c in calls] \
        == _as_plain(reply.choices[0].message.tool_calls)
    assert content is None and reason == "tool_calls"
    assert argument_chunks > 1  # the arguments arrive as they are generated, not as one piece at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


class _ScriptedStream:
    """A request's outputs that generate `ids` one token a step."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.finished, self.last = ids, False, None

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for count in range(1, len(self.ids) + 1):
            await asyncio.sleep(0)
            done = count == len(self.ids)
            self.last = RequestOutput("scripted", [1, 2, 3], [CompletionOutput(
                0, self.ids[:count], self.ids[count - 1:count], FinishReason.STOP if done else None)], done)
            self.finished = done
            yield self.last

    def abort(self) -> None:
        self.finished = True


class _ScriptedBackend:
    """A ServingBackend whose every request generates the text of `self.reply` (a model that calls tools)."""

    max_context, speculative = 4096, None

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.metrics, self.reply = tokenizer, MetricsRegistry(), ""
        self.alive, self.degraded = True, None

    def submit(self, spec) -> _ScriptedStream:
        return _ScriptedStream(self.tokenizer.encode(self.reply))

    def set_tenant_shares(self, shares) -> None:
        pass

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        return 1 << 20, 1 << 20

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def scripted(server, run_server):
    backend = _ScriptedBackend(server[2])
    with run_server(create_app(backend, server[2], MODEL)) as url:
        yield backend, OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}</tool_call>'


@pytest.mark.parametrize("reply", [CALL, "\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n"])
def test_a_streamed_auto_tool_call_arrives_in_pieces_equal_to_the_whole_reply(scripted, reply):
    backend, client = scripted
    backend.reply = reply
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=300)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls, content, reason, argument_chunks = _accumulate(chunks)
    assert [{k: c[k] for k in ("type", "name", "arguments")} for c in calls] \
        == _as_plain(whole.choices[0].message.tool_calls)
    assert len(calls) == reply.count("<tool_call>") and content is None and reason == "tool_calls"
    assert argument_chunks > len(calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("reply", ["It is sunny. " + CALL, CALL + " Shall I look again?", CALL[:-3],
                                   '<tool_call>{"name": "get_weather"}</tool_call>', "Just prose, no call."])
def test_a_streamed_auto_reply_that_is_no_call_streams_as_the_whole_reply_content(scripted, reply):
    backend, client = scripted
    backend.reply = reply
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=300)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == reply and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    _, content, reason, _ = _accumulate(chunks)
    assert content == reply and reason == "stop"
    if not reply.startswith("<tool_call>"):  # prose streams as it is generated, not held to the end
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
