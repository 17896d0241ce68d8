"""The slow fp32 reference of the K3 forward pass: one token at a time, written straight from K3_SPEC sections 3-5.

This module is the oracle the fast engine is tested against. It shares no code with the rest of
`k3serve.model`: only the config (`k3serve.config.K3Config`) and the typed errors are imported. Every array is
float32 and every operation is computed in float32 (like the fp32 C engine kimi-k3-in-c), never float64.

Shape letters (K3_SPEC section 1):
    H hidden, V vocabulary, L layers, B attention-residual block size,
    NH KDA heads, D KDA head dim (d_k = d_v = D), P = NH*D KDA projection width, K short-conv kernel,
    NA MLA heads, QL/KL q/kv lora ranks, DN/DR/DV nope/rope/v head dims, S number of cached positions,
    NE routed experts, TOPK active experts, LT routed latent width, MI routed intermediate width,
    SI shared-expert width, DI dense intermediate width.

Equations (section 5):
    RMSNorm(x, w)  = x / sqrt(mean(x^2) + eps) * w
    SiTU-GLU(g, u) = b1 tanh(g / b1) * sigmoid(g) * b2 tanh(u / b2)          (b1 = 4, b2 = 25)
    MXFP4          = E2M1[nibble] * 2^(scale - 127), low nibble = even element, scale byte 255 -> 0

    KDA, per token and head h (state S_h [D, D], rows = key channels):
        q, k, v = SiLU(causal_conv_K(proj x))         conv taps oldest -> newest, zeros before the sequence
        q = q / |q| / sqrt(D),  k = k / |k|           |y| = sqrt(sum y^2 + 1e-6)
        beta = sigmoid(b_proj x)_h
        g = gate_lower_bound * sigmoid(exp(A_log[h]) * (f_b f_a x + dt_bias)),  alpha = exp(g)   [D]
        S <- diag(alpha) S;  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q
        o = RMSNorm(o, o_norm) * sigmoid(g_proj x);  out = o_proj o

    Gated MLA (no rotary), per token over the cache of (normed latent c_s [KL], k_rope_s [DR]) rows:
        q_h = [q_nope_h | q_rope_h] = (q_b_proj RMSNorm(q_a_proj x))_h
        [k_nope_{h,s} | v_{h,s}] = (kv_b_proj c_s)_h                      (expanded per head, not absorbed)
        score_{h,s} = (q_nope_h . k_nope_{h,s} + q_rope_h . k_rope_s) / sqrt(DN + DR)
        attn_h = sum_s softmax_s(score_h)_s v_{h,s};  out = o_proj(attn * sigmoid(g_proj x))

    Latent MoE: s = sigmoid(gate x); ids = top-TOPK of s + bias; w = s_ids / sum(s_ids) * routed_scaling_factor
        out = up_proj RMSNorm(sum_e w_e w2_e SiTU-GLU(w1_e z, w3_e z), routed_expert_norm) + shared(x),
        z = down_proj x

    Attention residuals, AttnRes(sources, n, p) = sum_i softmax_i(RMSNorm(s_i) . (n * p)) s_i, and per layer l:
        pref = h; if stack: h = AttnRes(stack + [pref], self_attention_res_*)
        if l % B == 0: stack.push(pref), pref = empty
        a = Attn(RMSNorm(h, input_layernorm)); pref = a if pref is empty else pref + a
        h = AttnRes(stack + [pref], mlp_res_*); pref = pref + MLP(RMSNorm(h, post_attention_layernorm)); h = pref
    then logits = lm_head RMSNorm(AttnRes(stack + [h], output_attn_res_*), norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from k3serve.config import K3Config
from k3serve.errors import CheckpointError, RequestError

F32 = np.float32
L2_NORM_EPS = 1e-6  # K3_SPEC section 5, KDA step 3
MXFP4_GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_NAN_SCALE = 255

MODEL = "language_model.model."


# ---- elementary ops -------------------------------------------------------------------------------------------
def linear(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = W x for a dense [out, in] matrix and one vector x [in] -> [out], in float32."""
    return weight @ x


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Elementwise logistic function, computed without overflow: exp only ever sees -|x|."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over a 1-D array [S]."""
    e = np.exp(scores - scores.max())
    return e / e.sum()


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x [..., N] / sqrt(mean(x^2) + eps) * weight [N] (weight None means 1)."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True)  # [..., 1]
    y = x / np.sqrt(mean_square + F32(eps))
    return y if weight is None else y * weight


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x [N] / sqrt(sum(x^2) + 1e-6), the KDA q/k normalization."""
    return x / np.sqrt(np.sum(x * x) + F32(L2_NORM_EPS))


def situ_glu(g: np.ndarray, u: np.ndarray, beta1: float, beta2: float) -> np.ndarray:
    """SiTU-GLU(g, u) = beta1 tanh(g / beta1) * sigmoid(g) * beta2 tanh(u / beta2).

    Both branches are capped (|.| < beta1 and < beta2); the sigmoid sees the uncapped g.
    """
    b1, b2 = F32(beta1), F32(beta2)
    return (b1 * np.tanh(g / b1)) * sigmoid(g) * (b2 * np.tanh(u / b2))


def dense_mlp(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray,
              beta1: float, beta2: float) -> np.ndarray:
    """down(SiTU-GLU(gate x, up x)): x [N], gate_w/up_w [I, N], down_w [M, I] -> [M].

    Serves the dense layer-0 MLP (I = DI), the fused shared experts (I = SI) and each routed expert (I = MI,
    acting in the latent, N = M = LT).
    """
    return linear(down_w, situ_glu(linear(gate_w, x), linear(up_w, x), beta1, beta2))


# ---- MXFP4 ----------------------------------------------------------------------------------------------------
def decode_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode an MXFP4 matrix element by element: packed u8 [R, C/2], scales u8 [R, C/32] -> float32 [R, C].

    Byte j of a row holds element 2j in its low nibble and element 2j+1 in its high nibble. Nibble bits 0-2 index
    the E2M1 magnitudes, bit 3 is the sign. Element c of a row is scaled by 2^(scales[r, c // 32] - 127); a scale
    byte of 255 (NaN in the standard) decodes its whole group as 0.
    """
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.ndim != 2 or scales.ndim != 2:
        raise CheckpointError(f"MXFP4 tensors must be 2-D, got shapes {packed.shape} and {scales.shape}")
    rows, num_bytes = packed.shape
    cols = 2 * num_bytes
    if cols % MXFP4_GROUP or scales.shape != (rows, cols // MXFP4_GROUP):
        raise CheckpointError(
            f"MXFP4 packed shape {packed.shape} needs scales of shape {(rows, cols // MXFP4_GROUP)}, "
            f"got {scales.shape}"
        )
    out = np.empty((rows, cols), dtype=F32)
    for r in range(rows):
        row_bytes = packed[r].tolist()
        row_scales = scales[r].tolist()
        values: list[float] = []
        for j, byte in enumerate(row_bytes):
            for element, nibble in ((2 * j, byte & 0x0F), (2 * j + 1, byte >> 4)):
                scale_byte = row_scales[element // MXFP4_GROUP]
                if scale_byte == MXFP4_NAN_SCALE:
                    values.append(0.0)
                    continue
                magnitude = E2M1_MAGNITUDES[nibble & 0x7]
                sign = -1.0 if nibble & 0x8 else 1.0
                values.append(sign * math.ldexp(magnitude, scale_byte - 127))  # exact in float64 and float32
        out[r] = np.array(values, dtype=F32)
    return out


# ---- KDA ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KDAState:
    """What one KDA layer carries between tokens of a sequence.

    recurrent: [NH, D, D] the delta-rule state S_h (row i = key channel i, column j = value channel j).
    q_tail, k_tail, v_tail: [K-1, P] the last K-1 projections BEFORE the conv, oldest first (zeros at start).
    """

    recurrent: np.ndarray
    q_tail: np.ndarray
    k_tail: np.ndarray
    v_tail: np.ndarray

    @staticmethod
    def zeros(num_heads: int, head_dim: int, kernel_size: int) -> KDAState:
        width = num_heads * head_dim
        tail = np.zeros((kernel_size - 1, width), dtype=F32)
        return KDAState(np.zeros((num_heads, head_dim, head_dim), dtype=F32), tail, tail.copy(), tail.copy())


class KDAStepResult(NamedTuple):
    output: np.ndarray  # [H]
    state: KDAState


def causal_conv_step(tail: np.ndarray, x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One output of a causal depthwise conv of width K, before any activation.

    tail [K-1, C]: the previous K-1 inputs, oldest first; x [C]: the current input; weight [C, 1, K] with taps
    ordered oldest to newest (tap K-1 multiplies x). Returns (y [C], new tail [K-1, C]).
    """
    window = np.concatenate([tail, x[None, :]], axis=0)  # [K, C], oldest first
    kernel_size = window.shape[0]
    y = np.zeros_like(x)
    for tap in range(kernel_size):
        y = y + weight[:, 0, tap] * window[tap]
    return y, window[1:]


def kda_step(x: np.ndarray, weights: Mapping[str, np.ndarray], state: KDAState, *, num_heads: int,
             head_dim: int, gate_lower_bound: float, eps: float) -> KDAStepResult:
    """One token of one KDA layer: x [H] (already input-normed) and the carried state -> (out [H], new state).

    `weights` holds the layer's `self_attn.*` tensors under short names: q_proj, k_proj, v_proj, g_proj [P, H],
    o_proj [H, P], q_conv1d, k_conv1d, v_conv1d [P, 1, K], f_a_proj [D, H], f_b_proj [P, D], b_proj [NH, H],
    A_log [D] (the first NH entries are used, one per head), dt_bias [P], o_norm [D]. `state` is not modified.
    """
    NH, D = num_heads, head_dim
    q_proj = linear(weights["q_proj"], x)  # [P]
    k_proj = linear(weights["k_proj"], x)  # [P]
    v_proj = linear(weights["v_proj"], x)  # [P]
    q_conv, q_tail = causal_conv_step(state.q_tail, q_proj, weights["q_conv1d"])
    k_conv, k_tail = causal_conv_step(state.k_tail, k_proj, weights["k_conv1d"])
    v_conv, v_tail = causal_conv_step(state.v_tail, v_proj, weights["v_conv1d"])
    q, k, v = silu(q_conv), silu(k_conv), silu(v_conv)  # [P] each

    beta = sigmoid(linear(weights["b_proj"], x))  # [NH]
    z = linear(weights["f_b_proj"], linear(weights["f_a_proj"], x)) + weights["dt_bias"]  # [P]
    head_rate = np.exp(weights["A_log"][:NH])  # [NH]
    output_gate = sigmoid(linear(weights["g_proj"], x))  # [P]
    q_scale = F32(1.0 / math.sqrt(D))

    new_recurrent = np.empty_like(state.recurrent)  # [NH, D, D]
    o = np.empty(NH * D, dtype=F32)  # [P]
    for h in range(NH):
        channels = slice(h * D, (h + 1) * D)
        decay_log = F32(gate_lower_bound) * sigmoid(head_rate[h] * z[channels])  # g [D], in (-5, 0]
        alpha = np.exp(decay_log)  # [D]
        q_h = l2_normalize(q[channels]) * q_scale  # [D]
        k_h = l2_normalize(k[channels])  # [D]
        v_h = v[channels]  # [D]
        s_h = alpha[:, None] * state.recurrent[h]  # [D, D]: row i scaled by alpha_i
        u_h = s_h.T @ k_h  # [D]
        s_h = s_h + np.outer(k_h, beta[h] * (v_h - u_h))  # [D, D]
        o_h = s_h.T @ q_h  # [D], read from the updated state
        o[channels] = rms_norm(o_h, weights["o_norm"], eps) * output_gate[channels]
        new_recurrent[h] = s_h
    out = linear(weights["o_proj"], o)  # [H]
    return KDAStepResult(out, KDAState(new_recurrent, q_tail, k_tail, v_tail))


# ---- gated MLA ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLACache:
    """What one MLA layer caches per position: the normed latent [KL] and the (unnormed) k_rope [DR]."""

    latents: tuple[np.ndarray, ...] = ()
    k_ropes: tuple[np.ndarray, ...] = ()

    def __len__(self) -> int:
        return len(self.latents)


class MLAStepResult(NamedTuple):
    output: np.ndarray  # [H]
    cache: MLACache  # the input cache plus this token's row


def mla_step(x: np.ndarray, weights: Mapping[str, np.ndarray], cache: MLACache, *, num_heads: int,
             nope_dim: int, rope_dim: int, v_dim: int, kv_lora_rank: int, use_output_gate: bool,
             eps: float) -> MLAStepResult:
    """One token of gated MLA: x [H] (already input-normed) attends over `cache` plus its own row.

    `weights` holds the layer's `self_attn.*` tensors under short names: q_a_proj [QL, H], q_a_layernorm [QL],
    q_b_proj [NA*(DN+DR), QL], kv_a_proj_with_mqa [KL+DR, H], kv_a_layernorm [KL], kv_b_proj [NA*(DN+DV), KL],
    g_proj [NA*DV, H] (needed only with the output gate), o_proj [H, NA*DV]. Keys and values are expanded from
    each cached latent per head (the plain form; the fast engine may absorb kv_b instead). No rotary embedding.
    `cache` is not modified.
    """
    NA, DN, DR, DV, KL = num_heads, nope_dim, rope_dim, v_dim, kv_lora_rank
    q_latent = rms_norm(linear(weights["q_a_proj"], x), weights["q_a_layernorm"], eps)  # [QL]
    q = linear(weights["q_b_proj"], q_latent).reshape(NA, DN + DR)  # [NA, DN+DR]
    compressed = linear(weights["kv_a_proj_with_mqa"], x)  # [KL+DR]
    latent = rms_norm(compressed[:KL], weights["kv_a_layernorm"], eps)  # [KL]
    k_rope = compressed[KL:]  # [DR], shared by all heads, not normed
    cache = MLACache(cache.latents + (latent,), cache.k_ropes + (k_rope,))

    kv_b = weights["kv_b_proj"]  # [NA*(DN+DV), KL]
    score_scale = F32(math.sqrt(DN + DR))
    attn = np.empty(NA * DV, dtype=F32)  # [NA*DV]
    for h in range(NA):
        kv_b_h = kv_b[h * (DN + DV):(h + 1) * (DN + DV)]  # [DN+DV, KL]
        q_nope, q_rope = q[h, :DN], q[h, DN:]
        scores = np.empty(len(cache), dtype=F32)  # [S]
        values = []
        for s, (latent_s, k_rope_s) in enumerate(zip(cache.latents, cache.k_ropes)):
            kv = linear(kv_b_h, latent_s)  # [DN+DV]
            k_nope_s, v_s = kv[:DN], kv[DN:]
            scores[s] = (np.dot(q_nope, k_nope_s) + np.dot(q_rope, k_rope_s)) / score_scale
            values.append(v_s)
        probs = softmax(scores)  # [S]
        out_h = np.zeros(DV, dtype=F32)
        for s, v_s in enumerate(values):
            out_h = out_h + probs[s] * v_s
        attn[h * DV:(h + 1) * DV] = out_h
    if use_output_gate:
        attn = attn * sigmoid(linear(weights["g_proj"], x))
    return MLAStepResult(linear(weights["o_proj"], attn), cache)


# ---- attention residuals --------------------------------------------------------------------------------------
def attn_res_weights(sources: Sequence[np.ndarray], norm_w: np.ndarray, proj_w: np.ndarray,
                     eps: float) -> np.ndarray:
    """softmax_i(RMSNorm-without-weight(s_i) . (norm_w * proj_w)) over the sources [N] of [H] -> [N]."""
    query = norm_w * proj_w.reshape(-1)  # [H]
    scores = np.array([np.dot(rms_norm(s, None, eps), query) for s in sources], dtype=F32)  # [N]
    return softmax(scores)


def attn_res(sources: Sequence[np.ndarray], norm_w: np.ndarray, proj_w: np.ndarray, eps: float) -> np.ndarray:
    """AttnRes: sum_i weight_i * s_i over the RAW sources [H] (the keys are only used to score).

    norm_w [H], proj_w [1, H] (or [H]). Returns [H].
    """
    if not sources:
        raise ValueError("attn_res needs at least one source")
    weights = attn_res_weights(sources, norm_w, proj_w, eps)  # [N]
    out = np.zeros_like(sources[0])
    for weight, source in zip(weights, sources):
        out = out + weight * source
    return out


# ---- router and MoE -------------------------------------------------------------------------------------------
class Routing(NamedTuple):
    expert_ids: list[int]  # [TOPK], best (largest biased score) first
    weights: np.ndarray  # [TOPK] float32, from the unbiased scores


class Expert(NamedTuple):
    """One routed expert, decoded: w1 (gate) and w3 (up) [MI, LT], w2 (down) [LT, MI]."""

    w1: np.ndarray
    w3: np.ndarray
    w2: np.ndarray


class SharedMLP(NamedTuple):
    """The fused shared experts: gate and up [SI, H], down [H, SI]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


def route(x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray, top_k: int, scaling: float,
          renormalize: bool) -> Routing:
    """Sigmoid router: x [H], gate_w [NE, H], bias [NE] -> the TOPK expert ids and their weights.

    Selection ranks s + bias (ties go to the lower expert id); the weights use the unbiased s of the chosen
    experts, divided by their sum when `renormalize`, times `scaling`.
    """
    scores = sigmoid(linear(gate_w, x))  # [NE]
    selection = scores + bias  # [NE]
    ranked = sorted(range(len(scores)), key=lambda e: (-float(selection[e]), e))
    expert_ids = ranked[:top_k]
    chosen = scores[expert_ids]  # [TOPK]
    if renormalize:
        chosen = chosen / chosen.sum()
    return Routing(expert_ids, (chosen * F32(scaling)).astype(F32))


def latent_moe(x: np.ndarray, routing: Routing, expert: Callable[[int], Expert], *, down_proj: np.ndarray,
               up_proj: np.ndarray, norm_weight: np.ndarray | None, shared: SharedMLP | None, beta1: float,
               beta2: float, eps: float) -> np.ndarray:
    """The latent MoE for one token: x [H] (already post-attention-normed) -> [H].

    z = down_proj x [LT]; y_e = w2_e SiTU-GLU(w1_e z, w3_e z) [LT]; r = RMSNorm(sum_e weight_e y_e, norm_weight)
    (no norm when norm_weight is None); out = up_proj r + shared(x). down_proj [LT, H], up_proj [H, LT].
    `expert(e)` returns the decoded expert e of this layer.
    """
    z = linear(down_proj, x)  # [LT]
    mixed = np.zeros_like(z)  # [LT]
    for expert_id, weight in zip(routing.expert_ids, routing.weights):
        w = expert(expert_id)
        mixed = mixed + weight * dense_mlp(z, w.w1, w.w3, w.w2, beta1, beta2)
    r = mixed if norm_weight is None else rms_norm(mixed, norm_weight, eps)
    out = linear(up_proj, r)  # [H]
    if shared is not None:
        out = out + dense_mlp(x, shared.gate, shared.up, shared.down, beta1, beta2)
    return out


# ---- the model ------------------------------------------------------------------------------------------------
@dataclass
class ReferenceState:
    """One sequence's carried state: KDA states and MLA caches by zero-based layer, and positions consumed."""

    position: int = 0
    kda: dict[int, KDAState] = field(default_factory=dict)
    mla: dict[int, MLACache] = field(default_factory=dict)


@dataclass(frozen=True)
class _Layer:
    norms: dict[str, np.ndarray]  # input_layernorm, post_attention_layernorm, *_res_norm [H]; *_res_proj [1, H]
    attention: dict[str, np.ndarray]  # self_attn.* under short names
    mlp: dict[str, np.ndarray]  # mlp.* (dense) or block_sparse_moe.* (MoE, experts excluded) under short names


def _short_name(name: str) -> str:
    return name[:-len(".weight")] if name.endswith(".weight") else name


class ReferenceModel:
    """The whole K3 stack, one token at a time, in fp32.

    `tensors` maps the released names (K3_SPEC section 3) to arrays: trunk tensors as floats (converted to
    float32 here), expert tensors as the stored uint8 `weight_packed` / `weight_scale` bytes, decoded lazily
    with `decode_mxfp4` and kept in a dict. With `trace=True`, `self.trace[(position, layer)]` holds the routed
    expert ids of the most recent sequence (cleared by `forward` and `greedy`).
    """

    def __init__(self, config: K3Config, tensors: Mapping[str, np.ndarray], trace: bool = False) -> None:
        self.config = config
        self._tensors = tensors
        self._experts: dict[tuple[int, int], Expert] = {}
        self.trace: dict[tuple[int, int], list[int]] | None = {} if trace else None
        c = config
        H, V = c.hidden_size, c.vocab_size
        self.embed = self._float(MODEL + "embed_tokens.weight", (V, H))
        self.lm_head = self._float("language_model.lm_head.weight", (V, H))
        self.final_norm = self._float(MODEL + "norm.weight", (H,))
        self.output_res_norm = self._float(MODEL + "output_attn_res_norm.weight", (H,))
        self.output_res_proj = self._float(MODEL + "output_attn_res_proj.weight", (1, H))
        self.layers = [self._load_layer(layer) for layer in range(c.num_layers)]

    # -- loading --
    def _float(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._tensors:
            raise CheckpointError(f"missing tensor {name}")
        array = np.asarray(self._tensors[name])
        if array.dtype.kind != "f":
            raise CheckpointError(f"tensor {name} must be floating point, got {array.dtype}")
        if array.shape != shape:
            raise CheckpointError(f"tensor {name} has shape {array.shape}, expected {shape}")
        return array.astype(F32, copy=False)

    def _load_layer(self, layer: int) -> _Layer:
        c = self.config
        prefix = f"{MODEL}layers.{layer}."
        H, P, D, NH, K = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads, c.short_conv_kernel_size
        norms = {name: self._float(prefix + name + ".weight", (H,)) for name in
                 ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm")}
        for name in ("self_attention_res_proj", "mlp_res_proj"):
            norms[name] = self._float(prefix + name + ".weight", (1, H))

        if c.is_mla(layer):
            NA, QL, KL = c.num_mla_heads, c.q_lora_rank, c.kv_lora_rank
            DN, DR, DV = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            shapes = {"q_a_proj.weight": (QL, H), "q_a_layernorm.weight": (QL,),
                      "q_b_proj.weight": (NA * (DN + DR), QL), "kv_a_proj_with_mqa.weight": (KL + DR, H), "kv_a_layernorm.weight": (KL,),
                      "kv_b_proj.weight": (NA * (DN + DV), KL), "o_proj.weight": (H, NA * DV)}
            if c.mla_use_output_gate:
                shapes["g_proj.weight"] = (NA * DV, H)
        else:
            shapes = {"q_proj.weight": (P, H), "k_proj.weight": (P, H), "v_proj.weight": (P, H),
                      "g_proj.weight": (P, H), "o_proj.weight": (H, P), "q_conv1d.weight": (P, 1, K),
                      "k_conv1d.weight": (P, 1, K), "v_conv1d.weight": (P, 1, K), "f_a_proj.weight": (D, H),
                      "f_b_proj.weight": (P, D), "b_proj.weight": (NH, H), "A_log": (D,), "dt_bias": (P,),
                      "o_norm.weight": (D,)}
            if NH > D:
                raise CheckpointError(f"A_log has {D} entries but {NH} KDA heads need one each")
        attention = {_short_name(n): self._float(prefix + "self_attn." + n, s) for n, s in shapes.items()}

        if c.is_dense(layer):
            DI = c.intermediate_size
            shapes = {"gate_proj.weight": (DI, H), "up_proj.weight": (DI, H), "down_proj.weight": (H, DI)}
            mlp = {_short_name(n): self._float(prefix + "mlp." + n, s) for n, s in shapes.items()}
        else:
            NE, LT, SI = c.num_experts, c.latent_size, c.shared_intermediate_size
            shapes = {"gate.weight": (NE, H), "gate.e_score_correction_bias": (NE,),
                      "routed_expert_down_proj.weight": (LT, H), "routed_expert_up_proj.weight": (H, LT)}
            if c.latent_moe_use_norm:
                shapes["routed_expert_norm.weight"] = (LT,)
            if c.num_shared_experts:
                shapes.update({"shared_experts.gate_proj.weight": (SI, H), "shared_experts.up_proj.weight": (SI, H),
                               "shared_experts.down_proj.weight": (H, SI)})
            mlp = {_short_name(n): self._float(prefix + "block_sparse_moe." + n, s) for n, s in shapes.items()}
        return _Layer(norms, attention, mlp)

    def expert(self, layer: int, expert_id: int) -> Expert:
        """Routed expert `expert_id` of `layer`, decoded from its MXFP4 bytes on first use."""
        key = (layer, expert_id)
        if key not in self._experts:
            c = self.config
            MI, LT = c.moe_intermediate_size, c.latent_size
            prefix = f"{MODEL}layers.{layer}.block_sparse_moe.experts.{expert_id}."
            matrices = []
            for name, (rows, cols) in (("w1", (MI, LT)), ("w3", (MI, LT)), ("w2", (LT, MI))):
                packed_name, scale_name = prefix + name + ".weight_packed", prefix + name + ".weight_scale"
                for tensor_name in (packed_name, scale_name):
                    if tensor_name not in self._tensors:
                        raise CheckpointError(f"missing tensor {tensor_name}")
                packed, scales = np.asarray(self._tensors[packed_name]), np.asarray(self._tensors[scale_name])
                if packed.shape != (rows, cols // 2) or scales.shape != (rows, cols // MXFP4_GROUP):
                    raise CheckpointError(
                        f"expert tensors {prefix}{name}.* have shapes {packed.shape}, {scales.shape}; expected "
                        f"{(rows, cols // 2)}, {(rows, cols // MXFP4_GROUP)}"
                    )
                matrices.append(decode_mxfp4(packed, scales))
            self._experts[key] = Expert(*matrices)
        return self._experts[key]

    # -- running --
    def new_state(self) -> ReferenceState:
        c = self.config
        state = ReferenceState()
        for layer in range(c.num_layers):
            if c.is_mla(layer):
                state.mla[layer] = MLACache()
            else:
                state.kda[layer] = KDAState.zeros(c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size)
        return state

    def _attention(self, layer: int, x: np.ndarray, state: ReferenceState) -> np.ndarray:
        c = self.config
        weights = self.layers[layer].attention
        if c.is_mla(layer):
            result = mla_step(x, weights, state.mla[layer], num_heads=c.num_mla_heads, nope_dim=c.qk_nope_head_dim,
                              rope_dim=c.qk_rope_head_dim, v_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank,
                              use_output_gate=c.mla_use_output_gate, eps=c.rms_norm_eps)
            state.mla[layer] = result.cache
        else:
            result = kda_step(x, weights, state.kda[layer], num_heads=c.kda_num_heads, head_dim=c.kda_head_dim,
                              gate_lower_bound=c.gate_lower_bound, eps=c.rms_norm_eps)
            state.kda[layer] = result.state
        return result.output

    def _mlp(self, layer: int, x: np.ndarray, position: int) -> np.ndarray:
        c = self.config
        w = self.layers[layer].mlp
        if c.is_dense(layer):
            return dense_mlp(x, w["gate_proj"], w["up_proj"], w["down_proj"], c.situ_beta, c.situ_linear_beta)
        routing = route(x, w["gate"], w["gate.e_score_correction_bias"], c.num_experts_per_token,
                        c.routed_scaling_factor, c.moe_renormalize)
        if self.trace is not None:
            self.trace[(position, layer)] = list(routing.expert_ids)
        shared = None
        if c.num_shared_experts:
            shared = SharedMLP(w["shared_experts.gate_proj"], w["shared_experts.up_proj"],
                               w["shared_experts.down_proj"])
        return latent_moe(x, routing, lambda e: self.expert(layer, e), down_proj=w["routed_expert_down_proj"],
                          up_proj=w["routed_expert_up_proj"], norm_weight=w.get("routed_expert_norm"),
                          shared=shared, beta1=c.situ_beta, beta2=c.situ_linear_beta, eps=c.rms_norm_eps)

    def step(self, token_id: int, state: ReferenceState) -> np.ndarray:
        """Run one position through the whole stack, updating `state`; returns the logits [V] (float32)."""
        c = self.config
        if not 0 <= token_id < c.vocab_size:
            raise RequestError(f"token id {token_id} is outside the vocabulary (size {c.vocab_size})")
        eps, B = c.rms_norm_eps, c.attn_res_block_size
        h = self.embed[token_id]  # [H]
        stack: list[np.ndarray] = []  # block snapshots, per token (not carried)
        for layer in range(c.num_layers):
            w = self.layers[layer].norms
            pref: np.ndarray | None = h  # the partial sum of the current block
            if stack:
                h = attn_res(stack + [pref], w["self_attention_res_norm"], w["self_attention_res_proj"], eps)
            if layer % B == 0:
                stack.append(pref)
                pref = None
            a = self._attention(layer, rms_norm(h, w["input_layernorm"], eps), state)  # [H]
            pref = a if pref is None else pref + a
            h = attn_res(stack + [pref], w["mlp_res_norm"], w["mlp_res_proj"], eps)
            m = self._mlp(layer, rms_norm(h, w["post_attention_layernorm"], eps), state.position)  # [H]
            pref = pref + m
            h = pref
        h = attn_res(stack + [h], self.output_res_norm, self.output_res_proj, eps)
        logits = linear(self.lm_head, rms_norm(h, self.final_norm, eps))  # [V]
        state.position += 1
        assert logits.dtype == F32, logits.dtype
        return logits

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [T, V] for `ids` from a fresh state, one step per token."""
        if self.trace is not None:
            self.trace.clear()
        state = self.new_state()
        logits = np.zeros((len(ids), self.config.vocab_size), dtype=F32)  # [T, V]
        for position, token in enumerate(ids):
            logits[position] = self.step(int(token), state)
        return logits

    def greedy(self, ids: Sequence[int], num_tokens: int) -> list[int]:
        """The `num_tokens` tokens that argmax decoding appends to `ids` (no stop on EOS; ties -> lower id)."""
        if not len(ids):
            raise RequestError("greedy decoding needs at least one prompt token")
        if self.trace is not None:
            self.trace.clear()
        state = self.new_state()
        for token in ids:
            logits = self.step(int(token), state)
        generated: list[int] = []
        for index in range(num_tokens):
            generated.append(int(np.argmax(logits)))
            if index + 1 < num_tokens:
                logits = self.step(generated[-1], state)
        return generated
