"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streamed or not), /v1/models (and
/v1/models/{id}), /health and /metrics, over one `ServingBackend` (serve/backend.py): one engine in this process,
or replicas on Ray behind a router (k3serve.cluster).

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with the status mapped in one place
(`serve/errors.py`): bad input 400, unknown model or path 404, wrong method 405, a body over the size cap 413,
engine failure of one request 500. /health is 503 when the engine stopped, and 200 with `{"status": "degraded",
"reason"}` while recent requests fail for a server-wide cause such as a corrupt store (serve/health.py). A bad
request never reaches the engine, a failing request never disturbs the others, and a client that goes away
(streaming or not) cancels its request at the next engine step.

Tenancy (serve/tenants.py): with a tenants file, the bearer token must be one of a tenant's keys (else 401), and
each request is checked against its tenant's caps (400 naming the cap) and quotas (429 with Retry-After and the
x-ratelimit-* headers) before it reaches the engine, and /metrics needs the key of a tenant with `admin = true`
(401 without a key, 403 for another tenant's). Without one, every client is the tenant "anonymous" (one
metric label, one scheduling counter, however many keys clients invent). Prefix-cache entries are salted by tenant,
by the bearer token's hash in open mode, and by the request's `cache_salt`, so no two keys share cached state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from k3serve.engine.constraints import Grammar
from k3serve.engine.engine import LLMEngine
from k3serve.engine.metrics import Counter
from k3serve.engine.request import FinishReason, RequestOutput, RequestSpec
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ContextLengthError, RequestError
from k3serve.serve.backend import LocalBackend, OutputStream, ServingBackend
from k3serve.serve.chat import apply_chat_template
from k3serve.serve.errors import MAX_BODY_BYTES, APIError, install_error_handlers, read_json_body
from k3serve.serve.metrics import render_metrics
from k3serve.serve.openapi import declare_request_bodies
from k3serve.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from k3serve.serve.structured import (OutputPlan, chat_logprobs, completion_logprobs, parse_tool_calls,
                                      plan_output)
from k3serve.serve.tenants import (AuthenticationError, CapExceeded, Lease, QuotaExceeded, TenantRegistry,
                                   estimate_tokens)
