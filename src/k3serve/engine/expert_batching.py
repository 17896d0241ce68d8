"""Decode batches chosen by shared experts (`--batch-by-experts`, issue 35 item 4).

When more sequences are ready to decode than a step takes (`EngineConfig.max_decode_seqs`), the scheduler may pick the subset whose predicted experts overlap most, so a streamed step reads fewer experts.
A sequence's prediction is the routing of its previous step's last token ([L, TOPK]: its experts in each MoE
layer, in the layers' order), which the engine records after every forward from the source's step routing.

The rule, for k seats among the ready sequences R (in the policy's order: rank, then running order):
  1. forced: the sequences passed over `max_wait` times in a row while in the baseline's first k (starved), then
     those without a prediction, in order;
  2. fairness: tiers of equal policy rank, best first; a whole tier goes in while it fits, and the greedy choice
     below works only inside the first tier that does not fit (never a sequence of a worse rank before one of a
     better rank, the starved excepted);
  3. greedy: with U the set of (layer, expert) pairs the chosen ones need,
         next = argmin_{c in tier \\ chosen} |P_c \\ U|        (ties: the earlier in order)
     until k are chosen. |U| per layer is what the step reads for those tokens' experts.

Starvation bound: a sequence the baseline (first k in order) would run and the rule leaves out is counted; after
`max_wait` such steps in a row it is forced in (max_wait 0: the baseline's batches). So a sequence is never passed
over in more than `max_wait` consecutive steps in which the baseline would have run it.

Shapes: C candidates, L MoE layers, TOPK experts per token (DROPPED slots, -1, are ignored), NE experts per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass
class Candidate:
    """A ready decode: its predicted experts ([L, TOPK] or None), its policy rank and whether it is starved."""

    predicted: np.ndarray | None
    rank: tuple = ()
    starved: bool = False


def choose_by_experts(candidates: list[Candidate], k: int) -> list[int]:
    """Indices (into `candidates`, given in policy order) of the k to run, ascending. Vectorized greedy; its twin is
    `choose_by_experts_reference`."""
    if len(candidates) <= k:
        return list(range(len(candidates)))
    chosen = _forced(candidates, k)
    if len(chosen) == k:
        return sorted(chosen)
    tier = _open_tier(candidates, chosen, k)
    if len(chosen) >= k:
        return sorted(chosen[:k])
    known = [i for i, c in enumerate(candidates) if c.predicted is not None]
    keys = _pair_keys([candidates[i].predicted for i in known])  # [C', L*TOPK] flat (layer, expert), -1 dropped
    row = {i: r for r, i in enumerate(known)}
    size = int(keys.max(initial=-1)) + 1
    covered = np.zeros(size + 1, bool)  # the last slot stands for dropped slots: always covered
    covered[-1] = True
    keys = np.where(keys >= 0, keys, size)
    for i in chosen:
        if i in row:
            covered[keys[row[i]]] = True
    free = [i for i in tier if i not in chosen]  # all predicted (the unknown are forced)
    keys = keys[[row[i] for i in free]]  # [F, L*TOPK]
    taken = np.zeros(len(free), bool)
    while len(chosen) < k:
        new = (~covered[keys]).sum(axis=1)  # [F] pairs each would add to the union
        new[taken] = np.iinfo(new.dtype).max
        best = int(np.argmin(new))  # the first minimum: the earlier in order
        taken[best] = True
        covered[keys[best]] = True
        chosen.append(free[best])
    return sorted(chosen)


def choose_by_experts_reference(candidates: list[Candidate], k: int) -> list[int]:
    """The same rule in plain Python sets, one candidate at a time (the twin of `choose_by_experts`)."""
    if len(candidates) <= k:
        return list(range(len(candidates)))
    chosen = _forced(candidates, k)
    tier = [i for i in _open_tier(candidates, chosen, k) if i not in chosen]
    union: set[tuple[int, int]] = set()
    for i in chosen:
        union |= _pairs(candidates[i].predicted)
    while len(chosen) < k:
        best, best_new = -1, None
        for i in tier:
            if i in chosen:
                continue
            new = len(_pairs(candidates[i].predicted) - union)
            if best_new is None or new < best_new:
                best, best_new = i, new
        chosen.append(best)
        union |= _pairs(candidates[best].predicted)
    return sorted(chosen)


def union_size(predictions: list[np.ndarray | None]) -> int:
    """|U|: distinct (layer, expert) pairs the predictions need together (unknown ones count nothing)."""
    union: set[tuple[int, int]] = set()
    for p in predictions:
        union |= _pairs(p)
    return len(union)


def _forced(candidates: list[Candidate], k: int) -> list[int]:
    """The starved, then those without a prediction, in order, at most k."""
    starved = [i for i, c in enumerate(candidates) if c.starved]
    unknown = [i for i, c in enumerate(candidates) if not c.starved and c.predicted is None]
    return (starved + unknown)[:k]


def _open_tier(candidates: list[Candidate], chosen: list[int], k: int) -> list[int]:
    """Add to `chosen` every whole tier of equal rank that fits (best rank first) and return the indices of the
    first tier that does not (where the greedy choice is made)."""
    tiers: dict[tuple, list[int]] = {}
    for i, c in enumerate(candidates):
        tiers.setdefault(c.rank, []).append(i)
    for rank in sorted(tiers):
        rest = [i for i in tiers[rank] if i not in chosen]
        if len(chosen) + len(rest) <= k:
            chosen.extend(rest)
            continue
        return tiers[rank]
    return []


def _pairs(predicted: np.ndarray | None) -> set[tuple[int, int]]:
    if predicted is None:
        return set()
    return {(layer, int(e)) for layer, row in enumerate(predicted) for e in row if e >= 0}


def _pair_keys(predictions: list[np.ndarray]) -> np.ndarray:
    """[C, L*TOPK] flat keys layer * NE + expert (NE = the largest id + 1 over all), -1 for dropped slots."""
    if not predictions:
        return np.zeros((0, 0), np.int64)
    stacked = np.stack(predictions).astype(np.int64)  # [C, L, TOPK]
    num_experts = int(stacked.max(initial=0)) + 1
    layers = np.arange(stacked.shape[1], dtype=np.int64)[None, :, None]  # [1, L, 1]
    keys = np.where(stacked >= 0, layers * num_experts + stacked, -1)
    return keys.reshape(stacked.shape[0], -1)


@dataclass
class PredictionQuality:
    """How well the previous step's experts predict the next step's, per sequence: sum over decode steps and MoE
    layers of |prev & next| and |next|. `overlap` = hits / pairs."""

    hits: int = 0
    pairs: int = 0

    def observe(self, previous: np.ndarray, current: np.ndarray) -> None:
        """previous, current [L, TOPK] of one sequence's consecutive steps."""
        for prev_row, row in zip(previous, current):
            kept = row[row >= 0]
            self.hits += int(np.isin(kept, prev_row[prev_row >= 0]).sum())
            self.pairs += int(kept.size)

    @property
    def overlap(self) -> float:
        return self.hits / self.pairs if self.pairs else float("nan")
