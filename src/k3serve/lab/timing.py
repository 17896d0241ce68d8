"""How the lab times things: every timed path runs once untimed first (the model load, numba's compile or cache
load, first-touch of buffers happen there, not in the first measurement), and a time on the page is the median of
at least MIN_REPEATS measurements."""

from __future__ import annotations

from k3serve.lab.registry import Param

MIN_REPEATS = 3
WARM_UP_MESSAGE = "warming up (untimed: model load, kernel compile, one pass of each timed path)"


def repeats_param(name: str = "repeats", default: int = MIN_REPEATS, maximum: int = 10,
                  help: str = "alternated repeats (medians)") -> Param:
    """The number of timed repeats: at least MIN_REPEATS."""
    return Param(name, "int", default, help, min=MIN_REPEATS, max=maximum)
