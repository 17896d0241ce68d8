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

import numpy as np

from k3serve.default_model import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH, cache_root, default_model_dir,
                                   verify_checksums)
from k3serve.errors import CheckpointError, TokenizerError, UsageError
from k3serve.gguf_tokenizer import tokenizer_from_gguf
from k3serve.loading import registry
from k3serve.loading.loaded import LoadedModel, SharedWeights, configure_threads
from k3serve.loading.opened import ExpertWrapper, Opened
from k3serve.loading.streaming import default_packed_dir
from k3serve.model import delta_rule
from k3serve.model.kernels import warmup as warmup_kernels
from k3serve.model.ops import l2_normalize
from k3serve.model.routing import ExpertTopP, KeptExperts
from k3serve.stream.options import StreamOptions
from k3serve.weights import shared_pages
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.quantized import check_load_trunk_precision
from k3serve.weights.store import is_packed_store

logger = logging.getLogger(__name__)

WARM_PREFILL_TOKENS = 64  # enough tokens that the warm-up takes the parallel kernels too

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PATH", "LoadedModel", "SharedWeights", "cache_root",
           "configure_threads", "default_model_dir", "default_packed_dir", "load_model", "verify_checksums"]


def load_model(path: str | Path | None = None, expert_precision: str = "native", stream: StreamOptions | None = None,
               wrap_experts: ExpertWrapper | None = None, share_weights: bool = False,
               shared_weights: SharedWeights | None = None, expert_top_p: ExpertTopP | None = None,
               trunk_precision: str = "native") -> LoadedModel:
    """Open `path` (None: the embedded default model).

    A packed store, or any streaming option (`stream`), streams: the default model is packed into the user cache
    on first use. A GGUF file takes its tokenizer and chat template from its metadata. `expert_precision` quantizes
    a family's routed experts at load ("native", "bf16", "mxfp4", "int8"; K3's ship as MXFP4). `wrap_experts`
    wraps a K3 store's streaming source before the model is built on it (expert parallelism). `expert_top_p`
    keeps only each token's heaviest routed experts (--expert-top-p, model/routing.py). `trunk_precision`
    ("native", alias "bf16"; "q8_0"; "mxfp4") quantizes a resident model's trunk matrices, embedding and lm_head at
    load (--trunk-precision; a packed store's trunk is what `pack --trunk-precision` wrote, so it refuses one).

    `share_weights` places a resident checkpoint folder's weights in sealed read-only shared pages where its
    architecture offers it (K3) and the system has them (Linux): `LoadedModel.shared_weights` is then the handle a
    spawned process passes back as `shared_weights` to build the same model over the same pages, with no copy of
    its own. Anything else (a store, a GGUF file, a family, a trunk quantized at load) loads as without it, with
    `shared_weights` None."""
    try:
        trunk = check_load_trunk_precision(trunk_precision)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    loaded = _load(path, expert_precision, stream, wrap_experts, share_weights, shared_weights, trunk)
    if expert_top_p is not None and expert_top_p.active:
        if loaded.model.kept_experts.counts.shape[0] <= 1:
            raise UsageError(f"{loaded.path}: --expert-top-p needs a model with routed experts")
        loaded.model.limit_experts(expert_top_p)
    return loaded


