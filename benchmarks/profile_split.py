"""Split a cProfile of decode steps into compiled kernels, C calls and Python frames (issue 33, item 2).

- compiled: the tottime of k3serve's numba functions (their dispatch included);
- C calls: the tottime of built-in calls (numpy ufunc methods and functions, BLAS through `np.matmul`, dicts);
- Python: the own time of every other frame, k3serve's and numpy's Python wrappers. It includes the numpy
  operators a frame evaluates inline (`x @ w.T`, `a + b`), which cProfile cannot see as calls.

`python_share` = Python / the profiled forwards' total. cProfile inflates Python's part (it adds its own cost to
each call), so compare shares measured the same way; `calls_per_step` (every profiled call) is exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

from numba.core.dispatcher import Dispatcher


def compiled_keys() -> set[tuple[str, int, str]]:
    """cProfile's (file, line, name) of every numba function in k3serve's loaded modules."""
    keys = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("k3serve") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, Dispatcher):
                code = value.py_func.__code__
                keys.add((code.co_filename, code.co_firstlineno, code.co_name))
    return keys


def split(stats: dict, steps: int) -> dict:
    """stats: pstats.Stats(...).stats of `steps` forwards -> ms per step of each part, the shares and calls."""
    total = max(v[3] for k, v in stats.items() if k[2] == "forward")
    compiled_names = compiled_keys()
    compiled = sum(v[2] for k, v in stats.items() if k in compiled_names)
    c_calls = sum(v[2] for k, v in stats.items() if k[0] == "~")
    python = total - compiled - c_calls
    return {"forward_ms": round(total / steps * 1e3, 3), "compiled_ms": round(compiled / steps * 1e3, 3),
            "c_calls_ms": round(c_calls / steps * 1e3, 3), "python_ms": round(python / steps * 1e3, 3),
            "python_share": round(python / total, 3),
            "calls_per_step": round(sum(v[1] for v in stats.values()) / steps, 1)}


def by_own_time(stats: dict) -> list[tuple[float, str]]:
    """stats: pstats.Stats(...).stats -> (own time, "file.py:function") of every function, largest first."""
    return sorted(((entry[2], f"{Path(key[0]).name}:{key[2]}") for key, entry in stats.items()), reverse=True)


def line(parts: dict) -> str:
    return (f"profiled forward {parts['forward_ms']:.2f} ms: compiled {parts['compiled_ms']:.2f}, C calls "
            f"{parts['c_calls_ms']:.2f}, Python {parts['python_ms']:.2f} ({parts['python_share']:.0%}); "
            f"{parts['calls_per_step']:.0f} calls per step")
