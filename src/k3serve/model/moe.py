"""The sigmoid router, the latent MoE with shared experts, and the dense MLP (K3_SPEC section 5).

Router:  s = sigmoid(gate x); choose TOPK by s + bias (the bias affects selection only);
         weight_e = s_e / sum(s_chosen) * routed_scaling_factor
MoE:     z = routed_expert_down_proj x            (H -> LT)
         y_e = w2_e SiTU-GLU(w1_e z, w3_e z)       in the latent, each expert straight from its MXFP4 bytes
         r = RMSNorm(sum_e weight_e y_e, routed_expert_norm)
         out = routed_expert_up_proj r + shared_experts(x)
Each expert is computed once per forward for all tokens routed to it, so a batch reads each expert once.

Shapes: T tokens, NE experts, TOPK active, LT latent, MI expert intermediate, SI shared width.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
from numba import njit

from k3serve.config import K3Config
from k3serve.model.kernels import (StackedExperts, accumulate_expert_rows, linear, mxfp4_experts_accumulate_stacked,
                                   mxfp4_experts_run, stack_expert)
from k3serve.model.fused_ops import select_top_k, route_top_k
from k3serve.model.ops import rms_norm, sigmoid, situ_glu
from k3serve.model import routing as routing_module
from k3serve.model.routing import ExpertPairs, Routing, pairs_by_expert
from k3serve.model.weights import DenseMLPPieces, DenseMLPWeights, ExpertWeights, LayerWeights, MoEWeights


def route(config: K3Config, w: MoEWeights, x: np.ndarray) -> Routing:
    """x [T, H] -> the TOPK experts of each token and their mixing weights."""
    return route_scores(config, sigmoid(x @ w.router.T), w.router_bias)


def route_scores(config: K3Config, scores: np.ndarray, bias: np.ndarray) -> Routing:
    """scores [T, NE] (after sigmoid) -> Routing. Ties in s + bias go to the lower expert id."""
    num_tokens, top_k = scores.shape[0], config.num_experts_per_token
    ids = np.empty((num_tokens, top_k), np.int64)  # [T, TOPK]
    weights = np.empty((num_tokens, top_k), np.float32)  # [T, TOPK]
    route_top_k(np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(bias, dtype=np.float32),
                config.moe_renormalize, np.float32(config.routed_scaling_factor), ids, weights)
    return Routing(expert_ids=ids, weights=weights)


@njit(cache=True)
def top_k_rows(biased: np.ndarray, ids: np.ndarray) -> None:
    """ids[t] = the ids of row t's largest values, largest first, the lower id first among equal values (a stable
    descending sort's first TOPK; NaN counts as the smallest): `fused_ops.select_top_k` on every row."""
    taken = np.zeros(biased.shape[1], np.bool_)
    for t in range(biased.shape[0]):
        select_top_k(biased[t], taken, ids[t])


