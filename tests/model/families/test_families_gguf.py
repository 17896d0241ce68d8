"""GGUF input of the families: a tiny checkpoint converted to GGUF (llama.cpp's names and metadata, written with
gguf.GGUFWriter in _gguf_writer.py) computes the same logits and greedy tokens as the safetensors checkpoint
holding the same values; bad files are clear CheckpointErrors.

Each tiny model here uses settings a GGUF can state (see gguf_families.py): Qwen3-MoE without dense layers,
DeepSeek-V3 with mscale == mscale_all_dim, Kimi Linear with one routing group.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from _gguf_writer import dequantized, hf_keeps_f32, write_gguf
from _hf_tiny import FAMILIES, build_tiny, prompt
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import CheckpointError, ConfigError
from k3serve.loading import load_model
from k3serve.model import kernels
from k3serve.model.families import load_family, read_family_config
from k3serve.model.families.experts import Int8Matrix, QuantizedExpert
from k3serve.model.families.delta import KimiDeltaAttention
from k3serve.model.families.latent_attention import LatentAttention, absorb_heads, heads_values
from k3serve.model.families.loading import load_family_gguf
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.q8_0 import dequantize_q8_0
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.weights.safetensors_io import SafetensorsIndex

GGUF_SETTINGS = {
    "qwen3_moe": dict(mlp_only_layers=[]),
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "original_max_position_embeddings": 64}),
    "kimi_linear": dict(n_group=1, topk_group=1),
    "qwen3_next": {},
}


@pytest.fixture(scope="module")
def gguf_tiny(tmp_path_factory):
    """(family, bf16) -> checkpoint folder of a tiny model a GGUF can describe, built once."""
    built: dict = {}

    def get(family: str, bf16: bool = False) -> Path:
        if (family, bf16) not in built:
            folder = tmp_path_factory.mktemp(f"gguf-{family}-{'bf16' if bf16 else 'f32'}")
            build_tiny(family, folder, bf16=bf16, **GGUF_SETTINGS[family])
            built[family, bf16] = folder
        return built[family, bf16]

    return get


# KDA and gated DeltaNet decays are stored as -exp(A_log) and read back as log(-a): exp(log(a)) may differ from
# a by one rounding, so those two families agree to rounding, the others bit for bit
ROUNDED = {"kimi_linear", "qwen3_next"}


def assert_same(family: str, a: np.ndarray, b: np.ndarray) -> None:
    if family in ROUNDED:
        assert float(np.max(np.abs(a - b))) <= 1e-5 * float(np.max(np.abs(b))), family
    else:
        assert np.array_equal(a, b), family


def _greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    out = list(ids)
    for _ in range(num_tokens):
        out.append(int(np.argmax(model.logits(out)[-1])))
    return out[len(ids):]


def _share_trunk(source, twin) -> int:
    """Give `twin` the Q8_0 trunk matrices `source` holds (the same `QuantizedMatrix` objects, attribute by
    attribute), so that both multiply the trunk with the same Q8_0 x Q8_0 kernel; returns how many."""
    count = 0

    def visit(a, b, depth: int) -> None:
        nonlocal count
        if depth > 3 or not hasattr(a, "__dict__"):
            return
        for name, value in vars(a).items():
            if isinstance(value, QuantizedMatrix):
                object.__setattr__(b, name, value)
                count += 1
            elif not isinstance(value, (np.ndarray, int, float, str, bool, type(None))) and hasattr(b, name):
                visit(value, getattr(b, name), depth + 1)

    for a, b in zip(source.layers, twin.layers):
        visit(a, b, 0)
    if isinstance(source.lm_head, QuantizedMatrix):
        twin.lm_head = source.lm_head
        count += 1
    return count


def _twin(folder: Path, out: Path, tensor_type: str) -> Path:
    """A copy of the checkpoint whose every tensor holds the values it has once stored at `tensor_type`."""
    out.mkdir()
    config = read_family_config(folder)
    index = SafetensorsIndex.open(folder)
    tensors = {}
    for name in index:
        array = np.asarray(index.read(name), dtype=np.float32)
        expert = ".experts." in name and "shared" not in name
        if name.endswith("kv_b_proj.weight"):  # stored as k_b [NA, KL, DN] (transposed) and v_b [NA, DV, KL]
            NA, DN = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = array.reshape(NA, -1, array.shape[1])
            k_b = dequantized(np.ascontiguousarray(kv_b[:, :DN].transpose(0, 2, 1)), tensor_type, False)
            v_b = dequantized(np.ascontiguousarray(kv_b[:, DN:]), tensor_type, False)
            tensors[name] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(array.shape)
            continue
        tensors[name] = dequantized(array, tensor_type, expert, hf_keeps_f32(name, array.ndim))
    index.close()
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            (out / name).write_bytes((folder / name).read_bytes())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_equals_the_safetensors_checkpoint(family, gguf_tiny, tmp_path):
    folder = gguf_tiny(family)
    gguf_model = load_family_gguf(write_gguf(folder, tmp_path / "m.gguf"))
    reference = load_family(folder)
    ids = prompt(12)
    assert_same(family, gguf_model.logits(ids), reference.logits(ids))
    assert _greedy(gguf_model, ids, 6) == _greedy(reference, ids, 6)
    assert gguf_model.config.layer_map == reference.config.layer_map


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_gguf_equals_the_bf16_checkpoint(family, gguf_tiny, tmp_path):
    folder = gguf_tiny(family, bf16=True)
    gguf_model = load_family_gguf(write_gguf(folder, tmp_path / "m.gguf", "BF16"))
    ids = prompt(9, seed=3)
    assert_same(family, gguf_model.logits(ids), load_family(folder).logits(ids))


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_linear"])
@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
def test_f16_and_q8_0_gguf_equal_a_checkpoint_of_their_values(family, tensor_type, gguf_tiny, tmp_path,
                                                              monkeypatch):
    folder = gguf_tiny(family)
    gguf_model = load_family_gguf(write_gguf(folder, tmp_path / "m.gguf", tensor_type))
    twin = load_family(_twin(folder, tmp_path / "twin", tensor_type))
    ids = prompt(10, seed=5)
    logits, expected = gguf_model.logits(ids), twin.logits(ids)
    if tensor_type == "Q8_0":
        # the trunk stays Q8_0 (multiplied with activations quantized as llama.cpp does): the twin gets the same
        # matrices, so what is compared is everything else
        assert _share_trunk(gguf_model, twin) >= 2 * len(twin.layers)
        by_default = gguf_model.logits(ids)  # the experts on Q8_0 activations too (kernels.q8_0_experts_run)
        monkeypatch.setattr(kernels, "INT8_ACTIVATIONS", "f32")
        logits, expected = gguf_model.logits(ids), twin.logits(ids)
        # Q8_0 experts are kept as stored (int8 values, one scale per 32-value block) and, on float activations,
        # each block's dot is scaled before the sum, so they equal the twin's float32 experts to summation order
        experts = gguf_model.experts.loaded()
        assert experts and all(isinstance(e, QuantizedExpert) and isinstance(e.down, Int8Matrix)
                               and e.down.scales.shape == (e.down.values.shape[0], e.down.values.shape[1] // 32)
                               for e in experts.values())
        assert float(np.max(np.abs(logits - expected))) <= 1e-5 * float(np.max(np.abs(expected)))
        assert _greedy(gguf_model, ids, 6) == _greedy(twin, ids, 6)
        # by default the same experts multiply Q8_0 activations, as llama.cpp does: other numbers, close ones
        assert not np.array_equal(by_default, logits)
        assert float(np.sqrt(np.mean((by_default - logits) ** 2) / np.mean(logits ** 2))) < 0.06  # measured 0.012-0.020
    else:
        assert_same(family, logits, expected)
    # and the storage really changed the numbers (the test would be empty otherwise)
    assert not np.array_equal(twin.logits(ids), load_family(folder).logits(ids))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_mxfp4_experts_stay_packed_and_equal_our_own_mxfp4(family, gguf_tiny, tmp_path):
    folder = gguf_tiny(family)
    path = write_gguf(folder, tmp_path / "m.gguf", "MXFP4")
    twin_folder = _twin(folder, tmp_path / "twin", "MXFP4")
    ids = prompt(10, seed=6)
    gguf_model = load_family_gguf(path)
    logits = gguf_model.logits(ids)
    experts = gguf_model.experts.loaded()
    assert experts and all(isinstance(e, QuantizedExpert) for e in experts.values())
    # the blocks converted without floats equal our own encoding of the same values, so the logits are equal
    assert np.array_equal(logits, load_family(twin_folder, expert_precision="mxfp4").logits(ids))
    # and close to the float evaluation of those values (the MXFP4 kernel sums in another order)
    native = load_family(twin_folder).logits(ids)
    assert float(np.max(np.abs(logits - native))) < 1e-4 * max(1.0, float(np.max(np.abs(native))))


def test_mxfp4_block_conversion_matches_the_gguf_package(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q, quants

    values = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32) * 3
    values[0, 0, :32] = 0  # an all-zero block
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "qwen3moe")
    blocks = quants.quantize(values, Q.MXFP4)
    writer.add_tensor("x", blocks, raw_dtype=Q.MXFP4)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "x.gguf")
    expected = quants.dequantize(blocks, Q.MXFP4).reshape(values.shape)
    assert np.array_equal(file.f32("x"), expected)
    assert np.array_equal(file.f32("x", 2), expected[2])


def test_int8_precision_requantizes_gguf_mxfp4_experts(gguf_tiny, tmp_path):
    folder = gguf_tiny("qwen3_moe")
    model = load_family_gguf(write_gguf(folder, tmp_path / "m.gguf", "MXFP4"), expert_precision="int8")
    twin = load_family(_twin(folder, tmp_path / "twin", "MXFP4"), expert_precision="int8")
    ids = prompt(8)
    assert np.array_equal(model.logits(ids), twin.logits(ids))


def test_q8_0_experts_take_the_files_bytes_and_requantize_at_int8_and_mxfp4(gguf_tiny, tmp_path):
    """native keeps Q8_0's int8 values and per-block scales as the file stores them (float16: 1 + 2/32 bytes a
    weight, the file's 34 bytes per 32, not float32's 4); int8 and mxfp4 requantize the block values exactly as they
    quantize a checkpoint holding them."""
    folder = gguf_tiny("qwen3_moe")
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    twin_folder = _twin(folder, tmp_path / "twin", "Q8_0")
    ids = prompt(8, seed=2)
    native = load_family_gguf(path)
    native.logits(ids)
    experts = native.experts.loaded().values()
    weights = sum(m.values.size for e in experts for m in (e.gate_up, e.down))
    assert all(m.scales.dtype == np.float16 for e in experts for m in (e.gate_up, e.down))
    assert sum(e.nbytes for e in experts) == weights * (1 + 2 / 32)
    for precision in ("int8", "mxfp4"):
        model = load_family_gguf(path, expert_precision=precision)
        twin = load_family(twin_folder, expert_precision=precision)
        assert _share_trunk(model, twin) > 0  # the same Q8_0 trunk (the file's blocks); experts requantized alike
        assert np.array_equal(model.logits(ids), twin.logits(ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_trunk_is_held_as_the_files_blocks(family, gguf_tiny, tmp_path, monkeypatch):
    """A Q8_0 file's trunk matrices stay Q8_0 in RAM (the file's blocks, 34 bytes per 32 weights), as llama.cpp
    holds them, instead of widening to float32; logits stay close to the float twin's (the experts on float
    activations here, so that the error measured is the trunk's)."""
    monkeypatch.setattr(kernels, "INT8_ACTIVATIONS", "f32")
    folder = gguf_tiny(family)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    model = load_family_gguf(path)
    twin = load_family(_twin(folder, tmp_path / "twin", "Q8_0"))
    held = []

    def collect(obj, depth: int) -> None:
        if depth <= 3 and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                if isinstance(value, QuantizedMatrix):
                    held.append(value)
                elif not isinstance(value, (np.ndarray, int, float, str, bool, type(None))):
                    collect(value, depth + 1)

    for layer in model.layers:
        collect(layer, 0)
    assert len(held) >= len(model.layers) and all(m.precision == "q8_0" for m in held)
    assert all(m.nbytes == m.shape[0] * m.shape[1] // 32 * 34 for m in held)
    assert isinstance(model.embed, QuantizedMatrix) and model.embed.precision == "q8_0"  # not widened to float32
    ids = prompt(10, seed=7)
    logits, expected = model.logits(ids), twin.logits(ids)
    assert np.all(np.isfinite(logits)) and not np.array_equal(logits, expected)  # activations quantized
    error = float(np.sqrt(np.mean((logits - expected) ** 2) / np.mean(expected ** 2)))
    assert error < 0.25  # measured 0.015-0.13 (kimi_linear's random routers amplify most)


def _mla_mixers(model) -> list:
    return [layer.mixer for layer in model.layers if isinstance(layer.mixer, LatentAttention)]


def _engine_tokens(model, prompts, num_tokens: int) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=16), stop_ids=())
    ids = [engine.add_request(p, SamplingParams(max_tokens=num_tokens, ignore_eos=True)) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[i] for i in ids]


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
def test_q8_0_mla_heads_stay_the_files_blocks(family, tmp_path):
    """attn_k_b / attn_v_b stored as Q8_0 (head dims of whole 32-blocks) stay the file's blocks, per head, as
    llama.cpp holds them (and Kimi Linear's KDA f_b / g_b, 32-wide here, too): W_uk and W_uv multiply Q8_0 activations (`q8_0_heads_matmul`) for every token of a step at
    once, so a sequence's tokens do not depend on its batch; the logits stay close to those of the same model with
    the blocks' values as float32 heads (the float path)."""
    folder = tmp_path / "hf"
    kda = {"linear_head_dim": 32} if family == "kimi_linear" else {}  # KDA's f_b / g_b [P, D]: Q8_0 rows too
    build_tiny(family, folder, qk_nope_head_dim=32, v_head_dim=32, **kda, **GGUF_SETTINGS[family])
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    model = load_family_gguf(path)
    mixers = _mla_mixers(model)
    assert mixers
    deltas = [layer.mixer for layer in model.layers if isinstance(layer.mixer, KimiDeltaAttention)]
    assert len(deltas) == (len(model.layers) - len(mixers) if kda else 0)
    assert all(isinstance(d.weights.f_b, QuantizedMatrix) and isinstance(d.weights.g_b, QuantizedMatrix)
               and d.weights.f_b.shape == (d.num_heads * d.head_dim, d.head_dim) for d in deltas)
    file = GGUFFile(path)
    try:
        for mixer in mixers:
            NA, KL, DN, DV = mixer.num_heads, mixer.kv_lora_rank, mixer.nope_dim, mixer.value_dim
            w_uk, w_uv = mixer.weights.w_uk, mixer.weights.w_uv
            assert isinstance(w_uk, QuantizedMatrix) and isinstance(w_uv, QuantizedMatrix)
            assert w_uk.shape == (NA * KL, DN) and w_uv.shape == (NA * DV, KL)
            for held, name in ((w_uk, "attn_k_b"), (w_uv, "attn_v_b")):  # the file's bytes
                stored = np.asarray(file.tensor(f"blk.{mixer.layer}.{name}.weight").data)
                assert np.array_equal(held.data, stored.reshape(held.data.shape))
    finally:
        file.close()
    prompts = [prompt(6, seed=1), prompt(9, seed=2), prompt(4, seed=3)]
    alone = [model.greedy(p, 4) for p in prompts]
    assert _engine_tokens(model, prompts, 4) == alone
    ids = prompt(10, seed=7)
    logits = model.logits(ids)
    rng = np.random.default_rng(0)
    for mixer in mixers:  # the same values as float32 heads: the float path (BLAS a head)
        NA, KL, DN, DV = mixer.num_heads, mixer.kv_lora_rank, mixer.nope_dim, mixer.value_dim
        w = mixer.weights
        mixer.weights = dataclasses.replace(
            w, w_uk=np.ascontiguousarray(dequantize_q8_0(w.w_uk.data).reshape(NA, KL, DN).transpose(0, 2, 1)),
            w_uv=dequantize_q8_0(w.w_uv.data).reshape(NA, DV, KL))
        q_nope, latent = rng.standard_normal((5, NA, DN), np.float32), rng.standard_normal((NA, 5, KL), np.float32)
        for got, want in ((absorb_heads(q_nope, w.w_uk), absorb_heads(q_nope, mixer.weights.w_uk)),
                          (heads_values(latent, w.w_uv), heads_values(latent, mixer.weights.w_uv))):
            assert got.shape == want.shape  # one product: only the activations' Q8_0 rounding (~0.5%)
            assert float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))) < 0.02
    floats = model.logits(ids)
    assert not np.array_equal(logits, floats)
    error = float(np.sqrt(np.mean((logits - floats) ** 2) / np.mean(floats ** 2)))
    assert error < 0.25, error  # measured 0.099 (DeepSeek-V3), 0.018 (Kimi Linear): random weights amplify it


