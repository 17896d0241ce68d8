"""What a router decides, as data: `Routing` (each token's experts and weights) and `ExpertPairs` (the step's
(token, expert) pairs grouped by expert, what per-expert calls work on). Shared by every model's MoE, the expert
sources (model/expert_source.py) and the simulator. Shapes: T tokens, TOPK active, K distinct experts, N = T*TOPK
(fewer when slots are dropped).

Fewer experts by the router's own weights (`--expert-top-p P`, opt-in; colibri's K3_TOPP): per token, with the
chosen experts' weights w_1..w_TOPK sorted descending and q_i = w_i / sum_j w_j,

    n = max(min_kept, smallest n with q_1 + ... + q_n >= P)          (n <= TOPK)

the n heaviest are kept and the rest dropped: their slot holds `DROPPED` (-1) and weight 0, after the kept ones.
Kept weights are renormalized over the kept set when the router renormalizes over its chosen set (K3's
moe_renormalize: w_e = s_e / sum_{kept} s * routed_scaling_factor), and kept as they are when it does not.
P = 1 keeps every slot untouched (the same arrays, so the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from k3serve.errors import ConfigError


@dataclass(frozen=True)
class Routing:
    expert_ids: np.ndarray  # [T, TOPK] int64, best first
    weights: np.ndarray  # [T, TOPK] float32


DROPPED = -1  # an expert slot that top-p dropped (after the kept ones in its row, weight 0)


@dataclass(frozen=True)
class ExpertTopP:
    """The top-p rule's two knobs. `min_kept` defaults to 2: K3's routed path ends in an RMSNorm of the weighted
    sum, which removes its scale, so one kept expert would hand the layer that expert's output direction alone;
    two keep a mixture. At K3's 16 active it rarely binds (colibri keeps ~8 at P = 0.7)."""

    top_p: float = 1.0
    min_kept: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--expert-top-p must be in (0, 1], got {self.top_p}")
        if self.min_kept < 1:
            raise ConfigError(f"--expert-top-p-min must be >= 1, got {self.min_kept}")

    @property
    def active(self) -> bool:
        return self.top_p < 1.0


def keep_top_p(routing: Routing, limit: ExpertTopP, renormalize: bool) -> Routing:
    """The routing with each token's lightest experts dropped (the module docstring's rule). Rows keep TOPK
    slots: kept experts first in their original order, then DROPPED slots of weight 0."""
    if not limit.active:
        return routing
    ids, weights = routing.expert_ids, routing.weights  # [T, TOPK]
    T, top_k = ids.shape
    order = np.argsort(-weights, axis=1, kind="stable")  # [T, TOPK] heaviest first, ties to the earlier slot
    ranked = np.take_along_axis(weights, order, axis=1).astype(np.float64)
    totals = ranked.sum(axis=1, keepdims=True)  # [T, 1]
    cumulative = np.cumsum(ranked / np.where(totals > 0, totals, 1.0), axis=1)  # [T, TOPK]
    reached = np.sum(cumulative < limit.top_p, axis=1) + 1  # the smallest n whose share reaches P
    num_kept = np.clip(np.maximum(reached, limit.min_kept), 1, top_k)  # [T]
    keep = np.zeros((T, top_k), bool)
    np.put_along_axis(keep, order, np.arange(top_k)[None, :] < num_kept[:, None], axis=1)
    slot = np.argsort(~keep, axis=1, kind="stable")  # kept slots first, each group in original order
    new_ids = np.where(np.take_along_axis(keep, slot, axis=1), np.take_along_axis(ids, slot, axis=1), DROPPED)
    new_weights = np.where(new_ids >= 0, np.take_along_axis(weights, slot, axis=1), np.float32(0))
    if renormalize:  # the router's normalisation over the kept set: w_e * (sum of all) / (sum of kept)
        kept_sum = new_weights.sum(axis=1, keepdims=True)  # [T, 1]
        cut = (num_kept < top_k)[:, None] & (kept_sum > 0)  # rows that keep every slot keep their bits
        new_weights = np.where(cut, new_weights * (weights.sum(axis=1, keepdims=True) / np.where(cut, kept_sum, 1)),
                               new_weights)
    return Routing(expert_ids=new_ids.astype(np.int64), weights=new_weights.astype(np.float32))


class KeptExperts:
    """How many experts each (token, MoE layer) kept: counts[n] = pairs that kept n (0..TOPK)."""

    def __init__(self, top_k: int) -> None:
        self.counts = np.zeros(top_k + 1, np.int64)

    def add(self, expert_ids: np.ndarray) -> None:
        """expert_ids [T, TOPK], DROPPED slots excluded."""
        _count_kept(np.ascontiguousarray(expert_ids, dtype=np.int64), self.counts)

    @property
    def num_pairs(self) -> int:
        return int(self.counts.sum())

    @property
    def mean(self) -> float:
        n = self.num_pairs
        return float(np.dot(np.arange(self.counts.shape[0]), self.counts) / n) if n else float("nan")

    def histogram(self) -> dict[int, int]:
        return {n: int(c) for n, c in enumerate(self.counts) if c}

    def line(self) -> str:
        top_k = self.counts.shape[0] - 1
        shares = ", ".join(f"{n}: {100 * c / max(self.num_pairs, 1):.1f}%" for n, c in self.histogram().items())
        return f"experts kept      {self.mean:.2f} of {top_k} per token and layer ({shares})"


