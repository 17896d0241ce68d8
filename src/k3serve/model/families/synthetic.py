"""Random tiny checkpoints of the families, written without torch: for the lab's family choice, the benchmarks'
`--family`, and anyone who wants to try a family path without downloading a model.

`write_random_family(family, folder)` writes config.json and model.safetensors of a tiny model of `family` in its
Hugging Face tensor names. The names and shapes are not listed here: the family's own builder is run over a reader
that answers every request with a seeded random array of the requested shape (and every expert is read once), and
exactly the tensors it asked for are written, so the folder loads through the same code as a released checkpoint.

Values: matrices N(0, 0.08^2) (transformers' tiny-model initializer range); norm weights 1 + N(0, 0.2^2); routers
x3 and a selection bias N(0, 0.1^2), so that routing is neither uniform nor tied (as in tests/model/families). They
are random weights: the model's tokens mean nothing, only its shapes, routing and state paths are real. The
configs are the test suite's tiny shapes (hidden 64, expert width 32, so MXFP4 applies).

`write_random_checkpoint_streaming(config, folder)` writes any family config, released widths included (the
benchmarks' real-width fixtures, benchmarks/family_fixture.py): the tensor list comes from the family's builder run
over unbacked zeros (`family_tensor_shapes`), the values (bf16, scaled by fan-in) are drawn and written a chunk of
rows at a time, so a 6 GB checkpoint never sits in RAM.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3serve.errors import ConfigError
from k3serve.model.families.experts import ExpertStore
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.loading import family_of
from k3serve.model.families.moe import MoEBlock
from k3serve.model.families.tensors import TensorReader
from k3serve.weights.safetensors_io import save_safetensors

_COMMON = {"attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
           "intermediate_size": 96, "moe_intermediate_size": 32, "tie_word_embeddings": False, "vocab_size": 160}
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}

SYNTHETIC_CONFIGS: dict[str, dict] = {
    # KDA, KDA, MLA, KDA, MLA; layer 0 dense; grouped sigmoid routing with a shared expert
    "kimi_linear": {**_COMMON, "model_type": "kimi_linear", "num_hidden_layers": 5, "num_attention_heads": 4,
                    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
                    "num_expert_group": 2, "topk_group": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
                    "linear_head_dim": 16, "linear_num_heads": 4, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-5,
                    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention",
                                    "full_attention"],
                    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"]},
    # MLA with YaRN rope, grouped routing 4 groups of 4, a dense first layer, a shared expert
    "deepseek_v3": {**_COMMON, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4,
                    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 3, "n_shared_experts": 1,
                    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                    "rope_interleave": True,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                        "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 64}},
    # GQA 4 over 2 heads, softmax routing, layer 1 dense
    "qwen3_moe": {**_COMMON, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 32768, "use_sliding_window": False, "rope_parameters": _ROPE},
    # DeltaNet, DeltaNet, gated attention, DeltaNet; a gated shared expert
    "qwen3_next": {**_COMMON, "model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                   "norm_topk_prob": True, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "linear_key_head_dim": 8, "linear_value_head_dim": 16,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                   "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                   "rope_parameters": {**_ROPE, "partial_rotary_factor": 0.5}},
}
SYNTHETIC_FAMILIES: tuple[str, ...] = tuple(SYNTHETIC_CONFIGS)


class _RandomReader(TensorReader):
    """Answers every tensor request with a seeded random array of the requested shape, and records it."""

    def __init__(self, family: str, seed: int) -> None:  # no index to open: every tensor is made up
        self.family = family
        self.path = Path(f"<random {family}>")
        self.seed = seed
        self.tensors: dict[str, np.ndarray] = {}

    def kept(self, name: str) -> None:
        return None

    def _stored_blocks(self, name: str, shape, mapped: bool = False) -> None:  # made-up tensors: never Q8_0
        return None

    def _stored_bf16(self, name: str, shape) -> None:  # nor as a checkpoint's bf16 bits
        return None

    def __contains__(self, name: str) -> bool:
        return True

    def exists(self, *names: str) -> bool:
        return True

    def name_of(self, *names: str) -> str:
        return names[0]

    def mxfp4(self, name: str) -> None:
        return None

    def f32(self, *names: str, shape: tuple[int, ...] | None = None, size: int | None = None) -> np.ndarray:
        name = names[0]
        if name not in self.tensors:
            if shape is None:
                shape = (int(size),)
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            if name.endswith("norm.weight") or "layernorm" in name:
                values = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("e_score_correction_bias"):
                values = 0.1 * rng.standard_normal(shape)
            elif name.endswith("gate.weight") and len(shape) == 2 and shape[0] > 1:  # routers
                values = 0.24 * rng.standard_normal(shape)
            else:
                values = 0.08 * rng.standard_normal(shape)
            self.tensors[name] = values.astype(np.float32)
        return self.tensors[name].copy()

    def close(self) -> None:
        pass


def write_random_family(family: str, folder: str | Path, seed: int = 0, bf16: bool = False) -> Path:
    """Write a random tiny checkpoint of `family` (one of SYNTHETIC_FAMILIES) into `folder`; bf16 stores every
    tensor as bf16 (the experts then load as bf16 at "native"), else float32."""
    if family not in SYNTHETIC_CONFIGS:
        raise ConfigError(f"no synthetic config for family {family!r} (choose from {', '.join(SYNTHETIC_FAMILIES)})")
    raw = SYNTHETIC_CONFIGS[family]
    hf = HFConfig(raw, family, f"<synthetic {family}>")
    spec = family_of(hf)
    config = spec.parse(hf.with_family(spec.name))
    reader = _RandomReader(spec.name, seed)
    model = spec.build(config, reader, "native", 64)
    for layer in model.layers:
        if isinstance(layer.mlp, MoEBlock) and isinstance(model.experts, ExpertStore):
            for expert in range(layer.mlp.router.weight.shape[0]):
                model.experts.read(layer.mlp.layer, expert)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", reader.tensors,
                     dtypes={name: "BF16" for name in reader.tensors} if bf16 else None)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ any width
class _ShapeRecorder(_RandomReader):
    """Answers every tensor request with unbacked zeros (np.zeros: pages the builder only reads cost no RAM) and
    records the shape, so that a released-width model's tensor list costs about its bf16 trunk, not its weights."""

    # spellings the builder accepts that released checkpoints do not use (llama.cpp's converters know only the
    # released ones): Kimi Linear ships its KDA short convolutions as q/k/v_conv1d, not one stacked conv1d
    _NOT_RELEASED = ("self_attn.conv1d.weight",)

    def __init__(self, family: str) -> None:
        super().__init__(family, 0)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __contains__(self, name: str) -> bool:
        return not (self.family == "kimi_linear" and name.endswith(self._NOT_RELEASED))

    def f32(self, *names: str, shape: tuple[int, ...] | None = None, size: int | None = None) -> np.ndarray:
        shape = tuple(shape) if shape is not None else (int(size),)
        stored = (1, 1, shape[0], 1) if names[0].endswith("self_attn.A_log") else shape  # Kimi Linear's layout
        self.shapes[names[0]] = stored
        return np.zeros(shape, np.float32)


