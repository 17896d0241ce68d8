"""Kimi Delta Attention (KDA): gated delta rule with per-channel decay (K3_SPEC section 5, KDA layer).

Per head, with state S [D, D] (key channels x value channels), per token:
    S <- diag(alpha_t) S                 alpha_t = exp(g_t), g_t in (-5, 0] per key channel
    u  = S^T k_t
    S <- S + k_t (beta_t (v_t - u))^T
    o_t = S^T q_t                        (read from the updated S)

Chunked form (the numpy reference for prefill; the engine runs model/delta_rule.py's compiled token-by-token
loop at every length, which is faster on a CPU). Within a chunk of C tokens starting from state S0, let
b_t = sum_{j<=t} g_j (cumulative log decay per key channel) and w_t = beta_t (v_t - u_t). Unrolling the
recurrence gives
    S_t = exp(b_t) * S0 + sum_{i<=t} (exp(b_t - b_i) * k_i) w_i^T                (* scales rows)
so the w_t solve a unit lower-triangular system
    w_t + beta_t sum_{i<t} M_ti w_i = beta_t (v_t - S0^T (exp(b_t) * k_t)),   M_ti = sum_d k_td k_id e^(b_td - b_id)
and the outputs and the chunk-end state are
    o_t = S0^T (exp(b_t) * q_t) + sum_{i<=t} Q_ti w_i,   Q_ti = sum_d q_td k_id e^(b_td - b_id)
    S_C = exp(b_C) * S0 + sum_i (exp(b_C - b_i) * k_i) w_i^T.
Every exponent is b_t - b_i with i <= t, which is <= 0, so nothing overflows however strong the decay.

Shapes: T tokens, NH heads, D head dim (d_k = d_v), P = NH*D, K conv kernel, C chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit

from k3serve.config import K3Config
from k3serve.model.kernels import linear
from k3serve.model.ops import l2_normalize, rms_norm, sigmoid, silu
from k3serve.model.cache import SequenceCache
from k3serve.model.delta_rule import delta_rule_segments
from k3serve.model.replay import DeltaRuleWindow
from k3serve.model.weights import KDAWeights

DEFAULT_CHUNK_SIZE = 32


@dataclass
class KDAInputs:
    """The per-token vectors the recurrence consumes, after projections, conv and normalisation."""

    q: np.ndarray  # [T, NH, D] L2-normalised and scaled by 1/sqrt(D)
    k: np.ndarray  # [T, NH, D] L2-normalised
    v: np.ndarray  # [T, NH, D]
    g: np.ndarray  # [T, NH, D] log decay, in (lower_bound, 0]
    beta: np.ndarray  # [T, NH]
    conv_inputs: np.ndarray | None = None  # [T, 3P] pre-conv q, k, v (speculative rollback rebuilds the conv tail)

    def part(self, start: int, end: int) -> "KDAInputs":
        """Rows start..end-1 (one sequence's segment)."""
        conv = None if self.conv_inputs is None else self.conv_inputs[start:end]
        return KDAInputs(self.q[start:end], self.k[start:end], self.v[start:end], self.g[start:end],
                         self.beta[start:end], conv)

    def window(self, state: np.ndarray, conv_tail: np.ndarray) -> DeltaRuleWindow:
        """This segment's record for rollback, starting from (state, conv_tail); needs `conv_inputs`."""
        assert self.conv_inputs is not None, "a rollback window needs the pre-conv inputs"
        return DeltaRuleWindow(state, conv_tail, self.k, self.v, self.g, self.beta, self.conv_inputs)


def causal_conv(x: np.ndarray, tail: np.ndarray, taps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv of width K along time, with the last K-1 inputs carried in `tail`.

    x [T, C], tail [K-1, C], taps [C, K] (oldest to newest). Returns (out [T, C], new tail [K-1, C]).
    Each output is ((0 + in_0 w_0) + in_1 w_1) + ..., in float32, as the one-token path in `kda_prepare`."""
    K = taps.shape[1]
    full = np.concatenate([tail, x], axis=0).astype(np.float32, copy=False)  # [K-1+T, C]
    out = np.empty(x.shape, np.float32)
    _causal_conv(full, np.ascontiguousarray(taps, dtype=np.float32), out)
    return out, full[full.shape[0] - (K - 1):].copy()


@njit(cache=True)
def _causal_conv(full: np.ndarray, taps: np.ndarray, out: np.ndarray) -> None:
    for t in range(out.shape[0]):
        for c in range(out.shape[1]):
            acc = np.float32(0.0)
            for j in range(taps.shape[1]):
                acc += full[t + j, c] * taps[c, j]
            out[t, c] = acc


@njit(cache=True)
def conv_step(tail: np.ndarray, x: np.ndarray, taps: np.ndarray, out: np.ndarray, new_tail: np.ndarray) -> None:
    """One token of `causal_conv`: tail [K-1, C], x [C], taps [C, K] -> out [C] = ((0 + tail_0 w_0) + ...) + x
    w_(K-1), and new_tail [K-1, C] = the last K-1 inputs (tail[1:], then x)."""
    last = taps.shape[1] - 1
    for c in range(x.shape[0]):
        acc = np.float32(0.0)
        for j in range(last):
            acc += tail[j, c] * taps[c, j]
        out[c] = acc + x[c] * taps[c, last]
    for j in range(last - 1):
        new_tail[j] = tail[j + 1]
    if last:
        new_tail[last - 1] = x


def kda_prepare(config: K3Config, w: KDAWeights, x: np.ndarray, segments: Sequence[tuple[int, int]],
                conv_tails: Sequence[np.ndarray]) -> tuple[KDAInputs, np.ndarray, list[np.ndarray]]:
    """Projections, short conv and decay for T tokens made of several sequence segments.

    x [T, H]; segments are [start, end) row ranges, one per sequence, each with its conv tail [K-1, 3P].
    Returns (inputs over all T, output gate [T, P], the new conv tail of each segment)."""
    NH, D, P = config.kda_num_heads, config.kda_head_dim, config.kda_proj_size
    T = x.shape[0]
    proj = linear(x, w.in_proj)  # [T, 4P + D + NH]
    out_gate, f_a, b = proj[:, 3 * P:4 * P], proj[:, 4 * P:4 * P + D], proj[:, 4 * P + D:]
    qkv = np.empty((T, 3 * P), np.float32)
    new_tails: list[np.ndarray] = [np.empty(0)] * len(segments)
    for i, ((start, end), tail) in enumerate(zip(segments, conv_tails)):
        if end - start == 1:  # decode: one compiled call, same summation order as causal_conv
            new_tails[i] = np.empty_like(tail)
            conv_step(tail, proj[start, :3 * P], w.conv, qkv[start], new_tails[i])
        elif end - start > 1:
            qkv[start:end], new_tails[i] = causal_conv(proj[start:end, :3 * P], tail, w.conv)
    qkv = silu(qkv).reshape(T, 3, NH, D)
    q = l2_normalize(qkv[:, 0]) * np.float32(1.0 / np.sqrt(D))
    k = l2_normalize(qkv[:, 1])
    v = np.ascontiguousarray(qkv[:, 2])
    z = (f_a @ w.f_b.T + w.dt_bias).reshape(T, NH, D)  # [T, NH, D]
    g = np.float32(config.gate_lower_bound) * sigmoid(w.a_exp[None, :, None] * z)
    beta = sigmoid(b)  # [T, NH]
    return KDAInputs(q=q, k=k, v=v, g=g, beta=beta, conv_inputs=proj[:, :3 * P]), out_gate, new_tails


def kda_forward(config: K3Config, w: KDAWeights, x: np.ndarray, segments: Sequence[tuple[int, int]],
                caches: Sequence[SequenceCache], layer: int, chunk_size: int | None = None) -> np.ndarray:
    """A KDA layer over a batch: x [T, H] -> [T, H], reading and writing each sequence's state."""
    states = [cache.recurrent_state(layer) for cache in caches]
    inputs, out_gate, new_tails = kda_prepare(config, w, x, segments, [tail for _, tail in states])
    o = run_delta_rule(inputs, segments, caches, layer, new_tails, chunk_size)
    return kda_finish(config, w, o, out_gate)


def run_delta_rule(inputs: KDAInputs, segments: Sequence[tuple[int, int]], caches: Sequence[SequenceCache],
                   layer: int, new_tails: Sequence[np.ndarray], chunk_size: int | None = None) -> np.ndarray:
    """The delta rule over every sequence of a batch (KDA and gated DeltaNet): writes each new state and conv tail,
    and records a rollback window for every multi-token segment. -> o [T, NH, Dv].

    chunk_size None (the engine's path): every segment, decode or prefill, in one compiled token-by-token call
    (model/delta_rule.py). An int: the numpy twins instead, decode tokens batched (kda_step_batch) and longer
    segments in the chunked form with chunks of that many tokens (parity tests and the chunked form's reference)."""
    states = [cache.recurrent_state(layer) for cache in caches]
    if chunk_size is None:
        stacked = states[0][0][None] if len(states) == 1 else np.stack([state for state, _ in states])  # one: a view
        o, new_states = delta_rule_segments(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, stacked,
                                            np.asarray(segments, np.int64))
    else:
        o = np.empty(inputs.v.shape, np.float32)
        new_states = [None] * len(caches)
        decode = [i for i, (start, end) in enumerate(segments) if end - start == 1]
        if decode:
            rows = np.array([segments[i][0] for i in decode])
            o[rows], stepped = kda_step_batch(inputs.q[rows], inputs.k[rows], inputs.v[rows], inputs.g[rows],
                                              inputs.beta[rows], np.stack([states[i][0] for i in decode]))
            for j, i in enumerate(decode):
                new_states[i] = stepped[j]
        for i, (start, end) in enumerate(segments):
            if end - start > 1:
                o[start:end], new_states[i] = kda_chunked(inputs.part(start, end), states[i][0], chunk_size)
    for i, (start, end) in enumerate(segments):
        if end - start > 1:
            caches[i].record_window(layer, inputs.part(start, end).window(*states[i]))  # before the state is replaced
        caches[i].set_recurrent_state(layer, new_states[i], new_tails[i])
    return o


def kda_recurrent(inputs: KDAInputs, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token delta rule. state [NH, D, D] -> (o [T, NH, D], new state). The chunked form's twin."""
    S = state.copy()
    T = inputs.q.shape[0]
    out = np.empty_like(inputs.v)
    alpha = np.exp(inputs.g)
    for t in range(T):
        S *= alpha[t][:, :, None]
        u = np.einsum("hij,hi->hj", S, inputs.k[t])  # [NH, D]
        S += inputs.k[t][:, :, None] * (inputs.beta[t][:, None] * (inputs.v[t] - u))[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, inputs.q[t])
    return out, S


def kda_step_batch(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One decode token for each of B sequences at once.

    q, k, v, g [B, NH, D]; beta [B, NH]; state [B, NH, D, D] -> (o [B, NH, D], new state)."""
    S = state * np.exp(g)[..., None]
    u = np.einsum("bhij,bhi->bhj", S, k)
    S += k[..., None] * (beta[..., None] * (v - u))[..., None, :]
    return np.einsum("bhij,bhi->bhj", S, q), S


def kda_chunked(inputs: KDAInputs, state: np.ndarray, chunk_size: int = DEFAULT_CHUNK_SIZE
                ) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence, chunk by chunk (see the module docstring). state [NH, D, D]."""
    T = inputs.q.shape[0]
    out = np.empty_like(inputs.v)
    S = state
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        # to head-major: [NH, C, D]
        q = inputs.q[start:end].transpose(1, 0, 2)
        k = inputs.k[start:end].transpose(1, 0, 2)
        v = inputs.v[start:end].transpose(1, 0, 2)
        beta = inputs.beta[start:end].T  # [NH, C]
        b = np.cumsum(inputs.g[start:end], axis=0).transpose(1, 0, 2)  # [NH, C, D]
        C = end - start
        lower = np.tril(np.ones((C, C), dtype=bool))  # i <= t
        diff = b[:, :, None, :] - b[:, None, :, :]  # [NH, C(t), C(i), D]
        decay = np.exp(np.where(lower[None, :, :, None], diff, -np.inf)).astype(np.float32)
        k_decay = k[:, None, :, :] * decay  # [NH, t, i, D] = k_i * e^(b_t - b_i)
        m_kk = np.einsum("htd,htid->hti", k, k_decay) * ~np.eye(C, dtype=bool)  # strict lower
        m_qk = np.einsum("htd,htid->hti", q, k_decay)  # lower incl. diagonal
        eb = np.exp(b)  # [NH, C, D]
        rhs = beta[:, :, None] * (v - (eb * k) @ S)  # [NH, C, D]
        system = np.eye(C, dtype=np.float32) + beta[:, :, None] * m_kk  # [NH, C, C] unit lower-triangular
        w = _solve_unit_lower(system, rhs)  # [NH, C, D]
        out[start:end] = ((eb * q) @ S + m_qk @ w).transpose(1, 0, 2)
        end_decay = np.exp(b[:, -1:, :] - b)  # [NH, C, D]
        S = np.exp(b[:, -1, :])[:, :, None] * S + np.swapaxes(end_decay * k, 1, 2) @ w
    return out, np.ascontiguousarray(S, dtype=np.float32)


def _solve_unit_lower(system: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Forward substitution for a batch of unit lower-triangular systems. system [NH, C, C], rhs [NH, C, D]."""
    w = np.empty_like(rhs)
    for t in range(system.shape[1]):
        w[:, t] = rhs[:, t] - np.einsum("hi,hid->hd", system[:, t, :t], w[:, :t])
    return w


def kda_finish(config: K3Config, w: KDAWeights, o: np.ndarray, out_gate: np.ndarray) -> np.ndarray:
    """Per-head RMSNorm, output gate, o_proj. o [T, NH, D], out_gate [T, P] -> [T, H]."""
    T = o.shape[0]
    normed = rms_norm(o, w.o_norm, config.rms_norm_eps).reshape(T, config.kda_proj_size)
    return linear(normed * sigmoid(out_gate), w.o_proj)
