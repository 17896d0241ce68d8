"""An MXFP4 trunk matrix as store format 3 holds it (by rows: each row's nibbles, then its scales; two strided
views of one buffer) against the same matrix contiguous (nibbles [R, C/2] and scales [R, C/32] apart), multiplied
by `kernels.mxfp4_matmul` at T = 1: same bits (asserted), and the time of each, alternated in rounds.

Shapes: full-K3 trunk matrices, the MLA latent down projection [3584, 7168] and the shared experts' gate+up
[12288, 7168]. Both buffers are numpy allocations (what the staging ring is), so only the layout differs.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mxfp4_rows.py [--rounds 7] [--calls 20]
Prints one line per shape (min and median ms of each layout), then a JSON record.
"""

from __future__ import annotations

import argparse
import json
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model.kernels import mxfp4_matmul
from k3serve.weights.quantized import QuantizedMatrix

SHAPES = ((3584, 7168), (12288, 7168))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    records = []
    for rows, cols in SHAPES:
        contiguous = QuantizedMatrix.quantize(rng.standard_normal((rows, cols)).astype(np.float32), "mxfp4")
        buffer = np.empty(contiguous.nbytes, np.uint8)  # [R * 17 C / 32]
        buffer[:] = np.frombuffer(contiguous.to_bytes(rows=True), np.uint8)
        by_rows = QuantizedMatrix.from_bytes("MXFP4", buffer, contiguous.shape, rows=True)
        x = rng.standard_normal((1, cols)).astype(np.float32)  # [T, C]
        layouts = {"contiguous": contiguous, "rows": by_rows}
        results = {name: mxfp4_matmul(m.data, m.scales, x) for name, m in layouts.items()}
        assert np.array_equal(results["contiguous"], results["rows"])
        samples: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.rounds):
            for name, m in layouts.items():
                started = time.perf_counter()
                for _ in range(args.calls):
                    mxfp4_matmul(m.data, m.scales, x)
                samples[name].append((time.perf_counter() - started) / args.calls * 1e3)
        record = {"shape": [rows, cols], "bits_equal": True,
                  **{f"{name}_ms_min": float(np.min(s)) for name, s in samples.items()},
                  **{f"{name}_ms_median": float(np.median(s)) for name, s in samples.items()}}
        records.append(record)
        print(f"[{rows}, {cols}] T=1: contiguous {record['contiguous_ms_min']:.2f} ms min "
              f"({record['contiguous_ms_median']:.2f} median), rows {record['rows_ms_min']:.2f} min "
              f"({record['rows_ms_median']:.2f} median); same bits")
    print(json.dumps({"rounds": args.rounds, "calls": args.calls, "shapes": records}))


if __name__ == "__main__":
    main()
