"""Deterministic random K3 checkpoints: the tiny oracle (`k3serve make-tiny`) and the generated default model.

The initialisation is chosen so that plausible bugs change the output visibly:
- the router's correction bias is large enough to reorder the top-k against the unbiased scores;
- SiTU-GLU inputs reach past its caps (|gate| > 4, |up| > 25) on some rows;
- KDA decays vary widely between heads and channels (A_log spans two decades, dt_bias is spread);
- norm weights are not all ones and attention-residual queries give non-uniform mixes.
Trunk matrices are stored in bf16, experts in MXFP4, under the released tensor names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from k3serve.config import K3Config
from k3serve.weights import names
from k3serve.weights.mxfp4 import quantize_mxfp4
from k3serve.weights.safetensors_io import save_sharded

# (name suffix, gain) for matrices whose gain differs from 1; the std of a matrix is gain / sqrt(fan_in).
_GAINS = (
    ("mlp.gate_proj.weight", 4.0),
    ("mlp.up_proj.weight", 24.0),
    ("mlp.down_proj.weight", 0.05),
    ("shared_experts.gate_proj.weight", 4.0),
    ("shared_experts.up_proj.weight", 24.0),
    ("shared_experts.down_proj.weight", 0.05),
    ("o_proj.weight", 0.7),
    ("routed_expert_up_proj.weight", 0.7),
    ("lm_head.weight", 3.0),
)
_EXPERT_GAINS = {"w1": 4.0, "w3": 20.0, "w2": 0.06}


def _matrix_gain(name: str) -> float:
    for suffix, gain in _GAINS:
        if name.endswith(suffix):
            return gain
    return 1.0


def _init_tensor(spec: names.TensorSpec, config: K3Config, rng: np.random.Generator) -> np.ndarray:
    name, shape = spec.name, spec.shape
    H = config.hidden_size
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.05, 8.0, size=shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.normal(0.0, 1.5, size=shape).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, 0.6, size=shape).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return rng.normal(0.0, 0.15, size=shape).astype(np.float32)
    if name.endswith("res_proj.weight"):
        return rng.normal(0.0, 1.5 / np.sqrt(H), size=shape).astype(np.float32)
    if name == names.EMBED:
        return rng.normal(0.0, 1.0, size=shape).astype(np.float32)
    if len(shape) == 1:  # norm weights
        return (1.0 + 0.2 * rng.normal(size=shape)).astype(np.float32)
    fan_in = shape[-1]
    return rng.normal(0.0, _matrix_gain(name) / np.sqrt(fan_in), size=shape).astype(np.float32)


def random_tensors(config: K3Config, seed: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a random checkpoint (float32 values already rounded where stored as bf16) and dtypes."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for spec in names.all_specs(config):
        if spec.dtype == "U8":
            continue
        tensors[spec.name] = _init_tensor(spec, config, rng)
        dtypes[spec.name] = spec.dtype
    for layer in config.moe_layer_ids:
        for expert in range(config.num_experts):
            for matrix in names.EXPERT_MATRICES:
                rows, cols = names.expert_matrix_shape(config, matrix)
                dense = rng.normal(0.0, _EXPERT_GAINS[matrix] / np.sqrt(cols), size=(rows, cols)).astype(np.float32)
                packed, scales = quantize_mxfp4(dense)
                tensors[names.expert_name(layer, expert, matrix, "weight_packed")] = packed
                tensors[names.expert_name(layer, expert, matrix, "weight_scale")] = scales
                dtypes[names.expert_name(layer, expert, matrix, "weight_packed")] = "U8"
                dtypes[names.expert_name(layer, expert, matrix, "weight_scale")] = "U8"
    order = [spec.name for spec in names.all_specs(config)]
    return {n: tensors[n] for n in order}, {n: dtypes[n] for n in order}


def write_random_checkpoint(config: K3Config, out: str | Path, seed: int,
                            tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 64 << 20) -> Path:
    """Write config.json, sharded safetensors and (optionally) the tokenizer files into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, dtypes = random_tensors(config, seed)
    save_sharded(out, tensors, dtypes, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config.to_dict(nested=True), indent=2) + "\n")
    if tokenizer_dir is not None:
        for file in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / file, out / file)
    return out
