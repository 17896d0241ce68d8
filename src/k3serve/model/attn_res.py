"""Attention residuals (K3_SPEC section 5): each layer reads a learned softmax mix of block snapshots.

    AttnRes(sources, query) = sum_i softmax_i(RMSNorm(s_i) . query) * s_i
with query = norm_weight * proj_weight (one vector per use), RMSNorm without weight for the keys, and the raw
sources (not the keys) mixed. Everything here is per token: nothing crosses positions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from k3serve.model.ops import rms_norm, softmax


def attn_res(sources: Sequence[np.ndarray], query: np.ndarray, eps: float) -> np.ndarray:
    """sources: S arrays [T, H]; query [H] -> [T, H]."""
    stacked = np.stack(sources)  # [S, T, H]
    scores = rms_norm(stacked, None, eps) @ query  # [S, T]
    weights = softmax(scores, axis=0)
    return np.einsum("st,sth->th", weights, stacked)
