"""Drafters: cheap guesses of the next few tokens, verified by the target model in one forward.

    ngram     prompt lookup: find the longest recent n-gram of the context that ended earlier in the context, and
              propose what followed it; with several earlier matches, only the prefix on which their
              continuations agree. No model call at all; the draft is a point mass (q = one-hot).
    resident  the target model itself, with routing restricted to the experts the weight source holds in RAM
              (`resident_experts(layer) -> set | None`, None = all), so drafting reads nothing from disk. With the
              resident source every expert is in RAM and the draft equals the target's own greedy choice.
    model     a separate small draft model with the same vocabulary.
The model drafters keep their own dense cache per sequence at the confirmed position, draft k tokens one decode
step at a time, then take their cache back to the confirmed position (checkpoint and truncate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from k3serve.engine.sampling import Sampler
from k3serve.errors import RequestError
from k3serve.model.interface import ForwardItem, Model

DRAFTERS: tuple[str, ...] = ("ngram", "resident", "model")


@dataclass
class Draft:
    tokens: list[int]
    probs: list[np.ndarray] | None = None  # per draft token, the draft distribution q [V] it was sampled from;
    # None = deterministic draft (q is one-hot at the token)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Proposes draft tokens for one sequence."""

    @abstractmethod
    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        """Up to `max_tokens` guesses of the tokens after `context` (every confirmed token so far)."""

    def release(self) -> None:
        """Free per-sequence memory (the sequence finished)."""


class NGramDrafter(Drafter):
    """Prompt lookup over the whole context (prompt and generated tokens)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, max_matches: int = 4, lookback: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise RequestError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches  # most recent earlier occurrences whose continuations must agree
        self.lookback = lookback

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        ids = np.asarray(context[-self.lookback:], dtype=np.int64)
        N = len(ids)
        for n in range(min(self.max_ngram, N - 1), self.min_ngram - 1, -1):
            suffix = ids[N - n:]
            # windows[i] = ids[i:i+n]; a match at i < N - n has its continuation at i + n
            windows = np.lib.stride_tricks.sliding_window_view(ids[:N - 1], n)  # [N-n, n]
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts) == 0:
                continue
            continuations = [ids[s + n:s + n + max_tokens] for s in starts[::-1][:self.max_matches]]
            agreed = _common_prefix(continuations)
            # the longest n-gram decides: shorter ones only add matches that could disagree
            return Draft([int(t) for t in agreed])
        return Draft([])


def _common_prefix(arrays: list[np.ndarray]) -> np.ndarray:
    first = arrays[0]
    length = len(first)
    for other in arrays[1:]:
        m = min(length, len(other))
        diff = np.flatnonzero(first[:m] != other[:m])
        length = int(diff[0]) if len(diff) else m
    return first[:length]


class ModelDrafter(Drafter):
    """Drafts with a model (a small draft model, or the target restricted to resident experts)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.cache = model.new_cache()
        self.num_fed = 0  # confirmed context tokens in self.cache
        self._logits: np.ndarray | None = None  # [V] after the last confirmed token

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        if self.num_fed > len(context):  # the sequence went back (preempted and recomputed): start again
            self.cache = self.model.new_cache()
            self.num_fed = 0
        new = np.asarray(context[self.num_fed:], dtype=np.int64)
        if len(new):  # catch up on the tokens confirmed since the last draft
            self._logits = self.model.forward([ForwardItem(new, self.cache)]).logits[0][-1]
            self.num_fed = len(context)
        logits = self._logits
        checkpoint = {l: tuple(a.copy() for a in self.cache.recurrent_state(l))
                      for l in self.cache.layout.recurrent_layers}
        tokens: list[int] = []
        probs: list[np.ndarray] | None = None if sampler.params.greedy else []
        for i in range(max_tokens):
            if probs is None:
                token = int(np.argmax(logits))
            else:
                q = sampler.probabilities(logits)
                token = int(sampler.rng.choice(q.shape[0], p=q))
                probs.append(q)
            tokens.append(token)
            if i + 1 < max_tokens:
                logits = self.model.forward([ForwardItem(np.array([token]), self.cache)]).logits[0][-1]
        # back to the confirmed position: the drafts are not confirmed
        for layer, (state, tail) in checkpoint.items():
            self.cache.set_recurrent_state(layer, state, tail)
        self.cache.truncate(self.num_fed)
        return Draft(tokens, probs)

    def release(self) -> None:
        self.cache = self.model.new_cache()
        self.num_fed = 0
