"""Memory under --ram-budget: `k3serve serve` over a packed store, confined to a memory cgroup of budget + KV cache
+ the stated overhead, answers 64 concurrent requests, is never killed, and its peak RSS stays within that sum.
The overhead (interpreter, numpy/numba, the HTTP stack, activations of a full batch) is measured in
docs/RELIABILITY.md."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from _http_server import free_port, wait_healthy

BUDGET = 5 << 20  # below the store's 8 MiB of weights: experts stream
KV_CACHE = 16 << 20
OVERHEAD = 320 << 20  # stated in docs/RELIABILITY.md: measured 225 MiB (peak RSS minus budget and KV), +40%
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def _cgroup(limit: int) -> Path | None:
    """A cgroup-v1 memory cgroup with `limit`, or None when this machine has none we may write."""
    path = CGROUP_ROOT / f"k3serve-test-{os.getpid()}"
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit))
        if int((path / "memory.limit_in_bytes").read_text()) < limit - 4096:
            return None
    except OSError:
        return None
    return path


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from k3serve.loading import default_model_dir
    from k3serve.weights.pack import pack_checkpoint

    return pack_checkpoint(default_model_dir(), tmp_path_factory.mktemp("default-store"))


def test_64_concurrent_requests_in_a_memory_cgroup_never_kill_the_server(store):
    limit = BUDGET + KV_CACHE + OVERHEAD
    cgroup = _cgroup(limit)
    if cgroup is None:
        pytest.skip("no writable cgroup-v1 memory controller on this machine")
    port = free_port()
    command = [sys.executable, "-m", "k3serve.cli", "serve", "--model", str(store.path), "--port", str(port),
               "--ram-budget", str(BUDGET), "--kv-cache-mib", str(KV_CACHE >> 20), "--max-seqs", "64",
               "--no-lab", "--served-model-name", "m"]
    proc = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
        statuses: list[int] = []

        def ask(i: int) -> None:
            body = {"model": "m", "prompt": f"def function_{i}(x):" * 4, "max_tokens": 16, "ignore_eos": True,
                    "temperature": 0.7, "seed": i}
            statuses.append(httpx.post(url + "/v1/completions", json=body, timeout=300).status_code)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert statuses == [200] * 64
        assert proc.poll() is None, "the server died"
        peak = _peak_rss(proc.pid)
        oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
        assert int(oom.get("oom_kill", 0)) == 0
        print(f"peak RSS {peak / 2**20:.1f} MiB = budget {BUDGET / 2**20:.1f} + KV {KV_CACHE / 2**20:.0f} + "
              f"{(peak - BUDGET - KV_CACHE) / 2**20:.1f} MiB overhead; cgroup max usage "
              f"{int((cgroup / 'memory.max_usage_in_bytes').read_text()) / 2**20:.1f} MiB of {limit / 2**20:.0f}")
        assert peak <= limit
    finally:
        proc.terminate()
        proc.wait(60)
        time.sleep(0.2)
        try:
            cgroup.rmdir()
        except OSError:
            pass
