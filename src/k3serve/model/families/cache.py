"""Per-sequence state of a family model, behind the same `SequenceCache` seam as K3.

A family model has two kinds of token mixer, and each layer's state is one of:
- attention rows (`mla_append` / `mla_rows`): what an attention layer keeps per position, one row of fixed width.
  GQA layers store [k (NKV*hd) | v (NKV*hd)] after the key norm and rotary embedding; MLA layers store
  [latent (KL) | k_rope (DR)], the rope part already rotated.
- a recurrent state (`kda_state` / `set_kda_state`): the delta-rule state S [NH, Dk, Dv] of a KDA or gated DeltaNet
  layer, plus the last K-1 inputs of its short convolution [K-1, C].
The method names are the K3 ones (the K3 engine calls them), but nothing here is K3-specific.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3serve.model.state import SequenceCache


@dataclass(frozen=True)
class CacheLayout:
    """Which layers keep which state, and its shapes."""

    row_widths: dict[int, int] = field(default_factory=dict)  # attention layer -> values per position
    recurrent_shapes: dict[int, tuple[tuple[int, int, int], tuple[int, int]]] = field(default_factory=dict)
    # recurrent layer -> (S shape [NH, Dk, Dv], conv tail shape [K-1, C])


class FamilyCache(SequenceCache):
    """Contiguous state of one sequence: growable attention rows and one recurrent state per layer."""

    def __init__(self, layout: CacheLayout, initial_capacity: int = 64) -> None:
        self.layout = layout
        self._states = {l: np.zeros(s, np.float32) for l, (s, _) in layout.recurrent_shapes.items()}
        self._tails = {l: np.zeros(t, np.float32) for l, (_, t) in layout.recurrent_shapes.items()}
        self._rows = {l: np.zeros((initial_capacity, w), np.float32) for l, w in layout.row_widths.items()}
        self._lengths = {l: 0 for l in layout.row_widths}
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def kda_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self._states[layer], self._tails[layer]

    def set_kda_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self._states[layer] = state
        self._tails[layer] = conv_tail

    def mla_append(self, layer: int, rows: np.ndarray) -> None:
        buffer, length = self._rows[layer], self._lengths[layer]
        if length + len(rows) > len(buffer):
            grown = np.zeros((max(2 * len(buffer), length + len(rows)), buffer.shape[1]), np.float32)
            grown[:length] = buffer[:length]
            self._rows[layer] = buffer = grown
        buffer[length:length + len(rows)] = rows
        self._lengths[layer] = length + len(rows)

    def mla_rows(self, layer: int) -> np.ndarray:
        return self._rows[layer][: self._lengths[layer]]

    def advance(self, num_new_tokens: int) -> None:
        self._num_tokens += num_new_tokens

    def check_integrity(self) -> None:
        """Every attention layer holds exactly one row per processed position."""
        for layer, length in self._lengths.items():
            if length != self._num_tokens:
                raise AssertionError(f"layer {layer} caches {length} rows for {self._num_tokens} tokens")

    def nbytes(self) -> int:
        recurrent = sum(s.nbytes for s in self._states.values()) + sum(t.nbytes for t in self._tails.values())
        return recurrent + sum(self._lengths[l] * w * 4 for l, w in self.layout.row_widths.items())
