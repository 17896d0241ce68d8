"""Opening models: the one loader. A checkpoint folder (K3 or a family), a GGUF file, a packed store (streaming) or
the embedded default model (k3serve/default_model.py) becomes a `LoadedModel` (loading/loaded.py).

`load_model` does each thing once, for every architecture: find what the path is and its `Architecture`
(loading/registry.py), open it through that entry, check the tokenizer against the model's vocabulary, set the BLAS
threads and load the compiled kernels. The CLI, the server, the cluster's replicas and expert-parallel front, the
lab and the benchmarks all open models here.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from k3serve.default_model import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH, cache_root, default_model_dir,
                                   verify_checksums)
from k3serve.errors import CheckpointError, TokenizerError, UsageError
from k3serve.gguf_tokenizer import tokenizer_from_gguf
from k3serve.loading import registry
from k3serve.loading.loaded import LoadedModel, configure_threads
from k3serve.loading.opened import ExpertWrapper, Opened
from k3serve.loading.streaming import default_packed_dir
from k3serve.model.kernels import warmup as warmup_kernels
from k3serve.model.routing import ExpertTopP
from k3serve.stream.options import StreamOptions
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.store import is_packed_store

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PATH", "LoadedModel", "cache_root", "configure_threads",
           "default_model_dir", "default_packed_dir", "load_model", "verify_checksums"]


def load_model(path: str | Path | None = None, expert_precision: str = "native", stream: StreamOptions | None = None,
               wrap_experts: ExpertWrapper | None = None, expert_top_p: ExpertTopP | None = None) -> LoadedModel:
    """Open `path` (None: the embedded default model).

    A packed store, or any streaming option (`stream`), streams: the default model is packed into the user cache
    on first use. A GGUF file takes its tokenizer and chat template from its metadata. `expert_precision` quantizes
    a family's routed experts at load ("native", "bf16", "mxfp4", "int8"; K3's ship as MXFP4). `wrap_experts`
    wraps a K3 store's streaming source before the model is built on it (expert parallelism). `expert_top_p`
    keeps only each token's heaviest routed experts (--expert-top-p, model/routing.py)."""
    if stream is not None or wrap_experts is not None or (path is not None and is_packed_store(path)):
        folder = Path(path) if path is not None else default_packed_dir()
        if not is_packed_store(folder):
            raise CheckpointError(
                f"{folder} is not a packed store; streaming options (--ram-budget, --io, --cache, --prefetch, "
                f"--trace-out) read a packed store: run `k3serve pack {folder} PACKED_DIR` and pass --model "
                "PACKED_DIR")
        architecture = registry.of_store(folder)
        opened = architecture.open_store(folder, stream if stream is not None else StreamOptions(), wrap_experts)
    elif path is not None and is_gguf_file(path):
        folder = Path(path)
        opened, architecture = _open_gguf(folder, expert_precision)
    else:
        folder = Path(path) if path is not None else default_model_dir()
        architecture = registry.of_folder(folder)
        opened = architecture.open_folder(folder, expert_precision)
    _check_vocabulary(opened, folder)
    if expert_top_p is not None and expert_top_p.active:
        if opened.model.kept_experts.counts.shape[0] <= 1:
            raise UsageError(f"{folder}: --expert-top-p needs a model with routed experts")
        opened.model.limit_experts(expert_top_p)
    configure_threads(opened.model.config.hidden_size)  # the trunk's BLAS must not fight the expert kernels
    _load_kernels()  # compile (or load the cached) numba kernels now, not inside the first request
    return LoadedModel(model=opened.model, checkpoint=opened.checkpoint, tokenizer=opened.tokenizer, path=folder,
                       architecture=architecture)


def _open_gguf(path: Path, expert_precision: str) -> tuple[Opened, registry.Architecture]:
    """A GGUF file, with the tokenizer and chat template from its metadata; a tokenizer that cannot be rebuilt
    leaves the model usable with token ids, as for folders."""
    file = GGUFFile(path)
    try:
        architecture = registry.of_gguf(file)
        tokenizer = None
        try:
            tokenizer = tokenizer_from_gguf(file.metadata, str(path))
        except TokenizerError as exc:
            logger.warning("%s: tokenizer not usable (%s); pass token ids instead", path, exc)
        opened = architecture.open_gguf(file, expert_precision)
    except BaseException:
        file.close()
        raise
    return Opened(opened.model, tokenizer, opened.checkpoint), architecture


def _check_vocabulary(opened: Opened, path: Path) -> None:
    """A tokenizer with more tokens than the model's vocabulary would produce ids the model cannot embed."""
    vocab = opened.model.config.vocab_size
    if opened.tokenizer is not None and opened.tokenizer.vocab_size > vocab:
        raise CheckpointError(f"{path}: tokenizer has {opened.tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {vocab}")


@functools.cache
def _load_kernels() -> None:
    warmup_kernels()
