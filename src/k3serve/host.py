"""What a benchmark record says about the machine it ran on."""

from __future__ import annotations

import os
import platform

import numpy as np


def describe_host() -> dict[str, object]:
    """CPU model, core count, Python and numpy versions, and the 1-minute load average at the time of the call."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "load_average": os.getloadavg()[0]}


# OpenMP's wait settings, OpenBLAS's (importing k3serve sets it: k3serve/__init__.py) and k3serve's own
# (k3serve/threads.py): none reaches a child run "at its defaults", which sets its own
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "K3SERVE_WAIT_POLICY",
                  "K3SERVE_CORE_KEEPERS", "K3SERVE_SPIN")


def defaults_environment(threads: int | str) -> dict[str, str]:
    """The environment for an engine run in a fresh process "at its defaults": this process's, less the wait
    variables (OpenMP's and k3serve's), with `threads` threads. A benchmark may set OMP_WAIT_POLICY (or, before
    2026-12-06 evening, importing k3serve's kernels set PASSIVE); a child that inherited it would run llama.cpp with
    its workers sleeping, which is not llama.cpp's default (bench_peers' figures before 2026-12-06 noon had that flaw: docs/BENCHMARKS.md)."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    return env
