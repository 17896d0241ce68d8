"""Expert parallelism: each MoE layer's routed experts split over N owners, the trunk on the front (no Ray here).

Owner i holds shard i/N of the expert store (`k3serve.weights.shard`: experts [i NE/N, (i+1) NE/N) of every MoE
layer) under its own RAM budget and expert cache (`k3serve.stream.shard_source`). The front runs the model with an
`ExpertParallelSource`, whose `expert_outputs` capability (model/weights.py) takes over the routed experts of each
MoE layer:

    pairs (token, expert) of the step, sorted by expert (model/moe.py)  ->  owner o gets the contiguous run of pairs
    whose expert it owns: the latent rows z[u] [U_o, LT] of the distinct tokens u of that run, the pairs' local
    token indices, expert ids and run bounds; it returns y [N_o, LT], one row per pair
    front: y = concat_o y_o [N, LT]; mixed[t] += w * y[n] in pair order (the one-process accumulation)

One call per owner that has pairs, per MoE layer, per step; all calls of a layer in flight at once. Owners return
unweighted rows, one per pair, rather than per-token sums: the weighted sum is then added in exactly the order one
process adds it, so the output is the same bits (a per-owner partial sum would reorder float additions). Network
bytes per pair: LT x 4 back, plus LT x 4 per distinct token and owner out.

The transport is a parameter (`OwnerTransport`): `cluster/expert_actors.py` runs the owners as Ray actors; tests
and a one-machine check can run `ExpertOwnerCore`s in this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from k3serve.errors import K3Error
from k3serve.model.expert_source import NetworkStats, SourceStats, StreamStats
from k3serve.model.moe import expert_outputs
from k3serve.model.routing import ExpertPairs
from k3serve.model.weights import ExpertWeights, ForwardingSource, WeightSource
from k3serve.stream.shard_source import ShardExpertSource, ShardOptions
from k3serve.weights.shard import ExpertShard, check_shard_count
from k3serve.weights.store import config_fingerprint


@dataclass(frozen=True)
class OwnerCall:
    """What one owner computes for one MoE layer of one step."""

    owner: int
    step: int
    step_tokens: int
    layer: int
    expert_ids: np.ndarray  # [K_o] ascending, all owned by `owner`
    z: np.ndarray  # [U_o, LT] latent rows of the distinct tokens routed to those experts
    tokens: np.ndarray  # [N_o] rows of z, one per (token, expert) pair, grouped by expert
    starts: np.ndarray  # [K_o]
    ends: np.ndarray  # [K_o]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.expert_ids, self.z, self.tokens, self.starts, self.ends))


def split_by_owner(expert_ids: np.ndarray, z: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                   experts_per_owner: int, step: int = 0, step_tokens: int = 0, layer: int = 0) -> list[OwnerCall]:
    """The calls of one MoE layer: expert_ids [K] ascending with pair runs starts/ends into tokens [N] (rows of
    z [T, LT]) -> one `OwnerCall` per owner with pairs, in owner order; their pairs, concatenated, are the N pairs
    in order."""
    calls = []
    owners = expert_ids // experts_per_owner  # [K], non-decreasing
    for owner in np.unique(owners):
        k0, k1 = np.searchsorted(owners, owner, "left"), np.searchsorted(owners, owner, "right")
        p0, p1 = int(starts[k0]), int(ends[k1 - 1])
        distinct, local = np.unique(tokens[p0:p1], return_inverse=True)  # [U_o], [N_o]
        calls.append(OwnerCall(owner=int(owner), step=step, step_tokens=step_tokens, layer=layer,
                               expert_ids=np.ascontiguousarray(expert_ids[k0:k1], dtype=np.int64),
                               z=np.ascontiguousarray(z[distinct]), tokens=local.astype(np.int64).reshape(-1),
                               starts=np.ascontiguousarray(starts[k0:k1] - p0, dtype=np.int64),
                               ends=np.ascontiguousarray(ends[k0:k1] - p0, dtype=np.int64)))
    return calls


@dataclass(frozen=True)
class OwnerInfo:
    index: int
    pid: int
    node: str
    shard: str  # "i/N"
    experts: tuple[int, int]  # owned ids [start, stop)
    config_sha256: str
    slots: int
    cache_bytes: int
    shard_bytes: int  # every blob of the shard (its experts.bin)


class ExpertOwnerCore:
    """One owner's state and math, whatever runs it: its shard under its budget, and the expert outputs of a call.
    Step boundaries come from the front (`call.step`), so retention is judged per front step."""

    def __init__(self, shard_path: str, options: ShardOptions, index: int) -> None:
        import os
        import socket

        shard = ExpertShard(shard_path)
        if shard.shard.index != index:
            raise K3Error(f"owner {index} opened {shard_path}, which is shard {shard.shard}")
        self.source = ShardExpertSource(shard, options)
        self._step = -1
        self.info = OwnerInfo(index=index, pid=os.getpid(), node=socket.gethostname(), shard=str(shard.shard),
                              experts=(shard.owned.start, shard.owned.stop),
                              config_sha256=config_fingerprint(shard.config), slots=self.source.num_slots,
                              cache_bytes=self.source.cache_bytes,
                              shard_bytes=shard.num_experts_total * shard.expert_stride)

    def run(self, call: OwnerCall) -> np.ndarray:
        """y [N_o, LT] for the call's pairs."""
        if call.step != self._step:
            self._step = call.step
            self.source.begin_step(call.step_tokens)
        return expert_outputs(self.source.config, lambda ids: self.source.experts(call.layer, ids), call.expert_ids,
                              call.z, call.tokens, call.starts, call.ends)

    def stats(self) -> StreamStats:
        stream = self.source.stats().stream
        assert stream is not None  # a shard source always streams
        return stream

    def check_integrity(self) -> None:
        self.source.check_integrity()

    def close(self) -> None:
        self.source.close()


