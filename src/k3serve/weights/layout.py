"""Expert order within each layer of the packed store, from a routing trace.

- natural: expert id order.
- frequency: most requested first, so that a hot set is contiguous.
- coactivation: a chain through the co-activation graph. C[i, j] counts the tokens that chose both i and j in
  the layer; starting from the most popular expert, append the unplaced expert with the largest C[last, j]
  (ties: more popular, then lower id); when the last expert has no unplaced partner, restart from the most
  popular unplaced one. Experts chosen together for one token then sit side by side, so their misses
  coalesce into one read.

Shapes: NE experts of a layer, N tokens of the trace.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

LAYOUTS = ("natural", "frequency", "coactivation")


def coactivation_matrix(token_sets: Iterable[Sequence[int]], num_experts: int) -> np.ndarray:
    """int64 [NE, NE]: C[i, j] = tokens that chose both i and j (i != j); C[i, i] = tokens that chose i."""
    counts = np.zeros((num_experts, num_experts), np.int64)  # [NE, NE]
    for chosen in token_sets:
        ids = np.unique(np.asarray(chosen, dtype=np.int64))
        counts[np.ix_(ids, ids)] += 1
    return counts


def popularity(token_sets: Iterable[Sequence[int]], num_experts: int) -> np.ndarray:
    counts = np.zeros(num_experts, np.int64)
    for chosen in token_sets:
        np.add.at(counts, np.unique(np.asarray(chosen, dtype=np.int64)), 1)
    return counts


def frequency_order(counts: np.ndarray) -> list[int]:
    return [int(e) for e in np.lexsort((np.arange(len(counts)), -counts))]


def coactivation_order(matrix: np.ndarray) -> list[int]:
    num_experts = matrix.shape[0]
    pop = np.diag(matrix).astype(np.int64)
    by_popularity = frequency_order(pop)
    placed = np.zeros(num_experts, bool)
    order: list[int] = []
    last: int | None = None
    while len(order) < num_experts:
        candidate = None
        if last is not None:
            row = np.where(placed, -1, matrix[last]).astype(np.int64)
            row[last] = -1
            best = int(row.max())
            if best > 0:
                ties = np.flatnonzero(row == best)
                candidate = int(ties[np.lexsort((ties, -pop[ties]))[0]])
        if candidate is None:
            candidate = next(e for e in by_popularity if not placed[e])
        placed[candidate] = True
        order.append(candidate)
        last = candidate
    return order


def layer_order(layout: str, num_experts: int, token_sets: Sequence[Sequence[int]] | None) -> list[int]:
    """The file order of one layer's experts. `token_sets`: the experts chosen by each token of a trace."""
    if layout == "natural":
        return list(range(num_experts))
    if token_sets is None:
        raise ValueError(f"layout {layout!r} needs a routing trace")
    if layout == "frequency":
        return frequency_order(popularity(token_sets, num_experts))
    if layout == "coactivation":
        return coactivation_order(coactivation_matrix(token_sets, num_experts))
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def adjacency_score(order: Sequence[int], matrix: np.ndarray) -> int:
    """Co-activations between neighbours in `order`: how many token-pairs a layout makes adjacent."""
    return int(sum(matrix[a, b] for a, b in zip(order, order[1:])))
