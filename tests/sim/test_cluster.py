"""The simulator's cluster mode: the same expert reads per owner and the same network bytes as the real
expert-parallel engine on the same trace (exact), a deterministic clock, and clear errors for impossible clusters."""

from __future__ import annotations

import json

import pytest

from k3serve.cli.main import main
from k3serve.cluster.expert_parallel import ExpertOwnerCore, ExpertParallelSource, LocalOwners, trunk_budget
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.model.k3 import K3Model
from k3serve.sim.cluster import ClusterConfig, VirtualShard, simulate_cluster
from k3serve.sim.full import SimConfig, SimConfigError, VirtualStore, replay_config
from k3serve.sim.machine import MachineError, NetworkModel, load_machine
from k3serve.sim.presets import NETWORKS, laptop
from k3serve.stream.budget import BudgetError
from k3serve.stream.options import StreamOptions
from k3serve.stream.shard_source import ShardOptions
from k3serve.stream.source import StreamingSource
from k3serve.stream.trace import read_trace
from k3serve.weights.shard import ExpertShard, ShardSpec

TEN_GBE = NETWORKS["10gbe"]


@pytest.mark.parametrize("count,owner_slots,policy", [(2, 3, "lru"), (2, 7, "s3fifo"), (4, 2, "lru"),
                                                      (4, 5, "lfu"), (2, None, "none")])
