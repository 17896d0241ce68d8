"""Widening experts keeps the model's function: same logits to float32 rounding, same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.errors import CheckpointError
from k3serve.loading import load_model
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.widen import widen_experts


def test_widened_model_computes_the_same_function(tiny_dir, tmp_path):
    wide = widen_experts(tiny_dir, tmp_path / "wide", inner=4, latent=2)
    base_cfg, wide_cfg = Checkpoint(tiny_dir).config, Checkpoint(wide).config
    assert wide_cfg.moe_intermediate_size == 4 * base_cfg.moe_intermediate_size
    assert wide_cfg.latent_size == 2 * base_cfg.latent_size
    assert wide_cfg.expert_bytes == 8 * base_cfg.expert_bytes
    base, widened = load_model(tiny_dir).model, load_model(wide).model
    ids = np.random.default_rng(0).integers(0, base_cfg.vocab_size, size=40)
    a, b = base.logits(ids), widened.logits(ids)
    rel = float(np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)))
    assert rel < 1e-5, rel
    assert base.greedy(ids[:8], 12) == widened.greedy(ids[:8], 12)


def test_widen_refuses_a_factor_that_is_not_a_power_of_two(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match="power of two"):
        widen_experts(tiny_dir, tmp_path / "w", inner=3)
