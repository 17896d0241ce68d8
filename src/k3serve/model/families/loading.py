"""Choosing a family from a checkpoint's config.json and loading it.

`load_family(folder)` reads `model_type`, parses the family's config (missing keys are errors), opens the
safetensors lazily and builds the trunk; routed experts are read and packed to `expert_precision` on first use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import k3serve.model.families.deepseek_v3 as deepseek_v3
import k3serve.model.families.kimi_linear as kimi_linear
import k3serve.model.families.qwen3_moe as qwen3_moe
import k3serve.model.families.qwen3_next as qwen3_next
from k3serve.errors import ConfigError
from k3serve.model.families.decoder import DecoderConfig, FamilyModel
from k3serve.model.families.experts import normalize_precision
from k3serve.model.families.gguf_families import describe, hf_config, tensor_index
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.tensors import TensorReader
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.quantized import check_load_trunk_precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    name: str
    parse: Callable[[HFConfig], DecoderConfig]
    build: Callable[..., FamilyModel]


_FAMILIES = {
    "kimi_linear": Family("kimi_linear", kimi_linear.KimiLinearConfig.from_hf, kimi_linear.build),
    "deepseek_v3": Family("deepseek_v3", deepseek_v3.DeepseekV3Config.from_hf, deepseek_v3.build),
    "qwen3_moe": Family("qwen3_moe", qwen3_moe.Qwen3MoeConfig.from_hf, qwen3_moe.build),
    "qwen3_next": Family("qwen3_next", qwen3_next.Qwen3NextConfig.from_hf, qwen3_next.build),
}
# model_type -> family. Kimi K2 ships DeepSeek-V3's architecture under its own model_type.
MODEL_TYPE_FAMILIES = {"kimi_linear": "kimi_linear", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3",
                       "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next"}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(MODEL_TYPE_FAMILIES)


def family_of(config: HFConfig) -> Family:
    if config.has("text_config"):
        # a nested config (K3 nests a kimi_linear-typed text model under model_type kimi_k3): not ours
        raise ConfigError(f"{config.source}: a nested text_config is a K3 (or multimodal) checkpoint, not one of "
                          f"the families {', '.join(SUPPORTED_MODEL_TYPES)}")
    model_type = config.get("model_type", default=None)
    if model_type not in MODEL_TYPE_FAMILIES:
        raise ConfigError(f"{config.source}: model_type {model_type!r} is not supported by the family loader "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return _FAMILIES[MODEL_TYPE_FAMILIES[model_type]]


def is_family_checkpoint(folder: str | Path) -> bool:
    """True if `folder`'s config.json names, at its root, a model_type this loader handles. K3 checkpoints do not:
    their root says kimi_k3 (the released one nests a kimi_linear-typed text_config, which is not Kimi Linear)."""
    try:
        config = HFConfig.read(folder)
    except ConfigError:
        return False
    return not config.has("text_config") and config.get("model_type", default=None) in MODEL_TYPE_FAMILIES


def read_family_config(folder: str | Path) -> DecoderConfig:
    config = HFConfig.read(folder)
    family = family_of(config)
    return family.parse(config.with_family(family.name))


def _trunk_precision(trunk_precision: str) -> str:
    try:
        return check_load_trunk_precision(trunk_precision)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_family_gguf(path: str | Path | GGUFFile, expert_precision: str = "native",
                     chunk_size: int | None = None, trunk_precision: str = "native") -> FamilyModel:
    """Open a GGUF file of a supported family (`gguf_families.GGUF_ARCHITECTURES`), lazily by tensor; the trunk
    as the file stores it, or quantized to `trunk_precision` (see `load_family`)."""
    precision = normalize_precision(expert_precision)
    trunk = _trunk_precision(trunk_precision)
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"chunk_size must be None (the compiled delta rule) or >= 1, got {chunk_size}")
    file = path if isinstance(path, GGUFFile) else GGUFFile(path)
    try:
        raw = hf_config(file)
        hf = HFConfig(raw, "", f"{file.path} (GGUF {file.architecture})")
        family = family_of(hf)
        config = family.parse(hf.with_family(family.name))
        reader = TensorReader(tensor_index(file, raw), family.name, file.path, trunk)
        logger.info("loading %s (%s, layers %s) from GGUF %s, experts %s, trunk %s", family.name, describe(file),
                    config.layer_map, file.path, precision, trunk)
        return family.build(config, reader, precision, chunk_size)
    except BaseException:
        file.close()
        raise


def load_family(folder: str | Path, expert_precision: str = "native",
                chunk_size: int | None = None, trunk_precision: str = "native") -> FamilyModel:
    """Open a Hugging Face checkpoint folder of a supported family.

    expert_precision: "native" (alias "bf16": the stored values), "mxfp4" or "int8" (see `experts.py`).
    trunk_precision: "native" (alias "bf16": the trunk matrices, embedding and lm_head as stored), or "q8_0" /
    "mxfp4": those quantized at load and multiplied from their bytes (`kernels.linear`), as llama.cpp's Q8_0 and
    MXFP4_MOE files hold them (Q8_0: 8.5 bits a weight; lossy). Norms, routers and 1-D tensors stay as stored.
    chunk_size: None (default) runs KDA / DeltaNet through the compiled token-by-token delta rule; an int runs
    the numpy chunked form with chunks of that many tokens (the reference)."""
    return load_family_reading(folder, expert_precision, chunk_size, trunk_precision)[0]


def load_family_reading(folder: str | Path, expert_precision: str = "native", chunk_size: int | None = None,
                        trunk_precision: str = "native", record_quantized: bool = False
                        ) -> tuple[FamilyModel, TensorReader]:
    """`load_family`, and the reader it read the checkpoint through; with `record_quantized` the reader keeps each
    matrix it quantized at load in `quantized_at_load` (the family packer stores them)."""
    precision, trunk = normalize_precision(expert_precision), _trunk_precision(trunk_precision)
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"chunk_size must be None (the compiled delta rule) or >= 1, got {chunk_size}")
    hf = HFConfig.read(folder)
    family = family_of(hf)
    config = family.parse(hf.with_family(family.name))
    reader = TensorReader.open(folder, family.name, trunk)
    if record_quantized:
        reader.quantized_at_load = {}
    logger.info("loading %s (%s, layers %s) from %s, experts %s, trunk %s", family.name, config.model_type,
                config.layer_map, folder, precision, trunk)
    return family.build(config, reader, precision, chunk_size), reader
