"""The pre-norm decoder shared by every family, over the same `ForwardItem` / `ForwardResult` as K3.

Per layer, per token (all four families):
    h = h + Mixer(RMSNorm(h, input_layernorm))          Mixer: GQA, MLA, KDA or gated DeltaNet
    h = h + MLP(RMSNorm(h, post_attention_layernorm))   MLP: dense SiLU-GLU or a routed MoE
and logits = lm_head(RMSNorm(h, norm)). Norm weights arrive already in the "x_hat * w" form (Qwen3-Next's
"x_hat * (1 + w)" norms are folded into w when the layer is built), so one RMSNorm serves every family.

A batch is a list of `ForwardItem`s, each a run of new tokens of one sequence with its cache. Every matmul runs
once over all T tokens; attention and the recurrences run per sequence inside the mixers.
Shapes: T tokens of the batch, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from k3serve.errors import ConfigError
from k3serve.model.expert_source import ExpertSource
from k3serve.model.interface import (MIXER, MLP, ForwardItem, ForwardResult, PauseHook, RoutingObserver,
                                     SingleSequenceMixin, finish_batch, flatten_items, logit_rows)
from k3serve.model.fused_ops import add_rms_norm, rms_norm_into
from k3serve.model.kernels import linear, widen_bf16
from k3serve.model import routing as routing_module
from k3serve.model.routing import ExpertTopP, KeptExperts, Routing
from k3serve.model.ops import rms_norm
from k3serve.model.cache import CacheLayout, DenseSequenceCache, SequenceCache
from k3serve.threads import governed
from k3serve.weights.quantized import QuantizedMatrix

if TYPE_CHECKING:
    from k3serve.model.families.rope import Rotary
    from k3serve.model.families.tensors import TensorReader


LAYER_KINDS = {"attention": "a", "mla": "m", "kda": "k", "gated_deltanet": "g"}


@dataclass(frozen=True)
class DecoderConfig:
    """What every family config carries; each family adds its own fields."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_kinds: tuple[str, ...]  # per layer, one of LAYER_KINDS
    mlp_kinds: tuple[str, ...]  # per layer, "dense" or "moe"

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers or len(self.mlp_kinds) != self.num_layers:
            raise ConfigError(f"{self.model_type}: {self.num_layers} layers but {len(self.layer_kinds)} mixer kinds "
                              f"and {len(self.mlp_kinds)} MLP kinds")
        if not set(self.layer_kinds) <= set(LAYER_KINDS) or not set(self.mlp_kinds) <= {"dense", "moe"}:
            raise ConfigError(f"{self.model_type}: unknown layer kinds {set(self.layer_kinds) - set(LAYER_KINDS)} "
                              f"or MLP kinds {set(self.mlp_kinds) - {'dense', 'moe'}}")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ConfigError(f"{self.model_type}: bos_token_id {self.bos_token_id} is outside the vocabulary")

    def summary(self) -> dict:
        """Every setting, with the per-layer lists replaced by the layer map (for `k3serve info`)."""
        values = {k: v for k, v in asdict(self).items() if k not in ("layer_kinds", "mlp_kinds")}
        return {"layer_map": self.layer_map, **values}

    @property
    def layer_map(self) -> str:
        """One letter per layer, upper case for a MoE layer: a/A GQA attention, m/M MLA, k/K KDA, g/G DeltaNet."""
        return "".join(LAYER_KINDS[kind] if mlp == "dense" else LAYER_KINDS[kind].upper()
                       for kind, mlp in zip(self.layer_kinds, self.mlp_kinds))


