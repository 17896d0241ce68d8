"""The streaming options every streaming source takes (`--ram-budget`, `--io`, `--queue-depth`, `--cache`,
`--prefetch`, ...), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3serve.errors import K3Error
from k3serve.stream.cache import POLICIES
from k3serve.stream.io import IO_MODES

PREFETCH_MODES = ("none", "next-layer")


@dataclass(frozen=True)
class StreamOptions:
    ram_budget: int | None = None  # bytes; None = unlimited
    io: str = "pread"
    queue_depth: int = 16
    cache: str = "lru"
    prefetch: str = "none"
    prefetch_max: int | None = None  # guesses per layer; None = TOPK
    pin_trunk_bytes: int | None = None  # cap on pinned trunk; None = as much as the budget allows
    cache_profile: Path | None = None  # a routing trace: the pinned policy's popularity profile
    trace_out: Path | None = None
    # bf16 (the default): trunk matrices held as stored, as views of what was read on a store of format 2 (the
    # memory floor, stream/budget.py); float32: widened (faster BLAS for long prefills, a 2.7x higher floor)
    trunk_dtype: str = "bf16"


    def __post_init__(self) -> None:
        if self.io not in IO_MODES:
            raise K3Error(f"unknown --io {self.io!r}; choose one of {', '.join(IO_MODES)}")
        if self.cache not in POLICIES:
            raise K3Error(f"unknown --cache {self.cache!r}; choose one of {', '.join(POLICIES)}")
        if self.prefetch not in PREFETCH_MODES:
            raise K3Error(f"unknown --prefetch {self.prefetch!r}; choose one of {', '.join(PREFETCH_MODES)}")
        if self.trunk_dtype not in ("float32", "bf16"):
            raise K3Error(f"unknown --trunk-dtype {self.trunk_dtype!r}; choose float32 or bf16")
        if self.queue_depth < 1 or self.queue_depth > 1024:
            raise K3Error(f"--queue-depth must be 1..1024, got {self.queue_depth}")
        if self.prefetch_max is not None and self.prefetch_max < 0:
            raise K3Error("--prefetch-max must be >= 0")
        if self.cache == "pinned" and self.cache_profile is None:
            raise K3Error("--cache pinned needs --cache-profile TRACE (a routing trace written by --trace-out)")
