"""An opened model: the model, its tokenizer and where it came from (`LoadedModel`), and the thread settings every
loader applies."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING
from pathlib import Path

from threadpoolctl import threadpool_limits

import k3serve

from k3serve.default_model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.model.interface import Model
from k3serve.tokenizer import Tokenizer
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.shared_pages import SharedArrays

if TYPE_CHECKING:
    from k3serve.loading.registry import Architecture

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedWeights:
    """A resident model's weights in sealed, read-only shared pages (weights/shared_pages.py) and the checkpoint
    folder they were read from. Pickled into a spawned process it travels as a file descriptor; there
    `load_model(path, shared_weights=...)` builds the model over the same pages instead of loading a copy."""

    path: Path  # resolved
    arrays: SharedArrays

    @property
    def nbytes(self) -> int:
        return self.arrays.pages.nbytes


@dataclass
class LoadedModel:
    model: Model
    checkpoint: Checkpoint | None  # a K3 checkpoint read resident; None otherwise
    tokenizer: Tokenizer | HFTokenizer | None
    path: Path
    architecture: Architecture  # its registry entry (loading/registry.py): what it offers beyond `Model`
    shared_weights: SharedWeights | None = None  # the weights in shared pages (load_model's share_weights)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = list(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            ids += list(self.tokenizer.eos_ids)
        return tuple(dict.fromkeys(ids))

    @property
    def identity(self) -> str:
        """A digest naming these exact weights (the prefix cache's disk tier keys its entries with it): a packed
        store's index (every blob's offset, size and CRC-32), else a checkpoint's SHA256SUMS, else its config and
        the name, size and modification time of each weight file."""
        return model_identity(self.path)

    @property
    def name(self) -> str:
        """The model's id: the folder name, or DEFAULT_MODEL_NAME for the embedded default (packed or not)."""
        if self.path == DEFAULT_MODEL_PATH or self.path.name.startswith(DEFAULT_MODEL_NAME):
            return DEFAULT_MODEL_NAME
        return self.path.name


def model_identity(path: Path) -> str:
    """See `LoadedModel.identity`."""
    digest = hashlib.blake2b(digest_size=16)
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        digest.update(f"{path.name}\x00{stat.st_size}\x00{stat.st_mtime_ns}".encode())
        return digest.hexdigest()
    for name in ("store.json", "SHA256SUMS"):
        if (path / name).is_file():
            digest.update(name.encode() + b"\x00" + (path / name).read_bytes())
            return digest.hexdigest()
    if (path / "config.json").is_file():
        digest.update((path / "config.json").read_bytes())
    for weight in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin")):
        stat = weight.stat()
        digest.update(f"\x00{weight.name}\x00{stat.st_size}\x00{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


# Below this hidden size a trunk matmul is too small to gain from several BLAS threads, and idle OpenBLAS threads
# spinning after each call take the cores from the numba expert kernels (measured: -15% decode at batch 16).
SINGLE_THREAD_BLAS_MAX_HIDDEN = 1024


_WARNED_BLAS_SPIN = False


def configure_threads(hidden_size: int) -> None:
    """Give small models' matmuls one BLAS thread, leaving the cores to the parallel expert kernels, and every
    model's where the kernels' workers spin between regions (`threads.workers_spin`: `--wait-policy active`, an
    OMP_WAIT_POLICY=ACTIVE or a spin count): a threaded numpy matmul would wake OpenBLAS's second thread onto the
    core a spinning worker holds, and the two share it by time slices. Measured at Moonlight's widths, Q8_0, one
    token a step under ACTIVE: the MLA core over the cache (numpy matmuls) 15-17 ms a token on two BLAS threads
    against about 0.9 on one (docs/BENCHMARKS.md). Otherwise larger models keep OpenBLAS's threads, which sleep right
    after each call where k3serve was imported before numpy (k3serve's __init__: OPENBLAS_THREAD_TIMEOUT); where
    numpy came first, say so once."""
    global _WARNED_BLAS_SPIN
    import k3serve.model.kernels  # noqa: F401  (its import sets the wait policy libgomp will read)
    from k3serve import threads

    spinning = threads.workers_spin()
    if hidden_size <= SINGLE_THREAD_BLAS_MAX_HIDDEN or spinning:
        if spinning and hidden_size > SINGLE_THREAD_BLAS_MAX_HIDDEN:
            logger.info("the kernels' workers spin between regions: numpy's BLAS runs on one thread")
        threadpool_limits(limits=1, user_api="blas")
    elif not k3serve.OPENBLAS_TIMEOUT_IN_FORCE and not _WARNED_BLAS_SPIN:
        _WARNED_BLAS_SPIN = True
        logger.warning("numpy was imported before k3serve, so OpenBLAS's threads spin ~0.1 s after each call and "
                       "take cores from the kernels' threads (batch decode and prefill up to 1.7x slower): import "
                       "k3serve first, or set %s=%s before starting Python", k3serve.OPENBLAS_TIMEOUT_ENV,
                       k3serve.OPENBLAS_TIMEOUT)
