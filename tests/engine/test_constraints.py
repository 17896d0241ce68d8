"""Grammar-constrained decoding and logprobs in the engine: batched steps, n > 1, speculative verification."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.constraints import Grammar
from k3serve.engine.drafters import Draft
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import Sampler, SamplingParams
from k3serve.engine.speculative import SpeculativeConfig
from k3serve.engine.verification import verify
from k3serve.errors import RequestError
from k3serve.loading import load_model

SCHEMA = {"type": "object", "properties": {"units": {"enum": ["metric", "imperial"]}, "ok": {"type": "boolean"}},
          "required": ["units", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def _engine(loaded, **kwargs) -> LLMEngine:
    config = EngineConfig(max_model_len=256, max_seqs=8, kv_cache_bytes=16 << 20)
    return LLMEngine(loaded.model, config, stop_ids=loaded.stop_ids, **kwargs)


def _run(engine: LLMEngine, prompts, params, **kwargs) -> dict:
    ids = [engine.add_request(p, params, **kwargs) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
    return [final[i] for i in ids]


def _json_of(loaded, tokens: list[int]) -> dict:
    text = loaded.tokenizer.decode([t for t in tokens if not loaded.tokenizer.is_special(t)])
    return json.loads(text)


def test_every_completion_follows_the_schema_batched_sampled_and_speculative(loaded):
    grammar = Grammar.from_json_schema(SCHEMA, loaded.tokenizer)
    prompts = [loaded.tokenizer.encode(text) for text in ("def f(x):", "The weather", "import os\n")]
    for spec in (None, SpeculativeConfig(drafter="ngram", num_draft_tokens=3, adaptive=False)):
        engine = _engine(loaded, speculative=spec)
        for params in (SamplingParams(max_tokens=40), SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=40)):
            for out in _run(engine, prompts, params, grammar=grammar):
                for completion in out.outputs:
                    assert completion.finish_reason.value == "stop", completion
                    assert completion.token_ids[-1] in loaded.stop_ids  # the grammar ended with an EOS
                    value = _json_of(loaded, completion.token_ids)
                    assert value["units"] in ("metric", "imperial") and isinstance(value["ok"], bool)


def test_greedy_constrained_output_is_the_same_with_speculation(loaded):
    grammar = Grammar.from_json_schema(True, loaded.tokenizer)
    prompt = loaded.tokenizer.encode('{"a": 1, "a": 1, "a": 1, ')
    plain = _run(_engine(loaded), [prompt], SamplingParams(max_tokens=48), grammar=grammar)
    spec = SpeculativeConfig(drafter="ngram", num_draft_tokens=4, adaptive=False)
    fast = _run(_engine(loaded, speculative=spec), [prompt], SamplingParams(max_tokens=48), grammar=grammar)
    assert plain[0].outputs[0].token_ids == fast[0].outputs[0].token_ids
    text = loaded.tokenizer.decode(plain[0].outputs[0].token_ids)
    assert text.startswith("{")


def test_verify_masks_each_row_by_the_drafts_before_it_and_rolls_back(loaded):
    tokenizer, vocab = loaded.tokenizer, loaded.model.config.vocab_size
    grammar = Grammar.from_json_schema(SCHEMA, tokenizer)
    sampler = Sampler(SamplingParams(), constraint=grammar.constraint())
    good = tokenizer.encode('{"units":"')
    logits = np.zeros((len(good) + 1, vocab), np.float32)
    for row, token in enumerate(good):
        logits[row, token] = 5.0  # the target agrees with every draft
    logits[len(good), tokenizer.encode("x")[0]] = 9.0  # ...then prefers a token the grammar forbids there
    result = verify(logits, Draft(list(good)), sampler)
    assert result.num_accepted == len(good)
    text = tokenizer.decode(result.tokens)  # the forbidden 'x' was masked away: the target kept to the grammar
    assert any(full.startswith(text) for full in ('{"units":"metric"', '{"units":"imperial"')), text
    assert sampler.constraint.allowed()[good[0]] and not sampler.constraint.allowed()[good[1]]  # did not move
    bad = tokenizer.encode('[1]')  # a draft that breaks the grammar at once is rejected
    logits = np.zeros((len(bad) + 1, vocab), np.float32)
    logits[:, bad[0]] = 5.0
    assert verify(logits, Draft(list(bad)), sampler).num_accepted == 0


def test_verify_past_the_end_of_the_document_leaves_the_grammar_where_it_was(loaded):
    """Drafts that run past a complete document ('}' then end-of-sequence ids): llguidance does not record the
    ids consumed after the grammar stopped, so rolling back over them undid '}' and '{' too, and the engine's
    next accept failed ("token 125 breaks the grammar"). The soak-style stress of issue 19 found it."""
    tokenizer, vocab = loaded.tokenizer, loaded.model.config.vocab_size
    eos = loaded.stop_ids[-1]
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
        sampler = Sampler(params, constraint=Grammar.from_json_schema(True, tokenizer).constraint())
        sampler.accept(tokenizer.encode("{")[0])
        close = tokenizer.encode("}")[0]
        drafts = [close, eos, eos]
        logits = np.full((len(drafts) + 1, vocab), -5.0, np.float32)
        for row, token in enumerate(drafts + [eos]):
            logits[row, token] = 5.0  # the target agrees with every draft
        result = verify(logits, Draft(drafts), sampler)
        assert result.tokens[0] == close and result.num_accepted >= 1
        for token in result.tokens:  # the engine then advances the real grammar on what it emits
            sampler.accept(token)
            if token == eos:
                break
        assert sampler.constraint.is_complete


def _chat_ids(loaded, turns: list[tuple[str, str]]) -> list[int]:
    from k3serve.serve.chat import apply_chat_template

    return apply_chat_template(loaded.tokenizer, turns)


def test_a_json_chat_with_earlier_json_replies_completes_with_speculation(loaded):
    """Earlier assistant replies '{}<|im_end|>' in the prompt make the n-gram drafter propose '}' and the
    end-of-turn id: every completion must end as a document, greedy and sampled."""
    grammar = Grammar.from_json_schema(True, loaded.tokenizer)
    prompt = _chat_ids(loaded, [("user", "return data"), ("assistant", "{}")] * 3 + [("user", "return data")])
    spec = SpeculativeConfig(drafter="ngram", num_draft_tokens=3, adaptive=False)
    for params in (SamplingParams(max_tokens=12), SamplingParams(temperature=0.8, seed=0, n=4, max_tokens=12)):
        for out in _run(_engine(loaded, speculative=spec), [prompt], params, grammar=grammar):
            assert out.error is None, out.error
            for completion in out.outputs:
                if completion.finish_reason.value == "stop":
                    assert isinstance(_json_of(loaded, completion.token_ids), dict)


def test_with_a_grammar_ignore_eos_still_ends_at_the_end_of_the_document(loaded):
    """ignore_eos (a benchmarking switch) cannot extend a complete document: the grammar then allows only an
    end-of-sequence id, and it ends the completion, with speculation or not."""
    grammar = Grammar.from_json_schema(True, loaded.tokenizer)
    prompt = _chat_ids(loaded, [("user", "print value items")])
    for spec in (None, SpeculativeConfig(drafter="ngram", num_draft_tokens=3, adaptive=False)):
        params = SamplingParams(temperature=0.8, seed=0, n=4, max_tokens=24, ignore_eos=True)
        out = _run(_engine(loaded, speculative=spec), [prompt], params, grammar=grammar)[0]
        assert out.error is None, out.error
        stopped = [c for c in out.outputs if c.finish_reason.value == "stop"]
        assert stopped, "no completion finished its document within max_tokens: the test proves nothing"
        for completion in stopped:
            assert completion.token_ids[-1] in loaded.stop_ids
            assert sum(t in loaded.stop_ids for t in completion.token_ids) == 1
            assert isinstance(_json_of(loaded, completion.token_ids), dict)


def test_logprobs_are_the_models_log_softmax(loaded):
    engine = _engine(loaded)
    prompt = loaded.tokenizer.encode("def add(a, b):")
    out = _run(engine, [prompt], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    full = loaded.model.logits(prompt + out.token_ids[:-1])  # [T, V]: position i predicts token i + 1
    reference = full - np.log(np.sum(np.exp(full - full.max(1, keepdims=True)), 1, keepdims=True)) \
        - full.max(1, keepdims=True)
    for i, entry in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + i]
        assert entry.token == out.token_ids[i]
        assert abs(entry.logprob - row[entry.token]) < 1e-3
        assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:3])
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely one
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_a_bad_schema_is_a_request_error(loaded):
    with pytest.raises(RequestError, match="schema"):
        Grammar.from_json_schema({"type": "no-such-type"}, loaded.tokenizer)
