"""Causal softmax attention in tiles with an online softmax, so that prefill memory is O(T x block), never O(T^2).

For queries q_t (t = 0..T-1, at positions N - T + t) over N keys k_j and values v_j:
    o_t = sum_{j <= N-T+t} softmax_j(scale q_t . k_j) v_j
computed over key blocks K_1, K_2, ... with a running maximum m, a running normaliser l and an unnormalised
output acc (the online softmax of Milakov & Gimelshein 2018, as tiled in FlashAttention, Dao et al. 2022, sec. 3.1):
    S_i   = scale Q K_i^T (masked causally)
    m_i   = max(m_{i-1}, rowmax S_i)
    l_i   = exp(m_{i-1} - m_i) l_{i-1} + rowsum exp(S_i - m_i)
    acc_i = exp(m_{i-1} - m_i) acc_{i-1} + exp(S_i - m_i) V_i
    o     = acc_last / l_last
Queries are tiled too, and a query block only visits the key blocks it can see, so the causal upper triangle is
never computed. The live memory is one [..., query block, key block] score tile plus the [..., T, DV] output.

`causal_attention_reference` is the dense twin ([..., T, N] scores at once), kept for tests and for inputs small
enough to fit one tile, where `causal_attention` calls it (so short prompts and decode steps are unchanged).

Shapes: leading dims `...` broadcast between q, keys and values (heads, or KV groups and their query heads);
T queries, N keys (the queries are the last T of them), D query/key width, DV value width.
"""

from __future__ import annotations

import numpy as np

from k3serve.model.ops import softmax

DEFAULT_QUERY_BLOCK = 128  # [128 x 256] tiles: 2.1x the [256 x 1024] ones at T = 512 (32 heads of 128),
DEFAULT_KEY_BLOCK = 256  # as fast at T = 2048; fewer masked keys on the diagonal (docs/BENCHMARKS.md)


