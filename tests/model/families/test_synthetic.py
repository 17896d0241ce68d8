"""Random tiny family checkpoints written without torch (k3serve.model.families.synthetic): they load through the
ordinary loader, are a function of the seed, and bf16 storage gives bf16 experts."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.families import load_family
from k3serve.model.families.experts import BF16Expert, FloatExpert
from k3serve.model.families.synthetic import SYNTHETIC_FAMILIES, write_random_family


@pytest.mark.parametrize("family", SYNTHETIC_FAMILIES)
def test_a_random_family_checkpoint_loads_and_follows_its_seed(tmp_path, family):
    a = load_family(write_random_family(family, tmp_path / "a", seed=3))
    b = load_family(write_random_family(family, tmp_path / "b", seed=3))
    c = load_family(write_random_family(family, tmp_path / "c", seed=4))
    assert a.config.model_type == family
    prompt = [5, 9, 20, 33, 7, 11]
    tokens = a.greedy(prompt, 6)
    assert tokens == b.greedy(prompt, 6) and len(tokens) == 6
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    layer = next(l.mlp.layer for l in a.layers if hasattr(l.mlp, "router"))
    assert isinstance(a.experts.get(layer, 0), FloatExpert)


def test_bf16_storage_gives_bf16_experts(tmp_path):
    model = load_family(write_random_family("qwen3_moe", tmp_path, bf16=True))
    assert isinstance(model.experts.get(0, 0), BF16Expert)


def test_family_top_p_keeps_the_heaviest_experts_and_one_is_bit_identical(tmp_path):
    from k3serve.loading import load_model
    from k3serve.model.routing import ExpertTopP

    folder = write_random_family("deepseek_v3", tmp_path, seed=0)  # grouped sigmoid router, top-3, renormalized
    prompt = [5, 9, 20, 33, 7, 11, 40, 2]
    full = load_model(folder).model.logits(prompt)
    np.testing.assert_array_equal(load_model(folder, expert_top_p=ExpertTopP(1.0, 1)).model.logits(prompt), full)
    model = load_model(folder, expert_top_p=ExpertTopP(0.6, 1)).model
    assert not np.array_equal(model.logits(prompt), full)
    counts = model.kept_experts.counts  # [TOPK + 1]
    assert counts.shape[0] == 4 and counts[0] == 0 and counts[:3].sum() > 0  # some token kept fewer than 3
