"""Single-sequence generation with a run report, through the engine: one request in an `LLMEngine` sized for it
(engine/engine.py is the one decode loop: plain decoding, speculation, constraints and stop rules are the same code
as when serving).

The engine is sized so that nothing differs from running the sequence alone: one seat, the prompt prefilled in one
forward (the step budget holds the prompt, or a verify window), an attention pool that holds prompt + max_tokens,
no prefix cache. The report's prefill is the step that produced the first token; its decode, every step after.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import numpy as np

from k3serve.config import DEFAULT_MAX_MODEL_LEN
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.report import RunReport, peak_rss_bytes
from k3serve.engine.request import FinishReason, RequestOutput
from k3serve.engine.sampling import SamplingParams, mask_logits, validate_prompt
from k3serve.engine.speculative import DrafterFactory, SpeculativeConfig
from k3serve.errors import ContextLengthError
from k3serve.model.interface import Model

__all__ = ["RunReport", "generate", "peak_rss_bytes"]

BLOCK_SIZE = 16


class _AllowedIds:
    """A constraint given as `allowed(tokens so far) -> ids or None` (token healing, engine/healing.py), as the
    engine's output constraint: it masks every draw while it returns ids; an end-of-sequence id never ends it."""

    ends_on_eos = False

    def __init__(self, allowed: Callable[[list[int]], np.ndarray | None], generated: list[int] | None = None) -> None:
        self._allowed = allowed
        self._generated = [] if generated is None else generated

    def constraint(self) -> _AllowedIds:
        return _AllowedIds(self._allowed)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return mask_logits(logits, self._allowed(self._generated))

    def accept(self, token: int) -> None:
        self._generated.append(int(token))

    def fork(self) -> _AllowedIds:
        return _AllowedIds(self._allowed, list(self._generated))


def single_sequence_config(prompt_len: int, max_tokens: int, max_context: int,
                           speculative: SpeculativeConfig | None) -> EngineConfig:
    """An engine for one sequence: the prompt in one forward, room for prompt + max_tokens, no prefix cache."""
    window = 1 + (speculative.max_draft_tokens if speculative is not None else 0)
    num_blocks = math.ceil((prompt_len + max_tokens + window) / BLOCK_SIZE) + 2
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=max(prompt_len, window),
                        max_seqs=1, max_model_len=max_context, enable_prefix_caching=False, admission_watermark=0.0)


def generate(model: Model, prompt_ids: Sequence[int], params: SamplingParams,
             stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
             speculative: SpeculativeConfig | None = None, drafters: DrafterFactory | None = None,
             constraint: Callable[[list[int]], np.ndarray | None] | None = None,
             max_context: int = DEFAULT_MAX_MODEL_LEN,
             prepare: Callable[[LLMEngine], object] | None = None) -> tuple[list[int], RunReport]:
    """Generate up to params.max_tokens tokens after `prompt_ids`; `on_token` sees each one as it is made.
    With `speculative`, drafts are verified in windows (engine/speculative.py): same greedy tokens.
    `constraint(tokens so far)` may return the ids allowed next (token healing, engine/healing.py); None: any.
    Raises `ContextLengthError` when the prompt plus max_tokens exceeds `max_context`, as the server does.
    `prepare(engine)` runs before the first step (the CLI attaches the RAM controller there)."""
    prompt_ids = validate_prompt(prompt_ids, model.config.vocab_size)
    ContextLengthError.check(len(prompt_ids), params.max_tokens, max_context)
    engine = LLMEngine(model, single_sequence_config(len(prompt_ids), params.max_tokens, max_context, speculative),
                       stop_ids=tuple(stop_ids), speculative=speculative, drafters=drafters)
    if prepare is not None:
        prepare(engine)
    source = model.experts  # a streaming source (K3's, or a family's experts) reports its I/O
    first_token_time: float | None = None
    after_prefill = None

    def on_output(out: RequestOutput) -> None:
        nonlocal first_token_time, after_prefill
        new = out.outputs[0].new_token_ids
        if new and first_token_time is None:
            first_token_time = time.perf_counter()
            after_prefill = source.stats().stream if source is not None else None
        if on_token is not None:
            for token in new:
                on_token(token)

    request = engine.make_request(prompt_ids, params, on_output=on_output, speculative=speculative is not None,
                                  grammar=_AllowedIds(constraint) if constraint is not None else None)
    seq = request.sequences[0]
    started = time.perf_counter()
    engine.enqueue(request)
    final: RequestOutput | None = None
    while final is None:
        final = next((out for out in engine.step() if out.finished), None)
    ended = time.perf_counter()
    if final.error is not None:
        raise RuntimeError(f"generation failed: {final.error}")
    tokens = list(final.outputs[0].token_ids)
    first = first_token_time if first_token_time is not None else ended
    finish = "stop" if final.outputs[0].finish_reason is FinishReason.STOP else "length"
    report = RunReport(len(prompt_ids), len(tokens), first - started, ended - first, peak_rss_bytes(), finish)
    if source is not None and after_prefill is not None:
        from k3serve.stream.stats import stream_report_lines

        # decode phase only: per generated token after the first (which came out of the prefill)
        report.extra_lines = [f"streaming         {source.describe()}"] + stream_report_lines(
            source.stats().stream.minus(after_prefill), max(len(tokens) - 1, 1), ended - first, source.plan,
            report.peak_rss_bytes)
    limit = getattr(model, "expert_top_p", None)
    if limit is not None and limit.active:
        report.extra_lines.append(model.kept_experts.line() + f" (--expert-top-p {limit.top_p:g}, "
                                  f"min {limit.min_kept}; prompt and generated tokens)")
    if engine.ram_steering is not None:
        report.extra_lines = report.extra_lines + engine.ram_steering.controller.lines()
    if seq.speculation is not None:
        report.speculation = seq.speculation.stats
        report.extra_lines = report.extra_lines + seq.speculation.stats.lines()
    return tokens, report