def test_cluster_reads_and_sends_what_the_engine_does(tiny_shards, tmp_path, count, owner_slots, policy):
    packed, shards = tiny_shards
    budget = None if owner_slots is None else owner_slots * packed.expert_stride
    options = ShardOptions(ram_budget=budget, io="pread", queue_depth=4, cache=policy)
    owners = LocalOwners([ExpertOwnerCore(str(path), options, i) for i, path in enumerate(shards[count])])
    trace_path = tmp_path / "ep.trace"
    front_budget = trunk_budget(packed)
    source = ExpertParallelSource(StreamingSource(packed, StreamOptions(ram_budget=front_budget, io="pread",
                                                                        queue_depth=4, trace_out=trace_path,
                                                                        trunk_dtype="float32")),
                                  owners, owners.infos)
    generate(K3Model(source), [1, 5, 9, 200, 17, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    real, net = source.stats().owners, source.network
    source.close()
    front_real = source.inner.stats().stream
    assert all(s.expert_misses > 0 for s in real) and net.calls > net.layers > 0
    assert policy in ("none", "lru") or any(s.expert_retained > 0 for s in real)

    front = replay_config(read_trace(trace_path), laptop(), store=VirtualStore.from_store(packed),
                          ram_bytes=front_budget, prefetch="none", queue_depth=4, count_prefill=True,
                          trunk_dtype="float32")
    result = simulate_cluster(ClusterConfig(front, count, budget, TEN_GBE, node_policy=policy, node_queue_depth=4))
    for i, (sim, stats) in enumerate(zip(result.totals["owners"], real)):
        assert (sim["expert_bytes"], sim["num_reads"], sim["expert_requests"], sim["expert_retained"]) == \
            (stats.expert_bytes_read, stats.num_reads, stats.expert_requests, stats.expert_retained), f"owner {i}"
        assert result.nodes[i].slots == owners.infos[i].slots
    assert (result.totals["bytes_sent"], result.totals["bytes_received"], result.totals["calls"]) == \
        (net.bytes_sent, net.bytes_received, net.calls)
    assert result.front.totals["trunk_bytes"] == front_real.trunk_bytes_read
    assert result.front.totals["expert_bytes"] == 0  # the front reads no expert
    assert result.s_per_token > 0 and result.owner_wait_seconds_per_token > 0


def test_virtual_shard_has_the_packed_shards_offsets(tiny_shards):
    packed, shards = tiny_shards
    for i, path in enumerate(shards[4]):
        real = ExpertShard(path)
        virtual = VirtualShard(packed.config, ShardSpec(i, 4), packed.expert_blob_size, packed.expert_stride)
        assert virtual.owned == real.owned and virtual.num_experts_total == real.num_experts_total
        assert {l: e.offsets for l, e in virtual.experts.items()} == {l: e.offsets for l, e in real.experts.items()}


def _k3(nodes: int = 8, node_ram: int | None = 8 << 30, **front) -> ClusterConfig:
    base = dict(machine=laptop(), ram_bytes=16 << 30, trunk_dtype="bf16", prefetch="none", tokens=2, warmup=1)
    return ClusterConfig(SimConfig(**{**base, **front}), nodes, node_ram, TEN_GBE)


def test_cluster_clock_is_deterministic_and_owners_split_the_reads():
    a, b = simulate_cluster(_k3(seed=5)), simulate_cluster(_k3(seed=5))
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())  # as text: the front's retention is NaN (no requests)
    assert simulate_cluster(_k3(seed=6)).front.step_seconds != a.front.step_seconds
    # every owner reads its share of 16 x 92 cold requests a token; the network carries latent rows only
    assert sum(n.expert_requests_per_token for n in a.nodes) == pytest.approx(16 * 92)
    assert all(n.expert_bytes_per_token > 0 for n in a.nodes)
    assert a.network_received_per_token == pytest.approx(16 * 92 * 3584 * 4)
    # more owners: each reads less, and the slowest owner's wait shrinks
    four = simulate_cluster(_k3(nodes=4, seed=5))
    assert max(n.expert_bytes_per_token for n in a.nodes) < max(n.expert_bytes_per_token for n in four.nodes)
    assert a.owner_wait_seconds_per_token < four.owner_wait_seconds_per_token


def test_a_slower_network_costs_time_not_bytes():
    fast = _k3(ram_bytes=128 << 30)  # the trunk resident: nothing on the front overlaps the calls
    slow = ClusterConfig(fast.front, 8, 8 << 30, NetworkModel(bytes_per_s=50e6, call_latency_s=5e-3))
    a, b = simulate_cluster(fast), simulate_cluster(slow)
    assert b.network_bytes_per_token == a.network_bytes_per_token
    assert b.s_per_token > a.s_per_token + 92 * 5e-3 * 0.9
    assert b.network_seconds_per_token > a.network_seconds_per_token
    # the front's own work per call queues: a layer's calls pay it one after another, not side by side (the owners
    # work meanwhile)
    queued = ClusterConfig(fast.front, 8, 8 << 30, NetworkModel(bytes_per_s=1.175e9, call_latency_s=0.0,
                                                                call_overhead_s=40e-3))
    c = simulate_cluster(queued)
    assert c.owner_wait_seconds_per_token >= 0.999 * c.calls_per_token * 40e-3


@pytest.mark.parametrize("make,error,message", [
    (lambda: _k3(nodes=3), ConfigError, "3 shards do not divide the model's 896 experts"),
    (lambda: _k3(nodes=0), SimConfigError, "at least 1 expert owner"),
    (lambda: _k3(nodes=True), SimConfigError, "at least 1 expert owner"),
    (lambda: _k3(node_ram=-1), SimConfigError, "owner's RAM must be positive"),
    (lambda: _k3(node_ram=100 << 20), BudgetError, "at least 16"),
    (lambda: _k3(prefetch="next-layer"), SimConfigError, "prefetch must be 'none'"),
    (lambda: _k3(ram_bytes=1 << 30), BudgetError, "minimum"),
    (lambda: ClusterConfig(SimConfig(machine=laptop(), prefetch="none"), 8), SimConfigError, "no \\[network\\]"),
    (lambda: ClusterConfig(_k3().front, 8, None, TEN_GBE, node_policy="pinned"), SimConfigError, "owners take"),
])
def test_impossible_clusters_are_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        simulate_cluster(make())


def test_network_tables_in_machine_files(tmp_path):
    raw = laptop().to_dict()
    raw["network"] = {"bytes_per_s": 1e9, "call_latency_s": 1e-4}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    assert load_machine(path).network == NetworkModel(1e9, 1e-4)
    for bad, message in (({"bytes_per_s": 0, "call_latency_s": 0}, "positive"),
                         ({"bytes_per_s": 1e9}, "optionally"), ({"bytes_per_s": 1e9, "call_latency_s": -1}, ">= 0"),
                         ({"bytes_per_s": 1e9, "call_latency_s": 0, "call_overhead_s": -1}, "call_overhead_s")):
        raw["network"] = bad
        path.write_text(json.dumps(raw))
        with pytest.raises(MachineError, match=message):
            load_machine(path)


def test_cli_prints_a_row_per_cluster_and_refuses_bad_counts(tmp_path, capsys):
    out, plot = tmp_path / "c.json", tmp_path / "c.svg"
    assert main(["sim", "cluster", "--nodes", "4,8", "--ram", "8G", "--front-ram", "1G,16G", "--tokens", "1",
                 "--warmup", "0", "--json", str(out), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "does not run" in text and "minimum" in text  # a 1 GB front cannot hold k3serve's trunk minimum
    records = json.loads(out.read_text())
    ran = [r for r in records if "error" not in r]
    assert [(r["num_nodes"], r["front_ram"]) for r in ran] == [(4, "16G"), (8, "16G")]
    for r in ran:
        assert r["s_per_token"] > 0 and r["network_bytes_per_token"] > 0 and len(r["nodes"]) == r["num_nodes"]
    assert plot.read_text().startswith("<svg")
    assert main(["sim", "cluster", "--nodes", "3"]) == 2
    assert "do not divide" in capsys.readouterr().err
    assert main(["sim", "cluster", "--nodes", "eight"]) == 2
    assert main(["sim", "cluster", "--network", "carrier-pigeon"]) == 2
