"""The K3 model: one forward step over a batch of positions drawn from several sequences.

Layer l (zero-based, block size B), per token, following K3_SPEC section 5:
    pref = incoming h
    if stack: h = AttnRes(stack + [pref], attention query)
    if l % B == 0: push pref; pref = empty                 (layer 0 pushes the embedding)
    a = Attention(RMSNorm(h)); pref = a if empty else pref + a
    h = AttnRes(stack + [pref], mlp query)
    pref = pref + MLP or MoE(RMSNorm(h)); the layer outputs pref
and at the end logits = lm_head(RMSNorm(AttnRes(stack + [h], output query))).

A batch is a list of `ForwardItem`s, each a run of new tokens of one sequence with that sequence's cache. All
tokens of the batch share every matmul; only the recurrent and attention parts run per sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from k3serve.config import DEFAULT_MAX_MODEL_LEN, K3Config
from k3serve.errors import ConfigError, ContextLengthError, RequestError
from k3serve.model.attn_res import attn_res
from k3serve.model.causal_attention import DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK
from k3serve.model.kda import causal_conv, kda_forward
from k3serve.model.mla import mla_attend, mla_decode_batch, mla_project
from k3serve.model.kernels import linear, mxfp4_expert_forward, widen_bf16
from k3serve.model.moe import Routing, dense_mlp_forward, moe_forward, pairs_by_expert, top_k_rows
from k3serve.model.ops import rms_norm
from k3serve.model.cache import CacheLayout, DenseSequenceCache, SequenceCache
from k3serve.model.weights import KDAWeights, MLAWeights, MoEWeights, WeightSource


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


def k3_cache_layout(config: K3Config) -> CacheLayout:
    """K3's per-sequence state: MLA layers cache [latent KL | k_rope DR] rows; KDA layers keep S [NH, D, D] and the
    conv tail of q, k, v [K-1, 3P]."""
    state = (config.kda_num_heads, config.kda_head_dim, config.kda_head_dim)
    tail = (config.short_conv_kernel_size - 1, 3 * config.kda_proj_size)
    return CacheLayout(row_widths={l: config.mla_cache_width for l in config.mla_layer_ids},
                       recurrent_shapes={l: (state, tail) for l in config.kda_layer_ids})


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


@functools.cache
def load_compiled_loops() -> None:
    """Load the layers' small compiled loops (router, residual mix, short conv, the serial expert stages) from
    numba's cache, or compile them, once per process: at model load, not inside the first request's prefill."""
    ids = np.empty((1, 1), np.int64)
    top_k_rows(np.zeros((1, 2), np.float32), ids)
    pairs_by_expert(ids)
    attn_res([np.ones((1, 32), np.float32)] * 2, np.ones(32, np.float32), 1e-5)
    causal_conv(np.ones((1, 2), np.float32), np.zeros((3, 2), np.float32), np.ones((2, 4), np.float32))
    square = (np.zeros((32, 16), np.uint8), np.full((32, 1), 127, np.uint8))  # a [32, 32] MXFP4 matrix
    mxfp4_expert_forward(square, square, square, np.ones((1, 32), np.float32), 4.0, 25.0)


class K3Model(SingleSequenceMixin):
    """The K3 forward pass over a `WeightSource`. Stateless apart from its weights: all sequence state lives in
    the caches passed to `forward`."""

    def __init__(self, source: WeightSource, chunk_size: int | None = None,
                 attention_blocks: tuple[int, int] = (DEFAULT_QUERY_BLOCK, DEFAULT_KEY_BLOCK)) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be None (the compiled delta rule) or >= 1, got {chunk_size}")
        if min(attention_blocks) < 1:
            raise ConfigError(f"attention blocks (query, key) must be >= 1, got {attention_blocks}")
        self.source = source
        self.config: K3Config = source.config
        self.chunk_size = chunk_size
        self.attention_blocks = attention_blocks  # MLA prefill tiles: memory O(T x key block)
        self._globals = source.global_weights()
        load_compiled_loops()

    @property
    def cache_layout(self) -> CacheLayout:
        return k3_cache_layout(self.config)

    def new_cache(self) -> DenseSequenceCache:
        return DenseSequenceCache(self.cache_layout)

    @property
    def supports_nested_forward(self) -> bool:
        """Whether `at_pause` may run another forward (over other caches) before this one resumes."""
        return self.source.supports_nested_forward()

    def forward(self, items: Sequence[ForwardItem], keep_routing: bool = False,
                on_routing: RoutingObserver | None = None,
                at_pause: PauseHook | None = None) -> ForwardResult:
        """One step over `items`. `at_pause(layer, part)` runs at each of `pause_points` (the engine pauses a step
        there to serve an urgent arrival, engine/engine.py). What the forward holds there (h, the residual stack,
        its caches advanced through that part) is local to it, so a nested forward over other caches leaves it
        as it was."""
        c = self.config
        if not items:
            return ForwardResult(logits=[])
        ids, segments = flatten_items(items, c.vocab_size)
        caches = [item.cache for item in items]
        eps = c.rms_norm_eps
        result = ForwardResult(logits=[], segments=segments)

        source = self.source
        source.begin_step(int(ids.shape[0]))  # capabilities a streaming source uses (model/weights.py)
        h = self._globals.embed[ids]  # [T, H]
        if h.dtype == np.uint16:  # the embedding kept as bf16 bits (a bf16 trunk)
            h = widen_bf16(h)
        stack: list[np.ndarray] = []
        pref: np.ndarray | None = h
        for layer in range(c.num_layers):
            w = self.source.layer(layer)
            if stack:
                h = attn_res(stack + [pref], w.attn_res_query, eps)
            if layer % c.attn_res_block_size == 0:
                stack.append(pref)
                pref = None
            x = rms_norm(h, w.input_norm, eps)
            if isinstance(w.attention, KDAWeights):
                a = kda_forward(c, w.attention, x, segments, caches, layer, self.chunk_size)
            else:
                a = self._mla(w.attention, x, segments, caches, layer)
            pref = a if pref is None else pref + a
            if at_pause is not None:
                at_pause(layer, MIXER)
            h = attn_res(stack + [pref], w.mlp_res_query, eps)
            x = rms_norm(h, w.post_attention_norm, eps)
            source.prefetch_hint(layer, h)
            if isinstance(w.mlp, MoEWeights):
                m, routing = moe_forward(c, w.mlp, x, lambda ids, l=layer: self.source.experts(l, ids),
                                         stacked=source.stacked_experts(layer),
                                         remote=lambda *args, l=layer: source.expert_outputs(l, *args))
                if keep_routing:
                    result.routing[layer] = routing
                if on_routing is not None:
                    on_routing(layer, routing, segments)
                source.note_routing(layer, routing.expert_ids)
            else:
                m = dense_mlp_forward(c, w.mlp, x)
            pref = pref + m
            if at_pause is not None and layer < c.num_layers - 1:
                at_pause(layer, MLP)

        rows = logit_rows(items, segments)
        out = attn_res([s[rows] for s in stack] + [pref[rows]], self._globals.output_res_query, eps)
        logits = linear(rms_norm(out, self._globals.final_norm, eps), self._globals.lm_head)  # [R, V]
        return finish_batch(items, segments, logits, result)

    def _mla(self, w: MLAWeights, x: np.ndarray, segments: list[tuple[int, int]],
             caches: Sequence[SequenceCache], layer: int) -> np.ndarray:
        q, rows, gate = mla_project(self.config, w, x)
        if len(segments) > 1 and len(segments) == x.shape[0]:  # a decode step of several sequences: batched
            for i, cache in enumerate(caches):
                cache.append_rows(layer, rows[i:i + 1])
            return mla_decode_batch(self.config, w, q, [cache.attention_rows(layer) for cache in caches], gate)
        out = np.empty((x.shape[0], self.config.hidden_size), np.float32)
        for (start, end), cache in zip(segments, caches):
            cache.append_rows(layer, rows[start:end])
            out[start:end] = mla_attend(self.config, w, q[start:end], cache.attention_rows(layer),
                                        None if gate is None else gate[start:end], *self.attention_blocks)
        return out
