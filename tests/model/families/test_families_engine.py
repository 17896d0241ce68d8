"""Every family in the serving engine: the paged pools and the prefix cache are built from the model's cache
layout (GQA or MLA rows, KDA or DeltaNet states), so the engine invariants hold for each of them:
a batch gives each request's tokens alone, a prefix hit gives the tokens of a miss, speculative greedy gives the
plain greedy tokens (with rollback of attention rows and recurrent states), and pools pass `check_integrity()`
after every step."""

from __future__ import annotations

import numpy as np
import pytest

from _hf_tiny import FAMILIES, prompt
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.generate import generate
from k3serve.lab.replay_drafter import ReplayDrafter, ReplayFactory
from k3serve.engine.sampling import SamplingParams
from k3serve.engine.speculative import SpeculativeConfig
from k3serve.errors import RequestError
from k3serve.model.families import load_family

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def family_models(tiny_hf):
    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_family(tiny_hf(family)[1])
        return loaded[family]

    return get


def _run(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    return final


def _engine(model, **config) -> LLMEngine:
    config.setdefault("block_size", 4)
    config.setdefault("num_blocks", 96)
    return LLMEngine(model, EngineConfig(**config))


def _tokens(out) -> list[int]:
    assert out.error is None, out.error
    return out.outputs[0].token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_gives_each_request_its_tokens_alone(family_models, family):
    model = family_models(family)
    prompts = [prompt(3, seed=1), prompt(11, seed=2), prompt(6, seed=3)]
    engine = _engine(model, max_batch_tokens=8)  # chunked prefill beside decodes
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    batched = _run(engine)
    for request_id, p in zip(ids, prompts):
        alone = _engine(model)
        alone_id = alone.add_request(p, GREEDY)
        assert _tokens(batched[request_id]) == _tokens(_run(alone)[alone_id])
        assert _tokens(batched[request_id]) == model.greedy(p, GREEDY.max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_gives_the_tokens_of_a_miss(family_models, family):
    model = family_models(family)
    shared = prompt(10, seed=4)  # 2.5 blocks of 4: the hit needs the tail rows of a partial block too
    engine = _engine(model)
    for seed in (5, 6):  # the second request leaves the first one's path and checkpoints the branch point
        engine.add_request(shared + prompt(3, seed=seed), GREEDY)
        _run(engine)
    third = shared + prompt(4, seed=7)
    request_id = engine.add_request(third, GREEDY)
    hit = _run(engine)[request_id]
    assert hit.num_cached_tokens == len(shared)
    cold = _engine(model, enable_prefix_caching=False)
    cold_id = cold.add_request(third, GREEDY)
    assert _tokens(hit) == _tokens(_run(cold)[cold_id])


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_gives_the_plain_greedy_tokens(family_models, family):
    """Drafts are the true greedy tokens with 40% corrupted (a random tiny model gives an n-gram drafter nothing
    to find), so windows both accept and reject, and rejected positions are rolled back in every layer kind."""
    model = family_models(family)
    p = prompt(7, seed=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = model.greedy(p, params.max_tokens)
    vocab = model.config.vocab_size
    for rollback in ("projection", "snapshot"):
        spec = SpeculativeConfig(drafter="ngram", rollback=rollback, adaptive=False)
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=96), speculative=spec,
                           drafters=ReplayFactory(model, ReplayDrafter(len(p), plain, 0.4, vocab, seed=3)))
        request_id = engine.add_request(p, params)
        assert _tokens(_run(engine)[request_id]) == plain, rollback
        drafted = engine.metrics.counter("spec_draft_tokens").value
        accepted = engine.metrics.counter("spec_accepted_tokens").value
        assert 0 < accepted < drafted, (rollback, accepted, drafted)
        tokens, report = generate(model, p, params, speculative=spec,
                                  drafters=ReplayFactory(model, ReplayDrafter(len(p), plain, 0.4, vocab, seed=4)))
        assert tokens == plain and 0 < report.speculation.accepted < report.speculation.drafted, rollback


def test_the_resident_drafter_is_refused_clearly_for_a_family(family_models):
    engine = LLMEngine(family_models("qwen3_moe"), EngineConfig(block_size=4, num_blocks=32))
    with pytest.raises(RequestError, match="'resident'.*qwen3_moe"):
        engine.add_request(prompt(4), SamplingParams(max_tokens=3, ignore_eos=True),
                           speculative=SpeculativeConfig(drafter="resident"))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
def test_the_state_pool_follows_the_layout(family_models, family):
    model = family_models(family)
    engine = _engine(model)
    layout = model.cache_layout
    assert layout.recurrent_layers and layout.attention_layers
    pool = engine.scheduler.states
    for i, layer in enumerate(layout.recurrent_layers):
        state, tail = layout.recurrent_shapes[layer]
        assert pool.states[i].shape[1:] == tuple(state) and pool.conv_tails[i].shape[1:] == tuple(tail)
    assert engine.scheduler.blocks.storage.shape[0] == len(layout.attention_layers)
    assert np.all(engine.scheduler.blocks.storage.shape[-1] == layout.row_width)
