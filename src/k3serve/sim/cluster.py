"""The simulator's cluster mode: expert parallelism (`cluster/expert_parallel.py`) over N owner nodes, each with its
own RAM, disk and expert cache, the trunk on a front node; the same code as the single-box run on every node.

- The front is `sim/full.py`'s run under its own budget (`plan_budget`: the trunk pinned or streamed, as the
  engine's front `StreamingSource`), with no prefetch (the engine refuses it: the front holds no experts). Each MoE
  layer's routed experts go to the owners instead of its cache.
- Owner i of N holds shard i/N (`weights/shard.py`: experts [i NE/N, (i+1) NE/N) of every MoE layer, laid out layer
  by layer in ascending id, as `pack_shard` writes them), under the engine's `shard_slots` budget rule, with its own
  clock, device, I/O engine and `ExpertCache`, and serves a call with `ExpertWork` (groups of at most its slots,
  reads then compute), as `ExpertOwnerCore.run` does through `ExpertSlots`.
- The calls are the engine's: `pairs_by_expert` then `split_by_owner`, one call per owner with pairs per MoE layer
  per step; bytes out `OwnerCall.nbytes` (latent rows of the distinct tokens, pair indices, expert ids and runs),
  bytes back N_o x LT x 4 (one float32 row per pair): what the engine's `NetworkStats` counts.

Time of one MoE layer, on the front's clock (`network`: a link of `bytes_per_s` per node, `call_latency_s` per call):

    call o, in owner order: the front's work on it (half its per-call overhead), then its bytes over the front's
        link out, then latency / 2
    owner o starts at max(its clock, that arrival), loads and computes (its reads on its own disk)
    its reply, first done first: latency / 2, its bytes over the front's link in, then the front's work on it (the
        other half of the overhead; one queue with the sends)
    the front continues when the last reply is done

so a layer costs the slowest owner plus the transfers, one call latency and the calls' overheads one after another:
the owners work in parallel. With
`one_box` every owner reads from the front's device (one disk shared, as `bench_expert_parallel.py` runs them on one
machine), and with `one_box_cores` their compute shares that many cores.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from k3serve.cluster.expert_parallel import split_by_owner
from k3serve.model.expert_source import NetworkStats
from k3serve.config import K3Config
from k3serve.model.routing import pairs_by_expert
from k3serve.sim.device import SimClock, SimCores, SimDevice, SimIOEngine, VirtualBuffer
from k3serve.sim.full import ExpertWork, SimConfig, SimConfigError, SimResult, SimRun, drive_run, run_result
from k3serve.sim.machine import Machine, NetworkModel
from k3serve.units import format_size
from k3serve.stream.cache import POLICIES
from k3serve.stream.expert_cache import ExpertCache
from k3serve.stream.shard_source import shard_slots
from k3serve.model.expert_source import StreamStats
from k3serve.weights.shard import ShardLayerIndex, ShardSpec, check_shard_count

OWNER_FIGURES = 6  # per owner in a snapshot: bytes read, reads, requests, retained, I/O wait, compute


@dataclass(frozen=True)
class ClusterConfig:
    front: SimConfig  # the front's machine, RAM, model, routing, steps; its prefetch must be "none"
    num_nodes: int  # expert owners (N); must divide the experts per layer
    node_ram_bytes: int | None = None  # each owner's expert cache budget; None: its whole shard
    network: NetworkModel | None = None  # None: the front machine's [network]
    node_policy: str = "lru"  # the owners' cache policy (the engine's ShardOptions default)
    node_queue_depth: int = 16
    node_machine: Machine | None = None  # the owners' disk and kernels; None: the front's machine
    one_box: bool = False  # every owner reads from the front's device
    one_box_cores: int | None = None  # with one_box: the cores the owners' compute shares (None: one each)

    def __post_init__(self) -> None:
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise SimConfigError(f"a cluster needs at least 1 expert owner node, got {self.num_nodes!r}")
        if self.node_ram_bytes is not None and self.node_ram_bytes <= 0:
            raise SimConfigError(f"an owner's RAM must be positive, got {self.node_ram_bytes}")
        if self.node_policy not in POLICIES or self.node_policy == "pinned":
            raise SimConfigError(f"expert owners take policy none, lru, lfu or s3fifo, got {self.node_policy!r}")
        if not 1 <= self.node_queue_depth <= 1024:
            raise SimConfigError(f"an owner's queue depth must be 1..1024, got {self.node_queue_depth}")
        if self.front.engine != "k3serve":
            raise SimConfigError("the cluster mode simulates k3serve's expert parallelism (engine k3serve)")
        if self.front.prefetch != "none":
            raise SimConfigError("with expert parallelism the front holds no experts: its prefetch must be 'none'")
        if self.one_box_cores is not None and (not self.one_box or self.one_box_cores < 1):
            raise SimConfigError(f"one_box_cores needs one_box and at least 1 core, got {self.one_box_cores!r}")
        if self.network is None and self.front.machine.network is None:
            raise SimConfigError(f"machine {self.front.machine.name!r} has no [network] table: give a network "
                                 "(a preset such as 10gbe, or a machine file with bytes_per_s and call_latency_s)")

    @property
    def link(self) -> NetworkModel:
        link = self.network or self.front.machine.network
        assert link is not None
        return link


class VirtualShard:
    """What `shard_slots` and `ExpertCache` read of an `ExpertShard`, without the file: shard i/N's experts at the
    offsets `pack_shard` gives them (layer by layer in MoE layer order, owned ids ascending, one stride each)."""

    def __init__(self, config: K3Config, spec: ShardSpec, expert_blob_size: int, expert_stride: int) -> None:
        self.config = config
        self.shard = spec
        self.owned = spec.experts(config.num_experts)
        self.expert_path = Path(f"<virtual shard {spec}>")
        self.expert_blob_size = expert_blob_size
        self.expert_stride = expert_stride
        per = len(self.owned)
        self.experts = {layer: ShardLayerIndex({e: (j * per + r) * expert_stride for r, e in enumerate(self.owned)},
                                               {e: 0 for e in self.owned})
                        for j, layer in enumerate(config.moe_layer_ids)}

    @property
    def num_experts_total(self) -> int:
        return len(self.owned) * len(self.experts)


class _Owner:
    """One expert owner: its shard under its budget, on its own clock and (unless one box) its own device."""

    def __init__(self, shard: VirtualShard, machine: Machine, device: SimDevice | None, cores: SimCores | None,
                 ram_bytes: int | None, policy: str, queue_depth: int) -> None:
        self.shard = shard
        self.clock = SimClock()
        self.device = device or SimDevice(machine.disk)
        self.stats = StreamStats()
        self.io = SimIOEngine(str(shard.expert_path), self.clock, self.device, queue_depth)
        slots = shard_slots(shard, ram_bytes)
        self.cache = ExpertCache(shard, self.io, slots, policy, self.stats,
                                 slot_buffer=lambda _i: VirtualBuffer(shard.expert_stride),
                                 top_k=shard.config.num_experts_per_token)
        self.work = ExpertWork(shard.config, machine.compute, self.clock, self.io, self.cache, shard.expert_blob_size,
                               cores)
        self._step = -1

    def run(self, step: int, layer: int, rows_of: dict[int, int], arrives: float) -> tuple[float, float]:
        """Serve one call arriving at `arrives`; returns (start, done) on the owner's clock."""
        self.clock.idle_until(arrives)
        start = self.clock.now
        if step != self._step:  # as ExpertOwnerCore: a new front step begins with its first call
            self._step = step
            self.stats.steps += 1
            self.cache.begin_step()
        self.work.serve(layer, rows_of, _ignore)
        return start, self.clock.now

    def figures(self) -> tuple[float, ...]:
        return (self.io.counters.bytes_read, self.io.counters.num_reads, self.stats.expert_requests,
                self.stats.expert_retained, self.clock.io_wait, self.clock.compute)


