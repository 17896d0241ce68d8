"""Benchmark the fused MXFP4 matmul (the routed-expert hot path) against its two alternatives.

    (a) fused    k3serve.model.kernels.mxfp4_matmul: decode nibbles in tiles, never build the float matrix
    (b) dequant  numpy dequantize_mxfp4 then x @ W.T (the reference twin)
    (c) dense    numpy x @ W.T on the float32 matrix, dequantized beforehand (what 8x the memory would buy)

Shapes: the full K3 expert (w1/w3 [3072, 3584], w2 [3584, 3072]) and the small embedded model's expert
([128, 128], LT = MI = 128), each at T = 1 and T = 8 tokens. The methods run alternately in rounds (a, b, c,
a, b, c, ...) so that drifting machine load hits all of them alike; each figure is the median over the rounds.
GB/s counts the weight bytes a method consumes: MXFP4 bytes (packed + scales) for (a) and (b), float32 bytes
for (c).

NOTE: OpenBLAS worker threads busy-wait for a while after each multi-threaded call, and on a 2-core machine
they then slow the next numba parallel kernel down by up to 2x. Alternating rounds measure exactly that mix; run
with OPENBLAS_NUM_THREADS=1 as well to see the kernel without the interference (the record keeps the setting).

Usage: python benchmarks/bench_mxfp4_kernel.py [--quick] [--rounds N]
Prints a table, one summary line, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import numba
import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model.kernels import mxfp4_matmul, mxfp4_matmul_reference, warmup
from k3serve.weights.mxfp4 import dequantize_mxfp4, mxfp4_nbytes, quantize_mxfp4

SHAPES = ((3072, 3584), (3584, 3072), (128, 128))  # (R, C)
TOKEN_COUNTS = (1, 8)
METHODS = ("fused", "dequant", "dense")
MIN_SAMPLE_SECONDS = 2e-3  # tiny shapes repeat the call inside one sample to get above timer noise
THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")


def machine_info() -> dict[str, object]:
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": cpu_model,
        "nproc": num_cpus,
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": _threading_layer(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "python": platform.python_version(),
        "env": {name: os.environ.get(name) for name in THREAD_ENV_VARS},
    }


def _threading_layer() -> str:
    try:
        return str(numba.threading_layer())
    except ValueError:  # no parallel kernel has run yet
        return "unknown"


def _calls_per_sample(run: Callable[[], object]) -> int:
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    return max(1, int(MIN_SAMPLE_SECONDS / max(elapsed, 1e-7)))


def _time_once(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def bench_case(rows: int, cols: int, num_tokens: int, rounds: int, rng: np.random.Generator) -> dict[str, object]:
    weight = rng.standard_normal((rows, cols)).astype(np.float32)  # [R, C]
    packed, scales = quantize_mxfp4(weight)  # [R, C/2], [R, C/32]
    dense = dequantize_mxfp4(packed, scales)  # [R, C]
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)  # [T, C]
    runs: dict[str, Callable[[], object]] = {
        "fused": lambda: mxfp4_matmul(packed, scales, x),
        "dequant": lambda: mxfp4_matmul_reference(packed, scales, x),
        "dense": lambda: x @ dense.T,
    }
    fused_out = mxfp4_matmul(packed, scales, x)
    reference_out = mxfp4_matmul_reference(packed, scales, x)
    relative_rms = float(np.sqrt(np.mean((fused_out - reference_out) ** 2) / np.mean(reference_out**2)))

    calls = {name: _calls_per_sample(run) for name, run in runs.items()}
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    for _ in range(rounds):
        for name in METHODS:
            samples[name].append(_time_once(runs[name], calls[name]))

    weight_bytes = {"fused": mxfp4_nbytes(rows, cols), "dequant": mxfp4_nbytes(rows, cols), "dense": rows * cols * 4}
    median_s = {name: float(np.median(samples[name])) for name in METHODS}
    return {
        "rows": rows,
        "cols": cols,
        "tokens": num_tokens,
        "median_ms": {name: median_s[name] * 1e3 for name in METHODS},
        "min_ms": {name: min(samples[name]) * 1e3 for name in METHODS},
        "gb_per_s": {name: weight_bytes[name] / median_s[name] / 1e9 for name in METHODS},
        "speedup_vs_dequant": median_s["dequant"] / median_s["fused"],
        "speedup_vs_dense": median_s["dense"] / median_s["fused"],
        "calls_per_sample": calls,
        "relative_rms_fused_vs_reference": relative_rms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per case (default 9, or 3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)

    start = time.perf_counter()
    warmup()
    warmup_s = time.perf_counter() - start
    info = machine_info()
    print(
        f"machine: {info['cpu_model']} | nproc {info['nproc']} | numba threads {info['numba_threads']} "
        f"({info['numba_threading_layer']}) | numpy {info['numpy']} numba {info['numba']} | "
        f"warmup {warmup_s:.2f} s | {rounds} rounds | "
        + " ".join(f"{name}={value}" for name, value in info["env"].items() if value is not None)
    )
    header = (
        f"{'shape':>11} {'T':>2} | {'fused ms':>9} {'GB/s':>6} | {'dequant ms':>10} {'GB/s':>6} | "
        f"{'dense ms':>9} {'GB/s':>6} | {'vs dequant':>10} {'vs dense':>8} | rel rms"
    )
    print(header)
    rng = np.random.default_rng(args.seed)
    results = []
    for rows, cols in SHAPES:
        for num_tokens in TOKEN_COUNTS:
            case = bench_case(rows, cols, num_tokens, rounds, rng)
            results.append(case)
            ms, gbs = case["median_ms"], case["gb_per_s"]
            print(
                f"{rows:>5}x{cols:<5} {num_tokens:>2} | {ms['fused']:>9.3f} {gbs['fused']:>6.2f} | "
                f"{ms['dequant']:>10.3f} {gbs['dequant']:>6.2f} | {ms['dense']:>9.3f} {gbs['dense']:>6.2f} | "
                f"{case['speedup_vs_dequant']:>9.1f}x {case['speedup_vs_dense']:>7.2f}x | "
                f"{case['relative_rms_fused_vs_reference']:.1e}"
            )

    headline = [c for c in results if (c["rows"], c["cols"]) == (3072, 3584)]
    summary = "; ".join(
        f"3072x3584 T={c['tokens']}: fused {c['median_ms']['fused']:.2f} ms = {c['speedup_vs_dequant']:.1f}x "
        f"dequant+matmul, {c['speedup_vs_dense']:.2f}x dense fp32"
        for c in headline
    )
    print(f"summary: {summary}")
    record = {"benchmark": "mxfp4_kernel", "rounds": rounds, "warmup_s": warmup_s, "machine": info, "results": results}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
