"""Sampling: greedy, temperature, top-k and top-p filters, seeds, and parameter validation."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.sampling import Sampler, SamplingParams
from k3serve.errors import RequestError

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


def test_greedy_takes_the_argmax_and_the_lowest_id_on_ties():
    assert Sampler(SamplingParams()).sample(LOGITS) == 0
    assert Sampler(SamplingParams()).sample(np.array([1.0, 3.0, 3.0], np.float32)) == 1


def test_top_k_and_top_p_keep_the_smallest_likely_set():
    probs = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(LOGITS)
    assert np.count_nonzero(probs) == 2 and probs[0] == pytest.approx(0.5 / 0.75)
    # top_p 0.8: 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed too
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.8)).probabilities(LOGITS)
    assert list(np.nonzero(probs)[0]) == [0, 1, 2]
    assert probs.sum() == pytest.approx(1.0)


def test_temperature_sharpens_and_flattens():
    cold = Sampler(SamplingParams(temperature=0.5)).probabilities(LOGITS)
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(LOGITS)
    assert cold[0] > 0.5 > hot[0]


def test_empirical_distribution_matches_and_seeds_repeat():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=123))
    draws = np.array([sampler.sample(LOGITS) for _ in range(20000)])
    freq = np.bincount(draws, minlength=5) / len(draws)
    assert np.allclose(freq, np.exp(LOGITS), atol=0.015)
    again = Sampler(SamplingParams(temperature=1.0, seed=123))
    assert [again.sample(LOGITS) for _ in range(50)] == list(draws[:50])


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -3}, "seed"),
])
def test_bad_parameters_raise_request_error(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)
