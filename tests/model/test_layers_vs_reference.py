"""Each fast layer against the independent token-by-token reference, on odd lengths and with carried state.

The fast layers run a whole segment at once (chunked KDA, absorbed MLA over the cache, grouped experts); the
reference runs one token at a time. Inputs are real tiny-oracle weights and random activations.
"""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model import reference as ref
from k3serve.model.attn_res import attn_res
from k3serve.model.kda import kda_forward
from k3serve.model.mla import mla_attend, mla_project
from k3serve.model.moe import moe_forward
from k3serve.model.cache import DenseSequenceCache
from k3serve.model.k3 import k3_cache_layout
from k3serve.weights import names
from k3serve.weights.checkpoint import Checkpoint

LENGTHS = (1, 15, 63, 300)
RTOL = 2e-6  # one layer, fp32, different summation orders


def _relative_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.fixture(scope="module")
def checkpoint(tiny_dir):
    return Checkpoint(tiny_dir)


def _attn_weights(checkpoint, layer):
    prefix = f"{names.layer_prefix(layer)}self_attn."
    out = {}
    for name in checkpoint.index.names():
        if name.startswith(prefix):
            short = name[len(prefix):]
            out[short[:-len(".weight")] if short.endswith(".weight") else short] = checkpoint.read(name)
    return out


