"""The one interface every architecture's model offers (K3 and each family), and the types of a forward step.

A model is a function of token ids and per-sequence state. The engine, generation, speculation, the drafters, the
lab and the cluster know a model only through `Model`:
    config            vocabulary, end-of-sequence ids, layer count, hidden width (`ModelConfig`)
    cache_layout      the per-sequence state it needs (model/cache.py); the engine sizes every pool from it
    new_cache()       a dense `SequenceCache` for single-sequence use
    forward(items)    one step over a batch of `ForwardItem`s from several sequences (`ForwardResult`), with the
                      routing observer and the pause points (`pause_points`) step interruption uses
    experts           its `ExpertSource` (model/expert_source.py), or None for a model without routed experts
    supports_nested_forward, resident_draft(allowed): questions the engine asks instead of asking which
                      architecture it is (what an architecture offers beyond this: loading/registry.py)
`SingleSequenceMixin` gives every model `logits(ids)` and `greedy(prompt, n)` over `new_cache` and `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from k3serve.config import DEFAULT_MAX_MODEL_LEN
from k3serve.errors import ContextLengthError, RequestError
from k3serve.model.cache import CacheLayout, SequenceCache
from k3serve.model.expert_source import ExpertSource
from k3serve.model.routing import ExpertTopP, Routing


@dataclass
class ForwardItem:
    token_ids: np.ndarray  # [t] new tokens of one sequence, t >= 1
    cache: SequenceCache
    all_logits: bool = False  # logits for every new position, else only for the last


@dataclass
class ForwardResult:
    logits: list[np.ndarray]  # per item: [t, V] if all_logits else [1, V]
    routing: dict[int, Routing] = field(default_factory=dict)  # MoE layer -> routing of all T tokens
    segments: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each item's rows


RoutingObserver = Callable[[int, Routing, list[tuple[int, int]]], None]
MIXER, MLP = "mixer", "mlp"  # the two parts of a layer: attention (KDA or MLA), then the MLP or MoE
PauseHook = Callable[[int, str], None]  # (layer, part just finished) at every pause point of a forward


def pause_points(num_layers: int) -> list[tuple[int, str]]:
    """Where a forward calls its `at_pause` hook, in order: after every layer's mixer and after every layer's MLP
    but the last (the logits follow at once there)."""
    return [(layer, part) for layer in range(num_layers) for part in (MIXER, MLP)][:-1]


def flatten_items(items: Sequence[ForwardItem], vocab_size: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """All new token ids of a batch [T] and each item's [start, end) rows; validates lengths and ids."""
    segments: list[tuple[int, int]] = []
    start = 0
    for item in items:
        if len(item.token_ids) == 0:
            raise RequestError("a forward item needs at least one token")
        segments.append((start, start + len(item.token_ids)))
        start += len(item.token_ids)
    ids = np.concatenate([np.asarray(item.token_ids, dtype=np.int64) for item in items])  # [T]
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise RequestError(f"token id out of range 0..{vocab_size - 1}")
    return ids, segments


def logit_rows(items: Sequence[ForwardItem], segments: list[tuple[int, int]]) -> np.ndarray:
    """The rows whose logits the batch asked for: every new position of an all_logits item, else its last."""
    rows: list[int] = []
    for item, (begin, end) in zip(items, segments):
        rows.extend(range(begin, end) if item.all_logits else [end - 1])
    return np.asarray(rows)


def finish_batch(items: Sequence[ForwardItem], segments: list[tuple[int, int]], logits: np.ndarray,
                 result: ForwardResult) -> ForwardResult:
    """Split logits [R, V] (rows as `logit_rows`) into one array per item and advance every cache."""
    offset = 0
    for item, (begin, end) in zip(items, segments):
        n = end - begin if item.all_logits else 1
        result.logits.append(logits[offset:offset + n])
        offset += n
        item.cache.advance(len(item.token_ids))
    return result




class SingleSequenceMixin:
    """`logits` and `greedy` over one sequence, for any model with `new_cache()` and `forward(items)`."""

    def logits(self, token_ids: Sequence[int], mode: str = "full",
               max_context: int = DEFAULT_MAX_MODEL_LEN) -> np.ndarray:
        """Float32 logits [T, V] for every position: one forward over all ids ('full'), or a prefill of the first
        id followed by one decode step per remaining id ('incremental'). Raises `ContextLengthError` for more than
        `max_context` ids."""
        ids = np.asarray(token_ids, dtype=np.int64)
        ContextLengthError.check(len(ids), 0, max_context)
        cache = self.new_cache()
        if mode == "full":
            return self.forward([ForwardItem(ids, cache, all_logits=True)]).logits[0]
        if mode == "incremental":
            return np.concatenate([self.forward([ForwardItem(ids[i:i + 1], cache)]).logits[0]
                                   for i in range(len(ids))])
        raise RequestError(f"unknown logits mode {mode!r}; use 'full' or 'incremental'")

    def greedy(self, prompt: Sequence[int], num_tokens: int, max_context: int = DEFAULT_MAX_MODEL_LEN) -> list[int]:
        """Greedy continuation of `prompt` by prefill then one decode step per token."""
        ContextLengthError.check(len(prompt), num_tokens, max_context)
        cache = self.new_cache()
        logits = self.forward([ForwardItem(np.asarray(prompt, dtype=np.int64), cache)]).logits[0][-1]
        out: list[int] = []
        for step in range(num_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if step + 1 < num_tokens:
                logits = self.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]
        return out


class ModelConfig(Protocol):
    """What every architecture's config carries (K3Config, the families' DecoderConfig)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class Model(Protocol):
    """A model the engine can serve (see the module docstring)."""

    config: ModelConfig

    @property
    def cache_layout(self) -> CacheLayout: ...

    @property
    def experts(self) -> ExpertSource | None: ...

    @property
    def supports_nested_forward(self) -> bool:
        """Whether `at_pause` may run another forward (over other caches) before this one resumes."""

    def new_cache(self) -> SequenceCache: ...

    def forward(self, items: Sequence[ForwardItem], keep_routing: bool = False,
                on_routing: RoutingObserver | None = None,
                at_pause: PauseHook | None = None) -> ForwardResult: ...

    def limit_experts(self, limit: ExpertTopP) -> None:
        """Keep only each token's heaviest routed experts up to `limit.top_p` of their weight (--expert-top-p,
        model/routing.py); `kept_experts` counts what each (token, MoE layer) kept."""

    def resident_draft(self, allowed: Callable[[int], set[int] | None] | None = None) -> Model | None:
        """The same model routed only among the experts its source holds in RAM (a speculative drafter that reads
        nothing), or None when the architecture offers no such draft."""

    def logits(self, token_ids: Sequence[int], mode: str = "full",
               max_context: int = DEFAULT_MAX_MODEL_LEN) -> np.ndarray: ...

    def greedy(self, prompt: Sequence[int], num_tokens: int,
               max_context: int = DEFAULT_MAX_MODEL_LEN) -> list[int]: ...
