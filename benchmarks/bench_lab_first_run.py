"""The lab's speculative-decoding module: its first run in a fresh process with an empty numba cache (every kernel
compiled in that process) against the same run repeated, for both rollback methods (issue 36: within 20%).

    python benchmarks/bench_lab_first_run.py [--rounds 3]

Each round is a fresh process (NUMBA_CACHE_DIR a new empty folder) that runs the module twice at the page's
defaults; the ratio is first / rerun speedup. Prints the machine, one summary line (medians over the rounds), and a
JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from k3serve.host import describe_host

FIRST_AND_RERUN = r"""
import json
from k3serve.lab.fixtures import LabFixtures
from k3serve.lab.registry import CancelToken, get_module

if __name__ == "__main__":
    lab = LabFixtures()
    module = get_module("speculative")
    out = {}
    for rollback in ("projection", "snapshot"):  # each compiles its own kernels on first use
        params = module.validate({"rollback": rollback}, lab)  # the page's defaults otherwise
        out[rollback] = [module.run(params, lambda fraction, message: None, CancelToken(), lab).metrics
                         for _ in range(2)]
    print(json.dumps(out))
"""


def one_round() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as numba_cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": numba_cache}
        done = subprocess.run([sys.executable, "-c", FIRST_AND_RERUN], env=env, capture_output=True, text=True,
                              timeout=600, check=True)
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return {rollback: first["speedup"] / rerun["speedup"] for rollback, (first, rerun) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    host = describe_host()
    print(host)
    rounds = [one_round() for _ in range(args.rounds)]
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("first run / rerun speedup (median of %d fresh processes): %s" % (
        args.rounds, ", ".join(f"{k} {v:.3f}" for k, v in medians.items())))
    print(json.dumps({"benchmark": "lab_first_run", "host": host, "rounds": rounds, "median_ratio": medians}))


if __name__ == "__main__":
    main()
