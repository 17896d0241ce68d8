"""First-call (compile) CPU time of each compiled trunk stage of model/fused_ops.py.

    NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/bench_fused_ops_compile.py    # cold: compiles each stage
    python benchmarks/bench_fused_ops_compile.py                                  # warm: loads numba's cache

Prints one line per stage, a summary line and a JSON record on the last line.
"""

from __future__ import annotations

import json
import os
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model import fused_ops


def main() -> None:
    row, vector, eps = np.ones((1, 32), np.float32), np.ones(32, np.float32), np.float32(1e-5)
    ids, weights = np.empty((1, 2), np.int64), np.empty((1, 2), np.float32)
    cos_sin = np.ones((1, 4), np.float32)
    first_calls = {
        "rms_norm_into": lambda: fused_ops.rms_norm_into(row, vector, eps, row.copy()),
        "l2_normalize_into": lambda: fused_ops.l2_normalize_into(row, eps, row.copy()),
        "add_rms_norm": lambda: fused_ops.add_rms_norm(row.copy(), row, vector, eps, row.copy()),
        "attn_res_norm": lambda: fused_ops.attn_res_norm(np.ones((2, 1, 32), np.float32), vector, vector, eps,
                                                         row.copy(), row.copy()),
        "route_top_k": lambda: fused_ops.route_top_k(row, vector, True, np.float32(1.0), ids, weights),
        "softmax_top_k": lambda: fused_ops.softmax_top_k(row.copy(), True, ids, weights),
        "rotate_into": lambda: fused_ops.rotate_into(np.ones((1, 2, 8), np.float32), cos_sin, cos_sin, False,
                                                     np.empty((1, 2, 8), np.float32)),
    }
    seconds = {}
    for name, call in first_calls.items():
        start = time.process_time()
        call()
        seconds[name] = round(time.process_time() - start, 3)
        print(f"  {name:<20} {seconds[name]:6.2f} s CPU")
    total = sum(seconds.values())
    print(f"fused_ops first calls: {total:.2f} s CPU (NUMBA_CACHE_DIR={os.environ.get('NUMBA_CACHE_DIR', 'default')}, "
          f"load average {os.getloadavg()[0]:.1f})")
    print(json.dumps({"benchmark": "fused_ops_compile", "cpu_s": seconds, "total_cpu_s": round(total, 3),
                      "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR")}))


if __name__ == "__main__":
    main()
