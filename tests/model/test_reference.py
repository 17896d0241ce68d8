"""Tests of the slow fp32 reference itself (model/reference.py): hand-built op fixtures that plausible bugs fail,
then a random tiny model end to end. The expectations are written independently (scalar Python or float64 numpy)
from K3_SPEC sections 3-5."""

from __future__ import annotations

import math

import numpy as np
import pytest

from k3serve.config import K3Config, tiny_config
from k3serve.errors import CheckpointError
from k3serve.model.reference import (
    Expert,
    KDAState,
    MLACache,
    ReferenceModel,
    Routing,
    SharedMLP,
    attn_res,
    attn_res_weights,
    causal_conv_step,
    decode_mxfp4,
    kda_step,
    latent_moe,
    mla_step,
    rms_norm,
    route,
    situ_glu,
)

F32 = np.float32
MODEL = "language_model.model."


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


# ---- elementary ops -------------------------------------------------------------------------------------------
def test_situ_glu_hits_both_caps_and_gates_with_uncapped_g():
    g = np.array([100.0, -100.0, 8.0, 0.5, 30.0], dtype=F32)
    u = np.array([1000.0, -1000.0, 3.0, 0.2, -60.0], dtype=F32)
    got = situ_glu(g, u, 4.0, 25.0)
    assert got.dtype == F32
    expected = [4 * math.tanh(a / 4) * _sig(a) * 25 * math.tanh(b / 25) for a, b in zip(g.tolist(), u.tolist())]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-30)
    assert got[0] == pytest.approx(100.0, rel=1e-6)  # both caps: 4 * 25
    assert abs(got[1]) < 1e-40  # sigmoid(-100) kills the negative cap
    # a bug feeding the capped g into the sigmoid would give sigmoid(4 tanh 2) = 0.979 instead of sigmoid(8)
    capped_bug = 4 * math.tanh(2) * _sig(4 * math.tanh(2)) * 25 * math.tanh(3 / 25)
    assert abs(got[2] - capped_bug) > 1e-2


def test_rms_norm_rows_weight_and_no_weight():
    x = np.array([[3.0, 4.0], [1.0, -1.0]], dtype=F32)
    w = np.array([2.0, -1.0], dtype=F32)
    eps = 1e-5
    got = rms_norm(x, w, eps)
    assert got.dtype == F32
    expected = [[3 / math.sqrt(12.5 + eps) * 2, -4 / math.sqrt(12.5 + eps)],
                [1 / math.sqrt(1 + eps) * 2, 1 / math.sqrt(1 + eps)]]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(rms_norm(x[0], None, eps), [3 / math.sqrt(12.5 + eps), 4 / math.sqrt(12.5 + eps)],
                               rtol=1e-6)


# ---- MXFP4 ----------------------------------------------------------------------------------------------------
def test_decode_mxfp4_nibble_positions_sign_and_scale():
    packed = np.zeros((2, 32), dtype=np.uint8)  # two rows of 64 elements, two groups each
    packed[0, 0] = 0x21  # element 0 = nibble 1 (0.5), element 1 = nibble 2 (1.0)
    packed[0, 1] = 0x9F  # element 2 = nibble F (-6), element 3 = nibble 9 (-0.5)
    packed[0, 16] = 0x07  # element 32 = nibble 7 (6), element 33 = 0
    packed[1, :] = 0x77
    scales = np.array([[128, 125], [255, 127]], dtype=np.uint8)
    got = decode_mxfp4(packed, scales)
    assert got.shape == (2, 64) and got.dtype == F32
    assert got[0, :4].tolist() == [1.0, 2.0, -12.0, -1.0]  # group 0 scale 2^1
    assert got[0, 32] == 6.0 * 0.25  # group 1 scale 2^-2
    assert np.count_nonzero(got[0]) == 5
    assert np.all(got[1, :32] == 0.0)  # scale byte 255 zeroes its group only
    assert np.all(got[1, 32:] == 6.0)


def test_decode_mxfp4_every_nibble():
    packed = np.array([[lo | (hi << 4) for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))] * 2], dtype=np.uint8)
    got = decode_mxfp4(packed, np.array([[127]], dtype=np.uint8))
    magnitudes = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert got[0, :16].tolist() == magnitudes + [-m for m in magnitudes]