class OwnerTransport(Protocol):
    """Runs calls on their owners, all at once, and returns each call's y in the calls' order."""

    restarts: list[int]  # times each owner died and was restarted

    def run_all(self, calls: Sequence[OwnerCall]) -> list[np.ndarray]: ...

    def stats(self, timeout: float | None = None) -> list[StreamStats]: ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...


class LocalOwners:
    """Owners in this process, called one after another (tests; a one-machine check without Ray)."""

    def __init__(self, owners: Sequence[ExpertOwnerCore]) -> None:
        self.owners = list(owners)
        self.infos = [o.info for o in self.owners]
        self.restarts = [0] * len(self.owners)  # in-process owners are never restarted

    def run_all(self, calls: Sequence[OwnerCall]) -> list[np.ndarray]:
        return [self.owners[c.owner].run(c) for c in calls]

    def stats(self, timeout: float | None = None) -> list[StreamStats]:
        return [o.stats() for o in self.owners]

    def check_integrity(self) -> None:
        for owner in self.owners:
            owner.check_integrity()

    def close(self) -> None:
        for owner in self.owners:
            owner.close()


class ExpertParallelSource(ForwardingSource):
    """The front's source: the trunk from `inner` (any source: a streaming source over the packed store), the
    routed experts from the owners. `inner` is never asked for an expert."""

    def __init__(self, inner: WeightSource, owners: OwnerTransport, infos: Sequence[OwnerInfo]) -> None:
        super().__init__(inner)
        config = inner.config
        self.count = len(infos)
        check_shard_count(config.num_experts, self.count)
        self.experts_per_owner = config.num_experts // self.count
        fingerprint = config_fingerprint(config)
        for i, info in enumerate(infos):
            if info.index != i or info.experts != (i * self.experts_per_owner, (i + 1) * self.experts_per_owner):
                raise K3Error(f"owner {i} holds shard {info.shard} (experts {info.experts[0]}..{info.experts[1] - 1})"
                              f"; expert parallelism over {self.count} owners needs shard {i}/{self.count}")
            if info.config_sha256 != fingerprint:
                raise K3Error(f"owner {i}'s shard was packed from another model than the front's store")
        self.owners = owners
        self.infos = list(infos)
        self.network = NetworkStats(per_owner_calls=[0] * self.count)
        self._step = -1
        self._step_tokens = 0

    def begin_step(self, num_tokens: int) -> None:
        self.inner.begin_step(num_tokens)
        self._step += 1
        self._step_tokens = num_tokens

    def supports_nested_forward(self) -> bool:
        return False  # the owners' calls carry the step they belong to

    def expert_outputs(self, layer: int, pairs: ExpertPairs, z: np.ndarray) -> np.ndarray:
        calls = split_by_owner(pairs.expert_ids, z, pairs.tokens, pairs.starts, pairs.ends, self.experts_per_owner,
                               self._step, self._step_tokens, layer)
        started = time.perf_counter()
        outputs = self.owners.run_all(calls)
        net = self.network
        net.wait_seconds += time.perf_counter() - started
        net.layers += 1
        net.calls += len(calls)
        for call, y in zip(calls, outputs):
            net.per_owner_calls[call.owner] += 1
            net.bytes_sent += call.nbytes
            net.bytes_received += y.nbytes
            if y.shape != (call.tokens.shape[0], z.shape[1]):
                raise K3Error(f"owner {call.owner} returned {y.shape} outputs for {call.tokens.shape[0]} pairs")
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)  # [N, LT]

    def experts(self, layer: int, expert_ids: Sequence[int]) -> dict[int, ExpertWeights]:
        raise K3Error("with expert parallelism the experts live on their owners; the front computes none")

    def stacked_experts(self, layer: int) -> Any:
        return None

    @property
    def prefetching(self) -> bool:
        return False  # the front holds no experts (an owner's own read-ahead is future work)

    def resident_experts(self, layer: int) -> set[int] | None:
        return None

    def stats(self, timeout: float | None = None) -> SourceStats:
        """The front's trunk reads, each owner's counters since it last started, the calls and the restarts."""
        return SourceStats(stream=self.inner.stats().stream, owners=tuple(self.owners.stats(timeout)),
                           network=self.network, owner_restarts=tuple(self.owners.restarts))

    def local_stats(self) -> StreamStats | None:
        """The front's own reads (the trunk); the owners' expert reads are theirs, not charged per request."""
        return self.inner.local_stats()

    def describe(self) -> str:
        return f"expert-parallel x{self.count} (trunk: {self.inner.describe()})"

    def check_integrity(self) -> None:
        self.inner.check_integrity()
        self.owners.check_integrity()

    def close(self) -> None:
        try:
            self.owners.close()
        finally:
            self.inner.close()


def trunk_budget(store) -> int:
    """The front's budget when none is given: every trunk layer pinned, plus the top-k expert slots a streaming
    source always plans (they stay unused: the front reads no expert)."""
    c = store.config
    return (store.globals.float32_bytes + sum(blob.float32_bytes for blob in store.layers)
            + c.num_experts_per_token * store.expert_stride)
