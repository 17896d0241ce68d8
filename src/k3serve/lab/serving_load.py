"""Load for a running `k3serve serve`, through the official `openai` client: concurrent streamed completions, and
two tenants (a flood and a light stream). Every time is the client's: a request's TTFT runs from just before the
client sends it to the first streamed token; its inter-token latencies are the gaps between its streamed tokens (a
chunk that carries several tokens splits its gap evenly between them; `logprobs=0` says how many tokens a chunk
holds). Used by the lab's `serving` module.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import numpy as np

from k3serve.lab.registry import RunCancelled

PERCENTILES = (50, 90, 99)


@dataclass
class StreamedRequest:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    sent: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    tenant: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentiles(values: list[float]) -> dict[int, float]:
    """{50: p50, 90: p90, 99: p99} (linear interpolation), NaN for no values."""
    if not values:
        return {p: math.nan for p in PERCENTILES}
    return {p: float(np.percentile(values, p)) for p in PERCENTILES}


def import_client() -> None:
    """Import `openai` now (about a second, more on a loaded machine), e.g. while servers start, rather than inside
    the first timed or cancellable pass. Not at module level: the lab imports every module to list them."""
    import openai  # noqa: F401


def make_client(base_url: str, api_key: str, timeout_s: float = 120.0):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)


async def stream_completion(client, model: str, prompt: list[int], max_tokens: int, cancel,
                            record: StreamedRequest | None = None) -> StreamedRequest:
    """One streamed /v1/completions request of token ids, filling `record` as tokens arrive (so a request cut
    short keeps what it received); checks `cancel` at every chunk."""
    if record is None:
        record = StreamedRequest(time.perf_counter())
    record.sent = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             logprobs=0, temperature=0.0, extra_body={"ignore_eos": True})
    last = record.sent
    async for chunk in stream:
        if cancel is not None and cancel.cancelled:
            await stream.close()
            raise RunCancelled("the run was cancelled")
        now = time.perf_counter()
        for choice in chunk.choices:
            tokens = len(choice.logprobs.tokens) if choice.logprobs and choice.logprobs.tokens else \
                (1 if choice.text else 0)
            if not tokens:
                continue
            if record.first_token is None:
                record.first_token = now
                record.token_times.append(now)
                tokens -= 1
                last = now
            # several tokens in one chunk: spread its gap evenly (they were sent together)
            for i in range(1, tokens + 1):
                record.token_times.append(last + (now - last) * i / tokens)
            last = now
    return record


async def with_cancel(work, cancel, poll_s: float = 0.05):
    """Await `work` (a coroutine), but raise RunCancelled within `poll_s` of a cancel, even while a request waits
    for its first chunk (a fresh server's first forward can take seconds)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if cancel is not None and cancel.cancelled:
                raise RunCancelled("the run was cancelled")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@dataclass(frozen=True)
class ConcurrencyPoint:
    """One run of `concurrency` streams, each sending `requests_per_stream` requests back to back."""

    concurrency: int
    seconds: float
    tokens: int
    ttft: dict[int, float]  # percentile -> seconds
    itl: dict[int, float]  # percentile -> seconds

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds


async def _concurrency_run(client, model: str, prompts: list[list[int]], concurrency: int, requests_per_stream: int,
                           max_tokens: int, cancel) -> ConcurrencyPoint:
    async def one_stream(index: int) -> list[StreamedRequest]:
        done = []
        for r in range(requests_per_stream):
            prompt = prompts[(index * requests_per_stream + r) % len(prompts)]
            done.append(await stream_completion(client, model, prompt, max_tokens, cancel))
        return done

    started = time.perf_counter()
    streams = await asyncio.gather(*(one_stream(i) for i in range(concurrency)))
    seconds = time.perf_counter() - started
    requests = [r for stream in streams for r in stream]
    return ConcurrencyPoint(concurrency, seconds, sum(len(r.token_times) for r in requests),
                            percentiles([r.ttft for r in requests if r.ttft is not None]),
                            percentiles([g for r in requests for g in r.gaps()]))


def concurrency_run(base_url: str, api_key: str, model: str, prompts: list[list[int]], concurrency: int,
                    requests_per_stream: int, max_tokens: int, cancel) -> ConcurrencyPoint:
    async def main() -> ConcurrencyPoint:
        client = make_client(base_url, api_key)
        try:
            return await with_cancel(_concurrency_run(client, model, prompts, concurrency, requests_per_stream,
                                                      max_tokens, cancel), cancel)
        finally:
            await client.close()

    return asyncio.run(main())


@dataclass(frozen=True)
class TenantsRun:
    """Tenant A keeps `flood_streams` streams busy; tenant B sends one short request every `light_interval_s`."""

    seconds: float
    tokens: int  # every token both tenants received within the run
    b_ttft: dict[int, float]  # B's TTFT percentiles (s); a request without a first token counts its wait so far
    b_requests: int


def tenants_run(base_url: str, keys: dict[str, str], model: str, flood_prompt: list[int], light_prompt: list[int],
                flood_streams: int, flood_max_tokens: int, light_max_tokens: int, light_interval_s: float,
                seconds: float, cancel) -> TenantsRun:
    async def main() -> TenantsRun:
        clients = {name: make_client(base_url, key) for name, key in keys.items()}
        flood_records: list[StreamedRequest] = []
        light_records: list[StreamedRequest] = []
        started = time.perf_counter()
        deadline = started + seconds

        async def flood() -> None:
            while time.perf_counter() < deadline:
                record = StreamedRequest(time.perf_counter(), tenant="A")
                flood_records.append(record)
                await stream_completion(clients["A"], model, flood_prompt, flood_max_tokens, cancel, record)

        async def light(due: float) -> None:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            record = StreamedRequest(time.perf_counter(), tenant="B")
            light_records.append(record)
            await stream_completion(clients["B"], model, light_prompt, light_max_tokens, cancel, record)

        floods = [asyncio.ensure_future(flood()) for _ in range(flood_streams)]
        await asyncio.sleep(min(0.05, seconds / 10))  # A is in flight before B's first request
        dues = np.arange(time.perf_counter(), deadline, light_interval_s)
        lights = [asyncio.ensure_future(light(float(due))) for due in dues]
        try:
            while (left := deadline - time.perf_counter()) > 0 and not cancel.cancelled:
                await asyncio.sleep(min(0.05, left))  # a cancel is seen within 50 ms, not at the run's end
            cancel.check()
        finally:
            ended = time.perf_counter()
            for task in floods + lights:
                task.cancel()
            results = await asyncio.gather(*floods, *lights, return_exceptions=True)
            for client in clients.values():
                await client.close()
        for result in results:
            if isinstance(result, RunCancelled):
                raise result
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        tokens = sum(sum(1 for t in r.token_times if t <= ended) for r in flood_records + light_records)
        waits = [r.ttft if r.ttft is not None else ended - r.sent for r in light_records]
        return TenantsRun(ended - started, tokens, percentiles(waits), len(light_records))

    return asyncio.run(main())
