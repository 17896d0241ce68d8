"""Speculative decoding: draft k tokens, verify all of them in one forward, keep what the target agrees with.

A window feeds T = 1 + k positions: the last confirmed token x0 and the drafts d1..dk, with logits at every
position (row i predicts the token after position i). Verification walks the drafts in order:
    greedy     accept d_{i+1} while it equals argmax(row i); the first disagreement (or row k when all are
               accepted) gives one more token, the target's own argmax. Exactly the plain greedy tokens.
    sampling   (Leviathan et al. 2023; Chen et al. 2023) accept d_{i+1} with probability min(1, p_i(d) / q_i(d)),
               where p_i is the target's sampling distribution (temperature, top-k, top-p) at row i and q_i the
               draft's; on rejection draw from norm(max(0, p_i - q_i)) and stop; when all are accepted draw from
               p_k. Every emitted token then has exactly the target's distribution. A deterministic drafter (n-gram)
               has q = one-hot, so acceptance is p_i(d) and the residual is p_i with d removed.
The state then keeps the first n = accepted + 1 positions (model/rollback.py). This module holds what a sequence
speculates with (`SequenceSpeculation`, its one home on the sequence: the config, its drafter, the adaptive length,
this step's draft); `verification.py` decides what a window keeps, the engine runs the windows (engine.py, also for
single-sequence `generate`), `cli/spec_storage.py` reports rollback storage.

The draft length adapts per sequence (`AdaptiveDraftLength`): from the recent acceptance rate a it picks the k
that maximises expected tokens per window (1 - a^(k+1)) / (1 - a) over the window's relative cost 1 + c k, and
k = 0 (plain decode) when no k > 0 pays, probing again now and then. With `io_aware` (`--speculative-io-aware`,
for a model streamed under a RAM budget) the window's cost is measured instead of assumed: b_T, the bytes the
source read (trunk and experts) for a step of T positions of this sequence, an exponential average per T over its
batch-1 steps (a shared step's bytes are not one sequence's). A window of k drafts costs b_{k+1} / b_1: the growth
of the drafts' expert union, concave where the union saturates. A T not yet seen is interpolated between the
nearest seen sizes, or extended from the largest with the last measured growth per position (1 + c per position
before any window is seen).

Shapes: T window positions, k drafts, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from k3serve.engine.drafters import DRAFTERS, Draft, Drafter, ModelDrafter, NGramDrafter
from k3serve.engine.sampling import Sampler
from k3serve.errors import RequestError
from k3serve.model.interface import Model
from k3serve.model.restricted_routing import ResidentExperts
from k3serve.model.rollback import ROLLBACK_METHODS


# The default cap on drafts per window. N-gram drafts cost nothing to make, so a long cap only costs verify
# positions, and the adaptive length shortens windows when drafts miss: on the embedded model, grounded 1.81x ->
# 2.12x and open-ended 1.29x -> 1.32x going from 4 to 8 (docs/BENCHMARKS.md). A drafting model pays a forward per
# draft, so it keeps 4.
DEFAULT_DRAFT_TOKENS = {"ngram": 8, "resident": 4, "model": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    drafter: str = "ngram"  # ngram | resident | model
    rollback: str = "projection"  # snapshot | projection
    num_draft_tokens: int | None = None  # the most drafts per window (k); None: DEFAULT_DRAFT_TOKENS[drafter]
    adaptive: bool = True  # adapt k to the recent acceptance rate
    position_cost: float = 0.15  # relative cost of one extra window position vs a one-token decode step
    io_aware: bool = False  # measure position_cost from the bytes the streaming source reads (module docstring)
    max_ngram: int = 4
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise RequestError(f"unknown drafter {self.drafter!r}; use one of {', '.join(DRAFTERS)}")
        if self.rollback not in ROLLBACK_METHODS:
            raise RequestError(f"unknown rollback {self.rollback!r}; use one of {', '.join(ROLLBACK_METHODS)}")
        if self.num_draft_tokens is not None and (isinstance(self.num_draft_tokens, bool)
                                                  or not isinstance(self.num_draft_tokens, int)
                                                  or not 1 <= self.num_draft_tokens <= 32):
            raise RequestError(f"num_draft_tokens must be an integer in 1..32, got {self.num_draft_tokens!r}")
        if not isinstance(self.position_cost, (int, float)) or not 0 <= self.position_cost <= 10:
            raise RequestError(f"position_cost must be in [0, 10], got {self.position_cost!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise RequestError("n-gram sizes must satisfy 1 <= min_ngram <= max_ngram")

    @property
    def max_draft_tokens(self) -> int:
        """The cap on drafts per window: `num_draft_tokens`, or the drafter's default when it is unset."""
        return self.num_draft_tokens if self.num_draft_tokens is not None else DEFAULT_DRAFT_TOKENS[self.drafter]


