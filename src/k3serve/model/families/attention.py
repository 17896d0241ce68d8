"""Grouped-query attention with per-head q/k RMSNorm and rotary embedding (Qwen3-MoE), optionally with the
sigmoid output gate of Qwen3-Next's full-attention layers.

Per token, with NQ query heads sharing NKV key/value heads (group G = NQ / NKV), head dim hd:
    q_h = RMSNorm(W_q x)_h,  k_g = RMSNorm(W_k x)_g,  v_g = (W_v x)_g      (norms over hd, one weight per layer)
    q_h, k_g = RoPE(q_h, p), RoPE(k_g, p)
    o_h = sum_j softmax_j(q_h . k_{g(h), j} / sqrt(hd)) v_{g(h), j}        g(h) = h // G, causal over j <= p
    out = W_o [o_1 .. o_NQ]                               (Qwen3-MoE)
    out = W_o ([o_1 .. o_NQ] * sigmoid(gate))             (Qwen3-Next: W_q yields [q_h | gate_h] per head)
Keys are cached after norm and rotation: one row [k (NKV*hd) | v (NKV*hd)] per position. The softmax runs in
tiles (model/causal_attention.py): prefill memory O(T x block), not O(T x N); `_attend_reference` is the dense twin.

Shapes: T new tokens of a sequence, N cached positions (including the new ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.causal_attention import (DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK, causal_attention,
                                            causal_attention_reference)
from k3serve.model.families.decoder import Batch
from k3serve.model.families.rope import Rotary
from k3serve.model.kernels import linear
from k3serve.model.ops import rms_norm, sigmoid


@dataclass(frozen=True)
class GQAWeights:
    qkv: np.ndarray  # [NQ*hd*(2 if gated) + 2*NKV*hd, H]: q (with gate), k, v stacked
    q_norm: np.ndarray  # [hd]
    k_norm: np.ndarray  # [hd]
    o_proj: np.ndarray  # [H, NQ*hd]


@dataclass
class GQAAttention:
    layer: int
    weights: GQAWeights
    num_heads: int  # NQ
    num_kv_heads: int  # NKV
    head_dim: int  # hd
    rotary: Rotary
    eps: float
    gated: bool
    query_block: int = DEFAULT_QUERY_BLOCK
    key_block: int = DEFAULT_KEY_BLOCK

    @property
    def row_width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def __call__(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        NQ, NKV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        T = x.shape[0]
        proj = linear(x, self.weights.qkv)  # [T, NQ*hd*(1|2) + 2*NKV*hd]
        q_width = NQ * hd * (2 if self.gated else 1)
        if self.gated:
            q_and_gate = proj[:, :q_width].reshape(T, NQ, 2 * hd)  # per head [q | gate]
            q, gate = q_and_gate[:, :, :hd], q_and_gate[:, :, hd:].reshape(T, NQ * hd)
        else:
            q, gate = proj[:, :q_width].reshape(T, NQ, hd), None
        k = proj[:, q_width:q_width + NKV * hd].reshape(T, NKV, hd)
        v = proj[:, q_width + NKV * hd:]  # [T, NKV*hd]
        cos, sin = batch.cos_sin(self.rotary)
        q = self.rotary.apply(rms_norm(q, self.weights.q_norm, self.eps), cos, sin)  # [T, NQ, hd]
        k = self.rotary.apply(rms_norm(k, self.weights.k_norm, self.eps), cos, sin)  # [T, NKV, hd]
        rows = np.concatenate([k.reshape(T, NKV * hd), v], axis=1)  # [T, 2*NKV*hd]
        out = np.empty((T, NQ * hd), np.float32)
        for (start, end), cache in zip(batch.segments, batch.caches):
            cache.append_rows(self.layer, rows[start:end])
            out[start:end] = self._attend(q[start:end], cache.attention_rows(self.layer))
        if gate is not None:
            out = out * sigmoid(gate)
        return linear(out, self.weights.o_proj)

    def _split(self, q: np.ndarray, cached: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [T, NQ, hd], cached [N, 2*NKV*hd] -> grouped queries [NKV, G, T, hd], keys and values [NKV, 1, N, hd]."""
        NQ, NKV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        T, N, G = q.shape[0], cached.shape[0], NQ // NKV
        keys = cached[:, :NKV * hd].reshape(N, NKV, hd).transpose(1, 0, 2)[:, None]  # [NKV, 1, N, hd]
        values = cached[:, NKV * hd:].reshape(N, NKV, hd).transpose(1, 0, 2)[:, None]  # [NKV, 1, N, hd]
        return q.reshape(T, NKV, G, hd).transpose(1, 2, 0, 3), keys, values

    def _attend(self, q: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """q [T, NQ, hd] over cached rows [N, 2*NKV*hd]; the new tokens are the last T rows. -> [T, NQ*hd]."""
        grouped, keys, values = self._split(q, cached)
        out = causal_attention(grouped, keys, values, self.head_dim ** -0.5, self.query_block, self.key_block)
        return out.transpose(2, 0, 1, 3).reshape(q.shape[0], -1)  # [NKV, G, T, hd] -> [T, NQ*hd]

    def _attend_reference(self, q: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """The dense twin of `_attend` ([NKV, G, T, N] scores at once)."""
        grouped, keys, values = self._split(q, cached)
        out = causal_attention_reference(grouped, keys, values, self.head_dim ** -0.5)
        return out.transpose(2, 0, 1, 3).reshape(q.shape[0], -1)
