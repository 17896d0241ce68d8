"""How the OpenMP workers of the numba kernels should wait between parallel regions, on an idle machine and on a
loaded one: K3 decode ms/token per wait setting, each run a fresh process (libgomp reads its settings once).

    python benchmarks/bench_wait_policy.py [--model DIR | --embedded] [--rounds 3] [--steps 16] [--hogs 2]
        [--job-threads 2] [--conditions idle,hogs,job]

Settings: PASSIVE (sleep as soon as a region ends), GOMP_SPINCOUNT=N with the policy unset (spin N iterations,
then sleep; libgomp's own default is 300,000), ACTIVE (spin until the next region), and `adaptive` (no variable
set: k3serve's default, PASSIVE workers and idle-class core keepers, k3serve/threads.py; `adaptive 1` with one keeper
instead of one per core). Conditions: idle; `hogs`, loaded by --hogs
busy-looping processes; `job`, loaded by another --job-threads-thread job (bench_peers.py's OpenBLAS matmul loop). Within a condition the settings alternate round by round; medians. Default model: the widened
trained K3 of bench_peers.py (1.5 GB); --embedded for the 6.9M-parameter default (short regions, where the wake-up
cost weighs most). Prints the machine, a table, one summary line and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SETTINGS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 30k": {"GOMP_SPINCOUNT": "30000"},
    "spin 300k": {"GOMP_SPINCOUNT": "300000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "adaptive": {},
    "adaptive 1": {"K3SERVE_CORE_KEEPERS": "1"},
    "adaptive spin 300": {"K3SERVE_SPIN": "300"},
    "adaptive spin 1500": {"K3SERVE_SPIN": "1500"},
}

CHILD = r"""
import json, sys, time
import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem

path, steps = (None if sys.argv[1] == "-" else sys.argv[1]), int(sys.argv[2])
model = load_model(path).model
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 32 + 4 + steps)
cache = model.new_cache()
model.forward([ForwardItem(prompt[:32], cache)])
for i in range(32, 36):  # warm: first decode steps touch every page
    model.forward([ForwardItem(prompt[i:i + 1], cache)])
wall, cpu = time.perf_counter(), time.process_time()
for i in range(36, 36 + steps):
    model.forward([ForwardItem(prompt[i:i + 1], cache)])
from k3serve.threads import governor
g = governor()
print(json.dumps({"wall_ms": (time.perf_counter() - wall) / steps * 1e3,
                  "cpu_ms": (time.process_time() - cpu) / steps * 1e3,
                  "policy": __import__("os").environ.get("OMP_WAIT_POLICY"),
                  "spincount": __import__("os").environ.get("GOMP_SPINCOUNT"),
                  "keepers": g.keeper.keepers if g.keeper else 0, "keeper_spins": g.keeper.spins if g.keeper else 0,
                  "no_keeper_because": g.reason}))
"""


def run(model: str, steps: int, setting: dict[str, str]) -> dict:
    from k3serve.host import WAIT_VARIABLES  # every wait setting, OpenMP's and k3serve's

    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(setting)
    done = subprocess.run([sys.executable, "-c", CHILD, model, str(steps)], env=env, capture_output=True, text=True,
                          timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--embedded", action="store_true", help="the embedded default model instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes in the loaded runs")
    parser.add_argument("--job-threads", type=int, default=2, help="threads of the other job in the `job` runs")
    parser.add_argument("--conditions", default="idle,hogs,job", help="comma-separated subset of idle,hogs,job")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings")
    args = parser.parse_args()

    from k3serve.host import describe_host

    if args.embedded:
        model = "-"
    else:
        from bench_peers import widened_checkpoint
        model = str(args.model or widened_checkpoint(16, 32))
    from bench_peers import load_job

    names = args.settings.split(",")
    conditions = args.conditions.split(",")
    results: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in names} for c in conditions}
    for condition in conditions:
        hogs = ([subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
                if condition == "hogs" else [load_job(args.job_threads)] if condition == "job" else [])
        try:
            for _ in range(args.rounds):
                for name in names:
                    results[condition][name].append(run(model, args.steps, SETTINGS[name]))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    host = describe_host()
    print(host)
    print(f"{'setting':<10} " + " ".join(f"{c + ' ms/token':>16}" for c in conditions))
    medians = {name: {f"{c}_ms": statistics.median(r["wall_ms"] for r in results[c][name]) for c in conditions}
               for name in names}
    for name in names:
        print(f"{name:<10} " + " ".join(f"{medians[name][c + '_ms']:16.2f}" for c in conditions))
    best = {c: min(m[f"{c}_ms"] for m in medians.values()) for c in conditions}
    print(f"relative to the best setting ({', '.join(conditions)}): " + ", ".join(
        f"{n} " + "/".join(f"{m[c + '_ms'] / best[c]:.2f}x" for c in conditions) for n, m in medians.items()))
    print(json.dumps({"benchmark": "wait_policy", "host": host, "model": model, "steps": args.steps,
                      "rounds": args.rounds, "hogs": args.hogs, "job_threads": args.job_threads,
                      "medians": medians, "runs": results}))


if __name__ == "__main__":
    main()
