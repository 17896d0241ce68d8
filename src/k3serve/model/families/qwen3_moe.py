"""Qwen3-MoE (`model_type: qwen3_moe`): GQA attention with q/k norms and RoPE, softmax top-k routed experts.

Layer l is a MoE layer when l is not in `mlp_only_layers` and (l + 1) % decoder_sparse_step == 0, else a dense
SiLU-GLU MLP. No shared expert. Tensor names (prefix `model.layers.{l}.`):
    self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight [hd], input_layernorm, post_attention_layernorm;
    mlp.gate.weight [NE, H], mlp.experts.{e}.{gate,up,down}_proj.weight; dense: mlp.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from k3serve.model.families.attention import GQAAttention, GQAWeights
from k3serve.model.families.build import check_supported_basics, common_keys, embeddings, expert_reader, glu
from k3serve.model.cache import CacheLayout
from k3serve.model.families.decoder import DecoderConfig, FamilyModel, assemble_model, pre_norm_layer
from k3serve.model.families.experts import ExpertStore
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.moe import DenseMLP, MoEBlock, SoftmaxRouter
from k3serve.model.families.rope import Rotary, rope_parameters, rotary_from_config
from k3serve.model.families.tensors import TensorReader
from k3serve.model.weights import fuse_rows


@dataclass(frozen=True)
class GQAConfig:
    """The attention and softmax-routing settings that Qwen3-MoE and Qwen3-Next share."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: dict[str, Any]
    max_position_embeddings: int | None
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", 1.0)))


def read_gqa_config(config: HFConfig) -> dict:
    heads = config.integer("num_attention_heads")
    kv_heads = config.integer("num_key_value_heads")
    if heads % kv_heads:
        raise config.error(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    rope = rope_parameters(config)
    if "partial_rotary_factor" in config.raw:  # released Qwen3-Next configs keep it at the root
        rope.setdefault("partial_rotary_factor", config.number("partial_rotary_factor"))
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # transformers falls back to hidden_size // num_attention_heads when a config has no head_dim
        head_dim=config.optional("head_dim", None) or config.integer("hidden_size") // heads,
        rope=rope,
        max_position_embeddings=config.optional("max_position_embeddings", None),
        num_experts=config.integer("num_experts", "num_local_experts"),
        num_experts_per_token=config.integer("num_experts_per_tok", "num_experts_per_token"),
        moe_intermediate_size=config.integer("moe_intermediate_size"),
        intermediate_size=config.integer("intermediate_size"),
        norm_topk_prob=config.boolean("norm_topk_prob"),
    )


def sparse_layers(config: HFConfig, num_layers: int) -> tuple[str, ...]:
    # both keys have these transformers defaults when a config omits them
    mlp_only = set(config.optional("mlp_only_layers", []) or [])
    step = config.optional("decoder_sparse_step", 1)
    return tuple("moe" if l not in mlp_only and (l + 1) % step == 0 else "dense" for l in range(num_layers))


@dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig, GQAConfig):
    @classmethod
    def from_hf(cls, config: HFConfig) -> Qwen3MoeConfig:
        check_supported_basics(config)
        config.require_value("use_sliding_window", (False,), value_when_absent=False)
        common = common_keys(config)
        return cls(model_type=config.get("model_type"), **common, **read_gqa_config(config),
                   layer_kinds=("attention",) * common["num_layers"],
                   mlp_kinds=sparse_layers(config, common["num_layers"]))


def build_gqa(reader: TensorReader, config: DecoderConfig, gqa: GQAConfig, layer: int, rotary: Rotary,
              gated: bool, norm_offset: float) -> GQAAttention:
    """GQA attention of `layer`; `norm_offset` 1.0 folds Qwen3-Next's x_hat * (1 + w) norms into w."""
    NQ, NKV, hd, H = gqa.num_attention_heads, gqa.num_key_value_heads, gqa.head_dim, config.hidden_size
    a = f"model.layers.{layer}.self_attn."
    q_rows = NQ * hd * (2 if gated else 1)
    qkv = fuse_rows([reader.matrix(f"{a}q_proj.weight", shape=(q_rows, H)),
                     reader.matrix(f"{a}k_proj.weight", shape=(NKV * hd, H)),
                     reader.matrix(f"{a}v_proj.weight", shape=(NKV * hd, H))])
    weights = GQAWeights(
        qkv=qkv,
        q_norm=reader.f32(f"{a}q_norm.weight", shape=(hd,)) + np.float32(norm_offset),
        k_norm=reader.f32(f"{a}k_norm.weight", shape=(hd,)) + np.float32(norm_offset),
        o_proj=reader.matrix(f"{a}o_proj.weight", shape=(H, NQ * hd)),
    )
    return GQAAttention(layer=layer, weights=weights, num_heads=NQ, num_kv_heads=NKV, head_dim=hd, rotary=rotary,
                        eps=config.rms_norm_eps, gated=gated)


def softmax_router(reader: TensorReader, config: DecoderConfig, gqa: GQAConfig, layer: int) -> SoftmaxRouter:
    router = reader.f32(f"model.layers.{layer}.mlp.gate.weight", shape=(gqa.num_experts, config.hidden_size))
    return SoftmaxRouter(weight=router, top_k=gqa.num_experts_per_token, normalize=gqa.norm_topk_prob)


def build(config: Qwen3MoeConfig, reader: TensorReader, precision: str, chunk_size: int | None) -> FamilyModel:
    H = config.hidden_size
    rotary = rotary_from_config(config.rope, config.rotary_dim, config.max_position_embeddings,
                                interleaved=False, where=f"{reader.path} (qwen3_moe)")
    store = ExpertStore(expert_reader(reader, lambda l: f"model.layers.{l}.mlp.",
                                      ("gate_proj", "up_proj", "down_proj"), H, config.moe_intermediate_size),
                        precision, config.num_experts)
    layers, row_widths, recurrent_shapes = [], {}, {}
    for l in range(config.num_layers):
        p = f"model.layers.{l}."
        mixer = build_gqa(reader, config, config, l, rotary, gated=False, norm_offset=0.0)
        row_widths[l] = mixer.row_width
        if config.mlp_kinds[l] == "moe":
            mlp = MoEBlock(layer=l, router=softmax_router(reader, config, config, l), experts=store,
                           shared=None, shared_gate=None)
        else:
            mlp = DenseMLP(glu(reader, (f"{p}mlp.",), H, config.intermediate_size))
        layers.append(pre_norm_layer(reader, p, H, mixer, mlp))
    embed, lm_head = embeddings(reader, config.vocab_size, H, config.tie_word_embeddings)
    return assemble_model(reader, config, layers, CacheLayout(row_widths, recurrent_shapes), store, embed, lm_head)
