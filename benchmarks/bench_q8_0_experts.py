"""The families' expert kernels on a GGUF's Q8_0 experts kept as stored (int8 values, one scale per block of 32:
float16 as the families hold them since 2026-12-07 afternoon, float32 for the float kernels), on Q8_0 activations
(the default since 2026-12-07: `q8_0_experts_run`, llama.cpp's Q8_0 x Q8_0) and on float activations
(`K3SERVE_INT8_ACTIVATIONS=f32`: the float row dot below DENSE_TILE_MIN_TOKENS tokens an expert, the float tile
from there, as `run_experts` dispatches them), against the float kernels on float32 experts (what widening Q8_0 on
read held before) and on int8 experts with one scale per row (`--expert-precision int8`).

One MoE layer's active experts in one call: --active (at most 8) of 16 stacked experts of Qwen3-30B-A3B's shape
by default (H 2048, I 768; `--hidden 2048 --inner 1408 --active 6` is Moonlight's), at T = 1 token (decode: every
token to each active expert), 2, 8 and 64 tokens an expert. The methods run alternately in rounds, so drifting
machine load hits them alike; each figure is the median over the rounds. Bytes are the weight bytes held per
expert. The experts (active x 3 x H x I bytes, 52 MB at Moonlight's) exceed L3 only by about twice, so a round's
later calls find part of them cached: the model, where other weights stream in between, reads them colder.

Usage: python benchmarks/bench_q8_0_experts.py [--rounds N] [--hidden H] [--inner I] [--active A]
Prints a table, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model.families.experts import DENSE_TILE_MIN_TOKENS
from k3serve.model.kernels import dense_experts_run, dense_experts_tiled, q8_0_experts_run, warmup

METHODS = ("q8_0_q8", "q8_0_f32", "float32", "int8_row")
NUM_EXPERTS = 16


def stacks(rng: np.random.Generator, hidden: int, inner: int) -> dict[str, tuple]:
    """method -> (gate_up, gate_up scales, down, down scales) stacked [E, ...], the same int8 values in each."""
    gate_up = rng.integers(-127, 128, (NUM_EXPERTS, 2 * inner, hidden)).astype(np.int8)
    down = rng.integers(-127, 128, (NUM_EXPERTS, hidden, inner)).astype(np.int8)
    # half-precision values (a GGUF's), held as float32 for the float kernels
    gate_up_blocks = rng.uniform(5e-4, 1.5e-3, (NUM_EXPERTS, 2 * inner, hidden // 32)).astype(np.float16)
    down_blocks = rng.uniform(5e-4, 1.5e-3, (NUM_EXPERTS, hidden, inner // 32)).astype(np.float16)
    gate_up_blocks, down_blocks = gate_up_blocks.astype(np.float32), down_blocks.astype(np.float32)

    def widen(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        return (w.reshape(*s.shape, 32).astype(np.float32) * s[..., None]).reshape(w.shape)

    return {"q8_0_q8": (gate_up, gate_up_blocks.astype(np.float16), down, down_blocks.astype(np.float16)),
            "q8_0_f32": (gate_up, gate_up_blocks, down, down_blocks),
            "float32": (widen(gate_up, gate_up_blocks), None, widen(down, down_blocks), None),
            "int8_row": (gate_up, gate_up_blocks.mean(axis=2), down, down_blocks.mean(axis=2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768)
    parser.add_argument("--active", type=int, default=8)
    args = parser.parse_args()
    warmup()
    rng = np.random.default_rng(0)
    experts = stacks(rng, args.hidden, args.inner)
    expert_ids = np.arange(0, 2 * args.active, 2, dtype=np.int64)
    record = {"hidden": args.hidden, "inner": args.inner, "active": args.active, "rounds": args.rounds,
              "load_avg": os.getloadavg()[0], "bytes_per_expert": {}, "ms": {}}
    for method, parts in experts.items():
        record["bytes_per_expert"][method] = sum(a[0].nbytes for a in parts if a is not None)
    print(f"{'tokens':>6} " + " ".join(f"{m:>10}" for m in METHODS) + "   (ms per layer call, median)")
    for tokens in (1, 2, 8, 64):
        x = rng.standard_normal((tokens, args.hidden)).astype(np.float32)
        rows = np.tile(np.arange(tokens, dtype=np.int64), args.active)
        starts = np.arange(args.active, dtype=np.int64) * tokens
        ends = starts + tokens
        kernels = {m: dense_experts_run for m in METHODS}
        kernels["q8_0_q8"] = q8_0_experts_run
        if tokens >= DENSE_TILE_MIN_TOKENS:  # run_experts' float dispatch for block scales
            kernels["q8_0_f32"] = dense_experts_tiled
        for method in METHODS:  # compile each signature once before timing
            kernels[method](*experts[method], expert_ids, x, rows, starts, ends)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                start = time.perf_counter()
                kernels[method](*experts[method], expert_ids, x, rows, starts, ends)
                times[method].append(time.perf_counter() - start)
        medians = {m: float(np.median(t)) * 1e3 for m, t in times.items()}
        record["ms"][str(tokens)] = medians
        print(f"{tokens:>6} " + " ".join(f"{medians[m]:>10.2f}" for m in METHODS))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