def _split(T):
    """Where to cut a sequence of T tokens into two forwards (state carried between them)."""
    return max(1, T // 3) if T > 1 else 1


@pytest.mark.parametrize("T", LENGTHS)
def test_kda_layer_matches_reference(tiny_model, checkpoint, T):
    config, layer = tiny_model.config, 1
    rng = np.random.default_rng(T)
    x = rng.normal(size=(T, config.hidden_size)).astype(np.float32)
    state = ref.KDAState.zeros(config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size)
    weights = _attn_weights(checkpoint, layer)
    expected = []
    for t in range(T):
        step = ref.kda_step(x[t], weights, state, num_heads=config.kda_num_heads, head_dim=config.kda_head_dim,
                            gate_lower_bound=config.gate_lower_bound, eps=config.rms_norm_eps)
        expected.append(step.output)
        state = step.state
    cache = DenseSequenceCache(k3_cache_layout(config))
    w = tiny_model.source.layer(layer).attention
    cut = _split(T)
    got = [kda_forward(config, w, x[:cut], [(0, cut)], [cache], layer)]
    if cut < T:
        got.append(kda_forward(config, w, x[cut:], [(0, T - cut)], [cache], layer))
    error = _relative_rms(np.concatenate(got), np.stack(expected))
    print(f"KDA T={T} relative RMS {error:.2e}")
    assert error < RTOL, f"KDA T={T}: relative RMS {error:.2e}"
    final_state, _ = cache.recurrent_state(layer)
    assert _relative_rms(final_state, state.recurrent) < RTOL


@pytest.mark.parametrize("T", LENGTHS)
def test_mla_layer_matches_reference(tiny_model, checkpoint, T):
    config, layer = tiny_model.config, 3
    rng = np.random.default_rng(100 + T)
    x = rng.normal(size=(T, config.hidden_size)).astype(np.float32)
    weights = _attn_weights(checkpoint, layer)
    mla_cache, expected = ref.MLACache(), []
    for t in range(T):
        step = ref.mla_step(x[t], weights, mla_cache, num_heads=config.num_mla_heads,
                            nope_dim=config.qk_nope_head_dim, rope_dim=config.qk_rope_head_dim,
                            v_dim=config.v_head_dim, kv_lora_rank=config.kv_lora_rank,
                            use_output_gate=config.mla_use_output_gate, eps=config.rms_norm_eps)
        expected.append(step.output)
        mla_cache = step.cache
    cache = DenseSequenceCache(k3_cache_layout(config))
    w = tiny_model.source.layer(layer).attention
    got = []
    cut = _split(T)
    for start, end in ((0, cut), (cut, T)):
        if start == end:
            continue
        q, rows, gate = mla_project(config, w, x[start:end])
        cache.append_rows(layer, rows)
        got.append(mla_attend(config, w, q, cache.attention_rows(layer), gate))
    error = _relative_rms(np.concatenate(got), np.stack(expected))
    print(f"MLA T={T} relative RMS {error:.2e}")
    assert error < RTOL, f"MLA T={T}: relative RMS {error:.2e}"
    cached = cache.attention_rows(layer)
    assert np.allclose(cached[:, :config.kv_lora_rank], np.stack(mla_cache.latents), rtol=1e-5, atol=1e-6)
    assert np.allclose(cached[:, config.kv_lora_rank:], np.stack(mla_cache.k_ropes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", LENGTHS)
def test_moe_layer_matches_reference(tiny_model, tiny_reference, checkpoint, T):
    config, layer = tiny_model.config, 5
    rng = np.random.default_rng(200 + T)
    x = (2.0 * rng.normal(size=(T, config.hidden_size))).astype(np.float32)
    m = names.moe_prefix(layer)
    read = checkpoint.read
    shared = ref.SharedMLP(read(f"{m}shared_experts.gate_proj.weight"), read(f"{m}shared_experts.up_proj.weight"),
                           read(f"{m}shared_experts.down_proj.weight"))
    expected = []
    for t in range(T):
        routing = ref.route(x[t], read(f"{m}gate.weight"), read(f"{m}gate.e_score_correction_bias"),
                            config.num_experts_per_token, config.routed_scaling_factor, config.moe_renormalize)
        expected.append(ref.latent_moe(
            x[t], routing, lambda e: tiny_reference.expert(layer, e),
            down_proj=read(f"{m}routed_expert_down_proj.weight"), up_proj=read(f"{m}routed_expert_up_proj.weight"),
            norm_weight=read(f"{m}routed_expert_norm.weight"), shared=shared, beta1=config.situ_beta,
            beta2=config.situ_linear_beta, eps=config.rms_norm_eps))
    w = tiny_model.source.layer(layer).mlp
    got, routing = moe_forward(config, w, x, lambda ids: tiny_model.source.experts(layer, ids))
    error = _relative_rms(got, np.stack(expected))
    print(f"MoE T={T} relative RMS {error:.2e}")
    assert error < RTOL, f"MoE T={T}: relative RMS {error:.2e}"


def test_moe_runs_a_long_prompts_stacked_experts_in_chunks_with_the_same_bits(tiny_model, monkeypatch):
    """A resident (stacked) layer runs a prompt's experts EXPERT_CHUNK_TOKENS tokens a call (prefill's peak memory):
    the output is the bits of one call, and of the one-call-per-expert path."""
    from k3serve.model import routing as routing_module

    config, layer = tiny_model.config, 5
    x = (2.0 * np.random.default_rng(7).normal(size=(23, config.hidden_size))).astype(np.float32)
    w, source = tiny_model.source.layer(layer).mlp, tiny_model.source
    fetch = lambda ids: source.experts(layer, ids)  # noqa: E731
    stacked = source.stacked_experts(layer)
    assert stacked is not None
    monkeypatch.setattr(routing_module, "EXPERT_CHUNK_TOKENS", 5)
    chunked, routing = moe_forward(config, w, x, fetch, stacked=stacked)
    monkeypatch.setattr(routing_module, "EXPERT_CHUNK_TOKENS", 1 << 20)
    whole, _ = moe_forward(config, w, x, fetch, stacked=stacked)
    one_by_one, _ = moe_forward(config, w, x, fetch)
    assert len(np.unique(routing.expert_ids)) > 4  # chunks that route to different experts
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(chunked, one_by_one)


def test_moe_inputs_reach_the_situ_caps(tiny_model):
    """The oracle's experts see gate inputs beyond 4 and up inputs beyond 25, so a cap bug would show."""
    from k3serve.model.kernels import mxfp4_matmul

    config, layer = tiny_model.config, 5
    rng = np.random.default_rng(0)
    w = tiny_model.source.layer(layer).mlp
    z = (rng.normal(size=(64, config.hidden_size)).astype(np.float32)) @ w.latent_down.T
    expert = tiny_model.source.experts(layer, [0])[0]
    gate = mxfp4_matmul(expert.w1_packed, expert.w1_scales, z)
    up = mxfp4_matmul(expert.w3_packed, expert.w3_scales, z)
    assert np.mean(np.abs(gate) > 4) > 0.05
    assert np.mean(np.abs(up) > 25) > 0.01


@pytest.mark.parametrize("num_sources", [1, 2, 5])
def test_attn_res_matches_reference(tiny_model, num_sources):
    config = tiny_model.config
    rng = np.random.default_rng(num_sources)
    sources = [(rng.normal(size=(15, config.hidden_size)) * (i + 1)).astype(np.float32)
               for i in range(num_sources)]
    norm_w = (1 + 0.3 * rng.normal(size=config.hidden_size)).astype(np.float32)
    proj_w = (0.2 * rng.normal(size=(1, config.hidden_size))).astype(np.float32)
    got = attn_res(sources, norm_w * proj_w.reshape(-1), config.rms_norm_eps)
    expected = np.stack([ref.attn_res([s[t] for s in sources], norm_w, proj_w, config.rms_norm_eps)
                         for t in range(15)])
    assert _relative_rms(got, expected) < RTOL
