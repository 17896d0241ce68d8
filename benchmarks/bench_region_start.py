"""What starting one parallel region of the compiled kernels costs under each way the threads can wait (issue 33:
the wake-up a decode step pays a few hundred times).

    python benchmarks/bench_region_start.py [--rounds 5] [--calls 2000] [--threads 2]
        [--settings "default;passive:K3SERVE_CORE_KEEPERS=0;active:K3SERVE_WAIT_POLICY=active;spin:K3SERVE_SPIN=1500"]

Each setting runs in a fresh process at the defaults (`host.defaults_environment`) plus its variables, the
settings alternated round by round; medians. A child times the Q8_0 matrix-vector kernel on a 64 x 2048 matrix
(139 KB, in L2: the call is mostly overhead) on one thread (`_q8_0_matmul_serial`) and as a parallel region over the
threads (`_q8_0_matmul_parallel`), each inside a governed step as a model's forward runs them (the core keepers
spin there under the default policy), back to back and after a 50 us gap of Python (a decode step's gap between two
regions). The region's start is the parallel call less the serial one. Prints the machine, a table and a JSON
record on its last line (--out also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CHILD = r"""
import k3serve
import json, sys, time
import numpy as np
from k3serve import threads
from k3serve.model import kernels as K

spec = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
rows, cols = 64, 2048
blocks = rng.integers(0, 256, size=(rows, cols // 32 * 34), dtype=np.uint8)
blocks.reshape(rows, -1, 34)[:, :, :2] = (0, 0x20)  # half-precision block scales of 2^-7
x = rng.standard_normal((1, cols)).astype(np.float32)
xq, xd = K.quantize_activations(x)
code = K._isa_code(None)
xt, dt = K._q8_0_tiles(xq, xd, code, aligned=True)
out = np.empty((1, rows), np.float32)
args = (blocks, xq, xd, xt, dt, K._F16_TO_F32, code, out)
kernels = {"serial": K._q8_0_matmul_serial, "parallel": K._q8_0_matmul_parallel}

def timed(kernel, gap_s):
    total = 0.0
    for _ in range(spec["calls"]):
        if gap_s:
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        started = time.perf_counter()
        kernel(*args)
        total += time.perf_counter() - started
    return total / spec["calls"] * 1e6

for kernel in kernels.values():
    kernel(*args)
result = {"policy": threads.POLICY, "keepers": 0}
with threads.governor().step():
    keeper = threads.governor().keeper
    result["keepers"] = keeper.keepers if keeper is not None else 0
    for gap in (0.0, 50e-6):
        for name, kernel in kernels.items():
            result[f"{name}_us" + ("_after_gap" if gap else "")] = timed(kernel, gap)
print(json.dumps(result))
"""

FIGURES = ("serial_us", "parallel_us", "serial_us_after_gap", "parallel_us_after_gap")
DEFAULT_SETTINGS = ("default;passive:K3SERVE_CORE_KEEPERS=0;active:K3SERVE_WAIT_POLICY=active;"
                    "spin:K3SERVE_SPIN=1500")


def run_child(spec: dict, extra_env: dict[str, str]) -> dict:
    from k3serve.host import defaults_environment

    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env={**defaults_environment(spec["threads"]), **extra_env}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help='"label[:NAME=VALUE,...];...": the settings alternated (bench_decode_ops.py\'s syntax)')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from bench_decode_ops import parse_variants

    from k3serve.host import describe_host

    try:
        settings = parse_variants(args.settings)
    except ValueError as exc:
        parser.error(str(exc))
    if not settings:
        parser.error("--settings names no setting")
    spec = {"calls": args.calls, "threads": args.threads}
    runs: dict[str, list[dict]] = {label: [] for label in settings}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for label, env in settings.items():
            runs[label].append(run_child(spec, env))
    host = describe_host()
    print(host, f"| load average {os.getloadavg()[0]:.2f}")
    print(f"{'setting':<10} {'policy':<9} {'keepers':>7} {'serial us':>10} {'parallel us':>12} {'start us':>9}"
          f" {'after a 50 us gap: serial':>26} {'parallel':>9} {'start':>7}")
    summary = {}
    for label, rs in runs.items():
        med = {figure: statistics.median(r[figure] for r in rs) for figure in FIGURES}
        med["start_us"] = med["parallel_us"] - med["serial_us"]
        med["start_us_after_gap"] = med["parallel_us_after_gap"] - med["serial_us_after_gap"]
        summary[label] = {"policy": rs[0]["policy"], "keepers": rs[0]["keepers"], "env": settings[label], **med}
        print(f"{label:<10} {rs[0]['policy']:<9} {rs[0]['keepers']:>7} {med['serial_us']:10.1f} "
              f"{med['parallel_us']:12.1f} {med['start_us']:9.1f} {med['serial_us_after_gap']:26.1f} "
              f"{med['parallel_us_after_gap']:9.1f} {med['start_us_after_gap']:7.1f}")
    record = {"benchmark": "region_start", "machine": host, "rounds": args.rounds, "calls": args.calls,
              "threads": args.threads, "settings": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