def test_load_model_opens_a_gguf_file(gguf_tiny, tmp_path):
    folder = gguf_tiny("qwen3_moe")
    loaded = load_model(write_gguf(folder, tmp_path / "m.gguf"))
    ids = prompt(6)
    assert np.array_equal(loaded.model.logits(ids), load_family(folder).logits(ids))
    assert loaded.tokenizer is None  # this file has no tokenizer metadata


# ---- bad files -------------------------------------------------------------------------------------------------

def test_unsupported_architecture_is_named(gguf_tiny, tmp_path):
    path = write_gguf(gguf_tiny("qwen3_moe"), tmp_path / "m.gguf")
    data = path.read_bytes().replace(b"qwen3moe", b"llama3xx", 1)  # general.architecture, same length
    (tmp_path / "llama.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match="architecture 'llama3xx' is not supported"):
        load_model(tmp_path / "llama.gguf")


def test_missing_tensor_is_named(gguf_tiny, tmp_path):
    path = write_gguf(gguf_tiny("deepseek_v3"), tmp_path / "m.gguf", skip=("blk.1.attn_q_b.weight",))
    with pytest.raises(CheckpointError, match="q_b_proj"):
        load_family_gguf(path)


def test_unsupported_tensor_type_is_named(gguf_tiny, tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q

    path = write_gguf(gguf_tiny("qwen3_moe"), tmp_path / "m.gguf", skip=("output_norm.weight",))
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "q4.gguf"), "qwen3moe")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            value = field.contents()
            if isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    # 64 values as two Q4_0 blocks of 18 bytes (f16 scale + 16 bytes of nibbles)
    writer.add_tensor("output_norm.weight", np.zeros(36, np.uint8), raw_dtype=Q.Q4_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="output_norm.weight.*type Q4_0"):
        load_family_gguf(tmp_path / "q4.gguf")