def guess_next_layer(config: K3Config, next_layer: LayerWeights, hidden: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Guess the next layer's experts before it runs. hidden [T, H] is what the current layer feeds its
    post-attention norm; the next layer's own norm, router and selection bias score it. Returns the guessed top-k
    [T, TOPK] and the biased scores [T, NE]. This is what `--prefetch next-layer` loads and what routing-stats
    measures the recall of."""
    x = rms_norm(hidden, next_layer.post_attention_norm, config.rms_norm_eps)
    scores = sigmoid(x @ next_layer.mlp.router.T)
    return route_scores(config, scores, next_layer.mlp.router_bias).expert_ids, scores + next_layer.mlp.router_bias


ExpertFetch = Callable[[Sequence[int]], Mapping[int, ExpertWeights]]
# (the step's pairs, z [T, LT]) -> y [N, LT] in pair order, or None: compute them here (`ExpertSource.expert_outputs`)
RemoteExperts = Callable[[ExpertPairs, np.ndarray], "np.ndarray | None"]


def expert_outputs(config: K3Config, fetch_experts: ExpertFetch, expert_ids: np.ndarray, z: np.ndarray,
                   tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """y [N, LT]: y[n] = w2_e SiTU-GLU(w1_e z[tokens[n]], w3_e z[tokens[n]]) for expert e = expert_ids[k] on rows
    starts[k]:ends[k], one compiled call per expert in ascending id (what an expert owner computes; each row is
    the same bits as in the one-call kernel, whatever the other rows)."""
    y = np.empty((tokens.shape[0], z.shape[1]), np.float32)  # [N, LT]
    experts = fetch_experts([int(e) for e in expert_ids])
    single = np.zeros(1, np.int64)
    for expert, start, end in zip(expert_ids, starts, ends):
        e = experts[int(expert)]
        one = stack_expert((e.w1_packed, e.w1_scales), (e.w3_packed, e.w3_scales), (e.w2_packed, e.w2_scales))
        y[start:end] = mxfp4_experts_run(one, single, z, tokens[start:end], single, np.full(1, end - start, np.int64),
                                         config.situ_beta, config.situ_linear_beta)
    return y


def moe_forward(config: K3Config, w: MoEWeights, x: np.ndarray, fetch_experts: ExpertFetch,
                routing: Routing | None = None, stacked: StackedExperts | None = None,
                remote: RemoteExperts | None = None) -> tuple[np.ndarray, Routing]:
    """x [T, H] -> (out [T, H], routing). `fetch_experts(ids)` returns the MXFP4 weights of those experts;
    `stacked`, when the source holds the layer's experts as [NE, ...] arrays, lets one compiled call run them
    all (the same bits as one call per expert); `remote`, when it returns outputs, computed the experts elsewhere
    (expert parallelism) and they are weighted and added here in the same order, so the bits are the same."""
    if routing is None:
        routing = route(config, w, x)
    T = x.shape[0]
    z = np.ascontiguousarray(linear(x, w.latent_down))  # [T, LT]
    pairs = pairs_by_expert(routing.expert_ids)
    needed, starts, ends, tokens_by_expert = pairs.expert_ids, pairs.starts, pairs.ends, pairs.tokens
    weights_by_expert = np.ascontiguousarray(routing.weights.ravel()[pairs.order])
    mixed = np.zeros((T, config.latent_size), np.float32)  # [T, LT]
    beta, linear_beta = config.situ_beta, config.situ_linear_beta
    remote_y = None if remote is None else remote(pairs, z)
    if remote_y is not None:  # [T*TOPK, LT] from the expert owners
        accumulate_expert_rows(remote_y, tokens_by_expert, weights_by_expert, mixed)
    elif stacked is not None:  # every expert of the layer in one call, spread over the cores
        # a long prompt EXPERT_CHUNK_TOKENS tokens a call (routing.py: the calls' buffers were prefill's peak memory);
        # each token's row is the same bits, its experts added in ascending id as in one call
        step = routing_module.EXPERT_CHUNK_TOKENS
        for first in range(0, T, step):
            rows = slice(first, first + step)
            if T <= step:
                chunk, chunk_weights = pairs, weights_by_expert
            else:
                chunk = pairs_by_expert(routing.expert_ids[rows])
                chunk_weights = np.ascontiguousarray(routing.weights[rows].ravel()[chunk.order])
            mxfp4_experts_accumulate_stacked(stacked, np.asarray(chunk.expert_ids, np.int64), z[rows], chunk.tokens,
                                             np.asarray(chunk.starts, np.int64), np.asarray(chunk.ends, np.int64),
                                             chunk_weights, beta, linear_beta, mixed[rows])
    else:  # one call per expert, ascending id (a lazy mapping may reuse a slot for the next expert)
        experts = fetch_experts([int(e) for e in needed])
        single = np.zeros(1, np.int64)
        for expert, start, end in zip(needed, starts, ends):
            e = experts[int(expert)]
            one = stack_expert((e.w1_packed, e.w1_scales), (e.w3_packed, e.w3_scales), (e.w2_packed, e.w2_scales))
            mxfp4_experts_accumulate_stacked(one, single, z, tokens_by_expert[start:end], single,
                                             np.full(1, end - start, np.int64), weights_by_expert[start:end],
                                             beta, linear_beta, mixed)
    if config.latent_moe_use_norm:
        mixed = rms_norm(mixed, w.latent_norm, config.rms_norm_eps)
    out = linear(mixed, w.latent_up)  # [T, H]
    if w.shared_gate_up is not None:
        out += _glu_mlp(config, w.shared_gate_up, w.shared_down, x)
    return out, routing


def dense_mlp_forward(config: K3Config, w: DenseMLPWeights | DenseMLPPieces, x: np.ndarray) -> np.ndarray:
    if isinstance(w, DenseMLPPieces):  # read piece by piece: gate_up's buffer is reused for down
        gate_up = w.gate_up()  # [2I, H]
        h = linear(x, gate_up)  # [T, 2I]
        width = gate_up.shape[0] // 2
        del gate_up
        return linear(situ_glu(h[:, :width], h[:, width:], config.situ_beta, config.situ_linear_beta), w.down())
    return _glu_mlp(config, w.gate_up, w.down, x)


def _glu_mlp(config: K3Config, gate_up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """down(SiTU-GLU(gate x, up x)) with gate and up stacked in one [2I, H] matrix."""
    h = linear(x, gate_up)  # [T, 2I]
    width = gate_up.shape[0] // 2
    return linear(situ_glu(h[:, :width], h[:, width:], config.situ_beta, config.situ_linear_beta), down)
