"""A trainable torch K3 with exactly the numpy engine's math (K3_SPEC section 5), and its export.

Module paths mirror the released tensor names (k3serve.weights.names): the state-dict key of every trunk
parameter IS its released name, e.g. `language_model.model.layers.1.self_attn.q_proj.weight`. The one exception
is the routed experts, held stacked per layer as `...block_sparse_moe.experts.w1` [NE, MI, LT] (likewise w3, w2)
so that training does not walk NE tiny modules; `export` splits them into `experts.{e}.{w1,w3,w2}` in MXFP4.

    KDA    q,k,v = SiLU(causal_conv(proj x)); q,k L2-normalised, q /= sqrt(D); beta = sigmoid(b x)
           g = gate_lower_bound * sigmoid(exp(A_log[h]) * (f_b f_a x + dt_bias)); alpha = exp(g)
           S <- diag(alpha) S; S <- S + k (beta (v - S^T k))^T; o = S^T q    (chunked UT/WY form, see kda_chunked)
           out = o_proj(RMSNorm_D(o) * sigmoid(g_proj x))
    MLA    no rotary; out = o_proj(softmax((q_nope.k_nope + q_rope.k_rope)/sqrt(DN+DR)) v * sigmoid(g_proj x))
    MoE    s = sigmoid(gate x); top-k of s + bias (selection only); w = s_chosen / sum * scale
           out = up(RMSNorm(sum_e w_e w2_e SiTU-GLU(w1_e z, w3_e z))) + shared(x), z = down(x)
    AttnRes  sum_i softmax_i(RMSNorm(s_i) . (norm_w * proj_w)) s_i, block stack as in k3serve.model.k3

Shapes: B batch, T time, H hidden, NH KDA heads, D KDA head dim, P = NH*D, C chunk, NE experts, N = B*T tokens.
The correction bias is a buffer (no gradient): training adjusts it from expert loads (auxiliary-loss-free
balancing), see `K3ForTraining.update_router_bias`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import K3Config
from k3serve.weights import names
from k3serve.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3serve.weights.safetensors_io import SafetensorsIndex, save_sharded

KDA_CHUNK_SIZE = 16


# ---------------------------------------------------------------------------------------------------- ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return out * weight if weight is not None else out


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def attn_res(sources: list[torch.Tensor], norm: "RMSNorm", proj: nn.Linear, eps: float) -> torch.Tensor:
    """sources: S tensors [..., H] -> [..., H]; the query is norm.weight * proj.weight."""
    stacked = torch.stack(sources)  # [S, ..., H]
    query = norm.weight * proj.weight[0]  # [H]
    weights = torch.softmax(rms_norm(stacked, None, eps) @ query, dim=0)  # [S, ...]
    return (weights.unsqueeze(-1) * stacked).sum(0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    return nn.Linear(fan_in, fan_out, bias=False)


class GLUMLP(nn.Module):
    """down(SiTU-GLU(gate x, up x)): the dense MLP of layer 0 and the shared experts."""

    def __init__(self, config: K3Config, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(hidden, width), _linear(hidden, width)
        self.down_proj = _linear(width, hidden)
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


# ---------------------------------------------------------------------------------------------------- KDA
def kda_recurrent(q, k, v, g, beta, state):
    """Token-by-token delta rule (the reference twin). q,k,v,g [X, T, D]; beta [X, T]; state [X, D, D]."""
    S = state
    outs = []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        u = torch.einsum("xij,xi->xj", S, k[:, t])
        S = S + k[:, t].unsqueeze(-1) * (beta[:, t, None] * (v[:, t] - u)).unsqueeze(-2)
        outs.append(torch.einsum("xij,xi->xj", S, q[:, t]))
    return torch.stack(outs, 1), S


def kda_chunked(q, k, v, g, beta, state, chunk_size: int = KDA_CHUNK_SIZE):
    """The same recurrence chunk by chunk (UT/WY form, k3serve.model.kda docstring). Shapes as kda_recurrent.

    The pairwise decays e^(b_t - b_i) inside a chunk are factored as e^(b_t - m) * e^(m - b_i) around the chunk's
    middle position m, so both attention-like products are plain batched matmuls. With a per-step log decay >= -5
    and 16-token chunks each factor stays within e^(+-40), far from fp32 overflow.
    """
    S = state
    outs = []
    T = q.shape[1]
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        C = end - start
        b = torch.cumsum(g[:, start:end], dim=1)  # [X, C, D] log decay since the chunk start, <= 0
        mid = b[:, (C - 1) // 2].unsqueeze(1)
        grow, shrink = torch.exp(b - mid), torch.exp(mid - b)
        k_out = (kc * shrink).transpose(1, 2)  # [X, D, C]
        m_qk = torch.tril((qc * grow) @ k_out)  # [X, C(t), C(i)] = q_t . (k_i e^(b_t - b_i)), i <= t
        m_kk = torch.tril((kc * grow) @ k_out, diagonal=-1)
        eb = torch.exp(b)
        rhs = bc.unsqueeze(-1) * (vc - (eb * kc) @ S)  # [X, C, D]
        system = torch.eye(C, dtype=q.dtype, device=q.device) + bc.unsqueeze(-1) * m_kk
        w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append((eb * qc) @ S + m_qk @ w)
        end_decay = torch.exp(b[:, -1:] - b)  # [X, C, D]
        S = torch.exp(b[:, -1]).unsqueeze(-1) * S + (end_decay * kc).transpose(1, 2) @ w
    return torch.cat(outs, 1), S


def kda_chunked_parallel(q, k, v, g, beta, state, chunk_size: int = KDA_CHUNK_SIZE):
    """kda_chunked with far fewer kernel launches (what --device cuda uses; the CPU keeps kda_chunked, so the shipped
    checkpoint still reproduces byte for byte). Shapes as kda_recurrent.

    Everything that does not depend on the state is computed for all n chunks at once; only a D x D linear
    recurrence over the chunks stays sequential. Per chunk, with b_t the cumulative log decay since the chunk
    start, A = I + diag(beta) tril_(-1)(K_g K_s^T), U = A^-1 diag(beta) V and W = A^-1 diag(beta) (e^b * K):

        w = U - W S;   o = (e^b * Q) S + tril(Q_g K_s^T) w = Q' S + tril(Q_g K_s^T) U,  Q' = e^b * Q - tril(..) W
        S' = diag(e^(b_C)) S + (e^(b_C - b) * K)^T w = M S + Bm,  M = diag(e^(b_C)) - (e^(b_C - b) * K)^T W

    so the loop does one batched multiply-add per chunk. The pairwise decays e^(b_t - b_i) are factored as
    e^(b_t - m) * e^(m - b_i) around the chunk's middle position m (K_g = e^(b - m) K, K_s = e^(m - b) K); with a
    per-step log decay >= -5 and 16-token chunks each factor stays within e^(+-40), far from fp32 overflow.
    A ragged last chunk is padded with zero keys, values and beta and zero log decay, which leave S unchanged.
    """
    X, T, D = q.shape
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v, g = (t.reshape(X, n, C, D) for t in (q, k, v, g))
    bc = beta.reshape(X, n, C, 1)
    b = torch.cumsum(g, dim=2)  # [X, n, C, D] log decay since the chunk start, <= 0
    mid = b[:, :, (C - 1) // 2].unsqueeze(2)
    grow, shrink = torch.exp(b - mid), torch.exp(mid - b)
    k_out = (k * shrink).transpose(-1, -2)  # [X, n, D, C]
    m_qk = torch.tril((q * grow) @ k_out)  # [X, n, C(t), C(i)] = q_t . (k_i e^(b_t - b_i)), i <= t
    m_kk = torch.tril((k * grow) @ k_out, diagonal=-1)
    eb = torch.exp(b)
    system = torch.eye(C, dtype=q.dtype, device=q.device) + bc * m_kk  # [X, n, C, C]
    uw = torch.linalg.solve_triangular(system, torch.cat([bc * v, bc * eb * k], -1), upper=False,
                                       unitriangular=True)
    u, w = uw[..., :D], uw[..., D:]  # [X, n, C, D] each
    q_state = eb * q - m_qk @ w  # [X, n, C, D]: what reads the state at the chunk start
    end_decay = (torch.exp(b[:, :, -1:] - b) * k).transpose(-1, -2)  # [X, n, D, C]
    transition = torch.diag_embed(torch.exp(b[:, :, -1])) - end_decay @ w  # [X, n, D, D]
    inject = end_decay @ u  # [X, n, D, D]
    starts = []
    S = state
    for inject_c, transition_c in zip(inject.unbind(1), transition.unbind(1)):  # unbind: one backward, not n
        starts.append(S)
        S = torch.baddbmm(inject_c, transition_c, S)
    out = q_state @ torch.stack(starts, 1) + m_qk @ u  # [X, n, C, D]
    return out.reshape(X, n * C, D)[:, :T], S


class KDAttention(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        c = config
        H, P, D, NH, K = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads, c.short_conv_kernel_size
        self.config = c
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (_linear(H, P) for _ in range(4))
        self.o_proj = _linear(P, H)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(P, P, K, groups=P, bias=False) for _ in range(3))
        self.f_a_proj, self.f_b_proj = _linear(H, D), _linear(D, P)
        self.b_proj = _linear(H, NH)
        # NOTE: the released A_log has D entries; only the first NH are used (one rate per head), as the engine does
        self.A_log = nn.Parameter(torch.zeros(D))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = RMSNorm(D, c.rms_norm_eps)

    def _conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        K = conv.kernel_size[0]
        return conv(F.pad(x.transpose(1, 2), (K - 1, 0))).transpose(1, 2)  # [B, T, P], taps oldest to newest

    def forward(self, x: torch.Tensor, recurrent: bool = False) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        NH, D = c.kda_num_heads, c.kda_head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, P] -> [B*NH, T, D]
            return t.reshape(B, T, NH, D).transpose(1, 2).reshape(B * NH, T, D)

        q = l2_normalize(heads(F.silu(self._conv(self.q_conv1d, self.q_proj(x))))) / math.sqrt(D)
        k = l2_normalize(heads(F.silu(self._conv(self.k_conv1d, self.k_proj(x)))))
        v = heads(F.silu(self._conv(self.v_conv1d, self.v_proj(x))))
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2).reshape(B * NH, T)
        z = self.f_b_proj(self.f_a_proj(x)) + self.dt_bias  # [B, T, P]
        rate = torch.exp(self.A_log[:NH]).repeat_interleave(D)  # [P]
        g = heads(c.gate_lower_bound * torch.sigmoid(rate * z))
        state = x.new_zeros(B * NH, D, D)
        chunked = kda_chunked_parallel if x.is_cuda else kda_chunked
        o, _ = (kda_recurrent if recurrent else chunked)(q, k, v, g, beta, state)
        o = self.o_norm(o).reshape(B, NH, T, D).transpose(1, 2).reshape(B, T, NH * D)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))


# ---------------------------------------------------------------------------------------------------- MLA
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     explicit: bool | None = None) -> torch.Tensor:
    """softmax(scale q k^T + causal mask) v; q, k [B, NA, T, DK], v [B, NA, T, DV] -> [B, NA, T, DV].

    torch's fused CUDA kernels have a backward pass that is not deterministic, so under
    torch.use_deterministic_algorithms on CUDA (train.py sets it) the product is written out (explicit=None
    chooses; the two forms agree to rounding, tests/training/test_train.py)."""
    if explicit is None:
        explicit = q.is_cuda and torch.are_deterministic_algorithms_enabled()
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    T = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, NA, T, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        c = config
        H, NA, QL, KL = c.hidden_size, c.num_mla_heads, c.q_lora_rank, c.kv_lora_rank
        DN, DR, DV = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.config = c
        self.q_a_proj = _linear(H, QL)
        self.q_a_layernorm = RMSNorm(QL, c.rms_norm_eps)
        self.q_b_proj = _linear(QL, NA * (DN + DR))
        self.kv_a_proj_with_mqa = _linear(H, KL + DR)
        self.kv_a_layernorm = RMSNorm(KL, c.rms_norm_eps)
        self.kv_b_proj = _linear(KL, NA * (DN + DV))
        self.o_proj = _linear(NA * DV, H)
        self.g_proj = _linear(H, NA * DV) if c.mla_use_output_gate else None

    def forward(self, x: torch.Tensor, recurrent: bool = False) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        NA, KL, DN, DR, DV = c.num_mla_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(B, T, NA, DN + DR)
        kv_a = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a[..., :KL])).reshape(B, T, NA, DN + DV)
        k_rope = kv_a[..., KL:].unsqueeze(2).expand(B, T, NA, DR)  # one rope key shared by all heads, never rotated
        k = torch.cat([kv[..., :DN], k_rope], -1)
        attn = causal_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., DN:].transpose(1, 2),
                                1.0 / math.sqrt(DN + DR))  # [B, NA, T, DV]
        attn = attn.transpose(1, 2).reshape(B, T, NA * DV)
        if self.g_proj is not None:
            attn = attn * torch.sigmoid(self.g_proj(x))
        return self.o_proj(attn)


# ---------------------------------------------------------------------------------------------------- MoE
class Router(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        c = config
        H, NE, LT, MI = c.hidden_size, c.num_experts, c.latent_size, c.moe_intermediate_size
        self.config = c
        self.gate = Router(c)
        self.routed_expert_down_proj = _linear(H, LT)
        self.routed_expert_up_proj = _linear(LT, H)
        self.routed_expert_norm = RMSNorm(LT, c.rms_norm_eps)
        self.shared_experts = GLUMLP(c, H, c.shared_intermediate_size) if c.shared_intermediate_size else None
        self.experts = nn.ParameterDict({
            "w1": nn.Parameter(torch.zeros(NE, MI, LT)),
            "w3": nn.Parameter(torch.zeros(NE, MI, LT)),
            "w2": nn.Parameter(torch.zeros(NE, LT, MI)),
        })
        self.last_load: torch.Tensor | None = None  # [NE] tokens routed to each expert in the last forward

    def forward(self, x: torch.Tensor, recurrent: bool = False) -> torch.Tensor:
        c = self.config
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        scores = torch.sigmoid(flat @ self.gate.weight.T)  # [N, NE]
        with torch.no_grad():
            ids = torch.topk(scores + self.gate.e_score_correction_bias, c.num_experts_per_token, dim=-1).indices
        chosen = scores.gather(1, ids)  # [N, TOPK]
        if c.moe_renormalize:
            chosen = chosen / chosen.sum(-1, keepdim=True)
        weights = chosen * c.routed_scaling_factor
        z = self.routed_expert_down_proj(flat)  # [N, LT]
        K = c.num_experts_per_token
        flat_ids = ids.reshape(-1)  # [N * K], token-major
        order = torch.argsort(flat_ids, stable=True)  # a permutation: the (token, choice) pairs by expert
        counts = torch.bincount(flat_ids, minlength=c.num_experts)
        self.last_load = counts.detach()
        # padded dispatch: every expert's tokens in one row of [NE, most tokens any expert got, LT], three bmms.
        # On CUDA only permutations and gathers, whose backward passes are deterministic there.
        sorted_ids = flat_ids[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order), device=x.device) - starts[sorted_ids]
        dispatched = z.new_zeros(c.num_experts, int(counts.max()), z.shape[-1])
        picked = z.repeat_interleave(K, 0)[order] if x.is_cuda else z[order // K]  # [N * K, LT]
        dispatched = dispatched.index_put((sorted_ids, slot), picked)
        w1, w3, w2 = self.experts["w1"], self.experts["w3"], self.experts["w2"]
        hidden = situ_glu(dispatched @ w1.transpose(1, 2), dispatched @ w3.transpose(1, 2), c.situ_beta,
                          c.situ_linear_beta)
        y = (hidden @ w2.transpose(1, 2))[sorted_ids, slot]  # [N * K, LT] in sorted order
        if x.is_cuda:  # a permutation back to token order: deterministic backward on CUDA
            mixed = (y[torch.argsort(order)].reshape(-1, K, y.shape[-1]) * weights.unsqueeze(-1)).sum(1)  # [N, LT]
        else:  # the shipped checkpoint's summation order (byte-identical reproduction on CPU)
            mixed = torch.zeros_like(z).index_add(0, order // K, y * weights.reshape(-1)[order][:, None])
        if c.latent_moe_use_norm:
            mixed = self.routed_expert_norm(mixed)
        out = self.routed_expert_up_proj(mixed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)


# ---------------------------------------------------------------------------------------------------- model
class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer: int) -> None:
        super().__init__()
        c, H = config, config.hidden_size
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attention_res_norm = RMSNorm(H, c.rms_norm_eps)
        self.mlp_res_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attention_res_proj = _linear(H, 1)
        self.mlp_res_proj = _linear(H, 1)
        self.self_attn = GatedMLA(c) if c.is_mla(layer) else KDAttention(c)
        if c.is_dense(layer):
            self.mlp = GLUMLP(c, H, c.intermediate_size)
        else:
            self.block_sparse_moe = LatentMoE(c)


class TrunkModel(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(H, config.rms_norm_eps)
        self.output_attn_res_proj = _linear(H, 1)


class LanguageModel(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.model = TrunkModel(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)


class K3ForTraining(nn.Module):
    """token ids [B, T] -> logits [B, T, V], the same function as k3serve.model.k3.K3Model."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config)

    def moe_layers(self) -> list[LatentMoE]:
        layers = self.language_model.model.layers
        return [layer.block_sparse_moe for layer in layers if hasattr(layer, "block_sparse_moe")]

    def forward(self, ids: torch.Tensor, recurrent: bool = False) -> torch.Tensor:
        c, m = self.config, self.language_model.model
        eps, B_size = c.rms_norm_eps, c.attn_res_block_size
        h = m.embed_tokens(ids)  # [B, T, H]
        stack: list[torch.Tensor] = []
        pref: torch.Tensor | None = h
        for index, layer in enumerate(m.layers):
            if stack:
                h = attn_res(stack + [pref], layer.self_attention_res_norm, layer.self_attention_res_proj, eps)
            if index % B_size == 0:
                stack.append(pref)
                pref = None
            a = layer.self_attn(layer.input_layernorm(h), recurrent)
            pref = a if pref is None else pref + a
            h = attn_res(stack + [pref], layer.mlp_res_norm, layer.mlp_res_proj, eps)
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp if c.is_dense(index) else layer.block_sparse_moe
            pref = pref + mlp(x)
        out = attn_res(stack + [pref], m.output_attn_res_norm, m.output_attn_res_proj, eps)
        return self.language_model.lm_head(m.norm(out))

    @torch.no_grad()
    def update_router_bias(self, rate: float) -> None:
        """Auxiliary-loss-free balancing: raise the selection bias of under-loaded experts, lower the others."""
        for moe in self.moe_layers():
            if moe.last_load is not None:
                load = moe.last_load.float()
                moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def init_weights(model: K3ForTraining, seed: int) -> None:
    """Seeded initialisation: std 1/sqrt(fan_in) matrices (residual outputs scaled down), unit norms, zero
    attention-residual queries (uniform mixes at step 0), Mamba-style decay rates."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * c.num_layers)
    for name, p in model.named_parameters():
        if name.endswith("res_proj.weight"):
            p.zero_()
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=gen)
        else:
            fan_in = p.shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")):
                std *= out_scale
            p.normal_(0.0, std, generator=gen)


# ---------------------------------------------------------------------------------------------------- export
def _stacked_expert_key(layer: int, matrix: str) -> str:
    return f"{names.moe_prefix(layer)}experts.{matrix}"


def export_tensors(model: K3ForTraining) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Released name -> numpy array (float32 trunk, uint8 MXFP4 experts) and its storage dtype, in file order."""
    c = model.config
    state = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    quantized: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for spec in names.all_specs(c):
        if spec.dtype == "U8":
            continue
        tensors[spec.name] = state[spec.name].reshape(spec.shape)
        dtypes[spec.name] = spec.dtype
    for layer in c.moe_layer_ids:
        for matrix in names.EXPERT_MATRICES:
            stacked = state[_stacked_expert_key(layer, matrix)]  # [NE, rows, cols]
            for expert in range(c.num_experts):
                quantized[(layer * c.num_experts + expert, matrix)] = quantize_mxfp4(stacked[expert])
        for expert in range(c.num_experts):
            for matrix in names.EXPERT_MATRICES:
                packed, scales = quantized[(layer * c.num_experts + expert, matrix)]
                for part, array in (("weight_packed", packed), ("weight_scale", scales)):
                    tensors[names.expert_name(layer, expert, matrix, part)] = array
                    dtypes[names.expert_name(layer, expert, matrix, part)] = "U8"
    order = [spec.name for spec in names.all_specs(c)]
    return {n: tensors[n] for n in order}, {n: dtypes[n] for n in order}


