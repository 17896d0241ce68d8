"""Routing at full scale: synthetic traces fit from a measured one, a flat mode, and replay of a trace file.

A `RoutingModel` draws, for each sequence, token and MoE layer, TOPK distinct experts of NE:

    n_reuse ~ Binomial(TOPK, reuse)          experts kept from the same sequence's previous token in this layer
    the rest, one by one, without replacement:
        with probability `coactivation`, from the co-activation group (GROUP consecutive experts of the layer's
        hidden permutation) of the previous fresh pick; otherwise
        from the popularity law p_i ∝ (rank_i + 1)^-skew  (rank: a fixed random permutation per layer)

then, under `--expert-top-p`, keeps the first n of them (n drawn from `kept`, the probabilities of n = 1..TOPK;
the dropped slots are -1, as the engine's), and a next-layer guess per token for prefetch: each true expert is
named with probability `recall`, the rest of the TOPK guesses are wrong experts. Flat routing (the C engine's observation on K3: Quantile Balancing flattens
usage, 0% steady-state retention) is skew 0, reuse 0, coactivation 0, recall TOPK / NE.

Fit (`fit_routing`): from a measured trace of the trained model (64 experts, top-4), two scale-free figures:
- skew: the share of requests taken by the top 10% of a layer's experts; the full-scale `skew` exponent is
  solved so that the popularity law gives the same share at NE = 896;
- reuse: the overlap o with the previous token, corrected for chance: reuse = (o - TOPK/NE) / (1 - TOPK/NE);
- recall: the next-layer recall measured by `k3serve routing-stats` (the engine's own guess), as given.
The generated trace's own statistics are measured again and reported beside the targets.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from k3serve.errors import K3Error
from k3serve.stream.trace import Trace

GROUP = 16


class RoutingError(K3Error):
    """A routing model or trace cannot drive the simulation."""


@dataclass(frozen=True)
class RoutingModel:
    num_experts: int
    top_k: int
    skew: float = 0.0
    reuse: float = 0.0
    coactivation: float = 0.0
    recall: float | None = None  # None: chance (TOPK / NE)
    name: str = "flat"
    kept: tuple[float, ...] = ()  # --expert-top-p: P(a token keeps n experts), n = 1..TOPK; empty: all TOPK

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.num_experts < self.top_k:
            raise RoutingError(f"routing needs 1 <= top_k <= num_experts, got {self.top_k} of {self.num_experts}")
        for key in ("reuse", "coactivation"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise RoutingError(f"routing {key} must be in [0, 1], got {getattr(self, key)}")
        if self.recall is not None and not 0.0 <= self.recall <= 1.0:
            raise RoutingError(f"routing recall must be in [0, 1], got {self.recall}")
        if self.skew < 0:
            raise RoutingError(f"routing skew must be >= 0, got {self.skew}")
        if self.kept and (len(self.kept) != self.top_k or min(self.kept) < 0 or abs(sum(self.kept) - 1) > 1e-6):
            raise RoutingError(f"routing kept must be {self.top_k} probabilities (n = 1..TOPK) summing to 1, got "
                               f"{self.kept}")

    @property
    def mean_kept(self) -> float:
        return float(np.dot(np.arange(1, self.top_k + 1), self.kept)) if self.kept else float(self.top_k)

    @property
    def guess_recall(self) -> float:
        return self.top_k / self.num_experts if self.recall is None else self.recall


def flat_routing(num_experts: int, top_k: int) -> RoutingModel:
    return RoutingModel(num_experts, top_k, name="flat")


# What --expert-top-p P (min 2) kept on the embedded trained model (64 experts, top-4): {kept: (token, MoE layer)
# pairs} over 16 windows of 256 held-out code and 16 of prose (benchmarks/eval_top_p.py, docs/STREAMING.md)
MEASURED_KEPT: dict[float, tuple[int, dict[int, int]]] = {
    0.9: (4, {2: 289, 3: 4663, 4: 52392}),
    0.8: (4, {2: 2366, 3: 35875, 4: 19103}),
    0.7: (4, {2: 9676, 3: 47668}),
}


def kept_from_mean(mean: float, top_k: int) -> tuple[float, ...]:
    """P(n kept) with the given mean and the least spread: floor(mean) or the next count (a published mean such as
    colibri's 8.1 of 16 at K3_TOPP=0.7, with no histogram beside it)."""
    if not 1.0 <= mean <= top_k:
        raise RoutingError(f"experts kept must be in [1, {top_k}], got {mean}")
    low = min(int(math.floor(mean)), top_k - 1) if mean < top_k else top_k - 1
    out = [0.0] * top_k
    out[low], out[low - 1] = mean - low, 1.0 - (mean - low)  # counts low+1 and low
    return tuple(out)


def kept_from_histogram(histogram: dict[int, int], measured_top_k: int, top_k: int) -> tuple[float, ...]:
    """A kept-count histogram measured at another TOPK (the embedded model: 4), scaled by the kept share:
    n kept of `measured_top_k` -> round(n * top_k / measured_top_k) of `top_k`."""
    out = [0.0] * top_k
    total = sum(histogram.values())
    for n, count in histogram.items():
        scaled = min(max(int(round(int(n) * top_k / measured_top_k)), 1), top_k)
        out[scaled - 1] += count / total
    return tuple(out)


@dataclass
class StepRouting:
    """One forward step: for each MoE layer, each position's experts [T, TOPK] and the ranked prefetch guesses
    for that layer (made while the layer before it runs)."""
    experts: dict[int, np.ndarray]
    guesses: dict[int, list[int]]

    @property
    def num_positions(self) -> int:
        return next(iter(self.experts.values())).shape[0] if self.experts else 0


class RoutingStream:
    """Draws steps from a model: `sequences` independent sequences, each keeping its previous token's experts."""

    def __init__(self, model: RoutingModel, moe_layers: Sequence[int], seed: int) -> None:
        self.model = model
        self.layers = list(moe_layers)
        self.rng = np.random.default_rng(seed)
        ne = model.num_experts
        ranks = np.arange(ne, dtype=np.float64)
        weights = (ranks + 1.0) ** -model.skew
        self._pop = {}  # layer -> probabilities by expert id
        self._perm = {}
        for layer in self.layers:
            perm = self.rng.permutation(ne)  # perm[rank] = expert
            p = np.empty(ne)
            p[perm] = weights / weights.sum()
            self._pop[layer] = p
            self._perm[layer] = perm
        self._group_of = {layer: np.argsort(self._perm[layer]) // GROUP for layer in self.layers}
        self._previous: dict[tuple[int, int], np.ndarray] = {}

    def _draw(self, layer: int, previous: np.ndarray | None) -> np.ndarray:
        m, rng = self.model, self.rng
        chosen: list[int] = []
        if previous is not None and m.reuse > 0:
            keep = int(rng.binomial(m.top_k, m.reuse))
            keep = min(keep, len(previous))  # fewer where top-p dropped some of the previous token's
            if keep:
                chosen.extend(int(e) for e in rng.choice(previous, size=keep, replace=False))
        p = self._pop[layer].copy()
        p[chosen] = 0.0
        last_fresh = None
        while len(chosen) < m.top_k:
            if last_fresh is not None and m.coactivation > 0 and rng.random() < m.coactivation:
                group = self._group_of[layer][last_fresh]
                members = self._perm[layer][group * GROUP:(group + 1) * GROUP]
                free = [int(e) for e in members if p[e] > 0]
                if free:
                    pick = free[int(rng.integers(len(free)))]
                    chosen.append(pick)
                    p[pick] = 0.0
                    last_fresh = pick
                    continue
            pick = int(rng.choice(len(p), p=p / p.sum()))
            chosen.append(pick)
            p[pick] = 0.0
            last_fresh = pick
        if m.kept:
            chosen = chosen[:int(rng.choice(m.top_k, p=m.kept)) + 1]
        return np.array(chosen, dtype=np.int64)

    def _guess(self, truth: np.ndarray) -> list[int]:
        m, rng = self.model, self.rng
        named = [int(e) for e in truth if e >= 0 and rng.random() < m.guess_recall]
        truth_set = set(int(e) for e in truth)
        guesses = int(np.count_nonzero(truth >= 0)) if m.kept else m.top_k  # top-p trims the guess as the engine does
        while len(named) < guesses:
            e = int(rng.integers(m.num_experts))
            if e not in truth_set and e not in named:
                named.append(e)
        return named

    def step(self, positions: Sequence[int]) -> StepRouting:
        """positions[i]: the sequence of the step's i-th position (in order within each sequence)."""
        experts: dict[int, np.ndarray] = {}
        guesses: dict[int, list[int]] = {}
        for layer in self.layers:
            rows = []
            for seq in positions:
                ids = self._draw(layer, self._previous.get((seq, layer)))
                self._previous[(seq, layer)] = ids
                rows.append(ids)
            experts[layer] = _padded(rows, self.model.top_k)  # [T, TOPK], -1 where top-p dropped
            ranked: list[int] = []
            for row in rows:
                for e in self._guess(row):
                    if e not in ranked:
                        ranked.append(e)
            guesses[layer] = ranked
        return StepRouting(experts, guesses)


def replay_steps(trace: Trace, recall: float | None, seed: int,
                 guesses: dict[tuple[int, int], list[int]] | None = None) -> list[StepRouting]:
    """A recorded trace's steps in order, with the recorded prefetch guesses ({(step, layer): ranked experts},
    as the engine issued them) or, without them, guesses drawn at `recall` from the true experts."""
    ne, top_k = int(trace.meta["num_experts"]), int(trace.meta["top_k"])
    guesser = RoutingStream(RoutingModel(ne, top_k, recall=recall, name="replay"), [], seed)
    by_step: dict[int, dict[int, list]] = {}
    for step, _token, layer, ids in trace.records:
        by_step.setdefault(step, {}).setdefault(layer, []).append(np.array(ids, dtype=np.int64))
    out = []
    for step in sorted(by_step):
        layers = by_step[step]
        experts = {l: _padded(rows, top_k) for l, rows in layers.items()}
        step_guesses = {}
        for l, rows in layers.items():
            if guesses is not None:
                step_guesses[l] = list(guesses.get((step, l), []))
                continue
            ranked: list[int] = []
            for row in rows:
                for e in guesser._guess(row):
                    if e not in ranked:
                        ranked.append(e)
            step_guesses[l] = ranked
        out.append(StepRouting(experts, step_guesses))
    return out


def _padded(rows: list[np.ndarray], top_k: int) -> np.ndarray:
    """Rows of up to TOPK experts (fewer where --expert-top-p dropped some) -> [T, TOPK], -1 in dropped slots."""
    out = np.full((len(rows), top_k), -1, np.int64)
    for t, ids in enumerate(rows):
        out[t, :len(ids)] = ids
    return out


# ---- statistics and fit ---------------------------------------------------------------------------------------
def top_decile_share(counts: np.ndarray) -> float:
    top = max(1, int(round(len(counts) / 10)))
    ordered = np.sort(counts)[::-1]
    return float(ordered[:top].sum() / max(ordered.sum(), 1))


def law_share(skew: float, num_experts: int) -> float:
    w = (np.arange(num_experts) + 1.0) ** -skew
    return top_decile_share(w)


def solve_skew(share: float, num_experts: int) -> float:
    """The exponent whose popularity law gives the top 10% of `num_experts` this share of requests."""
    if share <= law_share(0.0, num_experts) + 1e-9:
        return 0.0
    lo, hi = 0.0, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if law_share(mid, num_experts) < share:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class RoutingStats:
    skew_top10: float  # share of requests on the top 10% of each layer's experts (mean over layers)
    reuse_prev: float  # share of a token's experts its predecessor (same sequence) also chose
    num_tokens: int


def token_stats(layer_rows: dict[int, list[np.ndarray]], num_experts: int) -> RoutingStats:
    """layer -> the experts of consecutive tokens of one sequence (in order)."""
    skews, reuses, tokens = [], [], 0
    for rows in layer_rows.values():
        counts = np.zeros(num_experts, np.int64)
        overlap = []
        for i, ids in enumerate(rows):
            np.add.at(counts, ids, 1)
            if i:
                overlap.append(len(set(ids.tolist()) & set(rows[i - 1].tolist())) / len(ids))
        skews.append(top_decile_share(counts))
        if overlap:
            reuses.append(float(np.mean(overlap)))
        tokens = max(tokens, len(rows))
    return RoutingStats(float(np.mean(skews)) if skews else float("nan"),
                        float(np.mean(reuses)) if reuses else float("nan"), tokens)


def trace_stats(trace: Trace) -> RoutingStats:
    rows: dict[int, list[np.ndarray]] = {}
    for _step, _token, layer, ids in sorted(trace.records, key=lambda r: (r[2], r[1])):
        rows.setdefault(layer, []).append(np.array(ids, dtype=np.int64))
    return token_stats(rows, int(trace.meta["num_experts"]))


@dataclass
class RoutingFit:
    measured: RoutingStats
    measured_num_experts: int
    measured_top_k: int
    model: RoutingModel
    generated: RoutingStats
    recall_source: str
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        m, g, r = self.measured, self.generated, self.model
        uniform_small = self.measured_top_k / self.measured_num_experts
        uniform_full = r.top_k / r.num_experts
        return [
            f"routing fit: measured {m.num_tokens} tokens x {self.measured_num_experts} experts top-"
            f"{self.measured_top_k}; generated {g.num_tokens} tokens x {r.num_experts} top-{r.top_k}",
            f"  top-10% share   measured {m.skew_top10:.1%} (uniform 10%) -> skew exponent {r.skew:.3f} -> "
            f"generated {g.skew_top10:.1%}",
            f"  reuse prev tok  measured {m.reuse_prev:.1%} (chance {uniform_small:.1%}) -> reuse {r.reuse:.3f} "
            f"-> generated {g.reuse_prev:.1%} (chance {uniform_full:.1%})",
            f"  next-layer recall {r.guess_recall:.1%} ({self.recall_source})",
            f"  co-activation   {r.coactivation:.2f} (not fit: set by hand)",
        ]

    def to_dict(self) -> dict:
        return {"measured": asdict(self.measured), "generated": asdict(self.generated), "model": asdict(self.model),
                "measured_num_experts": self.measured_num_experts, "measured_top_k": self.measured_top_k,
                "recall_source": self.recall_source}


# measured on the shipped trained model (docs/MODEL.md, `k3serve routing-stats`): mean next-layer recall@4
DEFAULT_RECALL = 0.65


def fit_routing(trace: Trace, num_experts: int, top_k: int, recall: float | None = None,
                coactivation: float = 0.0, check_tokens: int = 64, seed: int = 0) -> RoutingFit:
    measured = trace_stats(trace)
    ne_small, k_small = int(trace.meta["num_experts"]), int(trace.meta["top_k"])
    if not math.isfinite(measured.reuse_prev):
        raise RoutingError("the trace has no consecutive tokens to measure reuse from")
    chance = k_small / ne_small
    reuse = min(max((measured.reuse_prev - chance) / (1 - chance), 0.0), 1.0)
    skew = solve_skew(measured.skew_top10, num_experts)
    model = RoutingModel(num_experts, top_k, skew=skew, reuse=reuse, coactivation=coactivation,
                         recall=DEFAULT_RECALL if recall is None else recall, name="skewed")
    generated = generated_stats(model, list(range(1, 1 + min(8, 92))), check_tokens, seed)
    return RoutingFit(measured, ne_small, k_small, model, generated,
                      "given" if recall is not None else "docs/MODEL.md routing-stats mean, 65%")


def generated_stats(model: RoutingModel, layers: Sequence[int], tokens: int, seed: int) -> RoutingStats:
    stream = RoutingStream(model, layers, seed)
    rows: dict[int, list[np.ndarray]] = {l: [] for l in layers}
    for _ in range(tokens):
        step = stream.step([0])
        for l in layers:
            rows[l].append(step.experts[l][0])
    return token_stats(rows, model.num_experts)
