"""Verifying a speculative window: which drafts the target accepts, and how many tokens to emit.

Greedy: accept d_{i+1} while it equals argmax(row i); the first disagreement (or row k when all are accepted) gives
one more token, the target's argmax. Sampling (Leviathan et al. 2023; Chen et al. 2023): accept d with probability
min(1, p_i(d) / q_i(d)); on rejection draw from norm(max(0, p_i - q_i)) and stop; when all are accepted draw from
p_k. A deterministic drafter has q = one-hot. See engine/speculative.py.

Shapes: T = k + 1 window positions, k drafts, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from k3serve.engine.drafters import Draft
from k3serve.engine.sampling import Sampler
from k3serve.errors import RequestError


@dataclass
class Verification:
    tokens: list[int]  # accepted drafts then one token from the target: length num_accepted + 1
    num_accepted: int


def verify(logits: np.ndarray, draft: Draft, sampler: Sampler) -> Verification:
    """logits [T, V] of the window (T = len(draft) + 1) -> the tokens to emit."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise RequestError(f"{logits.shape[0]} logit rows for {k} drafts")
    # with a grammar, row i is masked by the grammar after the drafts before it: a copy of the grammar's position
    # advances through the accepted drafts (the engine advances the real one on the tokens it emits)
    sampler = sampler.tentative()
    constraint = sampler.constraint
    if sampler.params.greedy:
        a = 0
        while True:
            target = int(np.argmax(sampler.masked(logits[a])))
            if a == k or draft.tokens[a] != target:
                return Verification(list(draft.tokens[:a]) + [target], a)
            if constraint is not None:
                constraint.accept(target)
            a += 1
    return _verify_sampled(logits, draft, sampler)


def _verify_sampled(logits: np.ndarray, draft: Draft, sampler: Sampler) -> Verification:
    """Rejection sampling over the window (accepted drafts advance the tentative sampler's grammar)."""
    k = len(draft)
    rng = sampler.rng
    constraint = sampler.constraint
    for i, d in enumerate(draft.tokens):
        p = sampler.probabilities(logits[i])  # [V]
        q_d = 1.0 if draft.probs is None else float(draft.probs[i][d])
        if q_d > 0 and rng.random() < min(1.0, p[d] / q_d):
            if constraint is not None:
                constraint.accept(d)
            continue
        if draft.probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft.probs[i], 0.0)
        total = residual.sum()
        residual = p if total <= 0 else residual / total
        return Verification(list(draft.tokens[:i]) + [int(rng.choice(residual.shape[0], p=residual))], i)
    p = sampler.probabilities(logits[k])
    return Verification(list(draft.tokens) + [int(rng.choice(p.shape[0], p=p))], k)


def num_to_emit(tokens: Sequence[int], num_output_tokens: int, room: int, stop_ids: set[int] | frozenset[int],
                stop_hook: Callable[[list[int]], bool] | None = None, output: Sequence[int] = ()) -> int:
    """How many of a window's tokens to emit before a stop id, the length limit (`room`) or the stop hook."""
    m = 0
    for token in tokens:
        m += 1
        if token in stop_ids or m >= room:
            break
        if stop_hook is not None and stop_hook(list(output) + list(tokens[:m])):
            break
    return m