def export(model: K3ForTraining, config: K3Config, out_dir: str | Path, tokenizer_dir: str | Path | None,
           max_shard_bytes: int = 64 << 20) -> Path:
    """Write a servable K3 checkpoint: bf16 trunk and MXFP4 experts under the released names, config.json,
    and the tokenizer files. `k3serve.loading.load_model(out_dir)` opens it."""
    if config != model.config:
        raise ValueError("export: the config differs from the model's")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, dtypes = export_tensors(model)
    save_sharded(out, tensors, dtypes, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config.to_dict(nested=True), indent=2) + "\n")
    if tokenizer_dir is not None:
        for file in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / file, out / file)
    return out


@torch.no_grad()
def load_exported(model: K3ForTraining, folder: str | Path) -> None:
    """Load an exported checkpoint back into `model` (bf16 widened, MXFP4 dequantized): the served weights."""
    c = model.config
    state = model.state_dict()
    with SafetensorsIndex.open(folder) as index:
        for spec in names.all_specs(c):
            if spec.dtype != "U8":
                state[spec.name].copy_(torch.from_numpy(index.read(spec.name)).reshape(state[spec.name].shape))
        for layer in c.moe_layer_ids:
            for matrix in names.EXPERT_MATRICES:
                target = state[_stacked_expert_key(layer, matrix)]
                for expert in range(c.num_experts):
                    dense = dequantize_mxfp4(index.read(names.expert_name(layer, expert, matrix, "weight_packed")),
                                             index.read(names.expert_name(layer, expert, matrix, "weight_scale")))
                    target[expert].copy_(torch.from_numpy(dense))
