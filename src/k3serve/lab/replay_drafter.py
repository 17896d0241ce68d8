"""A drafter that proposes a known continuation, corrupted at a chosen rate: the speed of speculative decoding at a
given acceptance, independent of what a real drafter manages to guess (benchmarks/bench_spec.py and the lab)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from k3serve.engine.drafters import Draft, Drafter
from k3serve.engine.speculative import DrafterFactory, SpeculativeConfig


class ReplayDrafter(Drafter):
    """Proposes `continuation` (the tokens after a prompt of `prompt_len`); each draft token is replaced by a wrong
    one with probability `miss`."""

    def __init__(self, prompt_len: int, continuation: Sequence[int], miss: float, vocab: int, seed: int = 0) -> None:
        self.prompt_len, self.continuation, self.miss, self.vocab = prompt_len, list(continuation), miss, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, context, max_tokens, sampler) -> Draft:
        done = len(context) - self.prompt_len
        out = []
        for token in self.continuation[done:done + max_tokens]:
            out.append(int((token + 1) % self.vocab) if self.rng.random() < self.miss else int(token))
        return Draft(out)


class ReplayFactory(DrafterFactory):
    """Hands out one given drafter (the engine asks its factory for each sequence's drafter)."""

    def __init__(self, model, drafter: Drafter) -> None:
        super().__init__(model)
        self.drafter = drafter

    def create(self, config: SpeculativeConfig) -> Drafter:
        return self.drafter