@dataclass(frozen=True)
class Batch:
    """Where each sequence's tokens sit in the batch, and their absolute positions."""

    segments: list[tuple[int, int]]  # [start, end) rows of each item
    caches: Sequence[SequenceCache]
    positions: np.ndarray  # [T] int64 position of each token in its sequence
    rotations: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False, compare=False)

    def cos_sin(self, rotary: Rotary) -> tuple[np.ndarray, np.ndarray]:
        """`rotary.cos_sin(positions)`, computed once per step for each rotary embedding the layers share."""
        key = id(rotary)
        if key not in self.rotations:
            self.rotations[key] = rotary.cos_sin(self.positions)
        return self.rotations[key]

    def row_groups(self, step: int) -> list[tuple[int, int, Batch]]:
        """The batch as consecutive calls of at most `step` rows: (first row, end row, sub-batch) each.

        A segment longer than `step` is cut into `step`-token pieces that run in order, each from the attention rows,
        recurrent state and conv tail the previous piece wrote: a chunked prefill, with each token's result that of
        the whole segment in one call up to float32 round-off. A shorter segment is never cut, so a speculative
        verify window (at most 33 tokens) records its rollback window in one piece."""
        groups: list[tuple[int, int, Batch]] = []
        pending: list[tuple[int, int, SequenceCache]] = []

        def flush() -> None:
            if pending:
                first, last = pending[0][0], pending[-1][1]
                groups.append((first, last, Batch(segments=[(s - first, e - first) for s, e, _ in pending],
                                                  caches=[cache for _, _, cache in pending],
                                                  positions=self.positions[first:last])))
                pending.clear()

        for (start, end), cache in zip(self.segments, self.caches):
            pieces = [(start, end)] if end - start <= step else [(s, min(s + step, end))
                                                                  for s in range(start, end, step)]
            for s, e in pieces:
                if pending and e - pending[0][0] > step:
                    flush()
                pending.append((s, e, cache))
        flush()
        return groups


class Mixer(Protocol):
    def __call__(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        """x [T, H] (already normed) -> [T, H]; reads and writes each sequence's state for this layer."""


@runtime_checkable
class ExpertReader(Protocol):
    """An MLP that reads routed experts (the families' `MoEBlock`): `FamilyModel.use_experts` points it at the
    model's source."""

    experts: ExpertSource


class Mlp(Protocol):
    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, Routing | None]:
        """x [T, H] -> (out [T, H], routing of a MoE layer or None)."""


@dataclass
class DecoderLayer:
    input_norm: np.ndarray  # [H]
    post_attention_norm: np.ndarray  # [H]
    mixer: Mixer
    mlp: Mlp


