"""Opening a model through a streaming source: a packed store folder (K3's, or a family's), or the embedded default
model (packed into the user cache on first streaming use)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from k3serve.default_model import DEFAULT_MODEL_NAME, cache_root, default_model_dir, verify_checksums
from k3serve.errors import CheckpointError
from k3serve.loading.loaded import LoadedModel, configure_threads, family_tokenizer
from k3serve.model.families import load_family
from k3serve.model.families.decoder import FamilyModel
from k3serve.model.families.moe import MoEBlock
from k3serve.stream.family_source import StreamingExperts
from k3serve.stream.options import StreamOptions
from k3serve.stream.source import StreamingSource
from k3serve.weights.family_store import FamilyStore, is_family_store
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


def load_streaming(path: str | Path | None, options: StreamOptions):
    """A `LoadedModel` that streams: a K3 store's `K3Model` reads through a `StreamingSource`; a family store's
    `FamilyModel` reads its routed experts through `StreamingExperts` (stream/family_source.py)."""
    from k3serve.model.k3 import K3Model
    from k3serve.model.kernels import warmup as warmup_kernels
    from k3serve.hf_tokenizer import HFTokenizer
    from k3serve.tokenizer import Tokenizer

    folder = Path(path) if path is not None else default_packed_dir()
    if not is_packed_store(folder):
        raise CheckpointError(
            f"{folder} is not a packed store; streaming options (--ram-budget, --io, --cache, --prefetch, "
            f"--trace-out) read a packed store: run `k3serve pack {folder} PACKED_DIR` and pass --model PACKED_DIR")
    if is_family_store(folder):
        return load_family_streaming(folder, options)
    store = PackedStore(folder)
    tokenizer: Tokenizer | HFTokenizer | None = None
    if (folder / "tiktoken.model").exists():
        tokenizer = Tokenizer.from_dir(folder)
    elif (folder / "tokenizer.json").exists():  # a store packed from a GGUF file (gguf_tokenizer.py)
        tokenizer = HFTokenizer.from_dir(folder)
    if tokenizer is not None and tokenizer.vocab_size > store.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {store.config.vocab_size}")
    source = StreamingSource(store, options)
    configure_threads(store.config.hidden_size)
    warmup_kernels()
    return LoadedModel(model=K3Model(source), checkpoint=None, tokenizer=tokenizer, path=folder)


def load_family_streaming(folder: Path, options: StreamOptions) -> LoadedModel:
    """A `LoadedModel` of a family store: the trunk resident, the routed experts streamed."""
    from k3serve.model.kernels import warmup as warmup_kernels

    store = FamilyStore(folder)
    model: FamilyModel = load_family(folder, expert_precision=store.precision)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    if [b.layer for b in blocks] != store.moe_layers or any(b.router.top_k != store.top_k or
                                                            b.router.weight.shape[0] != store.num_experts
                                                            for b in blocks):
        raise CheckpointError(f"packed store {folder}: its MoE layers {store.moe_layers} ({store.num_experts} "
                              f"experts, top-{store.top_k}) differ from the model's; repack it")
    experts = StreamingExperts(store, options, model.config.num_layers)
    model.experts = experts  # type: ignore[assignment]
    for block in blocks:
        block.experts = experts  # type: ignore[assignment]
    configure_threads(model.config.hidden_size)
    warmup_kernels()
    return LoadedModel(model=model, checkpoint=None, tokenizer=family_tokenizer(folder), path=folder)