def family_tensor_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `raw_config` (a config.json as a dict, any family, any width) holds, by name:
    the family's own builder asks for them (every expert of every MoE layer included)."""
    hf = HFConfig(raw_config, str(raw_config.get("model_type")), "<synthetic config>")
    spec = family_of(hf)
    config = spec.parse(hf.with_family(spec.name))
    reader = _ShapeRecorder(spec.name)
    model = spec.build(config, reader, "native", 64)
    for layer in model.layers:
        if isinstance(layer.mlp, MoEBlock) and isinstance(model.experts, ExpertStore):
            for expert in range(layer.mlp.router.weight.shape[0]):
                model.experts.read(layer.mlp.layer, expert)
    return dict(reader.shapes)


def _random_rows(name: str, shape: tuple[int, ...], seed: int, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of tensor `name` (first axis) as bf16 bits, seeded by (seed, name, start). Uniform values
    (cheaper to draw than normal ones; a random model needs only the spread) scaled so that a random model's
    activations stay O(1) at any width: matrices standard deviation 1/sqrt(fan_in), norm weights 1 +- 0.2, routers
    2/sqrt(fan_in) (routing neither uniform nor tied), selection biases 0.1, other vectors 0.08. bf16 by truncation."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), start])
    rows = (stop - start,) + tuple(shape[1:])
    values = rng.random(rows, dtype=np.float32)  # U[0, 1): mean 1/2, standard deviation 1/sqrt(12)
    if name.endswith("norm.weight") or "layernorm" in name:
        std, mean = 0.2, 1.0
    elif name.endswith("e_score_correction_bias"):
        std, mean = 0.1, 0.0
    elif len(shape) >= 2:
        std, mean = (2.0 if name.endswith("gate.weight") and shape[0] > 1 else 1.0) / np.sqrt(shape[-1]), 0.0
    else:
        std, mean = 0.08, 0.0
    values -= np.float32(0.5)
    values *= np.float32(std * np.sqrt(12.0))
    values += np.float32(mean)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def write_random_checkpoint_streaming(raw_config: dict, folder: str | Path, seed: int = 0,
                                      progress: Callable[[int, int], None] | None = None) -> Path:
    """Write config.json and a random bf16 model.safetensors for `raw_config` (any family, released widths
    included) into `folder`, tensor by tensor in chunks of rows, so RAM holds one chunk (64 MiB) at a time, not the
    model. The file goes to a temporary name and is renamed into place; an existing complete folder is kept.
    `progress(bytes_written, bytes_total)` is called after each tensor."""
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    shapes = dict(sorted(family_tensor_shapes(raw_config).items()))
    header: dict[str, dict] = {}
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(8 + len(header_bytes)) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "model.safetensors.tmp"
    written = 0
    with open(partial, "wb") as handle:
        handle.write(len(header_bytes).to_bytes(8, "little"))
        handle.write(header_bytes)
        for name, shape in shapes.items():
            row_values = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            rows_per_chunk = max(1, (16 << 20) // row_values)
            for start in range(0, shape[0], rows_per_chunk):
                stop = min(shape[0], start + rows_per_chunk)
                handle.write(_random_rows(name, shape, seed, start, stop).tobytes())
            written += int(np.prod(shape)) * 2
            if progress is not None:
                progress(written, offset)
    os.replace(partial, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    return folder
