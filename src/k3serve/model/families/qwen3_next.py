"""Qwen3-Next (`model_type: qwen3_next`): gated DeltaNet and gated full attention, MoE with a gated shared expert.

- `layer_types` (or, in released configs, every `full_attention_interval`-th layer) marks full attention; the
  others are gated DeltaNet (see `delta.py`).
- Full attention is Qwen3-MoE's GQA with partial RoPE (first partial_rotary_factor * hd dims) and a sigmoid output
  gate: q_proj yields [q_h | gate_h] per head (see `attention.py`).
- Its RMSNorms (input, post-attention, final, q_norm, k_norm) compute x_hat * (1 + w) with w stored zero-centred;
  1 is added to w at load. The DeltaNet output norm is a plain x_hat * w.
- MoE: softmax top-k routing plus a shared expert scaled by sigmoid(shared_expert_gate x).
Tensor names (prefix `model.layers.{l}.`): linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, out_proj}.weight,
linear_attn.{dt_bias, A_log} [NVH], linear_attn.norm.weight [Dv]; self_attn.* as Qwen3-MoE; mlp.gate.weight,
mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.shared_expert.{gate,up,down}_proj.weight,
mlp.shared_expert_gate.weight [1, H]. The multi-token-prediction tensors (`mtp.*`) are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.families.build import check_supported_basics, common_keys, embeddings, expert_reader, glu
from k3serve.model.cache import CacheLayout
from k3serve.model.families.decoder import DecoderConfig, DecoderLayer, FamilyModel
from k3serve.model.families.delta import GatedDeltaNet, GatedDeltaWeights
from k3serve.model.families.experts import ExpertStore
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.moe import DenseMLP, MoEBlock
from k3serve.model.families.qwen3_moe import GQAConfig, build_gqa, read_gqa_config, softmax_router, sparse_layers
from k3serve.model.families.rope import rotary_from_config
from k3serve.model.families.tensors import TensorReader
from k3serve.model.weights import fuse_rows, take_rows

_LAYER_TYPES = {"full_attention": "attention", "linear_attention": "gated_deltanet"}


@dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig, GQAConfig):
    linear_conv_kernel_dim: int
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    linear_num_key_heads: int  # NKH
    linear_num_value_heads: int  # NVH
    shared_expert_intermediate_size: int

    @classmethod
    def from_hf(cls, config: HFConfig) -> Qwen3NextConfig:
        check_supported_basics(config)
        common = common_keys(config)
        L = common["num_layers"]
        if config.has("layer_types"):
            types = config.get("layer_types")
            if not isinstance(types, list) or len(types) != L or any(t not in _LAYER_TYPES for t in types):
                raise config.error(f"layer_types must list {L} entries among {sorted(_LAYER_TYPES)}")
            kinds = tuple(_LAYER_TYPES[t] for t in types)
        else:
            interval = config.integer("full_attention_interval")
            kinds = tuple("attention" if (l + 1) % interval == 0 else "gated_deltanet" for l in range(L))
        key_heads, value_heads = config.integer("linear_num_key_heads"), config.integer("linear_num_value_heads")
        if value_heads % key_heads:
            raise config.error(f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads "
                               f"{key_heads}")
        return cls(model_type=config.get("model_type"), **common, **read_gqa_config(config), layer_kinds=kinds,
                   mlp_kinds=sparse_layers(config, L),
                   linear_conv_kernel_dim=config.integer("linear_conv_kernel_dim", minimum=2),
                   linear_key_head_dim=config.integer("linear_key_head_dim"),
                   linear_value_head_dim=config.integer("linear_value_head_dim"),
                   linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                   shared_expert_intermediate_size=config.integer("shared_expert_intermediate_size"))


def build_gated_deltanet(reader: TensorReader, config: Qwen3NextConfig, layer: int,
                         chunk_size: int | None) -> GatedDeltaNet:
    NKH, NVH = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv, K, H = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim, \
        config.hidden_size
    group = NVH // NKH
    a = f"model.layers.{layer}.linear_attn."
    # the checkpoint lays rows out per key-head group: [q Dk | k Dk | v group*Dv | z group*Dv] and [b group | a
    # group]; regrouped here to [q | k | v | z | b | a] so that one slice per part serves every head. The rows are
    # picked from the matrices as held (`reader.matrix`: bf16 bits, or Q8_0 blocks from a Q8_0 GGUF or at a
    # quantized trunk precision, whose rows quantize alone), so the biggest trunk matrix of the layer is no longer
    # widened to float32 or left bf16 beside a Q8_0 trunk
    width = 2 * Dk + 2 * group * Dv
    qkvz = reader.matrix(f"{a}in_proj_qkvz.weight", shape=(NKH * width, H))
    ba = reader.matrix(f"{a}in_proj_ba.weight", shape=(NKH * 2 * group, H))
    bounds = np.cumsum([0, Dk, Dk, group * Dv, group * Dv])
    heads = np.arange(NKH)[:, None]
    order = [(heads * width + np.arange(bounds[i], bounds[i + 1])).reshape(-1) for i in range(4)]
    ba_rows = NKH * width + heads * 2 * group
    order += [(ba_rows + np.arange(group)).reshape(-1), (ba_rows + group + np.arange(group)).reshape(-1)]
    C = 2 * NKH * Dk + NVH * Dv
    weights = GatedDeltaWeights(
        in_proj=take_rows(fuse_rows([qkvz, ba]), np.concatenate(order)),
        conv=np.ascontiguousarray(reader.f32(f"{a}conv1d.weight", shape=(C, 1, K))[:, 0, :]),
        a_exp=np.exp(reader.f32(f"{a}A_log", shape=(NVH,))).astype(np.float32),
        dt_bias=reader.f32(f"{a}dt_bias", shape=(NVH,)),
        norm=reader.f32(f"{a}norm.weight", shape=(Dv,)),
        out_proj=reader.matrix(f"{a}out_proj.weight", shape=(H, NVH * Dv)),
    )
    return GatedDeltaNet(layer=layer, weights=weights, num_key_heads=NKH, num_value_heads=NVH, key_dim=Dk,
                         value_dim=Dv, eps=config.rms_norm_eps, chunk_size=chunk_size)


def build(config: Qwen3NextConfig, reader: TensorReader, precision: str, chunk_size: int | None) -> FamilyModel:
    H = config.hidden_size
    one = np.float32(1.0)  # x_hat * (1 + w) norms
    rotary = rotary_from_config(config.rope, config.rotary_dim, config.max_position_embeddings,
                                interleaved=False, where=f"{reader.path} (qwen3_next)")
    store = ExpertStore(expert_reader(reader, lambda l: f"model.layers.{l}.mlp.",
                                      ("gate_proj", "up_proj", "down_proj"), H, config.moe_intermediate_size),
                        precision, config.num_experts)
    layers, row_widths, recurrent_shapes = [], {}, {}
    for l in range(config.num_layers):
        p = f"model.layers.{l}."
        if config.layer_kinds[l] == "attention":
            mixer = build_gqa(reader, config, config, l, rotary, gated=True, norm_offset=1.0)
            row_widths[l] = mixer.row_width
        else:
            mixer = build_gated_deltanet(reader, config, l, chunk_size)
            recurrent_shapes[l] = mixer.state_shapes()
        if config.mlp_kinds[l] == "moe":
            mlp = MoEBlock(layer=l, router=softmax_router(reader, config, config, l), experts=store,
                           shared=glu(reader, (f"{p}mlp.shared_expert.",), H, config.shared_expert_intermediate_size),
                           shared_gate=reader.f32(f"{p}mlp.shared_expert_gate.weight", shape=(1, H)))
        else:
            mlp = DenseMLP(glu(reader, (f"{p}mlp.",), H, config.intermediate_size))
        layers.append(DecoderLayer(
            input_norm=reader.f32(f"{p}input_layernorm.weight", shape=(H,)) + one,
            post_attention_norm=reader.f32(f"{p}post_attention_layernorm.weight", shape=(H,)) + one,
            mixer=mixer, mlp=mlp))
    embed, lm_head = embeddings(reader, config.vocab_size, H, config.tie_word_embeddings)
    return FamilyModel(config, embed, layers, reader.f32("model.norm.weight", shape=(H,)) + one, lm_head,
                       CacheLayout(row_widths, recurrent_shapes), store)
