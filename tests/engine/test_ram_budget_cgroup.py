"""The RAM controller's budget in a memory cgroup: the expert slots' share of the budget is what the process holds.

A child process streams the embedded model with its experts widened 8x (448 experts of 52 KiB: an arena of 22.8 MiB
reserved for every slot), starts the experts pool at a few slots, sets its own cgroup-v1 limit to what it holds
then plus the experts' budget plus SLACK, and runs a workload while the controller moves RAM between the pools;
it must not be killed, and the cgroup's peak stays within the limit. The control run starts the experts pool at
every slot with the controller off, under the same limit rule: its peak goes past it (so the limit binds, and
the first run's margin is the controller's doing, not the cgroup's slack).

KV blocks and checkpoint arrays are allocated at their caps before the baseline is taken: only the expert slots
return pages to the OS when they shrink (docs/STREAMING.md, 'One RAM budget')."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
EXPERT_BUDGET = 6 << 20  # the experts' most under the controller (the ledger's budget less the other pools)
SLACK = 8 << 20  # activations and allocator growth over the workload, beyond the baseline

CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.ram_controller import ControllerConfig
    from k3serve.engine.ram_pools import attach_ram_controller
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    store, cgroup, expert_budget, slack, controlled = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), \\
        int(sys.argv[4]), sys.argv[5] == "1"
    model = load_model(store, stream=StreamOptions(io="direct", cache="lru")).model
    slots = model.experts.slots
    engine = LLMEngine(model, EngineConfig(max_seqs=8, num_blocks=128, num_state_checkpoints=4), stop_ids=())
    checkpoint_bytes = engine.scheduler.prefix_cache.checkpoint_bytes
    kv_bytes = engine.scheduler.blocks.num_blocks * engine.config.block_bytes(model.cache_layout)
    budget = expert_budget + 4 * checkpoint_bytes + kv_bytes
    start = 8 if controlled else slots.cache.max_slots
    ctl = attach_ram_controller(engine, budget if controlled else 1 << 40,
                                ControllerConfig(interval_steps=2, step_bytes=1 << 20, hysteresis=0.0),
                                experts=(start, slots.cache.max_slots), enabled=controlled)
    rng = np.random.default_rng(0)
    for _ in range(8):  # the workload's batch once: compiled kernels and activations in the baseline
        engine.add_request([int(t) for t in rng.integers(3, 1000, 48)], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    slots.resize(8)  # the warm-up's slots go back to the OS
    slots.resize(start)
    baseline = int((cgroup / "memory.usage_in_bytes").read_text())
    expert_cap = budget - kv_bytes  # the experts' most: the budget less the KV pool (at its floor)
    limit = baseline + expert_cap + slack
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    (cgroup / "memory.max_usage_in_bytes").write_text("0")
    peak_pools = 0
    for _ in range(3):
        for _ in range(8):
            engine.add_request([int(t) for t in rng.integers(3, 1000, 48)],
                               SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            assert ctl.pools.total_bytes <= ctl.pools.budget_bytes
            peak_pools = max(peak_pools, ctl.pools.pools["experts"].size_bytes)
    print(json.dumps({"baseline": baseline, "limit": limit, "peak": int((cgroup / "memory.max_usage_in_bytes")
                      .read_text()), "moves": len(ctl.moves), "peak_expert_pool": peak_pools,
                      "arena": slots.cache.max_slots * slots.stride, "expert_cap": expert_cap}))
""")


def _cgroup(name: str) -> Path | None:
    """A fresh cgroup-v1 memory cgroup, or None when this machine has none we may write."""
    path = CGROUP_ROOT / f"k3serve-ram-{name}-{os.getpid()}"
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(1 << 34))
    except OSError:
        return None
    return path


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    from k3serve.loading import default_model_dir
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.widen import widen_experts

    folder = tmp_path_factory.mktemp("wide")
    widen_experts(default_model_dir(), folder / "checkpoint", inner=4, latent=2)
    return pack_checkpoint(folder / "checkpoint", folder / "packed")


def _run_child(store, controlled: bool) -> tuple[int, dict | None, str]:
    cgroup = _cgroup("on" if controlled else "off")
    if cgroup is None:
        pytest.skip("no writable cgroup-v1 memory controller on this machine (/sys/fs/cgroup/memory)")
    try:
        args = [sys.executable, "-c", CHILD, str(store.path), str(cgroup), str(EXPERT_BUDGET), str(SLACK),
                "1" if controlled else "0"]
        proc = subprocess.run(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *args],
                              capture_output=True, text=True, timeout=300, env={**os.environ})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
        record = json.loads(lines[-1]) if lines else None
        if record is not None:
            record["oom_kill"] = int(oom.get("oom_kill", 0))
            record["failcnt"] = int((cgroup / "memory.failcnt").read_text())
        return proc.returncode, record, proc.stderr[-2000:]
    finally:
        try:
            cgroup.rmdir()
        except OSError:
            pass


def test_controller_keeps_the_experts_within_their_budget_in_a_memory_cgroup(wide_store):
    code, record, stderr = _run_child(wide_store, controlled=True)
    assert code == 0, stderr
    print(f"peak {(record['peak'] - record['baseline']) / 2**20:.1f} MiB over the baseline, limit "
          f"{(record['limit'] - record['baseline']) / 2**20:.1f} MiB over it, experts at most "
          f"{record['peak_expert_pool'] / 2**20:.1f} MiB, {record['moves']} moves")
    assert record["oom_kill"] == 0
    assert record["moves"] > 0
    assert record["peak_expert_pool"] <= record["expert_cap"]
    assert record["peak"] <= record["limit"]
    assert record["arena"] > record["expert_cap"] + SLACK  # every slot at once would not fit: the control run shows it


def test_control_every_slot_without_the_controller_goes_past_the_same_limit(wide_store):
    code, record, stderr = _run_child(wide_store, controlled=False)
    # killed by the cgroup (SIGKILL) or, when the kernel reclaims instead, held at the limit with failures
    assert code != 0 or record["failcnt"] > 0 or record["oom_kill"] > 0, record
