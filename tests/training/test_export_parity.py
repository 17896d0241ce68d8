"""The torch training model computes the numpy engine's function: export -> load_model -> same logits.

The torch side is evaluated with the served weights (bf16-rounded trunk, MXFP4-dequantized experts, loaded
back with `load_exported`), so the only differences left are float32 summation order.
"""

from __future__ import annotations

import numpy as np
import torch

from k3serve.config import tiny_config
from k3serve.loading import load_model
from k3serve.training.model import (K3ForTraining, export, init_weights, kda_chunked, kda_chunked_parallel,
                                    kda_recurrent, load_exported)
from k3serve.weights import names

MAX_RELATIVE_RMS = 1e-4
NUM_GREEDY_STEPS = 10


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def _randomize(model: K3ForTraining, seed: int) -> None:
    """Training init plus non-trivial attention-residual queries, norms and router bias, so every path matters."""
    init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5, generator=gen)
            elif name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0.0, 0.15, generator=gen)


def test_state_dict_keys_are_released_names():
    config = tiny_config()
    model = K3ForTraining(config)
    keys = set(model.state_dict())
    trunk = {spec.name for spec in names.all_specs(config) if spec.dtype != "U8"}
    stacked = {f"{names.moe_prefix(l)}experts.{m}" for l in config.moe_layer_ids for m in names.EXPERT_MATRICES}
    assert keys == trunk | stacked


def test_chunked_delta_rule_equals_token_loop():
    gen = torch.Generator().manual_seed(3)
    X, T, D = 3, 45, 8  # T not a multiple of the chunk
    q = torch.nn.functional.normalize(torch.randn(X, T, D, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(X, T, D, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(X, T, D, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.rand(X, T, D, generator=gen, dtype=torch.float64)
    beta = torch.rand(X, T, generator=gen, dtype=torch.float64)
    S0 = torch.randn(X, D, D, generator=gen, dtype=torch.float64)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, S0)
    for chunked in (kda_chunked, kda_chunked_parallel):  # the CPU's form and the CUDA one
        o, s = chunked(q, k, v, g, beta, S0, chunk_size=16)
        assert torch.allclose(o, o_ref, atol=1e-10) and torch.allclose(s, s_ref, atol=1e-10), chunked.__name__


def test_export_matches_numpy_engine(tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    model = K3ForTraining(config)
    _randomize(model, seed=7)
    out = export(model, config, tmp_path / "ckpt", tokenizer_dir=None)
    load_exported(model, out)  # the torch model now holds exactly the served (rounded) weights
    engine = load_model(out).model

    rng = np.random.default_rng(1)
    prompt = rng.integers(3, config.vocab_size, size=37)
    with torch.no_grad():
        expected = model(torch.from_numpy(prompt)[None]).numpy()[0]  # [T, V]
        expected_loop = model(torch.from_numpy(prompt)[None], recurrent=True).numpy()[0]
    got = engine.logits(prompt.tolist())
    assert _relative_rms(expected_loop, expected) < MAX_RELATIVE_RMS
    assert _relative_rms(got, expected) < MAX_RELATIVE_RMS, _relative_rms(got, expected)

    tokens = list(prompt[:8])
    with torch.no_grad():
        for _ in range(NUM_GREEDY_STEPS):
            tokens.append(int(model(torch.tensor(tokens)[None])[0, -1].argmax()))
    assert engine.greedy(prompt[:8].tolist(), NUM_GREEDY_STEPS) == tokens[8:]
