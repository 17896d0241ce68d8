"""Exact rollback of a sequence's state after a speculative verify window.

A verify forward feeds one window of T = 1 + k positions (the last confirmed token and k draft tokens) in one
segment. Verification then keeps the first n positions, 1 <= n <= T, and the state must be the one after exactly
those n positions, as if the rejected ones had never been fed.

MLA layers: truncate the cached rows (the block table) to the kept positions.
KDA layers, two methods (per layer, with S [NH, D, D] and the conv tail [K-1, 3P]):
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
the per-position states from the recorded vectors (a fused kernel would write them out as it goes), so its capture
time here includes that recurrence.

Shapes: T window positions, n kept positions, NH heads, D head dim, P = NH * D, K conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from k3serve.config import K3Config
from k3serve.errors import RequestError
from k3serve.model.kda import KDAInputs
from k3serve.model.state import SequenceCache

RollbackMethod = Literal["snapshot", "projection"]
ROLLBACK_METHODS: tuple[str, ...] = ("snapshot", "projection")


def kda_state_trajectory(k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                         num_steps: int | None = None, keep_all: bool = False) -> np.ndarray:
    """Replay the delta rule from `state` [NH, D, D] over the first `num_steps` of k, v, g [T, NH, D], beta [T, NH].

    Returns the final state [NH, D, D], or with `keep_all` every intermediate state [n, NH, D, D]. Same operations,
    in the same order, as `kda.kda_step_batch` for one sequence."""
    n = k.shape[0] if num_steps is None else num_steps
    S = state.astype(np.float32, copy=True)
    states = np.empty((n,) + S.shape, np.float32) if keep_all else None
    for t in range(n):
        S = S * np.exp(g[t])[..., None]
        u = np.einsum("hij,hi->hj", S, k[t])  # [NH, D]
        S += k[t][..., None] * (beta[t][..., None] * (v[t] - u))[..., None, :]
        if states is not None:
            states[t] = S
    return states if states is not None else S


def conv_tail_after(tail: np.ndarray, conv_inputs: np.ndarray, num_steps: int) -> np.ndarray:
    """The conv tail [K-1, 3P] after feeding the first `num_steps` rows of conv_inputs [T, 3P] to `tail`."""
    full = np.concatenate([tail, conv_inputs[:num_steps]], axis=0)
    return full[full.shape[0] - tail.shape[0]:].copy()


@dataclass
class _SnapshotRecord:
    states: np.ndarray  # [T, NH, D, D] state after each window position
    tails: np.ndarray  # [T, K-1, 3P]

    @property
    def nbytes(self) -> int:
        return self.states.nbytes + self.tails.nbytes


@dataclass
class _ProjectionRecord:
    state: np.ndarray  # [NH, D, D] checkpoint: the state before the window
    tail: np.ndarray  # [K-1, 3P]
    k: np.ndarray  # [T, NH, D]
    v: np.ndarray  # [T, NH, D]
    g: np.ndarray  # [T, NH, D]
    beta: np.ndarray  # [T, NH]
    conv_inputs: np.ndarray  # [T, 3P]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.state, self.tail, self.k, self.v, self.g, self.beta, self.conv_inputs))


class RollbackCache(SequenceCache):
    """Wraps a sequence's cache for one verify forward and can take it back to any kept length afterwards.

    Usage: `begin_window()`, one forward with this object as the item's cache, then `commit(n)`."""

    def __init__(self, inner: SequenceCache, method: RollbackMethod = "projection") -> None:
        if method not in ROLLBACK_METHODS:
            raise RequestError(f"unknown rollback method {method!r}; use one of {', '.join(ROLLBACK_METHODS)}")
        self.inner = inner
        self.method = method
        self._start: int | None = None
        self._records: dict[int, _SnapshotRecord | _ProjectionRecord] = {}

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
            if len(self._records) != len(self.inner_kda_layers()):
                raise RequestError("the window was not recorded by every KDA layer (was it a one-token window?)")
            for layer, record in self._records.items():
                state, tail = self._restored(record, num_kept)
                self.inner.set_kda_state(layer, state, tail)
            self.inner.truncate(self._start + num_kept)
        self._start = None
        self._records = {}

    def inner_kda_layers(self) -> tuple[int, ...]:
        config: K3Config | None = getattr(self.inner, "config", None)
        return tuple(self._records) if config is None else config.kda_layer_ids

    @staticmethod
    def _restored(record: _SnapshotRecord | _ProjectionRecord, num_kept: int) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(record, _SnapshotRecord):
            return record.states[num_kept - 1].copy(), record.tails[num_kept - 1].copy()
        state = kda_state_trajectory(record.k, record.v, record.g, record.beta, record.state, num_kept)
        return state, conv_tail_after(record.tail, record.conv_inputs, num_kept)

    # ---- SequenceCache: record, otherwise pass through --------------------------------------------------------
    def record_kda_window(self, layer: int, state: np.ndarray, conv_tail: np.ndarray, inputs: KDAInputs) -> None:
        if self._start is None:
            return  # not inside a window (e.g. a prefill through the wrapper): nothing to roll back
        if inputs.conv_inputs is None:
            raise RequestError("KDA inputs without conv inputs cannot be rolled back")
        if self.method == "snapshot":
            states = kda_state_trajectory(inputs.k, inputs.v, inputs.g, inputs.beta, state, keep_all=True)
            T = inputs.k.shape[0]
            tails = np.stack([conv_tail_after(conv_tail, inputs.conv_inputs, n) for n in range(1, T + 1)])
            self._records[layer] = _SnapshotRecord(states, tails)
        else:
            self._records[layer] = _ProjectionRecord(
                state.copy(), conv_tail.copy(), inputs.k.copy(), inputs.v.copy(), inputs.g.copy(),
                inputs.beta.copy(), np.array(inputs.conv_inputs, np.float32))

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def kda_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.kda_state(layer)

    def set_kda_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self.inner.set_kda_state(layer, state, conv_tail)

    def mla_append(self, layer: int, rows: np.ndarray) -> None:
        self.inner.mla_append(layer, rows)

    def mla_rows(self, layer: int) -> np.ndarray:
        return self.inner.mla_rows(layer)

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