def _ignore(*_args, **_kwargs) -> None:
    """Owners keep no per-layer timeline."""


class _ClusterRun(SimRun):
    def __init__(self, cc: ClusterConfig) -> None:
        super().__init__(cc.front)
        config = self.config
        check_shard_count(config.num_experts, cc.num_nodes)
        self.link = cc.link
        self.experts_per_owner = config.num_experts // cc.num_nodes
        machine = cc.node_machine or cc.front.machine
        cores = SimCores(cc.one_box_cores) if cc.one_box_cores else None
        self.owners = [_Owner(VirtualShard(config, ShardSpec(i, cc.num_nodes), self.store.expert_blob_size,
                                           self.store.expert_stride),
                              machine, self.device if cc.one_box else None, cores, cc.node_ram_bytes, cc.node_policy,
                              cc.node_queue_depth)
                       for i in range(cc.num_nodes)]
        self.network = NetworkStats(per_owner_calls=[0] * cc.num_nodes)
        self.network_seconds = 0.0  # front blocked on calls beyond the slowest owner's own work
        self._link_out = 0.0  # when the front's link is next free, each direction
        self._link_in = 0.0
        self._front_free = 0.0  # when the front's per-call work (both directions, one queue) is next free

    def routed_experts(self, layer: int, rows: np.ndarray) -> None:
        """rows [T, TOPK] -> one call per owner with pairs, all in flight at once; the front waits for the last."""
        c, link = self.config, self.link
        pairs = pairs_by_expert(rows)
        z = np.zeros((rows.shape[0], c.latent_size), np.float32)  # [T, LT]: the latent rows' size is what counts
        calls = split_by_owner(pairs.expert_ids.astype(np.int64), z, pairs.tokens, pairs.starts.astype(np.int64),
                               pairs.ends.astype(np.int64), self.experts_per_owner, self.stats.steps, rows.shape[0],
                               layer)
        half, overhead = link.call_latency_s / 2, link.call_overhead_s / 2
        sent = self.clock.now
        spans, replies = [], []
        for call in calls:
            self._front_free = max(self._front_free, sent) + overhead
            self._link_out = max(self._link_out, self._front_free) + call.nbytes / link.bytes_per_s
            rows_of = {int(e): int(b - a) for e, a, b in zip(call.expert_ids, call.starts, call.ends)}
            start, done = self.owners[call.owner].run(self.stats.steps, layer, rows_of, self._link_out + half)
            spans.append(done - start)
            replies.append((done, call.tokens.shape[0] * c.latent_size * 4))  # y [N_o, LT] float32
            net = self.network
            net.calls += 1
            net.per_owner_calls[call.owner] += 1
            net.bytes_sent += call.nbytes
        last = sent
        for done, nbytes in sorted(replies):
            self._link_in = max(self._link_in, done + half) + nbytes / link.bytes_per_s
            self._front_free = max(self._front_free, self._link_in) + overhead
            last = max(last, self._front_free)
            self.network.bytes_received += nbytes
        self.network.layers += 1
        self.clock.wait_for_calls(last)
        self.network_seconds += (last - sent) - max(spans, default=0.0)
        self._note(layer, expert_wait=last - sent)

    def snapshot(self) -> tuple:
        net = self.network
        owners = [v for owner in self.owners for v in owner.figures()]
        return (*super().snapshot(), self.clock.remote_wait, self.network_seconds, net.bytes_sent,
                net.bytes_received, net.calls, *owners)


