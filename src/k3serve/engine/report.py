"""The run report of one generation (`k3serve generate`): token counts, prefill and decode speed, peak RSS, and the
figures a streaming source or speculation adds."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3serve.engine.speculative import SpeculationStats


@dataclass
class RunReport:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    peak_rss_bytes: int
    finish_reason: str  # "stop" (a stop id) or "length"
    extra_lines: list[str] = field(default_factory=list)  # e.g. the streaming source's decode-phase figures
    speculation: SpeculationStats | None = None  # windows, drafts and acceptance when speculation ran

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        # the first generated token comes out of the prefill; each later one costs a decode step
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def lines(self) -> list[str]:
        return [
            f"prompt tokens     {self.prompt_tokens}",
            f"generated tokens  {self.generated_tokens} (finish: {self.finish_reason})",
            f"prefill           {self.prefill_tokens_per_second:.1f} tok/s ({self.prefill_seconds:.3f} s)",
            f"decode            {self.decode_tokens_per_second:.2f} tok/s ({self.decode_seconds:.3f} s)",
            f"peak RSS          {self.peak_rss_bytes / 2**20:.1f} MiB",
        ] + self.extra_lines


def peak_rss_bytes() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024
