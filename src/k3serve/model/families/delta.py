"""The two delta-rule token mixers of the families: Kimi Linear's KDA and Qwen3-Next's gated DeltaNet.

Both run the recurrence of k3serve.model.kda (chunked UT-transform form for prefill, one batched step for decode),
per head with state S [Dk, Dv]:
    S <- diag(exp(g_t)) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
q and k are L2-normalised per head (divided by sqrt(sum of squares + 1e-6)) and q is scaled by 1/sqrt(Dk).
They differ in the decay, the head layout and the output gate:

Kimi Linear KDA (Kimi Linear tech report, section 3; transformers `KimiLinearDeltaAttention`):
    q, k, v = SiLU(causal_conv(W_q x)), ...      NH heads of D (Dk = Dv = D)
    g       = -exp(A_log[h]) * softplus(f_b(f_a x) + dt_bias)        one decay per head and key channel
    beta    = sigmoid(b x)
    out     = o_proj(RMSNorm(o, o_norm) * sigmoid(g_b(g_a x)))       a low-rank output gate
  (K3's KDA differs in the decay, gate_lower_bound * sigmoid(exp(A_log) * z), and in a full-rank output gate.)

Qwen3-Next gated DeltaNet (Gated Delta Networks, Yang et al. 2024, eq. 10; transformers `Qwen3NextGatedDeltaNet`):
    [q k v z] = W_qkvz x and [b a] = W_ba x, laid out per key-head group in the checkpoint (reordered at load)
    q, k      NKH heads of Dk, each shared by NVH/NKH consecutive value heads; v, z: NVH heads of Dv
    g         = -exp(A_log[h]) * softplus(a + dt_bias)               one scalar per value head: the per-channel
                                                                      recurrence with all Dk channels equal
    beta      = sigmoid(b)
    out       = out_proj(RMSNorm(o, norm) * SiLU(z))

Shapes: T tokens, NH heads (value heads for DeltaNet), Dk / Dv head dims, K conv kernel, C conv channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.families.decoder import Batch
from k3serve.model.kda import KDAInputs, causal_conv, run_delta_rule
from k3serve.model.kernels import linear
from k3serve.model.ops import l2_normalize, rms_norm, sigmoid, silu
from k3serve.weights.quantized import QuantizedMatrix


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), without overflow for large x."""
    return np.logaddexp(np.float32(0.0), x).astype(np.float32, copy=False)


def _conv_segments(mixed: np.ndarray, taps: np.ndarray, batch: Batch, layer: int) -> tuple[np.ndarray, list]:
    """Causal depthwise conv of each sequence's rows with its carried tail, then SiLU. mixed [T, C]."""
    out = np.empty_like(mixed)
    new_tails = []
    for (start, end), cache in zip(batch.segments, batch.caches):
        out[start:end], tail = causal_conv(mixed[start:end], cache.recurrent_state(layer)[1], taps)
        new_tails.append(tail)
    return silu(out), new_tails


@dataclass(frozen=True)
class KimiDeltaWeights:
    in_proj: np.ndarray  # [3P + 2D + NH, H]: q, k, v, f_a, g_a, b stacked
    conv: np.ndarray  # [3P, K] q, k, v taps, oldest to newest
    f_b: np.ndarray | QuantizedMatrix  # [P, D]: float32, or a Q8_0 GGUF's blocks (multiplied by `linear`)
    g_b: np.ndarray | QuantizedMatrix  # [P, D]
    a_exp: np.ndarray  # [NH] exp(A_log)
    dt_bias: np.ndarray  # [P]
    o_norm: np.ndarray  # [D]
    o_proj: np.ndarray  # [H, P]


