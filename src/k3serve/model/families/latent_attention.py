"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1) with rotary embedding on the decoupled key
(DeepSeek-V3 / Kimi K2) or without any (Kimi Linear, whose "rope" dims are carried but never rotated).

    q        = q_b(RMSNorm(q_a x))   or   q_proj x            -> NA heads of [q_nope DN | q_rope DR]
    c        = kv_a x = [latent KL | k_rope DR];  latent = RMSNorm(c[:KL], kv_a_layernorm)
    q_rope, k_rope = RoPE(q_rope, p), RoPE(k_rope, p)         (DeepSeek-V3 only; k_rope is one head shared by all)
    k_nope_h = W_uk_h latent,   v_h = W_uv_h latent           (kv_b split per head into key and value halves)
    score    = (q_nope . k_nope + q_rope . k_rope) * scale, causal softmax;   out = o_proj(attention)
scale = 1/sqrt(DN + DR), times mscale^2 under YaRN with `mscale_all_dim` (DeepSeek-V3 section 4.3, long context).

As in K3's MLA (k3serve.model.mla), only [latent | rotated k_rope] is cached per position and attention runs on
the latent with W_uk absorbed into the query and W_uv into the output:
    q_nope . (W_uk latent_j) = (W_uk^T q_nope) . latent_j,     sum_j p_j W_uv latent_j = W_uv (sum_j p_j latent_j)
and the softmax runs in tiles (model/causal_attention.py): prefill memory O(T x block), not O(T x N).

W_uk and W_uv are float32 [NA, DN, KL] / [NA, DV, KL] (one BLAS product a head, per sequence), or, from a GGUF
that stores attn_k_b / attn_v_b as Q8_0, those blocks as they are (`QuantizedMatrix` [NA*KL, DN] / [NA*DV, KL],
heads stacked): llama.cpp's arithmetic (activations quantized to Q8_0 per head and token, `q8_0_heads_matmul`), a
quarter of the bytes, and every token of a step in one call, since each output's bits depend on its own row alone.

Shapes: T new tokens of a sequence, N cached positions (including the new ones), NA heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.causal_attention import (DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK, absorb_queries,
                                            causal_attention, causal_attention_reference, values_from_latent)
from k3serve.model.families.decoder import Batch
from k3serve.model.families.rope import Rotary
from k3serve.model.kernels import linear, q8_0_heads_matmul
from k3serve.model.ops import rms_norm
from k3serve.weights.quantized import QuantizedMatrix


@dataclass(frozen=True)
class LatentAttentionWeights:
    in_proj: np.ndarray  # [QL + KL + DR, H] (q_a and kv_a stacked) or [NA*(DN+DR) + KL + DR, H] (q_proj and kv_a)
    q_a_norm: np.ndarray | None  # [QL], None without a query low-rank
    q_b: np.ndarray | None  # [NA*(DN+DR), QL]
    kv_a_norm: np.ndarray  # [KL]
    w_uk: np.ndarray | QuantizedMatrix  # [NA, DN, KL], or Q8_0 attn_k_b [NA*KL, DN] (transposed per head)
    w_uv: np.ndarray | QuantizedMatrix  # [NA, DV, KL], or Q8_0 attn_v_b [NA*DV, KL]
    o_proj: np.ndarray  # [H, NA*DV]


