"""The MXFP4 routed-expert kernels with 1, 2 or 4 rows a pass of the row dot (`kernels.MXFP4_ROWS_PER_DOT`),
alternated in one process: same bits (asserted), decode-step time and GB/s of MXFP4 bytes, at 1 and 2 threads.

Shapes (T = 1, 4 experts active a call, each call the next 4 of E stacked experts so the weights come from DRAM
as in decode):
    widened  the widened K3 fixture's experts: w1/w3 [1024, 2048], w2 [2048, 1024], E = 64
    k3       full K3's experts: w1/w3 [3072, 3584], w2 [3584, 3072], E = 8
    matmul   `mxfp4_matmul` on one full-K3 w1 [3072, 3584] (the trunk's MXFP4 path), T = 1

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mxfp4_row_dots.py [--rounds 7] [--calls 8] [--threads 1 2]
Variants: rows a pass in stage 1 / stage 2 (1/1: the one-row dot everywhere, as before; 2/1: the w1 and w3 rows of
one index together, the default; 2/2 and 4/4). Prints one line per (shape, threads): median wall ms of each variant
(stage 1 + stage 2), its CPU ms, GB/s, the default's gain over 1/1; then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np

from k3serve.model import kernels

VARIANTS = ((1, 1), (2, 1), (2, 2), (4, 4))  # rows a pass (stage 1, stage 2); the matmul case uses the second
BASE, DEFAULT = (1, 1), (kernels.MXFP4_GATE_UP_ROWS_PER_DOT, kernels.MXFP4_ROWS_PER_DOT)
EXPERT_SHAPES = {"widened": (1024, 2048, 64), "k3": (3072, 3584, 8)}  # (MI, LT, E)
ACTIVE = 4


def _random_matrices(rng: np.random.Generator, count: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 256, size=(count, rows, cols // 2), dtype=np.uint8)  # [E, R, C/2]
    scales = rng.integers(118, 125, size=(count, rows, cols // 32), dtype=np.uint8)  # [E, R, G]
    return packed, scales


def _experts_case(rng: np.random.Generator, inner: int, latent: int, count: int):
    w1p, w1s = _random_matrices(rng, count, inner, latent)
    w3p, w3s = _random_matrices(rng, count, inner, latent)
    w2p, w2s = _random_matrices(rng, count, latent, inner)
    z = rng.standard_normal((1, latent)).astype(np.float32)  # [T, LT]
    zp = np.empty_like(z)
    kernels.permute_groups(z, zp)
    hidden = rng.standard_normal((ACTIVE, inner)).astype(np.float32)  # [N, MI] the stage-2 input
    tokens = np.zeros(ACTIVE, np.int64)
    starts, ends = np.arange(ACTIVE, dtype=np.int64), np.arange(1, ACTIVE + 1, dtype=np.int64)
    gate, up = np.empty((ACTIVE, inner), np.float32), np.empty((ACTIVE, inner), np.float32)
    out = np.empty((ACTIVE, latent), np.float32)
    code = kernels.ISA_CODES[kernels.ISA]
    state = {"call": 0}

    def run(rows_per_dot: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        first = (state["call"] * ACTIVE) % count
        state["call"] += 1
        expert_ids = (first + np.arange(ACTIVE, dtype=np.int64)) % count
        kernels._experts_gate_up_parallel(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends,
                                          kernels._HALF_SCALES, code, gate, up, rows_per_dot[0])
        kernels._experts_down_parallel(w2p, w2s, expert_ids, starts, ends, kernels._HALF_SCALES, code, hidden, out,
                                       rows_per_dot[1])
        return gate, up, out

    run.reset = lambda: state.update(call=0)  # type: ignore[attr-defined]
    nbytes = ACTIVE * 3 * (inner * latent // 2 + inner * latent // 32)
    return run, nbytes


def _matmul_case(rng: np.random.Generator):
    packed, scales = _random_matrices(rng, 1, 3072, 3584)
    packed, scales = packed[0], scales[0]
    x = rng.standard_normal((1, 3584)).astype(np.float32)
    xp = np.empty_like(x)
    kernels.permute_groups(x, xp)
    out = np.empty((1, 3072), np.float32)
    code = kernels.ISA_CODES[kernels.ISA]

    def run(rows_per_dot: tuple[int, int]) -> tuple[np.ndarray]:
        kernels._matmul_parallel(packed, scales, xp, kernels._HALF_SCALES, code, out, rows_per_dot[1])
        return (out,)

    return run, packed.nbytes + scales.nbytes


def _same_bits(run) -> bool:
    """Each variant on the same call (the experts case rotates its experts per call: reset the rotation)."""
    results = []
    for rows_per_dot in VARIANTS:
        if hasattr(run, "reset"):
            run.reset()
        results.append([a.copy() for a in run(rows_per_dot)])
    return all(all(np.array_equal(a, b) for a, b in zip(results[0], other)) for other in results[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=8, help="calls per timed sample")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=["widened", "k3", "matmul"])
    parser.add_argument("--experts", type=int, default=None,
                        help="stacked experts E (default 64 widened, 8 k3; 4 keeps them in cache: compute only)")
    args = parser.parse_args()
    kernels.warmup()
    rng = np.random.default_rng(0)
    records = []
    print(f"isa {kernels.ISA} | numba threads available {numba.config.NUMBA_NUM_THREADS} | {args.rounds} rounds x "
          f"{args.calls} calls")
    for shape in args.shapes:
        if shape == "matmul":
            run, nbytes = _matmul_case(rng)
        else:
            inner, latent, count = EXPERT_SHAPES[shape]
            run, nbytes = _experts_case(rng, inner, latent, args.experts or count)
        for threads in args.threads:
            numba.set_num_threads(threads)
            for rows_per_dot in VARIANTS:  # compile / first touch
                run(rows_per_dot)
            same_bits = _same_bits(run)
            samples: dict[tuple[int, int], list[float]] = {v: [] for v in VARIANTS}
            cpu: dict[tuple[int, int], list[float]] = {v: [] for v in VARIANTS}
            for round_index in range(args.rounds):
                order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
                for rows_per_dot in order:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        run(rows_per_dot)
                    samples[rows_per_dot].append((time.perf_counter() - start) / args.calls)
                    cpu[rows_per_dot].append((time.process_time() - start_cpu) / args.calls)
            median_ms = {v: float(np.median(samples[v])) * 1e3 for v in VARIANTS}
            cpu_ms = {v: float(np.median(cpu[v])) * 1e3 for v in VARIANTS}
            gb_per_s = {v: nbytes / (median_ms[v] * 1e-3) / 1e9 for v in VARIANTS}
            gain = median_ms[BASE] / median_ms[DEFAULT]
            print(f"{shape:>8} threads {threads} | " + " | ".join(
                f"{v[0]}/{v[1]}: {median_ms[v]:7.3f} ms (cpu {cpu_ms[v]:7.3f}) {gb_per_s[v]:5.1f} GB/s"
                for v in VARIANTS) + f" | default {DEFAULT[0]}/{DEFAULT[1]} vs 1/1: {gain:.2f}x | same bits {same_bits}",
                flush=True)
            records.append({"shape": shape, "threads": threads, "bytes_per_call": nbytes,
                            "median_ms": {f"{v[0]}/{v[1]}": median_ms[v] for v in VARIANTS},
                            "cpu_ms": {f"{v[0]}/{v[1]}": cpu_ms[v] for v in VARIANTS},
                            "gb_per_s": {f"{v[0]}/{v[1]}": gb_per_s[v] for v in VARIANTS},
                            "samples_ms": {f"{v[0]}/{v[1]}": [s * 1e3 for s in samples[v]] for v in VARIANTS},
                            "same_bits": same_bits})
    print(json.dumps({"benchmark": "mxfp4_row_dots", "isa": kernels.ISA, "rounds": args.rounds,
                      "calls": args.calls, "results": records}))


if __name__ == "__main__":
    main()