@dataclass
class KimiDeltaAttention:
    layer: int
    weights: KimiDeltaWeights
    num_heads: int  # NH
    head_dim: int  # D
    eps: float
    chunk_size: int | None

    def state_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        NH, D = self.num_heads, self.head_dim
        return (NH, D, D), (self.weights.conv.shape[1] - 1, 3 * NH * D)

    def __call__(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        NH, D = self.num_heads, self.head_dim
        P, T, w = NH * D, x.shape[0], self.weights
        proj = linear(x, w.in_proj)  # [T, 3P + 2D + NH]
        qkv, new_tails = _conv_segments(proj[:, :3 * P], w.conv, batch, self.layer)
        qkv = qkv.reshape(T, 3, NH, D)
        q = l2_normalize(qkv[:, 0]) * np.float32(D ** -0.5)
        k = l2_normalize(qkv[:, 1])
        v = np.ascontiguousarray(qkv[:, 2])
        f_a, g_a, b = proj[:, 3 * P:3 * P + D], proj[:, 3 * P + D:3 * P + 2 * D], proj[:, 3 * P + 2 * D:]
        z = (linear(f_a, w.f_b) + w.dt_bias).reshape(T, NH, D)
        g = -w.a_exp[None, :, None] * softplus(z)  # [T, NH, D], <= 0
        inputs = KDAInputs(q=q, k=k, v=v, g=g.astype(np.float32), beta=sigmoid(b), conv_inputs=proj[:, :3 * P])
        o = run_delta_rule(inputs, batch.segments, batch.caches, self.layer, new_tails, self.chunk_size)  # [T, NH, D]
        gate = linear(g_a, w.g_b).reshape(T, NH, D)
        return linear((rms_norm(o, w.o_norm, self.eps) * sigmoid(gate)).reshape(T, P), w.o_proj)


@dataclass(frozen=True)
class GatedDeltaWeights:
    in_proj: np.ndarray  # [2*NKH*Dk + 2*NVH*Dv + 2*NVH, H]: q, k, v, z, b, a (reordered from the checkpoint)
    conv: np.ndarray  # [2*NKH*Dk + NVH*Dv, K] q, k, v taps
    a_exp: np.ndarray  # [NVH] exp(A_log)
    dt_bias: np.ndarray  # [NVH]
    norm: np.ndarray  # [Dv]
    out_proj: np.ndarray  # [H, NVH*Dv]


@dataclass
class GatedDeltaNet:
    layer: int
    weights: GatedDeltaWeights
    num_key_heads: int  # NKH
    num_value_heads: int  # NVH
    key_dim: int  # Dk
    value_dim: int  # Dv
    eps: float
    chunk_size: int | None

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    def state_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        return (self.num_value_heads, self.key_dim, self.value_dim), (self.weights.conv.shape[1] - 1,
                                                                      self.conv_channels)

    def __call__(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        NKH, NVH, Dk, Dv = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim
        T, w, C = x.shape[0], self.weights, self.conv_channels
        proj = linear(x, w.in_proj)  # [T, C + NVH*Dv + 2*NVH]
        qkv, new_tails = _conv_segments(proj[:, :C], w.conv, batch, self.layer)
        q = l2_normalize(qkv[:, :NKH * Dk].reshape(T, NKH, Dk)) * np.float32(Dk ** -0.5)
        k = l2_normalize(qkv[:, NKH * Dk:2 * NKH * Dk].reshape(T, NKH, Dk))
        group = NVH // NKH  # value heads h uses key head h // group
        q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)  # [T, NVH, Dk]
        v = np.ascontiguousarray(qkv[:, 2 * NKH * Dk:].reshape(T, NVH, Dv))
        z = proj[:, C:C + NVH * Dv].reshape(T, NVH, Dv)
        b, a = proj[:, C + NVH * Dv:C + NVH * Dv + NVH], proj[:, C + NVH * Dv + NVH:]  # [T, NVH] each
        g = -w.a_exp * softplus(a + w.dt_bias)  # [T, NVH]
        g = np.repeat(g[:, :, None], Dk, axis=2).astype(np.float32)  # equal decay on every key channel
        inputs = KDAInputs(q=q, k=k, v=v, g=g, beta=sigmoid(b), conv_inputs=proj[:, :C])
        o = run_delta_rule(inputs, batch.segments, batch.caches, self.layer, new_tails, self.chunk_size)  # [T, NVH, Dv]
        return linear((rms_norm(o, w.norm, self.eps) * silu(z)).reshape(T, NVH * Dv), w.out_proj)
