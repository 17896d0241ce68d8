"""Machine presets, each with the sources of its figures (docs/SIMULATOR.md explains every number).

- `c-engine`: the machine kimi-k3-in-c published its K3 figures on (124 cores, a fast NVMe drive), with the
  compute of the engine version that produced the memory ladder and the trunk-vs-cache split.
- `c-engine-v1`: the same machine with its v1.0.0 compute ("the math per token about 8x lighter").
- `laptop`: a commodity NVMe laptop (PCIe 4 TLC drive, 8 performance cores, dual-channel DDR5).
- `this-machine`: this project's 2-core VM: the disk as `k3serve sim probe-disk` measured it
  (docs/sim/this-machine-disk.json; the QD16 points that fell below QD4 under load are held at the QD4 value);
  compute rough (probe-cpu ran under heavy load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from k3serve.sim.machine import ComputeModel, DiskModel, Machine, MachineError, NetworkModel, load_machine

GB = 1e9
MB = 1e6
EXPERT = 17_547_264  # one K3 expert blob


def c_engine(compute_seconds_per_token: float = 3.85, name: str = "c-engine") -> Machine:
    """kimi-k3-in-c's machine. Disk: its run report reads 25.83 GB of 17.55 MB O_DIRECT expert reads in 5.06 s
    (5,104 MB/s, queue depth up to 16); its two identical 8-token runs moved the same 374.99 GB of mixed trunk
    and expert reads at 2,709 and 5,874 MB/s (the device, not the engine, varied 2.17x); large trunk reads are
    set to 5.87 GB/s (the faster of the two). Compute: its steady decode step at 110 GB trunk / 13 GB cache
    took 8.9 s with 5.06 s of expert reads, so 3.85 s of arithmetic for 108.81 GB of bf16 trunk and 25.83 GB
    of experts: 32 GB/s over both (v1.0.0: 0.48 s, 8x lighter)."""
    bytes_per_token = 108.81 * GB + 25.83 * GB
    rate = bytes_per_token / compute_seconds_per_token
    disk = DiskModel(
        sizes=(4096, 1 << 20, EXPERT, 1 << 30),
        queue_depths=(1, 4, 16),
        throughput=((0.15 * GB, 0.55 * GB, 1.6 * GB),
                    (1.0 * GB, 3.0 * GB, 4.5 * GB),
                    (1.6 * GB, 4.0 * GB, 5.104 * GB),
                    (5.874 * GB, 5.874 * GB, 5.874 * GB)),
    )
    compute = ComputeModel(dense_bytes_per_s=rate, dense_flops=4.0e12, expert_bytes_per_s=rate,
                           expert_flops=4.0e12, attention_s_per_token_layer=0.0, layer_overhead_s=0.0,
                           widen_bytes_per_s=20 * GB)
    return Machine(name, disk, compute, "kimi-k3-in-c's published machine: 124 cores, fast NVMe",
                   "openchat-ai/kimi-k3-in-c README (run reports, memory ladder, replication) and "
                   "docs/notes/decode-walltime-budget.md")


def c_engine_v1() -> Machine:
    return c_engine(0.48, "c-engine-v1")


def laptop() -> Machine:
    """A commodity NVMe laptop: a PCIe 4 TLC drive (about 7 GB/s sequential reads, 60 MB/s of 4 KiB reads at
    queue depth 1, 700 MB/s at 16), 8 performance cores and dual-channel DDR5 (about 60 GB/s; a decode matvec
    reaches about half). Expert kernel: this machine's measured MXFP4 rate per core x 8 cores (probe-cpu)."""
    disk = DiskModel(
        sizes=(4096, 1 << 20, EXPERT, 1 << 30),
        queue_depths=(1, 4, 16),
        throughput=((0.06 * GB, 0.22 * GB, 0.7 * GB),
                    (1.2 * GB, 3.5 * GB, 5.5 * GB),
                    (2.0 * GB, 5.0 * GB, 6.2 * GB),
                    (6.5 * GB, 6.8 * GB, 6.8 * GB)),
    )
    compute = ComputeModel(dense_bytes_per_s=30 * GB, dense_flops=1.0e12, expert_bytes_per_s=8 * GB,
                           expert_flops=0.4e12, attention_s_per_token_layer=2e-4, layer_overhead_s=5e-4,
                           widen_bytes_per_s=8 * GB)
    return Machine("laptop", disk, compute, "commodity NVMe laptop (PCIe 4, 8 cores, DDR5)",
                   "typical datasheet figures; kernel rates scaled from this machine's probe-cpu")


