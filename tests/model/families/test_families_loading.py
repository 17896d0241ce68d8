"""Loading family checkpoints: dispatch on model_type, clear errors, bf16 and fused-expert layouts, the engine's
generate loop, and a runtime that needs neither torch nor transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _hf_tiny import FAMILIES, build_tiny, hf_logits, prompt
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import CheckpointError, ConfigError
from k3serve.model.families import (SUPPORTED_MODEL_TYPES, is_family_checkpoint, load_family,
                                    read_family_config)
from k3serve.weights.safetensors_io import SafetensorsIndex, save_safetensors

TOLERANCE = 2e-4  # as in test_families_parity.py


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def _rewrite_tensors(folder: Path, edit) -> None:
    """Rewrite the checkpoint's single safetensors file through `edit(dict name -> array) -> dict`."""
    (file,) = folder.glob("*.safetensors")
    with SafetensorsIndex.open(file) as index:
        tensors = {name: index.read(name) for name in index.names()}
    save_safetensors(file, edit(tensors))


def test_supported_model_types_include_every_family_and_kimi_k2():
    assert set(FAMILIES) | {"kimi_k2"} == set(SUPPORTED_MODEL_TYPES)


def test_unsupported_model_type_lists_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError) as info:
        load_family(tmp_path)
    message = str(info.value)
    assert "'llama'" in message and all(t in message for t in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("family, key", [("qwen3_moe", "num_key_value_heads"), ("deepseek_v3", "kv_lora_rank"),
                                         ("qwen3_next", "linear_num_value_heads"), ("kimi_linear", "topk_group")])
def test_missing_config_key_is_an_error_naming_it(family, key, tiny_hf, tmp_path):
    folder = _copy(tiny_hf(family)[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=key):
        load_family(folder)


def test_unsupported_setting_is_refused(tiny_hf, tmp_path):
    folder = _copy(tiny_hf("qwen3_moe")[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        load_family(folder)


def test_missing_trunk_tensor_is_an_error_naming_it(tiny_hf, tmp_path):
    folder = _copy(tiny_hf("qwen3_next")[1], tmp_path)
    name = "model.layers.1.linear_attn.in_proj_ba.weight"
    _rewrite_tensors(folder, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_family(folder)


def test_missing_expert_is_reported_when_first_used(tiny_hf, tmp_path):
    """Experts are read lazily, so a missing one is found when a token is routed to it, by name."""
    folder = _copy(tiny_hf("qwen3_moe")[1], tmp_path)
    _rewrite_tensors(folder, lambda t: {k: v for k, v in t.items() if ".experts." not in k})
    model = load_family(folder)
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.gate_proj"):
        model.logits(prompt(5))


def test_unknown_expert_precision_lists_choices(tiny_hf):
    with pytest.raises(ConfigError, match="mxfp4"):
        load_family(tiny_hf("qwen3_moe")[1], expert_precision="fp8")


def test_family_checkpoints_are_told_apart_from_k3(tiny_hf, tiny_dir):
    assert is_family_checkpoint(tiny_hf("deepseek_v3")[1])
    assert not is_family_checkpoint(tiny_dir)
    config = read_family_config(tiny_hf("kimi_linear")[1])
    assert config.layer_map == "kKMKM" and config.model_type == "kimi_linear"


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_matches_transformers_on_the_same_weights(family, tmp_path, parity_report):
    """Released checkpoints are bf16: read the header's dtype and widen exactly; the fp32 reference is the same
    model with its weights rounded to bf16."""
    hf = build_tiny(family, tmp_path, bf16=True)
    (file,) = tmp_path.glob("*.safetensors")
    with SafetensorsIndex.open(file) as index:
        assert index.info("model.embed_tokens.weight").dtype == "BF16"
    ids = prompt(29)
    error = float(np.max(np.abs(load_family(tmp_path, chunk_size=16).logits(ids) - hf_logits(hf, ids))))
    parity_report.setdefault(family, {})["bf16_checkpoint_max_abs_error"] = error
    assert error <= TOLERANCE


def test_tied_embeddings_without_lm_head(tmp_path):
    hf = build_tiny("qwen3_moe", tmp_path, tie_word_embeddings=True)
    with SafetensorsIndex.open(next(tmp_path.glob("*.safetensors"))) as index:
        assert "lm_head.weight" not in index
    ids = prompt(17)
    assert float(np.max(np.abs(load_family(tmp_path).logits(ids) - hf_logits(hf, ids)))) <= TOLERANCE


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_moe"])
def test_fused_expert_layout_gives_the_same_logits(family, tiny_hf, tmp_path):
    """transformers' in-memory layout ([E, 2I, H] gate_up and [E, H, I] down per layer) reads the same experts."""
    source = tiny_hf(family)[1]
    folder = _copy(source, tmp_path)
    gate, up, down = ("w1", "w3", "w2") if family == "kimi_linear" else ("gate_proj", "up_proj", "down_proj")

    def fuse(tensors: dict) -> dict:
        tensors = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()}
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        prefixes = sorted({k.split("experts.")[0] for k in tensors if ".experts." in k})
        for p in prefixes:
            count = len({k for k in tensors if k.startswith(f"{p}experts.") and k.endswith(f".{gate}.weight")})
            out[f"{p}experts.gate_up_proj"] = np.stack(
                [np.concatenate([tensors[f"{p}experts.{e}.{gate}.weight"], tensors[f"{p}experts.{e}.{up}.weight"]])
                 for e in range(count)])
            out[f"{p}experts.down_proj"] = np.stack([tensors[f"{p}experts.{e}.{down}.weight"] for e in range(count)])
        return out

    _rewrite_tensors(folder, fuse)
    ids = prompt(21)
    fused = load_family(folder).logits(ids)
    assert np.array_equal(fused, load_family(source).logits(ids))


def test_engine_generate_runs_a_family_model(tiny_hf):
    model = load_family(tiny_hf("qwen3_next")[1])
    ids = prompt(11)
    tokens, report = generate(model, ids, SamplingParams(max_tokens=9), stop_ids=())
    assert tokens == model.greedy(ids, 9)
    assert report.generated_tokens == 9 and report.finish_reason == "length"


def test_load_model_gives_a_small_family_model_one_blas_thread(tiny_hf):
    # numpy's multi-threaded BLAS between the numba expert kernels made a Qwen3-MoE decode 15x slower
    # (docs/BENCHMARKS.md, families against llama.cpp); load_model limits it as it does for K3
    from threadpoolctl import threadpool_info, threadpool_limits

    from k3serve.loading import load_model

    with threadpool_limits(limits=2, user_api="blas"):
        load_model(tiny_hf("qwen3_moe")[1])
        assert [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"] in ([1], [1, 1])


def test_the_loader_warms_dense_experts_for_a_family_and_the_delta_rule_for_recurrent_models(tiny_hf, tiny_dir,
                                                                                               monkeypatch):
    import k3serve.loading as loading

    warmed: list[bool] = []
    recurrences: list[int] = []
    monkeypatch.setattr(loading, "warmup_kernels", warmed.append)
    monkeypatch.setattr(loading.delta_rule, "warmup", lambda: recurrences.append(len(warmed)))
    loading._load_kernels.cache_clear()
    try:
        loading.load_model(tiny_dir)  # K3: KDA layers
        loading.load_model(tiny_hf("qwen3_moe")[1])  # attention only
    finally:
        loading._load_kernels.cache_clear()
    assert warmed == [False, True]
    assert recurrences == [1]  # the delta rule warmed for K3 alone


def test_runtime_needs_neither_torch_nor_transformers(tiny_hf):
    """A fresh interpreter in which importing torch or transformers fails loads and runs every family."""
    folders = {family: str(tiny_hf(family)[1]) for family in FAMILIES}
    expected = {family: load_family(folder).greedy(prompt(9), 4) for family, folder in folders.items()}
    script = (
        "import sys, json\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from k3serve.model.families import load_family\n"
        f"folders, ids = {folders!r}, {prompt(9)!r}\n"
        "print(json.dumps({f: load_family(d).greedy(ids, 4) for f, d in folders.items()}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def _released_kimi_linear(config: dict) -> dict:
    types, mlp = config.pop("layer_types"), config.pop("mlp_layer_types")
    config["linear_attn_config"] = {
        "num_heads": config.pop("linear_num_heads"), "head_dim": config.pop("linear_head_dim"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
        "full_attn_layers": [l + 1 for l, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [l + 1 for l, t in enumerate(types) if t == "linear_attention"]}
    config["first_k_dense_replace"] = mlp.index("sparse")
    config.update(mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1)
    return config


def _released_deepseek_v3(config: dict) -> dict:
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    del config["rope_interleave"]  # absent from released DeepSeek-V3 / Kimi K2 configs
    config.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    return config


def _released_qwen3_next(config: dict) -> dict:
    del config["layer_types"]
    config["full_attention_interval"] = 3
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                  rope_scaling=None)
    return config


def _released_qwen3_moe(config: dict) -> dict:
    config["num_experts"] = config.pop("num_local_experts")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    return config


@pytest.mark.parametrize("family, released", [("kimi_linear", _released_kimi_linear),
                                              ("deepseek_v3", _released_deepseek_v3),
                                              ("qwen3_next", _released_qwen3_next),
                                              ("qwen3_moe", _released_qwen3_moe)])
def test_released_config_spellings_load_the_same_model(family, released, tiny_hf, tmp_path):
    """Released checkpoints spell some settings differently from what transformers' save_pretrained writes."""
    source = tiny_hf(family)[1]
    folder = _copy(source, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(released(config)))
    ids = prompt(19)
    original = load_family(source)
    assert read_family_config(folder).layer_map == original.config.layer_map
    assert np.array_equal(load_family(folder).logits(ids), original.logits(ids))


def test_nested_k3_config_is_not_taken_for_kimi_linear(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3",
                                                      "text_config": {"model_type": "kimi_linear"}}))
    assert not is_family_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "text_config": {}}))
    with pytest.raises(ConfigError, match="text_config"):
        load_family(tmp_path)


def test_bf16_tensors_are_read_as_stored_bits(tmp_path):
    """`TensorReader.values` returns a BF16 tensor's stored bits without widening it first (a real-width lm_head
    peaked the load at 6x its size), the same bits `keep_bf16` gives on the widened values; F32 values that are not
    bf16 stay float32; a shape the config does not imply is an error naming both shapes."""
    from k3serve.model.families.tensors import TensorReader
    from k3serve.model.weights import keep_bf16

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, size=(6, 64), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no random NaN (the writer may quieten its payload) or inf
    bits[0, :3] = (0x7FC1, 0xFF80, 0x0001)  # a NaN payload, -inf, a denormal
    exact = (bits.astype(np.uint32) << 16).view(np.float32)
    other = rng.standard_normal((6, 64)).astype(np.float32)
    save_safetensors(tmp_path / "model.safetensors", {"a": exact, "b": other}, dtypes={"a": "BF16"})
    reader = TensorReader.open(tmp_path, "qwen3_moe")
    got = reader.values("a", shape=(6, 64))
    assert got.dtype == np.uint16 and got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, bits)
    np.testing.assert_array_equal(got, keep_bf16(reader.f32("a", shape=(6, 64))))
    assert reader.values("b", shape=(6, 64)).dtype == np.float32
    with pytest.raises(CheckpointError, match=r"shape \[6, 64\], the config implies \[64, 6\]"):
        reader.values("a", shape=(64, 6))
    reader.close()
