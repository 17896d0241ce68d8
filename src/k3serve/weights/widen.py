"""Widen a K3 checkpoint's experts without changing the function it computes (a benchmark fixture maker).

A streaming benchmark needs an expert store of a gigabyte or more, but a model we can train here is a few MB. This
rewrites a trained checkpoint so that every expert is `inner * latent` times larger while the model stays the same
function, so its routing stays the learned routing:

- inner (MI -> MI * inner): each expert's SiTU-GLU units are repeated `inner` times: w1 and w3 rows tiled, w2
  columns tiled and divided by `inner`. The shared expert (width num_shared * MI) is widened the same way.
- latent (LT -> LT * latent): the latent vector is repeated `latent` times: routed_expert_down_proj rows and the
  latent norm weight tiled, w1/w3 columns tiled and divided by `latent`, w2 rows tiled, routed_expert_up_proj
  columns tiled and divided by `latent`. An RMSNorm of a repeated vector equals the repeated RMSNorm.

Both factors are powers of two, so every division is exact: for MXFP4 it lowers the E8M0 scale byte of the copied
32-element groups, for bf16 it lowers the exponent. Only the fp32 summation order changes, so logits agree to
float32 rounding and greedy tokens normally agree exactly (tests/weights/test_widen.py measures both).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.safetensors_io import save_sharded


def _log2(factor: int, what: str) -> int:
    if factor < 1 or factor & (factor - 1):
        raise CheckpointError(f"--{what} must be a power of two (exact rescaling), got {factor}")
    return factor.bit_length() - 1


def _lower_scales(scales: np.ndarray, shift: int, name: str) -> np.ndarray:
    if shift == 0:
        return scales
    live = scales != 255
    if np.any(scales[live] < shift):
        raise CheckpointError(f"{name}: a scale byte below {shift} cannot be divided by 2^{shift} exactly")
    out = scales.astype(np.int32)
    out[live] -= shift
    return out.astype(np.uint8)


def widen_experts(src: str | Path, out: str | Path, inner: int = 1, latent: int = 1, progress: bool = False,
                  max_shard_bytes: int = 512 << 20) -> Path:
    """Write the widened checkpoint (config, shards, tokenizer files) into `out`; returns `out`."""
    src, out = Path(src), Path(out)
    inner_shift, latent_shift = _log2(inner, "inner"), _log2(latent, "latent")
    checkpoint = Checkpoint(src)
    config = checkpoint.config
    if not config.moe_layer_ids:
        raise CheckpointError(f"{src} has no MoE layers to widen")
    index = checkpoint.index
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    names = index.names()
    iterator = names
    if progress:
        from tqdm import tqdm
        iterator = tqdm(names, desc="widen", unit="tensor")
    for name in iterator:
        info = index.info(name)
        dtypes[name] = info.dtype
        array = index.read(name)  # bf16 arrives as float32 (exact) and is stored back as bf16
        if ".experts." in name and ".shared_experts." not in name:
            matrix = name.split(".")[-2]  # w1 / w2 / w3
            packed = name.endswith("weight_packed")
            if matrix in ("w1", "w3"):  # [MI, LT]: rows are units, columns the latent
                array = np.tile(array, (inner, latent))
                if not packed:
                    array = _lower_scales(array, latent_shift, name)
            else:  # w2 [LT, MI]
                array = np.tile(array, (latent, inner))
                if not packed:
                    array = _lower_scales(array, inner_shift, name)
        elif name.endswith("routed_expert_down_proj.weight"):  # [LT, H]
            array = np.tile(array, (latent, 1))
        elif name.endswith("routed_expert_norm.weight"):  # [LT]
            array = np.tile(array, latent)
        elif name.endswith("routed_expert_up_proj.weight"):  # [H, LT]
            array = np.tile(array, (1, latent)) / np.float32(latent)
        elif ".shared_experts." in name and (name.endswith("gate_proj.weight") or name.endswith("up_proj.weight")):
            array = np.tile(array, (inner, 1))  # [SI, H]
        elif name.endswith("shared_experts.down_proj.weight"):
            array = np.tile(array, (1, inner)) / np.float32(inner)  # [H, SI]
        tensors[name] = array
    out.mkdir(parents=True, exist_ok=True)
    save_sharded(out, tensors, dtypes, max_shard_bytes=max_shard_bytes)
    widened = dataclasses.replace(config, moe_intermediate_size=config.moe_intermediate_size * inner,
                                  latent_size=config.latent_size * latent)
    (out / "config.json").write_text(json.dumps(widened.to_dict(nested=True), indent=2) + "\n")
    for extra in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)
    return out
