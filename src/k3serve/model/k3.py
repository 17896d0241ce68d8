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
tokens of the batch share every matmul; only the recurrent and attention parts run per sequence. `K3Model` is one
`Model` (model/interface.py); its weights come through `WeightSource` (the trunk, K3-only) and its routed experts
through the same source as an `ExpertSource`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from k3serve.config import K3Config
from k3serve.errors import ConfigError
from k3serve.model.attn_res import attn_res
from k3serve.model.fused_ops import attn_res_norm, rms_norm_into, route_top_k
from k3serve.model.causal_attention import DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK
from k3serve.model.kda import causal_conv, conv_step, kda_forward
from k3serve.model.mla import mla_attend, mla_decode_batch, mla_project
from k3serve.model.kernels import linear, mxfp4_expert_forward, widen_bf16
from k3serve.model.moe import dense_mlp_forward, guess_next_layer, moe_forward, route, top_k_rows
from k3serve.model.routing import ExpertTopP, KeptExperts, Routing, keep_top_p, pairs_by_expert
from k3serve.model.cache import CacheLayout, DenseSequenceCache, SequenceCache
from k3serve.model.interface import (MIXER, MLP, ForwardItem, ForwardResult, PauseHook, RoutingObserver,
                                     SingleSequenceMixin, finish_batch, flatten_items, logit_rows)
from k3serve.model.restricted_routing import ResidentExperts, RestrictedRoutingSource
from k3serve.model.weights import KDAWeights, MLAWeights, MoEWeights, WeightSource
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.threads import governed


def k3_cache_layout(config: K3Config) -> CacheLayout:
    """K3's per-sequence state: MLA layers cache [latent KL | k_rope DR] rows; KDA layers keep S [NH, D, D] and the
    conv tail of q, k, v [K-1, 3P]."""
    state = (config.kda_num_heads, config.kda_head_dim, config.kda_head_dim)
    tail = (config.short_conv_kernel_size - 1, 3 * config.kda_proj_size)
    return CacheLayout(row_widths={l: config.mla_cache_width for l in config.mla_layer_ids},
                       recurrent_shapes={l: (state, tail) for l in config.kda_layer_ids})


