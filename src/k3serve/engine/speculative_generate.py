"""Single-sequence generation with speculation (`generate` with `speculative`): draft, verify one window per
step, roll the state back to the kept positions (model/rollback.py)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from k3serve.engine.report import RunReport, peak_rss_bytes
from k3serve.engine.sampling import Sampler, SamplingParams, mask_logits, validate_prompt
from k3serve.engine.speculative import DrafterFactory, SequenceSpeculation, SpeculativeConfig
from k3serve.engine.verification import num_to_emit, verify
from k3serve.model.interface import ForwardItem, Model
from k3serve.model.rollback import RollbackCache


def speculative_generate(model: Model, prompt_ids: Sequence[int], params: SamplingParams,
                         spec: SpeculativeConfig, stop_ids: Sequence[int] = (),
                         on_token: Callable[[int], None] | None = None,
                         drafters: DrafterFactory | None = None,
                         constraint: Callable[[list[int]], np.ndarray | None] | None = None
                         ) -> tuple[list[int], RunReport]:
    """`generate` with speculation: same tokens under greedy, same distribution under sampling.
    While `constraint(tokens so far)` returns allowed ids (token healing spelling the prompt's tail out again),
    steps are plain one-token windows sampled under the mask; speculation starts once it returns None."""
    prompt_ids = validate_prompt(prompt_ids, model.config.vocab_size)
    sampler = Sampler(params)
    stops = params.stop_set(stop_ids)
    factory = drafters if drafters is not None else DrafterFactory(model)
    speculation = SequenceSpeculation(spec, factory.create(spec))
    cache = RollbackCache(model.new_cache(), spec.rollback)
    started = time.perf_counter()
    logits = model.forward([ForwardItem(np.asarray(prompt_ids, dtype=np.int64), cache)]).logits[0][-1]
    prefill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    context = list(prompt_ids)
    tokens = [sampler.sample(mask_logits(logits, constraint([]) if constraint is not None else None))]
    context.append(tokens[0])
    if on_token is not None:
        on_token(tokens[0])
    finish = "stop" if tokens[0] in stops else "length"
    while tokens[-1] not in stops and len(tokens) < params.max_tokens:
        allowed = constraint(tokens) if constraint is not None else None
        if allowed is not None:  # healing: one plain step under the mask, no drafts
            cache.begin_window()
            logits = model.forward([ForwardItem(np.asarray(context[-1:], dtype=np.int64), cache)]).logits[0][-1]
            cache.commit(1)
            tokens.append(sampler.sample(mask_logits(logits, allowed)))
            context.append(tokens[-1])
            if on_token is not None:
                on_token(tokens[-1])
            finish = "stop" if tokens[-1] in stops else finish
            continue
        room = params.max_tokens - len(tokens)
        draft = speculation.propose(context, room, sampler)
        cache.begin_window()
        window = np.asarray([context[-1]] + draft.tokens, dtype=np.int64)
        logits_all = model.forward([ForwardItem(window, cache, all_logits=True)]).logits[0]  # [T, V]
        result = verify(logits_all, draft, sampler)
        m = num_to_emit(result.tokens, len(tokens), room, stops)
        speculation.stats.recorded_bytes += cache.recorded_bytes
        rollback_started = time.perf_counter()
        cache.commit(m)  # positions kept: x0 and the first m - 1 emitted tokens
        speculation.stats.rollback_seconds += time.perf_counter() - rollback_started
        speculation.record(len(draft), result.num_accepted, m)
        for token in result.tokens[:m]:
            tokens.append(token)
            context.append(token)
            if on_token is not None:
                on_token(token)
        if tokens[-1] in stops:
            finish = "stop"
    speculation.drafter.release()
    decode_seconds = time.perf_counter() - started
    return tokens, RunReport(len(prompt_ids), len(tokens), prefill_seconds, decode_seconds, peak_rss_bytes(), finish,
                             extra_lines=speculation.stats.lines(), speculation=speculation.stats)
