"""Family experts at each precision: bf16 kept as bf16, int8 and MXFP4 in one fused call, against float32."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.errors import CheckpointError
from k3serve.model.families.experts import (DENSE_BLAS_MIN_TOKENS, BF16Expert, ExpertStore, FloatExpert,
                                            QuantizedExpert, outputs_one_by_one, pack_expert)
from k3serve.model.kernels import dense_expert_reference
from k3serve.model.routing import pairs_by_expert


def _bf16_round(w: np.ndarray) -> np.ndarray:
    return ((w.astype(np.float32).view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)


def _matrices(seed: int, hidden: int = 64, inner: int = 96):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((inner, hidden)).astype(np.float32) / 8 for _ in range(2))
    return gate, up, rng.standard_normal((hidden, inner)).astype(np.float32) / 8


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


@pytest.mark.parametrize("tokens", [1, 5, DENSE_BLAS_MIN_TOKENS + 3])
def test_bf16_weights_stay_bf16_and_compute_the_same(tokens):
    gate, up, down = (_bf16_round(m) for m in _matrices(1))
    expert = pack_expert(gate, up, down, "native")
    assert isinstance(expert, BF16Expert) and expert.gate_up.dtype == np.uint16
    float_expert = FloatExpert(np.concatenate([gate, up]), down)
    assert expert.nbytes * 2 == float_expert.nbytes  # half the bytes of the float32 copy, and no such copy held
    x = np.random.default_rng(2).standard_normal((tokens, 64)).astype(np.float32)
    assert _relative_rms(expert(x), float_expert(x)) < 1e-5


def test_float32_weights_stay_float32():
    assert isinstance(pack_expert(*_matrices(3), "native"), FloatExpert)


@pytest.mark.parametrize("precision", ["int8", "mxfp4"])
def test_quantized_expert_fused_call_matches_dequantized_float(precision):
    expert = pack_expert(*_matrices(4), precision)
    assert isinstance(expert, QuantizedExpert)
    dequantized = FloatExpert(np.concatenate([expert.gate.dequantize(), expert.up.dequantize()]),
                              expert.down.dequantize())
    for tokens in (1, 4, DENSE_BLAS_MIN_TOKENS + 1):
        x = np.random.default_rng(tokens).standard_normal((tokens, 64)).astype(np.float32)
        assert _relative_rms(expert(x), dequantized(x)) < 1e-5, f"{precision}, {tokens} tokens"


@pytest.mark.parametrize("precision", ["bf16", "int8", "native"])
def test_a_tokens_bits_do_not_depend_on_how_many_tokens_share_its_expert(precision):
    """Per-row int8, bf16 and float32 experts run the row dot's tiles at every count below DENSE_BLAS_MIN_TOKENS:
    a prefill-sized group gives each token the bits it gets alone (decode)."""
    matrices = _matrices(6)
    expert = pack_expert(*((_bf16_round(m) for m in matrices) if precision == "bf16" else matrices),
                         "native" if precision == "bf16" else precision)
    x = np.random.default_rng(7).standard_normal((41, 64)).astype(np.float32)
    together = expert(x)
    np.testing.assert_array_equal(together, np.concatenate([expert(x[i:i + 1]) for i in range(41)]))
    np.testing.assert_array_equal(together[:9], expert(x[:9]))


def _float_twin(expert) -> FloatExpert:
    """The expert as float32 matrices (dequantized or widened), for the numpy forms."""
    if isinstance(expert, QuantizedExpert):
        return FloatExpert(np.concatenate([expert.gate.dequantize(), expert.up.dequantize()]),
                           expert.down.dequantize())
    return FloatExpert(*((m.astype(np.uint32) << 16).view(np.float32) if m.dtype == np.uint16 else m
                         for m in (expert.gate_up, expert.down)))


def _numpy_expert(expert: FloatExpert, x: np.ndarray) -> np.ndarray:
    return dense_expert_reference(expert.gate_up, None, expert.down, None, x)


@pytest.mark.parametrize("precision", ["bf16", "native", "int8", "mxfp4"])
def test_store_runs_a_layer_in_one_call_as_one_by_one_and_numpy(precision):
    """The resident store packs each expert into its layer's stack (the expert is a view of it) and runs the
    layer's active experts in one call: the same bits as one expert at a time (the streaming path), and the
    numpy form of each expert within float32 rounding, prefill-sized groups (BLAS) included."""
    num_experts, hidden, tokens_total = 6, 64, DENSE_BLAS_MIN_TOKENS + 8
    matrices = {e: _matrices(10 + e) for e in range(num_experts)}
    if precision == "bf16":
        matrices = {e: tuple(_bf16_round(m) for m in ms) for e, ms in matrices.items()}
    store = ExpertStore(lambda layer, e: matrices[e], precision, num_experts)
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice([0, 2, 5], size=2, replace=False) for _ in range(tokens_total)])  # [T, 2]
    ids[:DENSE_BLAS_MIN_TOKENS + 2, 0] = 3  # expert 3 gets enough tokens for the BLAS path
    pairs = pairs_by_expert(ids)
    x = rng.standard_normal((tokens_total, hidden)).astype(np.float32)
    together = store.expert_outputs(1, pairs, x)
    experts = {int(e): store.get(1, int(e)) for e in pairs.expert_ids}
    np.testing.assert_array_equal(together, outputs_one_by_one(experts, pairs, x))
    for k, e in enumerate(pairs.expert_ids):
        rows = slice(pairs.starts[k], pairs.ends[k])
        want = _numpy_expert(_float_twin(experts[int(e)]), x[pairs.tokens[rows]])
        assert _relative_rms(together[rows], want) < 1e-5, f"expert {e}"
    kind, stacked = store._stacks[1]
    assert any(np.shares_memory(a, experts[0].parts()[1][0]) for a in stacked if a is not None)
    assert store.num_loaded == 4  # experts 0, 2, 3 and 5; the others' slots of the stack were never written


def test_store_refuses_an_expert_outside_the_layer_or_in_another_format():
    gate, up, down = _matrices(1)
    store = ExpertStore(lambda layer, e: (gate, up, down) if e == 0 else tuple(_bf16_round(m) for m in (gate, up,
                                                                                                       down)),
                        "native", 3)
    store.get(0, 0)  # float32: the layer's stack is float32
    with pytest.raises(CheckpointError, match="share their format"):
        store.get(0, 1)  # bf16 bits
    with pytest.raises(IndexError, match="3 experts"):
        store.get(0, 3)


def test_a_dense_mlp_runs_a_long_prompt_in_chunks(monkeypatch):
    """A dense (or shared) SiLU-GLU MLP runs a long prompt PREFILL_CHUNK_TOKENS rows at a time (prefill's peak memory):
    the rows of one call, within float32 round-off (BLAS may block other row counts differently)."""
    from k3serve.model import routing as routing_module
    from k3serve.model.families import moe

    rng = np.random.default_rng(10)
    mlp = moe.GLUWeights(rng.standard_normal((2 * 24, 16), dtype=np.float32),
                         rng.standard_normal((16, 24), dtype=np.float32))
    x = rng.standard_normal((23, 16), dtype=np.float32)
    monkeypatch.setattr(routing_module, "PREFILL_CHUNK_TOKENS", 5)
    chunked = mlp(x)
    monkeypatch.setattr(routing_module, "PREFILL_CHUNK_TOKENS", 1 << 20)
    whole = mlp(x)
    assert chunked.shape == whole.shape == (23, 16)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked[7], mlp(x[7:8])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["int8", "mxfp4", "native"])
def test_a_long_prompt_runs_its_experts_in_chunks_with_the_same_bits(precision, monkeypatch):
    """The MoE block runs a resident store's experts EXPERT_CHUNK_TOKENS tokens at a time (prefill's peak memory):
    each token's output has the bits of the whole prompt in one call."""
    from k3serve.model import routing as routing_module
    from k3serve.model.families import moe

    num_experts, hidden = 6, 64
    matrices = {e: _matrices(20 + e) for e in range(num_experts)}
    router_weight = np.random.default_rng(8).standard_normal((num_experts, hidden)).astype(np.float32)
    block = moe.MoEBlock(layer=0, router=moe.SoftmaxRouter(router_weight, top_k=2, normalize=True),
                         experts=ExpertStore(lambda layer, e: matrices[e], precision, num_experts), shared=None,
                         shared_gate=None)
    x = np.random.default_rng(9).standard_normal((23, hidden)).astype(np.float32)
    monkeypatch.setattr(routing_module, "EXPERT_CHUNK_TOKENS", 5)
    chunked, routing = block(x)
    monkeypatch.setattr(routing_module, "EXPERT_CHUNK_TOKENS", 1 << 20)
    whole, _ = block(x)
    np.testing.assert_array_equal(chunked, whole)
    assert routing.expert_ids.shape == (23, 2) and block.experts.num_loaded > 2
