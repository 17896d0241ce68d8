"""The gated delta rule, token by token, compiled: the engine's path for KDA and gated DeltaNet at every length.

Per sequence and head, with S [Dk, Dv], for each token t (model/kda.py's docstring, K3_SPEC section 5):
    S <- diag(exp(g_t)) S;   u = S^T k_t;   S <- S + k_t (beta_t (v_t - u))^T;   o_t = S^T q_t

Why not the chunked form for prefill: on a CPU the chunked form (kda.kda_chunked, numpy) spends its time on
[C, C, D] decay tensors and a triangular solve per chunk, while the recurrence is 4 Dk Dv multiply-adds per token
and head that stream through one state that stays in L1/L2. Measured on the idle 2-core VM (2026-12-05), per
layer call: the embedded model (4 heads x 32) 11 us against 78 us for a 5-token verify window and 0.28 ms against
7.1 ms for a 269-token prefill; 8 heads x 128 (the real K3's head size) 0.26 / 0.30 ms at 5 tokens and 5.2 / 45.9 ms
at 256 (`benchmarks/bench_delta_rule.py`).

Each output and state depends only on its own token order, never on how the tokens are split into calls or on the
threads: a sequence prefilled in one call, in chunks, or token by token, and a state replayed for speculative
rollback (model/replay.py), all give the same bits. The loops are written so that the compiler vectorises over Dv
(no reductions across lanes), with fastmath off.

Shapes: T tokens, B sequences, NH heads, Dk key and Dv value head dims.
"""

from __future__ import annotations

import numpy as np

from k3serve.model import kernels  # noqa: F401  (sets the OpenMP wait policy before numba starts)
from numba import njit, prange  # noqa: E402

# Below this many multiply-adds per call one thread is faster than waking the pool; both give the same bits.
PARALLEL_MIN_WORK = 2**21


@njit(inline="always")
def _decay_and_project(k, g, S_in, S, h, t, u):
    """S = diag(exp(g_t)) S_in and u = S^T k_t (S_in may be S), in one pass over the rows: each element is decayed,
    stored, then added into u in row order, the operations and order of separate decay and projection passes."""
    Dk, Dv = S.shape
    for j in range(Dv):
        u[j] = 0.0
    for i in range(Dk):
        a = np.float32(np.exp(g[t, h, i]))
        ki = k[t, h, i]
        for j in range(Dv):
            decayed = S_in[i, j] * a
            S[i, j] = decayed
            u[j] += decayed * ki


@njit(inline="always")
def _update(k, v, g, beta, S_in, S, h, t, u):
    """One token's state update of head h from S_in [Dk, Dv] into S (S_in may be S; u: scratch [Dv])."""
    Dk, Dv = S.shape
    _decay_and_project(k, g, S_in, S, h, t, u)
    b = beta[t, h]
    for j in range(Dv):
        u[j] = b * (v[t, h, j] - u[j])
    for i in range(Dk):
        ki = k[t, h, i]
        for j in range(Dv):
            S[i, j] += ki * u[j]


@njit(inline="always")
def _update_and_read(q, k, v, g, beta, S_in, S, h, t, u, out):
    """`_update`, then o_t = S^T q_t into out[t, h]; the read rides the update's pass over the rows (each element
    updated, then added into the output in row order: the bits of two passes) -- two passes over S, not four."""
    Dk, Dv = S.shape
    _decay_and_project(k, g, S_in, S, h, t, u)
    b = beta[t, h]
    for j in range(Dv):
        u[j] = b * (v[t, h, j] - u[j])
        out[t, h, j] = 0.0
    for i in range(Dk):
        ki, qi = k[t, h, i], q[t, h, i]
        for j in range(Dv):
            updated = S[i, j] + ki * u[j]
            S[i, j] = updated
            out[t, h, j] += updated * qi


