"""Gated multi-head latent attention without rotary embedding (K3_SPEC section 5, gated MLA layer).

    q        = q_b(RMSNorm(q_a x))                      -> NA heads of [DN nope | DR rope]
    c        = kv_a x = [latent KL | k_rope DR];  latent = RMSNorm(c[:KL], kv_a_layernorm)
    k_nope_h = W_uk_h latent,   v_h = W_uv_h latent     (kv_b split per head into key and value halves)
    score    = (q_nope . k_nope + q_rope . k_rope) / sqrt(DN + DR), causal softmax
    out      = o_proj(attention * sigmoid(g x))

Only [latent | k_rope] (KL + DR values) is cached per position. Attention runs on the latent directly by
absorbing W_uk into the query and W_uv into the output:
    q_nope . (W_uk latent_j) = (W_uk^T q_nope) . latent_j,    sum_j p_j W_uv latent_j = W_uv (sum_j p_j latent_j)
so no per-head key or value is ever expanded. The reference (model/reference.py) computes the expanded form.
With the absorbed query [W_uk^T q_nope | q_rope] against the cached row [latent | k_rope], the scores are one
product, and the softmax runs in tiles (model/causal_attention.py): prefill memory O(T x block), not O(T x N).

Shapes: T new tokens, N cached positions (including the new ones), NA heads.
"""

from __future__ import annotations

import numpy as np

from k3serve.config import K3Config
from k3serve.model.causal_attention import (DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK, absorb_queries, causal_attention,
                                            values_from_latent)
from k3serve.model.kernels import linear
from k3serve.model.ops import rms_norm, sigmoid, softmax
from k3serve.model.weights import MLAWeights


def mla_project(config: K3Config, w: MLAWeights, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """x [T, H] -> (q [T, NA, DN+DR], cache rows [T, KL+DR], output gate [T, NA*DV] or None)."""
    QL, KL, DR = config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim
    NA, DN = config.num_mla_heads, config.qk_nope_head_dim
    proj = linear(x, w.in_proj)  # [T, QL + KL + DR (+ NA*DV)]
    q = linear(rms_norm(proj[:, :QL], w.q_a_norm, config.rms_norm_eps), w.q_b)
    latent = rms_norm(proj[:, QL:QL + KL], w.kv_a_norm, config.rms_norm_eps)
    rows = np.concatenate([latent, proj[:, QL + KL:QL + KL + DR]], axis=1)  # [T, KL+DR]
    gate = proj[:, QL + KL + DR:] if w.has_gate else None
    return q.reshape(x.shape[0], NA, DN + DR), rows, gate


def mla_attend(config: K3Config, w: MLAWeights, q: np.ndarray, cache: np.ndarray, gate: np.ndarray | None,
               query_block: int = DEFAULT_QUERY_BLOCK, key_block: int = DEFAULT_KEY_BLOCK) -> np.ndarray:
    """Attention of T new queries over N cached rows; the new tokens are the last T rows of the cache.

    q [T, NA, DN+DR], cache [N, KL+DR], gate [T, NA*DV] -> [T, H]."""
    KL, DN, DR = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim
    T = q.shape[0]
    q_latent = absorb_queries(q[:, :, :DN], w.w_uk)  # [NA, T, KL]
    q_rope = q[:, :, DN:].transpose(1, 0, 2)  # [NA, T, DR]
    absorbed = np.concatenate([q_latent, q_rope], axis=2)  # [NA, T, KL+DR], against cache rows [latent | k_rope]
    out_latent = causal_attention(absorbed, cache, cache[:, :KL], 1.0 / np.sqrt(DN + DR),
                                  query_block, key_block)  # [NA, T, KL]
    attn = values_from_latent(out_latent, w.w_uv)  # [T, NA*DV]
    if gate is not None:
        attn = attn * sigmoid(gate)
    return linear(attn, w.o_proj)


def mla_attend_reference(config: K3Config, w: MLAWeights, q: np.ndarray, cache: np.ndarray,
                         gate: np.ndarray | None) -> np.ndarray:
    """The dense twin of `mla_attend`: the [NA, T, N] score matrix at once (memory O(T x N))."""
    KL, DN, DR = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim
    T, N = q.shape[0], cache.shape[0]
    latent, k_rope = cache[:, :KL], cache[:, KL:]
    q_latent = np.einsum("tad,adk->atk", q[:, :, :DN], w.w_uk)  # [NA, T, KL]
    q_rope = q[:, :, DN:].transpose(1, 0, 2)  # [NA, T, DR]
    scores = (q_latent @ latent.T + q_rope @ k_rope.T) * np.float32(1.0 / np.sqrt(DN + DR))  # [NA, T, N]
    visible = np.arange(N)[None, :] <= (N - T + np.arange(T))[:, None]  # [T, N]
    probs = softmax(np.where(visible[None], scores, -np.inf), axis=-1)
    attn = np.einsum("atk,avk->tav", probs @ latent, w.w_uv).reshape(T, -1)  # [T, NA*DV]
    if gate is not None:
        attn = attn * sigmoid(gate)
    return linear(attn, w.o_proj)


def mla_decode_batch(config: K3Config, w: MLAWeights, q: np.ndarray, caches: list[np.ndarray],
                     gate: np.ndarray | None) -> np.ndarray:
    """One new token for each of B sequences: the absorbed query, the value projection, the gate and o_proj run
    once for the batch; only the scores against each sequence's own cache rows run per sequence.

    q [B, NA, DN+DR], caches B arrays [N_b, KL+DR] (each ending with its new row), gate [B, NA*DV] -> [B, H].
    The same function as `mla_attend` on each sequence alone (one query sees every cached row)."""
    KL, DN, DR = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim
    B, NA = q.shape[0], q.shape[1]
    q_latent = absorb_queries(q[:, :, :DN], w.w_uk).transpose(1, 0, 2)  # [B, NA, KL]
    absorbed = np.concatenate([q_latent, q[:, :, DN:]], axis=2)  # [B, NA, KL+DR]
    scale = np.float32(1.0 / np.sqrt(DN + DR))
    out_latent = np.empty((B, NA, KL), np.float32)  # [B, NA, KL]
    for b, rows in enumerate(caches):
        scores = (absorbed[b] @ rows.T) * scale  # [NA, N_b]
        probs = np.exp(scores - scores.max(axis=1, keepdims=True))
        out_latent[b] = (probs @ rows[:, :KL]) / probs.sum(axis=1, keepdims=True)
    attn = values_from_latent(out_latent.transpose(1, 0, 2), w.w_uv)  # [B, NA*DV]
    if gate is not None:
        attn = attn * sigmoid(gate)
    return linear(attn, w.o_proj)
