"""One streaming decode run for the lab's modules: open a packed store under options, generate on the prompts,
close; the figures of the decode steps (k3serve.lab.measure) plus the budget plan's expert slots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from k3serve.lab.measure import DecodeMeasurement, measure_decode
from k3serve.stream.options import StreamOptions

WIDENINGS = {"1x": (1, 1), "4x": (4, 4)}  # experts widened in units and latent (exact duplication, same routing)


@dataclass
class StreamedRun:
    measurement: DecodeMeasurement
    expert_slots: int
    pinned_layers: int
    streamed_layers: int


def warm_up(store: Path, options: StreamOptions, prompts: Sequence[Sequence[int]], cancel) -> None:
    """One untimed short decode from `store` (its loader, the streaming source's reads and the kernels run once), so
    that the first timed run does not pay for first use."""
    streamed_run(store, options, prompts[:1], 2, cancel)


def streamed_run(store: Path, options: StreamOptions, prompts: Sequence[Sequence[int]], max_tokens: int,
                 cancel) -> StreamedRun:
    from k3serve.loading import load_model

    loaded = load_model(store, stream=options)
    source = loaded.model.experts
    try:
        measurement = measure_decode(loaded.model, prompts, max_tokens, between=cancel.check)
        plan = source.plan
        return StreamedRun(measurement, plan.expert_slots, len(plan.pinned_layers), len(plan.streamed_layers))
    finally:
        source.close()