class DrafterFactory:
    """Makes one drafter per sequence for a target model (and, for 'model', a draft model)."""

    def __init__(self, target: Model, draft_model: Model | None = None,
                 allowed_experts: ResidentExperts | None = None) -> None:
        self.target = target
        self.draft_model = draft_model
        self._resident: Model | None = None
        self._allowed = allowed_experts

    def _resident_draft(self) -> Model | None:
        """The target routed among its resident experts (`Model.resident_draft`), made once; None if it has none."""
        if self._resident is None:
            self._resident = self.target.resident_draft(self._allowed)
        return self._resident

    def check(self, config: SpeculativeConfig) -> None:
        """`RequestError` if this factory cannot make `config`'s drafter (checked when a request is made)."""
        if config.drafter == "resident" and self._resident_draft() is None:
            raise RequestError(f"drafter 'resident' restricts a K3 model's routing to its cached experts; this "
                               f"{self.target.config.model_type} model holds every expert: use 'ngram' or 'model'")
        if config.drafter == "model" and self.draft_model is None:
            raise RequestError("drafter 'model' needs a draft model, and this engine has none (--draft-model)")

    def create(self, config: SpeculativeConfig) -> Drafter:
        self.check(config)
        if config.drafter == "ngram":
            return NGramDrafter(config.max_ngram, config.min_ngram)
        if config.drafter == "resident":
            resident = self._resident_draft()
            assert resident is not None  # check() refused an architecture without one
            return ModelDrafter(resident)
        if self.draft_model.config.vocab_size != self.target.config.vocab_size:
            raise RequestError("the draft model's vocabulary differs from the target's")
        return ModelDrafter(self.draft_model)


