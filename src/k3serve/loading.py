"""Finding and opening models: a checkpoint folder given by the user, or the embedded default model.

The embedded default is a small K3 that k3serve trained itself (docs/MODEL.md; `python -m k3serve.training.train`
rebuilds it). It ships inside the package (k3serve/assets/default_model) with a SHA256SUMS file that is checked
once per process before the first use; a file that does not match is refused with its name.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from threadpoolctl import threadpool_limits

from k3serve.errors import CheckpointError, ConfigError, TokenizerError
from k3serve.model.families import FamilyModel, is_family_checkpoint, load_family
from k3serve.model.k3 import K3Model
from k3serve.model.kernels import warmup as warmup_kernels
from k3serve.model.source import ResidentSource
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.tokenizer import Tokenizer
from k3serve.weights.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "k3-trained-default"
DEFAULT_MODEL_PATH = Path(__file__).parent / "assets" / "default_model"
_verified: dict[Path, str] = {}


def cache_root() -> Path:
    if os.environ.get("K3SERVE_CACHE"):
        return Path(os.environ["K3SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3serve"


def verify_checksums(folder: Path) -> str:
    """Check every file listed in folder/SHA256SUMS; returns the digest of that list (the model's identity)."""
    folder = Path(folder)
    if folder in _verified:
        return _verified[folder]
    sums = folder / "SHA256SUMS"
    try:
        listing = sums.read_text()
    except OSError as exc:
        raise CheckpointError(f"{sums}: cannot read the checksum list: {exc}") from exc
    for line in listing.splitlines():
        if not line.strip():
            continue
        expected, _, name = line.partition("  ")
        path = folder / name
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        if actual != expected:
            raise CheckpointError(f"{path}: sha256 {actual} does not match {expected} in {sums}; the file is "
                                  "damaged (reinstall k3serve)")
    digest = hashlib.sha256(listing.encode()).hexdigest()
    _verified[folder] = digest
    return digest


def default_model_dir() -> Path:
    """The embedded default model's folder (inside the package), after its checksums are verified."""
    verify_checksums(DEFAULT_MODEL_PATH)
    return DEFAULT_MODEL_PATH


@dataclass
class LoadedModel:
    model: K3Model | FamilyModel
    checkpoint: Checkpoint | None  # None for the other families (their tensors are read through the family)
    tokenizer: Tokenizer | HFTokenizer | None
    path: Path

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = list(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            ids += list(self.tokenizer.eos_ids)
        return tuple(dict.fromkeys(ids))

    @property
    def name(self) -> str:
        """The model's id: the folder name, or DEFAULT_MODEL_NAME for the embedded default (packed or not)."""
        if self.path == DEFAULT_MODEL_PATH or self.path.name.startswith(DEFAULT_MODEL_NAME):
            return DEFAULT_MODEL_NAME
        return self.path.name


# Below this hidden size a trunk matmul is too small to gain from several BLAS threads, and idle OpenBLAS threads
# spinning after each call take the cores from the numba expert kernels (measured: -15% decode at batch 16).
SINGLE_THREAD_BLAS_MAX_HIDDEN = 1024


def configure_threads(hidden_size: int) -> None:
    """Give small models' matmuls one BLAS thread, leaving the cores to the parallel expert kernels."""
    if hidden_size <= SINGLE_THREAD_BLAS_MAX_HIDDEN:
        threadpool_limits(limits=1, user_api="blas")


def load_model(path: str | Path | None = None, expert_precision: str = "native", stream=None) -> LoadedModel:
    """Open a checkpoint folder (or the default model) with the resident weight source.

    K3 checkpoints go to `K3Model`; Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE and Qwen3-Next checkpoints
    (by their config's model_type) to the family models, whose bf16 experts may be quantized at load."""
    from k3serve.weights.store import is_packed_store

    if stream is not None or (path is not None and is_packed_store(path)):
        # a packed store, or any streaming option (`stream`: k3serve.stream.source.StreamOptions)
        from k3serve.stream.loading import load_streaming
        from k3serve.stream.source import StreamOptions

        return load_streaming(path, stream if stream is not None else StreamOptions())
    folder = Path(path) if path is not None else default_model_dir()
    if is_family_checkpoint(folder):
        family = load_family(folder, expert_precision=expert_precision)
        family_tokenizer = None
        if (folder / "tiktoken.model").exists():
            try:
                family_tokenizer = Tokenizer.from_dir(folder)
            except TokenizerError as exc:
                logger.warning("%s: tokenizer not usable (%s); pass token ids instead", folder, exc)
        elif (folder / "tokenizer.json").exists():
            try:
                family_tokenizer = HFTokenizer.from_dir(folder)
            except TokenizerError as exc:
                logger.warning("%s: tokenizer not usable (%s); pass token ids instead", folder, exc)
        return LoadedModel(model=family, checkpoint=None, tokenizer=family_tokenizer, path=folder)
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
