"""sim/returning.py: the disk tier's checkpoint bytes at any scale, and restore against recompute."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.config import full_k3_config, load_config, tiny_config
from k3serve.default_model import default_model_dir
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.prefix_disk import CheckpointPayload, PrefixDiskTier
from k3serve.model.k3 import k3_cache_layout
from k3serve.sim.full import SimConfig, SimConfigError
from k3serve.sim.presets import resolve_machine
from k3serve.sim.returning import checkpoint_bytes, simulate_returning


def _written_file_bytes(tmp_path, config, position: int, with_logits: bool) -> tuple[int, int]:
    """(the payload length the engine's tier computes, the file it writes) for one checkpoint of `config`."""
    layout = k3_cache_layout(config)
    tier = PrefixDiskTier(tmp_path / f"p{position}-{with_logits}", 1 << 30, layout, "m", "slru", MetricsRegistry())
    rows = np.zeros((len(layout.attention_layers), position, layout.row_width), np.float32)  # [LA, p, W]
    shapes = [layout.recurrent_shapes[layer] for layer in layout.recurrent_layers]
    payload = CheckpointPayload(rows, [np.zeros(s, np.float32) for s, _ in shapes],
                                [np.zeros(t, np.float32) for _, t in shapes],
                                np.zeros(config.vocab_size, np.float32) if with_logits else None)
    tail = tuple(range(position % 16))
    assert tier.write(b"r" * 16, b"p" * 16, tail, position, payload, protected=False)
    (entry,) = tier.group(b"p" * 16).values()
    return tier.payload_length(position, config.vocab_size if with_logits else 0), entry.nbytes


@pytest.mark.parametrize("position", [0, 1, 15, 63, 300])
@pytest.mark.parametrize("with_logits", [False, True])
def test_checkpoint_bytes_match_the_engines_disk_tier_at_the_embedded_config(tmp_path, position, with_logits):
    for config in (load_config(default_model_dir()), tiny_config()):
        payload, file_bytes = _written_file_bytes(tmp_path, config, position, with_logits)
        sized = checkpoint_bytes(config, position, with_logits)
        assert sized.payload_bytes == payload
        assert sized.file_bytes == file_bytes


def test_full_scale_checkpoint_is_the_kda_state_plus_the_mla_latent_per_position():
    c = full_k3_config()
    at_4k = checkpoint_bytes(c, 4096)
    # 69 KDA layers x (S 96 x 128 x 128 + conv tail 3 x 3 x 12,288) float32; 24 MLA layers x 576 per position
    assert at_4k.kda_state_bytes == 4 * 69 * (96 * 128 * 128 + 3 * 3 * 12288) == 464_633_856
    assert at_4k.mla_row_bytes == 4 * 24 * 576 * 4096
    assert checkpoint_bytes(c, 4097).mla_row_bytes - at_4k.mla_row_bytes == 55_296


def test_restore_beats_recompute_and_adds_up_on_a_small_model():
    cfg = SimConfig(machine=resolve_machine("c-engine-v1"), ram_bytes=None, model=tiny_config())
    r = simulate_returning(cfg, 48, new_tokens=2)
    assert r.restore_seconds == pytest.approx(r.read_seconds + r.checksum_seconds + r.new_tokens_seconds)
    assert r.read_seconds > 0 and r.checksum_seconds > 0
    assert r.recompute_seconds > r.new_tokens_seconds  # 50 positions against 2, same machine
    assert r.recompute_steps == 1
    chunked = simulate_returning(cfg, 48, new_tokens=2, prefill_chunk=16)
    assert chunked.recompute_steps == 4  # 50 positions in steps of 16
    with pytest.raises(SimConfigError):
        simulate_returning(cfg, 0)


def test_sim_k3_returning_prompt_prints_and_writes_both_arms(capsys, monkeypatch, tmp_path):
    import json

    import k3serve.sim.returning as returning
    from k3serve.cli.main import main

    seen = {}

    def small(cfg, prompt_tokens, new_tokens=1, **kwargs):  # the full K3's 4,096-position prefill takes minutes
        seen.update(ram=cfg.ram_bytes, machine=cfg.machine.name, prompt=prompt_tokens, new=new_tokens)
        return simulate_returning(SimConfig(machine=cfg.machine, ram_bytes=None, model=tiny_config()), prompt_tokens,
                                  new_tokens, **kwargs)

    monkeypatch.setattr(returning, "simulate_returning", small)
    out_json = tmp_path / "r.json"
    assert main(["sim", "k3", "--machine", "c-engine-v1", "--ram", "8G", "--returning-prompt", "40",
                 "--returning-new-tokens", "3", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert seen == {"ram": 8 << 30, "machine": "c-engine-v1", "prompt": 40, "new": 3}
    assert "restore" in out and "recompute" in out and "less time to first token" in out
    record = json.loads(out_json.read_text())
    assert record["restore_seconds"] < record["recompute_seconds"] and record["prompt_tokens"] == 40
    assert main(["sim", "k3", "--returning-prompt", "40", "--sweep", "ram"]) == 2  # it sets its own prompts