def test_truncated_file_is_refused(gguf_tiny, tmp_path):
    path = write_gguf(gguf_tiny("qwen3_moe"), tmp_path / "m.gguf")
    data = path.read_bytes()
    for cut in (len(data) - 100, 200, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|not a readable GGUF"):
            load_model(tmp_path / "cut.gguf")


def test_gguf_without_the_gguf_package_says_what_to_install(gguf_tiny, tmp_path, monkeypatch):
    import sys

    path = write_gguf(gguf_tiny("qwen3_moe"), tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(CheckpointError, match="pip install"):
        load_model(path)


def test_kimi_linear_gguf_config_says_what_llama_cpp_assumes(gguf_tiny, tmp_path):
    config = load_family_gguf(write_gguf(gguf_tiny("kimi_linear"), tmp_path / "m.gguf")).config
    assert (config.num_expert_group, config.topk_group, config.norm_topk_prob) == (1, 1, True)
    assert json.dumps(config.layer_map)


def _held_quantized(model) -> dict[str, QuantizedMatrix]:
    """Every Q8_0 / MXFP4 matrix the model holds, by attribute path (layers, embedding, lm_head)."""
    held: dict[str, QuantizedMatrix] = {}

    def collect(obj, path: str, depth: int) -> None:
        if depth <= 3 and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if isinstance(value, QuantizedMatrix):
                    held[f"{path}.{name}"] = value
                elif not isinstance(value, (np.ndarray, int, float, str, bool, type(None))):
                    collect(value, f"{path}.{name}", depth + 1)

    for index, layer in enumerate(model.layers):
        collect(layer, f"layers.{index}", 0)
    for name in ("embed", "lm_head"):
        if isinstance(getattr(model, name), QuantizedMatrix):
            held[name] = getattr(model, name)
    return held


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trunk_quantized_at_load_holds_llama_cpps_q8_0_bytes(family, gguf_tiny, tmp_path):
    """`load_family(folder, trunk_precision="q8_0")` (`generate --trunk-precision q8_0`): every trunk matrix, the
    embedding and the lm_head held as the very Q8_0 blocks llama.cpp's quantizer (gguf.quants) writes into a Q8_0
    file of the same checkpoint; logits stay close to the unquantized model's."""
    folder = gguf_tiny(family)
    quantized = load_family(folder, trunk_precision="q8_0")
    from_file = _held_quantized(load_family_gguf(write_gguf(folder, tmp_path / "m.gguf", "Q8_0")))
    held = _held_quantized(quantized)
    assert {"embed", "lm_head"} <= set(held) and len(held) >= 2 * len(quantized.layers) + 2
    assert all(m.precision == "q8_0" for m in held.values())
    for path, matrix in from_file.items():
        assert path in held and np.array_equal(held[path].data, matrix.data), (family, path)
    ids = prompt(10, seed=7)
    logits, expected = quantized.logits(ids), load_family(folder).logits(ids)
    error = float(np.sqrt(np.mean((logits - expected) ** 2) / np.mean(expected ** 2)))
    assert 0 < error < 0.3, (family, error)  # measured 0.02-0.17 (the tiny random routers flip)
    np.testing.assert_array_equal(quantized.embed.rows(np.array(ids)),
                                  quantized.embed.dequantize()[ids])  # the lookup decodes its rows


def test_qwen3_next_in_proj_is_held_quantized(gguf_tiny, tmp_path):
    """Qwen3-Next's gated DeltaNet in_proj, regrouped from the checkpoint's rows (q, k, v, z and b, a, head by head),
    is held quantized like every other trunk matrix: a Q8_0 file keeps its attn_qkv / attn_gate / ssm_ba blocks
    (the same values, row for row, as the float twin's in_proj), and `trunk_precision="q8_0"` quantizes it to
    those same bytes (it was left bf16 or float32 beside a Q8_0 trunk)."""
    from k3serve.model.families.delta import GatedDeltaNet

    folder = gguf_tiny("qwen3_next")
    from_file = load_family_gguf(write_gguf(folder, tmp_path / "m.gguf", "Q8_0"))
    quantized = load_family(folder, trunk_precision="q8_0")
    twin = load_family(_twin(folder, tmp_path / "twin", "Q8_0"))
    mixers = [(a.mixer, b.mixer, c.mixer) for a, b, c in zip(from_file.layers, quantized.layers, twin.layers)
              if isinstance(a.mixer, GatedDeltaNet)]
    assert mixers
    for file_mixer, quantized_mixer, twin_mixer in mixers:
        held, requantized = file_mixer.weights.in_proj, quantized_mixer.weights.in_proj
        assert isinstance(held, QuantizedMatrix) and held.precision == "q8_0"
        assert np.array_equal(held.dequantize(), twin_mixer.weights.in_proj)
        assert isinstance(requantized, QuantizedMatrix) and np.array_equal(requantized.data, held.data)


@pytest.mark.parametrize("precision", ["mxfp4", "bf16"])
def test_trunk_precision_mxfp4_and_the_native_alias(precision, gguf_tiny):
    folder = gguf_tiny("qwen3_moe", bf16=True)
    model = load_family(folder, trunk_precision=precision)
    held = _held_quantized(model)
    if precision == "bf16":  # an alias of "native": the stored bf16 bits, nothing quantized
        assert not held and model.lm_head.dtype == np.uint16
        assert np.array_equal(model.logits(prompt(6)), load_family(folder).logits(prompt(6)))
    else:
        assert held["lm_head"].precision == "mxfp4" and len(held) >= 2 * len(model.layers) + 2
        assert held["lm_head"].nbytes < 0.3 * model.lm_head.shape[0] * model.lm_head.shape[1] * 2


def test_an_unknown_trunk_precision_is_a_config_error(gguf_tiny):
    with pytest.raises(ConfigError, match="q4_k"):
        load_family(gguf_tiny("qwen3_moe"), trunk_precision="q4_k")
