"""Tiled causal attention (online softmax) against its dense twin, in isolation, in every attention layer that uses
it, and through the whole model; then a 32K-token prefill whose memory stays O(T x block)."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from k3serve.config import tiny_config
from k3serve.errors import ContextLengthError
from k3serve.model.causal_attention import (absorb_queries, causal_attention, causal_attention_reference,
                                            values_from_latent)
from k3serve.model.families.attention import GQAAttention
from k3serve.model.families.latent_attention import LatentAttention, LatentAttentionWeights
from k3serve.model.interface import ForwardItem
from k3serve.model.k3 import K3Model
from k3serve.model.mla import mla_attend, mla_attend_reference, mla_project

RTOL = 2e-6  # float32 round-off between two summation orders of one softmax


def _relative_max(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("T, N, query_block, key_block", [
    (1, 1, 1, 1), (1, 300, 1, 7), (15, 15, 4, 3), (63, 63, 16, 16), (63, 100, 7, 64), (300, 300, 64, 17),
    (300, 301, 300, 1), (40, 1000, 8, 128),
])
def test_tiles_equal_the_dense_softmax(T, N, query_block, key_block):
    rng = np.random.default_rng(T * 1000 + N)
    q = rng.standard_normal((3, T, 24), dtype=np.float32) * 3  # sharp softmaxes: the running maximum matters
    keys = rng.standard_normal((N, 24), dtype=np.float32)
    values = rng.standard_normal((N, 10), dtype=np.float32)
    ours = causal_attention(q, keys, values, 0.2, query_block, key_block)
    ref = causal_attention_reference(q, keys, values, 0.2)
    assert ours.shape == ref.shape == (3, T, 10)
    assert _relative_max(ours, ref) < RTOL


def test_broadcast_groups_and_a_query_longer_than_its_keys():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 50, 8), dtype=np.float32)  # [NKV, G, T, hd]
    keys = rng.standard_normal((2, 1, 70, 8), dtype=np.float32)
    values = rng.standard_normal((2, 1, 70, 8), dtype=np.float32)
    assert _relative_max(causal_attention(q, keys, values, 0.35, 9, 11),
                         causal_attention_reference(q, keys, values, 0.35)) < RTOL
    with pytest.raises(ValueError, match="last T"):
        causal_attention(q, keys[:, :, :40], values[:, :, :40], 0.35, 9, 11)


@pytest.mark.parametrize("q_shape, key_lead", [((2, 3, 50, 8), (2, 1)), ((1, 3, 50, 8), (2, 1)),
                                               ((4, 50, 8), ()), ((2, 2, 50, 8), ())])
def test_query_rows_sharing_their_keys_are_folded_into_one_product(q_shape, key_lead):
    """The query heads of a KV group (keys [..., 1, N, D]) or every head (keys [N, D]) are one matrix product of
    their rows against each key tile; q broadcast against the keys too: within round-off of the dense twin."""
    rng = np.random.default_rng(len(q_shape) * 10 + q_shape[0])
    q = rng.standard_normal(q_shape, dtype=np.float32) * 3
    keys = rng.standard_normal((*key_lead, 70, 8), dtype=np.float32)
    values = rng.standard_normal((*key_lead, 70, 6), dtype=np.float32)
    ours = causal_attention(q, keys, values, 0.35, 9, 11)
    ref = causal_attention_reference(q, keys, values, 0.35)
    assert ours.shape == ref.shape
    assert _relative_max(ours, ref) < RTOL


@pytest.mark.parametrize("T", [0, 1, 4])
@pytest.mark.parametrize("q_shape, key_lead", [((4, 8), (4, 1)), ((16,), ())])
def test_one_tile_decode_takes_the_folded_products(T, q_shape, key_lead):
    """Where one tile holds every score (decode, speculative verification, short prompts), the same folded products
    run once over all the keys: within round-off of the dense twin, and of the last query run alone (BLAS may
    block a GQA group's rows differently for another count of them)."""
    rng = np.random.default_rng(T + len(q_shape))
    N = 90
    q = rng.standard_normal((*q_shape, T, 32), dtype=np.float32) * 3
    keys = rng.standard_normal((*key_lead, N, 32), dtype=np.float32)
    values = rng.standard_normal((*key_lead, N, 16), dtype=np.float32)
    ours = causal_attention(q, keys, values, 0.2)  # default blocks: T x N is within one tile
    ref = causal_attention_reference(q, keys, values, 0.2)
    assert ours.shape == ref.shape == (*q_shape, T, 16)
    if T:
        assert _relative_max(ours, ref) < RTOL
        last = causal_attention(q[..., -1:, :], keys, values, 0.2)  # the last query alone
        assert _relative_max(last, ours[..., -1:, :]) < RTOL


@pytest.mark.parametrize("T", [1, 5])
def test_mla_head_products_equal_their_einsum_twins(T):
    """The absorbed query (W_uk^T q_nope) and the value projection (W_uv out) as one BLAS product a head: within
    round-off of the per-head sums written out (np.einsum), shapes as the attention expects."""
    rng = np.random.default_rng(T)
    NA, DN, KL, DV = 3, 16, 40, 8
    q_nope = rng.standard_normal((T, NA, DN + 4), dtype=np.float32)[:, :, :DN]  # a strided view, as MLA slices it
    w_uk, w_uv = (rng.standard_normal(shape, dtype=np.float32) for shape in ((NA, DN, KL), (NA, DV, KL)))
    absorbed = absorb_queries(q_nope, w_uk)
    assert absorbed.shape == (NA, T, KL)
    assert _relative_max(absorbed, np.einsum("tad,adk->atk", q_nope, w_uk)) < RTOL
    out_latent = rng.standard_normal((NA, T, KL), dtype=np.float32)
    values = values_from_latent(out_latent, w_uv)
    assert values.shape == (T, NA * DV)
    assert _relative_max(values, np.einsum("atk,avk->tav", out_latent, w_uv).reshape(T, -1)) < RTOL


def test_mla_attend_tiled_equals_the_dense_twin(tiny_model):
    config = tiny_model.config
    layer = config.full_attn_layers[0] - 1
    w = tiny_model.source.layer(layer).attention
    rng = np.random.default_rng(2)
    x = rng.standard_normal((77, config.hidden_size), dtype=np.float32)
    q, rows, gate = mla_project(config, w, x)
    cache = np.concatenate([rng.standard_normal((23, rows.shape[1]), dtype=np.float32), rows])  # 23 earlier rows
    ours = mla_attend(config, w, q, cache, gate, query_block=8, key_block=13)
    assert _relative_max(ours, mla_attend_reference(config, w, q, cache, gate)) < 1e-5


NA, KL, DN, DR, DV = 3, 16, 8, 4, 8  # the small latent attention below: heads, latent, nope, rope, value widths


def _latent_attention(rng: np.random.Generator, query_block: int) -> LatentAttention:
    """Only the attention core's weights (W_uk, W_uv): `_attend` and its twin, without projections."""
    weights = LatentAttentionWeights(in_proj=None, q_a_norm=None, q_b=None, kv_a_norm=None,
                                     w_uk=rng.standard_normal((NA, DN, KL), dtype=np.float32),
                                     w_uv=rng.standard_normal((NA, DV, KL), dtype=np.float32), o_proj=None)
    return LatentAttention(layer=0, weights=weights, num_heads=NA, q_lora_rank=None, kv_lora_rank=KL, nope_dim=DN,
                           rope_dim=DR, value_dim=DV, scale=0.3, rotary=None, norm_eps=1e-6,
                           query_block=query_block, key_block=10)


def test_family_attention_tiled_equals_the_dense_twin():
    rng = np.random.default_rng(4)
    gqa = GQAAttention(layer=0, weights=None, num_heads=6, num_kv_heads=2, head_dim=8, rotary=None, eps=1e-6,
                       gated=False, query_block=5, key_block=9)
    q = rng.standard_normal((41, 6, 8), dtype=np.float32)
    cached = rng.standard_normal((60, 2 * 2 * 8), dtype=np.float32)
    assert _relative_max(gqa._attend(q, cached), gqa._attend_reference(q, cached)) < RTOL

    latent = _latent_attention(rng, query_block=6)
    q = rng.standard_normal((33, NA, DN + DR), dtype=np.float32)
    cached = rng.standard_normal((50, KL + DR), dtype=np.float32)
    assert _relative_max(latent._attend(q, cached), latent._attend_reference(q, cached)) < 1e-5


def test_whole_model_with_small_tiles_equals_one_tile(tiny_model):
    tiled = K3Model(tiny_model.source, attention_blocks=(7, 16))
    ids = np.random.default_rng(5).integers(3, 256, 150)
    ours, ref = tiled.logits(ids), tiny_model.logits(ids)  # 150 x 150 < 256 x 1024: the default is one dense tile
    assert float(np.sqrt(np.mean((ours - ref) ** 2) / np.mean(ref ** 2))) < 5e-5
    assert np.array_equal(ours.argmax(1), ref.argmax(1))


# a small K3 for long contexts: one KDA and one MLA layer, narrow heads
LONG_CONFIG = dataclasses.replace(
    tiny_config(), num_layers=2, kda_layers=(1,), full_attn_layers=(2,), hidden_size=32, num_mla_heads=1,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
    kda_num_heads=1, intermediate_size=32, attn_res_block_size=2)
LONG_PROMPT = 32 * 1024


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from k3serve.loading import load_model
    from k3serve.weights.synthetic import write_random_checkpoint

    folder = write_random_checkpoint(LONG_CONFIG, tmp_path_factory.mktemp("long"), seed=3)
    return load_model(folder).model


def test_long_model_tiled_equals_dense_on_a_shorter_prompt(long_model):
    ids = np.random.default_rng(6).integers(3, 256, 3000)
    dense = K3Model(long_model.source, attention_blocks=(4096, 4096))  # one tile: the dense twin
    ours = long_model.forward([ForwardItem(ids, long_model.new_cache(), all_logits=True)]).logits[0]
    ref = dense.forward([ForwardItem(ids, dense.new_cache(), all_logits=True)]).logits[0]
    assert float(np.sqrt(np.mean((ours - ref) ** 2) / np.mean(ref ** 2))) < 1e-5
    assert np.array_equal(ours.argmax(1), ref.argmax(1))


def test_32k_prompt_prefills_in_bounded_memory(long_model):
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams

    ids = np.random.default_rng(7).integers(3, 256, LONG_PROMPT).tolist()
    with pytest.raises(ContextLengthError, match="context holds 4096 tokens, but the prompt has 32768"):
        generate(long_model, ids, SamplingParams(max_tokens=2))  # the default context refuses it, as serve does
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        tokens, report = generate(long_model, ids, SamplingParams(max_tokens=2, ignore_eos=True),
                                  max_context=LONG_PROMPT + 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(tokens) == 2 and report.prompt_tokens == LONG_PROMPT
    dense_scores = LONG_CONFIG.num_mla_heads * LONG_PROMPT * LONG_PROMPT * 4  # what one [NA, T, T] matrix takes
    # activations are O(T): ~40 float32 rows of width <= 64 per token (~330 MB at 32K would be O(T) too); the
    # dense scores alone would be 4 GiB
    assert peak < 400 << 20, f"peak traced memory {peak / 2**20:.0f} MiB"
    assert peak < dense_scores / 10
