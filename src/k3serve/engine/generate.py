"""Single-sequence generation: prefill the prompt, then one decode step per token, with a run report."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from k3serve.config import DEFAULT_MAX_MODEL_LEN
from k3serve.engine.report import RunReport, peak_rss_bytes
from k3serve.engine.sampling import Sampler, SamplingParams, mask_logits, validate_prompt
from k3serve.engine.speculative import DrafterFactory, SpeculativeConfig
from k3serve.engine.speculative_generate import speculative_generate
from k3serve.errors import ContextLengthError
from k3serve.model.interface import ForwardItem, Model

__all__ = ["RunReport", "generate", "peak_rss_bytes"]


def generate(model: Model, prompt_ids: Sequence[int], params: SamplingParams,
             stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
             speculative: SpeculativeConfig | None = None, drafters: DrafterFactory | None = None,
             constraint: Callable[[list[int]], np.ndarray | None] | None = None,
             max_context: int = DEFAULT_MAX_MODEL_LEN) -> tuple[list[int], RunReport]:
    """Generate up to params.max_tokens tokens after `prompt_ids`; `on_token` sees each one as it is made.
    With `speculative`, drafts are verified in windows (engine/speculative.py): same greedy tokens.
    `constraint(tokens so far)` may return the ids allowed next (token healing, engine/healing.py); None: any.
    Raises `ContextLengthError` when the prompt plus max_tokens exceeds `max_context`, as the server does."""
    prompt_ids = validate_prompt(prompt_ids, model.config.vocab_size)
    ContextLengthError.check(len(prompt_ids), params.max_tokens, max_context)
    if speculative is not None:
        return speculative_generate(model, prompt_ids, params, speculative, stop_ids, on_token, drafters,
                                    constraint)
    sampler = Sampler(params)
    stops = params.stop_set(stop_ids)
    cache = model.new_cache()
    started = time.perf_counter()
    logits = model.forward([ForwardItem(np.asarray(prompt_ids, dtype=np.int64), cache)]).logits[0][-1]
    prefill_seconds = time.perf_counter() - started
    source = model.experts  # a streaming source (K3's, or a family's experts) reports its I/O
    after_prefill = source.stats().stream if source is not None else None
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
    if source is not None and after_prefill is not None:
        from k3serve.stream.stats import stream_report_lines

        # decode phase only: per generated token after the first (which came out of the prefill)
        report.extra_lines = [f"streaming         {source.describe()}"] + stream_report_lines(
            source.stats().stream.minus(after_prefill), max(len(tokens) - 1, 1), decode_seconds, source.plan,
            report.peak_rss_bytes)
    return tokens, report
