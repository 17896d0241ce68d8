"""The config reader: both layouts, and a clear rejection of every missing key and bad value."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from k3serve.config import _KEYS, K3Config, full_k3_config, load_config, tiny_config
from k3serve.errors import ConfigError


def test_nested_and_flat_forms_read_back_identically():
    config = tiny_config()
    assert K3Config.from_dict(config.to_dict(nested=True)) == config
    assert K3Config.from_dict(config.to_dict(nested=False)) == config


def test_nested_form_looks_in_text_config_then_linear_attn_config_then_root():
    raw = tiny_config().to_dict(nested=True)
    # a key moved from text_config to the root is still found
    raw["rms_norm_eps"] = raw["text_config"].pop("rms_norm_eps")
    assert K3Config.from_dict(raw).rms_norm_eps == pytest.approx(1e-5)
    # text_config wins over the root
    raw["text_config"]["vocab_size"] = 256
    raw["vocab_size"] = 999
    assert K3Config.from_dict(raw).vocab_size == 256


def test_tiny_layer_map_and_full_sizes():
    assert tiny_config().layer_map == "KKKMKKKMKKKMM"
    full = full_k3_config()
    assert full.expert_bytes == 17_547_264  # K3_SPEC section 1
    assert len(full.mla_layer_ids) == 24 and len(full.kda_layer_ids) == 69
    counts = full.num_parameters()
    assert abs(counts["total"] - 2.78e12) / 2.78e12 < 0.005
    assert counts["experts"] == 92 * 896 * 33_030_144


@pytest.mark.parametrize("field,nested_key,flat_key", _KEYS)
@pytest.mark.parametrize("nested", [True, False])
def test_each_missing_key_is_an_error_naming_it(field, nested_key, flat_key, nested):
    raw = tiny_config().to_dict(nested=nested)
    key = nested_key if nested else flat_key
    for scope in (raw, raw.get("text_config", {}), raw.get("text_config", {}).get("linear_attn_config", {})):
        scope.pop(key, None)
    with pytest.raises(ConfigError, match=f"missing required key '{key}'"):
        K3Config.from_dict(raw)


def _flat_with(**changes):
    raw = tiny_config().to_dict(nested=False)
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,message", [
    ({"full_attn_layers": [0, 4, 8, 12, 13]}, "out of range"),
    ({"full_attn_layers": [4, 8, 12, 14]}, "out of range"),
    ({"full_attn_layers": [4, 8, 12]}, "neither"),
    ({"kda_layers": [1, 2, 3, 4, 5, 6, 7, 9, 10, 11]}, "both"),
    ({"full_attn_layers": [4, 4, 8, 12, 13]}, "twice"),
    ({"num_experts_per_token": 9}, "exceeds num_experts"),
    ({"routed_expert_hidden_size": 48}, "multiple of the MXFP4 group size"),
    ({"moe_intermediate_size": 100}, "multiple of the MXFP4 group size"),
    ({"moe_router_activation_func": "softmax"}, "sigmoid"),
    ({"num_expert_group": 2}, "grouped routing"),
    ({"hidden_size": "128"}, "must be an integer"),
    ({"rms_norm_eps": float("nan")}, "finite"),
    ({"mla_use_output_gate": 1}, "true or false"),
    ({"eos_token_id": 300}, "outside the vocabulary"),
    ({"quantization_config": {"format": "int4", "group_size": 32}}, "not supported"),
])
def test_bad_values_are_rejected_with_a_message(changes, message):
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(_flat_with(**changes))


def test_load_config_errors_on_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_cli_rejection_exits_nonzero_with_message(tmp_path):
    raw = copy.deepcopy(tiny_config().to_dict(nested=True))
    del raw["text_config"]["linear_attn_config"]["full_attn_layers"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = subprocess.run([sys.executable, "-m", "k3serve.cli", "info", "--model", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "full_attn_layers" in result.stderr


# ---- the released keys other engines read (K3_SPEC section 2; llama.cpp's converter needs them) ----------------
def test_written_configs_carry_the_released_interop_keys(tmp_path):
    from k3serve.weights.synthetic import write_random_checkpoint

    write_random_checkpoint(tiny_config(), tmp_path, seed=0)  # what make-tiny and the training export write
    raw = json.loads((tmp_path / "config.json").read_text())
    text = raw["text_config"]
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert text["hidden_act"] == "situ" and text["mla_use_nope"] is True
    assert text["num_key_value_heads"] == text["num_attention_heads"]
    assert text["max_position_embeddings"] == tiny_config().max_position_embeddings
    assert load_config(tmp_path) == tiny_config()


def test_configs_without_the_interop_keys_still_read():
    old = tiny_config().to_dict(interop=False)
    assert "hidden_act" not in old["text_config"] and old["architectures"] == ["KimiK3ForCausalLM"]
    assert K3Config.from_dict(old) == tiny_config()
    released = tiny_config().to_dict()
    released["text_config"]["max_position_embeddings"] = 262144
    assert K3Config.from_dict(released).max_position_embeddings == 262144


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "silu", "hidden_act.*situ"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("max_position_embeddings", 0, "max_position_embeddings"),
])
def test_interop_keys_that_contradict_k3_are_refused(key, value, message):
    raw = tiny_config().to_dict()
    raw["text_config"][key] = value
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(raw)


def test_widening_writes_the_released_keys(tmp_path):
    from k3serve.weights.synthetic import write_random_checkpoint
    from k3serve.weights.widen import widen_experts

    src = tmp_path / "src"
    old = tiny_config()
    write_random_checkpoint(old, src, seed=0)
    raw = json.loads((src / "config.json").read_text())
    for key in ("hidden_act", "mla_use_nope", "num_key_value_heads", "max_position_embeddings"):
        del raw["text_config"][key]  # a checkpoint written before the keys existed
    (src / "config.json").write_text(json.dumps(raw))
    widen_experts(src, tmp_path / "wide", inner=2)
    wide = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert wide["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert wide["text_config"]["hidden_act"] == "situ"
    assert wide["text_config"]["moe_intermediate_size"] == 2 * old.moe_intermediate_size
