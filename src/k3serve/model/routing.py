"""What a router decides, as data: `Routing` (each token's experts and weights) and `ExpertPairs` (the step's
(token, expert) pairs grouped by expert, what per-expert calls work on). Shared by every model's MoE, the expert
sources (model/expert_source.py) and the simulator. Shapes: T tokens, TOPK active, K distinct experts, N = T*TOPK.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Routing:
    expert_ids: np.ndarray  # [T, TOPK] int64, best first
    weights: np.ndarray  # [T, TOPK] float32


@dataclass(frozen=True)
class ExpertPairs:
    """A step's (token, expert) pairs sorted by expert, tokens ascending within each: what the per-expert calls (and
    the expert owners' calls, cluster/expert_parallel.py) work on, and what the simulator sizes those calls from."""
    expert_ids: np.ndarray  # [K] the distinct experts, ascending
    starts: np.ndarray  # [K] first pair of each expert
    ends: np.ndarray  # [K]
    tokens: np.ndarray  # [N] int64, the token of each pair
    order: np.ndarray  # [N] each pair's index in the flattened [T*TOPK] routing


def pairs_by_expert(expert_ids: np.ndarray) -> ExpertPairs:
    """expert_ids [T, TOPK] -> the pairs grouped by expert (N = T*TOPK)."""
    flat = np.ascontiguousarray(expert_ids, dtype=np.int64).ravel()  # [T*TOPK]
    if flat.size and flat.min() < 0:
        raise ValueError(f"expert ids must be >= 0, got {int(flat.min())}")
    num_experts = int(flat.max()) + 1 if flat.size else 0
    order = np.empty(flat.size, np.int64)  # by expert, tokens ascending within each expert (a stable sort)
    counts = np.zeros(num_experts, np.int64)
    _counting_sort(flat, order, counts)
    present = np.flatnonzero(counts)
    ends = np.cumsum(counts)[present]
    top_k = max(expert_ids.shape[1], 1)
    return ExpertPairs(present, ends - counts[present], ends, order // top_k, order)


@njit(cache=True)
def _counting_sort(flat: np.ndarray, order: np.ndarray, counts: np.ndarray) -> None:
    """order = the stable argsort of flat (values 0..len(counts)-1); counts[v] = how many equal v."""
    for v in flat:
        counts[v] += 1
    next_slot = np.empty_like(counts)
    total = 0
    for v in range(counts.shape[0]):
        next_slot[v] = total
        total += counts[v]
    for i in range(flat.shape[0]):
        order[next_slot[flat[i]]] = i
        next_slot[flat[i]] += 1
