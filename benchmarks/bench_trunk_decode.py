"""Where the bf16 trunk matrices of the MoE block spend their time at decode, and whether a parallel region pays
for them (issue 33): three measurements in one process, under the process's wait policy (the default: sleeping
workers and idle-class core keepers, k3serve/threads.py).

1. A parallel region's fixed cost: an almost empty `prange` over 2 items, called back to back and with a busy gap
   of 20 / 200 us between calls (the Python between a decode step's regions); and, inside one region that splits
   a [2048, 128] matrix (in cache) in two halves, when each thread starts and ends its half after the call (TSC
   stamps; thread 0 is the calling thread).
2. Each trunk shape of the widened K3 alone, T = 1: the serial and parallel bf16 kernels (and the parallel one on
   1 thread), hot (the same matrix again) and cold (after reading 96 MB, more than the 32 MB L3: what the routed
   experts do to the caches between two layers).
3. The decode of the widened K3 itself, two settings of `kernels.BF16_PARALLEL_MIN_WEIGHTS` alternating step by
   step (old: 2**17, every trunk matrix of this model in a parallel region; new: the default): medians of the
   step's wall time and of the time inside the MoE module's `linear` calls.

    python benchmarks/bench_trunk_decode.py [--steps 200] [--batch 1] [--skip-shapes]

Prints one table per part and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {"latent_down, shared gate_up [2048, 128]": (2048, 128), "latent_up [128, 2048]": (128, 2048),
          "shared down [128, 1024]": (128, 1024)}
OLD_MIN_WEIGHTS = 2**17  # kernels.PARALLEL_MIN_WEIGHTS, the bf16 kernel's threshold before 2026-12-06 night


def region_cost(empty_region, gaps_us=(0, 20, 200), calls=400) -> dict[str, float]:
    out = np.zeros(2)
    empty_region(out)
    result = {}
    for gap in gaps_us:
        times = []
        for _ in range(calls):
            end = time.perf_counter() + gap * 1e-6
            while time.perf_counter() < end:
                pass
            started = time.perf_counter()
            empty_region(out)
            times.append(time.perf_counter() - started)
        result[f"gap {gap} us"] = statistics.median(times) * 1e6
    return result


def region_timeline(halves, now, tsc_per_us: float, calls=200) -> dict[str, float]:
    rng = np.random.default_rng(1)
    w = (rng.integers(0, 1 << 15, (2048, 128)) & 0x3FFF | 0x3C00).astype(np.uint16)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    out, stamps = np.empty((1, 2048), np.float32), np.zeros((2, 2), np.int64)
    halves(w, x, out, stamps)
    rows = []
    for _ in range(calls):
        started = now()
        halves(w, x, out, stamps)
        returned = now()
        rows.append([stamps[0, 0] - started, stamps[0, 1] - started, stamps[1, 0] - started, stamps[1, 1] - started,
                     returned - started])
    median = np.median(np.array(rows, np.float64), axis=0) / tsc_per_us
    return dict(zip(("caller starts", "caller ends", "worker starts", "worker ends", "call returns"),
                    (float(v) for v in median)))


def tsc_rate(now) -> float:
    """TSC ticks per microsecond, against perf_counter over 50 ms."""
    t0, c0 = time.perf_counter(), now()
    time.sleep(0.05)
    return (now() - c0) / ((time.perf_counter() - t0) * 1e6)


def shape_times(kernels, read_all, flush, rounds=40) -> dict[str, dict[str, float]]:
    import numba

    rng = np.random.default_rng(0)
    result = {}
    for label, (rows, cols) in SHAPES.items():
        w = (rng.integers(0, 1 << 15, (rows, cols)) & 0x3FFF | 0x3C00).astype(np.uint16)  # bf16 bits, |v| < 2
        x = rng.standard_normal((1, cols)).astype(np.float32)
        out = np.empty((1, rows), np.float32)
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name, kernel, threads in (("serial", kernels._bf16_matmul_serial, 2),
                                          ("parallel 2 threads", kernels._bf16_matmul_parallel, 2),
                                          ("parallel 1 thread", kernels._bf16_matmul_parallel, 1)):
                numba.set_num_threads(threads)
                for state in ("hot", "cold"):
                    if state == "cold":
                        read_all(flush)
                    else:
                        kernel(w, x, out)
                    started = time.perf_counter()
                    kernel(w, x, out)
                    times.setdefault(f"{name}, {state}", []).append(time.perf_counter() - started)
        numba.set_num_threads(2)
        result[label] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return result


def decode_ab(model, kernels, moe_module, steps: int, batch: int) -> dict[str, dict[str, float]]:
    from k3serve.model.interface import ForwardItem

    inner = moe_module.linear
    spent = [0.0]

    def timed(x, w):
        started = time.perf_counter()
        out = inner(x, w)
        spent[0] += time.perf_counter() - started
        return out

    settings = {"old (2**17)": OLD_MIN_WEIGHTS, "new (default)": kernels.BF16_PARALLEL_MIN_WEIGHTS}
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 64 * batch + (steps + 8) * batch * 2)
    caches = [model.new_cache() for _ in range(batch)]
    model.forward([ForwardItem(prompt[b * 64:b * 64 + 32], c) for b, c in enumerate(caches)])
    position = 64 * batch
    samples: dict[str, dict[str, list[float]]] = {name: {"step": [], "trunk": []} for name in settings}
    moe_module.linear = timed
    try:
        for step in range(steps + 2):
            for name, threshold in settings.items():
                kernels.BF16_PARALLEL_MIN_WEIGHTS = threshold
                spent[0] = 0.0
                started = time.perf_counter()
                model.forward([ForwardItem(prompt[position + b:position + b + 1], c) for b, c in enumerate(caches)])
                wall = time.perf_counter() - started
                position += batch
                if step >= 2:
                    samples[name]["step"].append(wall * 1e3)
                    samples[name]["trunk"].append(spent[0] * 1e3)
    finally:
        moe_module.linear = inner
        kernels.BF16_PARALLEL_MIN_WEIGHTS = settings["new (default)"]
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--skip-shapes", action="store_true", help="only the decode A/B")
    args = parser.parse_args()

    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from bench_peers import widened_checkpoint
    from k3serve.host import describe_host
    from k3serve.loading import load_model
    from k3serve.model import kernels, moe
    from k3serve.threads import POLICY, governor

    @njit(parallel=True)
    def empty_region(out):
        for i in prange(out.shape[0]):
            out[i] += 1.0

    @intrinsic
    def cycle_counter(typingctx):
        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])
        return types.int64(), codegen

    @njit
    def now():
        return cycle_counter()

    @njit(parallel=True)
    def halves(w, x, out, stamps):
        half = w.shape[0] // 2
        for t in prange(2):
            stamps[t, 0] = cycle_counter()
            for r in range(t * half, (t + 1) * half):
                out[0, r] = kernels._dense_row_dot(w[r], x[0])
            stamps[t, 1] = cycle_counter()

    @njit
    def read_all(buf):
        total = 0.0
        for i in range(0, buf.shape[0], 16):  # one float a cache line
            total += buf[i]
        return total

    record: dict = {"benchmark": "trunk_decode", "machine": describe_host(), "policy": POLICY, "batch": args.batch}
    model = load_model(args.model or widened_checkpoint(16, 32)).model
    kernels.warmup()
    if not args.skip_shapes:
        flush = np.ones(96 << 18, np.float32)  # 96 MB
        read_all(flush)
        with governor().step():  # the keepers spin, as during a forward
            record["region_us"] = region_cost(empty_region)
            record["region_timeline_us"] = region_timeline(halves, now, tsc_rate(now))
            record["shapes_us"] = shape_times(kernels, read_all, flush)
        print(f"machine: {describe_host()} | wait policy {POLICY}")
        print("empty parallel region, median us: " + ", ".join(f"{k} {v:.1f}" for k, v in record["region_us"].items()))
        print("a region over two halves of a [2048, 128] matrix, us after the call (median): " + ", ".join(
            f"{k} {v:.1f}" for k, v in record["region_timeline_us"].items()))
        print(f"\n{'shape, T = 1 (us, median)':<42} " + " ".join(f"{k:>26}" for k in next(iter(
            record["shapes_us"].values()))))
        for label, row in record["shapes_us"].items():
            print(f"{label:<42} " + " ".join(f"{v:26.1f}" for v in row.values()))
    record["decode_ms"] = decode_ab(model, kernels, moe, args.steps, args.batch)
    print(f"\ndecode, batch {args.batch}, {args.steps} steps a setting, alternating: medians in ms")
    for name, row in record["decode_ms"].items():
        print(f"  BF16_PARALLEL_MIN_WEIGHTS {name:<14} step {row['step']:7.3f}   MoE trunk matmuls {row['trunk']:6.3f}")
    old, new = record["decode_ms"]["old (2**17)"], record["decode_ms"]["new (default)"]
    print(f"MoE trunk {old['trunk']:.3f} -> {new['trunk']:.3f} ms ({old['trunk'] / new['trunk']:.2f}x), "
          f"step {old['step']:.2f} -> {new['step']:.2f} ms")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
