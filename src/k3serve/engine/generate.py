"""Single-sequence generation: prefill the prompt, then one decode step per token, with a run report."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from k3serve.config import DEFAULT_MAX_MODEL_LEN
from k3serve.engine.sampling import Sampler, SamplingParams, mask_logits
from k3serve.errors import ContextLengthError, RequestError
from k3serve.model.k3 import ForwardItem, K3Model

if TYPE_CHECKING:
    from k3serve.engine.speculative import DrafterFactory, SpeculativeConfig


@dataclass
class RunReport:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    peak_rss_bytes: int
    finish_reason: str  # "stop" (end-of-sequence id) or "length"
    extra_lines: list[str] = field(default_factory=list)  # e.g. the streaming source's decode-phase figures

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


def generate(model: K3Model, prompt_ids: Sequence[int], params: SamplingParams,
             stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
             speculative: SpeculativeConfig | None = None, drafters: DrafterFactory | None = None,
             constraint: Callable[[list[int]], np.ndarray | None] | None = None,
             max_context: int = DEFAULT_MAX_MODEL_LEN) -> tuple[list[int], RunReport]:
    """Generate up to params.max_tokens tokens after `prompt_ids`; `on_token` sees each one as it is made.
    With `speculative`, drafts are verified in windows (engine/speculative.py): same greedy tokens.
    `constraint(tokens so far)` may return the ids allowed next (token healing, engine/healing.py); None: any.
    Raises `ContextLengthError` when the prompt plus max_tokens exceeds `max_context`, as the server does."""
    if len(prompt_ids) == 0:
        raise RequestError("the prompt is empty: give at least one token")
    ContextLengthError.check(len(prompt_ids), params.max_tokens, max_context)
    if speculative is not None:
        from k3serve.engine.speculative import speculative_generate

        return speculative_generate(model, prompt_ids, params, speculative, stop_ids, on_token, drafters,
                                    constraint)
    sampler = Sampler(params)
    stops = set() if params.ignore_eos else set(stop_ids) | set(params.stop_token_ids)
    cache = model.new_cache()
    started = time.perf_counter()
    logits = model.forward([ForwardItem(np.asarray(prompt_ids, dtype=np.int64), cache)]).logits[0][-1]
    prefill_seconds = time.perf_counter() - started
    stream_stats = getattr(getattr(model, "source", None), "stream_stats", None)  # a streaming source reports its I/O
    after_prefill = stream_stats() if stream_stats is not None else None
    tokens: list[int] = []
    finish = "length"
    started = time.perf_counter()
    while True:
        token = sampler.sample(mask_logits(logits, constraint(tokens) if constraint is not None else None))
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in stops:
            finish = "stop"
            break
        if len(tokens) >= params.max_tokens:
            break
        logits = model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]
    decode_seconds = time.perf_counter() - started
    report = RunReport(len(prompt_ids), len(tokens), prefill_seconds, decode_seconds, peak_rss_bytes(), finish)
    if stream_stats is not None and after_prefill is not None:
        from k3serve.stream.source import stream_report_lines

        # decode phase only: per generated token after the first (which came out of the prefill)
        report.extra_lines = [f"streaming         {model.source.describe()}"] + stream_report_lines(
            stream_stats().minus(after_prefill), max(len(tokens) - 1, 1), decode_seconds, model.source.plan,
            report.peak_rss_bytes)
    return tokens, report
