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


# ------------------------------------------------------------------------------------------------ any width
def test_the_streamed_writer_holds_exactly_the_tensors_the_builder_asks_for(tmp_path):
    from k3serve.model.families.synthetic import (SYNTHETIC_CONFIGS, family_tensor_shapes,
                                                  write_random_checkpoint_streaming)
    from k3serve.weights.safetensors_io import SafetensorsIndex

    for family in SYNTHETIC_FAMILIES:
        raw = SYNTHETIC_CONFIGS[family]
        folder = write_random_checkpoint_streaming(raw, tmp_path / family, seed=5)
        index = SafetensorsIndex.open(folder)
        shapes = family_tensor_shapes(raw)
        assert sorted(index.names()) == sorted(shapes)
        assert all(tuple(index.info(n).shape) == shapes[n] and index.info(n).dtype == "BF16" for n in shapes)
        again = write_random_checkpoint_streaming(raw, tmp_path / f"{family}-again", seed=5)
        assert (folder / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
        model = load_family(folder)
        logits = model.logits([5, 9, 20, 33, 7, 11])
        # scaled by fan-in, so a random model's activations stay O(1): finite, non-trivial logits
        assert np.all(np.isfinite(logits)) and 0.05 < float(np.std(logits)) < 50, (family, float(np.std(logits)))


def test_the_streamed_writer_scales_by_fan_in_and_keeps_a_finished_folder(tmp_path):
    from k3serve.model.families.synthetic import SYNTHETIC_CONFIGS, write_random_checkpoint_streaming
    from k3serve.weights.safetensors_io import SafetensorsIndex

    raw = {**SYNTHETIC_CONFIGS["qwen3_moe"], "hidden_size": 256, "moe_intermediate_size": 64}
    calls = []
    folder = write_random_checkpoint_streaming(raw, tmp_path / "q", progress=lambda done, total: calls.append(
        (done, total)))
    assert calls[-1][0] == calls[-1][1] == (folder / "model.safetensors").stat().st_size - (
        8 + int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little"))
    index = SafetensorsIndex.open(folder)
    down = index.read("model.layers.0.mlp.experts.3.down_proj.weight").astype(np.float32)  # [H, I]
    gate = index.read("model.layers.0.mlp.experts.3.gate_proj.weight").astype(np.float32)  # [I, H]
    assert abs(float(down.std()) - 64 ** -0.5) < 0.1 * 64 ** -0.5
    assert abs(float(gate.std()) - 256 ** -0.5) < 0.1 * 256 ** -0.5
    norm = index.read("model.layers.0.input_layernorm.weight").astype(np.float32)
    assert abs(float(norm.mean()) - 1.0) < 0.1
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    write_random_checkpoint_streaming(raw, folder, seed=9)  # a finished folder is kept as it is
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_row_groups_cut_only_the_segments_longer_than_a_group():
    from k3serve.model.families.decoder import Batch

    batch = Batch(segments=[(0, 3), (3, 15), (15, 16), (16, 18)], caches=["a", "b", "c", "d"], positions=np.arange(18))
    groups = batch.row_groups(5)
    assert [(first, last, part.segments, list(part.caches)) for first, last, part in groups] == [
        (0, 3, [(0, 3)], ["a"]), (3, 8, [(0, 5)], ["b"]), (8, 13, [(0, 5)], ["b"]),
        (13, 18, [(0, 2), (2, 3), (3, 5)], ["b", "c", "d"])]
    assert all(np.array_equal(part.positions, np.arange(first, last)) for first, last, part in groups)
    assert [(first, last) for first, last, _ in batch.row_groups(4)] == [(0, 3), (3, 7), (7, 11), (11, 15), (15, 18)]


@pytest.mark.parametrize("family", SYNTHETIC_FAMILIES)
def test_a_long_prompt_runs_its_mixers_in_row_groups(tmp_path, family, monkeypatch):
    """Every mixer (GQA, MLA, KDA, gated DeltaNet) runs a long prompt PREFILL_CHUNK_TOKENS rows a call (prefill's
    peak memory), each call from the attention rows, state and conv tail the previous one wrote: the logits of the
    whole prompt in one call within float32 round-off (BLAS blocks other row counts differently), with a short
    sequence in the same batch, and the same state after it."""
    from k3serve.model import routing as routing_module
    from k3serve.model.interface import ForwardItem

    model = load_family(write_random_family(family, tmp_path, seed=6))
    prompt = np.random.default_rng(6).integers(3, 60, 23)

    def run() -> list[np.ndarray]:
        long, short = model.new_cache(), model.new_cache()
        first = model.forward([ForwardItem(prompt, long, all_logits=True), ForwardItem(prompt[:3], short, True)])
        return first.logits + model.forward([ForwardItem(prompt[:1], long)]).logits  # the state after the prompt

    monkeypatch.setattr(routing_module, "PREFILL_CHUNK_TOKENS", 5)
    chunked = run()
    monkeypatch.setattr(routing_module, "PREFILL_CHUNK_TOKENS", 1 << 20)
    whole = run()
    V = model.config.vocab_size
    assert [a.shape for a in chunked] == [a.shape for a in whole] == [(23, V), (3, V), (1, V)]
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
