"""Trunk matrix products at each trunk precision: `kernels.linear` on bf16 bits, Q8_0 blocks and MXFP4 bytes, and
float32 BLAS beside them.

    bf16     the bf16 row-dot kernel below 32 tokens, BLAS on transient float32 row blocks from 32 on
    q8_0     the Q8_0 x Q8_0 kernel (activations quantized per row, as llama.cpp) at every T
    mxfp4    the MXFP4 kernel (float activations) at every T
    float32  numpy x @ W.T (the widened trunk)

Shapes are full-K3 trunk matrices: the latent down projection [3584, 7168] and up [7168, 3584], the shared
expert's gate+up [12288, 7168]; T = 1 (decode), 8 (a decode batch) and 64 (a prefill chunk). The methods run
alternately in rounds, so drifting machine load hits them alike; each figure is the median over the rounds, in
milliseconds and in weight GB/s (the bytes each method reads: 2, 34/32, 17/32 or 4 per weight).

    python benchmarks/bench_trunk_kernels.py [--rounds 5] [--quick]
Prints a table, one summary line, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.host import describe_host
from k3serve.model.kernels import ISA, linear, warmup
from k3serve.weights.bf16 import f32_to_bf16_bits
from k3serve.weights.quantized import QuantizedMatrix

SHAPES = {"latent_down [3584, 7168]": (3584, 7168), "latent_up [7168, 3584]": (7168, 3584),
          "shared gate_up [12288, 7168]": (12288, 7168)}
METHODS = ("bf16", "q8_0", "mxfp4", "float32")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds, the first shape only")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    warmup()
    rng = np.random.default_rng(0)
    rows = []
    for label, (num_rows, num_cols) in shapes.items():
        w = (rng.standard_normal((num_rows, num_cols)) * 0.02).astype(np.float32)
        matrices = {"bf16": f32_to_bf16_bits(w), "q8_0": QuantizedMatrix.quantize(w, "q8_0"),
                    "mxfp4": QuantizedMatrix.quantize(w, "mxfp4"), "float32": w}
        weight_bytes = {m: matrices[m].nbytes for m in METHODS}
        for tokens in (1, 8, 64):
            x = rng.standard_normal((tokens, num_cols)).astype(np.float32)
            for method in METHODS:
                linear(x, matrices[method])
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(rounds):
                for method in METHODS:
                    started = time.perf_counter()
                    linear(x, matrices[method])
                    times[method].append(time.perf_counter() - started)
            for method in METHODS:
                seconds = statistics.median(times[method])
                rows.append({"shape": label, "tokens": tokens, "method": method, "ms": 1e3 * seconds,
                             "weight_gb_per_s": weight_bytes[method] / seconds / 1e9})
    print(f"host: {describe_host()}; ISA {ISA}; medians of {rounds} alternated rounds")
    print(f"{'shape':>30} {'T':>3} " + " ".join(f"{m + ' ms':>11}" for m in METHODS) + "   q8_0/bf16  mxfp4/bf16")
    for label in shapes:
        for tokens in (1, 8, 64):
            ms = {r["method"]: r["ms"] for r in rows if r["shape"] == label and r["tokens"] == tokens}
            print(f"{label:>30} {tokens:>3} " + " ".join(f"{ms[m]:>11.2f}" for m in METHODS)
                  + f"   {ms['bf16'] / ms['q8_0']:>8.2f}x {ms['bf16'] / ms['mxfp4']:>10.2f}x")
    decode = [r for r in rows if r["tokens"] == 1]
    speedup = statistics.median(
        next(r["ms"] for r in decode if r["shape"] == s and r["method"] == "bf16")
        / next(r["ms"] for r in decode if r["shape"] == s and r["method"] == "q8_0") for s in shapes)
    print(f"trunk kernels: q8_0 decode (T=1) {speedup:.2f}x bf16's speed (median over {len(shapes)} shapes)")
    print(json.dumps({"host": describe_host(), "isa": ISA, "rounds": rounds, "rows": rows}))


if __name__ == "__main__":
    main()