@dataclass
class LatentAttention:
    layer: int
    weights: LatentAttentionWeights
    num_heads: int  # NA
    q_lora_rank: int | None  # QL
    kv_lora_rank: int  # KL
    nope_dim: int  # DN
    rope_dim: int  # DR
    value_dim: int  # DV
    scale: float
    rotary: Rotary | None
    norm_eps: float  # of q_a_layernorm and kv_a_layernorm
    query_block: int = DEFAULT_QUERY_BLOCK
    key_block: int = DEFAULT_KEY_BLOCK

    @property
    def row_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def __call__(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        NA, KL, DN, DR = self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim
        w = self.weights
        T = x.shape[0]
        proj = linear(x, w.in_proj)
        if self.q_lora_rank is None:
            q_width = NA * (DN + DR)
            q = proj[:, :q_width]
        else:
            q_width = self.q_lora_rank
            q = linear(rms_norm(proj[:, :q_width], w.q_a_norm, self.norm_eps), w.q_b)
        q = q.reshape(T, NA, DN + DR)
        latent = rms_norm(proj[:, q_width:q_width + KL], w.kv_a_norm, self.norm_eps)  # [T, KL]
        k_rope = proj[:, q_width + KL:q_width + KL + DR]  # [T, DR]
        if self.rotary is not None:
            cos, sin = batch.cos_sin(self.rotary)
            q = np.concatenate([q[:, :, :DN], self.rotary.apply(q[:, :, DN:], cos, sin)], axis=2)
            k_rope = self.rotary.apply(k_rope[:, None, :], cos, sin)[:, 0, :]
        rows = np.concatenate([latent, k_rope], axis=1)  # [T, KL+DR]
        if isinstance(w.w_uk, QuantizedMatrix):  # per-token bits: every sequence's tokens in one call each side
            absorbed = self._absorbed(q)  # [NA, T, KL+DR]
            out_latent = np.empty((NA, T, KL), np.float32)
            for (start, end), cache in zip(batch.segments, batch.caches):
                cache.append_rows(self.layer, rows[start:end])
                cached = cache.attention_rows(self.layer)
                out_latent[:, start:end] = causal_attention(absorbed[:, start:end], cached, cached[:, :KL],
                                                            self.scale, self.query_block, self.key_block)
            return linear(heads_values(out_latent, w.w_uv), w.o_proj)
        out = np.empty((T, NA * self.value_dim), np.float32)
        for (start, end), cache in zip(batch.segments, batch.caches):
            cache.append_rows(self.layer, rows[start:end])
            out[start:end] = self._attend(q[start:end], cache.attention_rows(self.layer))
        return linear(out, w.o_proj)

    def _absorbed(self, q: np.ndarray) -> np.ndarray:
        """q [T, NA, DN+DR] -> [W_uk^T q_nope | q_rope] [NA, T, KL+DR], against cached rows [latent | k_rope]."""
        q_latent = absorb_heads(q[:, :, :self.nope_dim], self.weights.w_uk)  # [NA, T, KL]
        return np.concatenate([q_latent, q[:, :, self.nope_dim:].transpose(1, 0, 2)], axis=2)

    def _attend(self, q: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """q [T, NA, DN+DR] over cached rows [N, KL+DR]; the new tokens are the last T rows. -> [T, NA*DV]. (A long
        prompt arrives PREFILL_CHUNK_TOKENS rows at a time: `Batch.row_groups`.)"""
        out_latent = causal_attention(self._absorbed(q), cached, cached[:, :self.kv_lora_rank], self.scale,
                                      self.query_block, self.key_block)  # [NA, T, KL]
        return heads_values(out_latent, self.weights.w_uv)  # [T, NA*DV]

    def _attend_reference(self, q: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """The dense twin of `_attend` ([NA, T, N] scores at once)."""
        out_latent = causal_attention_reference(self._absorbed(q), cached, cached[:, :self.kv_lora_rank], self.scale)
        w_uv = self.weights.w_uv
        if isinstance(w_uv, QuantizedMatrix):
            return heads_values(out_latent, w_uv)
        return np.einsum("atk,avk->tav", out_latent, w_uv).reshape(q.shape[0], -1)


def absorb_heads(q_nope: np.ndarray, w_uk: np.ndarray | QuantizedMatrix) -> np.ndarray:
    """W_uk^T q_nope per head: q_nope [T, NA, DN] -> [NA, T, KL], for w_uk float32 [NA, DN, KL] (BLAS,
    `absorb_queries`) or Q8_0 attn_k_b [NA*KL, DN] (`q8_0_heads_matmul`)."""
    if not isinstance(w_uk, QuantizedMatrix):
        return absorb_queries(q_nope, w_uk)
    heads = q_nope.shape[1]
    return q8_0_heads_matmul(w_uk.data.reshape(heads, -1, w_uk.data.shape[1]), q_nope.transpose(1, 0, 2))


def heads_values(out_latent: np.ndarray, w_uv: np.ndarray | QuantizedMatrix) -> np.ndarray:
    """W_uv out_latent per head: out_latent [NA, T, KL] -> [T, NA*DV], for w_uv float32 [NA, DV, KL] (BLAS,
    `values_from_latent`) or Q8_0 attn_v_b [NA*DV, KL] (`q8_0_heads_matmul`)."""
    if not isinstance(w_uv, QuantizedMatrix):
        return values_from_latent(out_latent, w_uv)
    heads, tokens = out_latent.shape[0], out_latent.shape[1]
    values = q8_0_heads_matmul(w_uv.data.reshape(heads, -1, w_uv.data.shape[1]), out_latent)  # [NA, T, DV]
    return values.transpose(1, 0, 2).reshape(tokens, -1)
