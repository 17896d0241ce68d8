"""Attention residuals (K3_SPEC section 5): each layer reads a learned softmax mix of block snapshots.

    AttnRes(sources, query) = sum_i softmax_i(RMSNorm(s_i) . query) * s_i
with query = norm_weight * proj_weight (one vector per use), RMSNorm without weight for the keys, and the raw
sources (not the keys) mixed. Everything here is per token: nothing crosses positions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit


def attn_res(sources: Sequence[np.ndarray], query: np.ndarray, eps: float) -> np.ndarray:
    """sources: S arrays [T, H]; query [H] -> [T, H]."""
    stacked = np.stack(sources).astype(np.float32, copy=False)  # [S, T, H]
    out = np.empty(stacked.shape[1:], np.float32)  # [T, H]
    _attn_res(stacked, np.ascontiguousarray(query, dtype=np.float32), np.float32(eps), out)
    return out


@njit(cache=True)
def _attn_res(stacked: np.ndarray, query: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """One compiled pass per token: the RMSNorm keys' dot with the query (sums in float64), the softmax over the
    sources, then the mix of the raw sources. Each token's bits depend on its own rows only."""
    num_sources, num_tokens, width = stacked.shape
    scores = np.empty(num_sources, np.float32)
    for t in range(num_tokens):
        for s in range(num_sources):
            square, dot = 0.0, 0.0
            for h in range(width):
                value = np.float64(stacked[s, t, h])
                square += value * value
                dot += value * query[h]
            scores[s] = np.float32(dot / np.sqrt(square / width + eps))
        top = scores.max()
        total = np.float32(0.0)
        for s in range(num_sources):
            scores[s] = np.exp(scores[s] - top)
            total += scores[s]
        for s in range(num_sources):
            scores[s] /= total
        for h in range(width):
            mixed = np.float32(0.0)
            for s in range(num_sources):
                mixed += scores[s] * stacked[s, t, h]
            out[t, h] = mixed