@njit(inline="always")
def _segments_task(q, k, v, g, beta, states, new_states, starts, ends, out, task):
    """Sequence b, head h: its first token reads the old state and writes the new one (no copy first), the rest
    update the new one in place."""
    NH = states.shape[1]
    b, h = task // NH, task % NH
    S = new_states[b, h]
    if ends[b] <= starts[b]:
        S[:] = states[b, h]
        return
    u = np.empty(S.shape[1], np.float32)
    _update_and_read(q, k, v, g, beta, states[b, h], S, h, starts[b], u, out)
    for t in range(starts[b] + 1, ends[b]):
        _update_and_read(q, k, v, g, beta, S, S, h, t, u, out)


@njit(cache=True, fastmath=False)
def _segments_serial(q, k, v, g, beta, states, new_states, starts, ends, out):
    for task in range(states.shape[0] * states.shape[1]):
        _segments_task(q, k, v, g, beta, states, new_states, starts, ends, out, task)


@njit(cache=True, fastmath=False, parallel=True)
def _segments_parallel(q, k, v, g, beta, states, new_states, starts, ends, out):
    for task in prange(states.shape[0] * states.shape[1]):
        _segments_task(q, k, v, g, beta, states, new_states, starts, ends, out, task)


def warmup() -> None:
    """Compile (or load from numba's cache) both forms of `delta_rule_segments`' kernel on tiny inputs (the loader
    runs it for a model with recurrent layers, so that a first request does not compile it: ~4 s serial)."""
    f32 = np.float32
    qkg, v, beta = np.zeros((2, 2, 4), f32), np.zeros((2, 2, 4), f32), np.zeros((2, 2), f32)  # T = 2, NH = 2
    states = np.zeros((1, 2, 4, 4), f32)
    for kernel in (_segments_serial, _segments_parallel):
        kernel(qkg, qkg, v, qkg, beta, states, np.empty_like(states), np.zeros(1, np.int64), np.full(1, 2, np.int64),
               np.empty_like(v))


def delta_rule_segments(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        states: np.ndarray, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence's tokens in one call. q, k, g [T, NH, Dk]; v [T, NH, Dv]; beta [T, NH]; states
    [B, NH, Dk, Dv] (not modified); segments [B, 2] (start, end) rows of each sequence.
    Returns (o [T, NH, Dv], new states [B, NH, Dk, Dv])."""
    f32 = np.float32
    q, k, v, g, beta = (np.ascontiguousarray(a, dtype=f32) for a in (q, k, v, g, beta))
    states = np.ascontiguousarray(states, dtype=f32)
    new = np.empty(states.shape, f32)  # written from `states` by each sequence's first token (no copy first)
    out = np.empty(v.shape, f32)
    starts = np.ascontiguousarray(segments[:, 0], dtype=np.int64)
    ends = np.ascontiguousarray(segments[:, 1], dtype=np.int64)
    work = v.shape[0] * new.shape[1] * new.shape[2] * new.shape[3] * 4
    kernel = _segments_parallel if work >= PARALLEL_MIN_WORK and new.shape[0] * new.shape[1] > 1 else _segments_serial
    kernel(q, k, v, g, beta, states, new, starts, ends, out)
    return out, new


@njit(cache=True, fastmath=False)
def _trajectory(k, v, g, beta, S, num_steps, states):
    u = np.empty(S.shape[2], np.float32)
    for t in range(num_steps):
        for h in range(S.shape[0]):
            _update(k, v, g, beta, S[h], S[h], h, t, u)
        if states.shape[0] > 0:
            states[t] = S


def delta_rule_trajectory(k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                          num_steps: int, keep_all: bool = False) -> np.ndarray:
    """The state [NH, Dk, Dv] after the first `num_steps` tokens of k, g [T, NH, Dk], v [T, NH, Dv], beta [T, NH]
    from `state`, or with `keep_all` every intermediate state [num_steps, NH, Dk, Dv]. The same bits as the state
    delta_rule_segments leaves after those tokens."""
    f32 = np.float32
    k, v, g, beta = (np.ascontiguousarray(a, dtype=f32) for a in (k, v, g, beta))
    S = np.array(state, dtype=f32, order="C", copy=True)
    states = np.empty((num_steps if keep_all else 0,) + S.shape, f32)
    _trajectory(k, v, g, beta, S, num_steps, states)
    return states if keep_all else S

