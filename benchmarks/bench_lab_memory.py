"""What the lab costs in memory beside `k3serve serve` (issue 32, item 3): the server's RSS with `--no-lab` and
with the lab mounted (loopback), after one completion and after the page lists its modules; then the memory of the
lab's worker process after one run that loads the lab's model (`recurrent_state` with measured tokens).

    python benchmarks/bench_lab_memory.py [--model DIR] [--repeats N] [--widen N]

Each process is read from /proc/PID/smaps_rollup: RSS, PSS (each shared page divided among the processes that map
it) and Private (pages only this process maps). Beside the lab, `serve` holds a resident K3 model's weights in
sealed shared pages that the worker maps (weights/shared_pages.py), so the worker adds almost no weight memory of its
own; server PSS + worker PSS is what the pair costs. The figures are medians over `--repeats` servers started one
after the other. Prints the machine, one summary line, and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from k3serve.host import describe_host


def rss_mib(pid: int) -> float:
    return memory_mib(pid)["rss"]


def memory_mib(pid: int) -> dict[str, float]:
    """RSS, PSS, Private (clean + dirty) and Shared (clean + dirty) of one process, in MiB."""
    kib: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        kib[key] = int(value.split()[0])
    return {"rss": kib["Rss"] / 1024, "pss": kib["Pss"] / 1024,
            "private": (kib["Private_Clean"] + kib["Private_Dirty"]) / 1024,
            "shared": (kib["Shared_Clean"] + kib["Shared_Dirty"]) / 1024}


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def lab_worker(pid: int) -> int:
    """The lab's worker among the server's children (multiprocessing's resource tracker is another)."""
    workers = [child for child in children(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]
    if len(workers) != 1:
        raise RuntimeError(f"expected one lab worker process under {pid}, found {workers}")
    return workers[0]


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
        out = {"server_mib": rss_mib(server.pid), "server": memory_mib(server.pid)}
        if lab:
            httpx.get(url + "/lab/api/modules", timeout=30).raise_for_status()
            out["server_after_modules_mib"] = rss_mib(server.pid)
            run = httpx.post(url + "/lab/api/modules/recurrent_state/run?wait=true", timeout=600,
                             json={"measure_tokens": 64}).json()
            assert run["status"] == "done", run
            out["server_after_run_mib"] = rss_mib(server.pid)
            out["worker_processes_mib"] = sum(rss_mib(child) for child in children(server.pid))
            out["server_after_run"] = memory_mib(server.pid)
            out["worker"] = memory_mib(lab_worker(server.pid))
        return out
    finally:
        server.terminate()
        server.wait(60)


def _median(records: list[dict], *keys: str) -> float:
    values = []
    for record in records:
        for key in keys:
            record = record[key]
        values.append(record)
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3, help="servers measured with and without the lab each")
    parser.add_argument("--widen", type=int, default=1, metavar="N",
                        help="serve the model with every expert's inner width and latent repeated N times "
                             "(weights/widen.py: the same function, about N*N times the expert bytes)")
    args = parser.parse_args()
    if args.widen > 1:
        import tempfile

        from k3serve.loading import default_model_dir
        from k3serve.weights.widen import widen_experts

        source = Path(args.model) if args.model else default_model_dir()
        args.model = str(widen_experts(source, Path(tempfile.mkdtemp(prefix="k3-widened-")) / "model",
                                       inner=args.widen, latent=args.widen))
    host = describe_host()
    print(host)
    runs = [(measure(False, args.model), measure(True, args.model)) for _ in range(args.repeats)]
    without, with_lab = [r[0] for r in runs], [r[1] for r in runs]
    server = {k: _median(with_lab, "server_after_run", k) for k in ("rss", "pss", "private", "shared")}
    worker = {k: _median(with_lab, "worker", k) for k in ("rss", "pss", "private", "shared")}
    pair_pss = _median([{"v": r["server_after_run"]["pss"] + r["worker"]["pss"]} for r in with_lab], "v")
    print(f"serve RSS: {_median(without, 'server_mib'):.1f} MiB --no-lab, {_median(with_lab, 'server_mib'):.1f} MiB "
          f"with the lab; after a lab run that loaded the model: server PSS {server['pss']:.1f} MiB (private "
          f"{server['private']:.1f}), worker PSS {worker['pss']:.1f} MiB (private {worker['private']:.1f}, RSS "
          f"{worker['rss']:.1f}), server + worker PSS {pair_pss:.1f} MiB (medians of {args.repeats})")
    print(json.dumps({"benchmark": "lab_memory", "host": host, "repeats": args.repeats, "no_lab": without,
                      "lab": with_lab, "median": {"server_after_run": server, "worker": worker,
                                                  "server_plus_worker_pss": pair_pss}}))


if __name__ == "__main__":
    main()
