"""Expert owners as Ray actors (`k3serve cluster --expert-parallel N`), and the front's model over them.

Each owner is a Ray actor holding `cpus_per_owner` CPUs and one compute thread; it opens its shard folder on the
machine Ray placed it on (a path pattern with `{i}`, the same on every machine, or local shards on one machine)
and keeps its own RAM budget and expert cache. The front's `ExpertParallelSource` sends one call per owner per MoE
layer per step, all of a layer's calls in flight at once.

Faults: an owner holds no state a call depends on (its cache only saves reads; a call's output is a function of the
shard's bytes and the call), so when one dies Ray restarts it (`max_restarts`: it opens its shard again, with an
empty cache) and the front sends the calls it lost again, to the new incarnation: the step goes on and its output
is the same bits. The front waits up to `restart_timeout` seconds for the restart; an owner that Ray will not
restart (its restarts used up, its node gone for good) fails the step with a `K3Error`, which ends the step's
requests with that error and leaves the engine serving. An owner's counters (`stats`) start again from zero with
each incarnation; `restarts` counts the incarnations the front saw begin.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from k3serve.cluster.expert_parallel import ExpertOwnerCore, ExpertParallelSource, OwnerCall, OwnerInfo
from k3serve.cluster.spec import SINGLE_THREAD_ENV
from k3serve.errors import K3Error
from k3serve.stream.shard_source import ShardOptions
from k3serve.model.expert_source import StreamStats

logger = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 600.0
RESTART_POLL_SECONDS = 0.1


class OwnerActor:
    """An expert owner's actor body (`ExpertOwner` is its Ray actor class)."""

    def __init__(self, shard_path: str, options: ShardOptions, index: int) -> None:
        from threadpoolctl import threadpool_limits

        from k3serve.model.kernels import warmup

        threadpool_limits(limits=1)
        self.core = ExpertOwnerCore(shard_path, options, index)
        warmup(dense_experts=False)  # a K3 shard's experts are MXFP4

    def info(self) -> OwnerInfo:
        return self.core.info

    def run(self, call: OwnerCall) -> np.ndarray:
        return self.core.run(call)

    def stats(self) -> StreamStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()


ExpertOwner = ray.remote(OwnerActor)


class RayOwners:
    """The owners' actor handles as an `OwnerTransport`; restarts a dead owner's lost calls (see the module
    docstring)."""

    def __init__(self, shard_paths: Sequence[str | Path], options: ShardOptions, cpus_per_owner: float = 1.0,
                 max_restarts: int = 3, restart_timeout: float = START_TIMEOUT_SECONDS, actor_class=None) -> None:
        actor_options = dict(num_cpus=cpus_per_owner, max_restarts=max_restarts, max_task_retries=0,
                             runtime_env={"env_vars": SINGLE_THREAD_ENV})
        self.max_restarts = max_restarts
        self.restart_timeout = restart_timeout
        self.restarts = [0] * len(shard_paths)
        self.actors = [(actor_class or ExpertOwner).options(**actor_options).remote(str(path), options, i)
                       for i, path in enumerate(shard_paths)]
        try:
            self.infos: list[OwnerInfo] = ray.get([a.info.remote() for a in self.actors],
                                                  timeout=START_TIMEOUT_SECONDS)
        except RayActorError as exc:
            self.close()
            raise K3Error(f"an expert owner failed to start: {_cause(exc)}") from None

    def run_all(self, calls: Sequence[OwnerCall]) -> list[np.ndarray]:
        outputs: list[np.ndarray | None] = [None] * len(calls)
        pending, cause = list(range(len(calls))), ""
        for attempt in range(self.max_restarts + 1):
            if attempt:  # the calls a dead owner lost go to its next incarnation
                for owner in sorted({calls[i].owner for i in pending}):
                    self._await_restart(owner, cause)
            refs = {i: self.actors[calls[i].owner].run.remote(calls[i]) for i in pending}  # all in flight at once
            pending = []
            for i, ref in refs.items():
                try:
                    outputs[i] = ray.get(ref)
                except RayActorError as exc:
                    pending.append(i)
                    cause = _cause(exc)
            if not pending:
                return outputs  # type: ignore[return-value]
        owners = ", ".join(str(o) for o in sorted({calls[i].owner for i in pending}))
        tried = f"sent again {self.max_restarts} times" if self.max_restarts else "no restarts (--max-restarts 0)"
        raise K3Error(f"expert owner {owners} died and its calls were lost ({tried}): {cause}")

    def _await_restart(self, owner: int, cause: str) -> None:
        """Wait for Ray to bring `owner` back: a call fails with ActorUnavailableError while it restarts, with
        ActorDiedError once Ray has given it up."""
        started = time.monotonic()
        deadline = started + self.restart_timeout
        late = K3Error(f"expert owner {owner} died ({cause}) and did not come back within {self.restart_timeout:g} s")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise late
            try:
                info = ray.get(self.actors[owner].info.remote(), timeout=remaining)
                break
            except ActorUnavailableError:  # still restarting
                time.sleep(RESTART_POLL_SECONDS)
            except GetTimeoutError:
                raise late from None
            except RayActorError as exc:
                raise K3Error(f"expert owner {owner} died ({cause}) and was not restarted: {_cause(exc)}") from None
        if info.pid != self.infos[owner].pid or info.node != self.infos[owner].node:
            self.restarts[owner] += 1
            self.infos[owner] = info
            logger.warning("expert owner %d died (%s); Ray restarted it (pid %d on %s) in %.1f s; its calls are sent "
                           "again", owner, cause, info.pid, info.node, time.monotonic() - started)

    def stats(self, timeout: float | None = None) -> list[StreamStats]:
        return ray.get([a.stats.remote() for a in self.actors], timeout=timeout)

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

    loaded: object  # k3serve.loading.loaded.LoadedModel
    source: ExpertParallelSource


def load_expert_parallel(packed: Path, shard_paths: Sequence[str | Path], trunk_options, owner_options: ShardOptions,
                         cpus_per_owner: float = 1.0, max_restarts: int = 3) -> ExpertParallelModel:
    """Start the owners (Ray must be initialised) and open the front's trunk from the packed store `packed` through
    the one loader, its streaming source wrapped by an `ExpertParallelSource` over the owners."""
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore

    from k3serve.cluster.expert_parallel import trunk_budget

    options = trunk_options or StreamOptions(ram_budget=trunk_budget(PackedStore(packed)))
    if options.prefetch != "none":
        raise K3Error("--prefetch is per expert cache: with --expert-parallel the front holds no experts")
    owners = RayOwners(shard_paths, owner_options, cpus_per_owner, max_restarts=max_restarts)
    try:
        loaded = load_model(packed, stream=options,
                            wrap_experts=lambda inner: ExpertParallelSource(inner, owners, owners.infos))
    except BaseException:
        owners.close()
        raise
    source = loaded.model.experts
    assert isinstance(source, ExpertParallelSource)  # the wrapper's, as the K3 entry built the model on it
    return ExpertParallelModel(loaded=loaded, source=source)
