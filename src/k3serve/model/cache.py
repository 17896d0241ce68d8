"""Per-sequence model state: the layout a model exports, the seam the layers write through, and a dense cache.

Every token mixer keeps one of two kinds of state per sequence:
- attention rows: one row of fixed width W per position (K3 and DeepSeek-V3 MLA: [latent KL | k_rope DR];
  GQA: [k (NKV*hd) | v (NKV*hd)] after the key norm and rotary embedding);
- a recurrent state: S [NH, Dk, Dv] of a delta-rule layer (KDA, gated DeltaNet) plus the last K-1 inputs of its
  short convolution, the conv tail [K-1, C].
A model exports a `CacheLayout` (which layers keep which state, and its shapes). The engine builds its block pool,
state pool and prefix cache from that layout alone, and the layers read and write only through `SequenceCache`,
so nothing below knows which model runs and nothing above knows a layer's internals.

Speculative rollback hooks in through `record_window`: a recurrent layer that consumes a multi-token segment hands
the cache a `RecurrentWindow` that can rebuild its state after any number of the segment's positions; a plain cache
ignores it (model/rollback.py records it).

Shapes: W row width, n cached positions, t new positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np

from k3serve.errors import ConfigError

FLOAT32_BYTES = 4

StateShapes = tuple[tuple[int, ...], tuple[int, int]]  # (S shape [NH, Dk, Dv], conv tail shape [K-1, C])


@dataclass(frozen=True)
class CacheLayout:
    """Which layers keep which per-sequence state, and its shapes. Exported by every model (`model.cache_layout`)."""

    row_widths: Mapping[int, int] = field(default_factory=dict)  # attention layer -> values per position
    recurrent_shapes: Mapping[int, StateShapes] = field(default_factory=dict)  # recurrent layer -> its shapes

    def __post_init__(self) -> None:
        both = set(self.row_widths) & set(self.recurrent_shapes)
        if both:
            raise ConfigError(f"cache layout: layers {sorted(both)} are both attention and recurrent")
        if any(width < 1 for width in self.row_widths.values()):
            raise ConfigError(f"cache layout: row widths must be positive, got {dict(self.row_widths)}")
        for layer, (state, tail) in self.recurrent_shapes.items():
            if len(tail) != 2 or any(d < 0 for d in tuple(state) + tuple(tail)):
                raise ConfigError(f"cache layout: layer {layer} has state shapes {state}, {tail}")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.row_widths))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.recurrent_shapes))

    @property
    def row_width(self) -> int:
        """The widest attention row (the paged pool's row width; narrower layers use a prefix of it)."""
        return max(self.row_widths.values(), default=0)

    @property
    def position_bytes(self) -> int:
        """Bytes one position takes in the paged pool, over every attention layer."""
        return len(self.row_widths) * self.row_width * FLOAT32_BYTES


class RecurrentWindow(Protocol):
    """What a recurrent layer records about one multi-token segment, enough to rebuild its state after any prefix
    of the segment (speculative rollback). Implemented for the delta rule by `model.replay.DeltaRuleWindow`."""

    @property
    def num_positions(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def detached(self) -> RecurrentWindow:
        """A copy that owns its arrays (the state it starts from is a view the layer overwrites next)."""

    def state_after(self, num_kept: int) -> tuple[np.ndarray, np.ndarray]:
        """(state, conv tail) after the first `num_kept` positions, 1 <= num_kept <= num_positions."""

    def all_states(self) -> tuple[np.ndarray, np.ndarray]:
        """Every intermediate (states [T, ...], conv tails [T, K-1, C]) after positions 1..T."""


class SequenceCache(ABC):
    """The state of one sequence as the layers see it."""

    @property
    @abstractmethod
    def layout(self) -> CacheLayout: ...

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Positions already processed (the next token's position)."""

    @abstractmethod
    def recurrent_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(S, conv tail) of a recurrent layer; zeros for a fresh sequence."""

    @abstractmethod
    def set_recurrent_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None: ...

    @abstractmethod
    def append_rows(self, layer: int, rows: np.ndarray) -> None:
        """Append [t, W] rows for the new positions of an attention layer."""

    @abstractmethod
    def attention_rows(self, layer: int) -> np.ndarray:
        """All cached rows of an attention layer, [n, W], oldest first."""

    @abstractmethod
    def advance(self, num_new_tokens: int) -> None:
        """Called once per forward after every layer has written its state."""

    def record_window(self, layer: int, window: RecurrentWindow) -> None:
        """Called by a recurrent layer for a multi-token segment just before it replaces its state. Speculative
        rollback records here (model/rollback.py); plain caches ignore it."""

    def truncate(self, num_tokens: int) -> None:
        """Forget attention rows at positions >= num_tokens and move the position back there (speculative
        rollback; the caller restores the recurrent state)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be truncated")


class DenseSequenceCache(SequenceCache):
    """Contiguous state of one sequence: growable attention rows and one recurrent state per layer."""

    def __init__(self, layout: CacheLayout, initial_capacity: int = 64) -> None:
        self._layout = layout
        self._states = {l: np.zeros(s, np.float32) for l, (s, _) in layout.recurrent_shapes.items()}
        self._tails = {l: np.zeros(t, np.float32) for l, (_, t) in layout.recurrent_shapes.items()}
        self._rows = {l: np.zeros((initial_capacity, w), np.float32) for l, w in layout.row_widths.items()}
        self._lengths = {l: 0 for l in layout.row_widths}
        self._num_tokens = 0

    @property
    def layout(self) -> CacheLayout:
        return self._layout

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def recurrent_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self._states[layer], self._tails[layer]

    def set_recurrent_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self._states[layer] = state
        self._tails[layer] = conv_tail

    def append_rows(self, layer: int, rows: np.ndarray) -> None:
        buffer, length = self._rows[layer], self._lengths[layer]
        if length + len(rows) > len(buffer):
            grown = np.zeros((max(2 * len(buffer), length + len(rows)), buffer.shape[1]), np.float32)
            grown[:length] = buffer[:length]
            self._rows[layer] = buffer = grown
        buffer[length:length + len(rows)] = rows
        self._lengths[layer] = length + len(rows)

    def attention_rows(self, layer: int) -> np.ndarray:
        return self._rows[layer][: self._lengths[layer]]

    def advance(self, num_new_tokens: int) -> None:
        self._num_tokens += num_new_tokens

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot truncate a cache at {self._num_tokens} positions to {num_tokens}")
        for layer in self._lengths:
            self._lengths[layer] = num_tokens
        self._num_tokens = num_tokens

    def check_integrity(self) -> None:
        """Every attention layer holds exactly one row per processed position."""
        for layer, length in self._lengths.items():
            if length != self._num_tokens:
                raise AssertionError(f"layer {layer} caches {length} rows for {self._num_tokens} tokens")

    def nbytes(self) -> int:
        recurrent = sum(s.nbytes for s in self._states.values()) + sum(t.nbytes for t in self._tails.values())
        return recurrent + sum(self._lengths[l] * w * FLOAT32_BYTES for l, w in self._layout.row_widths.items())
