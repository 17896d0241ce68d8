"""Exact rollback of a sequence's state after a speculative verify window.

A verify forward feeds one window of T = 1 + k positions (the last confirmed token and k draft tokens) in one
segment. Verification then keeps the first n positions, 1 <= n <= T, and the state must be the one after exactly
those n positions, as if the rejected ones had never been fed.

Attention layers (MLA, GQA): truncate the cached rows (the block table) to the kept positions.
Recurrent layers (KDA, gated DeltaNet), two methods (per layer, with S [NH, D, D] and the conv tail [K-1, 3P]):
    snapshot    keep S_t and the conv tail after every position t = 1..T of the window: T states.
                Rollback to n: copy S_n back.
    projection  keep S_0 (one checkpoint, the state before the window) and, per position, the vectors the delta
                rule consumes (k_t, v_t, g_t, beta_t) plus the pre-conv inputs x_t of q, k, v (for the conv tail).
                Rollback to n: S <- S_0, then replay n steps
                    S <- diag(exp(g_t)) S;  u = S^T k_t;  S <- S + k_t (beta_t (v_t - u))^T
                and the tail is the last K-1 rows of [tail_0; x_1 .. x_n].
Storage per KDA layer: snapshot T (NH D^2 + (K-1) 3P); projection NH D^2 + (K-1) 3P + T (6P + NH): the ratio
tends to T as D grows (ReplaySSM, mlx-lm #1821 use the same idea; see `rollback_storage`).

NOTE: the verify forward itself runs the chunked form and only yields the end state; the snapshot method computes
the per-position states from the recorded vectors (model/replay.py; a fused kernel would write them out as it
goes), so its capture time here includes that recurrence.

Shapes: T window positions, n kept positions, NH heads, D head dim, P = NH * D, K conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from k3serve.config import K3Config
from k3serve.errors import RequestError
from k3serve.model.cache import CacheLayout, RecurrentWindow, SequenceCache

RollbackMethod = Literal["snapshot", "projection"]
ROLLBACK_METHODS: tuple[str, ...] = ("snapshot", "projection")


@dataclass
class _Snapshots:
    states: np.ndarray  # [T, ...] state after each window position
    tails: np.ndarray  # [T, K-1, C]

    @property
    def nbytes(self) -> int:
        return self.states.nbytes + self.tails.nbytes

    def state_after(self, num_kept: int) -> tuple[np.ndarray, np.ndarray]:
        return self.states[num_kept - 1].copy(), self.tails[num_kept - 1].copy()


class RollbackCache(SequenceCache):
    """Wraps a sequence's cache for one verify forward and can take it back to any kept length afterwards.

    Usage: `begin_window()`, one forward with this object as the item's cache, then `commit(n)`. It knows no
    layer's internals: each recurrent layer hands it a `RecurrentWindow` (model/cache.py) that rebuilds the state."""

    def __init__(self, inner: SequenceCache, method: RollbackMethod = "projection") -> None:
        if method not in ROLLBACK_METHODS:
            raise RequestError(f"unknown rollback method {method!r}; use one of {', '.join(ROLLBACK_METHODS)}")
        self.inner = inner
        self.method = method
        self._start: int | None = None
        self._records: dict[int, _Snapshots | RecurrentWindow] = {}

    # ---- the window -----------------------------------------------------------------------------------------
    def begin_window(self) -> None:
        self._start = self.inner.num_tokens
        self._records = {}

    @property
    def window_length(self) -> int:
        if self._start is None:
            raise RequestError("commit without begin_window")
        return self.inner.num_tokens - self._start

    @property
    def recorded_bytes(self) -> int:
        """Bytes the rollback records of the current window hold (the storage the two methods trade)."""
        return sum(r.nbytes for r in self._records.values())

    def commit(self, num_kept: int) -> None:
        """Keep the first `num_kept` positions of the window (1 <= num_kept <= window length) and drop the rest."""
        T = self.window_length
        if not 1 <= num_kept <= T:
            raise RequestError(f"a window of {T} positions cannot keep {num_kept}")
        if num_kept < T:
            if set(self._records) != set(self.layout.recurrent_layers):
                raise RequestError("the window was not recorded by every recurrent layer (was it a one-token "
                                   "window?)")
            for layer, record in self._records.items():
                state, tail = record.state_after(num_kept)
                self.inner.set_recurrent_state(layer, state, tail)
            self.inner.truncate(self._start + num_kept)
        self._start = None
        self._records = {}

    # ---- SequenceCache: record, otherwise pass through --------------------------------------------------------
    def record_window(self, layer: int, window: RecurrentWindow) -> None:
        if self._start is None:
            return  # not inside a window (e.g. a prefill through the wrapper): nothing to roll back
        if self.method == "snapshot":
            self._records[layer] = _Snapshots(*window.all_states())
        else:
            self._records[layer] = window.detached()

    @property
    def layout(self) -> CacheLayout:
        return self.inner.layout

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def recurrent_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.recurrent_state(layer)

    def set_recurrent_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self.inner.set_recurrent_state(layer, state, conv_tail)

    def append_rows(self, layer: int, rows: np.ndarray) -> None:
        self.inner.append_rows(layer, rows)

    def attention_rows(self, layer: int) -> np.ndarray:
        return self.inner.attention_rows(layer)

    def advance(self, num_new_tokens: int) -> None:
        self.inner.advance(num_new_tokens)

    def truncate(self, num_tokens: int) -> None:
        self.inner.truncate(num_tokens)


# ---- storage accounting -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecurrentShapes:
    """What rollback storage depends on: the KDA layers of one model."""

    name: str
    num_kda_layers: int
    num_heads: int  # NH
    head_dim: int  # D
    conv_kernel: int  # K (0 = no short conv)

    @classmethod
    def of(cls, name: str, config: K3Config) -> RecurrentShapes:
        return cls(name, len(config.kda_layer_ids), config.kda_num_heads, config.kda_head_dim,
                   config.short_conv_kernel_size)


KIMI_LINEAR_SHAPES = RecurrentShapes("Kimi Linear 48B-A3B", 20, 32, 128, 4)  # ANCHORS: 20 KDA + 7 MLA layers


@dataclass(frozen=True)
class RollbackStorage:
    window: int  # T positions per verify window
    snapshot_bytes: int
    projection_bytes: int

    @property
    def ratio(self) -> float:
        """snapshot / projection: how many times more the snapshots take."""
        return self.snapshot_bytes / self.projection_bytes


def rollback_storage(shapes: RecurrentShapes, window: int, bytes_per_value: int, accounting: str = "k3serve"
                     ) -> RollbackStorage:
    """Bytes per sequence that each method holds for one verify window of `window` positions.

    accounting 'k3serve': what `RollbackCache` stores (state + conv tail per snapshot; checkpoint with conv tail
    plus k, v, g, beta and the 3P pre-conv inputs per position). 'anchor': the public back-of-envelope (state only
    per snapshot; checkpoint plus k, u, g per position, no conv, no beta)."""
    NH, D, K, L = shapes.num_heads, shapes.head_dim, shapes.conv_kernel, shapes.num_kda_layers
    P = NH * D
    state = NH * D * D
    if accounting == "anchor":
        snapshot = window * state
        projection = state + window * 3 * P
    elif accounting == "k3serve":
        tail = max(K - 1, 0) * 3 * P
        snapshot = window * (state + tail)
        projection = state + tail + window * (3 * P + NH + 3 * P)
    else:
        raise RequestError(f"unknown accounting {accounting!r}")
    return RollbackStorage(window, L * snapshot * bytes_per_value, L * projection * bytes_per_value)
