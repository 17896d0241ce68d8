"""Opening models: a checkpoint folder given by the user (K3 or another family), a packed store (streaming), or
the embedded default model (k3serve/default_model.py). What comes back is a `LoadedModel` (k3serve/loaded.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from k3serve.default_model import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH, cache_root, default_model_dir,
                                   verify_checksums)
from k3serve.errors import CheckpointError, ConfigError, TokenizerError
from k3serve.loading.loaded import LoadedModel, configure_threads, family_tokenizer
from k3serve.model.families import is_family_checkpoint, load_family
from k3serve.model.families.loading import load_family_gguf
from k3serve.gguf_tokenizer import tokenizer_from_gguf
from k3serve.model.k3 import K3Model
from k3serve.model.kernels import warmup as warmup_kernels
from k3serve.model.source import ResidentSource
from k3serve.tokenizer import Tokenizer
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.gguf_k3 import ARCHITECTURE as K3_GGUF_ARCHITECTURE

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PATH", "LoadedModel", "cache_root", "configure_threads",
           "default_model_dir", "load_model", "verify_checksums"]

def load_model(path: str | Path | None = None, expert_precision: str = "native", stream=None) -> LoadedModel:
    """Open a checkpoint folder (or the default model) with the resident weight source.

    K3 checkpoints go to `K3Model`; Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE and Qwen3-Next checkpoints
    (by their config's model_type) to the family models, whose bf16 experts may be quantized at load."""
    from k3serve.weights.store import is_packed_store

    if stream is not None or (path is not None and is_packed_store(path)):
        # a packed store, or any streaming option (`stream`: k3serve.stream.options.StreamOptions)
        from k3serve.loading.streaming import load_streaming
        from k3serve.stream.options import StreamOptions

        return load_streaming(path, stream if stream is not None else StreamOptions())
    if path is not None and is_gguf_file(path):
        return _load_gguf(Path(path), expert_precision)
    folder = Path(path) if path is not None else default_model_dir()
    if is_family_checkpoint(folder):
        family = load_family(folder, expert_precision=expert_precision)
        configure_threads(family.config.hidden_size)  # as for K3: the trunk's BLAS must not fight the kernels
        return LoadedModel(model=family, checkpoint=None, tokenizer=family_tokenizer(folder), path=folder)
    if expert_precision not in ("native", "mxfp4"):
        raise ConfigError(f"K3 experts ship as MXFP4; --expert-precision {expert_precision!r} applies to the other "
                          "families")
    checkpoint = Checkpoint(folder)
    tokenizer = Tokenizer.from_dir(checkpoint.tokenizer_dir) if checkpoint.tokenizer_dir else None
    if tokenizer is not None and tokenizer.vocab_size > checkpoint.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {checkpoint.config.vocab_size}"
        )
    model = K3Model(ResidentSource(checkpoint))
    configure_threads(checkpoint.config.hidden_size)
    warmup_kernels()  # compile (or load the cached) numba kernels now, not inside the first request
    return LoadedModel(model=model, checkpoint=checkpoint, tokenizer=tokenizer, path=folder)


def _load_gguf(path: Path, expert_precision: str) -> LoadedModel:
    """A GGUF file of a family (see model/families/gguf_families.py), with the tokenizer and chat template from
    its metadata. A tokenizer that cannot be rebuilt leaves the model usable with token ids, as for folders."""
    file = GGUFFile(path)
    tokenizer = None
    try:
        tokenizer = tokenizer_from_gguf(file.metadata, str(path))
    except TokenizerError as exc:
        logger.warning("%s: tokenizer not usable (%s); pass token ids instead", path, exc)
    if file.architecture == K3_GGUF_ARCHITECTURE:
        if expert_precision not in ("native", "mxfp4"):
            raise ConfigError(f"K3 experts are MXFP4; --expert-precision {expert_precision!r} applies to the other "
                              "families")
        checkpoint = Checkpoint.from_gguf(file)
        if tokenizer is not None and tokenizer.vocab_size > checkpoint.config.vocab_size:
            raise CheckpointError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size "
                                  f"is {checkpoint.config.vocab_size}")
        model = K3Model(ResidentSource(checkpoint))
        configure_threads(checkpoint.config.hidden_size)
        warmup_kernels()
        return LoadedModel(model=model, checkpoint=checkpoint, tokenizer=tokenizer, path=path)
    family = load_family_gguf(file, expert_precision=expert_precision)
    return LoadedModel(model=family, checkpoint=None, tokenizer=tokenizer, path=path)
