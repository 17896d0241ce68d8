"""A K3 weight source whose routers choose only among allowed experts: the `resident` speculative drafter is the
target model over it (`K3Model.resident_draft`), routed among the experts its source holds in RAM."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from k3serve.model.weights import ForwardingSource, LayerWeights, MoEWeights, WeightSource

ResidentExperts = Callable[[int], "set[int] | frozenset[int] | None"]


class RestrictedRoutingSource(ForwardingSource):
    """A weight source whose routers may only choose among allowed experts per layer.

    Wraps another source; `allowed(layer)` gives the allowed expert ids (None = the source's resident experts, all
    for a resident source). Disallowed experts get a router bias of -inf, so top-k selection skips them; mixing
    weights still come from the unbiased scores of the chosen experts, exactly as in the unrestricted router.
    Layers with fewer than TOPK allowed experts run unrestricted (the draft would otherwise be undefined).
    A draft's forwards are not the target's steps: they neither prefetch (no disk reads) nor enter step counters
    or routing traces."""

    def __init__(self, source: WeightSource, allowed: ResidentExperts | None = None) -> None:
        super().__init__(source)
        self.allowed = allowed if allowed is not None else source.resident_experts
        self._cache: dict[tuple[int, frozenset[int]], LayerWeights] = {}

    def begin_step(self, num_tokens: int) -> None:
        pass

    @property
    def prefetching(self) -> bool:
        return False

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        pass

    def layer(self, layer: int) -> LayerWeights:
        weights = self.inner.layer(layer)
        allowed = self.allowed(layer)
        if allowed is None or not isinstance(weights.mlp, MoEWeights) \
                or len(allowed) < self.config.num_experts_per_token or len(allowed) >= self.config.num_experts:
            return weights
        key = (layer, frozenset(allowed))
        cached = self._cache.get(key)
        if cached is None:
            bias = np.full_like(weights.mlp.router_bias, -np.inf)
            ids = np.fromiter(allowed, dtype=np.int64)
            bias[ids] = weights.mlp.router_bias[ids]
            cached = dataclasses.replace(weights, mlp=dataclasses.replace(weights.mlp, router_bias=bias))
            self._cache = {k: v for k, v in self._cache.items() if k[0] != layer}  # one entry per layer
            self._cache[key] = cached
        return cached