@dataclass
class NodeFigures:
    node: int
    experts: tuple[int, int]  # owned ids [start, stop)
    slots: int
    cache_bytes: int
    shard_bytes: int
    expert_bytes_per_token: float
    reads_per_token: float
    expert_requests_per_token: float
    retention: float
    io_seconds_per_token: float
    compute_seconds_per_token: float


@dataclass
class ClusterResult:
    num_nodes: int
    network: dict
    front: SimResult  # s/token, the trunk's bytes and waits; its `io_seconds` are trunk waits only
    nodes: list[NodeFigures]
    s_per_token: float
    tok_per_s: float
    network_bytes_per_token: float
    network_sent_per_token: float
    network_received_per_token: float
    calls_per_token: float
    owner_wait_seconds_per_token: float  # the front blocked on owner calls (owners' work + network)
    network_seconds_per_token: float  # the part of that wait beyond the slowest owner's own work, per layer
    totals: dict = field(default_factory=dict)  # exact counts over the measured steps, per owner and network

    def to_dict(self) -> dict:
        out = asdict(self)
        out["front"] = self.front.to_dict()
        return out

    def lines(self) -> list[str]:
        f = self.front
        per_node = " ".join(format_size(n.expert_bytes_per_token) for n in self.nodes)
        retention = " ".join(f"{n.retention:.2f}" for n in self.nodes)
        return [
            f"front             {f.plan['summary']}",
            f"owners            {self.num_nodes} x {self.nodes[0].slots} expert slots "
            f"({format_size(self.nodes[0].cache_bytes)} of a {format_size(self.nodes[0].shard_bytes)} shard each)",
            f"time/token        {self.s_per_token:.3f} s ({self.tok_per_s:.3f} tok/s): front compute "
            f"{f.compute_seconds_per_token:.3f} s, trunk I/O wait {f.io_seconds_per_token:.3f} s, waiting on owners "
            f"{self.owner_wait_seconds_per_token:.3f} s (network and call latency {self.network_seconds_per_token:.3f} s)",
            f"front read/token  {format_size(f.trunk_bytes_per_token)} of trunk",
            f"owner read/token  {per_node} (all: {format_size(sum(n.expert_bytes_per_token for n in self.nodes))})",
            f"owner retention   {retention}",
            f"owner time/token  I/O wait max {max(n.io_seconds_per_token for n in self.nodes):.3f} s, compute max "
            f"{max(n.compute_seconds_per_token for n in self.nodes):.3f} s",
            f"network/token     {format_size(self.network_bytes_per_token)} (out {format_size(self.network_sent_per_token)}"
            f", back {format_size(self.network_received_per_token)}), {self.calls_per_token:.1f} calls",
        ]


