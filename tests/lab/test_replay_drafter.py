"""The replay drafter: acceptance follows its corruption rate, and greedy output stays the plain greedy output."""

from __future__ import annotations

import pytest

from k3serve.engine.generate import generate
from k3serve.lab.replay_drafter import ReplayDrafter, ReplayFactory
from k3serve.engine.sampling import SamplingParams
from k3serve.engine.speculative import SpeculativeConfig

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("miss", [0.0, 0.5])
def test_replay_drafts_keep_greedy_output_and_acceptance_follows_the_miss_rate(tiny_model, miss):
    prompt = [1, 5, 9, 200, 17]
    plain, _ = generate(tiny_model, prompt, PARAMS)
    factory = ReplayFactory(tiny_model, ReplayDrafter(len(prompt), plain, miss, tiny_model.config.vocab_size))
    tokens, report = generate(tiny_model, prompt, PARAMS, speculative=SpeculativeConfig(adaptive=False),
                              drafters=factory)
    assert tokens == plain
    stats = report.speculation
    if miss == 0.0:
        assert stats.acceptance_rate == 1.0 and stats.windows < len(plain) // 2
    else:
        assert 0.0 < stats.acceptance_rate < 1.0