def _load(path: str | Path | None, expert_precision: str, stream: StreamOptions | None,
          wrap_experts: ExpertWrapper | None, share_weights: bool, shared_weights: SharedWeights | None,
          trunk_precision: str = "native") -> LoadedModel:
    if shared_weights is not None:
        return _load_shared(Path(path) if path is not None else default_model_dir(), shared_weights)
    if stream is not None or wrap_experts is not None or (path is not None and is_packed_store(path)):
        folder = Path(path) if path is not None else default_packed_dir()
        if not is_packed_store(folder):
            raise CheckpointError(
                f"{folder} is not a packed store; streaming options (--ram-budget, --io, --cache, --prefetch, "
                f"--trace-out) read a packed store: run `k3serve pack {folder} PACKED_DIR` and pass --model "
                "PACKED_DIR")
        if trunk_precision != "native":
            raise UsageError(f"{folder}: a packed store's trunk is stored at the precision `pack --trunk-precision` "
                             f"gave it; --trunk-precision {trunk_precision} applies to a checkpoint folder or a "
                             "GGUF file")
        architecture = registry.of_store(folder)
        opened = architecture.open_store(folder, stream if stream is not None else StreamOptions(), wrap_experts)
    elif path is not None and is_gguf_file(path):
        folder = Path(path)
        opened, architecture = _open_gguf(folder, expert_precision, trunk_precision)
    else:
        folder = Path(path) if path is not None else default_model_dir()
        architecture = registry.of_folder(folder)
        if (share_weights and architecture.share_folder is not None and shared_pages.supported()
                and trunk_precision == "native"):  # (a quantized trunk's matrices are not placed in shared pages)
            opened, arrays = architecture.share_folder(folder, expert_precision, trunk_precision)
            return _loaded(opened, folder, architecture, SharedWeights(folder.resolve(), arrays))
        opened = architecture.open_folder(folder, expert_precision, trunk_precision)
    return _loaded(opened, folder, architecture)


def _load_shared(folder: Path, shared: SharedWeights) -> LoadedModel:
    """The model of checkpoint folder `folder` over the shared pages of the same folder's weights."""
    if is_packed_store(folder) or is_gguf_file(folder) or folder.resolve() != shared.path:
        raise CheckpointError(f"{folder}: the shared weights are {shared.path}'s (a checkpoint folder's); load "
                              "this model without them")
    architecture = registry.of_folder(folder)
    if architecture.open_shared is None:
        raise CheckpointError(f"{folder}: a {architecture.name} model does not open over shared weights")
    return _loaded(architecture.open_shared(folder, shared.arrays), folder, architecture, shared)


def _loaded(opened: Opened, folder: Path, architecture: registry.Architecture,
            shared: SharedWeights | None = None) -> LoadedModel:
    """The loader's shared steps: the tokenizer checked against the vocabulary, threads, kernels."""
    _check_vocabulary(opened, folder)
    configure_threads(opened.model.config.hidden_size)  # the trunk's BLAS must not fight the expert kernels
    if shared is None:
        # compile (or load the cached) kernels now, not in a request
        _load_kernels(architecture.dense_experts, bool(opened.model.cache_layout.recurrent_shapes))
    else:  # the kernels' read-only variants only (the writable ones load when a writable model first runs)
        _warm_read_only(opened.model)
    return LoadedModel(model=opened.model, checkpoint=opened.checkpoint, tokenizer=opened.tokenizer, path=folder,
                       architecture=architecture, shared_weights=shared)


def _warm_read_only(model) -> None:
    """numba compiles a kernel apart for read-only arrays: run a short prefill and a decode step on the shared
    weights now (loaded from numba's cache after the first time), not inside the first request."""
    ids = [i % model.config.vocab_size for i in range(WARM_PREFILL_TOKENS)]
    model.logits(ids, mode="full")
    model.logits(ids[:2], mode="incremental")


def _open_gguf(path: Path, expert_precision: str, trunk_precision: str = "native"
               ) -> tuple[Opened, registry.Architecture]:
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
        opened = architecture.open_gguf(file, expert_precision, trunk_precision)
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
def _load_kernels(dense_experts: bool, recurrent: bool) -> None:
    warmup_kernels(dense_experts)
    KeptExperts(1).add(np.zeros((1, 1), np.int64))  # every MoE forward counts its kept experts
    if recurrent:  # KDA / gated DeltaNet layers: their q and k norms and the recurrence
        l2_normalize(np.ones((1, 4), np.float32))
        delta_rule.warmup()
