"""The bf16-activation kernels alone (kernels section "bf16 weights x bf16 activations") against the float path
they replace, in GFLOP/s, at Qwen3-30B-A3B's widths, in one process, alternated:

- linear: the fused qkv projection [5120 x 2048] and o [2048 x 4096], bf16 bits, T tokens: float path = the row-dot
  tiles under 32 tokens, BLAS on a float32 copy from 32 (`kernels.linear` at K3SERVE_BF16_ACTIVATIONS=f32); bf16 =
  `kernels.bf16_linear` (activations rounded to bf16, vdpbf16ps);
- experts: 16 bf16 experts of 768 x 2048 with n tokens each, `dense_experts_tiled` (the float tile) against
  `bf16_experts_run`; BLAS (`dense_expert_reference` an expert, the float path from 64 tokens) at 64 and more.

    python benchmarks/bench_bf16_activations.py [--tokens 4 8 16 31 64 512 2048] [--expert-tokens 4 8 32 128]
                                                [--rounds 5]
Prints one line per shape (medians of --rounds alternated rounds), then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model import kernels

LINEAR_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}
EXPERTS, HIDDEN, INNER = 16, 2048, 768


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(paths: dict, flops: float, rounds: int) -> dict[str, float]:
    """path -> median GFLOP/s over `rounds` alternated calls (after one warm call each)."""
    for fn in paths.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            seconds[name].append(timed(fn))
    return {name: flops / statistics.median(s) / 1e9 for name, s in seconds.items()}


def float_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    kernels.BF16_ACTIVATIONS = "f32"
    return kernels.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16, 31, 64, 512, 2048])
    parser.add_argument("--expert-tokens", type=int, nargs="+", default=[4, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not kernels.BF16_DOT_AVAILABLE:
        raise SystemExit("this CPU lacks AVX512_BF16")
    rng = np.random.default_rng(0)
    record = {"threads": os.environ.get("NUMBA_NUM_THREADS"), "load_before": os.getloadavg()[0], "linear": {},
              "experts": {}}
    for label, (rows, cols) in LINEAR_SHAPES.items():
        w = kernels.round_to_bf16(0.02 * rng.standard_normal((rows, cols), np.float32))  # [R, C]
        for T in args.tokens:
            x = rng.standard_normal((T, cols), np.float32)  # [T, C]
            rates = compare({"f32": lambda: float_linear(x, w), "bf16": lambda: kernels.bf16_linear(x, w)},
                            2.0 * rows * cols * T, args.rounds)
            print(f"linear {label} [{rows} x {cols}] T={T}: f32 {rates['f32']:.0f} GFLOP/s, bf16 {rates['bf16']:.0f} "
                  f"GFLOP/s, {rates['bf16'] / rates['f32']:.2f}x", flush=True)
            record["linear"].setdefault(label, {})[T] = rates
    gate_up = kernels.round_to_bf16(0.02 * rng.standard_normal((EXPERTS, 2 * INNER, HIDDEN), np.float32))
    down = kernels.round_to_bf16(0.02 * rng.standard_normal((EXPERTS, HIDDEN, INNER), np.float32))
    for per in args.expert_tokens:
        T = per * EXPERTS
        x = rng.standard_normal((T, HIDDEN), np.float32)  # [T, H]
        ids, tokens = np.arange(EXPERTS), rng.permutation(T)
        starts = np.arange(EXPERTS) * per
        ends = starts + per
        paths = {"f32 tile": lambda: kernels.dense_experts_tiled(gate_up, None, down, None, ids, x, tokens, starts,
                                                                  ends),
                 "bf16": lambda: kernels.bf16_experts_run(gate_up, down, ids, x, tokens, starts, ends)}
        if per >= 64:
            paths["BLAS"] = lambda: [kernels.dense_expert_reference(gate_up[e], None, down[e], None,
                                                                    x[tokens[starts[e]:ends[e]]]) for e in ids]
        rates = compare(paths, 6.0 * HIDDEN * INNER * T, args.rounds)
        print(f"experts {EXPERTS} x [768 x 2048], {per} tokens each: " + ", ".join(
            f"{name} {rate:.0f} GFLOP/s" for name, rate in rates.items())
              + f"; bf16 / f32 tile {rates['bf16'] / rates['f32 tile']:.2f}x", flush=True)
        record["experts"][per] = rates
    record["load_after"] = os.getloadavg()[0]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