from k3serve.serve.text import TextTracker
from k3serve.serve.tool_stream import ToolCallStreamer
from k3serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat without max_tokens: a cap, not the rest of the context (vLLM and
# OpenAI run to the context's end; llama.cpp's server and Ollama cap by default); `serve --default-max-tokens`


@dataclass
class _Prompt:
    ids: list[int]


class ServerState:
    def __init__(self, backend: ServingBackend, tokenizer: Tokenizer, model_name: str,
                 default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, max_body_bytes: int = MAX_BODY_BYTES,
                 tenants: TenantRegistry | None = None) -> None:
        self.backend = backend
        self.tenants = tenants if tenants is not None else TenantRegistry()
        backend.set_tenant_shares(self.tenants.shares())
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        metrics = backend.metrics
        self.requests_total = metrics.counter("http_requests_total", "HTTP requests received")
        self.request_errors = metrics.counter("http_request_errors_total", "HTTP requests answered with 4xx/5xx")
        self.rejections = metrics.family(Counter, "tenant_rejections", "requests refused, per tenant and reason",
                                         ("tenant", "reason"))
        self.open_requests: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()  # one cut event per open request

    def cut_open_requests(self) -> int:
        """End every open request now (the shutdown's drain time ran out; serve/shutdown.py): a stream gets an
        SSE error event and its finish reasons, a whole response a 503. On the event loop. Returns how many."""
        cuts = list(self.open_requests)
        for cut in cuts:
            cut.set()
        return len(cuts)


def create_app(engine: LLMEngine | ServingBackend, tokenizer: Tokenizer, model_name: str,
               default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, max_body_bytes: int = MAX_BODY_BYTES,
               tenants: TenantRegistry | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine, run on a thread that starts now, or any `ServingBackend`),
    stopped with the app. A chat request without max_tokens generates at most `default_max_tokens`; a body over
    `max_body_bytes` is refused unread. `tenants`: API keys, caps and quotas (None: open, as without a tenants
    file)."""
    backend = LocalBackend(engine, tokenizer) if isinstance(engine, LLMEngine) else engine
    state = ServerState(backend, tokenizer, model_name, default_max_tokens, max_body_bytes, tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.backend.shutdown()

    # no /docs or /redoc: their pages load scripts from a CDN; /openapi.json stays
    app = FastAPI(title="k3serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.k3 = state

    install_error_handlers(app, on_error=state.request_errors.inc)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.backend.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        reason = state.backend.degraded
        if reason is not None:  # 200: what can be served still is; the reason says what fails (serve/health.py)
            return JSONResponse({"status": "degraded", "reason": reason})
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "k3serve",
                "max_model_len": state.backend.max_context}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authenticate(request, state)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        _authenticate(request, state)
        if model_id != state.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server has '{state.model_name}'",
                           param="model", code="model_not_found")
        return JSONResponse(model_card())

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        # with tenants, /metrics names every tenant and its traffic: an admin tenant's key only
        tenant = _authenticate(request, state)
        if not state.tenants.may_read_metrics(tenant):
            state.rejections.labels(tenant, "not_admin").inc()
            raise APIError(403, f"tenant '{tenant}' may not read /metrics; it needs admin = true in the tenants file",
                           code="permission_denied")
        # in a worker thread: a refresher may wait on other processes (expert owners' counters)
        body, content_type = await asyncio.to_thread(render_metrics, state.backend.metrics)
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, state)
        prompts = _completion_prompts(body.prompt, state.tokenizer)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        return await _serve(request, state, body, prompts, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest, state)
        plan, grammar = _chat_output(state, body)
        try:
            messages = ([("system", plan.tool_prompt)] if plan.tool_prompt else []) \
                + [(m.role, m.text()) for m in body.messages]
            ids = apply_chat_template(state.tokenizer, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except RequestError as exc:
            raise APIError(400, str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # a default cap, never more than the context leaves
            max_tokens = max(min(state.default_max_tokens, state.backend.max_context - len(ids)), 1)
        return await _serve(request, state, body, [_Prompt(ids)], max_tokens, chat=True, plan=plan,
                            grammar=grammar)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template, to token ids."""
        body = await _parse(request, TokenizeRequest, state, model_optional=True)
        try:
            if body.messages is not None:
                ids = apply_chat_template(state.tokenizer, [(m.role, m.text()) for m in body.messages])
                if not body.add_generation_prompt:  # drop the assistant header: <|im_assistant|>assistant<|im_middle|>
                    ids = ids[:len(ids) - len(state.tokenizer.encode("assistant")) - 2]
            else:
                ids = state.tokenizer.encode(body.prompt)
                if body.add_special_tokens and state.tokenizer.bos_id is not None:
                    ids = [state.tokenizer.bos_id] + ids
        except (RequestError, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        strs = [state.tokenizer.id_to_bytes(t).decode("utf-8", errors="replace") for t in ids] \
            if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": state.backend.max_context, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's /detokenize: token ids to text."""
        body = await _parse(request, DetokenizeRequest, state, model_optional=True)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range 0..{vocab - 1}", param="tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    declare_request_bodies(app, {"/v1/completions": CompletionRequest,
                                 "/v1/chat/completions": ChatCompletionRequest,
                                 "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    return app


async def _parse(request: Request, model: type, state: ServerState, model_optional: bool = False):
    state.requests_total.inc()
    _authenticate(request, state)  # before the body: a client without a valid key learns nothing more
    data = await read_json_body(request, state.max_body_bytes)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ()))
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = f"unknown field '{param}'"
        raise APIError(400, f"{message} ({param})" if param else message, param=param or None) from None
    if body.model != state.model_name and not (model_optional and body.model is None):
        raise APIError(404, f"the model '{body.model}' does not exist; this server has '{state.model_name}'",
                       param="model", code="model_not_found")
    return body


def _completion_prompts(prompt: Any, tokenizer: Tokenizer) -> list[_Prompt]:
    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids

    if isinstance(prompt, str):
        return [_Prompt(encode(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [_Prompt(encode(p)) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [_Prompt(list(prompt))]
    return [_Prompt(list(p)) for p in prompt]


def _authenticate(request: Request, state: ServerState) -> str:
    """The request's tenant (kept in `request.state.tenant`), or a 401."""
    try:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
    except AuthenticationError as exc:
        state.rejections.labels("unknown", "unauthenticated").inc()
        raise APIError(401, str(exc), code="invalid_api_key") from None
    request.state.tenant = tenant
    request.state.cache_scope = state.tenants.cache_scope(request.headers.get("authorization"))
    return tenant


def _cache_salt(scope: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt the engine gets: the request's `cache_salt`, and in open mode the key's scope with it
    (always as a JSON pair there, so no client-chosen salt can equal another key's)."""
    return salt if scope is None else json.dumps([scope, salt])


def _admit_tenant(state: ServerState, tenant: str, body, prompts: list[_Prompt], max_tokens: int,
                  chat: bool) -> tuple[Lease, int]:
    """Check the tenant's caps (400 naming the cap) and charge its quotas (429); returns the lease to release when
    the request ends and max_tokens (a chat default shortened to the tenant's max_context)."""
    config = state.tenants.tenant(tenant)
    lengths = [len(p.ids) for p in prompts]
    if chat and config is not None and config.max_context is not None \
            and body.max_completion_tokens is None and body.max_tokens is None:
        max_tokens = max(1, min(max_tokens, config.max_context - max(lengths)))
    _check_context(state, prompts, max_tokens)  # a request refused as too long is never charged
    try:
        state.tenants.check_caps(tenant, lengths, max_tokens, body.n, state.backend.share_capacity)
        lease = state.tenants.admit(tenant, estimate_tokens(lengths, max_tokens, body.n))
    except CapExceeded as exc:
        state.rejections.labels(tenant, exc.cap).inc()
        raise APIError(400, str(exc), param=exc.cap, code="tenant_cap_exceeded") from None
    except QuotaExceeded as exc:
        state.rejections.labels(tenant, exc.reason).inc()
        raise APIError(429, str(exc), param=exc.reason, code="rate_limit_exceeded", headers=exc.headers) from None
    return lease, max_tokens


def _check_context(state: ServerState, prompts: list[_Prompt], max_tokens: int) -> None:
    """A 400 for a prompt that cannot fit the context with max_tokens after it."""
    for prompt in prompts:
        if len(prompt.ids) + max_tokens > state.backend.max_context:
            raise APIError(400, str(ContextLengthError(len(prompt.ids), max_tokens, state.backend.max_context)),
                           param="max_tokens", code="context_length_exceeded")


def _tokens_used(streams: list[OutputStream]) -> int:
    """Prompt plus generated tokens of the outputs seen so far (what a finished request is charged)."""
    total = 0
    for stream in streams:
        if stream.last is not None:
            total += len(stream.last.prompt_token_ids) + sum(len(c.token_ids) for c in stream.last.outputs)
    return total


async def _release_after(events: AsyncIterator[str], lease: Lease, streams: list[OutputStream]
                         ) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        lease.finish(_tokens_used(streams))


def _chat_output(state: ServerState, body) -> tuple[OutputPlan, Grammar | None]:
    """A chat request's output plan (response_format, tools) and the grammar that enforces it, if any."""
    try:
        plan = plan_output(None if body.response_format is None else
                           {"type": body.response_format.type,
                            "json_schema": None if body.response_format.json_schema is None else
                            body.response_format.json_schema.model_dump(by_alias=True)},
                           None if body.tools is None else [tool.model_dump() for tool in body.tools],
                           body.tool_choice if isinstance(body.tool_choice, (str, type(None)))
                           else body.tool_choice.model_dump(), body.parallel_tool_calls)
        grammar = None if plan.schema is None else Grammar.from_json_schema(
            plan.schema, state.tokenizer)
    except RequestError as exc:
        raise APIError(400, str(exc), param="tools" if body.tools else "response_format") from None
    return plan, grammar


def _logprob_count(body, chat: bool) -> int | None:
    """How many top alternatives each generated token reports (None: no logprobs)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


async def _serve(request: Request, state: ServerState, body, prompts: list[_Prompt], max_tokens: int,
                 chat: bool, plan: OutputPlan | None = None, grammar: Grammar | None = None):
    tenant = request.state.tenant
    lease, max_tokens = _admit_tenant(state, tenant, body, prompts, max_tokens, chat)
    try:
        return await _submit_and_answer(request, state, body, prompts, max_tokens, chat, tenant, lease, plan,
                                        grammar)
    except APIError as exc:
        if exc.status == 400:
            lease.refund()  # refused by the engine before it ran: not charged
        else:
            lease.finish()
        raise
    except BaseException:
        lease.finish()  # the client went away: nothing more will run
        raise


async def _submit_and_answer(request: Request, state: ServerState, body, prompts: list[_Prompt], max_tokens: int,
                             chat: bool, tenant: str, lease: Lease, plan: OutputPlan | None = None,
                             grammar: Grammar | None = None):
    streams: list[OutputStream] = []
    for prompt in prompts:  # each prompt fits the context (_check_context)
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    max_tokens=max_tokens, seed=body.seed, n=body.n, ignore_eos=body.ignore_eos,
                                    logprobs=_logprob_count(body, chat))
            spec = RequestSpec(tuple(int(t) for t in prompt.ids), params, tenant=tenant,
                               cache_salt=_cache_salt(request.state.cache_scope, body.cache_salt),
                               stop=tuple(body.stop), speculative=body.speculative,
                               grammar=None if grammar is None else grammar.text, streamed=bool(body.stream))
            streams.append(state.backend.submit(spec))
        except RequestError as exc:
            for stream in streams:
                stream.abort()
            raise APIError(400, str(exc)) from None
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    cut = asyncio.Event()  # set when the server's shutdown drain runs out of time
    state.open_requests.add(cut)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(state, body, streams, response_id, chat, include_usage, plan, cut)
        return StreamingResponse(_release_after(events, lease, streams), media_type="text/event-stream",
                                 headers=lease.headers)
    watcher = asyncio.create_task(_abort_on_disconnect(request, streams))
    try:
        response = await _complete(state, body, streams, response_id, chat, plan, cut)
    finally:
        watcher.cancel()
        state.open_requests.discard(cut)
    lease.finish(_tokens_used(streams))
    response.headers.update(lease.headers)
    return response


SHUTDOWN_MESSAGE = "the server is shutting down and its drain time ran out; this response is incomplete"


async def _until_cut(stream: OutputStream, cut: asyncio.Event) -> AsyncIterator[RequestOutput | None]:
    """The stream's outputs; then None, once, if `cut` is set before the stream ends."""
    outputs = stream.__aiter__()
    cut_wait = asyncio.ensure_future(cut.wait())
    next_output: asyncio.Future | None = None
    try:
        while True:
            next_output = asyncio.ensure_future(outputs.__anext__())
            await asyncio.wait((next_output, cut_wait), return_when=asyncio.FIRST_COMPLETED)
            if not next_output.done():
                yield None
                return
            try:
                output = next_output.result()
            except StopAsyncIteration:
                return
            next_output = None
            yield output
    finally:
        cut_wait.cancel()
        if next_output is not None and not next_output.done():
            next_output.cancel()


async def _abort_on_disconnect(request: Request, streams: list[OutputStream]) -> None:
    """A non-streaming request's client hung up: abort its sequences (freed at the engine's next step). The body
    is read already, so the next ASGI message is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for stream in streams:
                if not stream.finished:
                    stream.abort()
            return


def _finish_reason(reason: FinishReason | None, tracker: TextTracker) -> str | None:
    if tracker.stopped:
        return "stop"
    if reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
            FinishReason.ERROR: "error"}[reason]


def _logprobs_field(state: ServerState, body, chat: bool, entries: list | None, offset: int = 0) -> dict | None:
    top = _logprob_count(body, chat)
    if top is None or entries is None:
        return None
    if chat:
        return chat_logprobs(state.tokenizer, entries, top)
    return completion_logprobs(state.tokenizer, entries, top, offset)


async def _complete(state: ServerState, body, streams: list[OutputStream], response_id: str, chat: bool,
                    plan: OutputPlan | None = None, cut: asyncio.Event | None = None):
    choices: list[dict] = []
    prompt_tokens = completion_tokens = 0
    finals: list[RequestOutput] = []
    try:
        for prompt_index, stream in enumerate(streams):
            final: RequestOutput | None = None
            async for output in _until_cut(stream, cut or asyncio.Event()):
                if output is None:
                    logger.warning("cut %s at shutdown: the drain time ran out before it finished", response_id)
                    raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutting_down")
                final = output
            assert final is not None
            finals.append(final)
            if final.error is not None:
                raise APIError(500, f"the request failed in the engine: {final.error}", type_="server_error")
            prompt_tokens += len(final.prompt_token_ids)
            for completion in final.outputs:
                tracker = TextTracker(state.tokenizer, body.stop)
                text = tracker.add(completion.token_ids) + tracker.finish()
                completion_tokens += len(completion.token_ids)
                index = prompt_index * body.n + completion.index
                reason = _finish_reason(completion.finish_reason, tracker)
                logprobs = _logprobs_field(state, body, chat, completion.logprobs)
                if chat:
                    message: dict[str, Any] = {"role": "assistant", "content": text}
                    calls = parse_tool_calls(text, plan) if plan is not None and reason == "stop" else None
                    if calls:
                        message, reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
                    choices.append({"index": index, "message": message, "finish_reason": reason,
                                    "logprobs": logprobs})
                else:
                    choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs})
    finally:
        for stream in streams:
            if not stream.finished:
                stream.abort()  # the client went away, or another prompt of this request failed
    return JSONResponse({
        "id": response_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens, **_io_usage(finals)},
    })


def _io_usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """The usage object's extension fields (as vLLM adds its own): disk reads charged to the request's prompts,
    each its share of every step's tokens (engine/io_usage.py)."""
    return {"bytes_read": sum(o.bytes_read for o in outputs),
            "expert_misses": sum(o.expert_misses for o in outputs),
            "io_wait_ms": round(sum(o.io_wait_ms for o in outputs), 3)}


async def _stream_events(state: ServerState, body, streams: list[OutputStream], response_id: str, chat: bool,
                         include_usage: bool, plan: OutputPlan | None = None, cut: asyncio.Event | None = None
                         ) -> AsyncIterator[str]:
    """SSE chunks. With tools, a reply's calls are streamed as OpenAI streams them (serve/tool_stream.py): each
    call's first delta (index, id, type, name), then its arguments as they are generated, then finish_reason
    "tool_calls"; a reply that is no call streams as content. When `cut` is set (the shutdown's drain time
    ran out) every open choice gets its held text and finish_reason "abort", then an error event ends the stream."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    trackers: dict[int, TextTracker] = {}
    prompt_tokens = completion_tokens = 0

    def event(choices: list[dict], usage: dict | None = None) -> str:
        payload: dict[str, Any] = {"id": response_id, "object": kind, "created": created,
                                   "model": state.model_name, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    with_tools = chat and plan is not None and plan.uses_tools
    streamers: dict[int, ToolCallStreamer] = {}
    logprobs_sent: dict[int, int] = {}
    text_sent: dict[int, int] = {}

    def choices_for(index: int, text: str, reason: str | None, first: bool, completion) -> list[dict]:
        """One choice per chunk to send: a tool call's first delta and its arguments go in chunks of their own."""
        entries = None
        if completion.logprobs is not None:
            entries = completion.logprobs[logprobs_sent.get(index, 0):]
            logprobs_sent[index] = len(completion.logprobs)
        logprobs = _logprobs_field(state, body, chat, entries, text_sent.get(index, 0))
        text_sent[index] = text_sent.get(index, 0) + len(text)
        if not chat:
            return [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}]
        if not with_tools:
            deltas: list[dict[str, Any]] = [{"content": text}]
        else:
            if index not in streamers:
                streamers[index] = ToolCallStreamer(plan)
            streamer = streamers[index]
            pieces = streamer.add(text)
            if reason is not None:
                last, reason = streamer.finish(reason)
                pieces += last
            deltas = [{"content": None, "tool_calls": piece.tool_calls} if piece.tool_calls
                      else {"content": piece.content} for piece in pieces]
            if not deltas:
                if not (first or reason or logprobs):
                    return []
                deltas = [{} if reason == "tool_calls" else {"content": ""}]
        if first:
            deltas[0]["role"] = "assistant"
        choices = [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None} for delta in deltas]
        choices[0]["logprobs"], choices[-1]["finish_reason"] = logprobs, reason
        return choices

    def cut_short() -> list[str]:
        logger.warning("cut stream %s at shutdown after %d generated token(s): the drain time ran out",
                       response_id, sum(token_counts.values()))
        choices = []
        for index in range(len(streams) * body.n):
            if index in done:
                continue
            tracker = trackers.get(index)
            text = tracker.finish() if tracker else ""
            if index in streamers:  # what is held back (a call is never finished here) goes out as content
                streamers[index].add(text)
                text = "".join(piece.content for piece in streamers[index].finish(None)[0])
            if chat:
                delta: dict[str, Any] = {"content": text}
                if tracker is None:
                    delta["role"] = "assistant"
                choices.append({"index": index, "delta": delta, "finish_reason": "abort", "logprobs": None})
            else:
                choices.append({"index": index, "text": text, "finish_reason": "abort", "logprobs": None})
        error = {"message": SHUTDOWN_MESSAGE, "type": "server_error", "param": None, "code": "server_shutting_down"}
        return ([event(choices)] if choices else []) + [f"data: {json.dumps({'error': error})}\n\n"]

    done: set[int] = set()
    token_counts: dict[int, int] = {}
    latest: dict[int, RequestOutput] = {}  # each prompt's last output: its usage so far
    cut = cut or asyncio.Event()
    try:
        for prompt_index, stream in enumerate(streams):
            first_output = True
            async for output in _until_cut(stream, cut):
                if output is None:
                    for chunk in cut_short():
                        yield chunk
                    return
                if output.error is not None:
                    error = {"message": f"the request failed in the engine: {output.error}", "type": "server_error",
                             "param": None, "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                latest[prompt_index] = output
                if first_output:
                    prompt_tokens += len(output.prompt_token_ids)
                    first_output = False
                rounds: list[list[dict]] = []  # rounds[k]: the k-th chunk's choices
                for completion in output.outputs:
                    index = prompt_index * body.n + completion.index
                    token_counts[index] = len(completion.token_ids)
                    if index in done:
                        continue
                    first = index not in trackers
                    tracker = trackers.setdefault(index, TextTracker(state.tokenizer, body.stop))
                    text = tracker.add(completion.new_token_ids)
                    reason = None
                    if completion.finished or tracker.stopped:
                        text += tracker.finish()
                        reason = _finish_reason(completion.finish_reason or FinishReason.STOP, tracker)
                        done.add(index)
                    if text or reason or first or completion.new_token_ids and completion.logprobs:
                        for k, one in enumerate(choices_for(index, text, reason, first, completion)):
                            if k == len(rounds):
                                rounds.append([])
                            rounds[k].append(one)
                for choices in rounds:
                    yield event(choices)
        if include_usage:
            completion_tokens = sum(token_counts.values())
            yield event([], {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens, **_io_usage(list(latest.values()))})
        yield "data: [DONE]\n\n"
    finally:
        state.open_requests.discard(cut)
        for stream in streams:
            if not stream.finished:
                stream.abort()  # the client disconnected mid-stream, or the server cut it