@njit(cache=True)
def _count_kept(expert_ids: np.ndarray, counts: np.ndarray) -> None:
    """counts[n] += the rows of expert_ids [T, TOPK] with n slots kept (>= 0), in one compiled call."""
    for t in range(expert_ids.shape[0]):
        kept = 0
        for j in range(expert_ids.shape[1]):
            kept += expert_ids[t, j] >= 0
        counts[kept] += 1


@dataclass(frozen=True)
class ExpertPairs:
    """A step's (token, expert) pairs sorted by expert, tokens ascending within each: what the per-expert calls (and
    the expert owners' calls, cluster/expert_parallel.py) work on, and what the simulator sizes those calls from."""
    expert_ids: np.ndarray  # [K] the distinct experts, ascending
    starts: np.ndarray  # [K] first pair of each expert
    ends: np.ndarray  # [K]
    tokens: np.ndarray  # [N] int64, the token of each pair
    order: np.ndarray  # [N] each pair's index in the flattened [T*TOPK] routing


# Tokens of a prompt that one call runs through a family's mixer (`Batch.row_groups`: projections, conv, gates,
# queries) or its dense or shared MLP, and (EXPERT_CHUNK_TOKENS) through the routed experts where they are resident
# (K3's stacked layers, the families' ExpertStore). Those calls' buffers scale with their tokens and were prefill's
# peak memory at 2048 tokens (the experts' pair rows 134 MB in Qwen3-30B-A3B's widths and 240 MiB in the widened
# K3's, a dense MLP's gate and up rows 368 MB in Moonlight's layer 0, KDA's inputs 546 MB in Kimi Linear's). The
# experts' buffers hold top-k rows a token, so they take the smaller chunk: 512 -> 256 took another ~60 MiB off the
# MoE call with a 2048-token prefill no slower (Qwen3-MoE MXFP4 204 / 206 tok/s, widened K3 277 / 300, medians of 3
# alternated in one process). The trunk's calls keep 512: a bf16 trunk widens each matrix once a call, and at 256
# Qwen3-Next's bf16 prefill fell 238 -> 192 tok/s (peers matrix, 512 tokens). Each token gets the same bits
# whatever the other tokens of its call (bar BLAS's blocking), and its experts are still added in ascending id.
PREFILL_CHUNK_TOKENS = 512
EXPERT_CHUNK_TOKENS = 256


def pairs_by_expert(expert_ids: np.ndarray) -> ExpertPairs:
    """expert_ids [T, TOPK] -> the pairs grouped by expert (N = T*TOPK less the DROPPED slots)."""
    flat = np.ascontiguousarray(expert_ids, dtype=np.int64).ravel()  # [T*TOPK]
    if flat.size and flat.min() < 0:
        if flat.min() < DROPPED:
            raise ValueError(f"expert ids must be >= 0 (or {DROPPED}, a dropped slot), got {int(flat.min())}")
        kept = np.flatnonzero(flat >= 0)  # [N]
        pairs = pairs_by_expert(flat[kept].reshape(-1, 1))
        top_k = max(expert_ids.shape[1], 1)
        order = kept[pairs.order]
        return ExpertPairs(pairs.expert_ids, pairs.starts, pairs.ends, order // top_k, order)
    order, tokens = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)  # [N]
    groups = np.empty((3, flat.size), np.int64)  # [3, N]: experts present, starts, ends (K <= N filled)
    count = _group_by_expert(flat, max(expert_ids.shape[1], 1), order, tokens, groups)
    return ExpertPairs(groups[0, :count], groups[1, :count], groups[2, :count], tokens, order)


@njit(cache=True)
def _group_by_expert(flat: np.ndarray, top_k: int, order: np.ndarray, tokens: np.ndarray, groups: np.ndarray) -> int:
    """flat [N] expert ids >= 0 -> order [N] (by expert, tokens ascending within each expert: a stable sort),
    tokens [N] (the token of each pair) and, in groups [3, N], the K experts present (ascending), their starts and
    ends; returns K. One compiled call that returns no array (numba's boxing of a returned array costs more than
    the work here)."""
    num_experts = 0
    for v in flat:
        num_experts = max(num_experts, v + 1)
    counts = np.zeros(num_experts, np.int64)
    _counting_sort(flat, order, counts)
    k, total = 0, 0
    for e in range(num_experts):
        if counts[e]:
            groups[0, k], groups[1, k], groups[2, k] = e, total, total + counts[e]
            k += 1
        total += counts[e]
    for i in range(flat.shape[0]):
        tokens[i] = order[i] // top_k
    return k


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
