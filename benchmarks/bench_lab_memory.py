"""What the lab costs in memory beside `k3serve serve` (issue 32, item 3): the server's RSS with `--no-lab` and
with the lab mounted (loopback), after one completion and after the page lists its modules; then the RSS of the
lab's worker process after one run that loads the lab's model (`recurrent_state` with measured tokens).

    python benchmarks/bench_lab_memory.py [--model DIR]

The lab's runs execute in a spawned worker process (lab/worker.py), which loads its own copy of the model on its
first run; the server process never loads a second one. Prints the machine, one summary line, and a JSON record on
the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from k3serve.host import describe_host


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(lab: bool, model: str | None) -> dict[str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "k3serve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--lab" if lab else "--no-lab"] + (["--model", model] if model else [])
    server = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                models = httpx.get(url + "/v1/models", timeout=5)
                if models.status_code == 200:
                    name = models.json()["data"][0]["id"]
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        httpx.post(url + "/v1/completions", timeout=120, json={"model": name, "prompt": "def f(x):",
                                                                "max_tokens": 8}).raise_for_status()
        out = {"server_mib": rss_mib(server.pid)}
        if lab:
            httpx.get(url + "/lab/api/modules", timeout=30).raise_for_status()
            out["server_after_modules_mib"] = rss_mib(server.pid)
            run = httpx.post(url + "/lab/api/modules/recurrent_state/run?wait=true", timeout=600,
                             json={"measure_tokens": 64}).json()
            assert run["status"] == "done", run
            out["server_after_run_mib"] = rss_mib(server.pid)
            out["worker_processes_mib"] = sum(rss_mib(child) for child in children(server.pid))
        return out
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded model)")
    args = parser.parse_args()
    host = describe_host()
    print(host)
    without, with_lab = measure(False, args.model), measure(True, args.model)
    print(f"serve RSS: {without['server_mib']:.1f} MiB --no-lab, {with_lab['server_mib']:.1f} MiB with the lab "
          f"({with_lab['server_after_run_mib']:.1f} MiB after a lab run); the lab's worker processes "
          f"{with_lab['worker_processes_mib']:.1f} MiB after a run that loaded the model")
    print(json.dumps({"benchmark": "lab_memory", "host": host, "no_lab": without, "lab": with_lab}))


if __name__ == "__main__":
    main()