class FamilyModel(SingleSequenceMixin):
    """A decoder-only model of one of the supported families (a `Model`, model/interface.py). Stateless apart from
    its weights; its routed experts come through one `ExpertSource` (resident `ExpertStore` or streaming
    `StreamingExperts`) that every MoE block reads."""

    def __init__(self, config: DecoderConfig, embed: np.ndarray, layers: list[DecoderLayer],
                 final_norm: np.ndarray, lm_head: np.ndarray, cache_layout: CacheLayout,
                 experts: ExpertSource | None = None) -> None:
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [V, H]
        self.cache_layout = cache_layout
        self._experts = experts  # routed experts, read and packed on first use
        routers = [getattr(layer.mlp, "router", None) for layer in layers]
        self.expert_top_p = ExpertTopP()
        self.kept_experts = KeptExperts(max((r.top_k for r in routers if r is not None), default=0))

    def limit_experts(self, limit: ExpertTopP) -> None:
        """Keep only each token's heaviest experts up to `limit.top_p` of their weight (model/routing.py), in every
        MoE block."""
        self.expert_top_p = limit
        for layer in self.layers:
            if hasattr(layer.mlp, "top_p"):
                layer.mlp.top_p = limit

    @property
    def experts(self) -> ExpertSource | None:
        return self._experts

    def use_experts(self, experts: ExpertSource) -> None:
        """Read the routed experts from `experts` from now on (a streaming source over a packed store): the model
        and every MoE block switch together."""
        self._experts = experts
        for layer in self.layers:
            if isinstance(layer.mlp, ExpertReader):
                layer.mlp.experts = experts

    def new_cache(self) -> DenseSequenceCache:
        return DenseSequenceCache(self.cache_layout)

    def resident_draft(self, allowed=None) -> None:
        """No resident-expert draft: a family's routers are not restricted (use the n-gram or a draft model)."""
        return None

    def _prefetch_next(self, index: int, h: np.ndarray) -> None:
        """h [T, H]: the residual after layer `index`'s mixer. Layer index+1's router on it (through that layer's
        own MLP norm) guesses its experts, which a streaming store reads while layer `index`'s MLP computes."""
        if index + 1 >= len(self.layers):
            return
        following = self.layers[index + 1]
        router = getattr(following.mlp, "router", None)
        if router is None or self._experts is None:
            return
        guess = router(rms_norm(h, following.post_attention_norm, self.config.rms_norm_eps))  # [T, TOPK]
        self._experts.prefetch(index + 1, guess)

    @property
    def supports_nested_forward(self) -> bool:
        """Whether another forward may run at a pause point of this one: not claimed, since the lazily packed
        expert store has not been checked for it."""
        return False

    @governed
    def forward(self, items: Sequence[ForwardItem], keep_routing: bool = False,
                on_routing: RoutingObserver | None = None,
                at_pause: PauseHook | None = None) -> ForwardResult:
        if not items:
            return ForwardResult(logits=[])
        ids, segments = flatten_items(items, self.config.vocab_size)
        caches = [item.cache for item in items]
        positions = np.concatenate([cache.num_tokens + np.arange(end - begin)
                                    for cache, (begin, end) in zip(caches, segments)])  # [T]
        batch = Batch(segments=segments, caches=caches, positions=positions)
        eps = self.config.rms_norm_eps
        result = ForwardResult(logits=[], segments=segments)

        experts = self._experts
        if experts is not None:
            experts.begin_step(int(ids.shape[0]))
        embed = self.embed  # float32, bf16 bits, or Q8_0 / MXFP4 bytes (a quantized trunk) decoded by rows
        h = embed.rows(ids) if isinstance(embed, QuantizedMatrix) else (
            widen_bf16(embed[ids]) if embed.dtype == np.uint16 else embed[ids])  # [T, H]
        h = np.ascontiguousarray(h, dtype=np.float32)  # a copy of the rows: the residual is added into it in place
        x = np.empty_like(h)  # [T, H] the normed input of each mixer and MLP, rewritten by the fused stages
        eps32 = np.float32(eps)
        layers = self.layers
        if layers:
            rms_norm_into(h, layers[0].input_norm, eps32, x)
        # A long prompt's mixers run PREFILL_CHUNK_TOKENS rows a call (routing.py): their projections, conv outputs,
        # gates and queries (a dozen [T, heads x head dim] float32 arrays in KDA, 546 MB at 2048 tokens in Kimi
        # Linear's widths) were the peak of prefill once the MLPs ran in chunks.
        step = routing_module.PREFILL_CHUNK_TOKENS
        groups = batch.row_groups(step) if ids.shape[0] > step else None
        for index, layer in enumerate(layers):
            mixed = layer.mixer(x, batch) if groups is None else _mix_in_groups(layer.mixer, x, groups)
            add_rms_norm(h, mixed, layer.post_attention_norm, eps32, x)  # h += mixer; x = norm(h)
            if at_pause is not None:
                at_pause(index, MIXER)
            if experts is not None and experts.prefetching:
                self._prefetch_next(index, h)
            m, routing = layer.mlp(x)
            following = layers[index + 1].input_norm if index + 1 < len(layers) else self.final_norm
            add_rms_norm(h, m, following, eps32, x)  # h += mlp; x = the next layer's (or the final) norm of h
            if routing is not None:
                self.kept_experts.add(routing.expert_ids)
                if keep_routing:
                    result.routing[index] = routing
                if on_routing is not None:
                    on_routing(index, routing, segments)
            if at_pause is not None and index < len(layers) - 1:
                at_pause(index, MLP)
        if not layers:
            rms_norm_into(h, self.final_norm, eps32, x)

        logits = linear(x[logit_rows(items, segments)], self.lm_head)  # [R, V]
        return finish_batch(items, segments, logits, result)


def _mix_in_groups(mixer: Mixer, x: np.ndarray, groups: list[tuple[int, int, Batch]]) -> np.ndarray:
    """mixer(x, batch) as one call per row group of `Batch.row_groups`, in order."""
    out = np.empty_like(x)
    for first, last, part in groups:
        out[first:last] = mixer(x[first:last], part)
    return out


def pre_norm_layer(reader: TensorReader, prefix: str, hidden: int, mixer: Mixer, mlp: Mlp) -> DecoderLayer:
    """A layer with the usual `input_layernorm` / `post_attention_layernorm` weights under `prefix`."""
    return DecoderLayer(input_norm=reader.f32(f"{prefix}input_layernorm.weight", shape=(hidden,)),
                        post_attention_norm=reader.f32(f"{prefix}post_attention_layernorm.weight", shape=(hidden,)),
                        mixer=mixer, mlp=mlp)


def assemble_model(reader: TensorReader, config: DecoderConfig, layers: list[DecoderLayer], layout: CacheLayout,
                   store: ExpertSource | None,
                   embed: np.ndarray, lm_head: np.ndarray) -> FamilyModel:
    """The model over its layers, with the final `model.norm` read as stored."""
    final_norm = reader.f32("model.norm.weight", shape=(config.hidden_size,))
    return FamilyModel(config, embed, layers, final_norm, lm_head, layout, store)
