"""How the OpenMP workers of the numba kernels should wait between parallel regions, on an idle machine and on a
loaded one: K3 decode ms/token per wait setting, each run a fresh process (libgomp reads its settings once).

    python benchmarks/bench_wait_policy.py [--model DIR | --embedded] [--rounds 3] [--steps 16] [--hogs 2]

Settings: PASSIVE (sleep as soon as a region ends), GOMP_SPINCOUNT=N with the policy unset (spin N iterations,
then sleep; libgomp's own default is 300,000), ACTIVE (spin until the next region), and `auto` (no variable set:
k3serve's own choice, model/kernels.py). Conditions: idle, and loaded by --hogs busy-looping processes (other jobs
on the machine). Within a condition the settings alternate round by round; medians. Default model: the widened
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
    "auto": {},
}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

CHILD = r"""
import json, sys, time
import numpy as np
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem

path, steps = (None if sys.argv[1] == "-" else sys.argv[1]), int(sys.argv[2])
model = load_model(path).model
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 32)
cache = model.new_cache()
model.forward([ForwardItem(prompt, cache)])
for i in range(4):  # warm: first decode steps touch every page
    model.forward([ForwardItem(prompt[i:i + 1], cache)])
wall, cpu = time.perf_counter(), time.process_time()
for i in range(steps):
    model.forward([ForwardItem(prompt[i:i + 1], cache)])
print(json.dumps({"wall_ms": (time.perf_counter() - wall) / steps * 1e3,
                  "cpu_ms": (time.process_time() - cpu) / steps * 1e3,
                  "policy": __import__("os").environ.get("OMP_WAIT_POLICY"),
                  "spincount": __import__("os").environ.get("GOMP_SPINCOUNT")}))
"""


def run(model: str, steps: int, setting: dict[str, str]) -> dict:
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
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings")
    args = parser.parse_args()

    from k3serve.host import describe_host

    if args.embedded:
        model = "-"
    else:
        from bench_peers import widened_checkpoint
        model = str(args.model or widened_checkpoint(16, 32))
    names = args.settings.split(",")
    results: dict[str, dict[str, list[dict]]] = {"idle": {n: [] for n in names}, "loaded": {n: [] for n in names}}
    for condition in ("idle", "loaded"):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)] \
            if condition == "loaded" else []
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
    print(f"{'setting':<10} {'idle ms/token':>14} {'loaded ms/token':>16}")
    medians = {}
    for name in names:
        idle = statistics.median(r["wall_ms"] for r in results["idle"][name])
        loaded = statistics.median(r["wall_ms"] for r in results["loaded"][name])
        medians[name] = {"idle_ms": idle, "loaded_ms": loaded}
        print(f"{name:<10} {idle:14.2f} {loaded:16.2f}")
    best_idle = min(m["idle_ms"] for m in medians.values())
    best_loaded = min(m["loaded_ms"] for m in medians.values())
    print("relative to the best setting (idle, loaded): " + ", ".join(
        f"{n} {m['idle_ms'] / best_idle:.2f}x/{m['loaded_ms'] / best_loaded:.2f}x" for n, m in medians.items()))
    print(json.dumps({"benchmark": "wait_policy", "host": host, "model": model, "steps": args.steps,
                      "rounds": args.rounds, "hogs": args.hogs, "medians": medians, "runs": results}))


if __name__ == "__main__":
    main()
