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
The state then keeps the first n = accepted + 1 positions (model/rollback.py).

The draft length adapts per sequence (`AdaptiveDraftLength`): from the recent acceptance rate a it picks the k
that maximises expected tokens per window (1 - a^(k+1)) / (1 - a) over the window's relative cost 1 + c k, and
k = 0 (plain decode) when no k > 0 pays, probing again now and then.

Shapes: T window positions, k drafts, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from k3serve.engine.drafters import (DRAFTERS, Draft, Drafter, ModelDrafter, NGramDrafter, ResidentExperts,
                                     resident_draft_model)
from k3serve.engine.sampling import Sampler, SamplingParams, mask_logits
from k3serve.errors import RequestError
from k3serve.model.k3 import ForwardItem, K3Model
from k3serve.model.rollback import ROLLBACK_METHODS, RollbackCache

if TYPE_CHECKING:  # generate.py imports this module lazily; a runtime import here would be circular
    from k3serve.engine.generate import RunReport


@dataclass(frozen=True)
class SpeculativeConfig:
    drafter: str = "ngram"  # ngram | resident | model
    rollback: str = "projection"  # snapshot | projection
    num_draft_tokens: int = 4  # the most drafts per window (k)
    adaptive: bool = True  # adapt k to the recent acceptance rate
    position_cost: float = 0.15  # relative cost of one extra window position vs a one-token decode step
    max_ngram: int = 4
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise RequestError(f"unknown drafter {self.drafter!r}; use one of {', '.join(DRAFTERS)}")
        if self.rollback not in ROLLBACK_METHODS:
            raise RequestError(f"unknown rollback {self.rollback!r}; use one of {', '.join(ROLLBACK_METHODS)}")
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or not 1 <= self.num_draft_tokens <= 32:
            raise RequestError(f"num_draft_tokens must be an integer in 1..32, got {self.num_draft_tokens!r}")
        if not isinstance(self.position_cost, (int, float)) or not 0 <= self.position_cost <= 10:
            raise RequestError(f"position_cost must be in [0, 10], got {self.position_cost!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise RequestError("n-gram sizes must satisfy 1 <= min_ngram <= max_ngram")


class DrafterFactory:
    """Makes one drafter per sequence for a target model (and, for 'model', a draft model)."""

    def __init__(self, target: K3Model, draft_model: K3Model | None = None,
                 allowed_experts: ResidentExperts | None = None) -> None:
        self.target = target
        self.draft_model = draft_model
        self._resident: K3Model | None = None
        self._allowed = allowed_experts

    def create(self, config: SpeculativeConfig) -> Drafter:
        if config.drafter == "ngram":
            return NGramDrafter(config.max_ngram, config.min_ngram)
        if config.drafter == "resident":
            if self._resident is None:
                self._resident = resident_draft_model(self.target, self._allowed)
            return ModelDrafter(self._resident)
        if self.draft_model is None:
            raise RequestError("drafter 'model' needs a draft model (--draft-model)")
        if self.draft_model.config.vocab_size != self.target.config.vocab_size:
            raise RequestError("the draft model's vocabulary differs from the target's")
        return ModelDrafter(self.draft_model)


class AdaptiveDraftLength:
    """Chooses k per window from an exponential average of the per-draft acceptance rate."""

    def __init__(self, config: SpeculativeConfig, smoothing: float = 0.3, probe_every: int = 16) -> None:
        self.max_k = config.num_draft_tokens
        self.adaptive = config.adaptive
        self.cost = config.position_cost
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.acceptance = 0.7  # optimistic start: try speculating
        self._idle_steps = 0

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
            rate = expected / (1 + self.cost * k)
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
class Verification:
    tokens: list[int]  # accepted drafts then one token from the target: length num_accepted + 1
    num_accepted: int


def verify(logits: np.ndarray, draft: Draft, sampler: Sampler) -> Verification:
    """logits [T, V] of the window (T = len(draft) + 1) -> the tokens to emit."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise RequestError(f"{logits.shape[0]} logit rows for {k} drafts")
    if sampler.params.greedy:
        target = np.argmax(logits, axis=1)  # [T]
        a = 0
        while a < k and draft.tokens[a] == int(target[a]):
            a += 1
        return Verification(list(draft.tokens[:a]) + [int(target[a])], a)
    rng = sampler.rng
    for i, d in enumerate(draft.tokens):
        p = sampler.probabilities(logits[i])  # [V]
        q_d = 1.0 if draft.probs is None else float(draft.probs[i][d])
        if q_d > 0 and rng.random() < min(1.0, p[d] / q_d):
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
    """Per-sequence speculative state: the drafter, the adaptive draft length and the counts."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.length = AdaptiveDraftLength(config)
        self.stats = SpeculationStats()

    def propose(self, context: Sequence[int], room: int, sampler: Sampler) -> Draft:
        """Drafts for the next window; `room` = tokens the sequence may still emit (a window emits up to k + 1)."""
        k = min(self.length.next_k(), room - 1)
        return self.drafter.propose(context, k, sampler) if k > 0 else Draft([])

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.length.observe(num_drafted, num_accepted)
        s = self.stats
        s.windows += 1
        s.drafted += num_drafted
        s.accepted += num_accepted
        s.emitted += num_emitted


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


def speculative_generate(model: K3Model, prompt_ids: Sequence[int], params: SamplingParams,
                         spec: SpeculativeConfig, stop_ids: Sequence[int] = (),
                         on_token: Callable[[int], None] | None = None,
                         drafters: DrafterFactory | None = None,
                         constraint: Callable[[list[int]], np.ndarray | None] | None = None
                         ) -> tuple[list[int], RunReport]:
    """`generate` with speculation: same tokens under greedy, same distribution under sampling.
    While `constraint(tokens so far)` returns allowed ids (token healing spelling the prompt's tail out again),
    steps are plain one-token windows sampled under the mask; speculation starts once it returns None."""
    from k3serve.engine.generate import RunReport, peak_rss_bytes

    if len(prompt_ids) == 0:
        raise RequestError("the prompt is empty: give at least one token")
    sampler = Sampler(params)
    stops = set() if params.ignore_eos else set(stop_ids) | set(params.stop_token_ids)
    factory = drafters if drafters is not None else DrafterFactory(model)
    speculation = SequenceSpeculation(spec, factory.create(spec))
    cache = RollbackCache(model.new_cache(), spec.rollback)
    started = time.perf_counter()
    logits = model.forward([ForwardItem(np.asarray(prompt_ids, dtype=np.int64), cache)]).logits[0][-1]
    prefill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    context = list(prompt_ids)
    tokens = [sampler.sample(mask_logits(logits, constraint([]) if constraint is not None else None))]
    context.append(tokens[0])
    if on_token is not None:
        on_token(tokens[0])
    finish = "stop" if tokens[0] in stops else "length"
    while tokens[-1] not in stops and len(tokens) < params.max_tokens:
        allowed = constraint(tokens) if constraint is not None else None
        if allowed is not None:  # healing: one plain step under the mask, no drafts
            cache.begin_window()
            logits = model.forward([ForwardItem(np.asarray(context[-1:], dtype=np.int64), cache)]).logits[0][-1]
            cache.commit(1)
            tokens.append(sampler.sample(mask_logits(logits, allowed)))
            context.append(tokens[-1])
            if on_token is not None:
                on_token(tokens[-1])
            finish = "stop" if tokens[-1] in stops else finish
            continue
        room = params.max_tokens - len(tokens)
        draft = speculation.propose(context, room, sampler)
        cache.begin_window()
        window = np.asarray([context[-1]] + draft.tokens, dtype=np.int64)
        logits_all = model.forward([ForwardItem(window, cache, all_logits=True)]).logits[0]  # [T, V]
        result = verify(logits_all, draft, sampler)
        m = num_to_emit(result.tokens, len(tokens), room, stops)
        speculation.stats.recorded_bytes += cache.recorded_bytes
        rollback_started = time.perf_counter()
        cache.commit(m)  # positions kept: x0 and the first m - 1 emitted tokens
        speculation.stats.rollback_seconds += time.perf_counter() - rollback_started
        speculation.record(len(draft), result.num_accepted, m)
        for token in result.tokens[:m]:
            tokens.append(token)
            context.append(token)
            if on_token is not None:
                on_token(token)
        if tokens[-1] in stops:
            finish = "stop"
    speculation.drafter.release()
    decode_seconds = time.perf_counter() - started
    report = RunReport(len(prompt_ids), len(tokens), prefill_seconds, decode_seconds, peak_rss_bytes(), finish)
    report.extra_lines = speculation.stats.lines()
    report.speculation = speculation.stats  # type: ignore[attr-defined]
    return tokens, report


# ---- spec-storage ---------------------------------------------------------------------------------------------
PRECISIONS = {"fp32": 4, "bf16": 2}


def storage_report(max_window: int = 8) -> tuple[list[str], dict]:
    """Rollback bytes per sequence for the full K3, Kimi Linear and the embedded model, windows 1..max_window."""
    from k3serve.config import full_k3_config, load_config
    from k3serve.loading import default_model_dir
    from k3serve.model.rollback import KIMI_LINEAR_SHAPES, RecurrentShapes, rollback_storage

    models = [RecurrentShapes.of("Kimi K3 (full)", full_k3_config()), KIMI_LINEAR_SHAPES]
    try:
        models.append(RecurrentShapes.of("embedded default", load_config(default_model_dir())))
    except Exception as exc:  # noqa: BLE001 - the table is still useful without it
        models.append(RecurrentShapes("embedded default (unavailable: " + str(exc)[:40] + ")", 0, 1, 1, 0))
    lines: list[str] = []
    record: dict = {"models": []}
    for shapes in models:
        lines.append(f"== {shapes.name}: {shapes.num_kda_layers} KDA layers, {shapes.num_heads} heads x "
                     f"{shapes.head_dim}, conv {shapes.conv_kernel}")
        entry: dict = {"name": shapes.name, "num_kda_layers": shapes.num_kda_layers, "heads": shapes.num_heads,
                       "head_dim": shapes.head_dim, "rows": []}
        if shapes.num_kda_layers == 0:
            record["models"].append(entry)
            continue
        lines.append(f"{'T':>2} {'accounting':>10} {'prec':>4} {'snapshot MiB':>13} {'projection MiB':>15} "
                     f"{'ratio':>6} {'proj/snap':>9}")
        first_four: dict[str, int | None] = {}
        for accounting in ("anchor", "k3serve"):
            for precision, width in PRECISIONS.items():
                first_four[f"{accounting}/{precision}"] = None
                for window in range(1, max_window + 1):
                    s = rollback_storage(shapes, window, width, accounting)
                    lines.append(f"{window:>2} {accounting:>10} {precision:>4} {s.snapshot_bytes / 2**20:>13.3f} "
                                 f"{s.projection_bytes / 2**20:>15.3f} {s.ratio:>6.2f} "
                                 f"{s.projection_bytes / s.snapshot_bytes:>9.1%}")
                    entry["rows"].append({"window": window, "accounting": accounting, "precision": precision,
                                          "snapshot_bytes": s.snapshot_bytes, "projection_bytes": s.projection_bytes,
                                          "ratio": s.ratio})
                    if s.ratio >= 4 and first_four[f"{accounting}/{precision}"] is None:
                        first_four[f"{accounting}/{precision}"] = window
        entry["first_window_at_4_to_1"] = first_four
        for key, window in first_four.items():
            lines.append(f"   ratio >= 4:1 first at T = {window} ({key})" if window is not None
                         else f"   ratio never reaches 4:1 for T <= {max_window} ({key})")
        record["models"].append(entry)
    lines.append("anchor = S per snapshot vs checkpoint + T x (k, u, g) [the public estimate]; k3serve = what "
                 "RollbackCache keeps (conv tails, beta and the 3P pre-conv inputs too). The ratio does not depend "
                 "on the precision when state and vectors share one; it tends to T as D grows.")
    return lines, record
