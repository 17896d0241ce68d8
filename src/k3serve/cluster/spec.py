"""What a replica is started from (`ReplicaSpec`) and what it reports back (`ReplicaInfo`); no Ray here, so the
front can build and check a spec before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3serve.engine.config import EngineConfig

# One thread per replica: the actor holds one CPU, and BLAS or numba threads beyond it would fight the other
# replicas for the cores.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                     "NUMBA_NUM_THREADS": "1"}


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads: the model folder (None = the embedded default) with its streaming options, and
    the engine's configuration. Each replica opens its own copy."""

    model: Path | None
    stream: object | None  # k3serve.stream.options.StreamOptions, or None for resident weights
    engine: EngineConfig
    speculative: object | None  # k3serve.engine.speculative.SpeculativeConfig, or None
    draft_model: Path | None = None


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's limits, which the front checks requests against before routing them."""

    index: int
    pid: int
    model_name: str
    vocab_size: int
    max_context: int
    max_seqs: int
    block_size: int