@functools.cache
def load_compiled_loops() -> None:
    """Load the layers' small compiled loops (router, residual mix, short conv, the serial expert stages) from
    numba's cache, or compile them, once per process: at model load, not inside the first request's prefill."""
    ids = np.empty((1, 1), np.int64)
    top_k_rows(np.zeros((1, 2), np.float32), ids)
    pairs_by_expert(ids)
    attn_res([np.ones((1, 32), np.float32)] * 2, np.ones(32, np.float32), 1e-5)
    row, vector = np.ones((1, 32), np.float32), np.ones(32, np.float32)
    attn_res_norm(np.ones((2, 1, 32), np.float32), vector, vector, np.float32(1e-5), row.copy(), row.copy())
    rms_norm_into(row, vector, np.float32(1e-5), row.copy())
    route_top_k(row, vector, True, np.float32(1.0), ids, row[:, :1].copy())
    causal_conv(np.ones((1, 2), np.float32), np.zeros((3, 2), np.float32), np.ones((2, 4), np.float32))
    tail, channels = np.zeros((3, 2), np.float32), np.ones(2, np.float32)
    conv_step(tail, channels, np.ones((2, 4), np.float32), channels.copy(), tail.copy())
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
        self.expert_top_p = ExpertTopP()  # keep every routed expert (`limit_experts` sets --expert-top-p)
        self.kept_experts = KeptExperts(self.config.num_experts_per_token)  # per (token, MoE layer) of every forward
        load_compiled_loops()

    def limit_experts(self, limit: ExpertTopP) -> None:
        """Keep only each token's heaviest experts up to `limit.top_p` of their weight (model/routing.py)."""
        self.expert_top_p = limit

    @property
    def cache_layout(self) -> CacheLayout:
        return k3_cache_layout(self.config)

    def new_cache(self) -> DenseSequenceCache:
        return DenseSequenceCache(self.cache_layout)

    @property
    def experts(self) -> WeightSource:
        """The routed experts' source: the weight source itself (the trunk is read through it too)."""
        return self.source

    @property
    def supports_nested_forward(self) -> bool:
        """Whether `at_pause` may run another forward (over other caches) before this one resumes."""
        return self.source.supports_nested_forward()

    def resident_draft(self, allowed: ResidentExperts | None = None) -> K3Model:
        """This model with routing restricted to the experts its source holds in RAM (or to `allowed`)."""
        draft = K3Model(RestrictedRoutingSource(self.source, allowed), chunk_size=self.chunk_size,
                        attention_blocks=self.attention_blocks)
        draft.limit_experts(self.expert_top_p)
        return draft

    @governed
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
        embed = self._globals.embed
        h = embed.rows(ids) if isinstance(embed, QuantizedMatrix) else embed[ids]  # [T, H]
        if h.dtype == np.uint16:  # the embedding kept as bf16 bits (a bf16 trunk)
            h = widen_bf16(h)
        # The residual stack lives in one buffer for the step: rows 0..num_blocks-1 are the block snapshots, row
        # num_blocks the partial sum `pref` (absent right after a push, until the mixer writes it). The fused
        # stages (model/fused_ops.py) write h and the normed x into two more buffers: no layer allocates them.
        T, H = h.shape
        sources = np.empty((-(-c.num_layers // c.attn_res_block_size) + 1, T, H), np.float32)  # [S, T, H]
        sources[0] = h
        h = np.empty((T, H), np.float32)
        x = np.empty((T, H), np.float32)
        eps32 = np.float32(eps)
        num_blocks, pref_written = 0, True
        for layer in range(c.num_layers):
            w = self.source.layer(layer)
            if num_blocks:
                attn_res_norm(sources[:num_blocks + 1], w.attn_res_query, w.input_norm, eps32, h, x)
            else:  # layer 0: h is the embedding
                rms_norm_into(sources[0], w.input_norm, eps32, x)
            if layer % c.attn_res_block_size == 0:
                num_blocks, pref_written = num_blocks + 1, False
            if isinstance(w.attention, KDAWeights):
                a = kda_forward(c, w.attention, x, segments, caches, layer, self.chunk_size)
            else:
                a = self._mla(w.attention, x, segments, caches, layer)
            pref = sources[num_blocks]
            if pref_written:
                np.add(pref, a, out=pref)
            else:
                np.copyto(pref, a)
                pref_written = True
            if at_pause is not None:
                at_pause(layer, MIXER)
            attn_res_norm(sources[:num_blocks + 1], w.mlp_res_query, w.post_attention_norm, eps32, h, x)
            if source.prefetching:
                self._prefetch_next(layer, h)
            if isinstance(w.mlp, MoEWeights):
                routing = keep_top_p(route(c, w.mlp, x), self.expert_top_p, c.moe_renormalize)
                self.kept_experts.add(routing.expert_ids)
                source.note_routing(layer, routing.expert_ids)  # before its experts are asked for (tenant shares)
                m, routing = moe_forward(c, w.mlp, x, lambda ids, l=layer: source.experts(l, ids), routing=routing,
                                         stacked=source.stacked_experts(layer),
                                         remote=lambda pairs, z, l=layer: source.expert_outputs(l, pairs, z))
                if keep_routing:
                    result.routing[layer] = routing
                if on_routing is not None:
                    on_routing(layer, routing, segments)
            else:
                m = dense_mlp_forward(c, w.mlp, x)
            np.add(pref, m, out=pref)
            if at_pause is not None and layer < c.num_layers - 1:
                at_pause(layer, MLP)

        rows = logit_rows(items, segments)
        picked = sources[:num_blocks + 1, rows]  # [S, R, H]
        out, normed = np.empty(picked.shape[1:], np.float32), np.empty(picked.shape[1:], np.float32)  # [R, H]
        attn_res_norm(picked, self._globals.output_res_query, self._globals.final_norm, eps32, out, normed)
        head = self._globals.lm_head
        held_whole = isinstance(head, (np.ndarray, QuantizedMatrix))
        logits = linear(normed, head) if held_whole else head.logits(normed)  # [R, V]
        return finish_batch(items, segments, logits, result)

    def _prefetch_next(self, layer: int, h: np.ndarray) -> None:
        """h [T, H]: what `layer` feeds its post-attention norm. Layer layer+1's own norm, router and selection bias
        on it guess its experts (`guess_next_layer`), which the source reads while this layer's MoE computes."""
        nxt = layer + 1
        if nxt >= self.config.num_layers or self.config.is_dense(nxt):
            return
        following = self.source.peek_layer(nxt)
        per_token, scores = guess_next_layer(self.config, following, h)  # [T, TOPK], [T, NE]
        if self.expert_top_p.active:  # guess only what top-p would keep, by the guessed experts' unbiased weights
            unbiased = np.take_along_axis(scores - following.mlp.router_bias, per_token, axis=1)  # [T, TOPK]
            per_token = keep_top_p(Routing(per_token, unbiased.astype(np.float32)), self.expert_top_p,
                                   False).expert_ids
        ranked = np.take_along_axis(scores, np.maximum(per_token, 0), axis=1)  # -1 slots are skipped by priority
        self.source.prefetch(nxt, Routing(per_token, ranked))

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
