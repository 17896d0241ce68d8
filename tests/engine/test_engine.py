"""The engine end to end on the tiny oracle: batching invariance, chunked prefill, n > 1 forks, seeds, stops,
aborts, bad requests and failure isolation."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLM, LLMEngine
from k3serve.engine.request import FinishReason
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import RequestError


def _mixed_requests(seed: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..60 tokens; a third greedy, the rest sampled with seeds and assorted filters."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        prompt = [int(t) for t in rng.integers(3, 256, size=int(rng.integers(1, 61)))]
        max_tokens = int(rng.integers(2, 9))
        if i % 3 == 0:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=float(rng.choice([0.7, 1.0, 1.3])), top_p=float(rng.choice([1.0, 0.9])),
                                    top_k=int(rng.choice([0, 40])), seed=1000 + i, max_tokens=max_tokens,
                                    ignore_eos=True)
        requests.append((prompt, params))
    return requests


def _generate(engine: LLMEngine, requests, drive) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = drive(engine)
    return [final[i].outputs[0].token_ids for i in ids]


def test_a_request_gives_the_same_tokens_alone_and_in_a_batch_of_16(tiny_model, drive):
    requests = _mixed_requests(seed=5, count=16)
    config = EngineConfig(block_size=8, num_blocks=256, max_batch_tokens=1024, max_seqs=16)
    batched_engine = LLMEngine(tiny_model, config)
    batched = _generate(batched_engine, requests, drive)
    assert batched_engine.metrics.histogram("batch_tokens").summary()["p90"] >= 8, "the batch really was mixed"
    for request, tokens in zip(requests, batched):
        alone = _generate(LLMEngine(tiny_model, config), [request], drive)[0]
        assert alone == tokens
        assert len(tokens) == request[1].max_tokens
    greedy = requests[0]
    assert batched[0] == tiny_model.greedy(greedy[0], greedy[1].max_tokens)


def test_chunked_prefill_gives_the_same_tokens_as_unchunked(tiny_model, drive):
    requests = _mixed_requests(seed=8, count=6)
    whole = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=512))
    chunked = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=7))
    assert _generate(whole, requests, drive) == _generate(chunked, requests, drive)
    assert chunked.metrics.histogram("batch_tokens").summary()["p99"] <= 7
    assert whole.metrics.counter("steps").value < chunked.metrics.counter("steps").value


def test_unchunked_mode_runs_a_long_prefill_alone_over_the_budget(tiny_model, drive):
    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8, enable_chunked_prefill=False,
                          enable_prefix_caching=False)
    engine = LLMEngine(tiny_model, config)
    prompt = list(range(3, 33))
    assert _generate(engine, [(prompt, SamplingParams(max_tokens=3, ignore_eos=True))], drive)[0] == \
        tiny_model.greedy(prompt, 3)
    assert max(engine.metrics.histogram("batch_tokens").samples()) == 30


def test_n_completions_fork_from_one_prefill(tiny_model, drive):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    prompt = list(range(10, 31))  # 21 tokens: the last block is partial and shared after the fork
    request_id = engine.add_request(prompt, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5,
                                                           ignore_eos=True))
    out = drive(engine)[request_id]
    completions = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c) == 5 for c in completions)
    assert len({tuple(c) for c in completions}) > 1, "each completion draws with its own generator"
    # the prompt went through the model once; each completion then decoded its own 4 more positions
    assert engine.metrics.counter("computed_tokens").value == len(prompt) + 3 * 4
    again = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64))
    request_id = again.add_request(prompt, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5,
                                                          ignore_eos=True))
    assert [c.token_ids for c in drive(again)[request_id].outputs] == completions, "seeded n > 1 is reproducible"


def test_stop_tokens_stop_hook_and_context_limit(tiny_model, drive):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_model_len=24))
    prompt = [5, 6, 7, 8]
    free_run = tiny_model.greedy(prompt, 6)
    stop_id = free_run[2]
    by_token = engine.add_request(prompt, SamplingParams(max_tokens=6, stop_token_ids=(stop_id,), ignore_eos=True))
    by_hook = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                                 stop_hook=lambda generated: len(generated) == 2)
    by_context = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=50, ignore_eos=True))
    final = drive(engine)
    first_stop = free_run.index(stop_id)
    assert final[by_token].outputs[0].token_ids == free_run[:first_stop + 1]
    assert final[by_token].outputs[0].finish_reason is FinishReason.STOP
    assert final[by_hook].outputs[0].token_ids == free_run[:2]
    assert final[by_hook].outputs[0].finish_reason is FinishReason.STOP
    assert len(final[by_context].outputs[0].token_ids) == 4  # 20 prompt tokens + 4 = max_model_len 24
    assert final[by_context].outputs[0].finish_reason is FinishReason.LENGTH


def test_streamed_deltas_add_up_and_abort_frees_everything(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64))
    streamed: dict[str, list] = {}
    ids = [engine.add_request([3 + i, 4, 5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True),
                              on_output=lambda out: streamed.setdefault(out.request_id, []).append(out))
           for i in range(3)]
    for _ in range(4):
        engine.step()
    engine.abort(ids[1])
    engine.abort("no-such-request")
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    for request_id in ids:
        outs = streamed[request_id]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        joined = [t for o in outs for t in o.outputs[0].new_token_ids]
        assert joined == outs[-1].outputs[0].token_ids
    assert streamed[ids[1]][-1].outputs[0].finish_reason is FinishReason.ABORT
    assert len(streamed[ids[1]][-1].outputs[0].token_ids) < 20
    assert streamed[ids[0]][-1].outputs[0].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.blocks.num_used_blocks == 0 and engine.scheduler.states.num_used_slots == 0
    assert engine.metrics.counter("requests_finished_abort").value == 1


@pytest.mark.parametrize("prompt, params, kwargs, match", [
    ([], None, {}, "empty"),
    ([1, 2, 256], None, {}, "0..255"),
    ([1, -1], None, {}, "0..255"),
    ([1.5, 2], None, {}, "integers"),
    ("text", None, {}, "token ids"),
    (list(range(3, 100)) * 3, None, {}, "context"),
    ([1, 2], {"max_tokens": 0}, {}, "max_tokens"),
    ([1, 2], {"temperature": -1.0}, {}, "temperature"),
    ([1, 2], {"top_p": 0.0}, {}, "top_p"),
    ([1, 2], {"n": 0}, {}, "n must"),
    ([1, 2], {"n": 99}, {}, "max_seqs"),
    ([1, 2], {"stop_token_ids": (999,)}, {}, "stop_token_ids"),
    ([1, 2], None, {"tenant": ""}, "tenant"),
    ([1, 2], None, {"stop_hook": 3}, "callable"),
])
def test_bad_requests_raise_and_leave_the_engine_untouched(tiny_model, drive, prompt, params, kwargs, match):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_model_len=256, max_seqs=8))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, None if params is None else SamplingParams(**params), **kwargs)
    assert engine.num_unfinished_requests == 1
    assert drive(engine)[good].outputs[0].token_ids == tiny_model.greedy([5, 6, 7], 3)


def test_duplicate_request_ids_are_refused_while_live(tiny_model, drive):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64))
    engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(RequestError, match="in use"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")
    drive(engine)
    engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")  # free again once finished
    drive(engine)


def test_a_failing_stop_hook_fails_only_its_request(tiny_model, drive):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64))

    def broken(generated):
        raise ValueError("hook bug")

    bad = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), stop_hook=broken)
    good = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    final = drive(engine)
    assert final[bad].outputs[0].finish_reason is FinishReason.ERROR and "hook bug" in final[bad].error
    assert final[good].outputs[0].token_ids == tiny_model.greedy([5, 6, 7, 8], 4)
    assert engine.scheduler.blocks.num_used_blocks == 0 and engine.scheduler.states.num_used_slots == 0


class _PoisonedModel:
    """The tiny model, except that any forward containing the poison token raises."""

    def __init__(self, model, poison: int) -> None:
        self.model, self.poison, self.config = model, poison, model.config
        self.cache_layout, self.experts = model.cache_layout, model.experts
        self.supports_nested_forward = model.supports_nested_forward

    def new_cache(self):
        return self.model.new_cache()

    def resident_draft(self, allowed=None):
        return None

    def forward(self, items, **kwargs):
        if any(self.poison in item.token_ids for item in items):
            raise FloatingPointError("poisoned batch")
        return self.model.forward(items, **kwargs)


def test_a_failing_forward_fails_only_the_request_that_causes_it(tiny_model, drive):
    engine = LLMEngine(_PoisonedModel(tiny_model, poison=250), EngineConfig(block_size=4, num_blocks=64))
    prompts = [[5, 6, 7], [9, 250, 11], [12, 13, 14, 15, 16]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts]
    final = drive(engine)
    assert final[ids[1]].outputs[0].finish_reason is FinishReason.ERROR
    assert "poisoned batch" in final[ids[1]].error
    for i in (0, 2):
        assert final[ids[i]].outputs[0].token_ids == tiny_model.greedy(prompts[i], 3)
    assert engine.metrics.counter("forward_failures").value == 2  # the batch, then the culprit alone
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_llm_generate_offline(tiny_model):
    llm = LLM(tiny_model, EngineConfig(block_size=4, num_blocks=64))
    prompts = [[5, 6, 7], [8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [tiny_model.greedy(p, 3) for p in prompts]
    with pytest.raises(RequestError):
        llm.generate([[5, 6], []])
    assert not llm.engine.has_unfinished_requests(), "a bad prompt in a batch queues none of it"


def test_metrics_snapshot_reports_the_engine_state(tiny_model, drive):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64))
    engine.add_request(list(range(5, 15)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    mid = engine.metrics.snapshot()
    assert mid["num_running"] == 1 and mid["kv_blocks_used"] == 3 and mid["state_slots_used"] == 1
    drive(engine)
    engine.add_request(list(range(5, 15)) + [1], SamplingParams(max_tokens=3, ignore_eos=True))
    drive(engine)
    snap = engine.metrics.snapshot()
    assert snap["generation_tokens"] == 6 and snap["prompt_tokens"] == 21
    assert snap["prefix_cache_hit_tokens"] == 10  # tokens saved
    assert snap["prefix_cache_hit_rate"] == pytest.approx(10 / 21)
    assert snap["ttft_seconds"]["count"] == 2 and snap["inter_token_latency_seconds"]["count"] == 4
    assert snap["requests_finished_length"] == 2 and snap["num_running"] == 0 and snap["queue_length"] == 0
    assert snap["kv_blocks_used"] == 0 and snap["state_slots_used"] == 0


def test_context_refusal_is_the_servers_message(tiny_model):
    from k3serve.errors import ContextLengthError

    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_model_len=32, max_seqs=2))
    with pytest.raises(ContextLengthError, match="^this model's context holds 32 tokens, but the prompt has 32 and "
                                                 "max_tokens asks for 5 more$"):
        engine.add_request([5] * 32, SamplingParams(max_tokens=5))
