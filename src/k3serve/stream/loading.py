"""Opening a model through the streaming source: a packed store folder, or the embedded default model (packed
into the user cache on first streaming use)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from k3serve.default_model import DEFAULT_MODEL_NAME, cache_root, default_model_dir, verify_checksums
from k3serve.errors import CheckpointError
from k3serve.loaded import LoadedModel, configure_threads
from k3serve.stream.options import StreamOptions
from k3serve.stream.source import StreamingSource
from k3serve.weights.store import PackedStore, is_packed_store

logger = logging.getLogger(__name__)


def default_packed_dir() -> Path:
    source = default_model_dir()
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{verify_checksums(source)[:12]}-packed"
    if is_packed_store(target):
        return target
    from k3serve.weights.pack import pack_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("packing the default model into %s (first streaming use only)", target)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        pack_checkpoint(source, staging)
        try:
            staging.rename(target)
        except OSError:
            if not is_packed_store(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def refuse_family(folder: Path, what: str) -> None:
    """A clear error for a family checkpoint (Kimi Linear, DeepSeek-V3, Qwen3-MoE, Qwen3-Next): the packed store
    and the streaming source hold K3's tensors only."""
    from k3serve.model.families import is_family_checkpoint, read_family_config

    if is_family_checkpoint(folder):
        model_type = read_family_config(folder).model_type
        raise CheckpointError(f"{folder} is a {model_type} checkpoint: {what} is built for K3 checkpoints only for "
                              "now; run it resident (without --ram-budget and the other streaming options)")


def load_streaming(path: str | Path | None, options: StreamOptions):
    """A `LoadedModel` whose K3Model reads through a `StreamingSource`."""
    from k3serve.model.k3 import K3Model
    from k3serve.model.kernels import warmup as warmup_kernels
    from k3serve.tokenizer import Tokenizer

    folder = Path(path) if path is not None else default_packed_dir()
    if not is_packed_store(folder):
        refuse_family(folder, "streaming (--ram-budget, --io, --cache, --prefetch, --trace-out)")
        raise CheckpointError(
            f"{folder} is not a packed store; streaming options (--ram-budget, --io, --cache, --prefetch, "
            f"--trace-out) read a packed store: run `k3serve pack {folder} PACKED_DIR` and pass --model PACKED_DIR")
    store = PackedStore(folder)
    tokenizer = Tokenizer.from_dir(folder) if (folder / "tiktoken.model").exists() else None
    if tokenizer is not None and tokenizer.vocab_size > store.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {store.config.vocab_size}")
    source = StreamingSource(store, options)
    configure_threads(store.config.hidden_size)
    warmup_kernels()
    return LoadedModel(model=K3Model(source), checkpoint=None, tokenizer=tokenizer, path=folder)