def causal_attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """q [..., T, D], keys [..., N, D], values [..., N, DV] -> [..., T, DV] with the whole score matrix."""
    T, N = q.shape[-2], keys.shape[-2]
    scores = (q @ keys.swapaxes(-1, -2)) * np.float32(scale)  # [..., T, N]
    # query t sits at position N - T + t and sees positions 0 .. N - T + t
    visible = np.arange(N)[None, :] <= (N - T + np.arange(T))[:, None]  # [T, N]
    return softmax(np.where(visible, scores, -np.inf), axis=-1) @ values


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
                     query_block: int = DEFAULT_QUERY_BLOCK, key_block: int = DEFAULT_KEY_BLOCK) -> np.ndarray:
    """As `causal_attention_reference`, in [query_block x key_block] tiles once T x N exceeds one tile."""
    if query_block < 1 or key_block < 1:
        raise ValueError(f"attention blocks must be >= 1, got {query_block} x {key_block}")
    T, N = q.shape[-2], keys.shape[-2]
    if T > N:
        raise ValueError(f"{T} queries over {N} keys: the queries must be the last T of the keys")
    if T * N <= query_block * key_block:  # one tile holds every score (decode, short prompts): the folded products
        query_block, key_block = max(T, 1), max(N, 1)  # below, once (1.25-1.7x the whole-matrix twin at decode)
    lead = np.broadcast_shapes(q.shape[:-2], keys.shape[:-2], values.shape[:-2])
    out = np.empty(lead + (T, values.shape[-1]), np.float32)  # [..., T, DV]
    scaled = q * np.float32(scale)
    first_position = N - T
    # Query rows that share their keys are one matrix product: the query heads of a KV group (GQA: q [..., G, T, D]
    # over keys [..., 1, N, D]) or every head (MLA: keys [N, D]) give G x bq rows against the key tile instead of G
    # products of bq rows: fewer, larger BLAS calls (1.33x the whole attention at T = 2048, 32 heads over 4 KV
    # heads), the same per-row arithmetic. `folded`: how many leading axes of q go into the rows.
    if keys.ndim == 2 and values.ndim == 2 and q.ndim > 2:
        folded, key_rows, value_rows = q.ndim - 2, keys, values
    elif (q.ndim > 2 and keys.ndim == values.ndim == q.ndim and q.shape[-3] > 1 and keys.shape[-3] == 1
          and values.shape[-3] == 1):
        folded, key_rows, value_rows = 1, keys[..., 0, :, :], values[..., 0, :, :]
    else:
        folded, key_rows, value_rows = 0, keys, values
    for q_start in range(0, T, query_block):
        q_end = min(q_start + query_block, T)
        q_tile = scaled[..., q_start:q_end, :]  # [..., bq, D]
        kept = q_tile.shape[:q.ndim - 2 - folded]  # the leading axes that stay batch axes of the products
        if folded:  # [kept..., folded rows x bq, D]
            q_tile = np.ascontiguousarray(q_tile).reshape(*kept, -1, q_tile.shape[-1])
        positions = first_position + np.arange(q_start, q_end)  # [bq]
        last_visible = int(positions[-1])
        running_max = normaliser = acc = None
        for k_start in range(0, last_visible + 1, key_block):
            k_end = min(k_start + key_block, last_visible + 1)
            scores = q_tile @ key_rows[..., k_start:k_end, :].swapaxes(-1, -2)  # [..., bq, bk] (rows folded)
            if folded:  # [..., bq, bk]: the mask and the softmax see each head's rows
                scores = scores.reshape(*lead, q_end - q_start, k_end - k_start)
            if k_end - 1 > positions[0]:  # the tile crosses the diagonal: mask the keys after each query
                hidden = np.arange(k_start, k_end)[None, :] > positions[:, None]  # [bq, bk]
                np.copyto(scores, np.float32(-np.inf), where=hidden)
            tile_max = scores.max(axis=-1)  # [..., bq]
            if running_max is None:  # key 0 is visible to every query: the first tile's maxima are finite
                new_max = tile_max
            else:
                new_max = np.maximum(running_max, tile_max)
            scores -= new_max[..., None]
            p = np.exp(scores, out=scores)  # [..., bq, bk], in place: one tile of memory
            if folded:
                rows = p.reshape(*p.shape[:len(kept)], -1, p.shape[-1])  # [kept..., folded rows x bq, bk]
                tile_out = (rows @ value_rows[..., k_start:k_end, :]).reshape(*p.shape[:-1], values.shape[-1])
            else:
                tile_out = p @ values[..., k_start:k_end, :]  # [..., bq, DV]
            if running_max is None:
                normaliser, acc = p.sum(axis=-1), tile_out
            else:
                correction = np.exp(running_max - new_max)  # [..., bq]
                normaliser *= correction
                normaliser += p.sum(axis=-1)
                acc *= correction[..., None]
                acc += tile_out
            running_max = new_max
        out[..., q_start:q_end, :] = acc / normaliser[..., None]
    return out


def absorb_queries(q_nope: np.ndarray, w_uk: np.ndarray) -> np.ndarray:
    """W_uk^T q_nope per head: q_nope [T, NA, DN], w_uk [NA, DN, KL] -> [NA, T, KL] (MLA's absorbed query). One BLAS
    product a head: np.einsum's loops took 107 us / 0.85 ms / 56 ms for 1 / 8 / 512 tokens of 16 heads of 128 x 512
    (Moonlight's shapes), this 58 us / 0.16 ms / 7.4 ms."""
    return np.matmul(q_nope.transpose(1, 0, 2), w_uk)


def values_from_latent(out_latent: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """W_uv out_latent per head: out_latent [NA, T, KL], w_uv [NA, DV, KL] -> [T, NA*DV], one BLAS product a head
    (against np.einsum: 171 us -> 64 us at 1 token, 108 -> 8.9 ms at 512, the same shapes)."""
    values = np.matmul(out_latent, w_uv.transpose(0, 2, 1))  # [NA, T, DV]
    return values.transpose(1, 0, 2).reshape(out_latent.shape[1], -1)
