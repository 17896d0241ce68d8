"""The routed-expert kernels at one shape, by tokens an expert: which path is fastest where (issue 33, prefill).

    python benchmarks/bench_dense_expert_paths.py [--kinds int8,bf16,f32,q8_0,mxfp4] [--tokens 1 4 8 16 32 64 256]
                                                  [--experts 16] [--hidden 2048] [--inner 768] [--repeats 5]

16 experts of Qwen3-30B-A3B's shape (768 x 2048, random values) in one stack, each given n tokens, through every
path `families.experts.run_experts` can take for that kind, each timed as one call over the 16 experts (median
of --repeats, after one untimed call that compiles):
- "rowdot": `kernels.dense_experts_run` (int8, bf16, float32, Q8_0 blocks) or `kernels.mxfp4_experts_run` with
  float activations (MXFP4): the row dot, 2 rows x 4 tokens a pass, every dot with the one-token bits;
- "tile": `kernels.dense_experts_tiled` / `kernels.mxfp4_experts_tiled` (rows widened to float32 once a call);
- "blas": `kernels.dense_expert_reference` an expert (a transient float32 copy, then numpy's BLAS).
Prints ms an expert per path, one line per (kind, n), then a JSON record on the last line. Figures:
docs/BENCHMARKS.md, "Experts at prefill: the row dot at every count".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy: OpenBLAS's workers sleep after a call)
import numpy as np

from k3serve.host import describe_host
from k3serve.model import kernels


def stack(kind: str, experts: int, hidden: int, inner: int, rng: np.random.Generator) -> tuple:
    """(gate_up, gate_up scales, down, down scales) of `experts` random experts, or MXFP4's six arrays."""
    if kind == "mxfp4":
        def matrix(rows, cols):
            return (rng.integers(0, 256, (experts, rows, cols // 2), dtype=np.uint8),
                    rng.integers(118, 128, (experts, rows, cols // 32), dtype=np.uint8))
        return (*matrix(inner, hidden), *matrix(inner, hidden), *matrix(hidden, inner))
    shapes = ((experts, 2 * inner, hidden), (experts, hidden, inner))
    if kind in ("int8", "q8_0"):
        values = [rng.integers(-127, 128, size=s, dtype=np.int8) for s in shapes]
        scales = [rng.random(s[:2] if kind == "int8" else (*s[:2], s[2] // 32), dtype=np.float32) * np.float32(0.01)
                  for s in shapes]
        return values[0], scales[0], values[1], scales[1]
    floats = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.05) for s in shapes]
    if kind == "bf16":
        floats = [(f.view(np.uint32) >> 16).astype(np.uint16) for f in floats]
    return floats[0], None, floats[1], None


def paths(kind: str, stacked: tuple, ids, x, tokens, starts, ends) -> dict:
    if kind == "mxfp4":
        return {"rowdot": lambda: kernels.mxfp4_experts_run(stacked, ids, x, tokens, starts, ends, 0.0, 0.0,
                                                            activation="silu", activations="f32"),
                "tile": lambda: kernels.mxfp4_experts_tiled(stacked, ids, x, tokens, starts, ends,
                                                            activations="f32")}
    gate_up, gate_up_scales, down, down_scales = stacked

    def blas():
        for k, e in enumerate(ids):
            kernels.dense_expert_reference(gate_up[e], None if gate_up_scales is None else gate_up_scales[e], down[e],
                                           None if down_scales is None else down_scales[e],
                                           x[tokens[starts[k]:ends[k]]])

    return {"rowdot": lambda: kernels.dense_experts_run(*stacked, ids, x, tokens, starts, ends),
            "tile": lambda: kernels.dense_experts_tiled(*stacked, ids, x, tokens, starts, ends), "blas": blas}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="int8,bf16,f32,q8_0,mxfp4")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for kind in args.kinds.split(","):
        stacked = stack(kind, args.experts, args.hidden, args.inner, rng)
        for n in args.tokens:
            x = rng.standard_normal((n * args.experts, args.hidden), dtype=np.float32)
            ids = np.arange(args.experts, dtype=np.int64)
            starts = ids * n
            ends = starts + n
            tokens = rng.permutation(n * args.experts).astype(np.int64)  # gathered rows, as routing gives them
            row = {"kind": kind, "tokens": n}
            for name, run in paths(kind, stacked, ids, x, tokens, starts, ends).items():
                run()
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - started)
                row[f"{name}_ms_per_expert"] = round(statistics.median(times) / args.experts * 1e3, 3)
            results.append(row)
            print(f"{kind:5s} n={n:4d}: " + ", ".join(f"{k.replace('_ms_per_expert', '')} {v:.2f} ms"
                                                       for k, v in row.items() if k.endswith("expert")), flush=True)
    print(json.dumps({"benchmark": "dense_expert_paths", "machine": describe_host(), "experts": args.experts,
                      "hidden": args.hidden, "inner": args.inner, "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
