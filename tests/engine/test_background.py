"""The engine on a background thread: submission from several threads, blocking and asyncio consumption, abort
(client disconnect), RequestError at submit time, and shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from k3serve.engine.background import EngineRunner
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.request import FinishReason, RequestSpec
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import RequestError


@pytest.fixture
def runner(tiny_model):
    runner = EngineRunner(LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=128)))
    yield runner
    runner.shutdown()


def test_threads_submit_and_consume_blocking(runner, tiny_model):
    prompts = [[5 + i, 6, 7] for i in range(4)]
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        stream = runner.submit(RequestSpec(tuple(prompts[i]), SamplingParams(max_tokens=4, ignore_eos=True)))
        tokens = []
        for out in stream:
            tokens += out.outputs[0].new_token_ids
        results[i] = tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: results[i] for i in range(4)} == {i: tiny_model.greedy(prompts[i], 4) for i in range(4)}
    with pytest.raises(RequestError):
        runner.submit(RequestSpec((), SamplingParams()))
    assert runner.alive


def test_async_consumption_and_abort_on_disconnect(runner, tiny_model):
    async def main():
        done = runner.submit(RequestSpec((5, 6, 7), SamplingParams(max_tokens=3, ignore_eos=True)))
        tokens = [t async for out in done for t in out.outputs[0].new_token_ids]
        long = runner.submit(RequestSpec((8, 9), SamplingParams(max_tokens=10_000 // 100, ignore_eos=True)))
        seen = []
        async for out in long:
            seen.append(out)
            if len(seen) == 2:
                long.abort()  # the client went away
        return tokens, seen

    tokens, seen = asyncio.run(asyncio.wait_for(main(), 60))
    assert tokens == tiny_model.greedy([5, 6, 7], 3)
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason is FinishReason.ABORT
    assert len(seen[-1].outputs[0].token_ids) < 100
    engine = runner.engine
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        threading.Event().wait(0.05)
    assert engine.scheduler.states.num_used_slots == 0


def test_shutdown_fails_live_requests(tiny_model):
    runner = EngineRunner(LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=128)))
    stream = runner.submit(RequestSpec((5, 6, 7), SamplingParams(max_tokens=100, ignore_eos=True)))
    runner.shutdown()
    outs = list(stream)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason in (FinishReason.ERROR, FinishReason.LENGTH)
    assert not runner.alive
