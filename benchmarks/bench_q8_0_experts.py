"""The families' expert kernel on a GGUF's Q8_0 experts kept as stored (int8 values, one float32 scale per block of
32) against the same kernel on float32 experts (what widening Q8_0 on read held before) and on int8 experts with
one scale per row (`--expert-precision int8`).

One MoE layer's active experts in one call (`dense_experts_run`): 8 of 16 stacked experts of Qwen3-30B-A3B's shape
(H 2048, I 768), at T = 1 token (decode: every token to each of the 8 experts) and T = 8 tokens. The three methods
run alternately in rounds, so drifting machine load hits them alike; each figure is the median over the rounds.
Bytes are the weight bytes held per expert.

Usage: python benchmarks/bench_q8_0_experts.py [--rounds N] [--hidden H] [--inner I]
Prints a table, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from k3serve.model.kernels import dense_experts_run, warmup

METHODS = ("q8_0", "float32", "int8_row")
NUM_EXPERTS, ACTIVE = 16, 8


def stacks(rng: np.random.Generator, hidden: int, inner: int) -> dict[str, tuple]:
    """method -> (gate_up, gate_up scales, down, down scales) stacked [E, ...], the same int8 values in each."""
    gate_up = rng.integers(-127, 128, (NUM_EXPERTS, 2 * inner, hidden)).astype(np.int8)
    down = rng.integers(-127, 128, (NUM_EXPERTS, hidden, inner)).astype(np.int8)
    gate_up_blocks = rng.uniform(5e-4, 1.5e-3, (NUM_EXPERTS, 2 * inner, hidden // 32)).astype(np.float32)
    down_blocks = rng.uniform(5e-4, 1.5e-3, (NUM_EXPERTS, hidden, inner // 32)).astype(np.float32)

    def widen(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        return (w.reshape(*s.shape, 32).astype(np.float32) * s[..., None]).reshape(w.shape)

    return {"q8_0": (gate_up, gate_up_blocks, down, down_blocks),
            "float32": (widen(gate_up, gate_up_blocks), None, widen(down, down_blocks), None),
            "int8_row": (gate_up, gate_up_blocks.mean(axis=2), down, down_blocks.mean(axis=2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768)
    args = parser.parse_args()
    warmup()
    rng = np.random.default_rng(0)
    experts = stacks(rng, args.hidden, args.inner)
    expert_ids = np.arange(0, NUM_EXPERTS, NUM_EXPERTS // ACTIVE, dtype=np.int64)
    record = {"hidden": args.hidden, "inner": args.inner, "active": ACTIVE, "rounds": args.rounds,
              "load_avg": os.getloadavg()[0], "bytes_per_expert": {}, "ms": {}}
    for method, parts in experts.items():
        record["bytes_per_expert"][method] = sum(a[0].nbytes for a in parts if a is not None)
    print(f"{'tokens':>6} " + " ".join(f"{m:>10}" for m in METHODS) + "   (ms per layer call, median)")
    for tokens in (1, 8):
        x = rng.standard_normal((tokens, args.hidden)).astype(np.float32)
        rows = np.tile(np.arange(tokens, dtype=np.int64), ACTIVE)
        starts = np.arange(ACTIVE, dtype=np.int64) * tokens
        ends = starts + tokens
        for method in METHODS:  # compile each signature once before timing
            dense_experts_run(*experts[method], expert_ids, x, rows, starts, ends)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                start = time.perf_counter()
                dense_experts_run(*experts[method], expert_ids, x, rows, starts, ends)
                times[method].append(time.perf_counter() - start)
        medians = {m: float(np.median(t)) * 1e3 for m, t in times.items()}
        record["ms"][str(tokens)] = medians
        print(f"{tokens:>6} " + " ".join(f"{medians[m]:>10.2f}" for m in METHODS))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