class AdaptiveDraftLength:
    """Chooses k per window from an exponential average of the per-draft acceptance rate."""

    def __init__(self, config: SpeculativeConfig, smoothing: float = 0.3, probe_every: int = 16) -> None:
        self.max_k = config.max_draft_tokens
        self.adaptive = config.adaptive
        self.assumed_cost = config.position_cost
        self.io_aware = config.io_aware
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.acceptance = 0.7  # optimistic start: try speculating
        self._idle_steps = 0
        self.step_bytes: dict[int, float] = {}  # T -> b_T, bytes read by a step of T positions (io_aware)

    @property
    def one_position_bytes(self) -> float | None:
        return self.step_bytes.get(1)

    def window_cost(self, k: int) -> float:
        """A window of k drafts' cost relative to a one-position step: b_{k+1} / b_1 measured (io_aware, module
        docstring), else 1 + c k with the assumed c."""
        b1 = self.step_bytes.get(1)
        if not self.io_aware or not b1:
            return 1 + self.assumed_cost * k
        return self._bytes_at(k + 1) / b1

    @property
    def cost(self) -> float:
        """The mean cost of one extra position at the largest window seen, relative to a one-position step (the
        assumed c until a window is measured)."""
        sizes = sorted(t for t in self.step_bytes if t > 1)
        if not self.io_aware or not self.step_bytes.get(1) or not sizes:
            return self.assumed_cost
        return (self.window_cost(sizes[-1] - 1) - 1) / (sizes[-1] - 1)

    def _bytes_at(self, positions: int) -> float:
        b = self.step_bytes
        if positions in b:
            return b[positions]
        below = max(t for t in b if t < positions)  # 1 is always there
        above = [t for t in b if t > positions]
        if above:
            hi = min(above)
            return b[below] + (b[hi] - b[below]) * (positions - below) / (hi - below)
        if below == 1:
            return b[1] * (1 + self.assumed_cost * (positions - 1))
        previous = max(t for t in b if t < below)
        growth = max((b[below] - b[previous]) / (below - previous), 0.0)
        return b[below] + growth * (positions - below)

    def observe_step(self, positions: int, bytes_read: int) -> None:
        """One batch-1 step of this sequence: `positions` fed (1, or a window's 1 + k) and the bytes it read."""
        if positions < 1:
            return
        old = self.step_bytes.get(positions)
        sample = float(bytes_read)
        self.step_bytes[positions] = sample if old is None else (1 - self.smoothing) * old + self.smoothing * sample

    def next_k(self) -> int:
        if not self.adaptive:
            return self.max_k
        k = self.best_k(self.acceptance)
        if k == 0:
            self._idle_steps += 1
            if self._idle_steps >= self.probe_every:  # conditions change (e.g. the text starts quoting the prompt)
                self._idle_steps = 0
                return 1
        return k

    def best_k(self, a: float) -> int:
        best, best_rate = 0, 1.0  # k = 0: one token per one-token step
        for k in range(1, self.max_k + 1):
            expected = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
            rate = expected / self.window_cost(k)
            if rate > best_rate * 1.02:  # a small margin: do not speculate for nothing
                best, best_rate = k, rate
        return best

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One window's result (a drafter that proposed nothing tells us nothing about acceptance)."""
        if num_drafted == 0:
            return
        # per-draft acceptance: accepted drafts over drafts the verifier looked at (it stops at the first miss)
        looked = min(num_accepted + 1, num_drafted)
        rate = num_accepted / looked
        self.acceptance = (1 - self.smoothing) * self.acceptance + self.smoothing * rate


@dataclass
class SpeculationStats:
    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    rollback_seconds: float = 0.0
    recorded_bytes: int = 0  # rollback records, summed over windows

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def lines(self) -> list[str]:
        per_window = self.emitted / self.windows if self.windows else 0.0
        return [f"speculation       {self.windows} windows, {self.drafted} drafted, {self.accepted} accepted "
                f"({self.acceptance_rate:.0%}), {per_window:.2f} tokens/window"]


class SequenceSpeculation:
    """A sequence's speculation, in one place (`Sequence.speculation`): its config, the drafter, the adaptive draft
    length, this step's draft and the counts."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.length = AdaptiveDraftLength(config)
        self.stats = SpeculationStats()
        self.draft: Draft | None = None  # this step's draft, until the window that verifies it has run
        self.stopped = False  # the drafter failed: the sequence decodes without drafts from then on

    def propose(self, context: Sequence[int], room: int, sampler: Sampler) -> Draft:
        """Drafts for the next window; `room` = tokens the sequence may still emit (a window emits up to k + 1)."""
        k = min(self.length.next_k(), room - 1)
        return self.drafter.propose(context, k, sampler) if k > 0 else Draft([])

    def take_draft(self, k: int) -> Draft:
        """The first `k` tokens of this step's draft (what the window verified); the step's draft is spent."""
        full, self.draft = self.draft, None
        if full is None:
            raise RuntimeError("a verify window ran without a draft")
        return Draft(full.tokens[:k], None if full.probs is None else full.probs[:k])

    def stop(self) -> None:
        self.stopped = True
        self.draft = None
        self.drafter.release()

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.length.observe(num_drafted, num_accepted)
        s = self.stats
        s.windows += 1
        s.drafted += num_drafted
        s.accepted += num_accepted
        s.emitted += num_emitted
