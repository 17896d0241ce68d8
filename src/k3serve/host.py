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
