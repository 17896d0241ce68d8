"""Expert owners as Ray actors (`k3serve cluster --expert-parallel N`), and the front's model over them.

Each owner is a Ray actor holding `cpus_per_owner` CPUs and one compute thread; it opens its shard folder on the
machine Ray placed it on (a path pattern with `{i}`, the same on every machine, or local shards on one machine)
and keeps its own RAM budget and expert cache. The front's `ExpertParallelSource` sends one call per owner per MoE
layer per step, all of a layer's calls in flight at once (`ray.get` on the list).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import ray
from ray.exceptions import RayActorError

from k3serve.cluster.expert_parallel import ExpertOwnerCore, ExpertParallelSource, OwnerCall, OwnerInfo
from k3serve.cluster.spec import SINGLE_THREAD_ENV
from k3serve.errors import K3Error
from k3serve.stream.shard_source import ShardOptions
from k3serve.stream.stats import StreamStats

logger = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 600.0


@ray.remote
class ExpertOwner:
    def __init__(self, shard_path: str, options: ShardOptions, index: int) -> None:
        from threadpoolctl import threadpool_limits

        from k3serve.model.kernels import warmup

        threadpool_limits(limits=1)
        self.core = ExpertOwnerCore(shard_path, options, index)
        warmup()

    def info(self) -> OwnerInfo:
        return self.core.info

    def run(self, call: OwnerCall) -> np.ndarray:
        return self.core.run(call)

    def stats(self) -> StreamStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()


class RayOwners:
    """The owners' actor handles as an `OwnerTransport`."""

    def __init__(self, shard_paths: Sequence[str | Path], options: ShardOptions, cpus_per_owner: float = 1.0) -> None:
        actor_options = dict(num_cpus=cpus_per_owner, max_restarts=0, runtime_env={"env_vars": SINGLE_THREAD_ENV})
        self.actors = [ExpertOwner.options(**actor_options).remote(str(path), options, i)
                       for i, path in enumerate(shard_paths)]
        try:
            self.infos: list[OwnerInfo] = ray.get([a.info.remote() for a in self.actors],
                                                  timeout=START_TIMEOUT_SECONDS)
        except RayActorError as exc:
            self.close()
            raise K3Error(f"an expert owner failed to start: {_cause(exc)}") from None

    def run_all(self, calls: Sequence[OwnerCall]) -> list[np.ndarray]:
        try:
            return ray.get([self.actors[c.owner].run.remote(c) for c in calls])
        except RayActorError as exc:
            raise K3Error(f"an expert owner died: {_cause(exc)}") from None

    def stats(self) -> list[StreamStats]:
        return ray.get([a.stats.remote() for a in self.actors])

    def check_integrity(self) -> None:
        ray.get([a.check_integrity.remote() for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _cause(exc: BaseException) -> str:
    text = str(exc)
    marker = text.rfind("K3Error") if "K3Error" in text else text.rfind("Error:")
    return text[marker:].strip().splitlines()[0] if marker >= 0 else text.strip().splitlines()[-1]


@dataclass(frozen=True)
class ExpertParallelModel:
    """The front's model (a K3Model over an `ExpertParallelSource`) and what it was built from."""

    loaded: object  # k3serve.loaded.LoadedModel
    source: ExpertParallelSource


def load_expert_parallel(packed: Path, shard_paths: Sequence[str | Path], trunk_options, owner_options: ShardOptions,
                         cpus_per_owner: float = 1.0) -> ExpertParallelModel:
    """Start the owners (Ray must be initialised) and open the front's trunk from the packed store `packed`."""
    from k3serve.loaded import LoadedModel, configure_threads
    from k3serve.model.k3 import K3Model
    from k3serve.model.kernels import warmup
    from k3serve.stream.options import StreamOptions
    from k3serve.stream.source import StreamingSource
    from k3serve.tokenizer import Tokenizer
    from k3serve.weights.store import PackedStore

    from k3serve.cluster.expert_parallel import trunk_budget

    store = PackedStore(packed)
    options = trunk_options or StreamOptions(ram_budget=trunk_budget(store))
    if options.prefetch != "none":
        raise K3Error("--prefetch is per expert cache: with --expert-parallel the front holds no experts")
    owners = RayOwners(shard_paths, owner_options, cpus_per_owner)
    try:
        source = ExpertParallelSource(StreamingSource(store, options), owners, owners.infos)
    except BaseException:
        owners.close()
        raise
    configure_threads(store.config.hidden_size)
    warmup()
    tokenizer = Tokenizer.from_dir(packed) if (packed / "tiktoken.model").exists() else None
    loaded = LoadedModel(model=K3Model(source), checkpoint=None, tokenizer=tokenizer, path=packed)
    return ExpertParallelModel(loaded=loaded, source=source)
