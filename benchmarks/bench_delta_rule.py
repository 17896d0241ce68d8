"""The delta rule (KDA / gated DeltaNet recurrence): the compiled token-by-token loop the engine runs
(model/delta_rule.py) against the numpy chunked form (kda.kda_chunked, the engine's prefill path before) on one
sequence, per layer call. Median of --repeats calls each; both from the same random state and inputs.

    .venv/bin/python benchmarks/bench_delta_rule.py [--repeats 30]

Shapes: the embedded model (4 heads x 32) and the real K3's head size (8 of its heads x 128).
Prints a table and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.host import describe_host
from k3serve.model.delta_rule import delta_rule_segments
from k3serve.model.kda import KDAInputs, kda_chunked


def inputs(rng: np.random.Generator, T: int, NH: int, D: int) -> KDAInputs:
    q = rng.standard_normal((T, NH, D), dtype=np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.float32(np.sqrt(D))
    k = rng.standard_normal((T, NH, D), dtype=np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, NH, D), dtype=np.float32)
    g = (-5.0 / (1.0 + np.exp(-rng.standard_normal((T, NH, D))))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, NH))))).astype(np.float32)
    return KDAInputs(q, k, v, g, beta)


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"machine: {describe_host()}")
    rng = np.random.default_rng(0)
    rows = []
    for label, NH, D, lengths in (("embedded model, 4 heads x 32", 4, 32, (1, 5, 9, 64, 269)),
                                  ("K3 head size, 8 heads x 128", 8, 128, (1, 5, 64, 256))):
        state = rng.standard_normal((NH, D, D), dtype=np.float32) * np.float32(0.1)
        for T in lengths:
            x = inputs(rng, T, NH, D)
            seg = np.array([[0, T]])
            chunked = median_us(lambda: kda_chunked(x, state), args.repeats)
            compiled = median_us(lambda: delta_rule_segments(x.q, x.k, x.v, x.g, x.beta, state[None], seg),
                                 args.repeats)
            o_c, _ = kda_chunked(x, state)
            o_f, _ = delta_rule_segments(x.q, x.k, x.v, x.g, x.beta, state[None], seg)
            row = {"shape": label, "tokens": T, "chunked_us": round(chunked, 1), "compiled_us": round(compiled, 1),
                   "speedup": round(chunked / compiled, 2), "max_abs_diff": float(np.abs(o_c - o_f).max())}
            rows.append(row)
            print(f"{label:<30} T={T:>4}  chunked {chunked:>9.1f} us  compiled {compiled:>8.1f} us  "
                  f"{row['speedup']:>5.1f}x  max |diff| {row['max_abs_diff']:.1e}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