def _quantize_row(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer of K3_SPEC section 4, for one row whose length is a multiple of 64."""
    magnitudes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    nibbles, scales = [], []
    for block in x.reshape(-1, 32):
        e = math.floor(math.log2(np.max(np.abs(block)))) - 2
        scales.append(e + 127)
        for value in block / 2.0 ** e:
            distances = np.abs(magnitudes - min(abs(value), 6.0))
            index = int(np.argmin(distances))  # first minimum: ties go to the smaller magnitude
            nibbles.append(index | (8 if value < 0 else 0))
    packed = [nibbles[i] | (nibbles[i + 1] << 4) for i in range(0, len(nibbles), 2)]
    return np.array([packed], dtype=np.uint8), np.array([scales], dtype=np.uint8)


def test_decode_mxfp4_round_trips_representable_values():
    rng = np.random.default_rng(3)
    magnitudes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x = rng.choice(magnitudes, size=64) * rng.choice([-1.0, 1.0], size=64)
    x[0], x[40] = 6.0, -6.0  # each block's max is 6 * 2^0 ...
    x[32:] *= 2.0 ** -5  # ... and 6 * 2^-5 for the second block
    packed, scales = _quantize_row(x)
    assert scales.tolist() == [[127, 122]]
    np.testing.assert_array_equal(decode_mxfp4(packed, scales)[0], x.astype(F32))


# ---- router ---------------------------------------------------------------------------------------------------
def _router_for(scores: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """x = [1] and a [NE, 1] gate whose logits give sigmoid = scores."""
    logits = [math.log(s / (1 - s)) for s in scores]
    return np.array([1.0], dtype=F32), np.array(logits, dtype=F32)[:, None]


def test_route_bias_reorders_selection_but_weights_use_unbiased_scores():
    scores = [0.9, 0.8, 0.3, 0.2]
    x, gate = _router_for(scores)
    bias = np.array([0.0, 0.0, 0.7, 0.0], dtype=F32)  # 0.3 + 0.7 beats 0.9 and 0.8
    routing = route(x, gate, bias, 2, 1.0, True)
    assert routing.expert_ids == [2, 0]
    np.testing.assert_allclose(routing.weights, [0.3 / 1.2, 0.9 / 1.2], rtol=1e-5)
    assert routing.weights.dtype == F32
    scaled = route(x, gate, bias, 2, 2.5, True)
    np.testing.assert_allclose(scaled.weights, 2.5 * routing.weights, rtol=1e-6)
    raw = route(x, gate, bias, 3, 2.0, False)
    assert raw.expert_ids == [2, 0, 1]
    np.testing.assert_allclose(raw.weights, [0.6, 1.8, 1.6], rtol=1e-5)


def test_route_ties_go_to_lower_expert_id():
    x = np.array([1.0], dtype=F32)
    gate = np.zeros((5, 1), dtype=F32)  # every score is 0.5
    bias = np.array([0.0, 0.25, 0.0, 0.25, 0.0], dtype=F32)
    assert route(x, gate, bias, 3, 1.0, True).expert_ids == [1, 3, 0]



def test_latent_moe_matches_the_formula():
    """z = down x; y_e = w2 SiTU(w1 z, w3 z); r = RMSNorm(sum_e weight_e y_e); out = up r + shared(x)."""
    rng = np.random.default_rng(13)
    H, LT, MI, SI = 6, 5, 4, 7
    n = rng.standard_normal
    down, up, norm_w = n((LT, H)), n((H, LT)), 1 + 0.2 * n(LT)
    experts = {e: Expert(n((MI, LT)), n((MI, LT)), n((LT, MI))) for e in (1, 3)}
    shared = SharedMLP(n((SI, H)), n((SI, H)), n((H, SI)))
    x = n(H) * 2
    routing = Routing([3, 1], np.array([0.7, 0.3], dtype=F32))

    def situ(g, u):
        return 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)

    z = down @ x
    mixed = sum(w * (experts[e].w2 @ situ(experts[e].w1 @ z, experts[e].w3 @ z))
                for e, w in zip(routing.expert_ids, routing.weights.astype(np.float64)))
    shared_out = shared.down @ situ(shared.gate @ x, shared.up @ x)
    expected = up @ (mixed / np.sqrt(np.mean(mixed ** 2) + 1e-5) * norm_w) + shared_out
    f32 = lambda a: a.astype(F32)  # noqa: E731
    experts32 = {e: Expert(*map(f32, w)) for e, w in experts.items()}
    got = latent_moe(f32(x), routing, experts32.__getitem__, down_proj=f32(down), up_proj=f32(up),
                     norm_weight=f32(norm_w), shared=SharedMLP(*map(f32, shared)), beta1=4.0, beta2=25.0, eps=1e-5)
    assert got.dtype == F32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    without_norm = latent_moe(f32(x), routing, experts32.__getitem__, down_proj=f32(down), up_proj=f32(up),
                              norm_weight=None, shared=None, beta1=4.0, beta2=25.0, eps=1e-5)
    np.testing.assert_allclose(without_norm, up @ mixed, rtol=1e-4, atol=1e-4)

# ---- KDA ------------------------------------------------------------------------------------------------------
def _kda_weights(rng: np.random.Generator, H: int, NH: int, D: int, K: int) -> dict[str, np.ndarray]:
    P = NH * D
    n = rng.standard_normal
    return {
        "q_proj": n((P, H)), "k_proj": n((P, H)), "v_proj": n((P, H)), "g_proj": n((P, H)), "o_proj": n((H, P)),
        "q_conv1d": n((P, 1, K)), "k_conv1d": n((P, 1, K)), "v_conv1d": n((P, 1, K)),
        "f_a_proj": n((D, H)), "f_b_proj": n((P, D)), "b_proj": n((NH, H)),
        "A_log": n(D) * 0.5, "dt_bias": n(P) * 0.5, "o_norm": 1 + 0.2 * n(D),
    }


def _hand_kda(xs: list[list[float]], w: dict[str, list], NH: int, D: int, K: int, lower: float,
              eps: float) -> list[list[float]]:
    """The KDA recurrence of K3_SPEC section 5, scalar by scalar."""
    def matvec(m, v):
        return [sum(m[i][j] * v[j] for j in range(len(v))) for i in range(len(m))]

    P = NH * D
    state = [[[0.0] * D for _ in range(D)] for _ in range(NH)]
    history = {"q": [], "k": [], "v": []}
    outputs = []
    for x in xs:
        act = {}
        for name in "qkv":
            history[name].append(matvec(w[name + "_proj"], x))
            conv = []
            for c in range(P):
                total = 0.0
                for tap in range(K):
                    t = len(history[name]) - K + tap  # tap 0 is the oldest input, tap K-1 the current one
                    if t >= 0:
                        total += w[name + "_conv1d"][c][0][tap] * history[name][t][c]
                conv.append(total)
            act[name] = [y * _sig(y) for y in conv]
        beta = [_sig(y) for y in matvec(w["b_proj"], x)]
        z = [a + b for a, b in zip(matvec(w["f_b_proj"], matvec(w["f_a_proj"], x)), w["dt_bias"])]
        gate = [_sig(y) for y in matvec(w["g_proj"], x)]
        o = []
        for h in range(NH):
            channels = range(h * D, (h + 1) * D)
            q = [act["q"][c] for c in channels]
            k = [act["k"][c] for c in channels]
            v = [act["v"][c] for c in channels]
            q_norm = math.sqrt(sum(y * y for y in q) + 1e-6)
            k_norm = math.sqrt(sum(y * y for y in k) + 1e-6)
            q = [y / q_norm / math.sqrt(D) for y in q]
            k = [y / k_norm for y in k]
            alpha = [math.exp(lower * _sig(math.exp(w["A_log"][h]) * z[c])) for c in channels]
            s = state[h]
            for i in range(D):
                for j in range(D):
                    s[i][j] *= alpha[i]
            u = [sum(s[i][j] * k[i] for i in range(D)) for j in range(D)]
            for i in range(D):
                for j in range(D):
                    s[i][j] += k[i] * beta[h] * (v[j] - u[j])
            read = [sum(s[i][j] * q[i] for i in range(D)) for j in range(D)]
            rms = math.sqrt(sum(y * y for y in read) / D + eps)
            o += [read[j] / rms * w["o_norm"][j] * gate[h * D + j] for j in range(D)]
        outputs.append(matvec(w["o_proj"], o))
    return outputs


def test_kda_step_matches_scalar_hand_computation_two_heads_d2():
    rng = np.random.default_rng(11)
    H, NH, D, K = 5, 2, 2, 4
    weights = {name: value.astype(F32) for name, value in _kda_weights(rng, H, NH, D, K).items()}
    xs = rng.standard_normal((6, H)).astype(F32)  # six steps: the conv window fills and rolls
    state = KDAState.zeros(NH, D, K)
    got = []
    for x in xs:
        out, state = kda_step(x, weights, state, num_heads=NH, head_dim=D, gate_lower_bound=-5.0, eps=1e-5)
        assert out.dtype == F32 and state.recurrent.dtype == F32
        got.append(out)
    hand = _hand_kda(xs.tolist(), {k: v.tolist() for k, v in weights.items()}, NH, D, K, -5.0, 1e-5)
    np.testing.assert_allclose(np.array(got), hand, rtol=2e-4, atol=2e-5)


def test_kda_delta_rule_closed_forms():
    """No decay (alpha = 1) and beta = 1: from S = 0 one write gives S_h = k v^T; a second write at key k' makes
    S^T k' = v' (the delta rule overwrites what the key reads)."""
    rng = np.random.default_rng(5)
    H, NH, D, K = 6, 2, 3, 2
    weights = {name: value.astype(F32) for name, value in _kda_weights(rng, H, NH, D, K).items()}
    weights["dt_bias"] = np.full(NH * D, -1e4, dtype=F32)  # sigmoid(exp(A) z) = 0 -> g = 0 -> alpha = 1
    weights["f_b_proj"] = np.zeros_like(weights["f_b_proj"])
    weights["b_proj"] = np.zeros_like(weights["b_proj"])
    weights["b_proj"][:, 0] = 1e4  # with x[0] = 1, beta = sigmoid(1e4) = 1
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        weights[name] = np.zeros_like(weights[name])
        weights[name][:, 0, K - 1] = 1.0  # the conv passes the current input through
    xs = rng.standard_normal((2, H)).astype(F32)
    xs[:, 0] = 1.0

    def key_value(x):
        k = weights["k_proj"] @ x.astype(np.float64)
        v = weights["v_proj"] @ x.astype(np.float64)
        k, v = k / (1 + np.exp(-k)), v / (1 + np.exp(-v))  # [P], SiLU
        k = k.reshape(NH, D)
        return k / np.sqrt((k * k).sum(axis=1, keepdims=True) + 1e-6), v.reshape(NH, D)

    state = KDAState.zeros(NH, D, K)
    _, state = kda_step(xs[0], weights, state, num_heads=NH, head_dim=D, gate_lower_bound=-5.0, eps=1e-5)
    k1, v1 = key_value(xs[0])
    for h in range(NH):
        np.testing.assert_allclose(state.recurrent[h], np.outer(k1[h], v1[h]), rtol=1e-5, atol=1e-6)
    _, state = kda_step(xs[1], weights, state, num_heads=NH, head_dim=D, gate_lower_bound=-5.0, eps=1e-5)
    k2, v2 = key_value(xs[1])
    for h in range(NH):
        np.testing.assert_allclose(state.recurrent[h].T @ k2[h], v2[h], rtol=1e-4, atol=1e-5)


def test_causal_conv_carried_tail_equals_convolving_the_whole_sequence():
    rng = np.random.default_rng(2)
    C, K, T = 3, 4, 7
    weight = rng.standard_normal((C, 1, K)).astype(F32)
    xs = rng.standard_normal((T, C)).astype(F32)
    padded = np.concatenate([np.zeros((K - 1, C)), xs.astype(np.float64)])  # zeros before the sequence
    tail = np.zeros((K - 1, C), dtype=F32)
    for t in range(T):
        y, tail = causal_conv_step(tail, xs[t], weight)
        expected = [sum(weight[c, 0, j] * padded[t + j, c] for j in range(K)) for c in range(C)]
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(tail, xs[-(K - 1):])


def test_kda_state_tail_holds_the_raw_projections():
    rng = np.random.default_rng(4)
    H, NH, D, K = 5, 2, 2, 4
    weights = {name: value.astype(F32) for name, value in _kda_weights(rng, H, NH, D, K).items()}
    xs = rng.standard_normal((5, H)).astype(F32)
    state = KDAState.zeros(NH, D, K)
    for x in xs:
        _, state = kda_step(x, weights, state, num_heads=NH, head_dim=D, gate_lower_bound=-5.0, eps=1e-5)
    for name, tail in (("q_proj", state.q_tail), ("k_proj", state.k_tail), ("v_proj", state.v_tail)):
        np.testing.assert_allclose(tail, xs[-(K - 1):] @ weights[name].T, rtol=1e-5, atol=1e-6)


# ---- MLA ------------------------------------------------------------------------------------------------------
NA, QL, KL, DN, DR, DV, H_MLA = 3, 8, 6, 4, 2, 5, 10


def _mla_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = rng.standard_normal
    weights = {
        "q_a_proj": n((QL, H_MLA)), "q_a_layernorm": 1 + 0.2 * n(QL), "q_b_proj": n((NA * (DN + DR), QL)),
        "kv_a_proj_with_mqa": n((KL + DR, H_MLA)), "kv_a_layernorm": 1 + 0.2 * n(KL),
        "kv_b_proj": n((NA * (DN + DV), KL)), "g_proj": n((NA * DV, H_MLA)), "o_proj": n((H_MLA, NA * DV)),
    }
    return {name: (value * 0.5).astype(F32) for name, value in weights.items()}


def _mla(x, weights, cache, gate=True):
    return mla_step(x, weights, cache, num_heads=NA, nope_dim=DN, rope_dim=DR, v_dim=DV, kv_lora_rank=KL,
                    use_output_gate=gate, eps=1e-5)


def test_mla_single_position_is_the_value_path():
    rng = np.random.default_rng(7)
    weights = _mla_weights(rng)
    x = rng.standard_normal(H_MLA).astype(F32)
    out, cache = _mla(x, weights, MLACache())
    assert len(cache) == 1 and out.dtype == F32
    latent = rms_norm(weights["kv_a_proj_with_mqa"][:KL] @ x, weights["kv_a_layernorm"], 1e-5)
    np.testing.assert_array_equal(cache.latents[0], latent)
    values = np.concatenate([weights["kv_b_proj"][h * (DN + DV) + DN:(h + 1) * (DN + DV)] @ latent
                             for h in range(NA)])
    gate = 1 / (1 + np.exp(-(weights["g_proj"] @ x)))
    np.testing.assert_allclose(out, weights["o_proj"] @ (values * gate), rtol=1e-6, atol=1e-6)
    other_q = dict(weights, q_b_proj=weights["q_b_proj"] * 3 + 1)  # one position: the query cannot matter
    np.testing.assert_array_equal(_mla(x, other_q, MLACache()).output, out)
    np.testing.assert_allclose(_mla(x, weights, MLACache(), gate=False).output, weights["o_proj"] @ values,
                               rtol=1e-6, atol=1e-6)


def test_mla_three_positions_match_the_absorbed_form():
    rng = np.random.default_rng(8)
    weights = _mla_weights(rng)
    xs = rng.standard_normal((3, H_MLA)).astype(F32)
    cache = MLACache()
    for x in xs:
        out, cache = _mla(x, weights, cache)
    assert len(cache) == 3

    w = {name: value.astype(np.float64) for name, value in weights.items()}

    def norm(v, g):
        return v / np.sqrt(np.mean(v * v) + 1e-5) * g

    compressed = xs.astype(np.float64) @ w["kv_a_proj_with_mqa"].T  # [S, KL+DR]
    latents = np.array([norm(c[:KL], w["kv_a_layernorm"]) for c in compressed])  # [S, KL]
    k_rope = compressed[:, KL:]  # [S, DR], not normed
    q = (w["q_b_proj"] @ norm(w["q_a_proj"] @ xs[-1], w["q_a_layernorm"])).reshape(NA, DN + DR)
    kv_b = w["kv_b_proj"].reshape(NA, DN + DV, KL)
    attn = []
    for h in range(NA):
        q_latent = kv_b[h, :DN].T @ q[h, :DN]  # absorb the key half of kv_b into the query
        scores = (latents @ q_latent + k_rope @ q[h, DN:]) / math.sqrt(DN + DR)
        p = np.exp(scores - scores.max())
        p /= p.sum()
        attn.append(kv_b[h, DN:] @ (p @ latents))  # absorb the value half after mixing latents
    gate = 1 / (1 + np.exp(-(w["g_proj"] @ xs[-1])))
    np.testing.assert_allclose(out, w["o_proj"] @ (np.concatenate(attn) * gate), rtol=1e-4, atol=1e-5)


# ---- attention residuals --------------------------------------------------------------------------------------
def test_attn_res_weights_sum_to_one_and_mix_raw_sources():
    rng = np.random.default_rng(9)
    H = 16
    sources = [rng.standard_normal(H).astype(F32) * scale for scale in (1.0, 5.0, 0.1)]
    norm_w = (1 + 0.3 * rng.standard_normal(H)).astype(F32)
    proj_w = (0.5 * rng.standard_normal((1, H))).astype(F32)
    weights = attn_res_weights(sources, norm_w, proj_w, 1e-5)
    assert weights.sum() == pytest.approx(1.0, abs=1e-6)
    keys = [s / np.sqrt(np.mean(s.astype(np.float64) ** 2) + 1e-5) for s in sources]
    scores = np.array([k @ (norm_w * proj_w[0]) for k in keys])
    expected_weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5)
    out = attn_res(sources, norm_w, proj_w, 1e-5)
    np.testing.assert_allclose(out, sum(w * s for w, s in zip(expected_weights, sources)), rtol=1e-5, atol=1e-6)
    # scaling a source leaves its key (and so every weight) alone but scales its share of the raw mix
    scaled = [sources[0] * 10, sources[1], sources[2]]
    np.testing.assert_allclose(attn_res_weights(scaled, norm_w, proj_w, 1e-5), weights, rtol=1e-5)
    np.testing.assert_allclose(attn_res(scaled, norm_w, proj_w, 1e-5), out + 9 * weights[0] * sources[0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(attn_res([sources[1]], norm_w, proj_w, 1e-5), sources[1])


# ---- a random tiny model end to end ---------------------------------------------------------------------------
def make_tiny_tensors(config: K3Config, seed: int) -> dict[str, np.ndarray]:
    """Random tensors under the released names and shapes (K3_SPEC section 3): float32 trunk, MXFP4-looking
    uint8 experts with scale bytes in 118..124."""
    rng = np.random.default_rng(seed)
    c = config
    H, V, P, D, NH, K = c.hidden_size, c.vocab_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads, \
        c.short_conv_kernel_size
    tensors: dict[str, np.ndarray] = {}

    def put(name, shape, scale):
        tensors[name] = (rng.standard_normal(shape) * scale).astype(F32)

    def matrix(name, rows, cols):
        put(name, (rows, cols), 1 / math.sqrt(cols))

    def norm(name, width):
        tensors[name] = (1 + 0.1 * rng.standard_normal(width)).astype(F32)

    def mxfp4(name, rows, cols):
        tensors[name + ".weight_packed"] = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        tensors[name + ".weight_scale"] = rng.integers(118, 125, (rows, cols // 32), dtype=np.uint8)

    put(MODEL + "embed_tokens.weight", (V, H), 1.0)
    matrix("language_model.lm_head.weight", V, H)
    norm(MODEL + "norm.weight", H)
    norm(MODEL + "output_attn_res_norm.weight", H)
    put(MODEL + "output_attn_res_proj.weight", (1, H), 0.1)
    for layer in range(c.num_layers):
        p = f"{MODEL}layers.{layer}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            norm(p + name + ".weight", H)
        put(p + "self_attention_res_proj.weight", (1, H), 0.1)
        put(p + "mlp_res_proj.weight", (1, H), 0.1)
        a = p + "self_attn."
        if c.is_mla(layer):
            NA_, QL_, KL_ = c.num_mla_heads, c.q_lora_rank, c.kv_lora_rank
            DN_, DR_, DV_ = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            matrix(a + "q_a_proj.weight", QL_, H)
            norm(a + "q_a_layernorm.weight", QL_)
            matrix(a + "q_b_proj.weight", NA_ * (DN_ + DR_), QL_)
            matrix(a + "kv_a_proj_with_mqa.weight", KL_ + DR_, H)
            norm(a + "kv_a_layernorm.weight", KL_)
            matrix(a + "kv_b_proj.weight", NA_ * (DN_ + DV_), KL_)
            matrix(a + "g_proj.weight", NA_ * DV_, H)
            matrix(a + "o_proj.weight", H, NA_ * DV_)
        else:
            for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
                matrix(a + name + ".weight", P, H)
            matrix(a + "o_proj.weight", H, P)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                put(a + name + ".weight", (P, 1, K), 0.5)
            matrix(a + "f_a_proj.weight", D, H)
            matrix(a + "f_b_proj.weight", P, D)
            matrix(a + "b_proj.weight", NH, H)
            tensors[a + "A_log"] = np.log(rng.uniform(1, 16, D)).astype(F32)
            put(a + "dt_bias", (P,), 0.5)
            norm(a + "o_norm.weight", D)
        if c.is_dense(layer):
            matrix(p + "mlp.gate_proj.weight", c.intermediate_size, H)
            matrix(p + "mlp.up_proj.weight", c.intermediate_size, H)
            matrix(p + "mlp.down_proj.weight", H, c.intermediate_size)
        else:
            m = p + "block_sparse_moe."
            NE, LT, MI, SI = c.num_experts, c.latent_size, c.moe_intermediate_size, c.shared_intermediate_size
            matrix(m + "gate.weight", NE, H)
            put(m + "gate.e_score_correction_bias", (NE,), 0.1)
            matrix(m + "routed_expert_down_proj.weight", LT, H)
            matrix(m + "routed_expert_up_proj.weight", H, LT)
            norm(m + "routed_expert_norm.weight", LT)
            matrix(m + "shared_experts.gate_proj.weight", SI, H)
            matrix(m + "shared_experts.up_proj.weight", SI, H)
            matrix(m + "shared_experts.down_proj.weight", H, SI)
            for expert in range(NE):
                mxfp4(f"{m}experts.{expert}.w1", MI, LT)
                mxfp4(f"{m}experts.{expert}.w3", MI, LT)
                mxfp4(f"{m}experts.{expert}.w2", LT, MI)
    return tensors


NEVER_ROUTED = (1, 0)  # (layer, expert) whose correction bias rules it out of every top-k


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    tensors = make_tiny_tensors(config, seed=1)
    tensors[f"{MODEL}layers.{NEVER_ROUTED[0]}.block_sparse_moe.gate.e_score_correction_bias"][NEVER_ROUTED[1]] = -10
    ids = np.random.default_rng(6).integers(0, config.vocab_size, 8).tolist()
    model = ReferenceModel(config, tensors, trace=True)
    logits = model.forward(ids)
    return config, tensors, ids, model, logits, dict(model.trace)


def test_forward_is_finite_and_equals_stepping_a_carried_state(tiny):
    config, _, ids, model, logits, _ = tiny
    assert logits.shape == (len(ids), config.vocab_size) and logits.dtype == F32
    assert np.all(np.isfinite(logits))
    assert np.std(logits[0]) > 1e-2 and not np.array_equal(logits[0], logits[1])
    state = model.new_state()
    stepped = np.array([model.step(token, state) for token in ids])
    np.testing.assert_array_equal(stepped, logits)
    assert state.position == len(ids)
    assert all(len(state.mla[layer]) == len(ids) for layer in config.mla_layer_ids)
    np.testing.assert_array_equal(model.forward(ids[:3]), logits[:3])  # a prefix is a prefix
    np.testing.assert_array_equal(model.forward(ids), logits)  # running never alters the weights


def test_interleaved_sequences_keep_separate_states(tiny):
    _, _, ids, model, logits, _ = tiny
    other = [5, 17, 200, 3, 99]
    other_logits = model.forward(other)
    state_a, state_b = model.new_state(), model.new_state()
    for position in range(len(ids)):
        np.testing.assert_array_equal(model.step(ids[position], state_a), logits[position])
        if position < len(other):
            np.testing.assert_array_equal(model.step(other[position], state_b), other_logits[position])


def test_greedy_agrees_with_teacher_forced_argmax(tiny):
    _, _, ids, model, _, _ = tiny
    prompt = ids[:4]
    generated = model.greedy(prompt, 5)
    assert len(generated) == 5
    forced = model.forward(prompt + generated)
    assert [int(np.argmax(row)) for row in forced[len(prompt) - 1:-1]] == generated


def test_trace_records_top_k_distinct_experts_per_moe_layer(tiny):
    config, _, ids, _, _, trace = tiny
    assert set(trace) == {(p, l) for p in range(len(ids)) for l in config.moe_layer_ids}
    for experts in trace.values():
        assert len(set(experts)) == config.num_experts_per_token
        assert all(0 <= e < config.num_experts for e in experts)
    assert all(NEVER_ROUTED[1] not in trace[(p, NEVER_ROUTED[0])] for p in range(len(ids)))


def _with_new_expert_bytes(tensors, layer, expert, seed):
    changed = dict(tensors)
    name = f"{MODEL}layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight_packed"
    fresh = np.random.default_rng(seed).integers(0, 256, tensors[name].shape, dtype=np.uint8)
    assert not np.array_equal(fresh, tensors[name])
    changed[name] = fresh
    return changed


def test_changing_an_expert_changes_logits_only_from_its_first_routed_token(tiny):
    config, tensors, ids, _, logits, trace = tiny
    first_use: dict[tuple[int, int], int] = {}
    for (position, layer), experts in sorted(trace.items()):
        for expert in experts:
            first_use.setdefault((layer, expert), position)
    (layer, expert), first = max(first_use.items(), key=lambda item: (item[1], item[0]))
    assert first >= 2, "the fixture should route some expert for the first time late in the sequence"
    changed = ReferenceModel(config, _with_new_expert_bytes(tensors, layer, expert, 100), trace=True)
    changed_logits = changed.forward(ids)
    # earlier tokens never touched the expert; later ones see the change through attention and KDA state
    np.testing.assert_array_equal(changed_logits[:first], logits[:first])
    assert np.max(np.abs(changed_logits[first] - logits[first])) > 1e-4
    assert all(changed.trace[key] == trace[key] for key in trace if key[0] < first)

    untouched = ReferenceModel(config, _with_new_expert_bytes(tensors, *NEVER_ROUTED, 101)).forward(ids)
    np.testing.assert_array_equal(untouched, logits)


def test_missing_or_misshapen_tensor_is_a_checkpoint_error(tiny):
    config, tensors, _, _, _, _ = tiny
    name = f"{MODEL}layers.5.self_attn.dt_bias"
    with pytest.raises(CheckpointError, match="dt_bias"):
        ReferenceModel(config, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match="shape"):
        ReferenceModel(config, dict(tensors, **{name: tensors[name][:-1]}))



def _attn_res64(sources, norm_w, proj_w):
    sources = [s.astype(np.float64) for s in sources]
    scores = np.array([s / np.sqrt(np.mean(s * s) + 1e-5) @ (norm_w * proj_w.reshape(-1)) for s in sources])
    p = np.exp(scores - scores.max())
    return sum(w * s for w, s in zip(p / p.sum(), sources))


def test_attention_residual_wiring_follows_the_block_structure(tiny):
    """With attention and MLP replaced by fixed outputs a_l, m_l, every layer must see AttnRes over the embedding,
    the sums of the completed blocks of B layers, and the partial sum of the current block (section 5)."""
    config, tensors, _, _, _, _ = tiny
    L, H, B, eps = config.num_layers, config.hidden_size, config.attn_res_block_size, config.rms_norm_eps
    model = ReferenceModel(config, tensors)
    rng = np.random.default_rng(12)
    attn_out = rng.standard_normal((L, H)).astype(F32)
    mlp_out = rng.standard_normal((L, H)).astype(F32)
    seen: dict[tuple[str, int], np.ndarray] = {}

    def fake_attention(layer, x, state):
        seen[("attn", layer)] = x
        return attn_out[layer]

    def fake_mlp(layer, x, position):
        seen[("mlp", layer)] = x
        return mlp_out[layer]

    model._attention, model._mlp = fake_attention, fake_mlp
    token = 7
    logits = model.step(token, model.new_state())
    embedding = tensors[MODEL + "embed_tokens.weight"][token].astype(np.float64)
    outputs = attn_out.astype(np.float64) + mlp_out

    def sources(num_full_blocks, partial_start, partial_end, extra=None):
        full = [outputs[j * B:(j + 1) * B].sum(axis=0) for j in range(num_full_blocks)]
        partial = outputs[partial_start:partial_end].sum(axis=0) + (0 if extra is None else extra)
        return [embedding] + full + [partial]

    def weights(layer, name):
        return tensors[f"{MODEL}layers.{layer}.{name}.weight"].astype(np.float64)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x) + eps) * w

    for layer in range(L):
        if layer == 0:
            h = embedding
        else:
            previous_block = (layer - 1) // B
            h = _attn_res64(sources(previous_block, previous_block * B, layer),
                            weights(layer, "self_attention_res_norm"), weights(layer, "self_attention_res_proj"))
        np.testing.assert_allclose(seen[("attn", layer)], norm(h, weights(layer, "input_layernorm")),
                                   rtol=1e-4, atol=1e-4, err_msg=f"attention input of layer {layer}")
        block = layer // B
        h = _attn_res64(sources(block, block * B, layer, extra=attn_out[layer]),
                        weights(layer, "mlp_res_norm"), weights(layer, "mlp_res_proj"))
        np.testing.assert_allclose(seen[("mlp", layer)], norm(h, weights(layer, "post_attention_layernorm")),
                                   rtol=1e-4, atol=1e-4, err_msg=f"MLP input of layer {layer}")
    last_block = (L - 1) // B
    h = _attn_res64(sources(last_block, last_block * B, L), tensors[MODEL + "output_attn_res_norm.weight"],
                    tensors[MODEL + "output_attn_res_proj.weight"])
    expected = tensors["language_model.lm_head.weight"] @ norm(h, tensors[MODEL + "norm.weight"])
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
