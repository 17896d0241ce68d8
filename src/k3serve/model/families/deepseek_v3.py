"""DeepSeek-V3 and Kimi K2 (`model_type: deepseek_v3` or `kimi_k2`): MLA with RoPE, grouped sigmoid routing with a
selection-only bias, and shared experts.

Layers 0 .. first_k_dense_replace-1 have a dense SiLU-GLU MLP, the rest a MoE. RoPE rotates only the decoupled
DR dims; the released weights use the interleaved pair layout (`rope_interleave`, absent from released configs,
which transformers takes as true). Long-context checkpoints use YaRN, which also scales the softmax by mscale^2.
Tensor names (prefix `model.layers.{l}.`):
    self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj};
    mlp.gate.weight [NE, H], mlp.gate.e_score_correction_bias [NE], mlp.experts.{e}.{gate,up,down}_proj.weight,
    mlp.shared_experts.{gate,up,down}_proj.weight (width n_shared_experts * moe_intermediate_size);
    dense: mlp.{gate,up,down}_proj.weight. Multi-token-prediction layers (index >= num_hidden_layers) are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from k3serve.model.families.build import (MLA_INNER_NORM_EPS, check_supported_basics, common_keys, embeddings,
                                          expert_reader, glu)
from k3serve.model.cache import CacheLayout
from k3serve.model.families.decoder import DecoderConfig, FamilyModel, assemble_model, pre_norm_layer
from k3serve.model.families.experts import ExpertStore
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.latent_attention import LatentAttention, LatentAttentionWeights
from k3serve.model.families.moe import DenseMLP, GLUWeights, GroupedSigmoidRouter, MoEBlock
from k3serve.model.families.rope import Rotary, rope_parameters, rotary_from_config, yarn_mscale
from k3serve.model.families.tensors import TensorReader
from k3serve.model.weights import fuse_rows


@dataclass(frozen=True)
class MLAConfig:
    """The latent-attention and grouped-routing settings DeepSeek-V3 and Kimi Linear share."""

    num_attention_heads: int  # NA
    q_lora_rank: int | None  # QL
    kv_lora_rank: int  # KL
    qk_nope_head_dim: int  # DN
    qk_rope_head_dim: int  # DR
    v_head_dim: int  # DV
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_expert_group: int
    topk_group: int


def read_mla_config(config: HFConfig, single_group_when_absent: bool = False) -> dict:
    """`single_group_when_absent`: a missing n_group / topk_group means one group (plain top-k), as transformers'
    Kimi Linear assumes; DeepSeek-V3 configs must state them."""
    if single_group_when_absent and not config.has("n_group", "num_expert_group"):
        groups = {"num_expert_group": 1, "topk_group": config.optional("topk_group", 1)}
    else:
        groups = {"num_expert_group": config.integer("n_group", "num_expert_group"),
                  "topk_group": config.integer("topk_group")}
    values = dict(
        num_attention_heads=config.integer("num_attention_heads"),
        q_lora_rank=config.optional_integer("q_lora_rank"),
        kv_lora_rank=config.integer("kv_lora_rank"),
        qk_nope_head_dim=config.integer("qk_nope_head_dim"),
        qk_rope_head_dim=config.integer("qk_rope_head_dim"),
        v_head_dim=config.integer("v_head_dim"),
        # released names first, then the names transformers' save_pretrained writes for Kimi Linear
        num_experts=config.integer("n_routed_experts", "num_experts", "num_local_experts"),
        num_experts_per_token=config.integer("num_experts_per_tok", "num_experts_per_token"),
        num_shared_experts=config.integer("n_shared_experts", "num_shared_experts", minimum=0),
        moe_intermediate_size=config.integer("moe_intermediate_size"),
        intermediate_size=config.integer("intermediate_size"),
        routed_scaling_factor=config.number("routed_scaling_factor"),
        norm_topk_prob=config.boolean("norm_topk_prob", "moe_renormalize"),
        **groups,
    )
    if values["num_experts"] % values["num_expert_group"]:
        raise config.error(f"{values['num_experts']} experts do not split into {values['num_expert_group']} groups")
    if values["num_expert_group"] > 1 and values["num_experts"] // values["num_expert_group"] < 2:
        raise config.error("grouped routing scores each group by its 2 best experts: groups need >= 2 experts")
    if values["topk_group"] > values["num_expert_group"]:
        raise config.error(f"topk_group {values['topk_group']} > n_group {values['num_expert_group']}")
    # released configs name the router's scoring; only the sigmoid, bias-corrected router is implemented
    config.require_value("scoring_func", ("sigmoid",), value_when_absent="sigmoid")
    config.require_value("moe_router_activation_func", ("sigmoid",), value_when_absent="sigmoid")
    config.require_value("topk_method", ("noaux_tc",), value_when_absent="noaux_tc")
    config.require_value("moe_layer_freq", (1,), value_when_absent=1)
    return values


@dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig, MLAConfig):
    rope: dict[str, Any]
    rope_interleave: bool
    max_position_embeddings: int | None

    @classmethod
    def from_hf(cls, config: HFConfig) -> DeepseekV3Config:
        check_supported_basics(config)
        common = common_keys(config)
        L = common["num_layers"]
        first_dense = config.integer("first_k_dense_replace", minimum=0)
        rope = rope_parameters(config)
        if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("mscale_all_dim") and "factor" not in rope:
            raise config.error("YaRN with mscale_all_dim needs rope 'factor'")
        return cls(model_type=config.get("model_type"), **common, **read_mla_config(config),
                   layer_kinds=("mla",) * L, mlp_kinds=tuple("dense" if l < first_dense else "moe" for l in range(L)),
                   rope=rope,
                   # absent from the released DeepSeek-V3 and Kimi K2 configs; transformers' default
                   rope_interleave=bool(config.optional("rope_interleave", True)),
                   max_position_embeddings=config.optional("max_position_embeddings", None))

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope_type = self.rope.get("rope_type", self.rope.get("type", "default"))
        if rope_type != "default" and self.rope.get("mscale_all_dim"):
            mscale = yarn_mscale(float(self.rope["factor"]), float(self.rope["mscale_all_dim"]))
            scale *= mscale * mscale
        return scale


def build_mla(reader: TensorReader, config: DecoderConfig, mla: MLAConfig, layer: int, rotary: Rotary | None,
              scale: float) -> LatentAttention:
    NA, QL, KL = mla.num_attention_heads, mla.q_lora_rank, mla.kv_lora_rank
    DN, DR, DV, H = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, config.hidden_size
    a = f"model.layers.{layer}.self_attn."
    kv_a = reader.matrix(f"{a}kv_a_proj_with_mqa.weight", shape=(KL + DR, H))
    if QL is None:
        in_proj = fuse_rows([reader.matrix(f"{a}q_proj.weight", shape=(NA * (DN + DR), H)), kv_a])
        q_a_norm = q_b = None
    else:
        in_proj = fuse_rows([reader.matrix(f"{a}q_a_proj.weight", shape=(QL, H)), kv_a])
        q_a_norm = reader.f32(f"{a}q_a_layernorm.weight", shape=(QL,))
        q_b = reader.matrix(f"{a}q_b_proj.weight", shape=(NA * (DN + DR), QL))
    # a GGUF's Q8_0 attn_k_b / attn_v_b (or a store packed from one) stay Q8_0, per head, as llama.cpp holds them
    k_b = reader.q8_0(f"{a}kv_b_proj.k_b", shape=(NA * KL, DN))
    v_b = reader.q8_0(f"{a}kv_b_proj.v_b", shape=(NA * DV, KL)) if k_b is not None else None
    if k_b is not None and v_b is not None:
        w_uk, w_uv = k_b, v_b
    else:
        kv_b = reader.f32(f"{a}kv_b_proj.weight", shape=(NA * (DN + DV), KL)).reshape(NA, DN + DV, KL)
        w_uk, w_uv = np.ascontiguousarray(kv_b[:, :DN]), np.ascontiguousarray(kv_b[:, DN:])
    weights = LatentAttentionWeights(
        in_proj=in_proj, q_a_norm=q_a_norm, q_b=q_b,
        kv_a_norm=reader.f32(f"{a}kv_a_layernorm.weight", shape=(KL,)),
        w_uk=w_uk, w_uv=w_uv,
        o_proj=reader.matrix(f"{a}o_proj.weight", shape=(H, NA * DV)),
    )
    return LatentAttention(layer=layer, weights=weights, num_heads=NA, q_lora_rank=QL, kv_lora_rank=KL, nope_dim=DN,
                           rope_dim=DR, value_dim=DV, scale=scale, rotary=rotary, norm_eps=MLA_INNER_NORM_EPS)


def build_grouped_moe(reader: TensorReader, config: DecoderConfig, mla: MLAConfig, layer: int, prefix: str,
                      store: ExpertStore) -> MoEBlock:
    H, NE = config.hidden_size, mla.num_experts
    router = GroupedSigmoidRouter(
        weight=reader.f32(f"{prefix}gate.weight", shape=(NE, H)),
        bias=reader.f32(f"{prefix}gate.e_score_correction_bias", shape=(NE,)),
        top_k=mla.num_experts_per_token, num_groups=mla.num_expert_group, topk_group=mla.topk_group,
        normalize=mla.norm_topk_prob, scaling_factor=mla.routed_scaling_factor)
    shared: GLUWeights | None = None
    if mla.num_shared_experts:
        shared = glu(reader, (f"{prefix}shared_experts.",), H, mla.num_shared_experts * mla.moe_intermediate_size)
    return MoEBlock(layer=layer, router=router, experts=store, shared=shared, shared_gate=None)


def build(config: DeepseekV3Config, reader: TensorReader, precision: str, chunk_size: int | None) -> FamilyModel:
    H = config.hidden_size
    rotary = rotary_from_config(config.rope, config.qk_rope_head_dim, config.max_position_embeddings,
                                interleaved=config.rope_interleave, where=f"{reader.path} ({config.model_type})")
    store = ExpertStore(expert_reader(reader, lambda l: f"model.layers.{l}.mlp.",
                                      ("gate_proj", "up_proj", "down_proj"), H, config.moe_intermediate_size),
                        precision, config.num_experts)
    layers, row_widths, recurrent_shapes = [], {}, {}
    for l in range(config.num_layers):
        p = f"model.layers.{l}."
        mixer = build_mla(reader, config, config, l, rotary, config.softmax_scale)
        row_widths[l] = mixer.row_width
        if config.mlp_kinds[l] == "moe":
            mlp: MoEBlock | DenseMLP = build_grouped_moe(reader, config, config, l, f"{p}mlp.", store)
        else:
            mlp = DenseMLP(glu(reader, (f"{p}mlp.",), H, config.intermediate_size))
        layers.append(pre_norm_layer(reader, p, H, mixer, mlp))
    embed, lm_head = embeddings(reader, config.vocab_size, H, config.tie_word_embeddings)
    return assemble_model(reader, config, layers, CacheLayout(row_widths, recurrent_shapes), store, embed, lm_head)
