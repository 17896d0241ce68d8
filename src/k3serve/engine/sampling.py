"""Sampling parameters and the sampler: temperature, top-k, top-p over float32 logits.

Temperature 0 means greedy (argmax, lowest id on ties). Otherwise logits are divided by the temperature, the
top-k and then the top-p (nucleus) filters keep the smallest set of most likely tokens, and one token is drawn
with the request's own seeded generator, so a seeded request gives the same tokens whatever else runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from k3serve.errors import RequestError

if TYPE_CHECKING:
    from k3serve.engine.constraints import TokenConstraint


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of the raw logits, before temperature,
    filters or a grammar, as vLLM reports by default) and the `top` most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """logits [V] -> the TokenLogprob of `token` with the `top` most likely ids (highest first, lowest id on ties)."""
    shifted = logits.astype(np.float64) - np.max(logits)
    logprobs = shifted - np.log(np.sum(np.exp(shifted)))  # [V]
    best = np.argsort(-logprobs, kind="stable")[:top] if top else np.empty(0, dtype=np.int64)
    return TokenLogprob(int(token), float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in best))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    max_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # completions per request (the engine forks them from one prefill)
    logprobs: int | None = None  # None: none; k: each generated token's log-probability and the k most likely

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer, got {self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be a positive integer, got {self.n!r}")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.stop_token_ids, tuple) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a tuple of non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_set(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """The ids that end a completion: `stop_token_ids` always, the model's end-of-sequence ids unless
        `ignore_eos`. The one rule for the engine and single-sequence generation alike."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


def validate_prompt(prompt_token_ids: Iterable[int], vocab_size: int) -> list[int]:
    """The prompt as a list of ints, or `RequestError`: not token ids, empty, or outside 0..vocab_size - 1."""
    if isinstance(prompt_token_ids, (str, bytes)):
        raise RequestError("the prompt must be token ids (tokenize text first)")
    try:
        raw = list(prompt_token_ids)
    except TypeError:
        raise RequestError("the prompt must be a sequence of integer token ids") from None
    if not raw:
        raise RequestError("the prompt is empty: give at least one token")
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in raw):
        raise RequestError("prompt token ids must be integers")
    prompt = [int(t) for t in raw]
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RequestError(f"prompt token ids must lie in 0..{vocab_size - 1}")
    return prompt


def mask_logits(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Logits [V] with every id outside `allowed` set to -inf (a generation constraint); None = unchanged."""
    if allowed is None:
        return logits
    masked = np.full_like(logits, -np.inf)
    masked[allowed] = logits[allowed]
    return masked


class Sampler:
    """Draws tokens for one sequence. Holds that sequence's random generator (by default seeded with
    `params.seed`; the engine passes its own for the 2nd..nth completion of a seeded request)."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None,
                 constraint: TokenConstraint | None = None) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed) if rng is None else rng
        self.constraint = constraint  # a grammar (engine/constraints.py): masks every draw, advances on accept

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] with what the grammar forbids next at -inf (unchanged without a grammar)."""
        return logits if self.constraint is None else self.constraint.mask(logits)

    def tentative(self) -> Sampler:
        """A sampler for trying tokens ahead (speculative verification): the same parameters and random generator,
        and a copy of the grammar's position that it may advance freely (this one's stays where it is)."""
        if self.constraint is None:
            return self
        return Sampler(self.params, self._rng, self.constraint.fork())

    def accept(self, token: int) -> None:
        """The sequence took `token`: advance the grammar."""
        if self.constraint is not None:
            self.constraint.accept(token)

    @property
    def rng(self) -> np.random.Generator:
        """This sequence's generator (speculative rejection sampling draws from it too)."""
        return self._rng

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampling draws from, after the grammar, temperature, top-k and top-p. [V] -> [V]."""
        p = self.params
        scaled = self.masked(logits).astype(np.float64) / p.temperature
        if p.top_k and p.top_k < scaled.shape[0]:
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        probs = np.exp(scaled - np.max(scaled))
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p) + 1)]
            filtered = np.zeros_like(probs)
            filtered[keep] = probs[keep]
            probs = filtered / filtered.sum()
        return probs

    def sample(self, logits: np.ndarray) -> int:
        """One token from logits [V] (the grammar's mask applied; the grammar is not advanced: see `accept`)."""
        if self.params.greedy:
            return int(np.argmax(self.masked(logits)))
        probs = self.probabilities(logits)
        return int(self._rng.choice(probs.shape[0], p=probs))
