"""Decode-phase figures of a streaming model: generate on each prompt and count what the decode steps read.

The first generated token comes out of the prefill, whose reads are counted apart (`prefill`); every later token
costs one decode step, and per-token figures divide by those steps. Shared by benchmarks/bench_stream.py and the
lab's streaming modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from k3serve.model.expert_source import StreamStats


@dataclass
class DecodeMeasurement:
    decode_steps: int
    decode_seconds: float
    prefill_seconds: float
    decode: StreamStats  # reads and cache events of the decode steps
    prefill: StreamStats
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def seconds_per_token(self) -> float:
        return self.decode_seconds / max(self.decode_steps, 1)

    @property
    def bytes_per_token(self) -> float:
        return self.decode.bytes_read / max(self.decode_steps, 1)

    @property
    def reads_per_token(self) -> float:
        return self.decode.num_reads / max(self.decode_steps, 1)

    @property
    def prefetch_hit_share(self) -> float:
        """Expert requests served by a prefetch made during the same step / all expert requests."""
        return self.decode.expert_prefetch_hits / max(self.decode.expert_requests, 1)


def measure_decode(model, prompts: Sequence[Sequence[int]], max_tokens: int,
                   between: Callable[[], None] | None = None) -> DecodeMeasurement:
    """Greedy-generate `max_tokens` on every prompt with `model` (any `Model` over a streaming `ExpertSource`); `between()`
    runs before each prompt (a cancellation check)."""
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams

    source = model.experts
    result = DecodeMeasurement(0, 0.0, 0.0, StreamStats(), StreamStats())
    for prompt in prompts:
        if between is not None:
            between()
        before = source.stats().stream
        marks: list[StreamStats] = []
        out, report = generate(model, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               on_token=lambda _t: marks.append(source.stats().stream) if not marks else None)
        after = source.stats().stream
        result.prefill_seconds += report.prefill_seconds
        result.decode_seconds += report.decode_seconds
        result.decode_steps += len(out) - 1
        result.prefill = result.prefill.plus(marks[0].minus(before))
        result.decode = result.decode.plus(after.minus(marks[0]))
        result.outputs.append(out)
    return result