def simulate_cluster(cc: ClusterConfig) -> ClusterResult:
    """Run the cluster and return per-token figures over the same steps `simulate` measures."""
    run = _ClusterRun(cc)
    d, step_times, tokens = drive_run(run)
    base = len(d) - 5 - OWNER_FIGURES * cc.num_nodes
    front = run_result(run, d[:base], step_times, tokens)
    remote_wait, network_seconds, sent, received, calls = d[base:base + 5]
    per = max(tokens, 1e-9)
    nodes, totals = [], {"bytes_sent": sent, "bytes_received": received, "calls": calls, "owners": []}
    for i, owner in enumerate(run.owners):
        nbytes, reads, requests, retained, io_wait, compute = d[base + 5 + OWNER_FIGURES * i:
                                                                base + 5 + OWNER_FIGURES * (i + 1)]
        shard = owner.shard
        nodes.append(NodeFigures(
            node=i, experts=(shard.owned.start, shard.owned.stop), slots=owner.cache.num_slots,
            cache_bytes=owner.cache.num_slots * shard.expert_stride,
            shard_bytes=shard.num_experts_total * shard.expert_stride, expert_bytes_per_token=nbytes / per,
            reads_per_token=reads / per, expert_requests_per_token=requests / per,
            retention=retained / requests if requests else math.nan, io_seconds_per_token=io_wait / per,
            compute_seconds_per_token=compute / per))
        totals["owners"].append({"expert_bytes": nbytes, "num_reads": reads, "expert_requests": requests,
                                 "expert_retained": retained})
    return ClusterResult(
        num_nodes=cc.num_nodes, network=asdict(cc.link), front=front, nodes=nodes, s_per_token=front.s_per_token,
        tok_per_s=front.tok_per_s, network_bytes_per_token=(sent + received) / per, network_sent_per_token=sent / per,
        network_received_per_token=received / per, calls_per_token=calls / per,
        owner_wait_seconds_per_token=remote_wait / per, network_seconds_per_token=network_seconds / per,
        totals=totals)


__all__ = ["ClusterConfig", "ClusterResult", "NodeFigures", "VirtualShard", "simulate_cluster"]
