"""Per-sequence model state: what a sequence carries from one forward step to the next.

KDA layers carry a recurrent state S [NH, D, D] and the last K-1 pre-conv inputs of q, k, v [K-1, 3P].
MLA layers carry, per position, the normed latent plus k_rope [KL + DR]. The model reads and writes these only
through `SequenceCache`, so the engine can back them with paged blocks and state slots without the model knowing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from k3serve.config import K3Config

if TYPE_CHECKING:
    from k3serve.model.kda import KDAInputs


class SequenceCache(ABC):
    """The state of one sequence as the model sees it."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Positions already processed (the next token's position)."""

    @abstractmethod
    def kda_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(S [NH, D, D], conv tail [K-1, 3P]) of a KDA layer; zeros for a fresh sequence."""

    @abstractmethod
    def set_kda_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None: ...

    @abstractmethod
    def mla_append(self, layer: int, rows: np.ndarray) -> None:
        """Append [t, KL+DR] cache rows for the new positions of an MLA layer."""

    @abstractmethod
    def mla_rows(self, layer: int) -> np.ndarray:
        """All cached rows of an MLA layer, [num_positions, KL+DR], oldest first."""

    @abstractmethod
    def advance(self, num_new_tokens: int) -> None:
        """Called once per forward after every layer has written its state."""

    def record_kda_window(self, layer: int, state: np.ndarray, conv_tail: np.ndarray, inputs: KDAInputs) -> None:
        """Called by a KDA layer for a multi-token segment, with the state before it and the segment's per-token
        vectors, just before the state is replaced. Speculative rollback records here (model/rollback.py); plain
        caches ignore it."""

    def truncate(self, num_tokens: int) -> None:
        """Forget MLA rows at positions >= num_tokens and move the position back there (speculative rollback;
        the caller restores the KDA state)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be truncated")


class DenseSequenceCache(SequenceCache):
    """Contiguous per-sequence state: growable MLA rows and one KDA state per layer."""

    def __init__(self, config: K3Config, initial_capacity: int = 64) -> None:
        self.config = config
        P, K = config.kda_proj_size, config.short_conv_kernel_size
        NH, D = config.kda_num_heads, config.kda_head_dim
        self._kda = {l: np.zeros((NH, D, D), np.float32) for l in config.kda_layer_ids}
        self._conv = {l: np.zeros((K - 1, 3 * P), np.float32) for l in config.kda_layer_ids}
        self._mla = {l: np.zeros((initial_capacity, config.mla_cache_width), np.float32)
                     for l in config.mla_layer_ids}
        self._mla_len = {l: 0 for l in config.mla_layer_ids}
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def kda_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self._kda[layer], self._conv[layer]

    def set_kda_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self._kda[layer] = state
        self._conv[layer] = conv_tail

    def mla_append(self, layer: int, rows: np.ndarray) -> None:
        buffer, length = self._mla[layer], self._mla_len[layer]
        if length + len(rows) > len(buffer):
            grown = np.zeros((max(2 * len(buffer), length + len(rows)), buffer.shape[1]), np.float32)
            grown[:length] = buffer[:length]
            self._mla[layer] = buffer = grown
        buffer[length:length + len(rows)] = rows
        self._mla_len[layer] = length + len(rows)

    def mla_rows(self, layer: int) -> np.ndarray:
        return self._mla[layer][: self._mla_len[layer]]

    def advance(self, num_new_tokens: int) -> None:
        self._num_tokens += num_new_tokens

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot truncate a cache at {self._num_tokens} positions to {num_tokens}")
        for layer in self._mla_len:
            self._mla_len[layer] = num_tokens
        self._num_tokens = num_tokens

    def nbytes(self) -> int:
        kda = sum(s.nbytes for s in self._kda.values()) + sum(c.nbytes for c in self._conv.values())
        return kda + sum(self._mla_len[l] * self.config.mla_cache_width * 4 for l in self._mla)