def this_machine() -> Machine:
    """This project's VM (2-core AMD EPYC, 24 GB, virtio disk). Disk: `k3serve sim probe-disk` on the streaming
    fixture's experts.bin (docs/sim/this-machine-disk.json), taken under load from other jobs. Compute: NOT a
    clean measurement: probe-cpu ran at load average ~15 (docs/sim/this-machine-cpu.json), so these rates are
    rough figures for an idle machine (the numba MXFP4 kernel on 2 cores, numpy float32 matvec)."""
    disk = DiskModel(
        sizes=(4096, 65536, 1 << 20, 3342336, 16 << 20),
        queue_depths=(1, 4, 16),
        throughput=((0.019 * GB, 0.153 * GB, 0.188 * GB),
                    (0.455 * GB, 1.013 * GB, 1.103 * GB),
                    (1.041 * GB, 1.472 * GB, 1.488 * GB),
                    (1.681 * GB, 1.819 * GB, 1.819 * GB),
                    (1.58 * GB, 1.58 * GB, 1.58 * GB)),
    )
    compute = ComputeModel(dense_bytes_per_s=8 * GB, dense_flops=60e9, expert_bytes_per_s=1.0 * GB,
                           expert_flops=20e9, attention_s_per_token_layer=1e-4, layer_overhead_s=1e-3,
                           widen_bytes_per_s=2 * GB)
    return Machine("this-machine", disk, compute, "this project's 2-core VM (disk probed; compute rough)",
                   "k3serve sim probe-disk (docs/sim/this-machine-disk.json)")


PRESETS: dict[str, Callable[[], Machine]] = {
    "c-engine": c_engine, "c-engine-v1": c_engine_v1, "laptop": laptop, "this-machine": this_machine,
}


# Links between nodes (the cluster mode). Payload rates are TCP goodput on the line rate (about 94%). Per call, from
# Ray's own microbenchmarks (ray-project/ray#51427, microbenchmark.json, March 2025): 1_1_actor_calls_sync about
# 2,000/s, a 0.5 ms round trip (the call latency); 1_1_actor_calls_async about 8,600/s, 0.12 ms of the caller's work
# per call (the overhead, one call after another). Not measured across machines here; the wire's own round trip is
# 20-50 us of the latency.
RAY_CALL_LATENCY_S = 0.5e-3
RAY_CALL_OVERHEAD_S = 0.12e-3
NETWORKS: dict[str, NetworkModel] = {
    name: NetworkModel(bytes_per_s=rate, call_latency_s=RAY_CALL_LATENCY_S, call_overhead_s=RAY_CALL_OVERHEAD_S)
    for name, rate in (("10gbe", 1.175 * GB), ("25gbe", 2.94 * GB), ("100gbe", 11.75 * GB))
}


def resolve_network(name: str) -> NetworkModel:
    key = name.lower()
    if key not in NETWORKS:
        raise MachineError(f"no network preset {name!r}; presets: {', '.join(NETWORKS)} (or give the machine file a "
                           "[network] table)")
    return NETWORKS[key]


def resolve_machine(name_or_path: str | Path) -> Machine:
    """A preset name (see PRESETS) or a machine file."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]()
    if Path(key).exists():
        return load_machine(key)
    raise MachineError(f"no machine preset or file {key!r}; presets: {', '.join(sorted(PRESETS))}")
